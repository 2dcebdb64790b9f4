"""The Krea 2 single-stream MMDiT in Flax NNX, equal in function to diffusers' `Krea2Transformer2DModel` (0.42.1).

Read top to bottom: norm, rotary embedding, attention, SwiGLU, the text-fusion stage, the transformer block, the
timestep and text embeddings, the final layer, then the model with its loading from disk. Attribute names follow
diffusers', so a parameter's path in the module is its key in a diffusers checkpoint.

Text conditioning arrives as a stack of hidden states tapped from several layers of the Qwen3-VL text encoder. The
text-fusion stage collapses that layer axis and refines the tokens; the result joins the patchified image latents in
one sequence processed by the blocks. The timestep conditions every block through one shared modulation vector plus a
learned table per block.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mxdit.ops.attention import AttentionFn, attend, attention_implementation
from mxdit.ops.linear import FP8Activations, fp8_input_backend, fused_fp8_producer
from mxdit.ops.names import AttentionKernel

from .layers import Linear, remat_call, rotary_tables, shard_activation, stacked_linear
from .loading import (Checkpoint, CheckpointError, KeyMap, config_from_dict, load_state, open_checkpoint,
                      read_json)


@dataclasses.dataclass(frozen=True)
class Krea2Config:
    """The transformer's config.json (diffusers names); defaults are the released Krea 2 model's."""

    in_channels: int = 64
    num_layers: int = 28
    attention_head_dim: int = 128
    num_attention_heads: int = 48
    num_key_value_heads: int = 12
    intermediate_size: int = 16384
    timestep_embed_dim: int = 256
    text_hidden_dim: int = 2560
    num_text_layers: int = 12
    text_num_attention_heads: int = 20
    text_num_key_value_heads: int = 20
    text_intermediate_size: int = 6912
    num_layerwise_text_blocks: int = 2
    num_refiner_text_blocks: int = 2
    axes_dims_rope: tuple[int, int, int] = (32, 48, 48)
    rope_theta: float = 1000.0
    norm_eps: float = 1e-5

    def __post_init__(self):
        if sum(self.axes_dims_rope) != self.attention_head_dim:
            raise ValueError(
                f"sum(axes_dims_rope)={sum(self.axes_dims_rope)} must equal attention_head_dim={self.attention_head_dim}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

    @property
    def hidden_size(self) -> int:
        return self.attention_head_dim * self.num_attention_heads

    @classmethod
    def from_json(cls, path: str | Path) -> "Krea2Config":
        return config_from_dict(cls, read_json(Path(path)), str(path))


# --------------------------------------------------------------------------------------------------------------------
# Building blocks


class RMSNorm(nnx.Module):
    """RMSNorm with a zero-centred scale (multiplier `1 + weight`), computed in float32 with a float32 weight, as in
    the checkpoint format; the result is cast back to the input dtype."""

    def __init__(self, dim: int, eps: float):
        self.eps = eps
        self.weight = nnx.Param(jnp.zeros((dim,), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * (1.0 + self.weight[...])).astype(x.dtype)


class Attention(nnx.Module):
    """Self-attention with grouped-query projections, per-head q/k RMSNorm, rotary embedding and a sigmoid output
    gate: `to_out(attention(q, k, v) * sigmoid(to_gate(x)))`."""

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, eps: float, *, dtype, rngs: nnx.Rngs):
        if dim % num_heads:
            raise ValueError(f"hidden size {dim} must be divisible by num_heads={num_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, dim // num_heads
        self.to_q = Linear(dim, num_heads * self.head_dim, bias=False, dtype=dtype, rngs=rngs)
        self.to_k = Linear(dim, num_kv_heads * self.head_dim, bias=False, dtype=dtype, rngs=rngs)
        self.to_v = Linear(dim, num_kv_heads * self.head_dim, bias=False, dtype=dtype, rngs=rngs)
        self.to_gate = Linear(dim, dim, bias=False, dtype=dtype, rngs=rngs)
        self.norm_q = RMSNorm(self.head_dim, eps)
        self.norm_k = RMSNorm(self.head_dim, eps)
        self.to_out = nnx.List([Linear(dim, dim, bias=False, dtype=dtype, rngs=rngs)])
        self.to_qkvg = nnx.data(None)  # `stack_projections`: Q, K, V and the gate as one Linear (inference)

    def input_layers(self) -> list[Linear]:
        """The layers that take the attention's input."""
        return [self.to_qkvg] if self.to_qkvg is not None else [self.to_q, self.to_k, self.to_v, self.to_gate]

    def stack_projections(self) -> bool:
        """Replace to_q, to_k, to_v and to_gate by one Linear of their stacked weights (one product of x instead of
        four). For inference: the separate layers are gone afterwards. False when they cannot be stacked."""
        if self.to_qkvg is not None:
            return False
        stacked = stacked_linear([self.to_q, self.to_k, self.to_v, self.to_gate],
                                 ("to_q", "to_k", "to_v", "to_gate"))
        if stacked is not None:
            self.to_qkvg = stacked
            self.to_q = self.to_k = self.to_v = self.to_gate = None
        return stacked is not None

    def __call__(
        self,
        x: jax.Array,
        rotary: tuple[jax.Array, jax.Array] | None = None,
        kv_lengths: jax.Array | None = None,
        implementation: AttentionKernel | AttentionFn = AttentionKernel.XLA,
        residual: jax.Array | None = None,
        residual_gate: jax.Array | None = None,
    ) -> jax.Array:
        """x: (batch, seq, dim). `kv_lengths` (batch,) int32: only the first kv_lengths[b] tokens are attended to as
        keys (the caller orders padded tokens last). `implementation`: a kernel name or an `AttentionFn`. Returns
        (batch, seq, dim); with `residual` and `residual_gate` (batch, 1, dim): `residual + residual_gate * that`
        (the output projection's epilogue, see `Linear.gated_residual`)."""
        q, k, v, gate, stacked = self._project(x)
        out = attend(q, k, v, kv_lengths, implementation, norms=(self.norm_q, self.norm_k), rotary=rotary,
                     stacked=stacked)
        out = self._gate(out.reshape(*x.shape[:2], -1), gate, stacked)
        if residual is not None:
            return self.to_out[0].gated_residual(out, residual, residual_gate)
        return self.to_out[0](out)

    def _project(self, x: jax.Array):
        """q, k, v (batch, seq, heads, head_dim), the gate (batch, seq, dim), and the stacked product they are
        slices of (None for separate projections)."""
        batch, seq, _ = x.shape
        nq, nk = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.to_qkvg is not None:
            stacked = self.to_qkvg(x)
            q, k, v, gate = jnp.split(stacked, [nq, nq + nk, nq + 2 * nk], axis=-1)
        else:
            stacked, (q, k, v, gate) = None, (self.to_q(x), self.to_k(x), self.to_v(x), self.to_gate(x))
        q = q.reshape(batch, seq, self.num_heads, self.head_dim)
        k, v = (t.reshape(batch, seq, self.num_kv_heads, self.head_dim) for t in (k, v))
        return q, k, v, gate, stacked

    def _gate(self, out: jax.Array, gate: jax.Array, stacked: jax.Array | None):
        """`out * sigmoid(gate)`; when the output projection takes FP8 activations, the gate (read in place from the
        stacked product) and the quantization in one pass."""
        backend = None if stacked is None else fp8_input_backend(self.to_out[0])
        if backend is None:
            return out * jax.nn.sigmoid(gate)
        gate_offset = stacked.shape[-1] - gate.shape[-1]  # the gate is the stacked product's last slice
        values, scales = fused_fp8_producer("sigmoid_gated_fp8", backend)(out, stacked, gate_offset=gate_offset)
        return FP8Activations(values, scales, out.dtype)


