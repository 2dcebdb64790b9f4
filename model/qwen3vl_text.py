"""The text path of transformers' `Qwen3VLModel` in Flax NNX, as Krea 2 uses it: token embeddings, decoder layers
(GQA with per-head q/k RMSNorm, rotary embedding, SwiGLU), returning the hidden states of the layers a pipeline taps.

For text, Qwen3-VL's multimodal rotary embedding gets the same position on its three (t, h, w) axes, and then equals
ordinary rotary embedding (half-split convention) at those positions; that is all this module implements. Vision
weights in a checkpoint are skipped.

`hidden_states` indices follow transformers' `output_hidden_states`: 0 is the embedding output, i the output of
layer i, and the last index (num_hidden_layers) the output after the final norm.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .layers import Linear, RMSNorm
from .loading import Checkpoint, CheckpointError, KeyMap, known_config, load_state, open_checkpoint, read_json


@dataclasses.dataclass(frozen=True)
class Qwen3VLTextConfig:
    """The `text_config` of a Qwen3-VL config.json; defaults are Qwen3-VL-4B's."""

    vocab_size: int = 151936
    hidden_size: int = 2560
    intermediate_size: int = 9728
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 5_000_000.0
    attention_bias: bool = False
    hidden_act: str = "silu"

    @classmethod
    def from_json(cls, path: str | Path) -> "Qwen3VLTextConfig":
        data = read_json(Path(path))
        text = dict(data.get("text_config", data))
        rope = text.pop("rope_parameters", None) or text.pop("rope_scaling", None) or {}
        if "rope_theta" in rope and "rope_theta" not in text:
            text["rope_theta"] = rope["rope_theta"]
        if rope.get("rope_type", "default") not in ("default", None):
            raise CheckpointError(f"{path}: rope_type {rope['rope_type']!r} is not implemented (only 'default')")
        return known_config(cls, text, str(path))


