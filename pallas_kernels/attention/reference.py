"""The numerics of INT8-QK attention in plain jnp: the reference the kernels must agree with, and the quantization
steps they share (docs/kernels/int8_attention.md states the recipe and the kernels' tolerances against it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..numerics import INV_127, INV_448



def _quantize_int8_blocks(x: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """x (batch, seq, heads, dim) -> int8 values and float32 scales (batch, seq_blocks, heads), per `block` tokens."""
    b, s, h, d = x.shape
    pad = (-s) % block
    xp = jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, (s + pad) // block, block, h, d)
    amax = jnp.max(jnp.abs(xp), axis=(2, 4))
    scale = jnp.where(amax > 0, amax * INV_127, 1.0)
    q = jnp.clip(jnp.round(xp * (1.0 / scale)[:, :, None, :, None]), -127, 127).astype(jnp.int8)
    return q.reshape(b, s + pad, h, d)[:, :s], scale


def _heads_and_scale(q, k, scale):
    """(query heads per KV head, softmax scale): heads must be a multiple of KV heads; the scale defaults to
    head_dim^-0.5."""
    return _group_and_scale(q.shape[2], k.shape[2], q.shape[3], scale)


def _group_and_scale(h: int, hk: int, d: int, scale):
    if h % hk:
        raise ValueError(f"query heads {h} must be a multiple of key/value heads {hk}")
    return h // hk, d**-0.5 if scale is None else scale


def _check_pv(pv: str) -> None:
    if pv not in ("bf16", "fp8"):
        raise ValueError(f"pv must be 'bf16' or 'fp8', got {pv!r}")


def _check_pv_accumulation(pv: str, pv_accumulation: str) -> None:
    if pv_accumulation not in ("two_level", "in_place") or (pv_accumulation == "in_place" and pv != "fp8"):
        raise ValueError(f"pv_accumulation must be 'two_level', or 'in_place' with pv='fp8'; got {pv_accumulation!r} "
                         f"with pv={pv!r}")


def _key_lengths(kv_lengths, batch: int, kv_len: int) -> jax.Array:
    """(batch,) int32 numbers of valid keys: `kv_lengths`, or every key without a mask."""
    return jnp.full((batch,), kv_len, jnp.int32) if kv_lengths is None else kv_lengths.astype(jnp.int32)


def _valid_keys(kv_lengths, batch: int, kv_len: int) -> jax.Array:
    """(batch, kv_len) bool: which keys are attended to."""
    return jnp.arange(kv_len)[None, :] < _key_lengths(kv_lengths, batch, kv_len)[:, None]


def _masked_values(v: jax.Array, kv_lengths, dtype) -> jax.Array:
    """V (batch, kv_len, kv_heads, dim) in `dtype` with the keys past `kv_lengths` zeroed (none masked: None)."""
    if kv_lengths is None:
        return v.astype(dtype)
    return jnp.where(_valid_keys(kv_lengths, v.shape[0], v.shape[1])[:, :, None, None], v.astype(dtype), 0)


def _v_fp8_scale_and_mean(v: jax.Array, kv_lengths, smooth: bool) -> tuple[jax.Array, jax.Array]:
    """V's E4M3 scales per channel, amax / 448 over the valid keys, and with `smooth` its channel means over them
    (zero otherwise), the scales then V centred's: (batch, kv_heads, dim) each from V (batch, kv_len, kv_heads,
    dim). One XLA reduction (max, min and sum): max |v - mean| = max(max v - mean, mean - min v)."""
    valid = _valid_keys(kv_lengths, v.shape[0], v.shape[1])[:, :, None, None]
    v32 = v.astype(jnp.float32)
    v_range = (jnp.max(jnp.where(valid, v32, -jnp.inf), axis=1), jnp.min(jnp.where(valid, v32, jnp.inf), axis=1),
               jnp.sum(jnp.where(valid, v32, 0.0), axis=1))
    return _v_fp8_scale_and_mean_of_range(*v_range, _key_lengths(kv_lengths, v.shape[0], v.shape[1]), smooth)


def _v_fp8_scale_and_mean_of_range(hi, lo, total, lengths, smooth: bool) -> tuple[jax.Array, jax.Array]:
    """`_v_fp8_scale_and_mean` from V's range over the valid keys: their max, min and sum (batch, kv_heads, dim)
    each, and the (batch,) numbers of valid keys."""
    if smooth:
        mean = total / jnp.maximum(lengths, 1).astype(jnp.float32)[:, None, None]
    else:
        mean = jnp.zeros_like(hi)
    amax = jnp.maximum(hi - mean, mean - lo)  # -inf without valid keys
    return jnp.where(amax > 0, amax * INV_448, 1.0), mean


def _quantize_v_fp8(v: jax.Array, kv_lengths=None, smooth: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """V (batch, kv_len, kv_heads, dim) per channel to E4M3 (`_v_fp8_scale_and_mean`), masked keys zero. Returns the
    E4M3 values, the scales and the means (batch, kv_heads, dim)."""
    v_scale, mean = _v_fp8_scale_and_mean(v, kv_lengths, smooth)
    valid = _valid_keys(kv_lengths, v.shape[0], v.shape[1])[:, :, None, None]
    centred = jnp.where(valid, v.astype(jnp.float32) - mean[:, None], 0.0)
    return (centred * (1.0 / v_scale)[:, None]).astype(jnp.float8_e4m3fn), v_scale, mean


def _prologue(q, k, v, kv_lengths, block_q, block_k, scale, smooth_k=True):
    """Masked keys and values zeroed (they must not enter any scale: a block's amax, V's channel range), K smoothed
    over the valid keys, Q (times the softmax scale) and K quantized to INT8 per block (`int8_qk_prologue` does the
    same in one fused pass, from the raw projections). Returns qi, qs, ki, ks, v (float32) and the (batch, kv_len)
    validity."""
    valid = _valid_keys(kv_lengths, k.shape[0], k.shape[1])
    keep = valid[:, :, None, None]
    k32, v32 = jnp.where(keep, k.astype(jnp.float32), 0.0), jnp.where(keep, v.astype(jnp.float32), 0.0)
    if smooth_k:
        count = jnp.maximum(valid.sum(axis=1), 1)[:, None, None, None]
        k32 = jnp.where(keep, k32 - jnp.sum(k32, axis=1, keepdims=True) / count, 0.0)
    qi, qs = _quantize_int8_blocks(q.astype(jnp.float32) * scale, block_q)
    ki, ks = _quantize_int8_blocks(k32, block_k)
    return qi, qs, ki, ks, v32, valid


def int8_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, *, kv_lengths: jax.Array | None = None,
                             pv: str = "bf16", block_q: int = 128, block_k: int = 64, smooth_k: bool = True,
                             scale: float | None = None, smooth_v: bool = False) -> jax.Array:
    """Non-causal attention with INT8 Q.K^T, as the kernels compute it.

    Args:
        q: (batch, q_len, heads, head_dim); k, v: (batch, kv_len, kv_heads, head_dim), heads a multiple of kv_heads.
        kv_lengths: (batch,) int, keys at positions >= kv_lengths[b] are masked; None: all valid.
        pv: "bf16" or "fp8" (the P.V product's precision).
        smooth_v: (FP8 P.V) V's channel means over the valid keys subtracted before its FP8 rounding, added back to
            the output (as the Mosaic kernel's FP8 P.V does).
    Returns:
        (batch, q_len, heads, head_dim) float32.
    """
    _check_pv(pv)
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    group, scale = _heads_and_scale(q, k, scale)
    qi, qs, ki, ks, v32, valid = _prologue(q, k, v, kv_lengths, block_q, block_k, scale, smooth_k)
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
        v8, v_scale, mean = _quantize_v_fp8(v32, kv_lengths, smooth_v)
        p8 = (p * 448.0).astype(jnp.float8_e4m3fn)
        acc = jnp.einsum("bhgqk,bkhd->bqhgd", p8, v8, preferred_element_type=jnp.float32)
        out = acc / 448.0 * v_scale[:, None, :, None, :] + mean[:, None, :, None, :]
    return out.reshape(b, sq, h, d)


# --------------------------------------------------------------------------------------------------------------------
# The portable kernel: Pallas with the Triton lowering (INT8 dots with INT32 accumulation), bf16 P.V
def rms_rope_reference(x: jax.Array, norm_weight: jax.Array, eps: float, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """What the models do to Q and K before attention, in float32 throughout: RMSNorm over head_dim with the
    zero-centred scale (`1 + weight`), then the rotary embedding of interleaved channel pairs.

    x: (batch, seq, heads, head_dim); norm_weight: (head_dim,); cos, sin: (seq, head_dim) or (batch, seq, head_dim),
    each frequency repeated for its pair (model/layers.py's tables). Returns float32 of x's shape."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps) * (1.0 + norm_weight)
    real, imag = y[..., 0::2], y[..., 1::2]
    rotated = jnp.stack([-imag, real], axis=-1).reshape(y.shape)
    return y * cos[..., None, :] + rotated * sin[..., None, :]


def _deinterleave(x: jax.Array) -> jax.Array:
    """Channels [0, 1, 2, 3, ...] -> [0, 2, ..., 1, 3, ...]: the order the fused prologue writes Q and K in. Q.K^T
    does not depend on the channel order as long as Q and K share it."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)

def _block_steps_of_range(key_range: jax.Array, mean: jax.Array) -> jax.Array:
    """INT8 steps (batch, blocks, heads) of K smoothed by `mean` (batch, heads, dim) from each block's per-channel
    max and min of the valid keys (batch, blocks, heads, 2, dim): max |x - m| over a block's keys is max(hi - m,
    m - lo) channel by channel, exactly (float32 subtraction of m is monotonic, and its rounding symmetric), so these
    are the steps the K pass would find by reducing over its tile (0 where no key is valid: step 1)."""
    m = mean[:, None]
    amax = jnp.max(jnp.maximum(key_range[:, :, :, 0] - m, m - key_range[:, :, :, 1]), axis=-1)
    amax = jnp.maximum(amax, 0.0)
    return jnp.where(amax > 0, amax * INV_127, 1.0)


def _round_half_even(x: jax.Array) -> jax.Array:
    """jnp.round (half to even) from floor alone: the Triton lowering has no `round` primitive (found on the GPU),
    and the add-and-subtract-2^23 trick is folded away by XLA in interpret mode."""
    r = jnp.floor(x + 0.5)
    tie_to_odd = (r - x == 0.5) & (r - 2.0 * jnp.floor(r * 0.5) == 1.0)
    return jnp.where(tie_to_odd, r - 1.0, r)