class SwiGLU(nnx.Module):
    def __init__(self, dim: int, hidden_dim: int, *, dtype, rngs: nnx.Rngs):
        self.gate = Linear(dim, hidden_dim, bias=False, dtype=dtype, rngs=rngs)
        self.up = Linear(dim, hidden_dim, bias=False, dtype=dtype, rngs=rngs)
        self.down = Linear(hidden_dim, dim, bias=False, dtype=dtype, rngs=rngs)
        self.gate_up = nnx.data(None)  # `stack_projections`: gate and up as one Linear (inference)

    def input_layers(self) -> list[Linear]:
        """The layers that take the block's input."""
        return [self.gate_up] if self.gate_up is not None else [self.gate, self.up]

    def stack_projections(self) -> bool:
        """Replace gate and up by one Linear of their stacked weights (see `Attention.stack_projections`)."""
        if self.gate_up is not None:
            return False
        stacked = stacked_linear([self.gate, self.up], ("gate", "up"), swiglu=True)
        if stacked is not None:
            self.gate_up, self.gate, self.up = stacked, None, None
        return stacked is not None

    def __call__(self, x: jax.Array, residual: jax.Array | None = None,
                 residual_gate: jax.Array | None = None) -> jax.Array:
        """With `residual` and `residual_gate`: `residual + residual_gate * swiglu(x)` (see `Attention`)."""
        backend = fp8_input_backend(self.down)
        paired = self.gate_up is not None and getattr(self.gate_up.weight.get_value(), "swiglu_width", 0)
        if paired:  # SwiGLU in the gate/up GEMM's epilogue (`Linear.swiglu`), then one quantizing pass
            hidden = self.gate_up.swiglu(x)
            if backend is not None:
                hidden = FP8Activations(*fused_fp8_producer("tokens_fp8", backend)(hidden), hidden.dtype)
        elif self.gate_up is not None and backend is not None:
            # silu(gate) * up and its FP8 quantization in one pass over the stacked product
            gate_up = self.gate_up(x)
            hidden = FP8Activations(*fused_fp8_producer("swiglu_fp8", backend)(gate_up), gate_up.dtype)
        elif self.gate_up is not None:
            gate, up = jnp.split(self.gate_up(x), 2, axis=-1)
            hidden = jax.nn.silu(gate) * up
        else:
            hidden = jax.nn.silu(self.gate(x)) * self.up(x)
        if residual is not None:
            return self.down.gated_residual(hidden, residual, residual_gate)
        return self.down(hidden)


