"""The Qwen-Image VAE (fine-tuned from Wan 2.1's) in Flax NNX, as Krea 2 uses it: equal in function to diffusers'
`AutoencoderKLQwenImage` (0.42.1) on images.

The network is a video VAE built of causal 3-D convolutions. An image is one frame, and for one frame the causal
padding (two zero frames before it) leaves only the last time slice of each 3x3x3 kernel touching real data, while
the temporal resamplers pass the first frame through untouched. So this implementation is 2-D: it loads each 3-D
kernel's last time slice and skips the `time_conv` weights, and computes exactly what diffusers computes on images.

Read top to bottom: norm, residual block, resampler, attention, mid block, encoder, decoder, the VAE with its latent
normalisation, tiling and loading. Arrays are channels-last: images (batch, height, width, 3) in [-1, 1], latents
(batch, height / 8, width / 8, z_dim).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from .layers import Conv2d, upsample_nearest_2x
from .loading import Checkpoint, CheckpointError, KeyMap, config_from_dict, load_state, open_checkpoint, read_json
from .vae_common import PerChannelLatents, Tiling, check_images, check_latents, tiled_apply
from .programs import stored_jit

# fmt: off
QWENIMAGE_LATENTS_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508, 0.4134, -0.0715, 0.5517,
                          -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
QWENIMAGE_LATENTS_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687, 2.1526, 2.8652, 1.5579,
                         1.6382, 1.1253, 2.8251, 1.9160)
# fmt: on


@dataclasses.dataclass(frozen=True)
class QwenImageVAEConfig:
    """The VAE's config.json (diffusers names); defaults are the released Qwen-Image VAE's."""

    base_dim: int = 96
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    attn_scales: tuple[float, ...] = ()
    temperal_downsample: tuple[bool, ...] = (False, True, True)
    dropout: float = 0.0
    input_channels: int = 3
    latents_mean: tuple[float, ...] = QWENIMAGE_LATENTS_MEAN
    latents_std: tuple[float, ...] = QWENIMAGE_LATENTS_STD

    def __post_init__(self):
        if self.attn_scales:
            raise ValueError("attn_scales (attention inside the down/up blocks) is not used by any released model")
        if len(self.latents_mean) != self.z_dim or len(self.latents_std) != self.z_dim:
            raise ValueError(f"latents_mean and latents_std need z_dim={self.z_dim} entries")

    @property
    def spatial_compression(self) -> int:
        return 2 ** (len(self.dim_mult) - 1)

    @classmethod
    def from_json(cls, path: str | Path) -> "QwenImageVAEConfig":
        return config_from_dict(cls, read_json(Path(path)), str(path))


class RMSNorm(nnx.Module):
    """L2-normalise each pixel's channel vector (in float32), times sqrt(dim) and a learned gain."""

    def __init__(self, dim: int, *, dtype):
        self.scale = dim**0.5
        self.gamma = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        norm = jnp.sqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True))
        return (x32 / jnp.maximum(norm, 1e-12)).astype(x.dtype) * self.scale * self.gamma[...]


class ResidualBlock(nnx.Module):
    def __init__(self, in_dim: int, out_dim: int, *, dtype, rngs: nnx.Rngs):
        self.norm1 = RMSNorm(in_dim, dtype=dtype)
        self.conv1 = Conv2d(in_dim, out_dim, 3, padding=1, dtype=dtype, rngs=rngs)
        self.norm2 = RMSNorm(out_dim, dtype=dtype)
        self.conv2 = Conv2d(out_dim, out_dim, 3, padding=1, dtype=dtype, rngs=rngs)
        self.conv_shortcut = Conv2d(in_dim, out_dim, 1, dtype=dtype, rngs=rngs) if in_dim != out_dim else None

    def __call__(self, x: jax.Array) -> jax.Array:
        shortcut = self.conv_shortcut(x) if self.conv_shortcut is not None else x
        x = self.conv1(jax.nn.silu(self.norm1(x)))
        x = self.conv2(jax.nn.silu(self.norm2(x)))
        return x + shortcut


