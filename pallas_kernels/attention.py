"""INT8-QK attention (SageAttention-style) for DiTs: the plain-jnp reference that defines its numerics, and the
Pallas kernels that compute it (Triton lowering, portable; Mosaic GPU, Hopper).

The kernels must agree with `int8_attention_reference`, which CPU tests also measure against exact attention. The
Mosaic GPU (Hopper, wgmma) kernel `_int8_attention_mosaic` is `int8_attention(backend="mosaic")`; the Triton one
reaches about half of cuDNN's speed on the H200 (NOTES.md). The recipe (`../shared/reference/formats_and_kernels.md`):

- K smoothing: the mean of K over the key sequence (per head and channel) is subtracted. Softmax is invariant to a
  per-row constant, so the output is unchanged, while the channel outliers real DiTs have in K stop dominating the
  INT8 range.
- Q (with the softmax scale folded in) and smoothed K are quantized to INT8 per block of `block_q` query / `block_k`
  key tokens and head, scale = amax / 127 (the Mosaic kernel that makes Q from the raw projection itself: per query
  row, `block_q=1` here); Q.K^T is an INT8 product with INT32 accumulation, rescaled by the two
  block scales; the softmax runs in float32.
- P.V in bfloat16 (`pv="bf16"`), or in FP8 (`pv="fp8"`): V per channel to E4M3 (scale amax / 448), P with the fixed
  scale 448 (P lies in [0, 1]), float32 accumulation.
- GQA without repeating K/V in memory (query head n reads KV head n // group); a key padding mask given as the number
  of valid keys per batch element, as the models pass it (`kv_lengths`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from .activations import reciprocal_products

# INT8 and E4M3 scales are amax times these (as `quant.formats`' scales), values times the scale's reciprocal
# (`activations.reciprocal_products`): what XLA computes for a division by them, spelled out.
_INV_127, _INV_448 = np.float32(1.0 / 127.0), np.float32(1.0 / 448.0)


def _quantize_int8_blocks(x: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """x (batch, seq, heads, dim) -> int8 values and float32 scales (batch, seq_blocks, heads), per `block` tokens."""
    b, s, h, d = x.shape
    pad = (-s) % block
    xp = jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, (s + pad) // block, block, h, d)
    amax = jnp.max(jnp.abs(xp), axis=(2, 4))
    scale = jnp.where(amax > 0, amax * _INV_127, 1.0)
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
    return jnp.where(amax > 0, amax * _INV_448, 1.0), mean


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
            the output (as the Mosaic kernel's `smooth_v`).
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


def int8_attention(q, k, v, *, kv_lengths=None, pv: str = "bf16", block_q: int = 64, block_k: int = 64,
                   scale: float | None = None, interpret: bool = False, num_warps: int = 4, num_stages: int = 2,
                   backend: str = "triton", out_dtype=jnp.float32, pv_accumulation: str = "two_level") -> jax.Array:
    """INT8-QK attention through a Pallas kernel; same arguments and result as `int8_attention_reference`
    (online softmax instead of a full one: equal up to rounding).

    pv "bf16": P.V in bf16. "fp8": V per channel in E4M3 (scale amax / 448, over the valid keys), P (the running,
    unnormalised exponentials, in [0, 1]) times 448 in E4M3; each key block's FP8 product accumulates in float32 in
    the dot, then adds into the float32 accumulator (two-level accumulation); the V scale is applied once at the end.
    Each program walks the key blocks up to its batch element's length. GQA reads KV head n // group, so K/V are
    never repeated in memory.

    out_dtype: the result's dtype (float32, as the reference, by default; the models ask for theirs, and the Mosaic
    kernel then writes it directly).

    backend "triton": the portable kernel (`_int8_attention_kernel`; num_warps, num_stages are Triton's).
    "mosaic": the Hopper kernel (`_int8_attention_mosaic`; block_q must be 64, the rows of one warpgroup, and
    num_stages is the depth of its K/V ring).

    pv_accumulation (FP8 P.V, mosaic): "two_level" as above, or "in_place": every block's FP8 product accumulates in
    the running wgmma accumulator, whose adds keep fewer bits than float32's. Measured on the H200 (NOTES.md, session
    9): 9% faster at 4608 tokens, and its error against exact attention the two-level one's within 0.1% (4608
    tokens) and 0.4% (16384) of that error; the error's drift grows with the sequence. Those inputs had zero-mean V:
    where V's channels have means, in-place sums come out low (7% at 4224 keys, session 13: the accumulator
    truncates), unless V is smoothed, as the Mosaic kernel does by default (`MOSAIC_SMOOTH_V`)."""
    _, scale = _heads_and_scale(q, k, scale)
    _check_pv(pv)
    qi, qs, ki, ks, v32, _ = _prologue(q, k, v, kv_lengths, block_q, block_k, scale)
    return _attention_backend(qi, qs, ki, ks, v32, kv_lengths, pv=pv, block_q=block_q, block_k=block_k,
                              interpret=interpret, num_warps=num_warps, num_stages=num_stages, backend=backend,
                              out_dtype=out_dtype, pv_accumulation=pv_accumulation)


def _attention_backend(qi, qs, ki, ks, v, kv_lengths, *, pv, block_q, block_k, interpret, num_warps, num_stages,
                       backend, out_dtype, pv_accumulation="two_level"):
    _check_pv_accumulation(pv, pv_accumulation)
    if backend == "triton":
        if pv_accumulation != "two_level":
            raise ValueError("pv_accumulation='in_place' is the mosaic backend's (the Triton kernel adds each block's "
                             "product to its float32 accumulator)")
        return _int8_attention_kernel(qi, qs, ki, ks, v, kv_lengths, pv=pv, block_q=block_q, block_k=block_k,
                                      interpret=interpret, num_warps=num_warps,
                                      num_stages=num_stages).astype(out_dtype)
    if backend == "mosaic":
        if block_q != MOSAIC_ROWS:
            raise ValueError(f"the mosaic backend quantizes Q per {MOSAIC_ROWS} rows (one warpgroup): block_q must "
                             f"be {MOSAIC_ROWS}, got {block_q}")
        return _int8_attention_mosaic(qi, qs, ki, ks, v, kv_lengths, pv=pv, block_k=block_k, num_stages=num_stages,
                                      interpret=interpret, out_dtype=out_dtype, pv_accumulation=pv_accumulation)
    raise ValueError(f"backend must be 'triton' or 'mosaic', got {backend!r}")


def _int8_attention_kernel(qi, qs, ki, ks, v, kv_lengths, *, pv, block_q, block_k, interpret, num_warps,
                           num_stages):
    """The attention kernel on quantized Q and K (batch, seq, heads, dim) int8 with scales (batch, seq blocks,
    heads), and V (batch, kv_len, kv_heads, dim) in a float dtype (the keys past `kv_lengths` are zeroed here).
    Returns float32."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    b, sq, h, d = qi.shape
    sk, hk = ki.shape[1], ki.shape[2]
    group = h // hk
    lengths = _key_lengths(kv_lengths, b, sk)
    pad_q, pad_k = (-sq) % block_q, (-sk) % block_k
    # (batch, heads, seq, dim) layouts padded to whole blocks; scales (batch, heads, blocks)
    qi = jnp.pad(qi, ((0, 0), (0, pad_q), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
    ki = jnp.pad(ki, ((0, 0), (0, pad_k), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
    if pv == "fp8":
        # FP8 V goes in as (dim, seq): K-major, the layout Hopper's 8-bit wgmma takes its B operand in (with V as
        # (seq, dim) the Triton lowering's FP8 P.V was wrong on the H200, rel L1 0.13, though right in interpret
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
                pv_blk = jnp.dot((p * 448.0).astype(jnp.float8_e4m3fn), v_blk, preferred_element_type=jnp.float32)
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
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="int8_attention",
    )(lengths, qi, qs, ki, ks, vb, v_scale)
    return out[:, :, :sq].transpose(0, 2, 1, 3)


# --------------------------------------------------------------------------------------------------------------------
# The Hopper kernel: Pallas Mosaic GPU (wgmma, TMA, warp specialization), FA3's structure with INT8 Q.K^T

MOSAIC_ROWS = 64  # query rows per compute warpgroup (wgmma's M); also the Q quantization block of this backend


def _mosaic_transforms(itemsize: int, minor: int):
    """Shared-memory tiling and swizzle for a tile whose minor dimension has `minor` elements: wgmma and TMA need
    tiles of 8 rows times one swizzle span."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    swizzle = plgpu.find_swizzle(minor * itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


_MAGIC = 0x4B400000  # the bits of 1.5 * 2^23: a float32 whose last mantissa bits count integers
_MAGIC_FLOAT = 12582912.0  # 1.5 * 2^23


def _int32_to_biased_float32(x: jax.Array) -> jax.Array:
    """x + 1.5 * 2^23 as float32, exactly, for |x| < 2^22, with one integer add: the conversion instruction runs at
    the rate of exp2 on Hopper (16 a clock per SM), and the softmax is what bounds the kernel; the bias is removed
    by the caller's own arithmetic. An INT8 product over head_dim <= 256 stays below 256 * 127^2 < 2^22."""
    return jax.lax.bitcast_convert_type(x + _MAGIC, jnp.float32)


def _pv_key_order(keys: int) -> np.ndarray:
    """The key order in which FP8 P's registers, read as wgmma's 8-bit A operand, multiply V (`_p_as_8bit_operand`).
    In the float32 accumulator's layout (WGMMA) the thread of lane c (mod 4) holds columns 2c, 2c + 1, 8 + 2c and
    9 + 2c of every 16; the 8-bit operand layout (WGMMA_8BIT) places a thread's four bytes at columns 4c .. 4c + 3.
    Regrouping the registers without moving data therefore permutes P's keys within each 16, and V^T's keys are
    permuted the same way (`v_fp8_operand`; the sum over keys does not depend on their order)."""
    c = np.arange(4)
    group = np.stack([2 * c, 2 * c + 1, 8 + 2 * c, 9 + 2 * c], axis=1).reshape(16)  # position 4c + i <- key
    return (np.arange(0, keys, 16)[:, None] + group[None]).reshape(keys)


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
    dim)). XLA's transpose (and gather) for this took 47-69 us a block in the step (session 10's profiles): 8-bit
    transposes with the permutation inside. Each program transposes a (block, dim) tile in registers.
    `scale_and_mean`: the scales and means as `_v_fp8_scale_and_mean` gives them for `smooth`, computed before (by
    the K prologue's sums pass, `_rms_rope_quantize(values=...)`); else an XLA reduction here makes them.
    `heads` (first, count): V is those heads of `v`, read in place (a stacked projection's; a slice handed to the
    pass would be copied first: 8.6 us a call at Krea 2's size, session 15's profile)."""
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


def _p_as_8bit_operand(p: jax.Array) -> jax.Array:
    """FP8 P (64, keys) in the accumulator's layout as wgmma's register A operand, WGMMA_8BIT, with no data moved:
    each 8-bit register vector is the two 2-byte vectors of neighbouring 8-column tiles; the columns' new order is
    `_pv_key_order`'s (FA3 shuffles bytes between threads instead; permuting V costs nothing here). Built on Mosaic
    GPU's FragmentedArray internals (`_registers`, jax 0.11.2, which the project pins)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,),
                       return_type=plgpu.ShapeDtypeStruct(p.shape, p.dtype, layout=plgpu.Layout.WGMMA_8BIT))
    def regroup(_, x):
        registers = np.empty(fa.WGMMA_LAYOUT_8BIT.registers_shape(x.shape), dtype=object)
        for index in np.ndindex(registers.shape):
            pair = [x.registers[(index[0], 2 * index[1] + k, *index[2:])] for k in range(2)]
            registers[index] = mgpu_utils.vector_concat(pair)
        return fa.FragmentedArray(_registers=registers, _layout=fa.WGMMA_LAYOUT_8BIT, _is_signed=None)

    return regroup(p)


