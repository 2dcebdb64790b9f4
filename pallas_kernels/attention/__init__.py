"""INT8-QK attention (SageAttention-style) for DiTs: the plain-jnp reference that defines its numerics
(`reference.py`), a portable kernel (`triton.py`, Pallas' Triton lowering), a Hopper kernel (`mosaic.py`, Pallas
Mosaic GPU), the fused prologue that makes INT8 Q and K from the raw projections (`prologue.py`), and their tuning
(`config.py`). docs/kernels/int8_attention.md describes the algorithm and each kernel's contract. The recipe:

- K smoothing: the mean of K over the key sequence (per head and channel) is subtracted. Softmax is invariant to a
  per-row constant, so the output is unchanged, while the channel outliers real DiTs have in K stop dominating the
  INT8 range.
- Q (with the softmax scale folded in) and smoothed K are quantized to INT8 per block of `block_q` query / `block_k`
  key tokens and head, scale = amax / 127 (the Mosaic kernel that makes Q from the raw projection itself: per query
  row); Q.K^T is an INT8 product with INT32 accumulation, rescaled by the two block scales; the softmax runs in
  float32.
- P.V in bfloat16 (`pv="bf16"`), or in FP8 (`pv="fp8"`): V per channel to E4M3 (scale amax / 448; the Mosaic
  kernel first subtracts V's channel means, and adds them to the output), P with the fixed scale 448 (P lies in
  [0, 1]), float32 accumulation.
- GQA without repeating K/V in memory (query head n reads KV head n // group); a key padding mask given as the number
  of valid keys per batch element, as the models pass it (`kv_lengths`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .config import MOSAIC_ROWS, AttentionConfig, PrologueConfig, default_config
from .mosaic import mosaic_attention
from .mosaic_fragments import MosaicQPrologue
from .prologue import _qk_prologue, int8_qk_prologue, int8_qk_prologue_stacked
from .reference import (_check_pv, _group_and_scale, _heads_and_scale, _prologue, int8_attention_reference,
                        rms_rope_reference)
from .triton import triton_attention, v_fp8_operand

__all__ = ["AttentionConfig", "PrologueConfig", "default_config", "int8_attention", "int8_attention_fused",
           "int8_attention_fused_stacked", "int8_attention_reference", "int8_qk_prologue", "int8_qk_prologue_stacked",
           "rms_rope_reference", "v_fp8_operand", "MOSAIC_ROWS"]


def int8_attention(q, k, v, *, kv_lengths=None, pv: str = "bf16", backend: str = "triton",
                   config: AttentionConfig | None = None, scale: float | None = None, interpret: bool = False,
                   out_dtype=jnp.float32) -> jax.Array:
    """INT8-QK attention through a Pallas kernel; same arguments and result as `int8_attention_reference`
    (online softmax instead of a full one: equal up to rounding).

    pv "bf16": P.V in bf16. "fp8": V per channel in E4M3 (scale amax / 448, over the valid keys), P (the running,
    unnormalised exponentials, in [0, 1]) times 448 in E4M3, float32 accumulation; the V scale is applied once at the
    end. Each program walks the key blocks up to its batch element's length. GQA reads KV head n // group, so K/V are
    never repeated in memory.

    backend "triton": the portable kernel (`triton_attention`); "mosaic": the Hopper kernel (`mosaic_attention`).
    config: the kernel's tiling (None: `default_config(backend, ...)`, the measured best). out_dtype: the result's
    dtype (float32, as the reference, by default; the models ask for theirs, which the Mosaic kernel writes
    directly)."""
    _, scale = _heads_and_scale(q, k, scale)
    _check_pv(pv)
    config = config or default_config(backend, pv, q.shape[3], q.shape[1], interpret=interpret)
    qi, qs, ki, ks, v32, _ = _prologue(q, k, v, kv_lengths, config.block_q, config.block_k, scale)
    return _attention_backend(qi, qs, ki, ks, v32, kv_lengths, pv=pv, backend=backend, config=config,
                              interpret=interpret, out_dtype=out_dtype)


def _attention_backend(qi, qs, ki, ks, v, kv_lengths, *, pv, backend, config: AttentionConfig, interpret, out_dtype):
    """The attention kernel on quantized Q and K; V as the projection gives it (each kernel zeroes the masked keys'
    values where it reads them: no float32 copy of V is written first)."""
    if backend == "triton":
        if config.pv_accumulation != "two_level":
            raise ValueError("pv_accumulation='in_place' is the mosaic backend's (the Triton kernel adds each block's "
                             "product to its float32 accumulator)")
        return triton_attention(qi, qs, ki, ks, v, kv_lengths, pv=pv, config=config,
                                interpret=interpret).astype(out_dtype)
    if backend == "mosaic":
        return mosaic_attention(qi, qs, ki, ks, v, kv_lengths, pv=pv, config=config, interpret=interpret,
                                out_dtype=out_dtype)
    raise ValueError(f"backend must be 'triton' or 'mosaic', got {backend!r}")


def int8_attention_fused(q, k, v, norm_q, norm_k, eps: float, cos, sin, *, kv_lengths=None, pv: str = "bf16",
                         backend: str = "triton", config: AttentionConfig | None = None, scale: float | None = None,
                         interpret: bool = False, out_dtype=jnp.float32) -> jax.Array:
    """`int8_attention` of the normed and rotated Q and K, from the raw projections: the fused prologue
    (`int8_qk_prologue`, Triton lowering) replaces the models' RMSNorm and rotary steps and the quantization pass.
    Arguments as `int8_qk_prologue` and `int8_attention`; returns `out_dtype` (batch, seq, heads, head_dim). With
    the Mosaic backend and Q in `out_dtype` (the models' case), the kernel makes INT8 Q itself, per row; only K's
    prologue runs as a pass."""
    _, scale = _heads_and_scale(q, k, scale)
    _check_pv(pv)
    config = config or _fused_default_config(backend, pv, q.shape[3], q.shape[1], q.dtype, out_dtype, interpret)
    if _q_in_kernel(backend, q.dtype, out_dtype):
        return _mosaic_with_q_in_kernel(q, q.shape[2], k, (0, k.shape[2]), v, 0, norm_q, norm_k, eps, cos, sin,
                                        kv_lengths, scale=scale, pv=pv, config=config, interpret=interpret,
                                        out_dtype=out_dtype)
    qi, qs, ki, ks = int8_qk_prologue(q, k, norm_q, norm_k, eps, cos, sin, kv_lengths, scale=scale,
                                      block_q=config.block_q, block_k=config.block_k, interpret=interpret,
                                      config=config.prologue)
    return _attention_backend(qi, qs, ki, ks, v, kv_lengths, pv=pv, backend=backend, config=config,
                              interpret=interpret, out_dtype=out_dtype)


def int8_attention_fused_stacked(qkv, num_heads: int, num_kv_heads: int, norm_q, norm_k, eps: float, cos, sin, *,
                                 kv_lengths=None, pv: str = "bf16", backend: str = "triton",
                                 config: AttentionConfig | None = None, scale: float | None = None,
                                 interpret: bool = False, out_dtype=jnp.float32) -> jax.Array:
    """`int8_attention_fused` on one stacked projection qkv (batch, seq, n * head_dim) whose heads are [Q
    (num_heads) | K (num_kv_heads) | V (num_kv_heads) | anything]: the prologue reads Q and K in place (a stacked
    QKV(G) product needs no copies of them sliced out). Returns (batch, seq, num_heads, head_dim)."""
    d = norm_q.shape[0]
    b, s, width = qkv.shape
    if width % d or width // d < num_heads + 2 * num_kv_heads:
        raise ValueError(f"qkv has {width} channels: not {num_heads} + 2 x {num_kv_heads} heads of {d} (and more)")
    _, scale = _group_and_scale(num_heads, num_kv_heads, d, scale)
    _check_pv(pv)
    config = config or _fused_default_config(backend, pv, d, s, qkv.dtype, out_dtype, interpret)
    x = qkv.reshape(b, s, width // d, d)
    options = dict(kv_lengths=kv_lengths, pv=pv, backend=backend, config=config, scale=scale, interpret=interpret,
                   out_dtype=out_dtype)
    if s % config.block_q or s % config.block_k:  # the prologue would pad its whole source: slice Q, K, V out instead
        q, k, v = (x[:, :, a:a + n] for a, n in ((0, num_heads), (num_heads, num_kv_heads),
                                                  (num_heads + num_kv_heads, num_kv_heads)))
        return int8_attention_fused(q, k, v, norm_q, norm_k, eps, cos, sin, **options)
    v = x[:, :, num_heads + num_kv_heads:num_heads + 2 * num_kv_heads]
    if _q_in_kernel(backend, x.dtype, out_dtype):
        return _mosaic_with_q_in_kernel(x, num_heads, x, (num_heads, num_kv_heads), x, num_heads + num_kv_heads,
                                        norm_q, norm_k, eps, cos, sin, kv_lengths, scale=scale, pv=pv, config=config,
                                        interpret=interpret, out_dtype=out_dtype)
    qi, qs, ki, ks = int8_qk_prologue_stacked(x, num_heads, num_kv_heads, norm_q, norm_k, eps, cos, sin, kv_lengths,
                                              scale=scale, block_q=config.block_q, block_k=config.block_k,
                                              interpret=interpret, config=config.prologue)
    return _attention_backend(qi, qs, ki, ks, v, kv_lengths, pv=pv, backend=backend, config=config,
                              interpret=interpret, out_dtype=out_dtype)


def _q_in_kernel(backend: str, q_dtype, out_dtype) -> bool:
    """Whether the fused attention makes INT8 Q inside the Mosaic kernel: raw Q's tiles use the output tiles' shared
    memory, so they need its dtype (the models' case)."""
    return backend == "mosaic" and jnp.dtype(q_dtype) == jnp.dtype(out_dtype)


def _fused_default_config(backend, pv, head_dim, q_len, q_dtype, out_dtype, interpret) -> AttentionConfig:
    """`default_config` for a fused call: Q made in the kernel from float32 tiles leaves less shared memory."""
    float32_q_tiles = _q_in_kernel(backend, q_dtype, out_dtype) and jnp.dtype(out_dtype).itemsize > 2
    return default_config(backend, pv, head_dim, q_len, interpret=interpret, float32_q_tiles=float32_q_tiles)


def _mosaic_with_q_in_kernel(q_src, num_heads, k_src, k_heads, v_src, v_first, norm_q, norm_k, eps, cos, sin,
                             kv_lengths, *, scale, pv, config, interpret, out_dtype):
    """The fused attention on the Mosaic kernel with Q's prologue inside it: K's prologue passes (natural channel
    order) and the kernel, which reads Q's first `num_heads` heads of `q_src` in place. V: the heads of `v_src`
    from `v_first` on, as many as K's; with FP8 P.V, K's sums pass reads their range in place."""
    if config.block_q != MOSAIC_ROWS:
        raise ValueError(f"the mosaic backend quantizes Q per row in blocks of {MOSAIC_ROWS} (one warpgroup): "
                         f"block_q must be {MOSAIC_ROWS}, got {config.block_q}")
    hk = k_heads[1]
    values = (v_src, (v_first, hk)) if pv == "fp8" else None
    _, _, ki, ks, *v_range = _qk_prologue(q_src, (0, num_heads), k_src, k_heads, norm_q, norm_k, eps, cos, sin,
                                          kv_lengths, scale=scale, block_q=config.block_q, block_k=config.block_k,
                                          smooth_k=True, interpret=interpret, k_only=True, values=values,
                                          config=config.prologue)
    return mosaic_attention(q_src, None, ki, ks, v_src, kv_lengths, pv=pv, config=config, interpret=interpret,
                            out_dtype=out_dtype, q_prologue=MosaicQPrologue(norm_q, eps, cos, sin, scale, num_heads),
                            v_range=v_range[0] if v_range else None, v_heads=(v_first, hk))
