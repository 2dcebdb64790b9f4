"""FP8 activations made in one pass with what produces them: the inputs of the DiT's low-precision GEMMs.

A quantized GEMM takes its activations as FP8 E4M3 values with one float32 scale per token
(`gemm.quantize_activations`). Computed apart, the quantization reads the activations twice (the row's amax, then the
values) after the producer wrote them: on a Krea 2 block at 4224 tokens the profile shows ~95 us for RMSNorm +
modulation + quantization and ~225 us for SwiGLU + quantization (NOTES.md, session 5), several passes over tensors of
52-277 MB. Here each row is read once, kept in registers, and written once as FP8:

- `modulated_rms_norm_fp8`: `(1 + scale) * rmsnorm(x) + shift` (the DiT's adaptive norm before attention and SwiGLU);
  `modulated_layer_norm_fp8`: FLUX.1's, with LayerNorm.
- `swiglu_fp8`: `silu(gate) * up` from the stacked gate/up product (the input of SwiGLU's down projection).
- `tokens_fp8`: a tensor as it is (SwiGLU's output where the GEMM epilogue computed it).
- `sigmoid_gated_fp8`: `out * sigmoid(gate)`, the attention output under its gate (the input of the output
  projection), with the gate read in place from the stacked Q/K/V/gate product.

Each computes what the models compute, in their order and rounding (float32 norm cast to x's dtype; modulation in x's
dtype; SwiGLU rounded as PyTorch rounds it), then `gemm.quantize_activations`' rule. `backend="reference"` is that
composition in jnp (what runs off the GPU, and what the tests compare the kernel with); `backend="triton"` the Pallas
kernel (Triton lowering: a program per row, or per few rows one after the other, `ROWS_PER_PROGRAM`; rows that
a power-of-two chunk of 16 to 2048 values divides).

The kernels' codes are those of the composition (values times the scale's reciprocal, `reciprocal_products`), as
the GPU tier measured on an H100 at Krea 2's 4224 x 6144 (`tests/test_gpu_kernels.py`): `tokens_fp8`, `swiglu_fp8`
and `sigmoid_gated_fp8` equal to XLA's composition on the CPU bit for bit (the sigmoid's approximation may in
principle flip a code at a bf16 tie); the adaptive norms equal to XLA's composition on the GPU in every scale and
all but 2e-7 of the codes (on the CPU XLA sums a row's squares in another order: scales an ulp apart). XLA's own
SwiGLU and gate on the GPU keep bf16 intermediates in float32 (its default excess precision), so they differ from
both by code flips at FP8 rounding boundaries, each within a step. Times: the norm at 4224 x 6144 in about half the
composition's, SwiGLU at 4224 x 32768 in about 60% (NOTES.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .gemm import BLOCK_K, quantize_activations

FP8_MAX = 448.0
CHUNK = 2048  # the widest power of two a row is loaded in (Triton's loads take power-of-two sizes)
# Rows a program at most (`rows_per_program=None`: the largest power of two dividing the sequence up to this). The
# adaptive norm at Krea 2's 4224 x 6144 alone at the power cap (session 16, `probes/s16_norm.py`; each program reads
# the norm's vectors, 4x a row's bytes, so more rows a program read them fewer times): 49.4 / 43.3 / 40.7 / 39.5 /
# 38.8 / 60.7 us and 30.2 / 24.9 / 22.9 / 21.9 / 21.3 / 23.4 mJ at 1 / 2 / 4 / 8 / 16 / 32 rows (32: 132 programs,
# one wave, too few in flight); in the fp8 step (A B B A) 8 rows 0.1040 s against 0.1046-0.1047 with one, 32 0.1050.
# `tokens_fp8` and `sigmoid_gated_fp8`, which read no vectors, ran slower with more rows (alone at the cap: 58.3 /
# 63.3 / 68.3 / 68.8 us and 42.0 / 42.8 / 48.6 / 47.4 us at 1 / 2 / 4 / 8), and no faster with 4 or 16 warps.
ROWS_PER_PROGRAM = {"modulated_rms_norm_fp8": 8, "modulated_layer_norm_fp8": 8, "swiglu_fp8": 1, "tokens_fp8": 1,
                    "sigmoid_gated_fp8": 1}
# The adaptive norms' row loop loads row r + 1 before it works on row r (a program's rows otherwise wait for each
# load in turn: latency, not bandwidth, bounds a program of several rows). Alone at the cap (session 17, 8 rows,
# 4224 x 6144): 39.5 -> 35.4 us a call, the same codes and scales, the same energy (~22 mJ); the fp8 step A B B A
# showed no difference (0.10346 / 0.10333 / 0.10298 / 0.10266 s without / with / with / without).
NORM_PREFETCH = True


def kernel_takes_row(d: int) -> bool:
    """Whether the kernels take rows of d values: a power-of-two chunk of at least 16 must divide d."""
    return d % 16 == 0


def _chunk(d: int) -> int:
    if not kernel_takes_row(d):
        raise ValueError(f"row length {d} needs a power-of-two divisor of at least 16")
    c = CHUNK
    while d % c:
        c //= 2
    return c


def _round(x: jax.Array, dtype) -> jax.Array:
    """x rounded to `dtype` and back to float32: the rounding a model step in `dtype` applies."""
    return x.astype(dtype).astype(jnp.float32)


# The row kernels' sigmoid on the GPU: 1 / (1 + 2^(-x log2 e)) from `ex2.approx.ftz` and `rcp.approx.ftz`, as the
# GEMM epilogue's (`gemm._fast_sigmoid`; relative error ~2^-21 before the bf16 rounding the models apply). Triton
# lowers `1 / (1 + jnp.exp(-x))` to libdevice's expf and `div.full.f32` with their range handling: in SASS
# (NOTES.md, session 20) `sigmoid_gated_fp8` took 825 instructions a program (24 values a thread), 482 this way.
_SIGMOID_PTX = ("{ .reg .f32 e; mul.f32 e, $1, 0fBFB8AA3B; ex2.approx.ftz.f32 e, e; add.f32 e, e, 0f3F800000; "
                "rcp.approx.ftz.f32 $0, e; }")  # 0fBFB8AA3B: float32(-log2 e)


def ptx_f32(code: str, *args) -> jax.Array:
    """Inline PTX inside a Triton kernel, a float32 result a value: `code` reads $1... (args, float32, broadcast to
    the first one's shape) and writes $0."""
    from jax.experimental.pallas import triton as pltriton

    shape = args[0].shape
    return pltriton.elementwise_inline_asm(
        code, args=[jnp.broadcast_to(a, shape) for a in args], constraints="=r" + ",r" * len(args), pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.float32)])[0]


