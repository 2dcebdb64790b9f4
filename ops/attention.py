"""The models' attention: which kernel runs (`attention_implementation`: per device and dtype, or as asked), the
kernels behind one call (`attention`), and the call a model's attention block makes (`attend`): the per-head norms
and rotary embedding of q and k, then the kernel; for the INT8-QK kernels of `pallas_kernels.attention` all of that
in the kernel's fused prologue.

Shapes: q (batch, seq, heads, head_dim); k and v (batch, kv_seq, kv_heads, head_dim) with heads a multiple of
kv_heads (GQA: query head n reads KV head n // (heads // kv_heads), what diffusers' repeat_interleave of the KV heads
computes, without the copies); only the first `kv_lengths[b]` keys are attended to (the models order padded tokens
last); the output is shaped as q.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from mxdit.pallas_kernels import attention as attention_kernels

from . import kernels
from .kernels import jitted, on_gpu
from .names import AttentionKernel

_MOSAIC_ATTENTION = (AttentionKernel.INT8_MOSAIC, AttentionKernel.INT8_MOSAIC_FP8)

# An attention function in place of a kernel name, e.g. sharding/'s sequence-parallel attention:
# (q, k, v, kv_lengths) -> out, shaped as above.
AttentionFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array | None], jax.Array]


class HeadNorm(Protocol):
    """A per-head RMSNorm of q or k with a zero-centred scale (multiplier `1 + weight`), as Krea 2's: the INT8
    kernels' fused prologue computes it from `weight` (read as `weight[...]`, float32) and `eps`."""

    weight: Any
    eps: float

    def __call__(self, x: jax.Array) -> jax.Array: ...


def attention_implementation(requested: str | None, dtype) -> AttentionKernel:
    """The attention kernel a model uses: `requested`, or by default cuDNN on an NVIDIA GPU for 16-bit dtypes and XLA
    otherwise (the INT8 kernels trade accuracy for speed: only when asked for). Raises ValueError for a kernel this
    GPU cannot run (the Mosaic ones off Hopper, cuDNN off NVIDIA)."""
    if requested is None:
        cudnn = kernels.on_nvidia() and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
        return AttentionKernel.CUDNN if cudnn else AttentionKernel.XLA
    try:
        kernel = AttentionKernel(requested)
    except ValueError:
        raise ValueError(f"attention must be one of {', '.join(AttentionKernel)}, got {requested!r}") from None
    arch = kernels.gpu_architecture()
    if arch is not None and kernel in _MOSAIC_ATTENTION and kernels.kernel_family() != "mosaic":
        raise ValueError(f"attention {kernel.value}: a Mosaic GPU kernel for Hopper (H100, H200); this GPU ({arch}) "
                         f"runs {kernel.value.replace('_mosaic', '')} (the same kernel through Triton)")
    if arch is not None and kernel is AttentionKernel.CUDNN and not kernels.on_nvidia():
        raise ValueError(f"attention cudnn: NVIDIA's library; this GPU ({arch}) runs xla or the int8 kernels")
    return kernel


def cudnn_takes_head_dim(head_dim: int) -> bool:
    """cuDNN's fused attention takes head dims that are multiples of 8 up to 128 (256 on Hopper): the released
    models' 128 always; anything else runs XLA's attention instead."""
    return head_dim % 8 == 0 and head_dim <= 128


def attention(q: jax.Array, k: jax.Array, v: jax.Array, kv_lengths: jax.Array | None,
              implementation: AttentionKernel | str | AttentionFn) -> jax.Array:
    """Non-causal attention of q, k, v (shapes in the module docstring). `implementation`: a kernel name or an
    `AttentionFn`. An INT8 kernel here quantizes q and k itself; `attend` fuses that with their norms and rotation."""
    if callable(implementation):
        return implementation(q, k, v, kv_lengths)
    kernel = AttentionKernel(implementation)
    if kernel.is_int8:
        return _int8_kernel(attention_kernels.int8_attention, q, k, v, kernel=kernel, kv_lengths=kv_lengths,
                            out_dtype=q.dtype)
    if kernel is AttentionKernel.CUDNN and not cudnn_takes_head_dim(q.shape[-1]):
        kernel = AttentionKernel.XLA  # a small model's narrow heads (a tiny fixture's text blocks)
    return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=kv_lengths, implementation=kernel.value)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, kv_lengths: jax.Array | None,
           implementation: AttentionKernel | str | AttentionFn, *, norms: tuple[HeadNorm, HeadNorm],
           rotary: tuple[jax.Array, jax.Array] | None = None, stacked: jax.Array | None = None) -> jax.Array:
    """`attention` of the projected q, k, v after q's and k's per-head `norms` and, given `rotary` (the cos and sin
    tables of `model.layers.rotary_tables`), their rotary embedding. Returns (batch, seq, heads, head_dim).

    With an INT8 kernel and rotary tables, the norms, the rotation and the INT8 quantization of q and k run in one
    pass, the kernel's prologue, which takes q and k straight from their projections; `stacked`, the product q, k
    and v were split from (channels [Q | K | V | ...]), lets it read them in place there."""
    norm_q, norm_k = norms
    if isinstance(implementation, str) and AttentionKernel(implementation).is_int8 and rotary is not None:
        prologue = (norm_q.weight[...], norm_k.weight[...], norm_q.eps, *rotary)
        kernel = AttentionKernel(implementation)
        if stacked is not None:
            return _int8_kernel(attention_kernels.int8_attention_fused_stacked, stacked, q.shape[2], k.shape[2],
                                *prologue, kernel=kernel, kv_lengths=kv_lengths, out_dtype=stacked.dtype)
        return _int8_kernel(attention_kernels.int8_attention_fused, q, k, v, *prologue, kernel=kernel,
                            kv_lengths=kv_lengths, out_dtype=q.dtype)
    q, k = norm_q(q), norm_k(k)
    if rotary is not None:
        q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
    return attention(q, k, v, kv_lengths, implementation)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate interleaved channel pairs of x (batch, seq, heads, head_dim) by tables of shape (seq, head_dim) or
    (batch, seq, head_dim); computed in float32."""
    real, imag = x[..., 0::2], x[..., 1::2]
    rotated = jnp.stack([-imag, real], axis=-1).reshape(x.shape)
    cos, sin = cos[..., None, :], sin[..., None, :]  # broadcast over heads
    return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)


def _int8_kernel(entry: Callable, *args, kernel: AttentionKernel, kv_lengths, out_dtype) -> jax.Array:
    """`entry` (an INT8-QK entry point of `pallas_kernels.attention`) for `kernel`: its backend and P.V precision,
    the kernel's default config for them. On a GPU under its own jit (`kernels.jitted`); elsewhere (tests) in
    interpret mode and called directly: under that jit the Mosaic GPU interpreter does not finish."""
    backend = "mosaic" if kernel in _MOSAIC_ATTENTION else "triton"
    pv = "fp8" if kernel in (AttentionKernel.INT8_FP8, AttentionKernel.INT8_MOSAIC_FP8) else "bf16"
    function = jitted(entry) if on_gpu() else entry
    return function(*args, kv_lengths=kv_lengths, backend=backend, pv=pv, interpret=not on_gpu(), out_dtype=out_dtype)