def rotary_tables(positions: jax.Array, head_dim: int, theta: float, dtype) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape positions.shape + (head_dim,), frequencies repeated over the two halves."""
    inv_freq = jnp.asarray(1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim), jnp.float32)
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    freqs = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(freqs).astype(dtype), jnp.sin(freqs).astype(dtype)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: (batch, seq, heads, head_dim); cos/sin: (batch, seq, head_dim). Rotates the two halves of each head."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None] + rotated * sin[:, :, None]


class Attention(nnx.Module):
    def __init__(self, cfg: Qwen3VLTextConfig, *, dtype, rngs: nnx.Rngs):
        h, kv, d, bias = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, d
        self.q_proj = Linear(cfg.hidden_size, h * d, bias=bias, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(cfg.hidden_size, kv * d, bias=bias, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(cfg.hidden_size, kv * d, bias=bias, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(h * d, cfg.hidden_size, bias=bias, dtype=dtype, rngs=rngs)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)

    def __call__(self, x: jax.Array, rotary, mask: jax.Array) -> jax.Array:
        batch, seq, _ = x.shape
        q = apply_rotary(self.q_norm(self.q_proj(x).reshape(batch, seq, self.num_heads, self.head_dim)), *rotary)
        k = apply_rotary(self.k_norm(self.k_proj(x).reshape(batch, seq, self.num_kv_heads, self.head_dim)), *rotary)
        v = self.v_proj(x).reshape(batch, seq, self.num_kv_heads, self.head_dim)
        out = jax.nn.dot_product_attention(q, k, v, mask=mask)
        return self.o_proj(out.reshape(batch, seq, -1))


class MLP(nnx.Module):
    def __init__(self, cfg: Qwen3VLTextConfig, *, dtype, rngs: nnx.Rngs):
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: Qwen3VLTextConfig, *, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(cfg, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = MLP(cfg, dtype=dtype, rngs=rngs)

    def __call__(self, x, rotary, mask):
        x = x + self.self_attn(self.input_layernorm(x), rotary, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Embedding(nnx.Module):
    def __init__(self, vocab: int, dim: int, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (vocab, dim), dtype))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], ids, axis=0)


class Qwen3VLTextEncoder(nnx.Module):
    """Token ids -> the hidden states at `layers` (transformers' `hidden_states` indices), stacked on axis 2."""

    def __init__(self, config: Qwen3VLTextConfig, *, dtype: jnp.dtype = jnp.bfloat16, rngs: nnx.Rngs):
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r}: only 'silu' is implemented")
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(config, dtype=dtype, rngs=rngs) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)

    def __call__(
        self, input_ids: jax.Array, attention_mask: jax.Array, position_ids: jax.Array, layers: tuple[int, ...]
    ) -> jax.Array:
        """Args:
            input_ids: (batch, seq) int.
            attention_mask: (batch, seq) bool, False for padding (masked as keys; attention is also causal).
            position_ids: (batch, seq) rotary positions.
            layers: which hidden states to return (0 = embeddings, num_hidden_layers = after the final norm).
        Returns:
            (batch, seq, len(layers), hidden_size).
        """
        n = self.config.num_hidden_layers
        if not layers or min(layers) < 0 or max(layers) > n:
            raise ValueError(f"layers must be hidden-state indices in [0, {n}], got {layers}")
        seq = input_ids.shape[1]
        causal = jnp.tril(jnp.ones((seq, seq), bool))
        mask = (causal[None] & attention_mask[:, None, :].astype(bool))[:, None]  # (batch, 1, seq, seq)
        rotary = rotary_tables(position_ids, self.config.head_dim, self.config.rope_theta, self.dtype)
        x = self.embed_tokens(input_ids)
        states = {0: x}
        for i in range(max(layers)):  # layers past the deepest tap are never run
            x = self.layers[i](x, rotary, mask)
            states[i + 1] = x
        if n in layers:
            states[n] = self.norm(x)
        return jnp.stack([states[i] for i in layers], axis=2)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, dtype: jnp.dtype = jnp.bfloat16, *, config: Qwen3VLTextConfig | str | Path | None = None
    ) -> "Qwen3VLTextEncoder":
        """Load from a transformers folder (config.json with `model.safetensors` or shards and their index; a saved
        `Qwen3VLModel` or `Qwen3VLForConditionalGeneration`) or a single `.safetensors` file. Language-model keys may
        carry the prefixes `model.language_model.`, `language_model.` or `model.`; vision and LM-head weights are
        skipped. A single file without `config` gets Qwen3-VL-4B's config, with sizes read from the weights."""
        path = Path(path)
        if isinstance(config, (str, Path)):
            config = Qwen3VLTextConfig.from_json(config)
        if path.is_dir() and config is None:
            config = Qwen3VLTextConfig.from_json(path / "config.json")
        config, keys = cls.key_map(open_checkpoint(path, "model"), config, str(path))
        return load_state(lambda: cls(config, dtype=dtype, rngs=nnx.Rngs(0)), keys, source=str(path))

    @staticmethod
    def key_map(checkpoint: Checkpoint, config: Qwen3VLTextConfig | None = None,
                source: str = "checkpoint") -> tuple[Qwen3VLTextConfig, KeyMap]:
        """How `checkpoint` maps onto the module (vision tower and LM head ignored), and its config: `config`, or
        Qwen3-VL-4B's with the sizes read from the weights."""
        if config is None:
            config = _config_from_shapes(checkpoint, source)
        return config, KeyMap(checkpoint, rename=_language_model_key,
                              ignore=lambda key: key.startswith(("visual.", "lm_head.")))


def _language_model_key(key: str) -> str:
    for prefix in ("model.language_model.", "language_model.", "model."):
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key


def _config_from_shapes(checkpoint: Checkpoint, path: str) -> Qwen3VLTextConfig:
    shapes = {_language_model_key(k): checkpoint.shape(k) for k in checkpoint.keys()}
    if "embed_tokens.weight" not in shapes:
        raise CheckpointError(f"{path}: not a Qwen3 text model checkpoint (no embed_tokens.weight)")
    vocab, hidden = shapes["embed_tokens.weight"]
    head_dim = shapes["layers.0.self_attn.q_norm.weight"][0]
    return Qwen3VLTextConfig(
        vocab_size=vocab, hidden_size=hidden, head_dim=head_dim,
        intermediate_size=shapes["layers.0.mlp.gate_proj.weight"][0],
        num_hidden_layers=len({k.split(".")[1] for k in shapes if k.startswith("layers.")}),
        num_attention_heads=shapes["layers.0.self_attn.q_proj.weight"][0] // head_dim,
        num_key_value_heads=shapes["layers.0.self_attn.k_proj.weight"][0] // head_dim,
    )