def _sigmoid(x: jax.Array, interpret: bool) -> jax.Array:
    """sigmoid(x) of float32 x in a row kernel: the exact expression in interpret mode, `_SIGMOID_PTX` on the GPU."""
    if interpret:
        return 1.0 / (1.0 + jnp.exp(-x))
    return ptx_f32(_SIGMOID_PTX, x)


# --------------------------------------------------------------------------------------------------------------------
# The definitions


def modulated_rms_norm(x, norm_weight, scale, shift, eps: float):
    """What the models compute: RMSNorm in float32 with the zero-centred weight, cast to x's dtype, then
    `(1 + scale) * norm + shift` in x's dtype. x (batch, seq, d); scale, shift (batch, 1, d)."""
    x32 = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    norm = (x32 * inv * (1.0 + norm_weight)).astype(x.dtype)
    return (1.0 + scale) * norm + shift


def modulated_layer_norm(x, scale, shift, eps: float):
    """FLUX.1's adaptive norm: LayerNorm without weight or bias in float32, cast to x's dtype, then
    `norm * (1 + scale) + shift` in x's dtype (`flux.layer_norm`'s arithmetic). Shapes as `modulated_rms_norm`."""
    x32 = x.astype(jnp.float32)
    centered = x32 - jnp.mean(x32, axis=-1, keepdims=True)
    norm = (centered * jax.lax.rsqrt(jnp.mean(centered * centered, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return norm * (1 + scale) + shift


def swiglu(gate_up: jax.Array) -> jax.Array:
    """`silu(gate) * up` of the stacked product [gate | up] along the last axis, rounded to its dtype after silu and
    after the product, each computed in float32: PyTorch's arithmetic for bf16 tensors (diffusers' model). XLA's bf16
    `jax.nn.silu` rounds differently (its logistic), so the models' unfused path agrees with this to bf16 rounding."""
    gate, up = jnp.split(gate_up.astype(jnp.float32), 2, axis=-1)
    silu = _round(gate * jax.nn.sigmoid(gate), gate_up.dtype)
    return (silu * up).astype(gate_up.dtype)


def sigmoid_gated(out: jax.Array, gate: jax.Array) -> jax.Array:
    """`out * sigmoid(gate)` rounded to out's dtype after the sigmoid and after the product, each in float32
    (PyTorch's arithmetic, as `swiglu`)."""
    g = _round(jax.nn.sigmoid(gate.astype(jnp.float32)), out.dtype)
    return (out.astype(jnp.float32) * g).astype(out.dtype)


def _quantized_rows(y: jax.Array) -> tuple[jax.Array, jax.Array]:
    lead = y.shape[:-1]
    values, scales = quantize_activations(y.reshape(-1, y.shape[-1]))
    return values.reshape(*lead, -1), scales.reshape(lead)


# --------------------------------------------------------------------------------------------------------------------
# The entry points


def modulated_rms_norm_fp8(x, norm_weight, scale, shift, eps: float, *, backend: str = "triton",
                           interpret: bool = False,
                           rows_per_program: int | None = None) -> tuple[jax.Array, jax.Array]:
    """`modulated_rms_norm` quantized to FP8 E4M3 per token: (values (batch, seq, d'), scales (batch, seq) float32),
    d' = d padded to a multiple of 128 with zeros (as `gemm.quantize_activations` gives the GEMM its input).
    x (batch, seq, d) in a 16- or 32-bit float; norm_weight (d,); scale, shift (batch, 1, d) or (1, 1, d).
    `rows_per_program`: rows a program runs through one after the other, the norm's vectors loaded once for them
    (a power of two dividing seq; None: `ROWS_PER_PROGRAM`'s, see there)."""
    if backend == "reference":
        return _quantized_rows(modulated_rms_norm(x, norm_weight, *_modulation(x, scale, shift), eps))
    return _modulated_norm_fp8("modulated_rms_norm_fp8", x, norm_weight, scale, shift, eps, False, backend, interpret,
                               rows_per_program)


def modulated_layer_norm_fp8(x, scale, shift, eps: float, *, backend: str = "triton", interpret: bool = False,
                             rows_per_program: int | None = None) -> tuple[jax.Array, jax.Array]:
    """`modulated_layer_norm` (FLUX.1) quantized to FP8 E4M3 per token; arguments and results as
    `modulated_rms_norm_fp8`'s, without a norm weight."""
    if backend == "reference":
        return _quantized_rows(modulated_layer_norm(x, *_modulation(x, scale, shift), eps))
    return _modulated_norm_fp8("modulated_layer_norm_fp8", x, None, scale, shift, eps, True, backend, interpret,
                               rows_per_program)


def _modulation(x, scale, shift):
    b, _, d = x.shape
    return jnp.broadcast_to(scale, (b, 1, d)), jnp.broadcast_to(shift, (b, 1, d))


def _modulated_norm_fp8(name, x, norm_weight, scale, shift, eps, centered: bool, backend, interpret,
                        rows_per_program: int | None):
    """The kernel of both adaptive norms: a row's mean subtracted first (`centered`: LayerNorm) or not (RMSNorm),
    scaled by `1 + norm_weight` (none: 1), modulated, quantized.

    Each program reads the norm's weight (float32), 1 + scale and the shift: 4 + 2 + 2 bytes a channel, four times
    the row's own bytes, from L2. At Krea 2's 4224 x 6144 that is ~200 MB a call against 52 MB of rows; the kernel
    takes 39-49 us where the rows alone would take ~20 from HBM. `rows_per_program` > 1 loads the vectors once and
    runs through its rows in a loop (`lax.fori_loop`; session 11's programs of several rows at once held all of them
    in registers and ran slower); see `ROWS_PER_PROGRAM` for what it measured."""
    _check_backend(backend)
    from jax.experimental import pallas as pl

    b, s, d = x.shape
    rows = _rows_per_program(name, s, rows_per_program)
    scale, shift = _modulation(x, scale, shift)
    c, dtype = _chunk(d), x.dtype
    n_chunks = d // c
    weight = jnp.ones((1, d), jnp.float32) if norm_weight is None else (1.0 + norm_weight.astype(jnp.float32))
    weight = weight.reshape(1, d)
    # 1 + scale as the model rounds it (in x's dtype), once here instead of in every row
    one_plus = (1.0 + scale).astype(dtype).reshape(b, d)
    shift = shift.reshape(b, d)

    def kernel(x_ref, w_ref, a_ref, sh_ref, q_ref, s_ref):
        vectors = [[None if ref is None else ref[:, pl.ds(i * c, c)] for i in range(n_chunks)]
                   for ref in (None if norm_weight is None else w_ref, a_ref, sh_ref)]  # LayerNorm: no weight

        def load(r):
            return [x_ref[r, pl.ds(i * c, c)] for i in range(n_chunks)]  # (1, c) each

        def row(r, loaded):
            chunks = [v.astype(jnp.float32) for v in loaded]
            if centered:
                mean = sum(jnp.sum(v) for v in chunks) / d
                chunks = [v - mean for v in chunks]
            ss = sum(jnp.sum(v * v) for v in chunks)
            inv = jax.lax.rsqrt(ss / d + eps)
            ys, amax = [], jnp.float32(0.0)
            for v, w, a, sh in zip(chunks, *vectors):
                norm = _round(v * inv if norm_weight is None else v * inv * w, dtype)
                y = _round(a.astype(jnp.float32) * norm, dtype)
                y = _round(y + sh.astype(jnp.float32), dtype)
                ys.append(y)
                amax = jnp.maximum(amax, jnp.max(jnp.abs(y)))
            _store_fp8_row(ys, amax, c, q_ref, s_ref, r, interpret=interpret)

        if NORM_PREFETCH:
            _for_each_row(rows, row, load)
        else:
            _for_each_row(rows, lambda r: row(r, load(r)))

    specs = [_row_spec(d, rows), _vec_spec(d, batched=False), _vec_spec(d), _vec_spec(d)]
    return _row_call(name, kernel, b, s, d, interpret, specs, x, weight, one_plus, shift, rows=rows)


def swiglu_fp8(gate_up: jax.Array, *, backend: str = "triton", interpret: bool = False,
               rows_per_program: int | None = None) -> tuple[jax.Array, jax.Array]:
    """`swiglu(gate_up)` quantized to FP8 E4M3 per token: gate_up (batch, seq, 2h) -> (values (batch, seq, h'),
    scales (batch, seq) float32), h' = h padded to a multiple of 128 (see `modulated_rms_norm_fp8`)."""
    b, s, d2 = gate_up.shape
    h = d2 // 2
    if backend == "reference":
        return _quantized_rows(swiglu(gate_up))
    _check_backend(backend)
    c, dtype = _chunk(h), gate_up.dtype
    n_chunks = h // c
    rows = _rows_per_program("swiglu_fp8", s, rows_per_program)
    from jax.experimental import pallas as pl

    def kernel(gu_ref, q_ref, s_ref):
        def row(r):
            ys, amax = [], jnp.float32(0.0)
            for i in range(n_chunks):
                g = gu_ref[r, pl.ds(i * c, c)].astype(jnp.float32)
                u = gu_ref[r, pl.ds(h + i * c, c)].astype(jnp.float32)
                y = _round(_round(g * _sigmoid(g, interpret), dtype) * u, dtype)  # as `swiglu`
                ys.append(y)
                amax = jnp.maximum(amax, jnp.max(jnp.abs(y)))
            _store_fp8_row(ys, amax, c, q_ref, s_ref, r, interpret=interpret)

        _for_each_row(rows, row)

    return _row_call("swiglu_fp8", kernel, b, s, h, interpret, [_row_spec(d2, rows)], gate_up, rows=rows)


def tokens_fp8(y: jax.Array, *, backend: str = "triton", interpret: bool = False,
               rows_per_program: int | None = None) -> tuple[jax.Array, jax.Array]:
    """y (batch, seq, d) quantized to FP8 E4M3 per token in one pass (each row read once): the input of SwiGLU's
    down projection when the gate/up GEMM applied SwiGLU in its epilogue (`gemm.swiglu_weight`). Returns as the
    others; the values and scales of `gemm.quantize_activations`."""
    b, s, d = y.shape
    if backend == "reference":
        return _quantized_rows(y)
    _check_backend(backend)
    c = _chunk(d)
    rows = _rows_per_program("tokens_fp8", s, rows_per_program)
    from jax.experimental import pallas as pl

    def kernel(y_ref, q_ref, s_ref):
        def row(r):
            ys = [y_ref[r, pl.ds(i * c, c)].astype(jnp.float32) for i in range(d // c)]
            _store_fp8_row(ys, functools.reduce(jnp.maximum, [jnp.max(jnp.abs(v)) for v in ys]), c, q_ref, s_ref, r,
                           interpret=interpret)

        _for_each_row(rows, row)

    return _row_call("tokens_fp8", kernel, b, s, d, interpret, [_row_spec(d, rows)], y, rows=rows)


def sigmoid_gated_fp8(out: jax.Array, stacked: jax.Array, gate_offset: int, *, backend: str = "triton",
                      interpret: bool = False, rows_per_program: int | None = None) -> tuple[jax.Array, jax.Array]:
    """`sigmoid_gated(out, gate)` quantized to FP8 E4M3 per token, gate = stacked[..., gate_offset:gate_offset + d]:
    out (batch, seq, d); stacked (batch, seq, n) the product the gate is a slice of (read in place: a slice handed
    to a kernel would be copied first). Returns (values (batch, seq, d'), scales (batch, seq)) as the others."""
    b, s, d = out.shape
    if stacked.shape[:2] != (b, s) or gate_offset + d > stacked.shape[2]:
        raise ValueError(f"sigmoid_gated_fp8: the gate [{gate_offset}, {gate_offset + d}) does not fit in the stacked "
                         f"product of shape {stacked.shape} for an output of shape {out.shape}")
    if backend == "reference":
        return _quantized_rows(sigmoid_gated(out, stacked[..., gate_offset:gate_offset + d]))
    _check_backend(backend)
    c, dtype = _chunk(d), out.dtype
    n_chunks = d // c
    rows = _rows_per_program("sigmoid_gated_fp8", s, rows_per_program)
    from jax.experimental import pallas as pl

    def kernel(out_ref, stacked_ref, q_ref, s_ref):
        def row(r):
            ys, amax = [], jnp.float32(0.0)
            for i in range(n_chunks):
                o = out_ref[r, pl.ds(i * c, c)].astype(jnp.float32)
                g = stacked_ref[r, pl.ds(gate_offset + i * c, c)].astype(jnp.float32)
                y = _round(o * _round(_sigmoid(g, interpret), dtype), dtype)  # as `sigmoid_gated`
                ys.append(y)
                amax = jnp.maximum(amax, jnp.max(jnp.abs(y)))
            _store_fp8_row(ys, amax, c, q_ref, s_ref, r, interpret=interpret)

        _for_each_row(rows, row)

    return _row_call("sigmoid_gated_fp8", kernel, b, s, d, interpret,
                     [_row_spec(d, rows), _row_spec(stacked.shape[2], rows)], out, stacked, rows=rows)


# --------------------------------------------------------------------------------------------------------------------
# Shared kernel parts


def _check_backend(backend: str) -> None:
    if backend != "triton":  # "reference" returned before
        raise ValueError(f"backend must be 'triton' or 'reference', got {backend!r}")


def _rows_per_program(name: str, s: int, rows: int | None) -> int:
    """The rows a program of kernel `name` runs through: `rows`, or by default the largest power of two dividing
    the sequence length s up to `ROWS_PER_PROGRAM[name]`."""
    if rows is None:
        rows = ROWS_PER_PROGRAM[name]
        while s % rows:
            rows //= 2
    if rows < 1 or rows & (rows - 1) or s % rows:
        raise ValueError(f"{name}: rows_per_program {rows} must be a power of two dividing the sequence length {s}")
    return rows


def _for_each_row(rows: int, row, load=None) -> None:
    """`row(r)` for each of a program's rows: r a slice of its block; a loop over them where there are several (the
    program's vectors, loaded before, then stay in registers). With `load`: `row(r, load(r))`, and in the loop row
    r + 1's loads are issued before row r's work (the loop carries them; the last iteration loads its own row again
    instead of one past the block)."""
    from jax.experimental import pallas as pl

    if rows == 1:
        if load is None:
            row(slice(None))
        else:
            row(slice(None), load(slice(None)))
        return

    def body(r, loaded):
        one = pl.ds(r, 1)  # (a slice of one, not an integer: interpret mode's loads take only slices)
        if load is None:
            row(one)
            return loaded
        following = load(pl.ds(jnp.minimum(r + 1, rows - 1), 1))
        row(one, loaded)
        return following

    jax.lax.fori_loop(0, rows, body, 0 if load is None else load(pl.ds(0, 1)))


def _store_fp8_row(ys, amax, c, q_ref, s_ref, row=slice(None), *, interpret: bool = False):
    """`gemm._fp8_e4m3_rows`' rule for one row held as chunks: scale amax * float32(1 / 448) (1 for a zero row; NaN
    for a row holding NaN or Inf, whose values then mean nothing), values times its reciprocal. `row`: which of the
    program's rows (all: its only one). On the GPU `reciprocal_products`; the E4M3 conversion saturates at 448."""
    from jax.experimental import pallas as pl

    finite = amax <= np.float32(np.finfo(np.float32).max)  # False for Inf and NaN
    step = jnp.where(amax > 0, amax * np.float32(1.0 / FP8_MAX), 1.0)
    if interpret:
        qs = [jnp.clip(y * (1.0 / step), -FP8_MAX, FP8_MAX) for y in ys]
    else:
        qs = reciprocal_products(ys, step)
    for i, q in enumerate(qs):
        q_ref[row, pl.ds(i * c, c)] = jnp.where(finite, q, 0.0).astype(q_ref.dtype)
    s_ref[row, :] = jnp.where(finite, step, jnp.nan).reshape(1, 1)


# Quantization multiplies by the scale's reciprocal (rounded once) rather than dividing by the scale: XLA rewrites a
# division by a broadcast scale or a constant into exactly that multiplication on every backend, so the jnp
# definitions spell it out (`gemm.quantize_activations`, `quant.formats`, the attention's references) and the
# kernels compute the same here: one `rcp.rn.f32` a row (Triton's own `/` is the approximate `div.full.f32`) and a
# `mul.rn.f32` a value. Every path then gives the same codes; IEEE division would differ from XLA's at rare ties.
_PRODUCT_PTX = "mul.rn.f32 $0, $1, $2;"
_ROUNDED_PRODUCT_PTX = "{ .reg .f32 q; mul.rn.f32 q, $1, $2; cvt.rni.f32.f32 $0, q; }"  # ties to even, as jnp.round


def reciprocal_products(ys, step, *, round_to_integer: bool = False):
    """[y * (1 / step) for y in ys], the reciprocal correctly rounded, each product rounded once (then to the nearest
    integer, ties to even: `round_to_integer`), inside a Triton kernel. step: one float32 for all of ys (a row's, a
    block's), or an array that broadcasts against each y (a step a channel: (1, d))."""
    step = jnp.reshape(step, (1, 1)) if jnp.ndim(step) < 2 else step
    reciprocal = ptx_f32("rcp.rn.f32 $0, $1;", step)
    code = _ROUNDED_PRODUCT_PTX if round_to_integer else _PRODUCT_PTX
    return [ptx_f32(code, y, reciprocal) for y in ys]


def _row_spec(d: int, rows: int = 1):
    from jax.experimental import pallas as pl

    return pl.BlockSpec((None, rows, d), lambda bi, si: (bi, si, 0))


def _vec_spec(d: int, batched: bool = True):
    from jax.experimental import pallas as pl

    return pl.BlockSpec((1, d), (lambda bi, si: (bi, 0)) if batched else (lambda bi, si: (0, 0)))


def _row_call(name: str, kernel, b: int, s: int, d_out: int, interpret: bool, in_specs, *args, rows: int = 1):
    """A program per `rows` rows (batch, tokens) writing d_out FP8 values and a scale a row; `name`: the kernel's,
    in profiles (the entry point's)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    values, scales = pl.pallas_call(
        kernel,
        grid=(b, s // rows),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, rows, d_out), lambda bi, si: (bi, si, 0)),
                   pl.BlockSpec((None, rows, 1), lambda bi, si: (bi, si, 0))],
        out_shape=[jax.ShapeDtypeStruct((b, s, d_out), jnp.float8_e4m3fn),
                   jax.ShapeDtypeStruct((b, s, 1), jnp.float32)],
        # 8 warps: a row of up to 16384 values is ~64 float32 registers a thread
        compiler_params=pltriton.CompilerParams(num_warps=8, num_stages=1),
        interpret=interpret,
        name=name,
    )(*args)
    pad = (-d_out) % BLOCK_K  # the GEMM takes K padded to whole 128-blocks, as `quantize_activations` gives it
    return (jnp.pad(values, ((0, 0), (0, 0), (0, pad))) if pad else values), scales[..., 0]
