"""The MiniMax H3 video + audio diffusion transformer in Flax NNX, equal in function to diffusers'
`MiniMaxH3Transformer3DModel` (0.42.1).

Read top to bottom: rotary embedding, attention, SwiGLU, the text refiner, the transformer block, the output norm,
then the model with its loading from disk. Attribute names follow diffusers', so a parameter's path in the module is
its key in a diffusers checkpoint.

One stack of blocks runs over one packed sequence holding the text rows, the conditioning and target video rows and
the audio rows, in whatever order the caller packed them. There is no cross-attention and no per-modality weight in
the blocks: a row's modality shows only in its input and output projections and in which row of the AdaLN table
modulates it, one row per (timestep, modality) pair, so that one forward serves rows at different noise levels.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mxdit.ops.attention import AttentionFn, attention, attention_implementation
from mxdit.ops.names import AttentionKernel

from .layers import (FeedForward, Linear, MLPEmbedder, NoParams, RMSNorm, remat_call, shard_activation,
                     timestep_sinusoids)
from .loading import KeyMap, config_from_dict, folder_config, load_state, open_checkpoint, read_json

# The modalities a row of the packed sequence is tagged with (`token_tags`), and so the AdaLN table's rows per timestep
VIDEO, TEXT, AUDIO = 0, 1, 2
MODALITIES = 3


@dataclasses.dataclass(frozen=True)
class MiniMaxH3Config:
    """The transformer's config.json (diffusers names); defaults are the released MiniMax H3 model's."""

    num_attention_heads: int = 56
    attention_head_dim: int = 128
    hidden_size: int = 5376
    num_layers: int = 50
    num_refiner_layers: int = 2
    ffn_dim: int = 14336
    in_channels: int = 24
    audio_in_channels: int = 32
    patch_size: tuple[int, int, int] = (1, 2, 2)
    text_dim: int = 5120
    freq_dim: int = 256
    time_embed_hidden_dim: int = 5376
    time_embed_dim: int = 2688
    rope_freq_dim: int = 16
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    qk_norm_eps: float = 1e-5
    final_norm_eps: float = 1e-5

    def __post_init__(self):
        if 6 * self.rope_freq_dim > self.attention_head_dim:
            raise ValueError(f"6 * rope_freq_dim = {6 * self.rope_freq_dim} rotated channels exceed "
                             f"attention_head_dim = {self.attention_head_dim}")

    @property
    def video_patch_dim(self) -> int:
        """The channels of one packed video row: a (t, h, w) patch of latents."""
        return self.in_channels * int(np.prod(self.patch_size))

    @classmethod
    def from_json(cls, path: str | Path) -> "MiniMaxH3Config":
        return config_from_dict(cls, read_json(Path(path)), str(path))


# --------------------------------------------------------------------------------------------------------------------
# Building blocks


def rotary_tables(position_ids: jax.Array, freq_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """(seq, 3) (t, h, w) positions -> cos, sin of shape (seq, 6 * freq_dim), float32: one set of `freq_dim`
    frequencies shared by the three axes, the three axes' angles side by side, the whole repeated for the two halves
    that `apply_rotary_half` pairs."""
    inv_freq = jnp.asarray(1.0 / theta ** (np.arange(0, 2 * freq_dim, 2, dtype=np.float32) / (2 * freq_dim)))
    angles = (position_ids.astype(jnp.float32)[:, :, None] * inv_freq).reshape(position_ids.shape[0], -1)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rotary_half(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the leading `cos.shape[-1]` channels of each head of x (batch, seq, heads, head_dim), channel i paired
    with channel i + half of them (the rotate-half convention); the other channels pass through. In float32."""
    rotated = cos.shape[-1]
    head, rest = x[..., :rotated].astype(jnp.float32), x[..., rotated:]
    first, second = jnp.split(head, 2, axis=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    head = head * cos + jnp.concatenate([-second, first], axis=-1) * sin
    return jnp.concatenate([head.astype(x.dtype), rest], axis=-1)


class Attention(nnx.Module):
    """Full self-attention over the packed sequence: q, k, v projections to `heads x head_dim` (wider than the
    residual stream in the release), per-head q/k RMSNorm, the rotary embedding, the output projection."""

    def __init__(self, dim: int, heads: int, head_dim: int, eps: float, *, dtype, rngs: nnx.Rngs):
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        self.to_q = Linear(dim, inner, bias=False, dtype=dtype, rngs=rngs)
        self.to_k = Linear(dim, inner, bias=False, dtype=dtype, rngs=rngs)
        self.to_v = Linear(dim, inner, bias=False, dtype=dtype, rngs=rngs)
        self.norm_q = RMSNorm(head_dim, eps, dtype=dtype)
        self.norm_k = RMSNorm(head_dim, eps, dtype=dtype)
        self.to_out = nnx.List([Linear(inner, dim, bias=False, dtype=dtype, rngs=rngs), NoParams()])

    def __call__(self, x: jax.Array, rotary: tuple[jax.Array, jax.Array] | None,
                 implementation: AttentionKernel | AttentionFn, kv_lengths: jax.Array | None = None) -> jax.Array:
        """x: (batch, seq, dim) -> (batch, seq, dim). `rotary`: `rotary_tables`' cos and sin, or None (the text
        refiner). One document: every row attends to every row, or with `kv_lengths` (batch,) to the first
        kv_lengths rows (padding rows last)."""
        batch, seq, _ = x.shape
        q, k, v = (layer(x).reshape(batch, seq, self.heads, self.head_dim)
                   for layer in (self.to_q, self.to_k, self.to_v))
        q, k = self.norm_q(q), self.norm_k(k)
        if rotary is not None:
            q, k = apply_rotary_half(q, *rotary), apply_rotary_half(k, *rotary)
        out = attention(q, k, v, kv_lengths, implementation)
        return self.to_out[0](out.reshape(batch, seq, -1))


class RefinerBlock(nnx.Module):
    """Pre-norm attention and SwiGLU over the text rows alone: no modulation, no rotary embedding."""

    def __init__(self, cfg: MiniMaxH3Config, *, dtype, rngs: nnx.Rngs):
        dim = cfg.hidden_size
        self.norm1 = RMSNorm(dim, cfg.norm_eps, dtype=dtype)
        self.attn = Attention(dim, cfg.num_attention_heads, cfg.attention_head_dim, cfg.qk_norm_eps, dtype=dtype,
                              rngs=rngs)
        self.norm2 = RMSNorm(dim, cfg.norm_eps, dtype=dtype)
        self.ff = FeedForward(dim, cfg.ffn_dim, bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, implementation: AttentionKernel | AttentionFn) -> jax.Array:
        x = x + self.attn(self.norm1(x), None, implementation)
        return x + self.ff(self.norm2(x))


class TokenRefiner(nnx.Module):
    def __init__(self, cfg: MiniMaxH3Config, *, dtype, rngs: nnx.Rngs):
        self.refiner_blocks = nnx.List([RefinerBlock(cfg, dtype=dtype, rngs=rngs)
                                        for _ in range(cfg.num_refiner_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.final_norm_eps, dtype=dtype)

    def __call__(self, x: jax.Array, implementation: AttentionKernel | AttentionFn) -> jax.Array:
        for block in self.refiner_blocks:
            x = block(x, implementation)
        return self.final_norm(x)


class AdaLNModulation(nnx.Module):
    """The block's six modulation vectors for every (timestep, modality) pair, from the shared time embedding."""

    def __init__(self, time_embed_dim: int, dim: int, *, dtype, rngs: nnx.Rngs):
        self.dim = dim
        self.linear = Linear(time_embed_dim, 6 * dim * MODALITIES, bias=True, dtype=dtype, rngs=rngs)

    def __call__(self, temb: jax.Array) -> jax.Array:
        """temb (timesteps, time_embed_dim) float32 -> (timesteps * MODALITIES, 6, dim), row t * MODALITIES + m for
        timestep t and modality m; the six in the order shift, scale, gate of the attention, then of the MLP.
        SiLU runs at temb's float32 and only its result is cast to the projection's dtype, as diffusers does: every
        block reads the same temb, so a rounding before the activation would bias all of them alike."""
        mod = self.linear(jax.nn.silu(temb).astype(self.linear.weight.dtype))
        return mod.reshape(-1, 6, self.dim)


class TransformerBlock(RefinerBlock):
    """Modulated RMSNorm -> attention, modulated RMSNorm -> SwiGLU, each added back through its gate; the
    modulation chosen per row of the packed sequence. A refiner block's layers and an AdaLN projection."""

    def __init__(self, cfg: MiniMaxH3Config, *, dtype, rngs: nnx.Rngs):
        super().__init__(cfg, dtype=dtype, rngs=rngs)
        self.adaln_proj = AdaLNModulation(cfg.time_embed_dim, cfg.hidden_size, dtype=dtype, rngs=rngs)

    def __call__(self, x, temb, adaln_indices, rotary, kv_lengths: jax.Array | None,
                 implementation: AttentionKernel | AttentionFn):
        """x: (batch, seq, dim); temb: (timesteps, time_embed_dim); adaln_indices: (seq,) the AdaLN table row of
        each row of x; kv_lengths: see `Attention`."""
        mod = jnp.take(self.adaln_proj(temb), adaln_indices, axis=0)  # (seq, 6, dim), the same for every batch item
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (mod[:, i] for i in range(6))
        x = x + gate_msa * self.attn(self.norm1(x) * (1.0 + scale_msa) + shift_msa, rotary, implementation,
                                     kv_lengths)
        return x + gate_mlp * self.ff(self.norm2(x) * (1.0 + scale_mlp) + shift_mlp)


class OutputNorm(nnx.Module):
    """RMSNorm, then shift and scale chosen per row by its timestep (not its modality)."""

    def __init__(self, dim: int, time_embed_dim: int, eps: float, *, dtype, rngs: nnx.Rngs):
        self.norm = RMSNorm(dim, eps, dtype=dtype)
        self.linear = Linear(time_embed_dim, 2 * dim, bias=True, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, temb: jax.Array, timestep_indices: jax.Array) -> jax.Array:
        shift, scale = jnp.split(self.linear(jax.nn.silu(temb).astype(self.linear.weight.dtype)), 2, axis=-1)
        return self.norm(x) * (1.0 + scale[timestep_indices]) + shift[timestep_indices]


# --------------------------------------------------------------------------------------------------------------------
# The model


class MiniMaxH3Transformer(nnx.Module):
    """The MiniMax H3 flow-matching transformer: predicts the velocity of the video and audio rows of one packed
    sequence.

    Call it as diffusers' forward (see `__call__`). The checkpoint is mixed precision, and so is the module: the
    input and output projections and the timestep MLP are float32, everything else is in `dtype`.

    `attention` picks the attention kernel (an `ops.names.AttentionKernel` or its name); None chooses cuDNN on a GPU
    for 16-bit dtypes and XLA otherwise (`ops.attention.attention_implementation`).
    """

    def __init__(self, config: MiniMaxH3Config, *, dtype: jnp.dtype = jnp.bfloat16,
                 attention: AttentionKernel | str | None = None, rngs: nnx.Rngs):
        cfg = self.config = config
        self.dtype = jnp.dtype(dtype)
        self.attention = attention_implementation(attention, self.dtype)
        dim, f32 = cfg.hidden_size, jnp.float32
        self.proj_in = Linear(cfg.video_patch_dim, dim, bias=True, dtype=f32, rngs=rngs)
        self.audio_proj_in = Linear(cfg.audio_in_channels, dim, bias=True, dtype=f32, rngs=rngs)
        self.context_embedder = Linear(cfg.text_dim, dim, bias=True, dtype=dtype, rngs=rngs)
        self.time_embedder = MLPEmbedder(cfg.freq_dim, cfg.time_embed_hidden_dim, cfg.time_embed_dim, dtype=f32,
                                         rngs=rngs)
        self.token_refiner = TokenRefiner(cfg, dtype=dtype, rngs=rngs)
        self.transformer_blocks = nnx.List([TransformerBlock(cfg, dtype=dtype, rngs=rngs)
                                            for _ in range(cfg.num_layers)])
        self.norm_out = OutputNorm(dim, cfg.time_embed_dim, cfg.final_norm_eps, dtype=dtype, rngs=rngs)
        self.proj_out = Linear(dim, cfg.video_patch_dim, bias=True, dtype=f32, rngs=rngs)
        self.audio_proj_out = Linear(dim, cfg.audio_in_channels, bias=True, dtype=f32, rngs=rngs)
        # Training: a `jax.checkpoint_policies` policy makes each block a remat unit (see `Krea2Transformer`).
        self.remat_policy = None
        # An `AttentionFn` that replaces the kernel in the transformer blocks (sharding/: sequence-parallel)
        self.joint_attention: AttentionFn | None = None

    def __call__(
        self,
        hidden_states: jax.Array,
        audio_hidden_states: jax.Array,
        encoder_hidden_states: jax.Array,
        timestep: jax.Array,
        timestep_indices: jax.Array,
        token_tags: jax.Array,
        position_ids: jax.Array,
        video_indices: jax.Array,
        audio_indices: jax.Array,
        text_indices: jax.Array,
        padding: int = 0,
    ) -> tuple[jax.Array, jax.Array]:
        """Predict the flow-matching velocity of the video and audio rows.

        The structural arguments describe one packed layout that every batch item shares.

        Args:
            hidden_states: (batch, video_rows, video_patch_dim) patchified video latents, conditioning and target
                rows, in the order of `video_indices`.
            audio_hidden_states: (batch, audio_rows, audio_in_channels) audio latents, in the order of
                `audio_indices`.
            encoder_hidden_states: (batch, text_rows, text_dim) the text condition, in the order of `text_indices`.
            timestep: (timesteps,) the distinct noise levels in the sequence, in [0, 1], unscaled.
            timestep_indices: (seq,) each row's index into `timestep`.
            token_tags: (seq,) each row's modality: VIDEO, TEXT or AUDIO.
            position_ids: (seq, 3) each row's (t, h, w) rotary coordinates.
            video_indices, audio_indices, text_indices: where each modality's rows sit in the packed sequence.
            padding: rows after the packed ones (seq counts them), zero and attended by no row, so that the sequence
                splits evenly over a mesh; they leave the result unchanged.

        Returns:
            The video velocity (batch, video_rows, video_patch_dim) and the audio velocity (batch, audio_rows,
            audio_in_channels), float32, in the order of `video_indices` and `audio_indices`.
        """
        x, temb, adaln_indices, rotary, kv_lengths = self.embed(
            hidden_states, audio_hidden_states, encoder_hidden_states, timestep, timestep_indices, token_tags,
            position_ids, video_indices, audio_indices, text_indices, padding)
        for block in self.transformer_blocks:
            x = self.run_block(block, x, temb, adaln_indices, rotary, kv_lengths)
        return self.finish(x, temb, timestep_indices, video_indices, audio_indices)

    def embed(self, hidden_states, audio_hidden_states, encoder_hidden_states, timestep, timestep_indices, token_tags,
              position_ids, video_indices, audio_indices, text_indices, padding: int = 0):
        """Everything before the transformer blocks (arguments as `__call__`): the packed sequence x, the time
        embedding, each row's AdaLN table row, the rotary tables and the key lengths (None without padding).
        `__call__` is `embed`, then `run_block` for each block, then `finish` (model/offload.py runs them apart)."""
        seq = position_ids.shape[0]
        if position_ids.ndim != 2 or position_ids.shape[-1] != 3:
            raise ValueError(f"position_ids must have shape (seq_len, 3), got {tuple(position_ids.shape)}")
        if tuple(token_tags.shape) != (seq,) or tuple(timestep_indices.shape) != (seq,):
            raise ValueError(f"token_tags {tuple(token_tags.shape)} and timestep_indices "
                             f"{tuple(timestep_indices.shape)} must both be ({seq},), one entry per row")
        rows = text_indices.shape[0] + video_indices.shape[0] + audio_indices.shape[0]
        if rows + padding != seq:
            raise ValueError(f"text, video and audio indices name {rows} rows and padding {padding} more, the "
                             f"sequence has {seq}")
        cfg = self.config
        rotary = rotary_tables(position_ids, cfg.rope_freq_dim, cfg.rope_theta)

        # Each modality projected, then scattered into the packed sequence, which takes the text stream's dtype.
        text = self.token_refiner(self.context_embedder(encoder_hidden_states.astype(self.dtype)), self.attention)
        video = self.proj_in(hidden_states.astype(jnp.float32)).astype(self.dtype)
        audio = self.audio_proj_in(audio_hidden_states.astype(jnp.float32)).astype(self.dtype)
        x = jnp.zeros((text.shape[0], seq, cfg.hidden_size), self.dtype)
        x = x.at[:, text_indices].set(text).at[:, video_indices].set(video).at[:, audio_indices].set(audio)
        kv_lengths = jnp.full((x.shape[0],), rows, jnp.int32) if padding else None

        temb = self.time_embedder(timestep_sinusoids(timestep, cfg.freq_dim))  # float32, one row per noise level
        adaln_indices = timestep_indices * MODALITIES + token_tags
        return shard_activation(x, "batch", "sequence", None), temb, adaln_indices, rotary, kv_lengths

    def run_block(self, block: TransformerBlock, x, temb, adaln_indices, rotary, kv_lengths=None) -> jax.Array:
        """One transformer block, as `__call__` runs each (rematerialized when training asks for it)."""
        implementation = self.attention if self.joint_attention is None else self.joint_attention
        x = remat_call(block, self.remat_policy, x, temb, adaln_indices, rotary, kv_lengths,
                       implementation=implementation)
        return shard_activation(x, "batch", "sequence", None)

    def finish(self, x, temb, timestep_indices, video_indices, audio_indices) -> tuple[jax.Array, jax.Array]:
        """The output norm and the two heads. The norm and the heads act per row: each head projects only its
        modality's rows."""
        x = self.norm_out(x, temb, timestep_indices).astype(jnp.float32)
        return self.proj_out(x[:, video_indices]), self.audio_proj_out(x[:, audio_indices])

    # ----------------------------------------------------------------------------------------------------------------
    # Loading

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: jnp.dtype = jnp.bfloat16, *,
                        config: MiniMaxH3Config | str | Path | None = None,
                        attention: AttentionKernel | str | None = None) -> "MiniMaxH3Transformer":
        """Load a diffusers `transformer/` folder (config.json with one safetensors file or shards and their
        `.index.json`), or a single `.safetensors` file with diffusers key names and `config`."""
        path = Path(path)
        config = folder_config(MiniMaxH3Config, path, config)
        keys = KeyMap(open_checkpoint(path, "diffusion_pytorch_model"))
        return load_state(lambda: cls(config, dtype=dtype, attention=attention, rngs=nnx.Rngs(0)), keys,
                          source=str(path))
