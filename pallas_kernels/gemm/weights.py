"""The GEMM's weight operand: `GemmWeight` in the layout each backend reads, and how weights get there."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from mxdit.quant.formats import FORMATS, QuantizedArray, element_values, quantize, unpack_fp4, unpack_fp6

from ..numerics import BLOCK_K, pad_k, swiglu


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


def prepare_weight(w: jax.Array | QuantizedArray, fmt: str | None = None, *, backend: str = "mosaic",
                   mx_fold_rows: int = 128) -> GemmWeight:
    """A weight for `scaled_matmul`: `w` (n, k) float (quantized here to `fmt`) or a `QuantizedArray` quantized along
    k (axis -1), laid out for `backend` ("mosaic", "triton" or "reference": the reference takes either layout).
    `mx_fold_rows`: MX weights on the Mosaic path fold their exponents per `mx_fold_rows` x 128 tile (see
    `fold_mx_weight`). 128 (default) makes the kernel's promotion factor one number per tile (about 1.5x the speed
    of 1); 1 keeps more exponent range per channel, for weights where `fold_mx_error(w, rows=128)` is not 0."""
    if not isinstance(w, QuantizedArray):
        if fmt is None:
            raise ValueError("prepare_weight: give `fmt` for an unquantized weight")
        w = quantize(pad_k(jnp.asarray(w, jnp.float32)), fmt, axis=-1)
    if w.fmt not in WEIGHT_FORMATS:
        raise ValueError(f"scaled_matmul weights: format {w.fmt!r} is not supported; use one of {WEIGHT_FORMATS}")
    if len(w.shape) != 2 or w.axis != 1:
        raise ValueError(f"scaled_matmul weights: need a 2-D (out, in) array quantized along its last axis, got shape "
                         f"{w.shape} quantized along axis {w.axis}")
    n, k = w.shape
    kp = k + (-k) % BLOCK_K
    f = FORMATS[w.fmt]
    if f.kind in ("fp8", "int8"):
        # A rotated format's codes are padded to its rotation block (256), and the activations rotated with them
        data = pad_k(w.data)
        return GemmWeight(data, w.scale.reshape(n).astype(jnp.float32), None, w.fmt, "channel", n, data.shape[1])
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
    exact = pad_k(w.dequantize(jnp.float32))
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
        return GemmWeight(pad_k(data), exps, None, w.fmt, "mx", n, kp128)
    codes = pad_k(codes)
    g64 = codes.reshape(n, kp128 // 64, 2, MX_BLOCK)
    low = (g64[:, :, 0] & 0xF) | ((g64[:, :, 1] & 0xF) << 4)
    data = low.reshape(n, kp128 // 2).astype(jnp.uint8)
    high = None
    if f.element.bits == 6:
        g128 = (codes.reshape(n, kp128 // BLOCK_K, 4, MX_BLOCK) >> 4).astype(jnp.uint8)
        high = (g128[:, :, 0] | (g128[:, :, 1] << 2) | (g128[:, :, 2] << 4) | (g128[:, :, 3] << 6))
        high = high.reshape(n, kp128 // 4).astype(jnp.uint8)
    return GemmWeight(data, exps, high, w.fmt, "mx", n, kp128)




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
