"""Arithmetic the kernels share with one another and with their references: the activations' FP8 / INT8
quantization rule, the float32 reciprocals the scales use, SwiGLU as the models round it, and inline PTX for Triton
kernels. Every kernel imports from here; nothing here imports a kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mxdit.quant.formats import quantize

BLOCK_K = 128  # the K extent of an activation / weight scale block, and of every GEMM kernel's K step
FP8_MAX = 448.0
# INT8 and E4M3 scales are amax times these (as `quant.formats`' scales), values times the scale's reciprocal
# (`reciprocal_products`): what XLA computes for a division by them, spelled out.
INV_127, INV_448 = np.float32(1.0 / 127.0), np.float32(1.0 / 448.0)


def pad_k(x: jax.Array, multiple: int = BLOCK_K) -> jax.Array:
    """x with its last axis padded with zeros to a multiple of `multiple` (the GEMMs take K in whole blocks)."""
    pad = (-x.shape[-1]) % multiple
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]) if pad else x


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
    x = pad_k(x)
    m, k = x.shape
    if fmt != "fp8_e4m3":
        q = quantize(x, fmt, axis=-1)
        return q.data, q.scale.reshape(m)
    rows = x.reshape(m, k // BLOCK_K, BLOCK_K) if scaling == "block" else x
    values, scale = fp8_e4m3_rows(rows.astype(jnp.float32))
    if scaling == "token":
        return values, scale[..., 0]
    return values.reshape(m, k), scale[..., 0].T


def fp8_e4m3_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-row FP8 E4M3 quantization with `quant.formats`' rule (scale amax * float32(1/448), values times the
    scale's reciprocal: see `reciprocal_products`); NaN scale for rows holding NaN/Inf, whose values are
    zeroed."""
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax * INV_448, 1.0).astype(jnp.float32)
    scale = jnp.where(jnp.isfinite(amax), scale, jnp.nan)
    q = jnp.where(jnp.isfinite(x), jnp.clip(x * (1.0 / scale), -448.0, 448.0), 0.0)
    return q.astype(jnp.float8_e4m3fn), scale


def round_to(x: jax.Array, dtype) -> jax.Array:
    """x rounded to `dtype` and back to float32: the rounding a model step in `dtype` applies."""
    return x.astype(dtype).astype(jnp.float32)


def swiglu(gate_up: jax.Array) -> jax.Array:
    """`silu(gate) * up` of the stacked product [gate | up] along the last axis, rounded to its dtype after silu and
    after the product, each computed in float32: PyTorch's arithmetic for bf16 tensors (diffusers' model). XLA's bf16
    `jax.nn.silu` rounds differently (its logistic), so the models' unfused path agrees with this to bf16 rounding."""
    gate, up = jnp.split(gate_up.astype(jnp.float32), 2, axis=-1)
    silu = round_to(gate * jax.nn.sigmoid(gate), gate_up.dtype)
    return (silu * up).astype(gate_up.dtype)


def ptx_f32(code: str, *args) -> jax.Array:
    """Inline PTX inside a Triton kernel, a float32 result a value: `code` reads $1... (args, float32, broadcast to
    the first one's shape) and writes $0."""
    from jax.experimental.pallas import triton as pltriton

    shape = args[0].shape
    return pltriton.elementwise_inline_asm(
        code, args=[jnp.broadcast_to(a, shape) for a in args], constraints="=r" + ",r" * len(args), pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.float32)])[0]


_PRODUCT_PTX = "mul.rn.f32 $0, $1, $2;"
_ROUNDED_PRODUCT_PTX = "{ .reg .f32 q; mul.rn.f32 q, $1, $2; cvt.rni.f32.f32 $0, q; }"  # ties to even, as jnp.round


def _lowering_device_kind() -> str:
    """The device kind the kernel being traced is lowered for: the local GPU's, or the gfx architecture of the
    abstract device an ahead-of-time build names (`pallas_kernels.amd`); "" with no GPU to ask (the CPU's interpret
    mode)."""
    from jax._src.pallas.triton import gpu_info

    try:
        return gpu_info.get_device_kind()
    except Exception:
        return ""


def lowering_for_amd() -> bool:
    """Whether the kernel being traced is for an AMD GPU. Inline PTX does not assemble there."""
    return _lowering_device_kind().startswith("gfx")


FNUZ_FP8_ARCHS = ("gfx942",)  # AMD GPUs whose FP8 MFMA takes only the FNUZ encodings


def fp8_mfma_takes_fnuz() -> bool:
    """Whether the kernel being traced is for an AMD GPU whose FP8 MFMA multiplies only E4M3FNUZ (gfx942): Triton
    would widen OCP E4M3FN operands to f16 there and run the f16 MFMA at half the rate."""
    return _lowering_device_kind().split(":")[0] in FNUZ_FP8_ARCHS


def as_fnuz_halves(x: jax.Array) -> jax.Array:
    """E4M3FN codes as E4M3FNUZ, whose exponent bias is one more: the same bits are half the value. -0 (FNUZ's NaN
    code) becomes +0 and the NaNs FNUZ's NaN; everything else is exact."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.int32)
    bits = jnp.where(bits == 0x80, 0, jnp.where((bits & 0x7F) == 0x7F, 0x80, bits))
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint8), jnp.float8_e4m3fnuz)


def dot_fp8(a: jax.Array, b: jax.Array) -> jax.Array:
    """a @ b in float32 for E4M3FN tiles inside a Triton kernel, as the target's FP8 MFMA takes them: where it takes
    only FNUZ (`fp8_mfma_takes_fnuz`), on the operands' halves (`as_fnuz_halves`) times 4, which is exact."""
    if fp8_mfma_takes_fnuz():
        return jnp.dot(as_fnuz_halves(a), as_fnuz_halves(b), preferred_element_type=jnp.float32) * 4.0
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _round_half_even(x: jax.Array) -> jax.Array:
    """jnp.round(x) (ties to even) from floor, in a Triton kernel, which cannot lower `round`: a fraction x - floor(x)
    above 1/2 rounds up, a tie to the even neighbour; a zero result takes x's sign, as jnp.round's."""
    low = jnp.floor(x)
    fraction = x - low
    low_is_even = low - 2.0 * jnp.floor(low * 0.5) == 0.0
    up = (fraction > 0.5) | ((fraction == 0.5) & ~low_is_even)
    rounded = jnp.where(up, low + 1.0, low)
    return jnp.where((rounded == 0.0) & (x < 0.0), -0.0, rounded)


def reciprocal_products(ys, step, *, round_to_integer: bool = False):
    """[y * (1 / step) for y in ys], the reciprocal correctly rounded, each product rounded once (then to the nearest
    integer, ties to even: `round_to_integer`), inside a Triton kernel. step: one float32 for all of ys (a row's, a
    block's), or an array that broadcasts against each y (a step a channel: (1, d)). On NVIDIA GPUs in PTX (Triton's
    `/` is the approximate `div.full.f32` there); on AMD GPUs the plain expression, whose float32 division LLVM's
    AMDGPU backend rounds correctly."""
    step = jnp.reshape(step, (1, 1)) if jnp.ndim(step) < 2 else step
    if lowering_for_amd():
        reciprocal = 1.0 / step
        products = [y * reciprocal for y in ys]
        return [_round_half_even(q) for q in products] if round_to_integer else products
    reciprocal = ptx_f32("rcp.rn.f32 $0, $1;", step)
    code = _ROUNDED_PRODUCT_PTX if round_to_integer else _PRODUCT_PTX
    return [ptx_f32(code, y, reciprocal) for y in ys]
