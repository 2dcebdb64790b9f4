"""INT8-QK attention (SageAttention-style) for DiTs: the plain-jnp reference that defines its numerics.

The Pallas kernels (Mosaic GPU / Triton lowering, issue #8) must agree with `int8_attention_reference`; it is also
what CPU tests measure against exact attention. The recipe (`../shared/reference/formats_and_kernels.md`):

- K smoothing: the mean of K over the key sequence (per head and channel) is subtracted. Softmax is invariant to a
  per-row constant, so the output is unchanged, while the channel outliers real DiTs have in K stop dominating the
  INT8 range.
- Q (with the softmax scale folded in) and smoothed K are quantized to INT8 per block of `block_q` query / `block_k`
  key tokens and head, scale = amax / 127; Q.K^T is an INT8 product with INT32 accumulation, rescaled by the two
  block scales; the softmax runs in float32.
- P.V in bfloat16 (`pv="bf16"`), or in FP8 (`pv="fp8"`): V per channel to E4M3 (scale amax / 448), P with the fixed
  scale 448 (P lies in [0, 1]), float32 accumulation.
- GQA without repeating K/V in memory (query head n reads KV head n // group); a key padding mask given as the number
  of valid keys per batch element, as the models pass it (`kv_lengths`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _quantize_int8_blocks(x: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """x (batch, seq, heads, dim) -> int8 values and float32 scales (batch, seq_blocks, heads), per `block` tokens."""
    b, s, h, d = x.shape
    pad = (-s) % block
    xp = jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, (s + pad) // block, block, h, d)
    amax = jnp.max(jnp.abs(xp), axis=(2, 4))
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    q = jnp.clip(jnp.round(xp / scale[:, :, None, :, None]), -127, 127).astype(jnp.int8)
    return q.reshape(b, s + pad, h, d)[:, :s], scale


def int8_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, *, kv_lengths: jax.Array | None = None,
                             pv: str = "bf16", block_q: int = 128, block_k: int = 64, smooth_k: bool = True,
                             scale: float | None = None) -> jax.Array:
    """Non-causal attention with INT8 Q.K^T, as the kernels compute it.

    Args:
        q: (batch, q_len, heads, head_dim); k, v: (batch, kv_len, kv_heads, head_dim), heads a multiple of kv_heads.
        kv_lengths: (batch,) int, keys at positions >= kv_lengths[b] are masked; None: all valid.
        pv: "bf16" or "fp8" (the P.V product's precision).
    Returns:
        (batch, q_len, heads, head_dim) float32.
    """
    if pv not in ("bf16", "fp8"):
        raise ValueError(f"pv must be 'bf16' or 'fp8', got {pv!r}")
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    if h % hk:
        raise ValueError(f"query heads {h} must be a multiple of key/value heads {hk}")
    group = h // hk
    scale = d**-0.5 if scale is None else scale
    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
    valid = jnp.ones((b, sk), bool) if kv_lengths is None else jnp.arange(sk)[None, :] < kv_lengths[:, None]
    # Masked keys and values must not enter any scale (a block's amax, V's channel range): zero them.
    keep = valid[:, :, None, None]
    k32, v32 = jnp.where(keep, k32, 0.0), jnp.where(keep, v32, 0.0)
    if smooth_k:
        count = jnp.maximum(valid.sum(axis=1), 1)[:, None, None, None]
        k32 = jnp.where(keep, k32 - jnp.sum(k32, axis=1, keepdims=True) / count, 0.0)
    qi, qs = _quantize_int8_blocks(q32 * scale, block_q)
    ki, ks = _quantize_int8_blocks(k32, block_k)
    # (batch, heads, q_len, kv_len) int32 products, GQA by grouping query heads per KV head
    qi_g = qi.reshape(b, sq, hk, group, d)
    s_int = jnp.einsum("bqhgd,bkhd->bhgqk", qi_g, ki, preferred_element_type=jnp.int32)
    q_scale = jnp.repeat(qs, block_q, axis=1)[:, :sq].reshape(b, sq, hk, group).transpose(0, 2, 3, 1)
    k_scale = jnp.repeat(ks, block_k, axis=1)[:, :sk].transpose(0, 2, 1)[:, :, None, None, :]
    logits = s_int.astype(jnp.float32) * q_scale[..., None] * k_scale
    logits = jnp.where(valid[:, None, None, None, :], logits, -jnp.inf)
    p = jax.nn.softmax(logits, axis=-1)
    if pv == "bf16":
        out = jnp.einsum("bhgqk,bkhd->bqhgd", p.astype(jnp.bfloat16), v32.astype(jnp.bfloat16),
                         preferred_element_type=jnp.float32)
    else:
        v_amax = jnp.max(jnp.abs(v32), axis=1, keepdims=True)
        v_scale = jnp.where(v_amax > 0, v_amax / 448.0, 1.0)
        v8 = (v32 / v_scale).astype(jnp.float8_e4m3fn)
        p8 = (p * 448.0).astype(jnp.float8_e4m3fn)
        acc = jnp.einsum("bhgqk,bkhd->bqhgd", p8, v8, preferred_element_type=jnp.float32)
        out = acc / 448.0 * v_scale[:, :, :, None, :]
    return out.reshape(b, sq, h, d)
