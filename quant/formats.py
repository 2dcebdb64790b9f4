"""Low-precision number formats as named objects, and `quantize(x, fmt)` -> `QuantizedArray` (a pytree).

Formats:

| name | element | scale | block along `axis` |
|---|---|---|---|
| fp8_e4m3, fp8_e5m2 | FP8 | float32 amax * (1/max), per tensor or per row (channel/token) | - |
| mxfp8_e4m3, mxfp8_e5m2, mxfp6_e2m3, mxfp6_e3m2, mxfp4_e2m1 | FP8/FP6/FP4 | E8M0 (OCP MX v1.0) | 32 |
| nvfp4 | FP4 E2M1 | E4M3 per block times one float32 per tensor | 16 |
| int8 | INT8, symmetric | float32 per row | - |
| int8_rot | INT8 of the row times a block-diagonal Hadamard(256) | float32 per row | 256 (rotation) |
| int8_b32 | INT8, symmetric (GGUF's Q8_0, held exactly) | float16 amax / 127 per block | 32 |

Exact rules, all computed here in float32 arithmetic that is exact for these formats (so it runs under jit, on any
device, and matches ml_dtypes' casts bit for bit):
- Elements round to nearest, ties to even, keep subnormals, and saturate at the format's largest normal.
- MX: the block's shared exponent is floor(log2(amax)) - emax(element), clamped to E8M0's [-127, 127]; elements are
  x / 2^exp. Some values just below the saturating range clip (the spec's floor; no amax rounding up).
- An all-zero MX block gets the smallest scale, 2^-127 (E8M0 code 0x00), and zero elements.
- float32 subnormals (|x| < 2^-126) count as zero, in inputs and in dequantized results: XLA flushes them on CPU
  and GPU. (Subnormals of the element formats are kept.) The float32 scales too: a row (FP8, INT8) or tensor
  (NVFP4) whose scale would be subnormal, amax below the format's largest value times 2^-126 (5.3e-36 for E4M3),
  dequantizes to zeros.
- A block holding NaN or +-Inf gets the NaN scale (E8M0 code 0xFF): the whole block dequantizes to NaN. E8M0 has no
  infinity, so Inf is not kept. FP8/INT8 per-row scales: a row with NaN/Inf dequantizes to NaN.

Packing (the bit layout is part of the checkpoint format): FP4 codes go two to a byte, element 2i in the low nibble
and 2i+1 in the high nibble; FP6 codes go four to three bytes, element 4i+j in bits [6j, 6j + 6) of the
little-endian 24-bit word. FP8 elements are stored as JAX's float8 dtypes, INT8 as int8.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class ElementFormat:
    """A small float format without infinities: sign, `ebits` exponent bits (bias 2^(ebits-1) - 1), `mbits`
    mantissa bits; `max_normal` is its largest finite value (E4M3FN keeps one code for NaN, so 448)."""

    name: str
    ebits: int
    mbits: int
    max_normal: float

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits

    @property
    def bias(self) -> int:
        return 2 ** (self.ebits - 1) - 1

    @property
    def emax(self) -> int:
        """Exponent of the largest normal (the OCP spec's emax_elem)."""
        return math.floor(math.log2(self.max_normal))

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal."""
        return 1 - self.bias


E4M3 = ElementFormat("e4m3", 4, 3, 448.0)
E5M2 = ElementFormat("e5m2", 5, 2, 57344.0)
E2M3 = ElementFormat("e2m3", 2, 3, 7.5)
E3M2 = ElementFormat("e3m2", 3, 2, 28.0)
E2M1 = ElementFormat("e2m1", 2, 1, 6.0)


@dataclasses.dataclass(frozen=True)
class Format:
    """A named quantization format (see the module docstring's table)."""

    name: str
    kind: str  # "fp8" | "mx" | "nvfp4" | "int8" | "int8_block"
    element: ElementFormat | None  # None for INT8
    block: int | None = None
    rotated: bool = False
    doc: str = ""


FORMATS = {
    f.name: f
    for f in (
        Format("fp8_e4m3", "fp8", E4M3, doc="FP8 E4M3 with a float32 scale per tensor or per row"),
        Format("fp8_e5m2", "fp8", E5M2, doc="FP8 E5M2 with a float32 scale per tensor or per row"),
        Format("mxfp8_e4m3", "mx", E4M3, 32, doc="OCP MXFP8 (E4M3), 32-blocks, E8M0 scales"),
        Format("mxfp8_e5m2", "mx", E5M2, 32, doc="OCP MXFP8 (E5M2), 32-blocks, E8M0 scales"),
        Format("mxfp6_e2m3", "mx", E2M3, 32, doc="OCP MXFP6 (E2M3), 32-blocks, E8M0 scales, 4 codes in 3 bytes"),
        Format("mxfp6_e3m2", "mx", E3M2, 32, doc="OCP MXFP6 (E3M2), 32-blocks, E8M0 scales, 4 codes in 3 bytes"),
        Format("mxfp4_e2m1", "mx", E2M1, 32, doc="OCP MXFP4 (E2M1), 32-blocks, E8M0 scales, 2 codes a byte"),
        Format("nvfp4", "nvfp4", E2M1, 16, doc="NVFP4: E2M1, 16-blocks with E4M3 scales, one float32 tensor scale"),
        Format("int8", "int8", None, doc="symmetric INT8, float32 scale per row (channel/token)"),
        Format("int8_rot", "int8", None, 256, rotated=True,
               doc="INT8 of rows rotated by a block-diagonal Hadamard of 256 (outliers spread; cancels in x.W^T)"),
        Format("int8_b32", "int8_block", None, 32,
               doc="INT8 in 32-blocks with a float16 scale each: GGUF's Q8_0, held exactly; dequantized for XLA's "
                   "product (no GEMM kernel)"),
    )
}


def formats() -> list[str]:
    """The names `quantize` accepts."""
    return list(FORMATS)


# --------------------------------------------------------------------------------------------------------------------
# Element rounding and codes, in exact float32 arithmetic


def _floor_log2(a: jax.Array) -> jax.Array:
    """floor(log2(a)) for finite a > 0, exactly (frexp gives a = m * 2^e with m in [0.5, 1))."""
    return jnp.frexp(a)[1] - 1


def round_to_element(v: jax.Array, fmt: ElementFormat) -> jax.Array:
    """Round float32 `v` to the nearest value of `fmt` (ties to even, subnormals kept), saturating at max_normal."""
    a = jnp.abs(v)
    exponent = jnp.maximum(_floor_log2(jnp.where(a > 0, a, 1.0)), fmt.emin)
    ulp = jnp.ldexp(jnp.float32(1.0), exponent - fmt.mbits)
    q = jnp.round(a / ulp) * ulp  # jnp.round rounds half to even; a / ulp is exact (a power-of-two division)
    return jnp.sign(v) * jnp.minimum(q, fmt.max_normal)


def encode(q: jax.Array, fmt: ElementFormat) -> jax.Array:
    """Codes (uint8, in the low `fmt.bits` bits) of values already on the `fmt` grid."""
    sign = (q < 0) | ((q == 0) & jnp.signbit(q))
    a = jnp.abs(q)
    normal = a >= 2.0**fmt.emin
    exponent = _floor_log2(jnp.where(normal, a, 1.0))
    mant_normal = (a / jnp.ldexp(jnp.float32(1.0), exponent) - 1.0) * 2**fmt.mbits
    mant_sub = a / 2.0 ** (fmt.emin - fmt.mbits)
    exp_field = jnp.where(normal, exponent + fmt.bias, 0)
    mant_field = jnp.where(normal, mant_normal, mant_sub).astype(jnp.int32)
    code = (sign.astype(jnp.int32) << (fmt.ebits + fmt.mbits)) | (exp_field << fmt.mbits) | mant_field
    return code.astype(jnp.uint8)


def decode(code: jax.Array, fmt: ElementFormat) -> jax.Array:
    """float32 values of `fmt` codes."""
    code = code.astype(jnp.int32)
    sign = jnp.where((code >> (fmt.ebits + fmt.mbits)) & 1, -1.0, 1.0)
    exp_field = (code >> fmt.mbits) & (2**fmt.ebits - 1)
    mant = (code & (2**fmt.mbits - 1)).astype(jnp.float32) / 2**fmt.mbits
    value = jnp.where(exp_field == 0, mant * 2.0**fmt.emin,
                      (1.0 + mant) * jnp.ldexp(jnp.float32(1.0), exp_field - fmt.bias))
    return (sign * value).astype(jnp.float32)


# --------------------------------------------------------------------------------------------------------------------
# Packing


def pack_fp4(codes: jax.Array) -> jax.Array:
    """(..., n) 4-bit codes, n even -> (..., n / 2) bytes: element 2i low nibble, 2i+1 high nibble."""
    c = codes.reshape(*codes.shape[:-1], -1, 2).astype(jnp.uint8)
    return c[..., 0] | (c[..., 1] << 4)


def unpack_fp4(packed: jax.Array) -> jax.Array:
    return jnp.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


def pack_fp6(codes: jax.Array) -> jax.Array:
    """(..., n) 6-bit codes, n a multiple of 4 -> (..., 3n / 4) bytes: element 4i+j in bits [6j, 6j+6) of the
    little-endian 24-bit word of bytes 3i..3i+2."""
    c = codes.reshape(*codes.shape[:-1], -1, 4).astype(jnp.uint32)
    word = c[..., 0] | (c[..., 1] << 6) | (c[..., 2] << 12) | (c[..., 3] << 18)
    out = jnp.stack([word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF], axis=-1).astype(jnp.uint8)
    return out.reshape(*codes.shape[:-1], -1)


def unpack_fp6(packed: jax.Array) -> jax.Array:
    b = packed.reshape(*packed.shape[:-1], -1, 3).astype(jnp.uint32)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    codes = jnp.stack([(word >> (6 * j)) & 0x3F for j in range(4)], axis=-1).astype(jnp.uint8)
    return codes.reshape(*packed.shape[:-1], -1)


# --------------------------------------------------------------------------------------------------------------------
# The quantized array


@functools.partial(jax.tree_util.register_dataclass, data_fields=["data", "scale", "tensor_scale"],
                   meta_fields=["fmt", "shape", "axis"])
@dataclasses.dataclass(frozen=True)
class QuantizedArray:
    """A quantized tensor: `data` (FP8/INT8 elements, or packed FP6/FP4 bytes) with the quantized axis moved last and
    padded to whole blocks, `scale` (float32 per tensor/row, E8M0 or E4M3 per block), `tensor_scale` (NVFP4's
    float32, else None). `shape` and `axis` are the original array's; a pytree, so jit and orbax handle it."""

    data: jax.Array
    scale: jax.Array
    tensor_scale: jax.Array | None
    fmt: str
    shape: tuple[int, ...]
    axis: int

    @property
    def format(self) -> Format:
        return FORMATS[self.fmt]

    @property
    def nbytes(self) -> int:
        arrays = [self.data, self.scale] + ([self.tensor_scale] if self.tensor_scale is not None else [])
        return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in arrays)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The values this array stands for, in `dtype`, with the original shape."""
        return _dequantize(self).astype(dtype)


def quantize(x: jax.Array, fmt: str, axis: int = -1, *, per_tensor: bool = False) -> QuantizedArray:
    """Quantize `x` to `fmt`, blocks (or rows) running along `axis` (the GEMM reduction axis).

    `per_tensor` applies to fp8_* (one scale for the whole tensor instead of one per row). Jittable with `fmt`,
    `axis` and `per_tensor` static.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")
    f = FORMATS[fmt]
    x = jnp.asarray(x, jnp.float32)
    axis = axis % x.ndim if x.ndim else 0
    moved = jnp.moveaxis(x, axis, -1)
    n = moved.shape[-1]
    if f.block:
        pad = (-n) % f.block
        moved = jnp.pad(moved, [(0, 0)] * (moved.ndim - 1) + [(0, pad)])
    if f.kind == "fp8":
        data, scale, tensor_scale = _quantize_fp8(moved, f, per_tensor)
    elif f.kind == "mx":
        data, scale, tensor_scale = _quantize_mx(moved, f)
    elif f.kind == "nvfp4":
        data, scale, tensor_scale = _quantize_nvfp4(moved, f)
    elif f.kind == "int8_block":
        data, scale, tensor_scale = _quantize_int8_blocks(moved, f)
    else:
        data, scale, tensor_scale = _quantize_int8(moved, f)
    return QuantizedArray(data, scale, tensor_scale, fmt, tuple(x.shape), axis)


def _reciprocal(c: float) -> np.float32:
    """Scales are defined as amax * float32(1 / c): XLA turns a division by a constant into that multiplication
    anyway, and spelling it out makes the definition the same on every backend and in the tests."""
    return np.float32(1.0 / c)


def _finite_rows(x, axis=-1, keepdims=True):
    return jnp.all(jnp.isfinite(x), axis=axis, keepdims=keepdims)


def _quantize_fp8(x, f: Format, per_tensor: bool):
    amax = jnp.max(jnp.abs(x)) if per_tensor else jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax * _reciprocal(f.element.max_normal), 1.0).astype(jnp.float32)
    finite = jnp.all(jnp.isfinite(x)) if per_tensor else _finite_rows(x)
    scale = jnp.where(finite, scale, jnp.nan)
    # times the reciprocal: what XLA makes of a division by a broadcast scale, spelled out (as `_reciprocal`)
    q = round_to_element(jnp.where(jnp.isfinite(x), x * (1.0 / scale), 0.0), f.element)
    dtype = jnp.float8_e4m3fn if f.element is E4M3 else jnp.float8_e5m2
    return jax.lax.bitcast_convert_type(encode(q, f.element), dtype), scale, None