class TextFusionBlock(nnx.Module):
    """Pre-norm transformer block without rotary embedding or time modulation."""

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, intermediate: int, eps: float, *, dtype, rngs):
        self.norm1 = RMSNorm(dim, eps)
        self.norm2 = RMSNorm(dim, eps)
        self.attn = Attention(dim, num_heads, num_kv_heads, eps, dtype=dtype, rngs=rngs)
        self.ff = SwiGLU(dim, intermediate, dtype=dtype, rngs=rngs)

    def __call__(self, x, kv_lengths=None, implementation: AttentionKernel | AttentionFn = AttentionKernel.XLA):
        x = x + self.attn(self.norm1(x), kv_lengths=kv_lengths, implementation=implementation)
        return x + self.ff(self.norm2(x))


class TextFusion(nnx.Module):
    """Collapses the stack of tapped text-encoder layers into one sequence of text features: `layerwise_blocks`
    attend across the layer axis of each token, a linear `projector` collapses that axis, `refiner_blocks` attend
    across the tokens."""

    def __init__(self, cfg: Krea2Config, *, dtype, rngs: nnx.Rngs):
        def block():
            return TextFusionBlock(
                cfg.text_hidden_dim, cfg.text_num_attention_heads, cfg.text_num_key_value_heads,
                cfg.text_intermediate_size, cfg.norm_eps, dtype=dtype, rngs=rngs,
            )

        self.layerwise_blocks = nnx.List([block() for _ in range(cfg.num_layerwise_text_blocks)])
        self.projector = Linear(cfg.num_text_layers, 1, bias=False, dtype=dtype, rngs=rngs)
        self.refiner_blocks = nnx.List([block() for _ in range(cfg.num_refiner_text_blocks)])

    def __call__(self, text: jax.Array, kv_lengths: jax.Array | None,
                 implementation: AttentionKernel | AttentionFn) -> jax.Array:
        """text: (batch, seq, num_text_layers, dim) -> (batch, seq, dim)."""
        batch, seq, layers, dim = text.shape
        x = text.reshape(batch * seq, layers, dim)
        for block in self.layerwise_blocks:
            x = block(x)  # sequences of `layers` tokens: too short to be worth a fused kernel
        x = self.projector(x.reshape(batch, seq, layers, dim).swapaxes(2, 3))[..., 0]
        for block in self.refiner_blocks:
            x = block(x, kv_lengths=kv_lengths, implementation=implementation)
        return x


class TransformerBlock(nnx.Module):
    """Joint-sequence block: modulated RMSNorm -> gated attention, modulated RMSNorm -> SwiGLU, each added back
    through its own gate. The six modulation vectors are the shared time vector plus this block's learned table."""

    def __init__(self, cfg: Krea2Config, *, dtype, rngs: nnx.Rngs):
        dim = cfg.hidden_size
        self.scale_shift_table = nnx.Param(jnp.zeros((6, dim), dtype))
        self.norm1 = RMSNorm(dim, cfg.norm_eps)
        self.norm2 = RMSNorm(dim, cfg.norm_eps)
        self.attn = Attention(dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.norm_eps, dtype=dtype, rngs=rngs)
        self.ff = SwiGLU(dim, cfg.intermediate_size, dtype=dtype, rngs=rngs)

    def __call__(self, x, temb_mod, rotary, kv_lengths, implementation: AttentionKernel | AttentionFn):
        """x: (batch, seq, dim); temb_mod: (batch, 1, 6 * dim)."""
        batch = temb_mod.shape[0]
        mod = temb_mod.reshape(batch, 1, 6, -1) + self.scale_shift_table[...]
        prescale, preshift, pregate, postscale, postshift, postgate = (mod[:, :, i] for i in range(6))
        x = self.attn(_adaptive_norm(self.norm1, x, prescale, preshift, self.attn.input_layers()), rotary,
                      kv_lengths, implementation, residual=x, residual_gate=pregate)
        return self.ff(_adaptive_norm(self.norm2, x, postscale, postshift, self.ff.input_layers()), residual=x,
                       residual_gate=postgate)


