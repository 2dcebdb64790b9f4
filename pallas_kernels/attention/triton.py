"""INT8-QK attention through Pallas' Triton lowering (portable: INT8 dots with INT32 accumulation), and the Triton
pass that makes FP8 V for either backend's FP8 P.V."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..numerics import dot_fp8, reciprocal_products
from .config import AttentionConfig
from .reference import _key_lengths, _masked_values, _v_fp8_scale_and_mean


def triton_attention(qi, qs, ki, ks, v, kv_lengths, *, pv: str, config: AttentionConfig, interpret: bool):
    """The attention kernel on quantized Q and K (batch, seq, heads, dim) int8 with scales (batch, seq blocks,
    heads), and V (batch, kv_len, kv_heads, dim) in a float dtype (the keys past `kv_lengths` are zeroed here).
    Returns float32."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    b, sq, h, d = qi.shape
    sk, hk = ki.shape[1], ki.shape[2]
    group = h // hk
    block_q, block_k = config.block_q, config.block_k
    lengths = _key_lengths(kv_lengths, b, sk)
    pad_q, pad_k = (-sq) % block_q, (-sk) % block_k
    # (batch, heads, seq, dim) layouts padded to whole blocks; scales (batch, heads, blocks)
    qi = jnp.pad(qi, ((0, 0), (0, pad_q), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
    ki = jnp.pad(ki, ((0, 0), (0, pad_k), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
    if pv == "fp8":
        # FP8 V goes in as (dim, seq): K-major, the layout Hopper's 8-bit wgmma takes its B operand in (with V as
        # (seq, dim) the Triton lowering's FP8 P.V was wrong on Hopper, though right in interpret
        # mode); made by the Mosaic kernel's pass, without its key permutation.
        vb, v_scale, _ = v_fp8_operand(v, block_k, permute_keys=False, kv_lengths=kv_lengths, interpret=interpret)
    else:
        v_scale = jnp.ones((b, hk, d), jnp.float32)
        vb = _masked_values(v, kv_lengths, jnp.bfloat16)
        vb = jnp.pad(vb, ((0, 0), (0, pad_k), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
    qs, ks = qs.transpose(0, 2, 1), ks.transpose(0, 2, 1)
    n_q, n_k = qi.shape[2] // block_q, ki.shape[2] // block_k

    def kernel(lengths_ref, q_ref, qs_ref, k_ref, ks_ref, v_ref, vs_ref, o_ref):
        bh, iq = pl.program_id(0), pl.program_id(1)
        length = lengths_ref[bh // h]
        q_blk = q_ref[0, 0]  # (block_q, d) int8
        q_scale = qs_ref[0, 0, iq]

        def body(j, carry):
            m, l, acc = carry
            start = pl.multiple_of(j * block_k, block_k)
            k_blk = k_ref[0, 0, pl.ds(start, block_k), :]
            s = jnp.dot(q_blk, k_blk.T, preferred_element_type=jnp.int32).astype(jnp.float32)
            s = s * (q_scale * ks_ref[0, 0, j])
            cols = start + jax.lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
            s = jnp.where(cols < length, s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            alpha = jnp.exp(m - m_new)
            p = jnp.exp(s - m_new[:, None])
            l_new = l * alpha + jnp.sum(p, axis=1)
            if pv == "fp8":
                v_blk = v_ref[0, 0, :, pl.ds(start, block_k)].T
                pv_blk = dot_fp8((p * 448.0).astype(jnp.float8_e4m3fn), v_blk)
                pv_blk = pv_blk * (1.0 / 448.0)
            else:
                v_blk = v_ref[0, 0, pl.ds(start, block_k), :]
                pv_blk = jnp.dot(p.astype(jnp.bfloat16), v_blk, preferred_element_type=jnp.float32)
            acc = acc * alpha[:, None] + pv_blk
            return m_new, l_new, acc

        init = (jnp.full((block_q,), -jnp.inf, jnp.float32), jnp.zeros((block_q,), jnp.float32),
                jnp.zeros((block_q, d), jnp.float32))
        n_blocks = (length + block_k - 1) // block_k
        _, l, acc = jax.lax.fori_loop(0, n_blocks, body, init)
        o_ref[0, 0] = (acc / l[:, None] * vs_ref[0, 0][None, :]).astype(o_ref.dtype)

    kv_head = lambda bh: (bh // h, (bh % h) // group)
    out = pl.pallas_call(
        kernel,
        grid=(b * h, n_q),
        in_specs=[
            pl.no_block_spec,  # the (batch,) key lengths, whole
            pl.BlockSpec((1, 1, block_q, d), lambda bh, iq: (bh // h, bh % h, iq, 0)),
            pl.BlockSpec((1, 1, n_q), lambda bh, iq: (bh // h, bh % h, 0)),
            pl.BlockSpec((1, 1, ki.shape[2], d), lambda bh, iq: (*kv_head(bh), 0, 0)),
            pl.BlockSpec((1, 1, n_k), lambda bh, iq: (*kv_head(bh), 0)),
            pl.BlockSpec((1, 1, *vb.shape[2:]), lambda bh, iq: (*kv_head(bh), 0, 0)),
            pl.BlockSpec((1, 1, d), lambda bh, iq: (*kv_head(bh), 0)),
        ],
        out_specs=pl.BlockSpec((1, 1, block_q, d), lambda bh, iq: (bh // h, bh % h, iq, 0)),
        out_shape=jax.ShapeDtypeStruct((b, h, n_q * block_q, d), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="int8_attention",
    )(lengths, qi, qs, ki, ks, vb, v_scale)
    return out[:, :, :sq].transpose(0, 2, 1, 3)


# --------------------------------------------------------------------------------------------------------------------
# The Hopper kernel: Pallas Mosaic GPU (wgmma, TMA, warp specialization), FA3's structure with INT8 Q.K^T

def v_fp8_operand(v: jax.Array, block: int, *, permute_keys: bool, kv_lengths: jax.Array | None = None,
                  interpret: bool = False, smooth: bool = False,
                  scale_and_mean: tuple[jax.Array, jax.Array] | None = None,
                  heads: tuple[int, int] | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """V as the kernels' FP8 P.V takes it, in one Triton pass: V (batch, kv_len, kv_heads, dim) in a float dtype
    (read as it is: the keys past `kv_lengths` are zeroed in the pass, and their values do not enter the scales)
    divided by its channel scales (`_v_fp8_scale_and_mean`) and rounded to E4M3, out as V^T (batch, kv_heads, dim,
    keys), keys padded to whole blocks of `block` (a multiple of 16): the K-major layout 8-bit wgmma takes its B
    operand in. `permute_keys`: keys in `_pv_key_order` within each 16 (key 8 * hi + 2 * c + lo to position
    4 * c + 2 * hi + lo). `smooth`: V's channel means over the valid keys are subtracted first (zero means
    otherwise), and the scales are those of V so centred. Returns (V^T, the scales, the means (batch, kv_heads,
    dim)). Each program transposes a (block, dim) tile in registers, the permutation inside (cheaper than XLA's
    8-bit transpose and gather).
    `scale_and_mean`: the scales and means as `_v_fp8_scale_and_mean` gives them for `smooth`, computed before (by
    the K prologue's sums pass, `prologue.rms_rope_quantize(values=...)`); else an XLA reduction here makes them.
    `heads` (first, count): V is those heads of `v`, read in place (a stacked projection's; a slice handed to the
    pass would be copied first)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    if block % 16:
        raise ValueError(f"v_fp8_operand: block {block} must be a multiple of 16")
    first, hk = (0, v.shape[2]) if heads is None else heads
    pad = (-v.shape[1]) % block
    if scale_and_mean is None or pad:  # (the padded copy takes V's heads only)
        v, first = v[:, :, first:first + hk], 0
    v_scale, mean = _v_fp8_scale_and_mean(v, kv_lengths, smooth) if scale_and_mean is None else scale_and_mean
    lengths = _key_lengths(kv_lengths, v.shape[0], v.shape[1])
    if pad:  # zero keys (past the lengths): a copy, where a sequence is no multiple of the block
        v = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0)))
    b, keys, _, d = v.shape

    def kernel(lengths_ref, v_ref, s_ref, m_ref, o_ref):
        rows = pl.program_id(2) * block + jax.lax.broadcasted_iota(jnp.int32, (block, d), 0)
        centred = v_ref[...].astype(jnp.float32) - m_ref[...][None, :]
        if interpret:
            y = centred * (1.0 / s_ref[...])[None, :]
        else:  # the reference's products (Triton's `/` is the approximate div.full.f32)
            (y,) = reciprocal_products([centred], s_ref[...][None, :])
        y = jnp.where(rows < lengths_ref[pl.program_id(0)], y, 0.0)
        if permute_keys:  # (16-key group, hi, c, lo, dim) -> (dim, group, c, hi, lo)
            y = y.reshape(block // 16, 2, 4, 2, d).transpose(4, 0, 2, 1, 3).reshape(d, block)
        else:
            y = y.T
        o_ref[...] = y.astype(o_ref.dtype)

    return pl.pallas_call(
        kernel,
        grid=(b, hk, keys // block),
        in_specs=[pl.no_block_spec,
                  pl.BlockSpec((None, block, None, d), lambda bi, hi, ki: (bi, ki, hi + first, 0)),
                  pl.BlockSpec((None, None, d), lambda bi, hi, ki: (bi, hi, 0)),
                  pl.BlockSpec((None, None, d), lambda bi, hi, ki: (bi, hi, 0))],
        out_specs=pl.BlockSpec((None, None, d, block), lambda bi, hi, ki: (bi, hi, 0, ki)),
        out_shape=jax.ShapeDtypeStruct((b, hk, d, keys), jnp.float8_e4m3fn),
        compiler_params=pltriton.CompilerParams(num_warps=8, num_stages=2),
        interpret=interpret,
        name="v_fp8_operand",
    )(lengths, v, v_scale, mean), v_scale, mean