def _blocks(x, block):
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _pack(codes, element: ElementFormat):
    if element.bits == 4:
        return pack_fp4(codes)
    if element.bits == 6:
        return pack_fp6(codes)
    return jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn if element is E4M3 else jnp.float8_e5m2)


def _quantize_mx(x, f: Format):
    blocks = _blocks(x, f.block)
    amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    finite = _finite_rows(blocks)
    safe = jnp.where(finite & (amax > 0), amax, 1.0)
    exp = jnp.where(finite & (amax > 0), _floor_log2(safe) - f.element.emax, -127)
    exp = jnp.clip(exp, -127, 127)
    q = round_to_element(jnp.where(finite, jnp.ldexp(jnp.where(finite, blocks, 0.0), -exp), 0.0), f.element)
    codes = encode(q, f.element).reshape(x.shape)
    scale_bits = jnp.where(finite, exp + 127, 255)[..., 0].astype(jnp.uint8)
    return _pack(codes, f.element), jax.lax.bitcast_convert_type(scale_bits, jnp.float8_e8m0fnu), None


def _quantize_nvfp4(x, f: Format):
    amax_tensor = jnp.max(jnp.abs(jnp.where(jnp.isfinite(x), x, 0.0)))
    # The tensor scale maps the largest block scale (amax / 6) onto E4M3's largest value, 448.
    tensor_scale = jnp.where(amax_tensor > 0, amax_tensor * _reciprocal(E4M3.max_normal * E2M1.max_normal), 1.0)
    blocks = _blocks(x, f.block)
    finite = _finite_rows(blocks)
    amax = jnp.max(jnp.abs(jnp.where(finite, blocks, 0.0)), axis=-1, keepdims=True)
    block_scale = round_to_element(amax * _reciprocal(E2M1.max_normal) / tensor_scale, E4M3)
    effective = block_scale * tensor_scale
    q = round_to_element(jnp.where(finite & (effective > 0), blocks / jnp.where(effective > 0, effective, 1.0), 0.0),
                         E2M1)
    codes = encode(q, E2M1).reshape(x.shape)
    scale_codes = jnp.where(finite, encode(block_scale, E4M3), 0x7F)[..., 0]  # 0x7F: E4M3FN's NaN
    return pack_fp4(codes), jax.lax.bitcast_convert_type(scale_codes, jnp.float8_e4m3fn), tensor_scale.astype(jnp.float32)


