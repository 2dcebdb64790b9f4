"""The CLIP text transformer (FLUX's `text_encoder`) in Flax NNX, equal in function to transformers'
`CLIPTextModel`: token + learned position embeddings, pre-norm causal self-attention layers with quick-GELU MLPs, a
final LayerNorm, and the pooled output taken at each sequence's end-of-text token."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from .layers import LayerNorm, Linear
from .loading import Checkpoint, KeyMap, known_config, load_state, open_checkpoint, read_json


@dataclasses.dataclass(frozen=True)
class CLIPTextConfig:
    """transformers' CLIPTextConfig; defaults are CLIP ViT-L/14's text tower, as FLUX uses."""

    vocab_size: int = 49408
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    max_position_embeddings: int = 77
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    eos_token_id: int = 2

    @classmethod
    def from_json(cls, path: str | Path) -> "CLIPTextConfig":
        data = read_json(Path(path))
        return known_config(cls, data.get("text_config", data), str(path))


ACTIVATIONS = {"quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
               "gelu": lambda x: jax.nn.gelu(x, approximate=False)}


class Attention(nnx.Module):
    def __init__(self, cfg, *, causal: bool = True, dtype, rngs):
        d = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.causal = causal  # the text tower's; the vision tower (model/clip.py) attends both ways
        self.q_proj = Linear(d, d, bias=True, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(d, d, bias=True, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(d, d, bias=True, dtype=dtype, rngs=rngs)
        self.out_proj = Linear(d, d, bias=True, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        b, s, d = x.shape
        shape = (b, s, self.heads, d // self.heads)
        out = jax.nn.dot_product_attention(self.q_proj(x).reshape(shape), self.k_proj(x).reshape(shape),
                                           self.v_proj(x).reshape(shape), is_causal=self.causal)
        return self.out_proj(out.reshape(b, s, d))


class MLP(nnx.Module):
    def __init__(self, cfg: CLIPTextConfig, *, dtype, rngs):
        if cfg.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act={cfg.hidden_act!r} is not implemented")
        self.hidden_act = cfg.hidden_act  # by name: a function in the module would put its address in program keys
        self.fc1 = Linear(cfg.hidden_size, cfg.intermediate_size, bias=True, dtype=dtype, rngs=rngs)
        self.fc2 = Linear(cfg.intermediate_size, cfg.hidden_size, bias=True, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.fc2(ACTIVATIONS[self.hidden_act](self.fc1(x)))


class EncoderLayer(nnx.Module):
    def __init__(self, cfg, *, causal: bool = True, dtype, rngs):
        self.layer_norm1 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype=dtype)
        self.self_attn = Attention(cfg, causal=causal, dtype=dtype, rngs=rngs)
        self.layer_norm2 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype=dtype)
        self.mlp = MLP(cfg, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class Embedding(nnx.Module):
    def __init__(self, vocab, dim, *, dtype, rngs):
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (vocab, dim), dtype) * 0.02)


class Embeddings(nnx.Module):
    def __init__(self, cfg, *, dtype, rngs):
        self.token_embedding = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.position_embedding = Embedding(cfg.max_position_embeddings, cfg.hidden_size, dtype=dtype, rngs=rngs)


class Encoder(nnx.Module):
    def __init__(self, cfg, *, causal: bool = True, dtype, rngs):
        self.layers = nnx.List([EncoderLayer(cfg, causal=causal, dtype=dtype, rngs=rngs)
                                for _ in range(cfg.num_hidden_layers)])


class TextTransformer(nnx.Module):
    def __init__(self, cfg, *, dtype, rngs):
        self.embeddings = Embeddings(cfg, dtype=dtype, rngs=rngs)
        self.encoder = Encoder(cfg, dtype=dtype, rngs=rngs)
        self.final_layer_norm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype=dtype)

    def __call__(self, input_ids: jax.Array, eos_token_id: int) -> tuple[jax.Array, jax.Array]:
        """(last hidden state, the state at each sequence's end-of-text token)."""
        seq = input_ids.shape[1]
        x = jnp.take(self.embeddings.token_embedding.weight[...], input_ids, axis=0)
        x = x + self.embeddings.position_embedding.weight[...][:seq]
        for layer in self.encoder.layers:
            x = layer(x)
        x = self.final_layer_norm(x)
        if eos_token_id == 2:
            # Checkpoints from before transformers fixed eos_token_id: the end token has the largest id.
            eos = jnp.argmax(input_ids, axis=-1)
        else:
            eos = jnp.argmax(input_ids == eos_token_id, axis=-1)  # its first occurrence
        return x, x[jnp.arange(x.shape[0]), eos]


class CLIPTextEncoder(nnx.Module):
    """Token ids (batch, seq) -> (last hidden state (batch, seq, hidden), pooled output (batch, hidden))."""

    def __init__(self, config: CLIPTextConfig, *, dtype: jnp.dtype = jnp.bfloat16, rngs: nnx.Rngs):
        self.config = config
        self.text_model = TextTransformer(config, dtype=dtype, rngs=rngs)

    def __call__(self, input_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        return self.text_model(input_ids, self.config.eos_token_id)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: jnp.dtype = jnp.bfloat16, *,
                        config: CLIPTextConfig | str | Path | None = None) -> "CLIPTextEncoder":
        """Load a transformers `text_encoder/` folder (CLIPTextModel) or a single `.safetensors` file (ViT-L/14's
        text config unless `config` is given). Vision-tower and projection weights of a full CLIP file are skipped."""
        path = Path(path)
        if isinstance(config, (str, Path)):
            config = CLIPTextConfig.from_json(config)
        if path.is_dir() and config is None:
            config = CLIPTextConfig.from_json(path / "config.json")
        config, keys = cls.key_map(open_checkpoint(path, "model"), config)
        return load_state(lambda: cls(config, dtype=dtype, rngs=nnx.Rngs(0)), keys, source=str(path))

    @staticmethod
    def key_map(checkpoint: Checkpoint, config: CLIPTextConfig | None = None) -> tuple[CLIPTextConfig, KeyMap]:
        """How `checkpoint` maps onto the module (vision tower and projections ignored), and its config: `config` or
        ViT-L/14's text config."""
        return config or CLIPTextConfig(), KeyMap(
            checkpoint,
            # transformers 5 saves CLIPTextModel without its `text_model.` prefix; older saves (FLUX's repo) keep it
            rename=lambda k: k if k.startswith(("text_model.", "vision_model.")) else "text_model." + k,
            ignore=lambda k: k.startswith(("vision_model.", "text_model.visual_projection",
                                           "text_model.text_projection", "text_model.logit_scale"))
            or k.endswith("position_ids"))
