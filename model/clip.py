"""CLIP (both towers and their projections) in Flax NNX, equal in function to transformers' `CLIPModel`: what the
CLIP score of `scripts/eval_quality.py` runs (openai/clip-vit-base-patch16 in the seeds' protocol). The text tower
is `clip_text`'s; the vision tower embeds 16x16 (patch_size) patches with a class token and learned positions,
normalizes before and after its bidirectional encoder and pools the class token. `clip_pixels` is
`CLIPImageProcessor`'s preprocessing (its PIL backend)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .clip_text import CLIPTextConfig, Encoder, TextTransformer
from .layers import LayerNorm, Linear
from .loading import KeyMap, known_config, load_state, open_checkpoint, read_json

# CLIPImageProcessor's defaults: the released CLIP models' preprocessing
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclasses.dataclass(frozen=True)
class CLIPVisionConfig:
    """transformers' CLIPVisionConfig; defaults are ViT-B/16's."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 16
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5


@dataclasses.dataclass(frozen=True)
class CLIPConfig:
    """transformers' CLIPConfig: the two towers, the shared embedding width and the initial logit scale."""

    text: CLIPTextConfig = CLIPTextConfig(hidden_size=512, intermediate_size=2048, num_attention_heads=8)
    vision: CLIPVisionConfig = CLIPVisionConfig()
    projection_dim: int = 512

    @classmethod
    def from_json(cls, path: str | Path) -> "CLIPConfig":
        data = read_json(Path(path))
        return cls(text=known_config(CLIPTextConfig, data.get("text_config", {}), str(path)),
                   vision=known_config(CLIPVisionConfig, data.get("vision_config", {}), str(path)),
                   projection_dim=int(data.get("projection_dim", 512)))


class VisionEmbeddings(nnx.Module):
    def __init__(self, cfg: CLIPVisionConfig, *, dtype, rngs):
        self.patch_size = cfg.patch_size
        d, p = cfg.hidden_size, cfg.patch_size
        self.class_embedding = nnx.Param(jax.random.normal(rngs.params(), (d,), dtype) * 0.02)
        self.patch_embedding = PatchEmbedding(d, cfg.num_channels, p, dtype=dtype, rngs=rngs)
        positions = (cfg.image_size // p) ** 2 + 1
        self.position_embedding = PositionEmbedding(positions, d, dtype=dtype, rngs=rngs)

    def __call__(self, pixels: jax.Array) -> jax.Array:
        """(batch, channels, height, width) -> (batch, 1 + patches, hidden)."""
        b, c, h, w = pixels.shape
        p = self.patch_size
        # the convolution's patches, in its output order (rows of patches), each flattened as (channel, row, column)
        patches = pixels.reshape(b, c, h // p, p, w // p, p).transpose(0, 2, 4, 1, 3, 5).reshape(b, -1, c * p * p)
        weight = self.patch_embedding.weight[...]
        x = jnp.einsum("bnk,dk->bnd", patches.astype(weight.dtype), weight.reshape(weight.shape[0], -1))
        cls = jnp.broadcast_to(self.class_embedding[...], (b, 1, x.shape[-1]))
        return jnp.concatenate([cls, x], axis=1) + self.position_embedding.weight[...]


class PatchEmbedding(nnx.Module):
    """transformers' patch convolution's weight (hidden, channels, patch, patch), without a bias."""

    def __init__(self, dim: int, channels: int, patch: int, *, dtype, rngs):
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (dim, channels, patch, patch), dtype) * 0.02)


class PositionEmbedding(nnx.Module):
    def __init__(self, count: int, dim: int, *, dtype, rngs):
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (count, dim), dtype) * 0.02)


class VisionTransformer(nnx.Module):
    def __init__(self, cfg: CLIPVisionConfig, *, dtype, rngs):
        self.embeddings = VisionEmbeddings(cfg, dtype=dtype, rngs=rngs)
        self.pre_layrnorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype=dtype)  # transformers' spelling
        self.encoder = Encoder(cfg, causal=False, dtype=dtype, rngs=rngs)
        self.post_layernorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype=dtype)

    def __call__(self, pixels: jax.Array) -> jax.Array:
        """The pooled output: the class token's last state, normalized (batch, hidden)."""
        x = self.pre_layrnorm(self.embeddings(pixels))
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x[:, 0])