def hadamard(n: int) -> np.ndarray:
    """The orthonormal Sylvester Hadamard matrix of order n (a power of two), float32."""
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


def _rotate(x, block, inverse=False):
    """Multiply each `block` run of the last axis by the orthonormal Hadamard (its own inverse: symmetric)."""
    h = jnp.asarray(hadamard(block))
    return (_blocks(x, block) @ h).reshape(x.shape)


def _quantize_int8(x, f: Format):
    if f.rotated:
        x = _rotate(x, f.block)
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax * _reciprocal(127.0), 1.0).astype(jnp.float32)
    scale = jnp.where(_finite_rows(x), scale, jnp.nan)
    q = jnp.clip(jnp.round(jnp.where(jnp.isfinite(x), x / scale, 0.0)), -127, 127).astype(jnp.int8)
    return q, scale, None


def _quantize_int8_blocks(x, f: Format):
    """GGUF's Q8_0: a float16 scale amax / 127 per block, codes rounded against the float16 scale (so that a
    dequantized Q8_0 block quantizes back to its own codes and scale)."""
    blocks = _blocks(x, f.block)
    amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax * _reciprocal(127.0), 1.0).astype(jnp.float16)
    scale = jnp.where(_finite_rows(blocks) & jnp.isfinite(scale), scale, jnp.nan)
    wide = scale.astype(jnp.float32)
    q = jnp.clip(jnp.round(jnp.where(jnp.isfinite(blocks), blocks / wide, 0.0)), -127, 127).astype(jnp.int8)
    return q.reshape(x.shape), scale[..., 0], None


