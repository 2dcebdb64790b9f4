"""The GEMM's definition in plain jnp: what every kernel must compute."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mxdit.quant.formats import FORMATS, decode

from ..numerics import BLOCK_K
from .weights import MX_BLOCK, GemmWeight, swiglu_pairs


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