@dataclasses.dataclass(frozen=True)
class MosaicQPrologue:
    """What the Mosaic kernel needs to make INT8 Q itself from the raw projection (`_int8_attention_mosaic`'s
    `q_prologue`): the RMSNorm weight (head_dim,) (zero-centred: `1 + weight` scales), its eps, the rotary tables
    cos, sin ((seq, head_dim) or (batch, seq, head_dim), each frequency repeated for its pair, as
    `rms_rope_reference` takes them), the softmax scale and the number of query heads (the first heads of Q's
    source)."""

    norm_weight: jax.Array
    eps: float
    cos: jax.Array
    sin: jax.Array
    scale: float
    num_heads: int

    def tables(self, b: int, s: int) -> tuple[jax.Array, jax.Array]:
        """cos and sin, one value a pair, float32 (1 or batch, seq, head_dim / 2), in `_pair_table_order` (what a
        thread of the WGMMA layout needs of them, `_pairs_from_table`)."""
        d = self.cos.shape[-1]
        cos, sin = (jnp.asarray(t, jnp.float32).reshape(-1, s, d) for t in (self.cos, self.sin))
        if cos.shape[0] not in (1, b):
            raise ValueError(f"rotary tables {self.cos.shape}: not (seq, {d}) or ({b}, {s}, {d})")
        return tuple(_pair_table_order(t[..., 0::2]) for t in (cos, sin))

    def weight(self) -> jax.Array:
        return 1.0 + self.norm_weight.astype(jnp.float32)