def _adaptive_norm(norm: RMSNorm, x, scale, shift, consumers: list[Linear]):
    """`(1 + scale) * norm(x) + shift`; for layers that multiply FP8 activations, quantized in the same pass
    (pallas_kernels/activations.py), so the normalised tensor is never written out in x's dtype."""
    backend = fp8_input_backend(*consumers)
    if backend is None:
        return (1.0 + scale) * norm(x) + shift
    values, scales = fused_fp8_producer("modulated_rms_norm_fp8", backend)(x, norm.weight[...], scale, shift,
                                                                           eps=norm.eps)
    return FP8Activations(values, scales, x.dtype)


class TimestepEmbedding(nnx.Module):
    """Cos-first sinusoidal embedding of 1000 * t, then a two-layer MLP. Output keeps a length-1 sequence axis."""

    def __init__(self, embed_dim: int, dim: int, *, dtype, rngs: nnx.Rngs):
        self.embed_dim = embed_dim
        self.linear_1 = Linear(embed_dim, dim, bias=True, dtype=dtype, rngs=rngs)
        self.linear_2 = Linear(dim, dim, bias=True, dtype=dtype, rngs=rngs)

    def __call__(self, t: jax.Array, dtype) -> jax.Array:
        """t: (batch,) in [0, 1] -> (batch, 1, dim)."""
        half = self.embed_dim // 2
        freqs = jnp.exp(-math.log(1e4) * jnp.arange(half, dtype=jnp.float32) / half)
        args = (t.astype(jnp.float32) * 1e3)[:, None, None] * freqs
        emb = jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1).astype(dtype)
        return self.linear_2(jax.nn.gelu(self.linear_1(emb), approximate=True))


