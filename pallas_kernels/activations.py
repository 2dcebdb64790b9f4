"""FP8 activations made in one pass with what produces them: the inputs of the DiT's low-precision GEMMs.

A quantized GEMM takes its activations as FP8 E4M3 values with one float32 scale per token
(`gemm.quantize_activations`). Computed apart, the quantization reads the activations twice (the row's amax, then the
values) after the producer wrote them: several passes over tensors of 52-277 MB on a Krea 2 block. Here each row is
read once, kept in registers, and written once as FP8:

- `modulated_rms_norm_fp8`: `(1 + scale) * rmsnorm(x) + shift` (the DiT's adaptive norm before attention and SwiGLU);
  `modulated_layer_norm_fp8`: FLUX.1's, with LayerNorm.
- `swiglu_fp8`: `silu(gate) * up` from the stacked gate/up product (the input of SwiGLU's down projection).
- `tokens_fp8`: a tensor as it is (SwiGLU's output where the GEMM epilogue computed it).
- `sigmoid_gated_fp8`: `out * sigmoid(gate)`, the attention output under its gate (the input of the output
  projection), with the gate read in place from the stacked Q/K/V/gate product.

Each computes what the models compute, in their order and rounding (float32 norm cast to x's dtype; modulation in x's
dtype; SwiGLU rounded as PyTorch rounds it), then `gemm.quantize_activations`' rule. `backend="reference"` is that
composition in jnp (what runs off the GPU, and what the tests compare the kernel with); `backend="triton"` the Pallas
kernel (Triton lowering: a program per row, or per few rows one after the other, `rows_per_program`, by default
`default_rows_per_program`'s; rows that a power-of-two chunk of 16 to 2048 values divides).

The kernels' codes are those of the composition (values times the scale's reciprocal, `reciprocal_products`), as
the GPU tier measured on an H100 at Krea 2's 4224 x 6144 (`tests/test_gpu_kernels.py`): `tokens_fp8`, `swiglu_fp8`
and `sigmoid_gated_fp8` equal to XLA's composition on the CPU bit for bit (the sigmoid's approximation may in
principle flip a code at a bf16 tie); the adaptive norms equal to XLA's composition on the GPU in every scale and
all but 2e-7 of the codes (on the CPU XLA sums a row's squares in another order: scales an ulp apart). XLA's own
SwiGLU and gate on the GPU keep bf16 intermediates in float32 (its default excess precision), so they differ from
both by code flips at FP8 rounding boundaries, each within a step. docs/kernels/fp8_rows.md has their times.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .numerics import (BLOCK_K, FP8_MAX, lowering_for_amd, ptx_f32, quantize_activations, reciprocal_products,
                       round_to, swiglu)

CHUNK = 2048  # the widest power of two a row is loaded in (Triton's loads take power-of-two sizes)


def default_rows_per_program(name: str, seq: int) -> int:
    """Rows a program of kernel `name` runs through by default: the largest power of two dividing the sequence
    length up to 8 for the adaptive norms (each program reads the norm's vectors, four times a row's bytes, so more
    rows a program read them fewer times; 16 and more leave too few programs in flight), 1 for the others, which
    read no vectors and measured slower with more (docs/kernels/fp8_rows.md)."""
    rows = 8 if name in ("modulated_rms_norm_fp8", "modulated_layer_norm_fp8") else 1
    while seq % rows:
        rows //= 2
    return rows


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


# The row kernels' sigmoid on the GPU: 1 / (1 + 2^(-x log2 e)) from `ex2.approx.ftz` and `rcp.approx.ftz`, as the
# GEMM epilogue's (`gemm.mosaic._fast_sigmoid`; relative error ~2^-21 before the bf16 rounding the models apply).
# Triton lowers `1 / (1 + jnp.exp(-x))` to libdevice's expf and `div.full.f32` with their range handling: about
# twice the instructions.
_SIGMOID_PTX = ("{ .reg .f32 e; mul.f32 e, $1, 0fBFB8AA3B; ex2.approx.ftz.f32 e, e; add.f32 e, e, 0f3F800000; "
                "rcp.approx.ftz.f32 $0, e; }")  # 0fBFB8AA3B: float32(-log2 e)


def _sigmoid(x: jax.Array, interpret: bool) -> jax.Array:
    """sigmoid(x) of float32 x in a row kernel: the exact expression in interpret mode and on AMD GPUs,
    `_SIGMOID_PTX` on NVIDIA GPUs."""
    if interpret or lowering_for_amd():
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


def sigmoid_gated(out: jax.Array, gate: jax.Array) -> jax.Array:
    """`out * sigmoid(gate)` rounded to out's dtype after the sigmoid and after the product, each in float32
    (PyTorch's arithmetic, as `swiglu`)."""
    g = round_to(jax.nn.sigmoid(gate.astype(jnp.float32)), out.dtype)
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
    (a power of two dividing seq; None: `default_rows_per_program`'s)."""
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
    takes about twice what the rows alone would take from HBM. `rows_per_program` > 1 loads the vectors once and
    runs through its rows in a loop (`lax.fori_loop`, loading row r + 1 before working on row r: latency, not
    bandwidth, bounds a program of several rows)."""
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
                norm = round_to(v * inv if norm_weight is None else v * inv * w, dtype)
                y = round_to(a.astype(jnp.float32) * norm, dtype)
                y = round_to(y + sh.astype(jnp.float32), dtype)
                ys.append(y)
                amax = jnp.maximum(amax, jnp.max(jnp.abs(y)))
            _store_fp8_row(ys, amax, c, q_ref, s_ref, r, interpret=interpret)

        _for_each_row(rows, row, load)

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
                y = round_to(round_to(g * _sigmoid(g, interpret), dtype) * u, dtype)  # as `swiglu`
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
                y = round_to(o * round_to(_sigmoid(g, interpret), dtype), dtype)  # as `sigmoid_gated`
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
    """The rows a program of kernel `name` runs through: `rows`, or `default_rows_per_program`'s."""
    if rows is None:
        rows = default_rows_per_program(name, s)
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