class Resample(nnx.Module):
    """2x spatial down- (zero pad right/bottom, stride-2 conv) or upsampling (nearest, conv to half the channels)."""

    def __init__(self, dim: int, mode: str, *, dtype, rngs: nnx.Rngs):
        self.mode = mode
        if mode.startswith("upsample"):
            self.resample = Conv2d(dim, dim // 2, 3, padding=1, dtype=dtype, rngs=rngs)
        else:
            self.resample = Conv2d(dim, dim, 3, stride=2, padding=((0, 1), (0, 1)), dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.mode.startswith("upsample"):
            x = upsample_nearest_2x(x.astype(jnp.float32)).astype(x.dtype)
        return self.resample(x)


class AttentionBlock(nnx.Module):
    """Single-head self-attention over the pixels of one frame, with a residual connection."""

    def __init__(self, dim: int, *, dtype, rngs: nnx.Rngs):
        self.norm = RMSNorm(dim, dtype=dtype)
        self.to_qkv = Conv2d(dim, dim * 3, 1, dtype=dtype, rngs=rngs)
        self.proj = Conv2d(dim, dim, 1, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        batch, height, width, channels = x.shape
        qkv = self.to_qkv(self.norm(x)).reshape(batch, height * width, 1, 3 * channels)
        q, k, v = jnp.split(qkv, 3, axis=-1)
        out = jax.nn.dot_product_attention(q, k, v).reshape(batch, height, width, channels)
        return self.proj(out) + x


class MidBlock(nnx.Module):
    def __init__(self, dim: int, *, dtype, rngs: nnx.Rngs):
        self.resnets = nnx.List([ResidualBlock(dim, dim, dtype=dtype, rngs=rngs) for _ in range(2)])
        self.attentions = nnx.List([AttentionBlock(dim, dtype=dtype, rngs=rngs)])

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.resnets[1](self.attentions[0](self.resnets[0](x)))


class Encoder(nnx.Module):
    def __init__(self, cfg: QwenImageVAEConfig, *, dtype, rngs: nnx.Rngs):
        dims = [cfg.base_dim * m for m in (1, *cfg.dim_mult)]
        self.conv_in = Conv2d(cfg.input_channels, dims[0], 3, padding=1, dtype=dtype, rngs=rngs)
        blocks = []
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            for _ in range(cfg.num_res_blocks):
                blocks.append(ResidualBlock(in_dim, out_dim, dtype=dtype, rngs=rngs))
                in_dim = out_dim
            if i != len(cfg.dim_mult) - 1:
                mode = "downsample3d" if cfg.temperal_downsample[i] else "downsample2d"
                blocks.append(Resample(out_dim, mode, dtype=dtype, rngs=rngs))
        self.down_blocks = nnx.List(blocks)
        self.mid_block = MidBlock(dims[-1], dtype=dtype, rngs=rngs)
        self.norm_out = RMSNorm(dims[-1], dtype=dtype)
        self.conv_out = Conv2d(dims[-1], cfg.z_dim * 2, 3, padding=1, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        x = self.mid_block(x)
        return self.conv_out(jax.nn.silu(self.norm_out(x)))


class UpBlock(nnx.Module):
    def __init__(self, in_dim: int, out_dim: int, num_res_blocks: int, upsample: str | None, *, dtype, rngs):
        self.resnets = nnx.List(
            [ResidualBlock(in_dim if i == 0 else out_dim, out_dim, dtype=dtype, rngs=rngs) for i in range(num_res_blocks + 1)]
        )
        self.upsamplers = nnx.List([Resample(out_dim, upsample, dtype=dtype, rngs=rngs)]) if upsample else None

    def __call__(self, x: jax.Array) -> jax.Array:
        for resnet in self.resnets:
            x = resnet(x)
        return self.upsamplers[0](x) if self.upsamplers is not None else x


class Decoder(nnx.Module):
    def __init__(self, cfg: QwenImageVAEConfig, *, dtype, rngs: nnx.Rngs):
        dims = [cfg.base_dim * m for m in (cfg.dim_mult[-1], *cfg.dim_mult[::-1])]
        temperal_upsample = cfg.temperal_downsample[::-1]
        self.conv_in = Conv2d(cfg.z_dim, dims[0], 3, padding=1, dtype=dtype, rngs=rngs)
        self.mid_block = MidBlock(dims[0], dtype=dtype, rngs=rngs)
        blocks = []
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            if i > 0:
                in_dim //= 2  # each upsampler halves the channels
            upsample = None
            if i != len(cfg.dim_mult) - 1:
                upsample = "upsample3d" if temperal_upsample[i] else "upsample2d"
            blocks.append(UpBlock(in_dim, out_dim, cfg.num_res_blocks, upsample, dtype=dtype, rngs=rngs))
        self.up_blocks = nnx.List(blocks)
        self.norm_out = RMSNorm(dims[-1], dtype=dtype)
        self.conv_out = Conv2d(dims[-1], cfg.input_channels, 3, padding=1, dtype=dtype, rngs=rngs)

    def __call__(self, z: jax.Array) -> jax.Array:
        x = self.mid_block(self.conv_in(z))
        for block in self.up_blocks:
            x = block(x)
        return self.conv_out(jax.nn.silu(self.norm_out(x)))


class QwenImageVAE(PerChannelLatents, nnx.Module):
    """Encode images to latents and decode them back.

    `encode` returns the posterior mean, `decode` images clamped to [-1, 1]; with `tiled=True` both go tile by tile
    (by default 256-pixel tiles every 192 pixels, as diffusers) so large images fit in bounded memory.
    `normalize_latents` and `denormalize_latents` convert between the VAE's latent space and the normalised one the
    transformer sees.
    """

    def __init__(self, config: QwenImageVAEConfig, *, dtype: jnp.dtype = jnp.bfloat16, rngs: nnx.Rngs):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.encoder = Encoder(config, dtype=dtype, rngs=rngs)
        self.quant_conv = Conv2d(config.z_dim * 2, config.z_dim * 2, 1, dtype=dtype, rngs=rngs)
        self.post_quant_conv = Conv2d(config.z_dim, config.z_dim, 1, dtype=dtype, rngs=rngs)
        self.decoder = Decoder(config, dtype=dtype, rngs=rngs)

    # -- encode / decode -----------------------------------------------------------------------------------------------

    def encode_moments(
        self, images: jax.Array, *, tiled: bool = False, tile_size: int = 256, tile_stride: int = 192
    ) -> tuple[jax.Array, jax.Array]:
        """images (batch, h, w, 3) in [-1, 1], h and w multiples of 8 -> posterior (mean, logvar), each
        (batch, h / 8, w / 8, z_dim); logvar clipped to [-30, 20] as diffusers does. Tiles are in pixels."""
        check_images(images, self.config.input_channels, self.config.spatial_compression)
        images = jnp.asarray(images, self.dtype)
        r = self.config.spatial_compression
        out_size = (images.shape[1] // r, images.shape[2] // r)
        if tiled:
            tiling = Tiling(tile=tile_size, stride=tile_stride, blend=(tile_size - tile_stride) // r, keep=tile_stride // r)
            moments = tiled_apply(functools.partial(_encode_fn, self), images, tiling, out_size)
        else:
            moments = _encode_fn(self, images)
        mean, logvar = jnp.split(moments, 2, axis=-1)
        return mean, jnp.clip(logvar, -30.0, 20.0)

    def encode(self, images: jax.Array, **tiling) -> jax.Array:
        """images (batch, h, w, 3) in [-1, 1] -> latent mean (batch, h / 8, w / 8, z_dim), not normalised."""
        return self.encode_moments(images, **tiling)[0]

    def decode(self, latents: jax.Array, *, tiled: bool = False, tile_size: int = 256, tile_stride: int = 192) -> jax.Array:
        """latents (batch, h, w, z_dim), not normalised -> images (batch, 8h, 8w, 3) in [-1, 1]. Tiles are given in
        output pixels; tiles overlap by `tile_size - tile_stride` pixels, which are cross-faded."""
        check_latents(latents, self.config.z_dim)
        latents = jnp.asarray(latents, self.dtype)
        r = self.config.spatial_compression
        out_size = (latents.shape[1] * r, latents.shape[2] * r)
        if tiled:
            tiling = Tiling(tile=tile_size // r, stride=tile_stride // r, blend=tile_size - tile_stride, keep=tile_stride)
            images = tiled_apply(functools.partial(_decode_fn, self), latents, tiling, out_size)
        else:
            images = _decode_fn(self, latents)
        return jnp.clip(images, -1.0, 1.0)

    # -- loading -------------------------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls, path: str | Path, dtype: jnp.dtype = jnp.bfloat16, *, config: QwenImageVAEConfig | str | Path | None = None
    ) -> "QwenImageVAE":
        """Load from a diffusers `vae/` folder, or a single `.safetensors` file with diffusers key names or Wan 2.1's
        original ones (ComfyUI's `qwen_image_vae.safetensors`). A single file without `config` gets the released
        model's structure with `base_dim` and `z_dim` read from the weights."""
        path = Path(path)
        if isinstance(config, (str, Path)):
            config = QwenImageVAEConfig.from_json(config)
        if path.is_dir() and config is None:
            config = QwenImageVAEConfig.from_json(path / "config.json")
        config, keys = cls.key_map(open_checkpoint(path, "diffusion_pytorch_model"), config, str(path))
        return load_state(lambda: cls(config, dtype=dtype, rngs=nnx.Rngs(0)), keys, source=str(path))

    @staticmethod
    def key_map(checkpoint: Checkpoint, config: QwenImageVAEConfig | None = None,
                source: str = "checkpoint") -> tuple[QwenImageVAEConfig, KeyMap]:
        """How `checkpoint` (diffusers' key names or Wan 2.1's) maps onto the module (the temporal convolutions
        ignored), and its config: `config`, or the released structure with `base_dim` and `z_dim` read from the
        weights."""
        original = any(k.startswith(("encoder.downsamples.", "decoder.upsamples.")) for k in checkpoint.keys())
        if config is None:
            stored = set(checkpoint.keys())
            in_key = "encoder.conv1.weight" if original else "encoder.conv_in.weight"
            post_key = "conv2.weight" if original else "post_quant_conv.weight"
            if in_key not in stored or post_key not in stored:
                raise CheckpointError(f"{source}: not a Qwen-Image / Wan 2.1 VAE checkpoint (no {in_key!r})")
            config = QwenImageVAEConfig(base_dim=checkpoint.shape(in_key)[0], z_dim=checkpoint.shape(post_key)[0])
        per_block = config.num_res_blocks + 2
        rename = (lambda k: _diffusers_name(original_key_to_diffusers(k, per_block))) if original else _diffusers_name
        return config, KeyMap(checkpoint, rename=rename, convert=_to_2d, ignore=lambda key: ".time_conv." in key)


@stored_jit  # the module as a pytree: less host time a call than nnx.jit's graph traversal
def _encode_fn(vae: QwenImageVAE, images: jax.Array) -> jax.Array:
    return vae.quant_conv(vae.encoder(images))


@stored_jit
def _decode_fn(vae: QwenImageVAE, latents: jax.Array) -> jax.Array:
    return vae.decoder(vae.post_quant_conv(latents))


# --------------------------------------------------------------------------------------------------------------------
# Checkpoint layouts


def _diffusers_name(key: str) -> str:
    # Our resampler holds its conv directly; diffusers keeps it at index 1 of a Sequential (after the pad/upsample).
    return key.replace(".resample.1.", ".resample.")


def _to_2d(key: str, shape: tuple[int, ...]):
    """Conv kernels are stored 3-D (out, in, t, kh, kw): keep the last time slice (see the module docstring). Norm
    gains are stored with trailing singleton axes."""
    if key.endswith(".weight") and len(shape) == 5:
        return (*shape[:2], *shape[3:]), lambda array: array[:, :, -1]
    if key.endswith(".gamma") and len(shape) > 1:
        return (shape[0],), lambda array: array.reshape(-1)
    return None


_RESIDUAL = {"residual.0.gamma": "norm1.gamma", "residual.2.": "conv1.", "residual.3.gamma": "norm2.gamma",
             "residual.6.": "conv2.", "shortcut.": "conv_shortcut."}


def _residual(rest: str) -> str:
    for old, new in _RESIDUAL.items():
        if rest.startswith(old):
            return new + rest[len(old) :]
    return rest


def original_key_to_diffusers(key: str, per_block: int = 4) -> str:
    """Map a key of the original Wan 2.1 VAE layout to diffusers' `AutoencoderKLQwenImage` name.

    The original keeps flat lists: `encoder.downsamples.N` (same order as diffusers' down_blocks), `*.middle.{0,1,2}`
    (resnet, attention, resnet) and `decoder.upsamples.N`, where each decoder level holds `num_res_blocks + 1`
    residual blocks then its resampler (`per_block` entries a level)."""
    for part in ("encoder", "decoder"):
        for old, new in ((f"{part}.conv1.", f"{part}.conv_in."), (f"{part}.head.0.", f"{part}.norm_out."),
                         (f"{part}.head.2.", f"{part}.conv_out.")):
            if key.startswith(old):
                return new + key[len(old) :]
        if m := re.match(rf"{part}\.middle\.(\d)\.(.*)", key):
            index, rest = int(m[1]), m[2]
            if index == 1:
                return f"{part}.mid_block.attentions.0.{rest}"
            return f"{part}.mid_block.resnets.{index // 2}.{_residual(rest)}"
    if m := re.match(r"encoder\.downsamples\.(\d+)\.(.*)", key):
        return f"encoder.down_blocks.{m[1]}.{_residual(m[2])}"
    if m := re.match(r"decoder\.upsamples\.(\d+)\.(.*)", key):
        level, within = divmod(int(m[1]), per_block)
        if within == per_block - 1:
            return f"decoder.up_blocks.{level}.upsamplers.0.{m[2]}"
        return f"decoder.up_blocks.{level}.resnets.{within}.{_residual(m[2])}"
    return {"conv1.weight": "quant_conv.weight", "conv1.bias": "quant_conv.bias",
            "conv2.weight": "post_quant_conv.weight", "conv2.bias": "post_quant_conv.bias"}.get(key, key)