class TextProjection(nnx.Module):
    """RMSNorm, then a two-layer MLP from the text width to the transformer width."""

    def __init__(self, text_dim: int, dim: int, eps: float, *, dtype, rngs: nnx.Rngs):
        self.norm = RMSNorm(text_dim, eps)
        self.linear_1 = Linear(text_dim, dim, bias=True, dtype=dtype, rngs=rngs)
        self.linear_2 = Linear(dim, dim, bias=True, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear_2(jax.nn.gelu(self.linear_1(self.norm(x)), approximate=True))


class FinalLayer(nnx.Module):
    """Adaptive RMSNorm modulated by the time embedding plus a learned (scale, shift) table, then the projection."""

    def __init__(self, dim: int, out_channels: int, eps: float, *, dtype, rngs: nnx.Rngs):
        self.scale_shift_table = nnx.Param(jnp.zeros((2, dim), dtype))
        self.norm = RMSNorm(dim, eps)
        self.linear = Linear(dim, out_channels, bias=True, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, temb: jax.Array) -> jax.Array:
        mod = temb + self.scale_shift_table[...]  # (batch, 2, dim)
        scale, shift = mod[:, 0:1], mod[:, 1:2]
        return self.linear((1.0 + scale) * self.norm(x) + shift)


# --------------------------------------------------------------------------------------------------------------------
# The model


def stack_projections(model: nnx.Module) -> int:
    """Stack the projections that share an input, in every attention (Q, K, V, gate) and SwiGLU (gate, up) of
    `model`, into single products. For inference, after quantizing and after attaching or fusing LoRAs. Returns how
    many modules were stacked."""
    modules = [node for _, node in nnx.iter_graph(model) if isinstance(node, (Attention, SwiGLU))]
    return sum(node.stack_projections() for node in modules)  # listed first: stacking changes the graph


# Joint sequence lengths the kernels take without padding: the GEMMs' 192-row CTAs (three 64-row warpgroups) and
# the INT8 attention's 128- or 192-row query blocks (two or three compute warpgroups). A length they do not divide
# pads every product and costs more than the few padded text tokens that round it up.
JOINT_TOKENS_MULTIPLE = 384


def trim_padded_text(fused: jax.Array, mask: jax.Array, multiple: int = 64, *, image_len: int = 0,
                     joint_multiple: int = 1) -> tuple[jax.Array, jax.Array]:
    """Drop the padded text tokens of `fuse_text`'s output (real tokens first), keeping the longest prompt's real
    tokens rounded up to `multiple` (one compilation serves every prompt of a bucket): (fused, mask) for `__call__`.
    With `joint_multiple`, the kept length is the shortest such one that makes `image_len` + it a multiple of
    `joint_multiple` (when one fits in the padded length): a few padded tokens more, and no kernel pads its operands.

    Exact, not an approximation: padded tokens are never attended to as keys, and everything else acts per token, so
    no real token's output depends on them. diffusers pads every prompt to 512 tokens (a short prompt has ~120 real
    ones), so at 1024x1024 the joint sequence shrinks from 4608 to ~4224 tokens. `mask` must be concrete (a host
    value): the kept length sets the shapes."""
    lengths = np.asarray(mask).astype(bool).sum(axis=1)
    keep = min(fused.shape[1], max(multiple, -(-int(lengths.max(initial=0)) // multiple) * multiple))
    keep = next((n for n in range(keep, fused.shape[1] + 1, multiple) if (image_len + n) % joint_multiple == 0), keep)
    return fused[:, :keep], jnp.arange(keep)[None, :] < jnp.asarray(lengths)[:, None]


def _real_tokens_first(mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(batch, text_len) bool mask -> the permutation that moves the real text tokens first and the padded ones last
    (each group in its original order), and the number of real tokens per batch element."""
    mask = mask.astype(bool)
    return jnp.argsort(~mask, axis=1, stable=True), mask.sum(axis=1, dtype=jnp.int32)


class Krea2Transformer(nnx.Module):
    """The Krea 2 flow-matching transformer: predicts the velocity of the packed image latents.

    Call it as diffusers' forward: `model(hidden_states, encoder_hidden_states, timestep, position_ids,
    encoder_attention_mask=None)`. Parameters are in `dtype` except the RMSNorm weights (float32); activations are
    computed in `dtype`, normalisation and rotary embedding in float32.

    `attention` picks the attention kernel (an `ops.names.AttentionKernel` or its name); None chooses cuDNN on a GPU
    for 16-bit dtypes and XLA otherwise (`ops.attention.attention_implementation`).
    `joint_attention` (default None: `attention`) is an `AttentionFn` that replaces the kernel in the joint blocks,
    where the long sequence is: sharding/ sets it to a sequence-parallel attention. The text-fusion blocks keep
    `attention`.
    """

    def __init__(
        self,
        config: Krea2Config,
        *,
        dtype: jnp.dtype = jnp.bfloat16,
        attention: AttentionKernel | str | None = None,
        rngs: nnx.Rngs,
    ):
        cfg = self.config = config
        self.dtype = jnp.dtype(dtype)
        self.attention = attention_implementation(attention, self.dtype)
        self.joint_attention: AttentionFn | None = None
        dim = cfg.hidden_size
        self.img_in = Linear(cfg.in_channels, dim, bias=True, dtype=dtype, rngs=rngs)
        self.time_embed = TimestepEmbedding(cfg.timestep_embed_dim, dim, dtype=dtype, rngs=rngs)
        self.time_mod_proj = Linear(dim, 6 * dim, bias=True, dtype=dtype, rngs=rngs)
        self.text_fusion = TextFusion(cfg, dtype=dtype, rngs=rngs)
        self.txt_in = TextProjection(cfg.text_hidden_dim, dim, cfg.norm_eps, dtype=dtype, rngs=rngs)
        self.transformer_blocks = nnx.List([TransformerBlock(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_layer = FinalLayer(dim, cfg.in_channels, cfg.norm_eps, dtype=dtype, rngs=rngs)
        # Training: a `jax.checkpoint_policies` policy makes each transformer block a `jax.checkpoint` (remat) unit
        # whose backward pass recomputes what the policy does not save. None: no rematerialization. Inference is
        # unaffected either way.
        self.remat_policy = None

    def __call__(
        self,
        hidden_states: jax.Array,
        encoder_hidden_states: jax.Array,
        timestep: jax.Array,
        position_ids: jax.Array,
        encoder_attention_mask: jax.Array | None = None,
    ) -> jax.Array:
        """Predict the flow-matching velocity of the image tokens.

        Args:
            hidden_states: (batch, image_seq_len, in_channels) packed noisy latents.
            encoder_hidden_states: (batch, text_seq_len, num_text_layers, text_hidden_dim) tapped text states, or
                (batch, text_seq_len, hidden_size) what `fuse_text` made of them (the text stage then is skipped:
                it depends on the prompt only, so a pipeline runs it once, not every step).
            timestep: (batch,) flow time in [0, 1] (1 is pure noise, 0 is clean data).
            position_ids: (text_seq_len + image_seq_len, 3) (t, h, w) rotary coordinates of the `[text, image]`
                sequence; text rows are zero in Krea 2.
            encoder_attention_mask: (batch, text_seq_len) bool, True for real text tokens; None if all are real.

        Returns:
            (batch, image_seq_len, in_channels) velocity, in the model dtype.
        """
        x, temb, temb_mod, rotary, kv_lengths = self.embed(hidden_states, encoder_hidden_states, timestep, position_ids,
                                                           encoder_attention_mask)
        for block in self.transformer_blocks:
            x = self.run_block(block, x, temb_mod, rotary, kv_lengths)
        return self.finish(x, temb, hidden_states.shape[1])

    def embed(self, hidden_states, encoder_hidden_states, timestep, position_ids, encoder_attention_mask=None):
        """Everything before the joint blocks (arguments as `__call__`): the joint sequence x, the time embedding
        and its modulation vector, the rotary tables and the number of valid keys. `__call__` is `embed`, then
        `run_block` for each block, then `finish` (model/offload.py runs the three apart)."""
        if position_ids.ndim != 2 or position_ids.shape[-1] != 3:
            raise ValueError(f"position_ids must have shape (sequence_length, 3), got {tuple(position_ids.shape)}")
        batch, image_len, _ = hidden_states.shape
        text_len = encoder_hidden_states.shape[1]
        if position_ids.shape[0] != text_len + image_len:
            raise ValueError(
                f"position_ids has {position_ids.shape[0]} rows, expected text {text_len} + image {image_len}"
            )
        hidden_states = hidden_states.astype(self.dtype)
        encoder_hidden_states = encoder_hidden_states.astype(self.dtype)
        fused = encoder_hidden_states.ndim == 3
        text_pos, image_pos = position_ids[:text_len], position_ids[text_len:]

        # Padded text tokens must not be attended to. Attention is permutation-equivariant and every other operation
        # acts per token, so instead of a (batch, 1, 1, seq) mask we move the real text tokens first and the padded
        # ones last, carrying their rotary positions along, and give the kernels the number of real keys. cuDNN takes
        # such lengths at full speed where it rejects a padding mask. The joint sequence is then [image, real text,
        # padded text], and the image rows come out first, unpermuted.
        text_kv_lengths = joint_kv_lengths = None
        if encoder_attention_mask is not None:
            order, text_kv_lengths = _real_tokens_first(encoder_attention_mask)
            order = shard_activation(order, "batch", None)  # on a mesh: each sequence sorted whole, on its devices
            if not fused:
                encoder_hidden_states = jnp.take_along_axis(encoder_hidden_states, order[:, :, None, None], axis=1)
            text_pos = jnp.take(text_pos, order, axis=0)  # (batch, text_len, 3)
            image_pos = jnp.broadcast_to(image_pos, (batch, *image_pos.shape))
            joint_kv_lengths = text_kv_lengths + image_len

        temb = self.time_embed(timestep, self.dtype)
        temb_mod = self.time_mod_proj(jax.nn.gelu(temb, approximate=True))

        # On a mesh, the text stage runs whole on each device of a sequence group and the joint blocks on a split
        # sequence. The joint sequence is concatenated whole, then split: a local slice. (A concatenation straight
        # into a split sequence makes XLA's partitioner exchange data.)
        text = encoder_hidden_states if fused else self._text_stage(encoder_hidden_states, text_kv_lengths)
        x = shard_activation(jnp.concatenate([self.img_in(hidden_states), text], axis=1), "batch", None, None)
        x = shard_activation(x, "batch", "sequence", None)
        positions = jnp.concatenate([image_pos, text_pos], axis=-2)
        batched = ("batch",) if positions.ndim == 3 else ()
        positions = shard_activation(shard_activation(positions, *batched, None, None), *batched, "sequence", None)
        rotary = rotary_tables(positions, self.config.axes_dims_rope, self.config.rope_theta)
        return x, temb, temb_mod, rotary, joint_kv_lengths

    def run_block(self, block: "TransformerBlock", x, temb_mod, rotary, kv_lengths) -> jax.Array:
        """One joint block, as `__call__` runs each (rematerialized when training asks for it)."""
        joint_attention = self.attention if self.joint_attention is None else self.joint_attention
        x = remat_call(block, self.remat_policy, x, temb_mod, rotary, kv_lengths, implementation=joint_attention)
        return shard_activation(x, "batch", "sequence", None)

    def finish(self, x: jax.Array, temb: jax.Array, image_len: int) -> jax.Array:
        """The final layer and the image rows. It acts per token: applied before the slice, it keeps a split
        sequence split up to the small (batch, seq, in_channels) output."""
        return self.final_layer(x, temb)[:, :image_len]

    def _text_stage(self, states: jax.Array, kv_lengths: jax.Array | None) -> jax.Array:
        return self.txt_in(self.text_fusion(states, kv_lengths, self.attention))

    def fuse_text(self, encoder_hidden_states: jax.Array, encoder_attention_mask: jax.Array | None = None) -> jax.Array:
        """The text stage alone (text fusion, then the projection to the joint width), as `__call__` runs it:
        (batch, text_len, num_text_layers, text_dim) tapped states -> (batch, text_len, hidden_size), the real
        tokens first. Pass the result to `__call__` as `encoder_hidden_states` with the same mask."""
        states = encoder_hidden_states.astype(self.dtype)
        kv_lengths = None
        if encoder_attention_mask is not None:
            order, kv_lengths = _real_tokens_first(encoder_attention_mask)
            states = jnp.take_along_axis(states, order[:, :, None, None], axis=1)
        return self._text_stage(states, kv_lengths)

    # ----------------------------------------------------------------------------------------------------------------
    # Loading

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: jnp.dtype = jnp.bfloat16,
        *,
        config: Krea2Config | str | Path | None = None,
        attention: AttentionKernel | str | None = None,
    ) -> "Krea2Transformer":
        """Load a Krea 2 transformer from local disk.

        Args:
            path: a diffusers `transformer/` folder (config.json with `diffusion_pytorch_model.safetensors`, or shards
                with their `.index.json`), or a single `.safetensors` file with diffusers key names or the original
                release's (as ComfyUI uses, optionally prefixed `model.diffusion_model.`).
            dtype: parameter and compute dtype; RMSNorm weights stay float32.
            config: for a single file, a `Krea2Config` or a config.json path; without it the sizes are read from
                the tensor shapes and the rotary split, theta and eps are the released model's (head_dim 128 only).
            attention: see the class docstring.
        """
        path = Path(path)
        if isinstance(config, (str, Path)):
            config = Krea2Config.from_json(config)
        if path.is_dir() and config is None:
            config = Krea2Config.from_json(path / "config.json")
        config, keys = cls.key_map(open_checkpoint(path, "diffusion_pytorch_model"), config, str(path))
        return load_state(lambda: cls(config, dtype=dtype, attention=attention, rngs=nnx.Rngs(0)), keys,
                          source=str(path))

    @staticmethod
    def key_map(checkpoint: Checkpoint, config: Krea2Config | None = None,
                source: str = "checkpoint") -> tuple[Krea2Config, KeyMap]:
        """How `checkpoint` (diffusers' key names, or the original release's, optionally prefixed
        `model.diffusion_model.`) maps onto the module, and its config: `config`, or the sizes read from the tensor
        shapes (see `from_pretrained`)."""
        original = any(_is_original_key(k) for k in checkpoint.keys())
        rename = original_key_to_diffusers if original else _strip_prefix
        if config is None:
            config = _config_from_shapes({rename(k): checkpoint.shape(k) for k in checkpoint.keys()}, source)
        return config, KeyMap(checkpoint, rename=rename, convert=_unflatten_modulation)


# --------------------------------------------------------------------------------------------------------------------
# The original single-file layout (ComfyUI), as diffusers' `convert_krea2_transformer_checkpoint_to_diffusers` maps it

_COMFY_PREFIX = "model.diffusion_model."
_ORIGINAL_PREFIXES = {
    "first.": "img_in.",
    "tmlp.0.": "time_embed.linear_1.",
    "tmlp.2.": "time_embed.linear_2.",
    "tproj.1.": "time_mod_proj.",
    "txtmlp.0.scale": "txt_in.norm.weight",
    "txtmlp.1.": "txt_in.linear_1.",
    "txtmlp.3.": "txt_in.linear_2.",
    "txtfusion.": "text_fusion.",
    "blocks.": "transformer_blocks.",
    "last.linear.": "final_layer.linear.",
    "last.norm.scale": "final_layer.norm.weight",
    "last.modulation.lin": "final_layer.scale_shift_table",
}
_ORIGINAL_BLOCK_NAMES = {
    ".attn.wq.": ".attn.to_q.",
    ".attn.wk.": ".attn.to_k.",
    ".attn.wv.": ".attn.to_v.",
    ".attn.wo.": ".attn.to_out.0.",
    ".attn.gate.": ".attn.to_gate.",
    ".attn.qknorm.qnorm.scale": ".attn.norm_q.weight",
    ".attn.qknorm.knorm.scale": ".attn.norm_k.weight",
    ".mlp.": ".ff.",
    ".prenorm.scale": ".norm1.weight",
    ".postnorm.scale": ".norm2.weight",
    ".mod.lin": ".scale_shift_table",
}


def _strip_prefix(key: str) -> str:
    return key[len(_COMFY_PREFIX) :] if key.startswith(_COMFY_PREFIX) else key


def _is_original_key(key: str) -> bool:
    key = _strip_prefix(key)
    return key.startswith(("first.", "tmlp.", "tproj.", "txtmlp.", "txtfusion.", "blocks.", "last."))


def original_key_to_diffusers(key: str) -> str:
    """Map a key of the original Krea 2 release (ComfyUI's single file) to its diffusers name."""
    key = _strip_prefix(key)
    for old, new in _ORIGINAL_PREFIXES.items():
        if key.startswith(old):
            key = new + key[len(old) :]
            break
    for old, new in _ORIGINAL_BLOCK_NAMES.items():
        key = key.replace(old, new)
    return key


def diffusers_key_to_original(key: str) -> str:
    """The inverse of `original_key_to_diffusers` (without the `model.diffusion_model.` prefix): a diffusers key
    (`transformer_blocks.0.attn.to_q.weight`) in the original release's naming (`blocks.0.attn.wq.weight`)."""
    for old, new in _ORIGINAL_PREFIXES.items():
        if key.startswith(new):
            key = old + key[len(new) :]
            break
    if not key.startswith("last."):  # the final layer's names contain no block name; its table ends in "modulation.lin"
        for old, new in _ORIGINAL_BLOCK_NAMES.items():
            key = key.replace(new, old)
    return key


def _unflatten_modulation(key: str, shape: tuple[int, ...]):
    # The original release stores each block's (6, dim) modulation table flattened into one vector.
    if key.startswith("transformer_blocks.") and key.endswith(".scale_shift_table") and len(shape) == 1:
        new_shape = (6, shape[0] // 6)
        return new_shape, lambda array: array.reshape(new_shape)
    return None


def _config_from_shapes(shapes: dict[str, tuple[int, ...]], path: str) -> Krea2Config:
    """Read the sizes of a single-file checkpoint from its tensor shapes."""

    def shape(key: str) -> tuple[int, ...]:
        if key not in shapes:
            raise CheckpointError(f"{path}: not a Krea 2 transformer checkpoint (no tensor {key!r})")
        return shapes[key]

    def count(prefix: str) -> int:
        return len({k[len(prefix) :].split(".")[0] for k in shapes if k.startswith(prefix)})

    hidden, in_channels = shape("img_in.weight")
    head_dim = shape("transformer_blocks.0.attn.norm_q.weight")[0]
    text_dim = shape("txt_in.norm.weight")[0]
    text_head_dim = shape("text_fusion.refiner_blocks.0.attn.norm_q.weight")[0]
    defaults = Krea2Config()
    if head_dim != defaults.attention_head_dim:
        raise CheckpointError(
            f"{path}: head_dim {head_dim} differs from the released model's {defaults.attention_head_dim}; the rotary "
            "split cannot be read from the weights, pass config= (a Krea2Config or a config.json path)"
        )
    return Krea2Config(
        in_channels=in_channels,
        num_layers=count("transformer_blocks."),
        attention_head_dim=head_dim,
        num_attention_heads=hidden // head_dim,
        num_key_value_heads=shape("transformer_blocks.0.attn.to_k.weight")[0] // head_dim,
        intermediate_size=shape("transformer_blocks.0.ff.gate.weight")[0],
        timestep_embed_dim=shape("time_embed.linear_1.weight")[1],
        text_hidden_dim=text_dim,
        num_text_layers=shape("text_fusion.projector.weight")[1],
        text_num_attention_heads=text_dim // text_head_dim,
        text_num_key_value_heads=shape("text_fusion.refiner_blocks.0.attn.to_k.weight")[0] // text_head_dim,
        text_intermediate_size=shape("text_fusion.refiner_blocks.0.ff.gate.weight")[0],
        num_layerwise_text_blocks=count("text_fusion.layerwise_blocks."),
        num_refiner_text_blocks=count("text_fusion.refiner_blocks."),
    )
