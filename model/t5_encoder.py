"""The T5 v1.1 encoder (FLUX's `text_encoder_2`) in Flax NNX, equal in function to transformers' `T5EncoderModel`:
RMS layer norm without mean or bias, relative position buckets shared from the first block, unscaled attention,
gated-GELU feed-forward."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .layers import Linear
from .loading import Checkpoint, CheckpointError, KeyMap, known_config, load_state, open_checkpoint, read_json


@dataclasses.dataclass(frozen=True)
class T5Config:
    """transformers' T5Config (the encoder's fields); defaults are T5 v1.1 XXL's, as FLUX uses."""

    vocab_size: int = 32128
    d_model: int = 4096
    d_kv: int = 64
    d_ff: int = 10240
    num_layers: int = 24
    num_heads: int = 64
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    feed_forward_proj: str = "gated-gelu"

    def __post_init__(self):
        if self.feed_forward_proj != "gated-gelu":
            raise ValueError(f"feed_forward_proj={self.feed_forward_proj!r}: only T5 v1.1's 'gated-gelu' is implemented")

    @classmethod
    def from_json(cls, path: str | Path) -> "T5Config":
        return known_config(cls, read_json(Path(path)), str(path))


class LayerNorm(nnx.Module):
    """T5's norm: scale by the root mean square (in float32), cast back, times the weight."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * y.astype(self.weight.dtype)


def relative_position_buckets(q_len: int, k_len: int, num_buckets: int, max_distance: int) -> np.ndarray:
    """Bidirectional bucket of (key - query) offsets, (q_len, k_len) int: half the buckets per direction, exact up to
    num_buckets / 4, logarithmic beyond, saturating at max_distance."""
    relative = np.arange(k_len)[None, :] - np.arange(q_len)[:, None]
    half = num_buckets // 2
    buckets = (relative > 0).astype(np.int64) * half
    distance = np.abs(relative)
    max_exact = half // 2
    with np.errstate(divide="ignore"):
        large = max_exact + (np.log(np.maximum(distance, 1).astype(np.float32) / max_exact)
                             / math.log(max_distance / max_exact) * (half - max_exact)).astype(np.int64)
    large = np.minimum(large, half - 1)
    return buckets + np.where(distance < max_exact, distance, large)


class Embedding(nnx.Module):
    def __init__(self, vocab, dim, *, dtype, rngs):
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (vocab, dim), dtype))


class SelfAttention(nnx.Module):
    def __init__(self, cfg: T5Config, has_bias: bool, *, dtype, rngs):
        inner = cfg.num_heads * cfg.d_kv
        self.heads, self.d_kv = cfg.num_heads, cfg.d_kv
        self.q = Linear(cfg.d_model, inner, bias=False, dtype=dtype, rngs=rngs)
        self.k = Linear(cfg.d_model, inner, bias=False, dtype=dtype, rngs=rngs)
        self.v = Linear(cfg.d_model, inner, bias=False, dtype=dtype, rngs=rngs)
        self.o = Linear(inner, cfg.d_model, bias=False, dtype=dtype, rngs=rngs)
        # Only the first block learns the bucket -> per-head bias table; all blocks use it.
        self.relative_attention_bias = (
            Embedding(cfg.relative_attention_num_buckets, cfg.num_heads, dtype=dtype, rngs=rngs) if has_bias else None
        )

    def __call__(self, x, bias):
        b, s, _ = x.shape
        shape = (b, s, self.heads, self.d_kv)
        # T5 does not scale q.k by 1/sqrt(d): the learned position bias carries the scale (scale=1 here).
        out = jax.nn.dot_product_attention(self.q(x).reshape(shape), self.k(x).reshape(shape),
                                           self.v(x).reshape(shape), bias=bias.astype(x.dtype), scale=1.0)
        return self.o(out.reshape(b, s, -1))


class AttentionLayer(nnx.Module):
    def __init__(self, cfg, has_bias, *, dtype, rngs):
        self.SelfAttention = SelfAttention(cfg, has_bias, dtype=dtype, rngs=rngs)
        self.layer_norm = LayerNorm(cfg.d_model, cfg.layer_norm_epsilon, dtype=dtype)

    def __call__(self, x, bias):
        return x + self.SelfAttention(self.layer_norm(x), bias)


class GatedGelu(nnx.Module):
    def __init__(self, cfg: T5Config, *, dtype, rngs):
        self.wi_0 = Linear(cfg.d_model, cfg.d_ff, bias=False, dtype=dtype, rngs=rngs)
        self.wi_1 = Linear(cfg.d_model, cfg.d_ff, bias=False, dtype=dtype, rngs=rngs)
        self.wo = Linear(cfg.d_ff, cfg.d_model, bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.wo(jax.nn.gelu(self.wi_0(x), approximate=True) * self.wi_1(x))


class FeedForwardLayer(nnx.Module):
    def __init__(self, cfg, *, dtype, rngs):
        self.DenseReluDense = GatedGelu(cfg, dtype=dtype, rngs=rngs)
        self.layer_norm = LayerNorm(cfg.d_model, cfg.layer_norm_epsilon, dtype=dtype)

    def __call__(self, x):
        return x + self.DenseReluDense(self.layer_norm(x))


class Block(nnx.Module):
    def __init__(self, cfg, has_bias, *, dtype, rngs):
        self.layer = nnx.List([AttentionLayer(cfg, has_bias, dtype=dtype, rngs=rngs),
                               FeedForwardLayer(cfg, dtype=dtype, rngs=rngs)])

    def __call__(self, x, bias):
        return self.layer[1](self.layer[0](x, bias))


class Stack(nnx.Module):
    def __init__(self, cfg, *, dtype, rngs):
        self.block = nnx.List([Block(cfg, i == 0, dtype=dtype, rngs=rngs) for i in range(cfg.num_layers)])
        self.final_layer_norm = LayerNorm(cfg.d_model, cfg.layer_norm_epsilon, dtype=dtype)


class T5Encoder(nnx.Module):
    """Token ids (batch, seq) -> last hidden state (batch, seq, d_model). `attention_mask` (batch, seq) bool masks
    padded keys; FLUX's pipeline passes none."""

    def __init__(self, config: T5Config, *, dtype: jnp.dtype = jnp.bfloat16, rngs: nnx.Rngs):
        self.config = config
        self.shared = Embedding(config.vocab_size, config.d_model, dtype=dtype, rngs=rngs)
        self.encoder = Stack(config, dtype=dtype, rngs=rngs)

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
        cfg = self.config
        seq = input_ids.shape[1]
        x = jnp.take(self.shared.weight[...], input_ids, axis=0)
        buckets = relative_position_buckets(seq, seq, cfg.relative_attention_num_buckets,
                                            cfg.relative_attention_max_distance)
        table = self.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight[...]
        bias = jnp.transpose(table[buckets], (2, 0, 1))[None].astype(jnp.float32)  # (1, heads, q, k)
        if attention_mask is not None:
            bias = bias + jnp.where(attention_mask[:, None, None, :], 0.0, jnp.finfo(jnp.float32).min)
        for block in self.encoder.block:
            x = block(x, bias)
        return self.encoder.final_layer_norm(x)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: jnp.dtype = jnp.bfloat16, *,
                        config: T5Config | str | Path | None = None) -> "T5Encoder":
        """Load a transformers `text_encoder_2/` folder (config.json with `model.safetensors` or shards) or a single
        `.safetensors` file (T5 v1.1 XXL config unless `config` is given). The token embedding may be stored as
        `shared.weight` or `encoder.embed_tokens.weight` (the two are tied)."""
        path = Path(path)
        if isinstance(config, (str, Path)):
            config = T5Config.from_json(config)
        if path.is_dir() and config is None:
            config = T5Config.from_json(path / "config.json")
        config, keys = cls.key_map(open_checkpoint(path, "model"), config, str(path))
        return load_state(lambda: cls(config, dtype=dtype, rngs=nnx.Rngs(0)), keys, source=str(path))

    @staticmethod
    def key_map(checkpoint: Checkpoint, config: T5Config | None = None,
                source: str = "checkpoint") -> tuple[T5Config, KeyMap]:
        """How `checkpoint` maps onto the module (decoder and LM head ignored), and its config: `config` or
        T5 v1.1 XXL's."""
        stored = set(checkpoint.keys())
        if "shared.weight" not in stored and "encoder.embed_tokens.weight" not in stored:
            raise CheckpointError(f"{source}: not a T5 encoder checkpoint (no shared.weight)")
        tied = "shared.weight" in stored
        return config or T5Config(), KeyMap(
            checkpoint,
            rename=lambda k: "shared.weight" if (k == "encoder.embed_tokens.weight" and not tied) else k,
            ignore=lambda k: k in ("encoder.embed_tokens.weight", "lm_head.weight") or k.startswith("decoder."))