def _pair_table_order(half: jax.Array, inverse: bool = False) -> jax.Array:
    """A table of one value a channel pair (..., pairs) reordered so that, read as a (rows, pairs) array in the
    WGMMA layout, each thread's register vector at column tile t holds the values of its pairs in the tiles 2t and
    2t + 1 of the full (rows, 2 * pairs) array: position 8t + 2c + e <- pair 4 (2t + e) + c (lane c of 4). Half the
    bytes of a full table, and no data moved between threads to widen it (`_pairs_from_table`). `inverse`: back."""
    *lead, n = half.shape
    groups = half.reshape(*lead, n // 8, *((4, 2) if inverse else (2, 4)))
    return jnp.swapaxes(groups, -1, -2).reshape(half.shape)


def _pairs_from_table(table: jax.Array, interpret: bool) -> jax.Array:
    """(rows, pairs) in `_pair_table_order`, WGMMA layout -> (rows, 2 * pairs) with each pair's value at both its
    channels: register vector (t, e) of the table, split in its two values, is the full array's tiles 2t + e."""
    if interpret:
        return jnp.repeat(_pair_table_order(table, inverse=True), 2, axis=1)
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    rows, pairs = table.shape

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,),
                       return_type=plgpu.ShapeDtypeStruct((rows, 2 * pairs), table.dtype, layout=plgpu.Layout.WGMMA))
    def widen(_, x):
        shape = fa.WGMMA_LAYOUT.registers_shape((rows, 2 * pairs))
        registers = np.empty(shape, dtype=object)
        for index in np.ndindex(shape):  # index[1]: the column tile of 8
            value = mgpu_utils.vector_slice(x.registers[(index[0], index[1] // 2, *index[2:])],
                                            slice(index[1] % 2, index[1] % 2 + 1))
            registers[index] = mgpu_utils.vector_concat([value, value])
        return fa.FragmentedArray(_registers=registers, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

    return widen(table)


def _rotate_pairs(x: jax.Array, interpret: bool) -> jax.Array:
    """x (rows, dim) float32 in the WGMMA layout with each channel pair (a, b) made (-b, a), the rotary
    embedding's quarter turn (`rms_rope_reference`'s `rotated`): the layout's register vectors are pairs of
    neighbouring columns, so no data moves between threads (Mosaic GPU has no op for this; built on
    FragmentedArray's internals as `_p_as_8bit_operand`). The interpreter, which has no registers, uses a reshape."""
    if interpret:
        r, d = x.shape
        pairs = x.reshape(r, d // 2, 2)
        return jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(r, d)
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax._src.lib.mlir.dialects import arith
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,),
                       return_type=plgpu.ShapeDtypeStruct(x.shape, x.dtype, layout=plgpu.Layout.WGMMA))
    def rotate(_, y):
        registers = np.empty(y.registers.shape, dtype=object)
        for index in np.ndindex(registers.shape):
            pair = y.registers[index]
            registers[index] = mgpu_utils.vector_concat([arith.negf(mgpu_utils.vector_slice(pair, slice(1, 2))),
                                                         mgpu_utils.vector_slice(pair, slice(0, 1))])
        return fa.FragmentedArray(_registers=registers, _layout=y.layout, _is_signed=None)

    return rotate(x)


def _mosaic_q_prologue(raw_ref, q_ref, cos_ref, sin_ref, w_ref, prologue: MosaicQPrologue,
                       interpret: bool, before_store=None) -> jax.Array:
    """One compute warpgroup's Q tile in the Mosaic kernel: the raw rows (`raw_ref`), normed (weight `w_ref`),
    rotated (tables `cos_ref`, `sin_ref` in `_pair_table_order`) and quantized to INT8 per row into `q_ref` (for
    wgmma); all in shared memory, arrived by TMA. Returns the rows' scales (rows,), the softmax scale in them, in the
    layout of the logits' row reductions. The arithmetic is `rms_rope_reference`'s, then `_quantize_int8_blocks`'
    with one row a block (up to rounding). Measured (session 12, Krea 2's attention at 4224 tokens): with the
    tables read from global memory by each thread this cost ~60 us a call more, as much as the Q prologue's pass.
    `before_store()`: runs before the INT8 values are stored (q_ref may share memory with what was read)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax import lax

    layout = plgpu.Layout.WGMMA
    x = plgpu.load(raw_ref, layout=layout).astype(jnp.float32)
    d = x.shape[1]
    inv = lax.rsqrt((x * x).sum(axis=1) / d + prologue.eps)
    w = plgpu.load(w_ref, layout=layout.reduce(0), optimized=False)
    y = x * lax.broadcast_in_dim(inv, x.shape, [0]) * lax.broadcast_in_dim(w, x.shape, [1])
    cos = _pairs_from_table(plgpu.load(cos_ref, layout=layout), interpret)
    sin = _pairs_from_table(plgpu.load(sin_ref, layout=layout), interpret)
    y = y * cos + _rotate_pairs(y, interpret) * sin
    # The softmax scale goes into the row's scale, not into each value; and a multiply by the reciprocal, not a
    # division (27 us of the kernel's time at Krea 2's size, session 12): the codes may differ from the reference's
    # y * scale / step where a value lies within an ulp of a rounding tie.
    amax = jnp.abs(y).max(axis=1)
    positive = amax > 0
    inverse = jnp.where(positive, 127.0 / amax, 1.0)
    q = jnp.clip(jnp.round(y * lax.broadcast_in_dim(inverse, y.shape, [0])), -127.0, 127.0).astype(jnp.int8)
    if before_store is not None:
        before_store()
    q_ref[...] = q
    plgpu.commit_smem()  # visible to wgmma's (async proxy) reads
    return jnp.where(positive, amax * (prologue.scale / 127.0), 1.0)


def compute_registers(compute_wgs: int, memory_registers: int = 40) -> int:
    """The registers a thread of each compute warpgroup can take with `setmaxnreg` when the memory warpgroup keeps
    `memory_registers`: the SM has 65536, and the count must be a multiple of 8. Asking for more does not fail; the
    warpgroup waits forever for registers that never free up (with 240 for two warpgroups the kernel hung on the
    H200: 2 x 128 x 240 + 128 x 40 = 66560)."""
    per_thread = (65536 - 128 * memory_registers) // (128 * compute_wgs)
    return min(per_thread - per_thread % 8, 256)


def _int8_attention_mosaic(qi, qs, ki, ks, v, kv_lengths, *, pv, block_k, num_stages, p_in_smem=None,
                           pv_accumulation="two_level", interpret=False, lower_only=False, out_dtype=jnp.float32,
                           q_prologue: MosaicQPrologue | None = None, row_sums: str | None = None,
                           smooth_v: bool | None = None, v_range: tuple | None = None,
                           compute_wgs: int | None = None, turns: str | None = None,
                           v_heads: tuple[int, int] | None = None):
    """The Mosaic GPU kernel on quantized Q (per 64 rows) and K (per `block_k` keys), (batch, seq, heads, dim) int8
    with scales (batch, seq blocks, heads), and V (batch, kv_len, kv_heads, dim) in a float dtype (the keys past
    `kv_lengths` are zeroed here). Returns `out_dtype` (batch, q_len, heads, dim).

    A CTA (grid: heads, blocks of 64 x `compute_wgs` query rows, batch) runs two or three compute warpgroups of 64
    query rows each and a memory warpgroup that streams K and V blocks by TMA into a `num_stages` ring (a "full"
    barrier per slot for the copies, a "free" barrier per slot that every compute warpgroup arrives at). Each
    compute warpgroup: S = wgmma(Q int8 from shared memory, K block^T) with int32 accumulation (8-bit wgmma wants both
    operands K-major: Q (rows, dim) and K (keys, dim) already are), times q_scale * k_scale in float32, the key mask
    on the last block only, online softmax in base 2, then P.V. The warpgroups take turns issuing their wgmmas
    (`turns`; FA3's ping-pong for two) so that one's softmax overlaps the others' matrix products.

    P.V: "bf16" with P from registers (wgmma's A operand) and V (keys, dim) from shared memory, accumulating into
    the running accumulator in place. "fp8": V^T (dim, keys) E4M3 from shared memory (8-bit B must be K-major, so
    a Triton pass transposes it before, `v_fp8_operand`), P * 448 in E4M3 from registers (the 448 applied in the
    exponent; l sums P so scaled, so acc / l cancels it), regrouped into the 8-bit operand layout with no data moved
    (`_p_as_8bit_operand`; V's keys permuted to match in the same pass); `pv_accumulation` "two_level": each key
    block's product in a fresh accumulator, then rescale-and-add into the running float32 one; "in_place": into the
    running accumulator itself (its adds keep fewer bits). V's channel scales are applied in the epilogue. Measured at
    4608 tokens, GQA 48/12 (session 9): two-level 735 us, in place 666, bf16 P.V 767 (cuDNN 780). `p_in_smem` (default:
    only in interpret mode, whose wgmma reads operands from shared memory only) sends P, bf16 or FP8, through shared
    memory, with a fresh accumulator per block.

    `q_prologue` (`MosaicQPrologue`): `qi` is the raw Q projection instead (batch, seq, heads >= its num_heads,
    dim; the first num_heads heads are Q, read in place) and `qs` is not used: each compute warpgroup loads its 64
    rows, applies the RMSNorm, the rotary embedding and the softmax scale, and quantizes them to INT8 per row into
    shared memory before its key loop (`_mosaic_q_prologue` states the numerics). K must then be in the natural
    channel order (`_qk_prologue(k_only=True)`), not `_deinterleave`'s. This replaces the Q prologue's pass (2.4
    ms a step of full-size Krea 2 at 1024^2, session 11's profile), its INT8 write and the kernel's read of it.

    `row_sums` (None: `MOSAIC_ROW_SUMS`): the softmax's row sums l by "adds" (64 float32 adds a thread a key block),
    or "wgmma" (FP8 P.V in place only): by the tensor cores, P times a (keys, 8) operand whose first column is ones,
    into a fresh (rows, 8) accumulator a key block, added to the running float32 l (4 adds a thread); l then sums
    the E4M3-rounded P that the output's numerator sums. Not in place: the FP8 wgmma's accumulator keeps ~14 bits
    and truncates each product to the accumulator's exponent, so a long sum of positive terms comes out low by
    ~N * 2^-15 of itself (measured in place: l 6% low at 4224 keys; a fresh block's 128 keys: no bias seen,
    session 13).

    `smooth_v` (FP8 P.V only; None: `MOSAIC_SMOOTH_V`): V's channel means over the valid keys are subtracted before
    its FP8 rounding and added to the output after (rows of the softmax sum to one), as SageAttention2 does: the
    FP8 wgmma's truncating accumulator biases a long sum of same-signed terms (see `row_sums`), which a channel's
    mean makes of P.V accumulated in place.

    `v_range` (FP8 P.V): V's (max, min, sum) over the valid keys (batch, kv_heads, dim) each, computed before (K's
    sums pass reads them, `_qk_prologue(values=...)`), from which V's scales and means come; None: from V here.

    `v_heads` (first, count): V is those heads of `v` (a stacked projection), which FP8 P.V's operand pass reads in
    place.

    `compute_wgs` (None: `_compute_wgs`' choice): compute warpgroups a CTA, 2 or 3 (64 query rows each; 3 leaves
    each 160 registers a thread). `turns` (None: "pairs" for two, "ring" for three): how the warpgroups share the
    tensor cores. "pairs" (two only; FA3's ping-pong): a two-party barrier after each Q.K^T issue and before each
    P.V makes one warpgroup's softmax run while the other's matrix products do, never both softmaxes at once.
    "ring": a warpgroup issues its block's P.V and the next block's Q.K^T only after the one before it in the ring
    issued its own, then passes the turn on; softmaxes may overlap one another. Measured (session 16, Krea 2's
    fused call alone): three in a ring 599 us, three in no order at all 647, two in pairs 638 (outputs equal).

    `lower_only`: return the lowered (cuda) computation instead of running it; CPU tests use it to check that the
    real Mosaic lowering accepts every variant.
    """
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax import lax

    b, sq, h, d = qi.shape
    if q_prologue is not None:
        h = q_prologue.num_heads
    sk, hk = ki.shape[1], ki.shape[2]
    group = h // hk
    rows = MOSAIC_ROWS
    float32_q_tiles = q_prologue is not None and jnp.dtype(out_dtype).itemsize > 2
    wgs = _compute_wgs(pv, d, sq, interpret, float32_q_tiles) if compute_wgs is None else compute_wgs
    if wgs not in (2, 3):
        raise ValueError(f"mosaic attention: compute_wgs must be 2 or 3, got {wgs}")
    memory_registers = MOSAIC_MEMORY_REGISTERS[wgs]
    turns = ("pairs" if wgs == 2 else "ring") if turns is None else turns
    if turns not in ("pairs", "ring") or (turns == "pairs" and wgs != 2):
        raise ValueError(f"mosaic attention: turns={turns!r} with {wgs} compute warpgroups ('pairs' takes two)")
    if d % 64 or d > 256 or block_k % 64 or block_k > 256:
        raise ValueError(f"mosaic attention: head_dim {d} and block_k {block_k} must be multiples of 64, at most 256")
    if q_prologue is None and qs.shape[1] != pl.cdiv(sq, rows):
        raise ValueError(f"mosaic attention: Q must be quantized per {rows} rows")
    if q_prologue is not None and jnp.dtype(qi.dtype) != jnp.dtype(out_dtype):
        raise ValueError(f"mosaic attention making Q itself: raw Q ({jnp.dtype(qi.dtype).name}) must have the "
                         f"output's dtype ({jnp.dtype(out_dtype).name}): its tiles use the output tiles' memory")
    if p_in_smem is None:
        p_in_smem = interpret
    if interpret and not p_in_smem:
        raise ValueError("the Mosaic GPU interpreter's wgmma reads A from shared memory only: p_in_smem=True")
    _check_pv_accumulation(pv, pv_accumulation)
    if pv_accumulation == "in_place" and p_in_smem:
        raise ValueError("pv_accumulation='in_place' takes P from registers (the interpreter, which needs P in shared "
                         "memory, cannot run wgmma into a carried accumulator)")
    # A fresh accumulator per key block: FP8 P.V's two-level accumulation, and P from shared memory (interpreter).
    fresh = p_in_smem or (pv == "fp8" and pv_accumulation == "two_level")
    in_place_fp8 = pv == "fp8" and pv_accumulation == "in_place" and not p_in_smem
    if row_sums is None:
        row_sums = MOSAIC_ROW_SUMS if in_place_fp8 else "adds"
    if row_sums not in ("adds", "wgmma"):
        raise ValueError(f"row_sums={row_sums!r}: expected 'adds' or 'wgmma'")
    row_sums_by_wgmma = row_sums == "wgmma"
    if row_sums_by_wgmma and not in_place_fp8:
        raise ValueError(f"row_sums={row_sums!r} takes FP8 P.V accumulated in place, with P from registers")
    smooth_v = (MOSAIC_SMOOTH_V and pv == "fp8") if smooth_v is None else smooth_v
    if smooth_v and pv != "fp8":
        raise ValueError("smooth_v takes FP8 P.V")
    sum_cols = 8  # wgmma's narrowest N
    pad_q, pad_k = (-sq) % (wgs * rows), (-sk) % block_k
    n_q, n_k = (sq + pad_q) // (wgs * rows), (sk + pad_k) // block_k
    stages = max(1, min(num_stages, n_k))
    lengths = _key_lengths(kv_lengths, b, sk)
    tail_masked = kv_lengths is not None or pad_k > 0  # else no key of any block is masked
    qi = jnp.pad(qi, ((0, 0), (0, pad_q), (0, 0), (0, 0)))  # (a copy only where the rows fill no whole CTA)
    ki = jnp.pad(ki, ((0, 0), (0, pad_k), (0, 0), (0, 0)))
    if q_prologue is None:  # scales read as scalars from global memory: (batch, heads, blocks); padding's are 1
        qs = jnp.pad(qs, ((0, 0), (0, wgs * n_q - qs.shape[1]), (0, 0)), constant_values=1.0).transpose(0, 2, 1)
        q_tables = ()
    else:  # the rotary tables and the norm's weight, copied in with the raw Q tile
        qs = jnp.zeros((1,), jnp.float32)
        q_tables = tuple(jnp.pad(t, ((0, 0), (0, pad_q), (0, 0))) for t in q_prologue.tables(b, sq)) + (
            jnp.broadcast_to(q_prologue.weight(), (wgs, d)),)  # a copy for each compute warpgroup's slot
    ks = ks.transpose(0, 2, 1)
    if pv == "fp8":
        def v_operand(v):
            """(V^T (batch, kv_heads, dim, keys) in E4M3, its channel scales and means (batch, kv_heads, 2, dim));
            P's registers read as the 8-bit operand layout order the keys so (`_p_as_8bit_operand`)."""
            scale_and_mean = None if v_range is None else _v_fp8_scale_and_mean_of_range(*v_range, lengths, smooth_v)
            vt, scale, mean = v_fp8_operand(v, block_k, permute_keys=not p_in_smem, kv_lengths=kv_lengths,
                                            interpret=interpret, smooth=smooth_v, scale_and_mean=scale_and_mean,
                                            heads=v_heads)
            return vt, jnp.stack([scale, mean], axis=2)

        v_block, v_transforms, p_dtype = (d, block_k), _mosaic_transforms(1, block_k), jnp.float8_e4m3fn
    else:
        def v_operand(v):  # the scales are not read: bf16 V is not scaled
            if v_heads is not None:
                v = v[:, :, v_heads[0]:v_heads[0] + v_heads[1]]
            return (jnp.pad(_masked_values(v, kv_lengths, jnp.bfloat16), ((0, 0), (0, pad_k), (0, 0), (0, 0))),
                    jnp.ones((b, hk, 2, d), jnp.float32))

        v_block, v_transforms, p_dtype = (block_k, d), _mosaic_transforms(2, d), jnp.bfloat16
    wgmma_layout = plgpu.Layout.WGMMA
    log2e = math.log2(math.e)
    log2_p_max = math.log2(448.0) if pv == "fp8" else 0.0  # P's fixed FP8 scale, applied in the exponent
    # The output tile leaves in `out_dtype` (bf16 halves its shared memory and its writes); FP8 V's channel scales
    # are applied in the kernel's epilogue, so no pass after it (40 us a block in the step, session 10's profile).
    kernel_out = jnp.dtype(out_dtype)

    def kernel(q_gmem, qs_gmem, k_gmem, ks_gmem, v_gmem, vs_gmem, len_gmem, tables, ones_gmem, o_gmem, scoped):
        (q_alloc, k_smem, v_smem, p_smem, o_smem), (q_full, k_full, v_full), (k_free, v_free), turn, \
            w_smem, table_full, tables_read, ones_smem, ones_full = scoped
        if q_prologue is None:
            q_smem, table_smem = q_alloc, None
        else:  # INT8 Q shares the tables' memory (see `entry`)
            (cos_smem, sin_smem), q_smem = q_alloc
            table_smem = (cos_smem, sin_smem, w_smem)
        # raw Q's tiles arrive in the output tiles' buffer (Q is read before the key loop, the output written after
        # it): a buffer of their own would leave bf16 P.V with the tables too little shared memory
        q_raw_smem = o_smem
        head, q_block, batch = lax.axis_index("heads"), lax.axis_index("q_seq"), lax.axis_index("batch")
        wg = lax.axis_index("wg")
        kv_head = head // group
        length = len_gmem[batch]
        steps = (length + block_k - 1) // block_k  # only the key blocks holding valid keys

        # The tensor cores' turns ("ring"): a warpgroup waits for its turn (`turn.at[wg]`) before its block's P.V
        # and the next block's Q.K^T, and passes it to the next warpgroup once they are issued. ("pairs": one
        # two-party barrier, `turn`, that both warpgroups arrive at and wait for.)
        def wait_turn():
            plgpu.barrier_wait(turn.at[wg] if turns == "ring" else turn)

        def pass_turn():
            if turns == "ring":
                plgpu.barrier_arrive(turn.at[lax.rem(wg + 1, wgs)])
            else:
                plgpu.barrier_arrive(turn)

        def schedule_barrier():  # "pairs"
            pass_turn()
            wait_turn()

        @pl.when(wg < wgs)
        def _compute():
            plgpu.set_max_registers(compute_registers(wgs, memory_registers), action="increase")
            row0 = q_block * (wgs * rows) + wg * rows
            if q_prologue is None:
                plgpu.copy_gmem_to_smem(q_gmem.at[batch, pl.ds(row0, rows), head], q_smem.at[wg], q_full.at[wg])
                q_scale = qs_gmem[batch, head, q_block * wgs + wg] * log2e  # logits in base 2: exp2 below
                plgpu.barrier_wait(q_full.at[wg])
            else:  # per-row scales (rows,), in the layout of the logits' row reductions
                plgpu.copy_gmem_to_smem(q_gmem.at[batch, pl.ds(row0, rows), head], q_raw_smem.at[wg],
                                        q_full.at[wg])
                cos_gmem, sin_gmem, w_gmem = tables
                tb = batch if cos_gmem.shape[0] > 1 else 0  # the tables' batch
                sources = (cos_gmem.at[tb, pl.ds(row0, rows)], sin_gmem.at[tb, pl.ds(row0, rows)], w_gmem.at[wg])
                for src, dst, full in zip(sources, table_smem, table_full):
                    plgpu.copy_gmem_to_smem(src, dst.at[wg], full.at[wg])
                for full in (q_full, *table_full):
                    plgpu.barrier_wait(full.at[wg])
                def all_tables_read():  # by every compute warpgroup: INT8 Q is written over them
                    plgpu.commit_smem()  # (a warpgroup barrier: its threads' loads are done)
                    plgpu.barrier_arrive(tables_read)
                    plgpu.barrier_wait(tables_read)

                q_scale = _mosaic_q_prologue(q_raw_smem.at[wg], q_smem.at[wg], *(ref.at[wg] for ref in table_smem),
                                             q_prologue, interpret, before_store=all_tables_read) * log2e
            m = plgpu.layout_cast(jnp.full((rows,), -jnp.inf, jnp.float32), wgmma_layout.reduce(1))
            if row_sums_by_wgmma:  # the ones operand, a copy a warpgroup; l is a (rows, 8) accumulator
                plgpu.copy_gmem_to_smem(ones_gmem, ones_smem.at[wg], ones_full.at[wg])
                plgpu.barrier_wait(ones_full.at[wg])
                l = plgpu.layout_cast(jnp.zeros((rows, sum_cols), jnp.float32), wgmma_layout)
            else:
                l = plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), wgmma_layout.reduce(1))
            acc = plgpu.layout_cast(jnp.zeros((rows, d), jnp.float32), wgmma_layout)

            @pl.when(steps > 0)
            def _():
                plgpu.barrier_wait(k_full.at[0])

            if turns == "pairs":
                pl.when(wg == 1)(schedule_barrier)
            else:
                pl.when(wg > 0)(wait_turn)  # the first Q.K^T: warpgroup 0 starts with the turn

            def softmax(s, j, k_scale, m, l, masked):
                """Block j's int32 logits -> (P in the P.V dtype, running max, running sum, rescale factor)."""
                # The bias leaves through the exponent's multiply-add below: no subtraction a logit.
                s = _int32_to_biased_float32(s)
                if masked:
                    cols = plgpu.broadcasted_iota(jnp.int32, (rows, block_k), 1, layout=wgmma_layout)
                    s = jnp.where(cols < length - j * block_k, s, -jnp.inf)
                # The block's dequantization scale (> 0) folds into the exponent's multiply-add.
                c = q_scale * k_scale  # a scalar, or (rows,) with Q's scales per row
                m_new = jnp.maximum(m, (s.max(axis=1) - _MAGIC_FLOAT) * c)
                alpha = jnp.exp2(m - m_new)
                # exp2(logit - m_new) * p_max as exp2(s * c - (m_new + bias * c - log2(p_max))): FP8's fixed scale
                # 448 is in the exponent too, so no multiply either; l sums P so scaled, and acc / l cancels it.
                # Rounding the per-row term moves a block's exponent by at most one integer logit unit (c).
                shift = lax.broadcast_in_dim(m_new + (_MAGIC_FLOAT * c - log2_p_max), s.shape, [0])
                p = jnp.exp2(s * (c if q_prologue is None else lax.broadcast_in_dim(c, s.shape, [0])) - shift)
                if row_sums_by_wgmma:  # rescaled here; the block's sums come from the P.V wgmma
                    l = l * lax.broadcast_in_dim(alpha, l.shape, [0])
                else:
                    l = l * alpha + p.sum(axis=1)
                return p.astype(p_dtype), m_new, l, alpha

            def step(j, carry, masked):
                acc, m, l = carry
                slot = lax.rem(j, stages)
                # The block's K scale is loaded before its Q.K^T is issued, so the load's latency passes while the
                # wgmma runs: loaded in the softmax (after the wait), the kernel took 519-522 us at Krea 2's size
                # against 491-494, and ptxas spilled a register (session 18).
                k_scale = ks_gmem[batch, kv_head, j]

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem.at[wg], k_smem.at[slot].transpose((1, 0)))
                    if turns == "pairs":  # and wait until the other warpgroup's softmax is done
                        schedule_barrier()
                    else:
                        pass_turn()
                    return acc_ref[...]

                s = pl.run_scoped(qk, plgpu.ACC((rows, block_k), jnp.int32))
                plgpu.barrier_arrive(k_free.at[slot])
                p, m, l, alpha = softmax(s, j, k_scale, m, l, masked)
                if pv == "fp8" and not p_in_smem:
                    p = _p_as_8bit_operand(p)
                if not fresh:  # rescaled while the other warpgroup's matrix products run, then accumulated into
                    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                if p_in_smem:
                    p_smem.at[wg][...] = p
                    plgpu.commit_smem()  # visible to wgmma's (async proxy) reads
                    acc, l, m, alpha = lax.optimization_barrier((acc, l, m, alpha))
                else:  # the softmax completes before the barriers below (FA3's ordering, measured faster there)
                    acc, l, m, alpha, p = lax.optimization_barrier((acc, l, m, alpha, p))
                if turns == "pairs":
                    pass_turn()  # softmax done
                plgpu.barrier_wait(v_full.at[slot])
                wait_turn()  # the warpgroup before this one issued its matrix products

                def wait_next_k():
                    @pl.when(j + 1 < steps)
                    def _():
                        plgpu.barrier_wait(k_full.at[lax.rem(j + 1, stages)])

                v_op = v_smem.at[slot].transpose((1, 0)) if pv == "fp8" else v_smem.at[slot]
                p_op = p_smem.at[wg] if p_in_smem else p
                if fresh:  # the block's product in a fresh accumulator; the rescale and the add are one FMA
                    def pv_fresh(acc_ref):
                        plgpu.wgmma(acc_ref, p_op, v_op)
                        wait_next_k()
                        return acc_ref[...]

                    block = pl.run_scoped(pv_fresh, plgpu.ACC((rows, d), jnp.float32))
                    acc = block + acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                elif row_sums_by_wgmma:
                    def pv_and_sums(refs):
                        acc_ref, l_ref = refs
                        plgpu.wgmma(acc_ref, p_op, v_op)
                        plgpu.wgmma(l_ref, p_op, ones_smem.at[wg].transpose((1, 0)))
                        wait_next_k()

                    # the block's sums in a fresh accumulator (in place they come out low), then float32 adds
                    fresh_l = plgpu.layout_cast(jnp.zeros((rows, sum_cols), jnp.float32), wgmma_layout)
                    acc, l_block = pl.run_state(pv_and_sums)((plgpu.ACC.init(acc), plgpu.ACC.init(fresh_l)))
                    l = l + l_block
                else:
                    def pv_in_place(acc_ref):
                        plgpu.wgmma(acc_ref, p_op, v_op)
                        wait_next_k()

                    acc = pl.run_state(pv_in_place)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m, l

            carry = (acc, m, l)
            if tail_masked:  # the mask is needed on the last block only
                last = jnp.maximum(steps - 1, 0)
                carry = lax.fori_loop(0, last, functools.partial(step, masked=False), carry)
                carry = lax.fori_loop(last, steps, functools.partial(step, masked=True), carry)
            else:
                carry = lax.fori_loop(0, steps, functools.partial(step, masked=False), carry)
            acc, m, l = carry
            if turns == "pairs":
                pl.when(wg == 0)(schedule_barrier)
            else:  # after the last P.V; warpgroup 0 takes the turn that comes back (every pass waited)
                pass_turn()
                pl.when(wg == 0)(wait_turn)
            if row_sums_by_wgmma:
                l = l.sum(axis=1)  # the ones column's; the other seven are zero
            out = acc * lax.broadcast_in_dim(1.0 / l, acc.shape, [0])
            if pv == "fp8":  # V's channel scales (P's 448 cancelled in acc / l), once a tile: a plain load is enough
                v_scale = plgpu.load(vs_gmem.at[batch, kv_head, 0], layout=wgmma_layout.reduce(0), optimized=False)
                out = out * lax.broadcast_in_dim(v_scale, acc.shape, [1])
                if smooth_v:
                    v_mean = plgpu.load(vs_gmem.at[batch, kv_head, 1], layout=wgmma_layout.reduce(0), optimized=False)
                    out = out + lax.broadcast_in_dim(v_mean, acc.shape, [1])
            o_smem.at[wg][...] = out.astype(kernel_out)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[wg], o_gmem.at[batch, pl.ds(row0, rows), head])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == wgs)
        def _memory():
            plgpu.set_max_registers(memory_registers, action="decrease")

            def v_slice(j):
                if pv == "fp8":
                    return v_gmem.at[batch, kv_head, :, pl.ds(j * block_k, block_k)]
                return v_gmem.at[batch, pl.ds(j * block_k, block_k), kv_head]

            def load(j, slot):
                plgpu.copy_gmem_to_smem(k_gmem.at[batch, pl.ds(j * block_k, block_k), kv_head], k_smem.at[slot],
                                        k_full.at[slot])
                plgpu.copy_gmem_to_smem(v_slice(j), v_smem.at[slot], v_full.at[slot])

            for i in range(stages):
                pl.when(i < steps)(functools.partial(load, i, i))

            @pl.loop(0, steps - stages)
            def _(j):
                slot = lax.rem(j, stages)
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.copy_gmem_to_smem(k_gmem.at[batch, pl.ds((j + stages) * block_k, block_k), kv_head],
                                        k_smem.at[slot], k_full.at[slot])
                plgpu.barrier_wait(v_free.at[slot])
                plgpu.copy_gmem_to_smem(v_slice(j + stages), v_smem.at[slot], v_full.at[slot])

            # The last use of each slot is released too before the barriers go (the interpreter checks that every
            # waiter saw every phase; on the GPU this only waits for the compute warpgroups' last steps).
            for i in range(stages):
                @pl.when(i < steps)
                def _():
                    plgpu.barrier_wait(k_free.at[i])
                    plgpu.barrier_wait(v_free.at[i])

    def entry(q_gmem, qs_gmem, k_gmem, ks_gmem, v_gmem, vs_gmem, len_gmem, *rest):
        # the Q prologue's tables, then the row sums' ones operand, each only where used
        *inputs, o_gmem = rest
        tables, ones_gmem = inputs[:len(q_tables)], (inputs[len(q_tables)] if row_sums_by_wgmma else None)
        int8_transforms = _mosaic_transforms(1, d)
        q_alloc = plgpu.SMEM((wgs, rows, d), jnp.int8, transforms=int8_transforms)
        if q_prologue is None:
            tables_scoped = (None, None, None)
        else:
            # cos, sin (one value a pair, `_pair_table_order`) and the norm's weight, a slot each warpgroup. INT8 Q
            # takes the tables' memory once every warpgroup has read its own (`tables_read`): with three compute
            # warpgroups their own memory would not fit (244944 > 232448 bytes at head_dim 128).
            half_transforms = _mosaic_transforms(4, d // 2)
            q_alloc = plgpu.RefUnion((plgpu.SMEM((wgs, rows, d // 2), jnp.float32, transforms=half_transforms),
                                      plgpu.SMEM((wgs, rows, d // 2), jnp.float32, transforms=half_transforms)),
                                     q_alloc)
            tables_scoped = (plgpu.SMEM((wgs, d), jnp.float32), (plgpu.Barrier(num_barriers=wgs),) * 3,
                             plgpu.Barrier(num_arrivals=wgs))
        smem = [
            q_alloc,
            plgpu.SMEM((stages, block_k, d), jnp.int8, transforms=int8_transforms),
            plgpu.SMEM((stages, *v_block), p_dtype, transforms=v_transforms),
            plgpu.SMEM((wgs, rows, block_k), p_dtype, transforms=_mosaic_transforms(jnp.dtype(p_dtype).itemsize,
                                                                                     block_k)) if p_in_smem else None,
            plgpu.SMEM((wgs, rows, d), kernel_out, transforms=_mosaic_transforms(jnp.dtype(kernel_out).itemsize, d)),
        ]
        pl.run_scoped(
            lambda *scoped: kernel(q_gmem, qs_gmem, k_gmem, ks_gmem, v_gmem, vs_gmem, len_gmem, tables, ones_gmem,
                                   o_gmem, scoped),
            smem,
            (plgpu.Barrier(num_barriers=wgs), plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages)),
            (plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),) * 2,
            plgpu.Barrier(num_arrivals=2) if turns == "pairs" else plgpu.Barrier(num_barriers=wgs),  # the turns
            *tables_scoped,
            plgpu.SMEM((wgs, sum_cols, block_k), jnp.float8_e4m3fn, transforms=_mosaic_transforms(1, block_k))
            if row_sums_by_wgmma else None,
            plgpu.Barrier(num_barriers=wgs) if row_sums_by_wgmma else None,
            collective_axes="wg",
        )

    entry.__name__ = "int8_attention"  # what profiles list
    call = plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct((b, wgs * n_q * rows, h, d), kernel_out),
        grid=(h, n_q, b),
        grid_names=("heads", "q_seq", "batch"),
        num_threads=wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )

    # the row sums' B operand (K-major like V^T): a row of ones, seven of zeros
    ones = (jnp.zeros((sum_cols, block_k), jnp.float8_e4m3fn).at[0].set(1.0),) if row_sums_by_wgmma else ()

    def run(qi, qs, ki, ks, v, lengths, q_tables):
        return call(qi, qs, ki, ks, *v_operand(v), lengths, *q_tables, *ones)[:, :sq]

    if lower_only:
        return jax.jit(run).trace(qi, qs, ki, ks, v, lengths, q_tables).lower(lowering_platforms=("cuda",))
    return run(qi, qs, ki, ks, v, lengths, q_tables)


# --------------------------------------------------------------------------------------------------------------------
# The fused prologue: per-head RMSNorm, rotary embedding, K smoothing and INT8 quantization in one pass


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


def int8_qk_prologue(q, k, norm_q, norm_k, eps: float, cos, sin, kv_lengths=None, *, scale: float,
                     block_q: int = 64, block_k: int = 64, smooth_k: bool = True, interpret: bool = False):
    """Fused RMSNorm + rotary + (K: smoothing, masking) + INT8 block quantization of raw Q and K projections.

    q: (batch, seq, heads, head_dim), k: (batch, seq, kv_heads, head_dim) as the projections give them (before the
    norms); norm_q, norm_k: (head_dim,) RMSNorm weights; cos, sin as `rms_rope_reference`. One kernel pass over Q
    and one over K; K's mean over the valid keys (for smoothing) takes one pass of the same kernel before it, which
    sums each block's normed and rotated keys (`block_sums`). Returns qi, qs, ki, ks as `_prologue` does (int8
    values, float32 scales (batch, seq blocks, heads)), with channels in the order of `_deinterleave`.
    """
    return _qk_prologue(q, (0, q.shape[2]), k, (0, k.shape[2]), norm_q, norm_k, eps, cos, sin, kv_lengths,
                        scale=scale, block_q=block_q, block_k=block_k, smooth_k=smooth_k, interpret=interpret)


def int8_qk_prologue_stacked(qkv, num_heads: int, num_kv_heads: int, norm_q, norm_k, eps: float, cos, sin,
                             kv_lengths=None, *, scale: float, block_q: int = 64, block_k: int = 64,
                             smooth_k: bool = True, interpret: bool = False, heads_per_program: int | None = None,
                             num_warps: int | None = None, split_pairs: bool = False):
    """`int8_qk_prologue` with Q and K read in place from one stacked projection (batch, seq, H, head_dim), whose
    heads are [Q (num_heads) | K (num_kv_heads) | ...]: no copy of Q or K sliced out of it first.
    `heads_per_program`, `num_warps` (both passes; None: `PROLOGUE_HEADS`, `PROLOGUE_WARPS`), `split_pairs`: the
    kernel's (see `_rms_rope_quantize`; `benchmark.py qk-prologue` times them)."""
    return _qk_prologue(qkv, (0, num_heads), qkv, (num_heads, num_kv_heads), norm_q, norm_k, eps, cos, sin,
                        kv_lengths, scale=scale, block_q=block_q, block_k=block_k, smooth_k=smooth_k,
                        interpret=interpret, heads_per_program=heads_per_program, num_warps=num_warps,
                        split_pairs=split_pairs)


# Warps a program of the Q and of the K pass: at Krea 2's 4224 tokens (48 Q, 12 K heads, `benchmark.py qk-prologue`,
# sessions 8 and 10) Q took 73 us with 16 and 96 with 8; K 27 with 8 and 42 with 16 (the same codes).
PROLOGUE_WARPS = (16, 8)
# Heads a program of the Q and of the K pass (the rotary tables loaded once for them): measured at 4224 tokens
# (`benchmark.py qk-prologue`, session 11) Q 73.8 us with 4 heads and 16 warps against 82.2 with one (8 heads: 90.4,
# 16: 91.3); K 31.0 with one head and 8 warps, 57.4 with 4 and 8 warps.
PROLOGUE_HEADS = (4, 1)

# K's INT8 steps from its sums pass (`_qk_prologue`): the pass also writes each block's per-channel max and min,
# from which the steps follow exactly (`_block_steps_of_range`), and the K pass then quantizes `K_PASS_ROWS` tokens a
# program with no reduction over the block (the K pass, 128 x 128 a program, one program an SM, is latency-bound:
# ~40 us a call for 20 MB, session 15). Krea 2's fused attention call at the cap (session 17, outputs equal to the
# bit): 603 -> 591 us (16 / 64 rows a program: 593 / 593); the fp8 step A B B A 0.10393 / 0.10383 / 0.10396 / 0.10405 s.
K_STEPS_FROM_SUMS = True
K_PASS_ROWS = 32

# The K side of the Mosaic path (`_mosaic_with_q_in_kernel`), not yet timed on a GPU (session 20, no GPU lent):
# `K_SPLIT_PAIRS` loads the K (and sums) passes' tiles contiguously and splits the rotary pairs in registers
# (`_rms_rope_quantize(split_pairs=True)`); `K_SUMS_ROWS` gives the sums pass programs of that many tokens instead of
# a whole key block (the blocks' sums and ranges then combine their parts in XLA). Both only reorder float32
# operations (the parts' sums; a row's norm reduced over another layout): K's codes may move by one at a rounding tie.
# Their SASS (ptxas on the kernels' PTX compiled here from their TTIR; NOTES.md, session 20): the K pass at 8 warps x
# 32 tokens 52 -> 29 instructions a value (IEEE quotients; 60 -> 36 before them) and 63 -> 48 registers with the pairs
# split (no 16-bit strided loads; 96 -> 6 shuffles); the sums pass of 128 tokens with V's range holds 255 registers
# (179 split), one 8-warp program an SM, 396 programs at Krea 2's size; 8 warps x 32 tokens split: 48 registers, 5
# programs an SM by registers.
K_SPLIT_PAIRS = False
K_SUMS_ROWS = None


def _qk_prologue(q_src, q_heads, k_src, k_heads, norm_q, norm_k, eps, cos, sin, kv_lengths, *, scale, block_q,
                 block_k, smooth_k, interpret, heads_per_program: int | None = None, num_warps: int | None = None,
                 split_pairs: bool = False, k_only: bool = False, values=None, sums_rows: int | None = None):
    """The prologue on heads [first, first + count) of `q_src` and `k_src` (`q_heads`, `k_heads`);
    `heads_per_program` and `num_warps` for both passes (None: `PROLOGUE_HEADS`, `PROLOGUE_WARPS`). `k_only`: no
    Q pass (qi, qs None), and K in the natural channel order (for the Mosaic kernel that makes Q itself).
    `values` (V's source, (first, count) of its heads; with `smooth_k`): K's sums pass also takes V's range over the
    valid keys, returned fifth as (max, min, sum) (batch, kv_heads, head_dim) each. `sums_rows`: tokens a program of
    the sums pass (None: a key block; a power of two dividing `block_k`): the parts' sums and ranges are combined
    here."""
    b, s, _, d = q_src.shape
    (_, h), (_, hk) = q_heads, k_heads
    cos = jnp.broadcast_to(cos, (b, s, d)).astype(jnp.float32)[..., 0::2]  # pairs share a frequency: half the table
    sin = jnp.broadcast_to(sin, (b, s, d)).astype(jnp.float32)[..., 0::2]
    valid = _valid_keys(kv_lengths, b, s)
    lengths = _key_lengths(kv_lengths, b, s)
    q_warps, k_warps = PROLOGUE_WARPS if num_warps is None else (num_warps, num_warps)
    q_group, k_group = PROLOGUE_HEADS if heads_per_program is None else (heads_per_program, heads_per_program)
    kernel = functools.partial(_rms_rope_quantize, split_pairs=split_pairs)
    k_mean = jnp.zeros((b, hk, d), jnp.float32)  # in `_deinterleave`'s channel order, as the kernel writes K
    if values is not None and (not smooth_k or values[1][1] != hk):
        raise ValueError(f"_qk_prologue: V's range comes with K smoothing's sums, for as many heads as K ({hk})")
    k_steps = None
    if smooth_k:  # the normed, rotated K summed over the valid keys of each block by a pass of the same kernel
        key_range = K_STEPS_FROM_SUMS
        sums = kernel(k_src, norm_k, eps, cos, sin, None, lengths, 1.0, block_k, interpret, heads=k_heads,
                      num_warps=k_warps, heads_per_program=k_group, block_sums=True,
                      values=None if values is None else (values[0], values[1][0]), key_range=key_range,
                      rows_per_program=sums_rows)
        sums, *extra = sums if isinstance(sums, tuple) else (sums,)
        if key_range and sums_rows is not None and sums_rows != block_k:  # a key block's range from its parts'
            parts = extra[-1].reshape(b, -1, block_k // sums_rows, *extra[-1].shape[2:])
            extra[-1] = jnp.stack([parts[:, :, :, :, 0].max(axis=2), parts[:, :, :, :, 1].min(axis=2)], axis=3)
        if values is not None:
            v_range = extra.pop(0)
            v_range = (v_range[:, :, :, 0].max(axis=1), v_range[:, :, :, 1].min(axis=1), v_range[:, :, :, 2].sum(axis=1))
        k_mean = jnp.sum(sums, axis=1) / jnp.maximum(valid.sum(axis=1), 1)[:, None, None]
        if key_range:
            k_steps = _block_steps_of_range(extra.pop(0), k_mean)
    qi = qs = None
    if not k_only:
        q_mean = jnp.zeros((b, h, d), jnp.float32)
        qi, qs = kernel(q_src, norm_q, eps, cos, sin, q_mean, None, scale, block_q, interpret, heads=q_heads,
                        num_warps=q_warps, heads_per_program=q_group)
    ki, ks = kernel(k_src, norm_k, eps, cos, sin, k_mean, lengths, 1.0, block_k, interpret,
                    heads=k_heads, num_warps=k_warps, heads_per_program=k_group, natural_order=k_only,
                    steps=k_steps)
    return (qi, qs, ki, ks) if values is None else (qi, qs, ki, ks, v_range)


def _block_steps_of_range(key_range: jax.Array, mean: jax.Array) -> jax.Array:
    """INT8 steps (batch, blocks, heads) of K smoothed by `mean` (batch, heads, dim) from each block's per-channel
    max and min of the valid keys (batch, blocks, heads, 2, dim): max |x - m| over a block's keys is max(hi - m,
    m - lo) channel by channel, exactly (float32 subtraction of m is monotonic, and its rounding symmetric), so these
    are the steps the K pass would find by reducing over its tile (0 where no key is valid: step 1)."""
    m = mean[:, None]
    amax = jnp.max(jnp.maximum(key_range[:, :, :, 0] - m, m - key_range[:, :, :, 1]), axis=-1)
    amax = jnp.maximum(amax, 0.0)
    return jnp.where(amax > 0, amax * _INV_127, 1.0)


def _round_half_even(x: jax.Array) -> jax.Array:
    """jnp.round (half to even) from floor alone: the Triton lowering has no `round` primitive (found on the GPU),
    and the add-and-subtract-2^23 trick is folded away by XLA in interpret mode."""
    r = jnp.floor(x + 0.5)
    tie_to_odd = (r - x == 0.5) & (r - 2.0 * jnp.floor(r * 0.5) == 1.0)
    return jnp.where(tie_to_odd, r - 1.0, r)


def _rms_rope_quantize(x, weight, eps, cos_half, sin_half, mean, lengths, multiplier, block, interpret,
                       num_warps: int = 8, heads: tuple[int, int] | None = None, heads_per_program: int = 1,
                       split_pairs: bool = False, block_sums: bool = False, natural_order: bool = False,
                       values: tuple[jax.Array, int] | None = None, key_range: bool = False,
                       steps: jax.Array | None = None, rows_per_program: int | None = None):
    """The kernel: a program per (batch, block of `block` tokens, group of `heads_per_program` heads; fewer when the
    heads or their first one are no multiple of it). 8 warps: half the registers a thread holds of the (block,
    head_dim) tile, twice the occupancy: 270 vs 549 us for Krea 2's Q at 4224 tokens (NOTES.md). A group's heads are
    done one after the other (an unrolled loop) with the rotary tables loaded once (float32, half a head's width:
    twice the bytes of a head's bf16 tile). Measured (session 11, `PROLOGUE_HEADS`): Q 82 -> 74 us with 4 heads,
    still ~4x what its bytes take, so the tables' reads were not most of the cost. Session 8's groups, one (block,
    group, half) tile a program, measured slower (Q 103-174 us) and are gone. `heads` (first, count): only those
    heads of x, read in place (all of them by default). `split_pairs`: load the tile contiguously and split the
    (real, imaginary) channel pairs in registers instead of two stride-2 loads; measured at 4224 tokens: Q 96 -> 82
    us, K 27 -> 32 (as noisy), together < 1% of a step, so off by default. `block_sums`: instead of quantizing, the
    normed and rotated values summed over each block's valid tokens, (batch, blocks, heads, head_dim) float32 in
    `_deinterleave`'s order (K smoothing's mean; `mean` and `multiplier` are not used). `natural_order`: the
    INT8 values in the input's channel order (the Mosaic kernel's order when it makes Q itself), not
    `_deinterleave`'s; `mean` stays in the latter. `values` (block_sums only): (V's source, its first head), V's
    heads as many as x's and read in place; the same programs also give V's range over each block's valid tokens,
    (batch, blocks, heads, 3, head_dim) float32 max, min and sum, returned after the sums (FP8 P.V's scales and
    means, `_v_fp8_scale_and_mean_of_range`: an XLA reduction over V took 19 us a call at Krea 2's size, session 15's
    profile, where these programs read V in a few). `key_range` (block_sums only): also each block's per-channel max
    and min of the normed, rotated valid keys, (batch, blocks, heads, 2, head_dim) in the sums' order, returned
    last. `steps` (quantizing only): the blocks' INT8 steps (batch, blocks, heads) given (`_block_steps_of_range`),
    so that a program needs no reduction over its block: it then takes `rows_per_program` tokens (None:
    `K_PASS_ROWS`; a power of two dividing `block`) and the steps are returned as the scales. With `block_sums`,
    `rows_per_program` (None: `block`) makes the sums and ranges those of parts of the blocks, (batch, parts, ...)
    for the caller to combine."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    b, s, _, d = x.shape
    first, h = heads if heads is not None else (0, x.shape[2])
    if (values is not None or key_range) and not block_sums:
        raise ValueError("_rms_rope_quantize: V's range (values) and K's (key_range) come with block_sums")
    if steps is not None and block_sums:
        raise ValueError("_rms_rope_quantize: steps are given to the quantizing pass, not to block_sums")
    if steps is not None:
        tile = K_PASS_ROWS if rows_per_program is None else rows_per_program
    else:  # block_sums may take parts of a block (`rows_per_program`); the quantizing pass reduces over whole blocks
        tile = rows_per_program if block_sums and rows_per_program is not None else block
    if tile != block and (block % tile or tile & (tile - 1)):
        raise ValueError(f"_rms_rope_quantize: rows_per_program {tile} must be a power of two dividing {block}")
    v_src, v_first = values if values is not None else (None, 0)
    # a power of two (Triton's block shapes) dividing the heads and their first ones
    group = max(g for g in (1, 2, 4, 8, 16)
                if g <= heads_per_program and h % g == 0 and first % g == 0 and v_first % g == 0)
    half = d // 2
    pad = (-s) % block
    if pad:  # zero rows: they contribute nothing to a block's amax
        rows_pad = ((0, 0), (0, pad), (0, 0), (0, 0))
        v_in_x = v_src is x  # (a stacked projection: V's heads read from the same padded copy)
        x = jnp.pad(x, rows_pad)
        if v_src is not None:
            v_src = x if v_in_x else jnp.pad(v_src, rows_pad)
        cos_half = jnp.pad(cos_half, ((0, 0), (0, pad), (0, 0)))
        sin_half = jnp.pad(sin_half, ((0, 0), (0, pad), (0, 0)))
    n_blocks = (s + pad) // block
    w = (1.0 + weight.astype(jnp.float32))
    w_even, w_odd = w[0::2], w[1::2]
    mean_even, mean_odd = (None, None) if mean is None else (mean[..., :half], mean[..., half:])
    masked = lengths is not None
    lengths = jnp.full((b,), s, jnp.int32) if lengths is None else lengths

    def rotated(x_ref, c, sn, we_ref, wo_ref, head):
        """One head's (block, half) real and imaginary parts after the norm and the rotation."""
        one = pl.ds(head, 1)  # (a slice of one, not an integer: interpret mode's strided loads take only slices)
        if split_pairs:  # one contiguous load, the (real, imaginary) pairs split in registers
            pairs = x_ref[:, one, :].reshape(tile, d).astype(jnp.float32)
            even, odd = jnp.split(pairs.reshape(tile, half, 2), 2, axis=-1)
            even, odd = even[..., 0], odd[..., 0]
        else:  # every other channel from 0 and from 1: two strided loads
            even, odd = (x_ref[:, one, pl.ds(start, half, stride=2)].reshape(tile, half).astype(jnp.float32)
                         for start in (0, 1))
        inv = jax.lax.rsqrt((jnp.sum(even * even, axis=-1) + jnp.sum(odd * odd, axis=-1)) / d + eps)[:, None]
        even = even * inv * we_ref[...]
        odd = odd * inv * wo_ref[...]
        return even * c - odd * sn, odd * c + even * sn

    def tables_and_mask(lengths_ref, c_ref, s_ref):
        """The tables (tile, half), loaded once for the group's heads, and which rows are valid keys (tile, 1)."""
        c, sn = c_ref[...], s_ref[...]
        rows = pl.program_id(1) * tile + jax.lax.broadcasted_iota(jnp.int32, (tile, 1), 0)
        return c, sn, rows < lengths_ref[pl.program_id(0)]

    def kernel(lengths_ref, x_ref, c_ref, s_ref, we_ref, wo_ref, me_ref, mo_ref, *refs):
        steps_ref, q_ref, scale_ref = (*refs, None) if steps is not None else (None, *refs)
        c, sn, keep = tables_and_mask(lengths_ref, c_ref, s_ref)
        for head in range(group):  # unrolled: the heads' loads are independent
            one = pl.ds(head, 1)
            real, imag = rotated(x_ref, c, sn, we_ref, wo_ref, head)
            real = (real - me_ref[one, :]) * multiplier
            imag = (imag - mo_ref[one, :]) * multiplier
            if masked:  # masked keys are zeroed: they must not enter the block's scale
                real, imag = jnp.where(keep, real, 0.0), jnp.where(keep, imag, 0.0)
            if steps_ref is None:
                amax = jnp.maximum(jnp.max(jnp.abs(real)), jnp.max(jnp.abs(imag)))
                step = jnp.where(amax > 0, amax * _INV_127, 1.0)
            else:
                step = steps_ref[one]
            if interpret:
                rounded = [_round_half_even(v * (1.0 / step)) for v in (real, imag)]
            else:  # the reference's products rounded to integers, ties to even
                rounded = reciprocal_products([real, imag], step, round_to_integer=True)
            parts = [jnp.clip(v, -127, 127).astype(jnp.int8) for v in rounded]
            if natural_order:  # the pairs joined in registers: one contiguous store (strided ones: +12% time)
                q_ref[:, one, :] = jnp.stack(parts, axis=-1).reshape(tile, 1, d)
            else:  # `_deinterleave`'s order: the halves
                for start, q in zip((0, half), parts):
                    q_ref[:, one, pl.ds(start, half)] = q.reshape(tile, 1, half)
            if steps_ref is None:
                scale_ref[one] = step.reshape(1)

    def sums_kernel(lengths_ref, x_ref, c_ref, s_ref, we_ref, wo_ref, *refs):
        refs = list(refs)
        v_ref = refs.pop(0) if v_src is not None else None
        sum_ref = refs.pop(0)
        range_ref = refs.pop(0) if v_src is not None else None
        key_range_ref = refs.pop(0) if key_range else None
        c, sn, keep = tables_and_mask(lengths_ref, c_ref, s_ref)

        def valid_max_min(v):
            return jnp.max(jnp.where(keep, v, -jnp.inf), axis=0), jnp.min(jnp.where(keep, v, jnp.inf), axis=0)

        for head in range(group):
            one = pl.ds(head, 1)
            real, imag = rotated(x_ref, c, sn, we_ref, wo_ref, head)
            for start, v in ((0, real), (half, imag)):
                sum_ref[one, pl.ds(start, half)] = jnp.sum(jnp.where(keep, v, 0.0), axis=0)[None]
                if key_range_ref is not None:
                    for i, part in enumerate(valid_max_min(v)):
                        key_range_ref[one, pl.ds(i, 1), pl.ds(start, half)] = part.reshape(1, 1, half)
            if v_ref is not None:
                v = v_ref[:, one, :].reshape(tile, d).astype(jnp.float32)
                for i, part in enumerate((*valid_max_min(v), jnp.sum(jnp.where(keep, v, 0.0), axis=0))):
                    range_ref[one, pl.ds(i, 1), :] = part.reshape(1, 1, d)

    in_specs = [
        pl.no_block_spec,
        pl.BlockSpec((None, tile, group, d), lambda bi, si, hi: (bi, si, hi + first // group, 0)),
        pl.BlockSpec((None, tile, half), lambda bi, si, hi: (bi, si, 0)),
        pl.BlockSpec((None, tile, half), lambda bi, si, hi: (bi, si, 0)),
        pl.BlockSpec((half,), lambda bi, si, hi: (0,)),
        pl.BlockSpec((half,), lambda bi, si, hi: (0,)),
    ]
    common = dict(grid=(b, (s + pad) // tile, h // group), interpret=interpret,
                  compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=2))
    if block_sums:
        n_parts = (s + pad) // tile  # (key blocks, or their parts of `tile` tokens)
        out_specs = [pl.BlockSpec((None, None, group, d), lambda bi, si, hi: (bi, si, hi, 0))]
        out_shape = [jax.ShapeDtypeStruct((b, n_parts, h, d), jnp.float32)]
        inputs = [lengths, x, cos_half, sin_half, w_even, w_odd]
        if v_src is not None:
            in_specs.append(pl.BlockSpec((None, tile, group, d), lambda bi, si, hi: (bi, si, hi + v_first // group, 0)))
            inputs.append(v_src)
            out_specs.append(pl.BlockSpec((None, None, group, 3, d), lambda bi, si, hi: (bi, si, hi, 0, 0)))
            out_shape.append(jax.ShapeDtypeStruct((b, n_parts, h, 3, d), jnp.float32))
        if key_range:
            out_specs.append(pl.BlockSpec((None, None, group, 2, d), lambda bi, si, hi: (bi, si, hi, 0, 0)))
            out_shape.append(jax.ShapeDtypeStruct((b, n_parts, h, 2, d), jnp.float32))
        outs = pl.pallas_call(sums_kernel, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                              name="rms_rope_sums" if v_src is None else "rms_rope_sums_v_range", **common)(*inputs)
        return outs[0] if len(outs) == 1 else tuple(outs)
    vector_specs = [pl.BlockSpec((None, group, half), lambda bi, si, hi: (bi, hi, 0)),
                    pl.BlockSpec((None, group, half), lambda bi, si, hi: (bi, hi, 0))]
    q_spec = pl.BlockSpec((None, tile, group, d), lambda bi, si, hi: (bi, si, hi, 0))
    q_shape = jax.ShapeDtypeStruct((b, s + pad, h, d), jnp.int8)
    name = "rms_rope_int8_keys" if masked else "rms_rope_int8"
    if steps is not None:  # given steps: a program quantizes `tile` tokens of a block, no reduction over it
        per_block = block // tile
        qi = pl.pallas_call(
            kernel, in_specs=in_specs + vector_specs + [
                pl.BlockSpec((None, None, group), lambda bi, si, hi: (bi, si // per_block, hi))],
            out_specs=q_spec, out_shape=q_shape, name=name + "_given_steps", **common,
        )(lengths, x, cos_half, sin_half, w_even, w_odd, mean_even, mean_odd, steps)
        return qi[:, :s], steps
    qi, qs = pl.pallas_call(
        kernel,
        in_specs=in_specs + vector_specs,
        out_specs=[q_spec, pl.BlockSpec((None, None, group), lambda bi, si, hi: (bi, si, hi))],
        out_shape=[q_shape, jax.ShapeDtypeStruct((b, n_blocks, h), jnp.float32)],
        name=name,
        **common,
    )(lengths, x, cos_half, sin_half, w_even, w_odd, mean_even, mean_odd)
    return qi[:, :s], qs


def int8_attention_fused(q, k, v, norm_q, norm_k, eps: float, cos, sin, *, kv_lengths=None, pv: str = "bf16",
                         block_q: int = 64, block_k: int = 64, scale: float | None = None, interpret: bool = False,
                         num_warps: int = 4, num_stages: int = 2, backend: str = "triton",
                         out_dtype=jnp.float32, pv_accumulation: str = "two_level") -> jax.Array:
    """`int8_attention` of the normed and rotated Q and K, from the raw projections: the fused prologue
    (`int8_qk_prologue`, Triton lowering) replaces the models' RMSNorm and rotary steps and the quantization pass.
    Arguments as `int8_qk_prologue` and `int8_attention` (backend: the attention kernel's); returns `out_dtype`
    (batch, seq, heads, head_dim). With the Mosaic backend and Q in `out_dtype` (the models' case), the kernel
    makes INT8 Q itself, per row (`_q_in_kernel`); only K's prologue runs as a pass."""
    _, scale = _heads_and_scale(q, k, scale)
    _check_pv(pv)
    if backend == "mosaic" and _q_in_kernel(q.dtype, out_dtype):
        return _mosaic_with_q_in_kernel(q, q.shape[2], k, (0, k.shape[2]), v, 0, norm_q, norm_k, eps, cos, sin,
                                        kv_lengths, scale=scale, pv=pv, block_q=block_q, block_k=block_k,
                                        interpret=interpret, num_stages=num_stages, out_dtype=out_dtype,
                                        pv_accumulation=pv_accumulation)
    qi, qs, ki, ks = int8_qk_prologue(q, k, norm_q, norm_k, eps, cos, sin, kv_lengths, scale=scale, block_q=block_q,
                                      block_k=block_k, interpret=interpret)
    return _fused_attention(qi, qs, ki, ks, v, kv_lengths, pv=pv, block_q=block_q, block_k=block_k,
                            interpret=interpret, num_warps=num_warps, num_stages=num_stages, backend=backend,
                            out_dtype=out_dtype, pv_accumulation=pv_accumulation)


def int8_attention_fused_stacked(qkv, num_heads: int, num_kv_heads: int, norm_q, norm_k, eps: float, cos, sin, *,
                                 kv_lengths=None, pv: str = "bf16", block_q: int = 64, block_k: int = 64,
                                 scale: float | None = None, interpret: bool = False, num_warps: int = 4,
                                 num_stages: int = 2, backend: str = "triton", out_dtype=jnp.float32,
                                 pv_accumulation: str = "two_level") -> jax.Array:
    """`int8_attention_fused` on one stacked projection qkv (batch, seq, n * head_dim) whose heads are [Q
    (num_heads) | K (num_kv_heads) | V (num_kv_heads) | anything]: the prologue reads Q and K in place (a stacked
    QKV(G) product needs no copies of them sliced out). Returns (batch, seq, num_heads, head_dim)."""
    d = norm_q.shape[0]
    b, s, width = qkv.shape
    if width % d or width // d < num_heads + 2 * num_kv_heads:
        raise ValueError(f"qkv has {width} channels: not {num_heads} + 2 x {num_kv_heads} heads of {d} (and more)")
    _, scale = _group_and_scale(num_heads, num_kv_heads, d, scale)
    _check_pv(pv)
    x = qkv.reshape(b, s, width // d, d)
    if s % block_q or s % block_k:  # the prologue would pad its whole source: slice Q and K out (and pad) instead
        q, k, v = (x[:, :, a:a + n] for a, n in ((0, num_heads), (num_heads, num_kv_heads),
                                                  (num_heads + num_kv_heads, num_kv_heads)))
        return int8_attention_fused(q, k, v, norm_q, norm_k, eps, cos, sin, kv_lengths=kv_lengths, pv=pv,
                                    block_q=block_q, block_k=block_k, scale=scale, interpret=interpret,
                                    num_warps=num_warps, num_stages=num_stages, backend=backend, out_dtype=out_dtype,
                                    pv_accumulation=pv_accumulation)
    v = x[:, :, num_heads + num_kv_heads:num_heads + 2 * num_kv_heads]
    if backend == "mosaic" and _q_in_kernel(x.dtype, out_dtype):
        return _mosaic_with_q_in_kernel(x, num_heads, x, (num_heads, num_kv_heads), x, num_heads + num_kv_heads,
                                        norm_q, norm_k, eps, cos, sin,
                                        kv_lengths, scale=scale, pv=pv, block_q=block_q, block_k=block_k,
                                        interpret=interpret, num_stages=num_stages, out_dtype=out_dtype,
                                        pv_accumulation=pv_accumulation)
    qi, qs, ki, ks = int8_qk_prologue_stacked(x, num_heads, num_kv_heads, norm_q, norm_k, eps, cos, sin, kv_lengths,
                                              scale=scale, block_q=block_q, block_k=block_k, interpret=interpret)
    return _fused_attention(qi, qs, ki, ks, v, kv_lengths, pv=pv, block_q=block_q, block_k=block_k,
                            interpret=interpret, num_warps=num_warps, num_stages=num_stages, backend=backend,
                            out_dtype=out_dtype, pv_accumulation=pv_accumulation)


# How the Mosaic kernel's softmax sums its rows with FP8 P.V in place (`_int8_attention_mosaic`'s `row_sums`):
# "adds" or "wgmma" (session 13: the kernel 583 -> 554 us at 4224 tokens, the same error).
MOSAIC_ROW_SUMS = "wgmma"

# Compute warpgroups a CTA of the Mosaic kernel (`_int8_attention_mosaic`'s `compute_wgs`); None: `_compute_wgs`'
# choice (3 where it measured faster). Session 16 at Krea 2's 4224 tokens, FP8 P.V, the fused call alone at the cap:
# 644 us with 2, 610 with 3 (Q made in the kernel; outputs equal to the bit; 599 with V then read in place); the fp8
# step A B B A 0.1052 / 0.1048 / 0.1041 / 0.1057 s (2, 3, 3, 2).
MOSAIC_COMPUTE_WGS = None


# Registers a thread of the memory warpgroup keeps (`setmaxnreg`), by compute warpgroups: the compute ones get the
# rest (`compute_registers`: 232 with two, 160 with three). 40 with three (152 for compute): Krea 2's fused call
# alone 1566 us against 603 (session 17; the compute warpgroups spill).
MOSAIC_MEMORY_REGISTERS = {2: 40, 3: 24}


def _compute_wgs(pv: str, head_dim: int, q_len: int, interpret: bool, float32_q_tiles: bool = False) -> int:
    """Three compute warpgroups for FP8 P.V at head_dim <= 128 (the accumulator and the logits fit 160 registers a
    thread) where 192-row CTAs pad the queries no more than 128-row ones; else two. Shared memory rules out bf16
    P.V (V's tiles) and, at head_dim 128, `float32_q_tiles` (Q made in the kernel from float32 tiles, which use the
    output's: 269528 > 232448 bytes). Two in interpret mode: on this project's 2-core CI machine the
    Mosaic GPU interpreter never started a kernel's fourth thread (the three-warpgroup kernel hung there; it runs
    on the GPU, equal to two warpgroups' to the bit)."""
    if MOSAIC_COMPUTE_WGS is not None:
        return MOSAIC_COMPUTE_WGS
    rows = MOSAIC_ROWS
    fits = pv == "fp8" and head_dim <= (64 if float32_q_tiles else 128) and not interpret
    return 3 if fits and (-q_len) % (3 * rows) <= (-q_len) % (2 * rows) else 2


# The Mosaic kernel's FP8 P.V subtracts V's channel means and adds them back (`_int8_attention_mosaic`'s `smooth_v`).
MOSAIC_SMOOTH_V = True

# With FP8 P.V, the fused Mosaic attention's K sums pass also takes V's range (`_rms_rope_quantize(values=...)`)
# rather than an XLA reduction over V (19 us a call at Krea 2's size, session 15); False restores the reduction.
MOSAIC_V_RANGE_IN_K_SUMS = True

# The Mosaic backend of the fused attention makes INT8 Q in the kernel (`_int8_attention_mosaic`'s `q_prologue`)
# rather than in the Q prologue's pass; False restores the pass (benchmarks compare the two).
MOSAIC_Q_IN_KERNEL = True


def _q_in_kernel(q_dtype, out_dtype) -> bool:
    """Whether the Mosaic kernel makes INT8 Q itself: `MOSAIC_Q_IN_KERNEL`, and raw Q's tiles can use the output
    tiles' shared memory (the same dtype: the models' case)."""
    return MOSAIC_Q_IN_KERNEL and jnp.dtype(q_dtype) == jnp.dtype(out_dtype)


def _mosaic_with_q_in_kernel(q_src, num_heads, k_src, k_heads, v_src, v_first, norm_q, norm_k, eps, cos, sin,
                             kv_lengths, *, scale, pv, block_q, block_k, interpret, num_stages, out_dtype,
                             pv_accumulation):
    """The fused attention on the Mosaic kernel with Q's prologue inside it: K's prologue passes (natural channel
    order) and the kernel, which reads Q's first `num_heads` heads of `q_src` in place. V: the heads of `v_src`
    from `v_first` on, as many as K's; with FP8 P.V, K's sums pass reads their range in place
    (`MOSAIC_V_RANGE_IN_K_SUMS`)."""
    if block_q != MOSAIC_ROWS:
        raise ValueError(f"the mosaic backend quantizes Q per row in blocks of {MOSAIC_ROWS} (one warpgroup): "
                         f"block_q must be {MOSAIC_ROWS}, got {block_q}")
    hk = k_heads[1]
    values = (v_src, (v_first, hk)) if pv == "fp8" and MOSAIC_V_RANGE_IN_K_SUMS else None
    _, _, ki, ks, *v_range = _qk_prologue(q_src, (0, num_heads), k_src, k_heads, norm_q, norm_k, eps, cos, sin,
                                          kv_lengths, scale=scale, block_q=block_q, block_k=block_k, smooth_k=True,
                                          interpret=interpret, k_only=True, values=values, split_pairs=K_SPLIT_PAIRS,
                                          sums_rows=K_SUMS_ROWS)
    return _int8_attention_mosaic(q_src, None, ki, ks, v_src, kv_lengths, pv=pv, block_k=block_k,
                                  num_stages=num_stages, interpret=interpret, out_dtype=out_dtype,
                                  pv_accumulation=pv_accumulation,
                                  q_prologue=MosaicQPrologue(norm_q, eps, cos, sin, scale, num_heads),
                                  v_range=v_range[0] if v_range else None, v_heads=(v_first, hk))


def _fused_attention(qi, qs, ki, ks, v, kv_lengths, **options):
    """The attention kernel after the fused prologue; V as the projection gives it (each kernel zeroes the masked
    keys' values where it reads them: no float32 copy of V is written first)."""
    return _attention_backend(qi, qs, ki, ks, v, kv_lengths, **options)
