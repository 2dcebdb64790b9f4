"""The FLUX.1 VAE in Flax NNX: diffusers' `AutoencoderKL` (0.42.1) with FLUX's configuration (16 latent channels,
8x downsampling, no quant convs, latents scaled and shifted by config factors).

Read top to bottom: group norm, residual block, down/upsampler, attention, blocks, encoder, decoder, the VAE with its
latent scaling, tiling and loading. Arrays are channels-last: images (batch, height, width, 3) in [-1, 1], latents
(batch, height / 8, width / 8, latent_channels).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from .layers import Conv2d, Linear, upsample_nearest_2x
from .loading import Checkpoint, CheckpointError, KeyMap, config_from_dict, load_state, open_checkpoint, read_json
from .vae_common import Tiling, check_images, check_latents, tiled_apply
from .programs import stored_jit


@dataclasses.dataclass(frozen=True)
class FluxVAEConfig:
    """`AutoencoderKL`'s config.json (diffusers names); defaults are FLUX.1's `vae/` config."""

    in_channels: int = 3
    out_channels: int = 3
    down_block_types: tuple[str, ...] = ("DownEncoderBlock2D",) * 4
    up_block_types: tuple[str, ...] = ("UpDecoderBlock2D",) * 4
    block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    layers_per_block: int = 2
    act_fn: str = "silu"
    latent_channels: int = 16
    norm_num_groups: int = 32
    sample_size: int = 1024
    scaling_factor: float = 0.3611
    shift_factor: float | None = 0.1159
    latents_mean: tuple[float, ...] | None = None  # AutoencoderKL config keys that FLUX leaves unset
    latents_std: tuple[float, ...] | None = None
    use_quant_conv: bool = False
    use_post_quant_conv: bool = False
    mid_block_add_attention: bool = True
    force_upcast: bool = True

    def __post_init__(self):
        if self.act_fn != "silu":
            raise ValueError(f"act_fn={self.act_fn!r}: only 'silu' is implemented")
        if set(self.down_block_types) != {"DownEncoderBlock2D"} or set(self.up_block_types) != {"UpDecoderBlock2D"}:
            raise ValueError("only DownEncoderBlock2D / UpDecoderBlock2D blocks are implemented")
        bad = [c for c in self.block_out_channels if c % self.norm_num_groups]
        if bad:
            raise ValueError(f"block_out_channels {bad} are not divisible by norm_num_groups={self.norm_num_groups}")

    @property
    def spatial_compression(self) -> int:
        return 2 ** (len(self.block_out_channels) - 1)

    @classmethod
    def from_json(cls, path: str | Path) -> "FluxVAEConfig":
        return config_from_dict(cls, read_json(Path(path)), str(path))


class GroupNorm(nnx.Module):
    """torch.nn.GroupNorm over channels-last input (groups of consecutive channels), computed in float32."""

    def __init__(self, groups: int, channels: int, eps: float = 1e-6, *, dtype):
        self.groups, self.eps = groups, eps
        self.weight = nnx.Param(jnp.ones((channels,), dtype))
        self.bias = nnx.Param(jnp.zeros((channels,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        shape = x.shape
        x32 = x.astype(jnp.float32).reshape(shape[0], -1, self.groups, shape[-1] // self.groups)
        mean = jnp.mean(x32, axis=(1, 3), keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=(1, 3), keepdims=True)
        y = ((x32 - mean) * jax.lax.rsqrt(var + self.eps)).reshape(shape)
        return (y * self.weight[...] + self.bias[...]).astype(x.dtype)


class ResnetBlock(nnx.Module):
    def __init__(self, in_channels: int, out_channels: int, groups: int, *, dtype, rngs: nnx.Rngs):
        self.norm1 = GroupNorm(groups, in_channels, dtype=dtype)
        self.conv1 = Conv2d(in_channels, out_channels, 3, padding=1, dtype=dtype, rngs=rngs)
        self.norm2 = GroupNorm(groups, out_channels, dtype=dtype)
        self.conv2 = Conv2d(out_channels, out_channels, 3, padding=1, dtype=dtype, rngs=rngs)
        self.conv_shortcut = Conv2d(in_channels, out_channels, 1, dtype=dtype, rngs=rngs) if in_channels != out_channels else None

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.conv1(jax.nn.silu(self.norm1(x)))
        h = self.conv2(jax.nn.silu(self.norm2(h)))
        return (self.conv_shortcut(x) if self.conv_shortcut is not None else x) + h


class Downsample(nnx.Module):
    """Zero pad right and bottom by one, then a stride-2 3x3 conv."""

    def __init__(self, channels: int, *, dtype, rngs: nnx.Rngs):
        self.conv = Conv2d(channels, channels, 3, stride=2, padding=((0, 1), (0, 1)), dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.conv(x)


class Upsample(nnx.Module):
    """Nearest 2x upsampling, then a 3x3 conv."""

    def __init__(self, channels: int, *, dtype, rngs: nnx.Rngs):
        self.conv = Conv2d(channels, channels, 3, padding=1, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.conv(upsample_nearest_2x(x))


class Attention(nnx.Module):
    """Single-head self-attention over all pixels, group-normed input, residual output."""

    def __init__(self, channels: int, groups: int, *, dtype, rngs: nnx.Rngs):
        self.group_norm = GroupNorm(groups, channels, dtype=dtype)
        self.to_q = Linear(channels, channels, bias=True, dtype=dtype, rngs=rngs)
        self.to_k = Linear(channels, channels, bias=True, dtype=dtype, rngs=rngs)
        self.to_v = Linear(channels, channels, bias=True, dtype=dtype, rngs=rngs)
        self.to_out = nnx.List([Linear(channels, channels, bias=True, dtype=dtype, rngs=rngs)])

    def __call__(self, x: jax.Array) -> jax.Array:
        batch, height, width, channels = x.shape
        h = self.group_norm(x).reshape(batch, height * width, 1, channels)
        out = jax.nn.dot_product_attention(self.to_q(h), self.to_k(h), self.to_v(h))
        return self.to_out[0](out.reshape(batch, height, width, channels)) + x


class MidBlock(nnx.Module):
    def __init__(self, channels: int, groups: int, add_attention: bool, *, dtype, rngs: nnx.Rngs):
        self.resnets = nnx.List([ResnetBlock(channels, channels, groups, dtype=dtype, rngs=rngs) for _ in range(2)])
        self.attentions = nnx.List([Attention(channels, groups, dtype=dtype, rngs=rngs)]) if add_attention else None

    def __call__(self, x):
        x = self.resnets[0](x)
        if self.attentions is not None:
            x = self.attentions[0](x)
        return self.resnets[1](x)


class DownBlock(nnx.Module):
    def __init__(self, in_ch: int, out_ch: int, layers: int, groups: int, downsample: bool, *, dtype, rngs):
        self.resnets = nnx.List(
            [ResnetBlock(in_ch if i == 0 else out_ch, out_ch, groups, dtype=dtype, rngs=rngs) for i in range(layers)]
        )
        self.downsamplers = nnx.List([Downsample(out_ch, dtype=dtype, rngs=rngs)]) if downsample else None

    def __call__(self, x):
        for resnet in self.resnets:
            x = resnet(x)
        return self.downsamplers[0](x) if self.downsamplers is not None else x


class UpBlock(nnx.Module):
    def __init__(self, in_ch: int, out_ch: int, layers: int, groups: int, upsample: bool, *, dtype, rngs):
        self.resnets = nnx.List(
            [ResnetBlock(in_ch if i == 0 else out_ch, out_ch, groups, dtype=dtype, rngs=rngs) for i in range(layers)]
        )
        self.upsamplers = nnx.List([Upsample(out_ch, dtype=dtype, rngs=rngs)]) if upsample else None

    def __call__(self, x):
        for resnet in self.resnets:
            x = resnet(x)
        return self.upsamplers[0](x) if self.upsamplers is not None else x


class Encoder(nnx.Module):
    def __init__(self, cfg: FluxVAEConfig, *, dtype, rngs: nnx.Rngs):
        ch, groups, n = cfg.block_out_channels, cfg.norm_num_groups, len(cfg.block_out_channels)
        self.conv_in = Conv2d(cfg.in_channels, ch[0], 3, padding=1, dtype=dtype, rngs=rngs)
        self.down_blocks = nnx.List([
            DownBlock(ch[max(i - 1, 0)], ch[i], cfg.layers_per_block, groups, i < n - 1, dtype=dtype, rngs=rngs)
            for i in range(n)
        ])
        self.mid_block = MidBlock(ch[-1], groups, cfg.mid_block_add_attention, dtype=dtype, rngs=rngs)
        self.conv_norm_out = GroupNorm(groups, ch[-1], dtype=dtype)
        self.conv_out = Conv2d(ch[-1], 2 * cfg.latent_channels, 3, padding=1, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        x = self.mid_block(x)
        return self.conv_out(jax.nn.silu(self.conv_norm_out(x)))


class Decoder(nnx.Module):
    def __init__(self, cfg: FluxVAEConfig, *, dtype, rngs: nnx.Rngs):
        ch, groups, n = cfg.block_out_channels[::-1], cfg.norm_num_groups, len(cfg.block_out_channels)
        self.conv_in = Conv2d(cfg.latent_channels, ch[0], 3, padding=1, dtype=dtype, rngs=rngs)
        self.mid_block = MidBlock(ch[0], groups, cfg.mid_block_add_attention, dtype=dtype, rngs=rngs)
        self.up_blocks = nnx.List([
            UpBlock(ch[max(i - 1, 0)], ch[i], cfg.layers_per_block + 1, groups, i < n - 1, dtype=dtype, rngs=rngs)
            for i in range(n)
        ])
        self.conv_norm_out = GroupNorm(groups, ch[-1], dtype=dtype)
        self.conv_out = Conv2d(ch[-1], cfg.out_channels, 3, padding=1, dtype=dtype, rngs=rngs)

    def __call__(self, z):
        x = self.mid_block(self.conv_in(z))
        for block in self.up_blocks:
            x = block(x)
        return self.conv_out(jax.nn.silu(self.conv_norm_out(x)))


class FluxVAE(nnx.Module):
    """Encode images to latents and decode them back.

    `encode` returns the posterior mean and `decode` the raw decoder output (diffusers' AutoencoderKL does not clamp;
    the image conversion in `model/images.py` does). With `tiled=True` both go tile by tile: tiles of
    `config.sample_size` pixels overlapping by a quarter, as diffusers. `normalize_latents` / `denormalize_latents`
    apply the config's shift and scaling factors between VAE latents and the transformer's.
    """

    def __init__(self, config: FluxVAEConfig, *, dtype: jnp.dtype = jnp.bfloat16, rngs: nnx.Rngs):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        z = config.latent_channels
        self.encoder = Encoder(config, dtype=dtype, rngs=rngs)
        self.decoder = Decoder(config, dtype=dtype, rngs=rngs)
        self.quant_conv = Conv2d(2 * z, 2 * z, 1, dtype=dtype, rngs=rngs) if config.use_quant_conv else None
        self.post_quant_conv = Conv2d(z, z, 1, dtype=dtype, rngs=rngs) if config.use_post_quant_conv else None

    # -- latent normalisation: the one place where the config's factors are applied ------------------------------------

    def normalize_latents(self, z: jax.Array) -> jax.Array:
        """VAE latents -> the transformer's: (z - shift_factor) * scaling_factor."""
        shift = self.config.shift_factor or 0.0
        return ((z - shift) * self.config.scaling_factor).astype(z.dtype)

    def denormalize_latents(self, z: jax.Array) -> jax.Array:
        """Inverse of `normalize_latents`: z / scaling_factor + shift_factor."""
        shift = self.config.shift_factor or 0.0
        return (z / self.config.scaling_factor + shift).astype(z.dtype)

    # -- encode / decode -----------------------------------------------------------------------------------------------

    def _tilings(self, tile_size: int | None) -> tuple[Tiling, Tiling]:
        """(encode, decode) tilings for square tiles of `tile_size` pixels overlapping by 25%, as diffusers."""
        sample = tile_size or self.config.sample_size
        latent = sample // self.config.spatial_compression
        encode = Tiling(tile=sample, stride=int(sample * 0.75), blend=int(latent * 0.25), keep=latent - int(latent * 0.25))
        decode = Tiling(tile=latent, stride=int(latent * 0.75), blend=int(sample * 0.25), keep=sample - int(sample * 0.25))
        return encode, decode

    def encode_moments(self, images: jax.Array, *, tiled: bool = False, tile_size: int | None = None):
        """images (batch, h, w, 3) in [-1, 1], h and w multiples of 8 -> posterior (mean, logvar), each
        (batch, h / 8, w / 8, latent_channels); logvar clipped to [-30, 20]."""
        check_images(images, self.config.in_channels, self.config.spatial_compression)
        images = jnp.asarray(images, self.dtype)
        r = self.config.spatial_compression
        fn = functools.partial(_encode_fn, self)
        if tiled:
            moments = tiled_apply(fn, images, self._tilings(tile_size)[0], (images.shape[1] // r, images.shape[2] // r))
        else:
            moments = fn(images)
        mean, logvar = jnp.split(moments, 2, axis=-1)
        return mean, jnp.clip(logvar, -30.0, 20.0)

    def encode(self, images: jax.Array, **tiling) -> jax.Array:
        """images (batch, h, w, 3) in [-1, 1] -> latent mean (batch, h / 8, w / 8, latent_channels), not normalised."""
        return self.encode_moments(images, **tiling)[0]

    def decode(self, latents: jax.Array, *, tiled: bool = False, tile_size: int | None = None) -> jax.Array:
        """latents (batch, h, w, latent_channels), not normalised -> images (batch, 8h, 8w, 3), nominally [-1, 1]."""
        check_latents(latents, self.config.latent_channels)
        latents = jnp.asarray(latents, self.dtype)
        r = self.config.spatial_compression
        fn = functools.partial(_decode_fn, self)
        if tiled:
            return tiled_apply(fn, latents, self._tilings(tile_size)[1], (latents.shape[1] * r, latents.shape[2] * r))
        return fn(latents)

    # -- loading -------------------------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls, path: str | Path, dtype: jnp.dtype = jnp.bfloat16, *, config: FluxVAEConfig | str | Path | None = None
    ) -> "FluxVAE":
        """Load from a diffusers `vae/` folder, or a single `.safetensors` file with diffusers key names or the
        original layout of FLUX's `ae.safetensors`. A single file without `config` gets FLUX.1's configuration with
        the channel counts read from the weights."""
        path = Path(path)
        if isinstance(config, (str, Path)):
            config = FluxVAEConfig.from_json(config)
        if path.is_dir() and config is None:
            config = FluxVAEConfig.from_json(path / "config.json")
        config, keys = cls.key_map(open_checkpoint(path, "diffusion_pytorch_model"), config, str(path))
        return load_state(lambda: cls(config, dtype=dtype, rngs=nnx.Rngs(0)), keys, source=str(path))

    @staticmethod
    def key_map(checkpoint: Checkpoint, config: FluxVAEConfig | None = None,
                source: str = "checkpoint") -> tuple[FluxVAEConfig, KeyMap]:
        """How `checkpoint` (diffusers' key names or `ae.safetensors`' LDM ones) maps onto the module, and its config:
        `config`, or FLUX.1's with the channel counts read from the weights."""
        original = any(k.startswith(("encoder.down.", "decoder.up.")) for k in checkpoint.keys())
        if config is None:
            config = _config_from_shapes(checkpoint, original, source)
        n = len(config.block_out_channels)
        rename = (lambda k: original_key_to_diffusers(k, n)) if original else (lambda k: k)
        return config, KeyMap(checkpoint, rename=rename, convert=_attention_conv_to_linear)


@stored_jit  # the module as a pytree: less host time a call than nnx.jit's graph traversal
def _encode_fn(vae: FluxVAE, images: jax.Array) -> jax.Array:
    h = vae.encoder(images)
    return vae.quant_conv(h) if vae.quant_conv is not None else h


@stored_jit
def _decode_fn(vae: FluxVAE, latents: jax.Array) -> jax.Array:
    if vae.post_quant_conv is not None:
        latents = vae.post_quant_conv(latents)
    return vae.decoder(latents)


# --------------------------------------------------------------------------------------------------------------------
# Checkpoint layouts


def _attention_conv_to_linear(key: str, shape: tuple[int, ...]):
    # The original layout stores the mid-block attention projections as 1x1 convolutions.
    if ".attentions." in key and key.endswith(".weight") and len(shape) == 4:
        return shape[:2], lambda array: array[:, :, 0, 0]
    return None


def original_key_to_diffusers(key: str, num_blocks: int = 4) -> str:
    """Map a key of FLUX's `ae.safetensors` (the LDM layout) to diffusers' `AutoencoderKL` name. The original numbers
    decoder levels from the lowest resolution up, diffusers from the first block applied."""
    key = key.replace("nin_shortcut", "conv_shortcut")
    if m := re.match(r"(encoder|decoder)\.norm_out\.(.*)", key):
        return f"{m[1]}.conv_norm_out.{m[2]}"
    if m := re.match(r"encoder\.down\.(\d+)\.block\.(\d+)\.(.*)", key):
        return f"encoder.down_blocks.{m[1]}.resnets.{m[2]}.{m[3]}"
    if m := re.match(r"encoder\.down\.(\d+)\.downsample\.(.*)", key):
        return f"encoder.down_blocks.{m[1]}.downsamplers.0.{m[2]}"
    if m := re.match(r"decoder\.up\.(\d+)\.block\.(\d+)\.(.*)", key):
        return f"decoder.up_blocks.{num_blocks - 1 - int(m[1])}.resnets.{m[2]}.{m[3]}"
    if m := re.match(r"decoder\.up\.(\d+)\.upsample\.(.*)", key):
        return f"decoder.up_blocks.{num_blocks - 1 - int(m[1])}.upsamplers.0.{m[2]}"
    if m := re.match(r"(encoder|decoder)\.mid\.block_(\d)\.(.*)", key):
        return f"{m[1]}.mid_block.resnets.{int(m[2]) - 1}.{m[3]}"
    if m := re.match(r"(encoder|decoder)\.mid\.attn_1\.(norm|q|k|v|proj_out)\.(.*)", key):
        name = {"norm": "group_norm", "q": "to_q", "k": "to_k", "v": "to_v", "proj_out": "to_out.0"}[m[2]]
        return f"{m[1]}.mid_block.attentions.0.{name}.{m[3]}"
    return key


def _config_from_shapes(checkpoint: Checkpoint, original: bool, path: str) -> FluxVAEConfig:
    """FLUX.1's configuration with channel counts and depth read from the weights."""
    keys = {original_key_to_diffusers(k) if original else k: k for k in checkpoint.keys()}
    if "encoder.conv_in.weight" not in keys:
        raise CheckpointError(f"{path}: not an AutoencoderKL / FLUX VAE checkpoint (no encoder.conv_in.weight)")
    levels = sorted({int(k.split(".")[2]) for k in keys if k.startswith("encoder.down_blocks.")})
    channels = tuple(checkpoint.shape(keys[f"encoder.down_blocks.{i}.resnets.0.conv1.weight"])[0] for i in levels)
    layers = len({k.split(".")[4] for k in keys if k.startswith("encoder.down_blocks.0.resnets.")})
    try:
        return FluxVAEConfig(
            block_out_channels=channels,
            down_block_types=("DownEncoderBlock2D",) * len(channels),
            up_block_types=("UpDecoderBlock2D",) * len(channels),
            layers_per_block=layers,
            latent_channels=checkpoint.shape(keys["decoder.conv_in.weight"])[1],
            use_quant_conv="quant_conv.weight" in keys,
            use_post_quant_conv="post_quant_conv.weight" in keys,
        )
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}; pass config= (a FluxVAEConfig or a config.json path)") from None
