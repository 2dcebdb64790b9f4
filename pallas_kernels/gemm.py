"""Block-scaled low-precision GEMM: `y = epilogue((x * sx) @ (w * sw)^T)` with x in FP8 or INT8 and w in FP8, MXFP8,
MXFP6, MXFP4 or INT8; float32 accumulation; bf16 output.

Three implementations of one definition, which `scaled_matmul_reference` states in plain jnp:

- `backend="mosaic"`: Mosaic GPU for Hopper (wgmma with FP8 operands straight from shared memory, TMA loads in a
  warp-specialized pipeline: one memory warpgroup, two compute warpgroups; a persistent grid over output tiles).
- `backend="triton"`: Pallas' Triton lowering, the portable path (also the code for ROCm): FP8 and INT8 dots, MX
  weights unpacked and scaled inside the kernel.
- `backend="reference"`: dequantize both operands to float32 and multiply (what the tests compare against).

Scaling (`../shared/reference/formats_and_kernels.md`, DeepGEMM's recipe):
- Activations: FP8 E4M3 with one float32 scale per token (`x_scaling="token"`) or per token and 128-wide K block
  (`"block"`, 1x128), quantized by `quantize_activations` (one XLA fusion over x); INT8 per token for INT8 weights.
- Weights: one scale per output channel (fp8, int8), or per output channel and 128-wide K block. With block scales
  anywhere, the kernel promotes: each 128-wide K block's product is accumulated on its own and added into the float32
  accumulator as `acc += s * partial`, which also keeps FP8 wgmma's short accumulator (~14 significant bits) from
  seeing a long sum. `s` holds only the scales that vary along K (sx[m] for 1x128 activations, sw[n] for 128-blocked
  weights): the promotion's arithmetic was the kernel's limit, and the constant side costs nothing in the epilogue.
  Per-token x per-channel scales are applied once, in the epilogue, with no promotion at all.
- MX weights on the Mosaic path are re-expressed per 128-block by `fold_mx_weight`: the four 32-block exponents of
  a 128-block are folded into E4M3 values under one float32 scale. E2M3 / E2M1 / E3M2 values shifted by the exponent
  differences stay exact in E4M3 while the spread is small (see `fold_mx_weight`); the weight then takes 8 bits a
  value on the device (not 6 or 4). The Triton path keeps the packed codes in memory and unpacks them in the kernel.

Epilogue: `activation(y + bias)`, then `residual + gate * that` (the DiT's gated residual), all in float32.
`activation="swiglu"` takes a weight made by `swiglu_weight` (the gate's and up's rows interleaved in runs of
`SWIGLU_WIDTH`, so that every output tile holds both halves of its columns) and returns `silu(gate) * up`: (m, n / 2),
rounded as the unfused model rounds it. The product of SwiGLU's gate and up (Krea 2: 4224 x 32768 a block) is then
never written out and read back.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from mxdit.quant.formats import FORMATS, QuantizedArray, decode, element_values, quantize, unpack_fp4, unpack_fp6

BLOCK_K = 128  # the K extent of an activation / weight scale block, and of every kernel's K step
MX_BLOCK = 32
ACTIVATIONS = ("none", "gelu_tanh", "silu", "swiglu")
SWIGLU_WIDTH = 64  # rows of the gate, then of up, alternating in a `swiglu_weight` (divides every kernel tile width)
WEIGHT_FORMATS = ("fp8_e4m3", "mxfp8_e4m3", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp4_e2m1", "int8", "int8_rot")


# --------------------------------------------------------------------------------------------------------------------
# Operands


@functools.partial(jax.tree_util.register_dataclass, data_fields=["data", "scale", "high_bits"],
                   meta_fields=["fmt", "layout", "n", "k", "scale_rows", "swiglu_width"])
@dataclasses.dataclass(frozen=True)
class GemmWeight:
    """A weight (n, k) (PyTorch's (out, in) layout) in the form a backend reads.

    layout:
        "channel": `data` (n, k) FP8/INT8, `scale` (n,) float32.
        "block":   `data` (n, k) FP8 E4M3, `scale` (k / 128, n) float32 (one per channel and 128-wide K block; equal
                   over runs of `scale_rows` channels when the MX fold was made per `scale_rows` x 128 tile).
        "mx":      packed codes for the Triton kernel (`pack_mx_for_kernel`): `data` (n, k / 2) uint8 low nibbles,
                   `high_bits` (n, k / 4) uint8 (FP6 only), or `data` (n, k) FP8 for MXFP8; `scale` (n, k / 32) uint8
                   E8M0 exponents.
    k is padded to a multiple of 128 (zeros), n is not. `swiglu_width` > 0: a `swiglu_weight`, whose rows alternate
    between runs of the gate's and of up's; it multiplies only with `activation="swiglu"`.
    """

    data: jax.Array
    scale: jax.Array
    high_bits: jax.Array | None
    fmt: str
    layout: str
    n: int
    k: int
    scale_rows: int = 1
    swiglu_width: int = 0


def _pad_k(x: jax.Array, multiple: int = BLOCK_K) -> jax.Array:
    pad = (-x.shape[-1]) % multiple
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]) if pad else x


def prepare_weight(w: jax.Array | QuantizedArray, fmt: str | None = None, *, backend: str = "mosaic",
                   mx_fold_rows: int = 128) -> GemmWeight:
    """A weight for `scaled_matmul`: `w` (n, k) float (quantized here to `fmt`) or a `QuantizedArray` quantized along
    k (axis -1), laid out for `backend` ("mosaic", "triton" or "reference": the reference takes either layout).
    `mx_fold_rows`: MX weights on the Mosaic path fold their exponents per `mx_fold_rows` x 128 tile (see
    `fold_mx_weight`). 128 (default) makes the kernel's promotion factor one number per tile: 1432-1480 TFLOP/s vs
    952-957 with 1 at 4608x6144x6144 (pallas_kernels/NOTES.md); 1 keeps more exponent range per channel, for weights
    where `fold_mx_error(w, rows=128)` is not 0."""
    if not isinstance(w, QuantizedArray):
        if fmt is None:
            raise ValueError("prepare_weight: give `fmt` for an unquantized weight")
        w = quantize(_pad_k(jnp.asarray(w, jnp.float32)), fmt, axis=-1)
    if w.fmt not in WEIGHT_FORMATS:
        raise ValueError(f"scaled_matmul weights: format {w.fmt!r} is not supported; use one of {WEIGHT_FORMATS}")
    if len(w.shape) != 2 or w.axis != 1:
        raise ValueError(f"scaled_matmul weights: need a 2-D (out, in) array quantized along its last axis, got shape "
                         f"{w.shape} quantized along axis {w.axis}")
    n, k = w.shape
    kp = k + (-k) % BLOCK_K
    f = FORMATS[w.fmt]
    if f.kind in ("fp8", "int8"):
        return GemmWeight(_pad_k(w.data), w.scale.reshape(n).astype(jnp.float32), None, w.fmt, "channel", n, kp)
    if backend == "mosaic":
        data, scale = fold_mx_weight(w, mx_fold_rows)
        return GemmWeight(data, scale, None, w.fmt, "block", n, kp, mx_fold_rows)
    return pack_mx_for_kernel(w)


def concat_weights(weights: list[GemmWeight]) -> GemmWeight:
    """Weights of one input stacked along their outputs (n): one GEMM for several projections of the same
    activations (Q, K, V and the gate; SwiGLU's gate and up). Scales are per output channel, or per channel and K
    block, so stacking is exact; MX folds made per `scale_rows` channels need each n to be a multiple of it."""
    first = weights[0]
    for w in weights:
        if w.swiglu_width:
            raise ValueError("concat_weights: a swiglu_weight is a whole product; stack its gate and up instead")
        if (w.fmt, w.layout, w.k, w.scale_rows) != (first.fmt, first.layout, first.k, first.scale_rows):
            raise ValueError("concat_weights: weights differ in format, layout, K or fold rows")
        if w.layout == "mx" or w.n % w.scale_rows:
            raise ValueError(f"concat_weights: cannot stack a {w.layout} weight of {w.n} outputs")
    axis = 1 if first.layout == "block" else 0  # block scales are (k / 128, n)
    return GemmWeight(jnp.concatenate([w.data for w in weights]), jnp.concatenate([w.scale for w in weights], axis),
                      None, first.fmt, first.layout, sum(w.n for w in weights), first.k, first.scale_rows)


def swiglu_weight(gate: GemmWeight, up: GemmWeight, width: int = SWIGLU_WIDTH) -> GemmWeight:
    """SwiGLU's gate and up projections as one weight for `scaled_matmul(..., activation="swiglu")`: their rows
    interleaved in runs of `width` (gate rows [0, w), up rows [0, w), gate rows [w, 2w), ...), so that a kernel tile
    of 2 * width columns (or a multiple) holds the gate and up of the same `width` outputs and its epilogue applies
    SwiGLU itself. Exact: rows keep their scales."""
    if gate.n != up.n or gate.n % width:
        raise ValueError(f"swiglu_weight: gate and up need the same number of outputs, a multiple of {width}; got "
                         f"{gate.n} and {up.n}")
    if gate.layout == "mx" or width % gate.scale_rows:
        raise ValueError(f"swiglu_weight: a {gate.layout} weight folded per {gate.scale_rows} rows cannot be "
                         f"interleaved in runs of {width}")
    stacked = concat_weights([gate, up])
    runs = gate.n // width

    def paired(a: jax.Array, axis: int) -> jax.Array:  # [g0 g1 ... | u0 u1 ...] -> [g0 u0 g1 u1 ...] along axis
        a = jnp.moveaxis(a, axis, 0)
        a = a.reshape(2, runs, width, *a.shape[1:]).swapaxes(0, 1).reshape(2 * gate.n, *a.shape[1:])
        return jnp.moveaxis(a, 0, axis)

    return dataclasses.replace(stacked, data=paired(stacked.data, 0),
                               scale=paired(stacked.scale, 1 if stacked.layout == "block" else 0), swiglu_width=width)


def swiglu_pairs(y: jax.Array, width: int, dtype) -> jax.Array:
    """`silu(gate) * up` of a product (..., 2h) by a `swiglu_weight`: its pairs put back in [gate | up] order, then
    `activations.swiglu` of it in `dtype` (the unfused model's roundings). Returns (..., h) in float32 (rounded to
    `dtype`)."""
    from .activations import swiglu  # activations imports this module

    lead, n = y.shape[:-1], y.shape[-1]
    gate_up = y.reshape(*lead, n // (2 * width), 2, width).swapaxes(-3, -2).reshape(*lead, n)
    return swiglu(gate_up.astype(dtype)).astype(jnp.float32)


def _e8m0_exponents(scale: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(scale, jnp.uint8).astype(jnp.int32) - 127


def fold_mx_weight(w: QuantizedArray, rows: int = 1) -> tuple[jax.Array, jax.Array]:
    """An MX weight (n, k) as E4M3 values (n, k') and float32 scales (k' / 128, n), k' = k rounded up to 128.

    rows: how many consecutive output channels share a scale (1: per channel and 128-block; 128: per 128x128 tile,
    as DeepGEMM scales weights, so a kernel tile of 128 channels promotes with one number; the exponent spread then
    runs over 128 rows too, and `fold_mx_error` says what that costs).

    Each 128-block takes the scale 2^(e_max - shift) where e_max is the largest of its four 32-block exponents and
    `shift` lifts the element format's largest value as close to E4M3's 448 as a power of two allows (E2M1 x 64,
    E2M3 x 32, E3M2 x 8, E4M3 x 1); a 32-block with exponent e_max - d has its elements multiplied by 2^(shift - d).
    That is exact unless d is large enough to push elements below E4M3's subnormal grid (2^-9): for E2M3 / E2M1 it
    stays exact up to d = 11 / 14 (a 2048x / 16384x spread of block scales within 128 values), for E4M3 elements
    (MXFP8) small elements can lose bits as soon as d > 0. `fold_mx_error` measures it.
    """
    f = w.format
    n = w.shape[0]
    values = _mx_values(w)  # (n, kp / 32, 32) element values (unscaled), float32
    exps = _e8m0_exponents(w.scale)  # (n, kp / 32)
    kp = values.shape[1] * MX_BLOCK
    kp128 = kp + (-kp) % BLOCK_K
    pad_blocks = (kp128 - kp) // MX_BLOCK
    values = jnp.pad(values, ((0, 0), (0, pad_blocks), (0, 0)))
    exps = jnp.pad(exps, ((0, 0), (0, pad_blocks)), constant_values=-127)
    shift = math.floor(math.log2(448.0 / f.element.max_normal))
    sub = BLOCK_K // MX_BLOCK
    e128 = jnp.max(exps.reshape(n, -1, sub), axis=-1)  # (n, kp128 / 128)
    if rows > 1:  # the largest exponent over each run of `rows` channels (the last run may be shorter)
        pad_rows = (-n) % rows
        grouped = jnp.pad(e128, ((0, pad_rows), (0, 0)), constant_values=-127).reshape(-1, rows, e128.shape[1])
        e128 = jnp.repeat(jnp.max(grouped, axis=1), rows, axis=0)[:n]
    d = jnp.repeat(e128, sub, axis=1) - exps
    folded = jnp.ldexp(values, (shift - d)[..., None]).reshape(n, kp128)
    scale = jnp.ldexp(jnp.float32(1.0), e128 - shift).T  # (kp128 / 128, n)
    return folded.astype(jnp.float8_e4m3fn), scale.astype(jnp.float32)


def fold_mx_error(w: QuantizedArray, rows: int = 1) -> float:
    """Relative L2 difference between an MX weight and its `fold_mx_weight` form (0.0 when the fold is exact)."""
    data, scale = fold_mx_weight(w, rows)
    kp = data.shape[1]
    folded = data.astype(jnp.float32).reshape(w.shape[0], kp // BLOCK_K, BLOCK_K) * scale.T[..., None]
    exact = _pad_k(w.dequantize(jnp.float32))
    folded = folded.reshape(w.shape[0], kp)[:, : exact.shape[1]]
    return float(jnp.linalg.norm(folded - exact) / jnp.maximum(jnp.linalg.norm(exact), 1e-30))


def _mx_values(w: QuantizedArray) -> jax.Array:
    """Unscaled element values of an MX array, (rows, blocks, 32) float32."""
    return element_values(w).reshape(w.data.shape[0], -1, MX_BLOCK)


def pack_mx_for_kernel(w: QuantizedArray) -> GemmWeight:
    """Re-pack an MX weight's codes so the Triton kernel unpacks them with shifts and masks only (no interleaving).

    K is padded to 128. Within each 64-wide group g of K, byte j of `data` holds element 64g + j in its low nibble and
    element 64g + 32 + j in its high nibble, so one 32-byte load yields two whole 32-blocks. FP6 codes keep their
    low 4 bits that way and their top 2 bits in `high_bits`: within each 128-wide group h, byte j holds the top bits
    of elements 128h + 32q + j in bits [2q, 2q + 2), q = 0..3. MXFP8 keeps its E4M3 bytes.
    """
    f = w.format
    n = w.shape[0]
    if f.element.bits == 8:
        data = jax.lax.bitcast_convert_type(w.data, jnp.float8_e4m3fn)
        codes = None
    else:
        codes = (unpack_fp4 if f.element.bits == 4 else unpack_fp6)(w.data).astype(jnp.uint8)
    exps = jax.lax.bitcast_convert_type(w.scale, jnp.uint8)
    kp = (codes if codes is not None else data).shape[1]
    kp128 = kp + (-kp) % BLOCK_K
    exps = jnp.pad(exps, ((0, 0), (0, (kp128 - kp) // MX_BLOCK)))  # zero codes: the padding is zero anyway
    if codes is None:
        return GemmWeight(_pad_k(data), exps, None, w.fmt, "mx", n, kp128)
    codes = _pad_k(codes)
    g64 = codes.reshape(n, kp128 // 64, 2, MX_BLOCK)
    low = (g64[:, :, 0] & 0xF) | ((g64[:, :, 1] & 0xF) << 4)
    data = low.reshape(n, kp128 // 2).astype(jnp.uint8)
    high = None
    if f.element.bits == 6:
        g128 = (codes.reshape(n, kp128 // BLOCK_K, 4, MX_BLOCK) >> 4).astype(jnp.uint8)
        high = (g128[:, :, 0] | (g128[:, :, 1] << 2) | (g128[:, :, 2] << 4) | (g128[:, :, 3] << 6))
        high = high.reshape(n, kp128 // 4).astype(jnp.uint8)
    return GemmWeight(data, exps, high, w.fmt, "mx", n, kp128)


def quantize_activations(x: jax.Array, scaling: str = "token", fmt: str = "fp8_e4m3") -> tuple[jax.Array, jax.Array]:
    """x (m, k) float -> (values (m, k'), scales), k' = k padded to 128 with zeros.

    scaling "token": scales (m,) float32; "block": scales (k' / 128, m), one per token and 128-wide K block (stored
    K-major so a kernel reads a tile's scales as one contiguous run). fmt: "fp8_e4m3", or "int8" / "int8_rot" (per
    token only; the rotation must match the weight's).

    The values are those of `quant.formats.quantize` bit for bit (a test checks it), computed the fast way: XLA's
    float32 -> E4M3 conversion rounds to nearest even as the format's definition does, so one fused pass replaces
    the exact-arithmetic emulation (which took as long as the GEMM itself at 4608x6144).
    """
    if scaling not in ("token", "block"):
        raise ValueError(f"scaling must be 'token' or 'block', got {scaling!r}")
    if fmt.startswith("int8") and scaling != "token":
        raise ValueError("INT8 activations are scaled per token only")
    x = _pad_k(x)
    m, k = x.shape
    if fmt != "fp8_e4m3":
        q = quantize(x, fmt, axis=-1)
        return q.data, q.scale.reshape(m)
    rows = x.reshape(m, k // BLOCK_K, BLOCK_K) if scaling == "block" else x
    values, scale = _fp8_e4m3_rows(rows.astype(jnp.float32))
    if scaling == "token":
        return values, scale[..., 0]
    return values.reshape(m, k), scale[..., 0].T


def _fp8_e4m3_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-row FP8 E4M3 quantization with `quant.formats`' rule (scale amax * float32(1/448), values times the
    scale's reciprocal: see `activations.reciprocal_products`); NaN scale for rows holding NaN/Inf, whose values are
    zeroed."""
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax * np.float32(1.0 / 448.0), 1.0).astype(jnp.float32)
    scale = jnp.where(jnp.isfinite(amax), scale, jnp.nan)
    q = jnp.where(jnp.isfinite(x), jnp.clip(x * (1.0 / scale), -448.0, 448.0), 0.0)
    return q.astype(jnp.float8_e4m3fn), scale


# --------------------------------------------------------------------------------------------------------------------
# The definition


def _epilogue(y, bias, activation, residual, gate, swiglu_width=0, out_dtype=jnp.bfloat16):
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    if activation == "swiglu":
        return swiglu_pairs(y, swiglu_width, out_dtype)  # no gate or residual (`scaled_matmul` checks)
    if activation == "gelu_tanh":
        y = jax.nn.gelu(y, approximate=True)
    elif activation == "silu":
        y = jax.nn.silu(y)
    if gate is not None:
        y = y * gate.astype(jnp.float32)
    if residual is not None:
        y = y + residual.astype(jnp.float32)
    return y


def dequantize_weight(w: GemmWeight, *, rotated_basis: bool = False) -> jax.Array:
    """The (n, k') float32 values a `GemmWeight` stands for (k' padded to 128). An `int8_rot` weight is rotated back,
    unless `rotated_basis`: then its values stay in the rotated basis that its activations share."""
    if w.layout == "channel":
        values = w.data.astype(jnp.float32) * w.scale[:, None]
        if FORMATS[w.fmt].rotated and not rotated_basis:
            from mxdit.quant.formats import _rotate

            values = _rotate(values, FORMATS[w.fmt].block)
        return values
    if w.layout == "block":
        v = w.data.astype(jnp.float32).reshape(w.n, w.k // BLOCK_K, BLOCK_K) * w.scale.T[..., None]
        return v.reshape(w.n, w.k)
    codes = _unpack_kernel_codes(w)
    values = decode(codes, FORMATS[w.fmt].element).reshape(w.n, w.k // MX_BLOCK, MX_BLOCK)
    exps = w.scale.astype(jnp.int32) - 127
    return jnp.where(exps[..., None] == 128, jnp.nan, jnp.ldexp(values, exps[..., None])).reshape(w.n, w.k)


def _unpack_kernel_codes(w: GemmWeight) -> jax.Array:
    if FORMATS[w.fmt].element.bits == 8:
        return jax.lax.bitcast_convert_type(w.data, jnp.uint8)
    g = w.data.reshape(w.n, w.k // 64, 1, MX_BLOCK)
    codes = jnp.concatenate([g & 0xF, g >> 4], axis=2).reshape(w.n, w.k)
    if w.high_bits is not None:
        h = w.high_bits.reshape(w.n, w.k // BLOCK_K, 1, MX_BLOCK)
        top = jnp.concatenate([(h >> (2 * q)) & 3 for q in range(4)], axis=2).reshape(w.n, w.k)
        codes = codes | (top << 4)
    return codes


def scaled_matmul_reference(x: jax.Array, x_scale: jax.Array, w: GemmWeight, *, bias=None, activation: str = "none",
                            residual=None, gate=None, out_dtype=jnp.bfloat16) -> jax.Array:
    """The float32 product of the dequantized operands, then the epilogue: what every backend computes.

    x: (m, k') quantized values, x_scale: (m,) or (k' / 128, m) as `quantize_activations` returns them.
    """
    xf = x.astype(jnp.float32)
    m, k = xf.shape
    if x_scale.ndim == 1:
        xf = xf * x_scale[:, None]
    else:
        xf = (xf.reshape(m, k // BLOCK_K, BLOCK_K) * x_scale.T[..., None]).reshape(m, k)
    # int8_rot: x was quantized in the rotated basis too, and the rotations cancel in the product.
    y = jnp.dot(xf, dequantize_weight(w, rotated_basis=True).T, precision=jax.lax.Precision.HIGHEST)
    return _epilogue(y, bias, activation, residual, gate, w.swiglu_width, out_dtype).astype(out_dtype)


# --------------------------------------------------------------------------------------------------------------------
# Mosaic GPU (Hopper)


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """Tiles of the Mosaic GPU kernel. Each of the `compute_wgs` compute warpgroups owns `tile_m` x `tile_n` of the
    output (the CTA covers compute_wgs * tile_m rows); the K step is 128. `max_concurrent_steps`: shared-memory
    pipeline depth. `grid_tile_width`: how many tiles along the minor grid dimension the persistent loop sweeps before
    turning (output tiles that share operands run close together in time, so they hit L2). `prefetch_residual`: the
    residual epilogue's first two column slices are fetched when the tile starts, not after its main loop.
    `cluster_n`: CTAs a cluster, side by side along N; they share their rows of x, which one TMA multicast brings to
    all of them (less L2-to-SM traffic a FLOP)."""

    tile_m: int = 128
    tile_n: int = 128
    max_concurrent_steps: int = 4
    epi_tile_n: int = 64
    grid_minor_n: bool = True
    grid_tile_width: int = 8
    compute_wgs: int = 2
    prefetch_residual: bool = False
    cluster_n: int = 1


def default_mosaic_config(m: int, n: int, k: int, block_scaled: bool, residual: bool = False) -> MosaicConfig:
    """The tiles the benchmark picked for this kind of shape on an H200 (see pallas_kernels/NOTES.md). No clusters:
    at Krea 2's shapes they saved ~1.5% of the SwiGLU GEMM's energy in a loop and nothing measurable in the step."""
    if block_scaled:
        # Promotion keeps a partial and a total accumulator in registers: 64 x 128 per warpgroup leaves room for both.
        # Three compute warpgroups keep the tensor cores busy while the others promote (1387 vs 1143 TFLOP/s at
        # 4608x6144x6144); they need M to be a multiple of 192, or padding rows would cost more than they gain.
        return MosaicConfig(tile_m=64, tile_n=128, max_concurrent_steps=4, compute_wgs=3 if m % 192 == 0 else 2)
    if m <= 2048:  # more, smaller tiles fill the 132 SMs better (1302 vs 1148 TFLOP/s at M = 1024)
        return MosaicConfig(tile_m=64, tile_n=128, max_concurrent_steps=4)
    if m % 256:
        # 256-row CTAs would pad M (Krea 2 with trimmed text: 4096 + 128 = 4224 rows) and copy x, the residual and
        # the output around the kernel. 128-row CTAs of two 64 x 256 tiles divide it, and the wide tile halves the
        # per-tile overhead. At M = 4224 against 64 x 128 in 3 warpgroups (us, pallas_kernels/NOTES.md session 6):
        # 566 vs 579 (N = 15360), 1240 vs 1261-1351 (N = 32768) with 128-wide output slices; with the residual
        # epilogue fetched during the main loop, 259 vs 270 (6144 -> 6144) and 598 vs 623 (16384 -> 6144).
        # Tile width 4: at the power cap the order that fetches fewer bytes from HBM runs faster, though CUPTI at full
        # clock sees no difference (session 6). The fp8 step, A B B A: 0.1072 / 0.1059 / 0.1059 / 0.1071 s with 8
        # (outputs equal to the bit); 2: 0.1064; the SwiGLU GEMM read 477 MB of HBM with 8, 1.74 GB with 32 (ncu).
        if residual:
            return MosaicConfig(tile_m=64, tile_n=256, max_concurrent_steps=3, compute_wgs=2, prefetch_residual=True,
                                grid_tile_width=4)
        return MosaicConfig(tile_m=64, tile_n=256, max_concurrent_steps=3, compute_wgs=2, epi_tile_n=128,
                            grid_tile_width=4)
    return MosaicConfig(tile_m=128, tile_n=128, max_concurrent_steps=3)


# The most shared memory a CTA may have on Hopper (H100/H200: 227 KB).
SHARED_MEMORY_BYTES = 232448

# The SiLU / SwiGLU / GELU (tanh) epilogues' sigmoid from one approximate exponential and one approximate reciprocal
# (a MUFU instruction each), not libdevice's expf (tanhf) and an IEEE division (~20 instructions more an element, in
# an epilogue that keeps the tensor cores idle). Relative error ~2^-21 before the bf16 rounding the model applies.
MOSAIC_FAST_SIGMOID = True


def _gelu_tanh_by_sigmoid(x: jax.Array, sigmoid) -> jax.Array:
    """GELU's tanh form, 0.5 x (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2 / pi) (x + 0.044715 x^3)."""
    return x * sigmoid((2 * math.sqrt(2 / math.pi)) * (x + 0.044715 * (x * x * x)))


def _fast_sigmoid(x: jax.Array, layout) -> jax.Array:
    """1 / (1 + 2^(-x log2 e)) with `ex2.approx.ftz` and `rcp.approx.ftz` (inside a Mosaic GPU kernel; float32 in
    `layout`). Large negative x gives 0 (the exact sigmoid: a subnormal or 0)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax.experimental.mosaic.gpu import fragmented_array as fa

    fast = fa.FragmentedArray._lift_fast_instr  # the PTX instruction a register (jax 0.11.2, pinned)

    @plgpu.inline_mgpu(arg_types=(layout,),
                       return_type=plgpu.ShapeDtypeStruct(x.shape, jnp.float32, layout=layout))
    def sigmoid(_, y):
        e = (y * -math.log2(math.e))._pointwise(fast("ex2.approx.ftz.f32"))
        return (e + 1.0)._pointwise(fast("rcp.approx.ftz.f32"))

    return sigmoid(x)


def mosaic_shared_memory_bytes(config: MosaicConfig, out_itemsize: int, *, block_scaled: bool = False,
                               swiglu_width: int = 0, col_vectors: int = 1) -> int:
    """The shared memory `_mosaic_gemm` takes with `config`: the FP8 operand ring (and the scales travelling with
    it when block-scaled), the output's two staging slots a warpgroup, the epilogue's row vector and `col_vectors`
    column vectors (weight scales, bias, gate); the barriers left out. (4224 x 16384 -> 2048, float32 out, 64 x 256
    tiles: 281088 here, 281712 by Mosaic's count on the H200, session 13.)"""
    cta_m = config.compute_wgs * config.tile_m
    ring = config.max_concurrent_steps * (cta_m + config.tile_n) * (BLOCK_K + (4 if block_scaled else 0))
    epi_n = swiglu_width or min(config.epi_tile_n, config.tile_n)
    staging = config.compute_wgs * 2 * config.tile_m * epi_n * out_itemsize
    vectors = config.compute_wgs * (config.tile_m + col_vectors * config.tile_n) * 4
    return ring + staging + vectors


def _fit_shared_memory(config: MosaicConfig, out_itemsize: int, **kwargs) -> MosaicConfig:
    """`config` with narrower output slices, then a shallower ring, until it fits in shared memory (the defaults
    are tuned for bf16 outputs; float32 ones need twice the staging)."""
    def fits(c):
        return mosaic_shared_memory_bytes(c, out_itemsize, **kwargs) <= SHARED_MEMORY_BYTES - 2048  # barriers

    while not fits(config) and config.epi_tile_n > 32:
        config = dataclasses.replace(config, epi_tile_n=config.epi_tile_n // 2)
    while not fits(config) and config.max_concurrent_steps > 2:
        config = dataclasses.replace(config, max_concurrent_steps=config.max_concurrent_steps - 1)
    return config


def _mosaic_gemm(x, x_scale, w_data, w_scale, bias, residual, gate, *, x_blocks, w_blocks, activation, out_dtype,
                 config: MosaicConfig, w_scale_rows: int = 1, swiglu_width: int = 0, interpret=False):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax import lax

    m, k = x.shape
    n = w_data.shape[0]
    tm, tn, tk = config.tile_m, config.tile_n, BLOCK_K
    wgs = config.compute_wgs
    cta_m = wgs * tm
    cluster_n = config.cluster_n
    if m % cta_m or n % (tn * cluster_n) or k % tk:
        raise ValueError(f"mosaic gemm: ({m}, {k}) x ({n}, {k}) must be multiples of ({cta_m}, {tk}) x "
                         f"({tn} * cluster_n {cluster_n}, {tk})")
    if interpret and cluster_n > 1:  # it would hand each CTA only its share of x's tile
        raise ValueError("mosaic gemm: interpret mode does not model TMA multicast; use cluster_n=1")
    m_iters, n_iters, k_iters = m // cta_m, n // tn, k // tk
    swiglu = activation == "swiglu"
    if swiglu and tn % (2 * swiglu_width):
        raise ValueError(f"mosaic gemm: tile_n {tn} must hold whole SwiGLU pairs of 2 x {swiglu_width} columns")
    out_tn = tn // 2 if swiglu else tn  # the output columns of one tile
    # SwiGLU: each pair's output (swiglu_width columns) leaves on its own
    epi_n = swiglu_width if swiglu else min(config.epi_tile_n, tn)
    steps = min(config.max_concurrent_steps, k_iters)
    wgmma = plgpu.Layout.WGMMA
    fp8_transforms = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))
    out_swizzle = plgpu.find_swizzle(epi_n * jnp.dtype(out_dtype).itemsize * 8)
    out_transforms = (plgpu.TilingTransform((8, out_swizzle // jnp.dtype(out_dtype).itemsize)),
                      plgpu.SwizzleTransform(out_swizzle))
    has_bias, has_res, has_gate = bias is not None, residual is not None, gate is not None
    # Epilogue operands travel by TMA into shared memory (registers can only be filled from there): per warpgroup,
    # column vectors (n-indexed: weight scales, bias, gate) and the row scales, each copy on its own barrier.
    # Scales that vary along K (x_blocks: x per 1x128; w_blocks: w per channel and 128-block) travel with the
    # operand tiles and are applied at each promotion; the others wait for the epilogue.
    block_scaled = x_blocks or w_blocks
    w_uniform = w_blocks and w_scale_rows % tn == 0  # tiles never straddle two runs of equal weight scales
    col_vectors = ([] if w_blocks else ["w_scale"]) + (["bias"] if has_bias else []) + (["gate"] if has_gate else [])
    n_barriers = len(col_vectors) + 3  # + row scales + two residual slices
    # The residual shares the output's two staging slots: a slice is fetched into the slot its output leaves from.
    # Prefetched, the first two slices arrive during the main loop (each slot's previous store must have been read).
    n_parts = out_tn // epi_n
    prefetched = min(2, n_parts) if (has_res and config.prefetch_residual) else 0
    fast_sigmoid = MOSAIC_FAST_SIGMOID and not interpret  # the interpreter runs no PTX: the exact sigmoid there
    sigmoid = functools.partial(_fast_sigmoid, layout=wgmma) if fast_sigmoid else jax.nn.sigmoid

    def kernel(x_gmem, xs_gmem, w_gmem, ws_gmem, bias_gmem, res_gmem, gate_gmem, out_gmem, out_smem, row_smem,
               col_smem, barriers):
        wg = lax.axis_index("wg")
        col_gmem = {"w_scale": ws_gmem, "bias": bias_gmem, "gate": gate_gmem}

        def barrier(i):
            return barriers.at[wg * n_barriers + i]

        def pipeline(body, compute_context):
            specs = [plgpu.BlockSpec((cta_m, tk), lambda kk: (0, kk), transforms=fp8_transforms,
                                     collective_axes=("cluster",) if cluster_n > 1 else ()),
                     plgpu.BlockSpec((tn, tk), lambda kk: (0, kk), transforms=fp8_transforms)]
            if x_blocks:
                specs.append(plgpu.BlockSpec((1, cta_m), lambda kk: (kk, 0)))
            if w_blocks:
                specs.append(plgpu.BlockSpec((1, tn), lambda kk: (kk, 0)))
            return plgpu.emit_pipeline_warp_specialized(
                body, grid=(k_iters,), memory_registers=40, in_specs=specs, wg_axis="wg", num_compute_wgs=wgs,
                max_concurrent_steps=steps, compute_context=compute_context)

        @plgpu.nd_loop((m_iters * n_iters // cluster_n,), collective_axes="sm")
        def _tile_loop(info):
            (lin,) = info.index
            mi, ni = plgpu.planar_snake(lin, (m_iters, n_iters // cluster_n), 1 if config.grid_minor_n else 0,
                                        config.grid_tile_width)
            if cluster_n > 1:  # the cluster's CTAs take neighbouring column tiles of the same rows
                ni = ni * cluster_n + lax.axis_index("cluster")
            rows = pl.ds(mi * cta_m, cta_m)
            cols = pl.ds(ni * tn, tn)
            wg_rows = pl.ds(wg * tm, tm)

            def body(_, x_smem, w_smem, *rest):
                if not block_scaled:
                    (acc_ref,) = rest
                    plgpu.wgmma(acc_ref, x_smem.at[wg_rows], w_smem.transpose((1, 0)))
                    plgpu.wgmma_wait(0)
                    return acc_ref
                *scale_smems, acc = rest

                def block_product(ref):
                    plgpu.wgmma(ref, x_smem.at[wg_rows], w_smem.transpose((1, 0)))
                    plgpu.wgmma_wait(0)
                    return ref[...]

                partial = pl.run_scoped(block_product, plgpu.ACC((tm, tn), jnp.float32))
                # Promotion: one FMA per element when only one side's scale varies along K.
                if x_blocks:
                    sx = plgpu.load(scale_smems[0].at[0, wg_rows], layout=wgmma.reduce(1))
                    partial = partial * lax.broadcast_in_dim(sx, (tm, tn), [0])
                if w_blocks and w_uniform:  # one weight scale for the whole tile: a scalar from shared memory
                    partial = partial * scale_smems[-1][0, 0]
                elif w_blocks:
                    sw = plgpu.load(scale_smems[-1].at[0], layout=wgmma.reduce(0))
                    partial = partial * lax.broadcast_in_dim(sw, (tm, tn), [1])
                return acc + partial

            def compute_context(run):
                # The epilogue's vectors are fetched while the main loop runs.
                if not x_blocks:
                    plgpu.copy_gmem_to_smem(xs_gmem.at[rows].at[wg_rows], row_smem.at[wg], barrier(0))
                for i, name in enumerate(col_vectors):
                    plgpu.copy_gmem_to_smem(col_gmem[name].at[cols], col_smem.at[wg, i], barrier(3 + i))
                if prefetched:
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                for e in range(prefetched):
                    plgpu.copy_gmem_to_smem(res_gmem.at[rows].at[wg_rows].at[:, pl.ds(ni * tn + e * epi_n, epi_n)],
                                            out_smem.at[wg, e], barrier(1 + e))
                if block_scaled:
                    acc = run(plgpu.layout_cast(jnp.zeros((tm, tn), jnp.float32), wgmma))
                else:
                    def scoped(acc_ref):
                        run(acc_ref)
                        return acc_ref[...]

                    acc = pl.run_scoped(scoped, plgpu.ACC((tm, tn), jnp.float32))
                if not x_blocks:
                    plgpu.barrier_wait(barrier(0))
                    sx = plgpu.load(row_smem.at[wg], layout=wgmma.reduce(1))
                    acc = acc * lax.broadcast_in_dim(sx, (tm, tn), [0])

                def column(name):
                    i = col_vectors.index(name)
                    plgpu.barrier_wait(barrier(3 + i))
                    return lax.broadcast_in_dim(plgpu.load(col_smem.at[wg, i], layout=wgmma.reduce(0)), (tm, tn), [1])

                if not w_blocks:
                    acc = acc * column("w_scale")
                if has_bias:
                    acc = acc + column("bias")
                if activation == "gelu_tanh":  # by the sigmoid, libdevice's tanhf avoided too
                    acc = _gelu_tanh_by_sigmoid(acc, sigmoid) if fast_sigmoid else jax.nn.gelu(acc, approximate=True)
                elif activation == "silu":
                    acc = acc * sigmoid(acc)
                if has_gate:
                    acc = acc * column("gate")
                if not has_res and not swiglu:
                    acc = acc.astype(out_dtype)

                def rounded(v):  # to the output's precision and back, as the unfused model's arithmetic rounds
                    return v.astype(out_dtype).astype(jnp.float32)

                def out_part(e):
                    if not swiglu:
                        return acc[:, e * epi_n:(e + 1) * epi_n]
                    g = rounded(acc[:, 2 * e * epi_n:(2 * e + 1) * epi_n])
                    u = rounded(acc[:, (2 * e + 1) * epi_n:(2 * e + 2) * epi_n])
                    return (rounded(g * sigmoid(g)) * u).astype(out_dtype)  # as `swiglu_pairs`

                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                for e in range(n_parts):
                    slot = e % 2
                    plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                    out_cols = pl.ds(ni * out_tn + e * epi_n, epi_n)
                    part = out_part(e)
                    if has_res:
                        if e >= prefetched:
                            plgpu.copy_gmem_to_smem(res_gmem.at[rows].at[wg_rows].at[:, out_cols],
                                                    out_smem.at[wg, slot], barrier(1 + slot))
                        plgpu.barrier_wait(barrier(1 + slot))
                        res = plgpu.load(out_smem.at[wg, slot], layout=wgmma).astype(jnp.float32)
                        part = (part + res).astype(out_dtype)
                    out_smem[wg, slot] = part
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(out_smem.at[wg, slot], out_gmem.at[rows].at[wg_rows].at[:, out_cols])

            args = [x_gmem.at[rows], w_gmem.at[cols]]
            if x_blocks:
                args.append(xs_gmem.at[:, rows])
            if w_blocks:
                args.append(ws_gmem.at[:, cols])
            pipeline(body, compute_context)(*args)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    num_sms = 1 if interpret else _num_sms()
    dummy = jnp.zeros((16,), jnp.float32)
    # profiles list the kernel under its body's name: say which product it is
    kernel.__name__ = "scaled_matmul" + "".join(f"_{part}" for part, used in (
        ("blocks", block_scaled), (activation, activation != "none"), ("gate", has_gate), ("residual", has_res))
        if used)
    call = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((m, n // 2 if swiglu else n), out_dtype),
        grid=(min(num_sms // cluster_n, m_iters * n_iters // cluster_n),),
        grid_names=("sm",),
        **(dict(cluster=(cluster_n,), cluster_names=("cluster",)) if cluster_n > 1 else {}),
        num_threads=wgs + 1,
        thread_name="wg",
        scratch_types=dict(
            out_smem=plgpu.SMEM((wgs, 2, tm, epi_n), out_dtype, transforms=out_transforms),
            row_smem=plgpu.SMEM((wgs, tm), jnp.float32),
            col_smem=plgpu.SMEM((wgs, max(len(col_vectors), 1), tn), jnp.float32),
            barriers=plgpu.Barrier(num_barriers=wgs * n_barriers),
        ),
        interpret=_mosaic_interpret() if interpret else None,
    )
    return call(x, x_scale, w_data, w_scale, bias.astype(jnp.float32) if has_bias else dummy,
                residual.astype(out_dtype) if has_res else dummy, gate.astype(jnp.float32) if has_gate else dummy)


def _num_sms() -> int:
    """The GPU's streaming multiprocessors: the persistent grid's size (a seam for lowering tests on the CPU)."""
    return jax.devices()[0].core_count


def _mosaic_interpret():
    import jax.experimental.pallas.mosaic_gpu as plgpu

    return plgpu.InterpretGPUParams()


# --------------------------------------------------------------------------------------------------------------------
# Triton lowering (portable)


@dataclasses.dataclass(frozen=True)
class TritonConfig:
    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3


def default_triton_config(m: int, n: int, k: int, fmt: str) -> TritonConfig:
    """Tiles by operand kind: MX unpacking needs registers, so its tiles are narrower."""
    if FORMATS[fmt].kind == "mx":
        return TritonConfig(block_m=64, block_n=128, num_warps=4, num_stages=2)
    return TritonConfig()


def _mx_codes_to_e4m3(codes, fmt):
    """Element codes (uint8 in the low bits) -> float8_e4m3fn of the same values (exact: every E2M1, E2M3 and E3M2
    value is an E4M3 value). Integer arithmetic builds the float32 value; no table, no ldexp (Triton has neither)."""
    e = FORMATS[fmt].element
    c = codes.astype(jnp.int32)
    sign = (c >> (e.ebits + e.mbits)) & 1
    exp_field = (c >> e.mbits) & ((1 << e.ebits) - 1)
    mant = c & ((1 << e.mbits) - 1)
    # value = (exp_field ? 2^mbits + mant : 2 * mant) * 2^(max(exp_field, 1) - bias - mbits)
    significand = jnp.where(exp_field > 0, mant + (1 << e.mbits), mant).astype(jnp.float32)
    pow2_bits = (jnp.maximum(exp_field, 1) - e.bias - e.mbits + 127) << 23
    value = significand * jax.lax.bitcast_convert_type(pow2_bits, jnp.float32)
    value = jnp.where(sign == 1, -value, value)
    return value.astype(jnp.float8_e4m3fn)


def _triton_gemm(x, x_scale, w: GemmWeight, bias, residual, gate, *, activation, out_dtype, config: TritonConfig,
                 interpret=False):
    import jax.experimental.pallas as pl
    from jax.experimental.pallas import triton as pltriton

    m, k = x.shape
    n = w.n
    bm, bn = min(config.block_m, _pow2_at_least(m)), min(config.block_n, _pow2_at_least(n))
    # The Triton lowering masks no load or store: a tile reaching past the arrays would read and write past them, so
    # every operand is padded to whole tiles (DiT shapes need none) and the result cut back.
    x, x_scale, w, bias, residual, gate = _pad_to_tiles(x, x_scale, w, bias, residual, gate, (-m) % bm, (-n) % bn)
    k_iters = k // BLOCK_K
    x_blocks = x_scale.ndim == 2
    int8 = jnp.dtype(x.dtype) == jnp.int8
    mx = w.layout == "mx"
    bits = FORMATS[w.fmt].element.bits if mx else 8
    has_bias, has_res, has_gate = bias is not None, residual is not None, gate is not None
    w_block = w.layout == "block"

    def kernel(x_ref, xs_ref, w_ref, ws_ref, hb_ref, bias_ref, res_ref, gate_ref, o_ref):
        acc_type = jnp.int32 if int8 else jnp.float32

        def x_scale_block(kb):
            return xs_ref[kb, :] if x_blocks else None

        def step(kb, acc):
            if not (mx or w_block or x_blocks):
                xt = x_ref[:, pl.ds(kb * BLOCK_K, BLOCK_K)]
                wt = w_ref[:, pl.ds(kb * BLOCK_K, BLOCK_K)]
                return acc + jnp.dot(xt, wt.T, preferred_element_type=acc_type)
            if not mx:
                xt = x_ref[:, pl.ds(kb * BLOCK_K, BLOCK_K)]
                wt = w_ref[:, pl.ds(kb * BLOCK_K, BLOCK_K)]
                part = jnp.dot(xt, wt.T, preferred_element_type=jnp.float32)
                if x_blocks:
                    part = part * x_scale_block(kb)[:, None]
                if w_block:
                    part = part * ws_ref[kb, :][None, :]
                return acc + part
            # MX weights: four 32-blocks per K step, each promoted with its own E8M0 scale.
            part_sum = jnp.zeros_like(acc)
            for q in range(BLOCK_K // MX_BLOCK):
                k0 = kb * BLOCK_K + q * MX_BLOCK
                xt = x_ref[:, pl.ds(k0, MX_BLOCK)]
                if bits == 8:
                    wt = w_ref[:, pl.ds(k0, MX_BLOCK)]
                else:
                    byte_col = kb * (BLOCK_K // 2) + (q // 2) * MX_BLOCK
                    packed = w_ref[:, pl.ds(byte_col, MX_BLOCK)].astype(jnp.int32)
                    codes = (packed >> 4) if q % 2 else (packed & 0xF)
                    if bits == 6:
                        high = hb_ref[:, pl.ds(kb * MX_BLOCK, MX_BLOCK)].astype(jnp.int32)
                        codes = codes | (((high >> (2 * q)) & 3) << 4)
                    wt = _mx_codes_to_e4m3(codes, w.fmt)
                exps = ws_ref[:, kb * (BLOCK_K // MX_BLOCK) + q].astype(jnp.int32)
                sw = jax.lax.bitcast_convert_type(jnp.clip(exps, 1, 254) << 23, jnp.float32)
                sw = jnp.where(exps == 255, jnp.nan, jnp.where(exps == 0, 0.0, sw))
                part_sum = part_sum + jnp.dot(xt, wt.T, preferred_element_type=jnp.float32) * sw[None, :]
            if x_blocks:
                part_sum = part_sum * x_scale_block(kb)[:, None]
            return acc + part_sum

        acc = jax.lax.fori_loop(0, k_iters, step, jnp.zeros((bm, bn), acc_type))
        y = acc.astype(jnp.float32)
        if not x_blocks:
            y = y * xs_ref[...][:, None]
        if w.layout == "channel":
            y = y * ws_ref[...][None, :]
        y = _epilogue(y, bias_ref[...] if has_bias else None, activation,
                      res_ref[...] if has_res else None, gate_ref[...] if has_gate else None)
        o_ref[...] = y.astype(o_ref.dtype)

    grid = (x.shape[0] // bm, w.n // bn)
    row_k = pl.BlockSpec((bm, k), lambda i, j: (i, 0))
    dummy = jnp.zeros((1,), jnp.float32)
    any_spec = pl.BlockSpec((1,), lambda i, j: (0,))
    xs_spec = pl.BlockSpec((k_iters, bm), lambda i, j: (0, i)) if x_blocks else pl.BlockSpec((bm,), lambda i, j: (i,))
    w_cols = w.data.shape[1]
    w_spec = pl.BlockSpec((bn, w_cols), lambda i, j: (j, 0))
    if w.layout == "channel":
        ws_spec = pl.BlockSpec((bn,), lambda i, j: (j,))
    elif w.layout == "block":
        ws_spec = pl.BlockSpec((k_iters, bn), lambda i, j: (0, j))
    else:
        ws_spec = pl.BlockSpec((bn, w.scale.shape[1]), lambda i, j: (j, 0))
    hb = w.high_bits if w.high_bits is not None else dummy
    hb_spec = pl.BlockSpec((bn, hb.shape[1]), lambda i, j: (j, 0)) if w.high_bits is not None else any_spec
    vec_n = pl.BlockSpec((bn,), lambda i, j: (j,))
    tile = pl.BlockSpec((bm, bn), lambda i, j: (i, j))
    y = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((x.shape[0], w.n), out_dtype),
        grid=grid,
        in_specs=[row_k, xs_spec, w_spec, ws_spec, hb_spec, vec_n if has_bias else any_spec,
                  tile if has_res else any_spec, vec_n if has_gate else any_spec],
        out_specs=tile,
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
    )(x, x_scale, w.data, w.scale, hb, bias if has_bias else dummy, residual if has_res else dummy,
      gate if has_gate else dummy)
    return y[:m, :n]


def _pad_to_tiles(x, x_scale, w: GemmWeight, bias, residual, gate, pm: int, pn: int):
    """The GEMM's operands with pm zero rows (scale 1) and pn zero columns (weight rows) more."""
    def rows(a, pad, axis=0, value=0):
        if a is None or not pad:
            return a
        widths = [(0, 0)] * a.ndim
        widths[axis] = (0, pad)
        return jnp.pad(a, widths, constant_values=value)

    x = rows(x, pm)
    x_scale = rows(x_scale, pm, axis=x_scale.ndim - 1, value=1)  # (m,) or K-major blocks (k / 128, m)
    residual = rows(rows(residual, pm), pn, axis=1)
    scale = rows(w.scale, pn, axis=1 if w.layout == "block" else 0, value=1 if w.layout != "mx" else 127)
    w = dataclasses.replace(w, data=rows(w.data, pn), scale=scale, high_bits=rows(w.high_bits, pn), n=w.n + pn)
    return x, x_scale, w, rows(bias, pn), residual, rows(gate, pn)


def _pow2_at_least(v: int) -> int:
    return max(16, 1 << (v - 1).bit_length())


# --------------------------------------------------------------------------------------------------------------------
# The public entry point


def scaled_matmul(x: jax.Array, w: GemmWeight, x_scale: jax.Array | None = None, *, x_scaling: str = "token",
                  bias: jax.Array | None = None, activation: str = "none", residual: jax.Array | None = None,
                  gate: jax.Array | None = None, out_dtype=jnp.bfloat16, backend: str = "mosaic",
                  config: MosaicConfig | TritonConfig | None = None, interpret: bool = False) -> jax.Array:
    """`epilogue(x @ w^T)` with low-precision operands.

    Args:
        x: (m, k) float (quantized here, `x_scaling` "token" or "block") or already-quantized values with `x_scale`
            from `quantize_activations`.
        w: `prepare_weight(...)` for this backend.
        bias, gate: (n,); residual: (m, n). The output is `residual + gate * activation(x @ w^T + bias)`; with
            activation "swiglu" (a `swiglu_weight`, no residual or gate) `swiglu_pairs(x @ w^T + bias)`, (m, n / 2).
        backend: "mosaic" (Hopper), "triton" (portable) or "reference".
        interpret: run the Pallas kernel in interpret mode (CPU tests).
    Returns:
        (m, n) `out_dtype` ((m, n / 2) for "swiglu").
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if (activation == "swiglu") != bool(w.swiglu_width):
        raise ValueError("scaled_matmul: activation='swiglu' takes a `swiglu_weight` and such a weight only that "
                         f"activation (got activation {activation!r}, swiglu_width {w.swiglu_width})")
    if activation == "swiglu" and (residual is not None or gate is not None):
        raise ValueError("scaled_matmul: the swiglu epilogue takes no residual or gate")
    int8 = FORMATS[w.fmt].kind == "int8"
    if x_scale is None:
        x, x_scale = quantize_activations(x, "token" if int8 else x_scaling, w.fmt if int8 else "fp8_e4m3")
    m = x.shape[0]
    if x.shape[1] != w.k:
        raise ValueError(f"scaled_matmul: x has {x.shape[1]} columns (padded), the weight {w.k}")
    if int8 != (jnp.dtype(x.dtype) == jnp.int8):
        raise ValueError(f"scaled_matmul: {w.fmt} weights need {'INT8' if int8 else 'FP8'} activations, got {x.dtype}")
    if backend == "reference":
        return scaled_matmul_reference(x, x_scale, w, bias=bias, activation=activation, residual=residual, gate=gate,
                                       out_dtype=out_dtype)
    if backend == "triton":
        config = config or default_triton_config(m, w.n, w.k, w.fmt)
        if activation == "swiglu":  # SwiGLU after the kernel (its tiles do not follow the weight's pairs)
            y = _triton_gemm(x, x_scale, w, bias, None, None, activation="none", out_dtype=out_dtype, config=config,
                             interpret=interpret)
            return swiglu_pairs(y, w.swiglu_width, out_dtype).astype(out_dtype)
        return _triton_gemm(x, x_scale, w, bias, residual, gate, activation=activation, out_dtype=out_dtype,
                            config=config, interpret=interpret)
    if backend != "mosaic":
        raise ValueError(f"backend must be 'mosaic', 'triton' or 'reference', got {backend!r}")
    if int8 or w.layout == "mx":
        raise ValueError(f"the Mosaic GPU kernel takes FP8 operands (wgmma has no INT8 here); {w.fmt} in layout "
                         f"{w.layout!r} runs on backend='triton'")
    x_blocks, w_blocks = x_scale.ndim == 2, w.layout == "block"
    # A given config is fitted too: tiles tuned for bf16 outputs stage twice the bytes for float32 ones.
    config = config or default_mosaic_config(m, w.n, w.k, x_blocks or w_blocks, residual is not None)
    config = _fit_shared_memory(config, jnp.dtype(out_dtype).itemsize, block_scaled=x_blocks or w_blocks,
                                swiglu_width=w.swiglu_width,
                                col_vectors=max((not w_blocks) + (bias is not None) + (gate is not None), 1))
    # The kernel takes whole tiles: pad rows and columns (cheap next to the product for DiT shapes, which need none).
    cta_m, tn = config.compute_wgs * config.tile_m, config.tile_n * config.cluster_n
    n = w.n
    x, x_scale, w, bias, residual, gate = _pad_to_tiles(x, x_scale, w, bias, residual, gate, (-m) % cta_m,
                                                        (-n) % tn)
    y = _mosaic_gemm(x, x_scale.astype(jnp.float32), w.data, w.scale.astype(jnp.float32), bias, residual, gate,
                     x_blocks=x_blocks, w_blocks=w_blocks, activation=activation, out_dtype=out_dtype, config=config,
                     w_scale_rows=w.scale_rows, swiglu_width=w.swiglu_width, interpret=interpret)
    return y[:m, : n // 2 if w.swiglu_width else n]