def element_values(qa: QuantizedArray) -> jax.Array:
    """The unscaled element values of a block-scaled (MX, NVFP4) array: its codes unpacked and decoded, float32 of
    `qa.data`'s leading shape with the padded last axis."""
    f = qa.format
    if f.element.bits == 4:
        codes = unpack_fp4(qa.data)
    elif f.element.bits == 6:
        codes = unpack_fp6(qa.data)
    else:
        codes = jax.lax.bitcast_convert_type(qa.data, jnp.uint8)
    return decode(codes, f.element)


def _dequantize(qa: QuantizedArray) -> jax.Array:
    f = qa.format
    if f.kind in ("fp8", "int8"):
        values = qa.data.astype(jnp.float32) * qa.scale
        if f.rotated:
            values = _rotate(values, f.block)
    elif f.kind == "int8_block":
        values = _blocks(qa.data.astype(jnp.float32), f.block) * qa.scale.astype(jnp.float32)[..., None]
        values = values.reshape(qa.data.shape)
    else:
        elements = _blocks(element_values(qa), f.block)
        if f.kind == "mx":
            bits = jax.lax.bitcast_convert_type(qa.scale, jnp.uint8).astype(jnp.int32)[..., None]
            # ldexp, not a product with 2^exp: 2^-127 itself is a float32 subnormal that XLA would flush to zero
            values = jnp.where(bits == 255, jnp.nan, jnp.ldexp(elements, bits - 127))
        else:
            scale_codes = jax.lax.bitcast_convert_type(qa.scale, jnp.uint8)
            scale = jnp.where(scale_codes & 0x7F == 0x7F, jnp.nan, decode(scale_codes, E4M3)) * qa.tensor_scale
            values = elements * scale[..., None]
        values = values.reshape(*elements.shape[:-2], -1)
    n = qa.shape[qa.axis] if qa.shape else 1
    values = values[..., :n]
    return jnp.moveaxis(values, -1, qa.axis) if qa.shape else values.reshape(())