class CLIPModel(nnx.Module):
    """Images and texts to unit embeddings in one space; their scaled cosine similarities (`logits`) and the CLIP
    score (`clip_score`)."""

    def __init__(self, config: CLIPConfig, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.text_model = TextTransformer(config.text, dtype=dtype, rngs=rngs)
        self.vision_model = VisionTransformer(config.vision, dtype=dtype, rngs=rngs)
        self.text_projection = Linear(config.text.hidden_size, config.projection_dim, bias=False, dtype=dtype,
                                      rngs=rngs)
        self.visual_projection = Linear(config.vision.hidden_size, config.projection_dim, bias=False, dtype=dtype,
                                        rngs=rngs)
        self.logit_scale = nnx.Param(jnp.asarray(2.6592, jnp.float32))

    def image_embeds(self, pixels: jax.Array) -> jax.Array:
        """Pixels (batch, 3, size, size) from `clip_pixels` -> unit embeddings (batch, projection_dim), float32."""
        return _unit(self.visual_projection(self.vision_model(pixels)))

    def text_embeds(self, input_ids: jax.Array) -> jax.Array:
        """Token ids (batch, seq) of CLIP's tokenizer -> unit embeddings (batch, projection_dim), float32."""
        _, pooled = self.text_model(input_ids, self.config.text.eos_token_id)
        return _unit(self.text_projection(pooled))

    def logits(self, pixels: jax.Array, input_ids: jax.Array) -> jax.Array:
        """transformers' `logits_per_image`: exp(logit_scale) times the cosine of each image with each text."""
        scale = jnp.exp(self.logit_scale[...].astype(jnp.float32))
        return scale * self.image_embeds(pixels) @ self.text_embeds(input_ids).T

    def clip_score(self, pixels: jax.Array, input_ids: jax.Array) -> jax.Array:
        """The CLIP score of each image with its own text (pairs, batch each): 100 times their cosine, at least 0
        (torchmetrics' `clip_score`, the seeds' protocol)."""
        cosine = jnp.sum(self.image_embeds(pixels) * self.text_embeds(input_ids), axis=-1)
        return jnp.maximum(100.0 * cosine, 0.0)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: jnp.dtype = jnp.float32) -> "CLIPModel":
        """Load a transformers CLIPModel folder (config.json and safetensors weights)."""
        path = Path(path)
        config = CLIPConfig.from_json(path / "config.json")
        keys = KeyMap(open_checkpoint(path, "model"), ignore=lambda k: k.endswith("position_ids"),
                      convert=_to_scalar)
        return load_state(lambda: cls(config, dtype=dtype, rngs=nnx.Rngs(0)), keys, source=str(path))


def _to_scalar(name: str, shape: tuple[int, ...]):
    """transformers keeps logit_scale as a 0-d tensor, as we do; older saves as (1,)."""
    if name == "logit_scale" and shape == (1,):
        return (), lambda array: array.reshape(())
    return None


def _unit(x: jax.Array) -> jax.Array:
    x = x.astype(jnp.float32)
    return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


def clip_pixels(images: Sequence, size: int = 224) -> np.ndarray:
    """`CLIPImageProcessor` (PIL backend) on PIL images: the shortest side resized to `size` (bicubic, the other
    side rounded down as it rounds it), the centre `size` x `size` cropped, scaled to [0, 1] and normalized with
    CLIP's mean and std; (batch, 3, size, size) float32."""
    from PIL import Image

    out = []
    for image in images:
        image = image.convert("RGB")
        w, h = image.size
        short, long = (w, h) if w <= h else (h, w)
        new_long = int(size * long / short)
        new_w, new_h = (size, new_long) if w <= h else (new_long, size)
        resized = image.resize((new_w, new_h), Image.Resampling.BICUBIC)
        top, left = (new_h - size) // 2, (new_w - size) // 2
        array = np.asarray(resized, np.float32)[top:top + size, left:left + size] / 255.0
        out.append(((array - np.asarray(CLIP_MEAN, np.float32)) / np.asarray(CLIP_STD, np.float32)).transpose(2, 0, 1))
    return np.stack(out).astype(np.float32)


def load_clip(folder: str | Path, dtype: jnp.dtype = jnp.float32):
    """A transformers CLIP folder (e.g. openai/clip-vit-base-patch16): the model and its tokenizer."""
    from .tokenizer import TextTokenizer

    return CLIPModel.from_pretrained(folder, dtype), TextTokenizer.from_folder(folder)


@nnx.jit
def _clip_score(model: CLIPModel, pixels: jax.Array, input_ids: jax.Array) -> jax.Array:
    return model.clip_score(pixels, input_ids)


def clip_scores(model: CLIPModel, tokenizer, images: Sequence, prompts: Sequence[str], batch: int = 16) -> np.ndarray:
    """The CLIP score of each image (PIL, or uint8 (h, w, 3)) with its prompt, as torchmetrics' `clip_score` takes
    it with transformers' processor: the image through `clip_pixels`, the prompt tokenized to the text tower's
    length (truncated there, padded with the end token), 100 times their cosine, at least 0. (images,) float32."""
    from PIL import Image

    if len(images) != len(prompts):
        raise ValueError(f"clip_scores: {len(images)} images for {len(prompts)} prompts")
    images = [image if isinstance(image, Image.Image) else Image.fromarray(np.asarray(image, np.uint8))
              for image in images]
    out = []
    for start in range(0, len(images), batch):
        part = slice(start, start + batch)
        ids, _ = tokenizer(list(prompts[part]), max_length=model.config.text.max_position_embeddings)
        pixels = clip_pixels(images[part], model.config.vision.image_size)
        out.append(np.asarray(_clip_score(model, jnp.asarray(pixels), jnp.asarray(ids))))
    return np.concatenate(out).astype(np.float32)
