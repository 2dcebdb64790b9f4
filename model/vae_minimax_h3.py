"""The MiniMax H3 video VAE in Flax NNX, equal in function to diffusers' `AutoencoderKLMiniMaxH3` (0.42.1): a causal
3-D CNN encoder and a non-causal ViT decoder.

Read top to bottom: the causal convolution, the per-frame group norm, the residual block, the downsampler, the
encoder; then the decoder's rotary embedding, attention, feed-forward, transformer block and the decoder; then the VAE
with its pixel and latent conventions, its temporal chunking, spatial tiling and loading. Attribute names follow
diffusers', so a parameter's path in the module is its key in a diffusers checkpoint.

Arrays are channels-last: videos (batch, frames, height, width, 3) in [-1, 1], latents (batch, latent_frames,
height / 16, width / 16, 24) for the release. Inside, the network works on ImageNet-normalised RGB, the VAE's own pixel
space (`to_vae_pixels`, `from_vae_pixels`).

Frames map to latents clip by clip: the encoder sees `clip_length` (17) frames at a time, which its two stride-2
causal convolutions turn into 5 latent frames, and the last `token_drop` (3) latent frames of the whole encoded video
are dropped; so `17 n + 5` frames encode to `5 n + 2` latent frames and decode back to `17 n + 5` frames. A single
frame (an image) is encoded alone into one latent frame.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mxdit.ops.attention import attention, attention_implementation
from mxdit.ops.names import AttentionKernel

from .layers import FeedForward, Linear, NoParams, RMSNorm
from .loading import KeyMap, config_from_dict, folder_config, load_state, open_checkpoint, read_json
from .programs import stored_jit
from .vae_common import PerChannelLatents

# The pixel convention of the VAE (the pipeline's `pixel_mean` / `pixel_std`): ImageNet statistics over [0, 1] RGB.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# torch.nn.functional.pad's modes as jnp.pad names them
_PAD_MODES = {"reflect": "reflect", "replicate": "edge", "circular": "wrap", "constant": "constant",
              "zeros": "constant"}


@dataclasses.dataclass(frozen=True)
class MiniMaxH3VAEConfig:
    """`AutoencoderKLMiniMaxH3`'s config.json (diffusers names); defaults are diffusers' (the released structure)."""

    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = 24
    block_out_channels: tuple[int, ...] = (128, 256, 256, 512, 512, 1024)
    layers_per_block: int = 2
    spatial_downsample_factors: tuple[int, ...] = (2, 2, 2, 2, 1, 1)
    temporal_downsample_factors: tuple[int, ...] = (1, 2, 2, 1, 1, 1)
    norm_num_groups: int = 32
    norm_eps: float = 1e-6
    spatial_padding_mode: str = "reflect"
    decoder_num_layers: int = 36
    decoder_num_attention_heads: int = 32
    decoder_attention_head_dim: int = 64
    decoder_num_register_tokens: int = 4
    decoder_ffn_mult: int = 4
    decoder_rope_theta: float = 100.0
    decoder_rope_dim_ratio: float = 0.75
    decoder_norm_eps: float = 1e-5
    clip_length: int = 17
    token_drop: int = 3
    latents_mean: tuple[float, ...] = (0.0,) * 24
    latents_std: tuple[float, ...] = (1.0,) * 24

    def __post_init__(self):
        levels = len(self.block_out_channels)
        if len(self.spatial_downsample_factors) != levels or len(self.temporal_downsample_factors) != levels:
            raise ValueError(f"spatial_downsample_factors and temporal_downsample_factors need {levels} entries, one "
                             "per block_out_channels")
        if len(self.latents_mean) != self.latent_channels or len(self.latents_std) != self.latent_channels:
            raise ValueError(f"latents_mean and latents_std need latent_channels={self.latent_channels} entries")
        if self.spatial_padding_mode not in _PAD_MODES:
            raise ValueError(f"spatial_padding_mode must be one of {sorted(_PAD_MODES)}, "
                             f"got {self.spatial_padding_mode!r}")
        if self.rope_dim % 6:
            raise ValueError(f"the rotated channels int(decoder_attention_head_dim * decoder_rope_dim_ratio) = "
                             f"{self.rope_dim} must be divisible by 6 (2 halves x 3 axes)")

    @property
    def spatial_compression(self) -> int:
        return math.prod(self.spatial_downsample_factors)

    @property
    def temporal_compression(self) -> int:
        return math.prod(self.temporal_downsample_factors)

    @property
    def rope_dim(self) -> int:
        """How many of each decoder head's channels the rotary embedding rotates."""
        return int(self.decoder_attention_head_dim * self.decoder_rope_dim_ratio)

    # The temporal chunking's geometry (diffusers derives it in the VAE's __init__). `clip_length` is not a multiple of
    # the temporal ratio, so a decoded clip starts with `frame_pre_padding` frames that no input frame gave, and the
    # `token_drop` dropped latents leave consecutive decoded clips overlapping by `frame_overlap` frames.

    @property
    def tokens_chunk_size(self) -> int:
        """Latent frames a `clip_length`-frame clip encodes to."""
        return math.ceil(self.clip_length / self.temporal_compression)

    @property
    def frame_pre_padding(self) -> int:
        return (-self.clip_length) % self.temporal_compression

    @property
    def token_overlap(self) -> int:
        return (-self.token_drop) % self.tokens_chunk_size

    @property
    def frame_overlap(self) -> int:
        return max(self.token_overlap * self.temporal_compression - self.frame_pre_padding, 0)

    @classmethod
    def from_json(cls, path: str | Path) -> "MiniMaxH3VAEConfig":
        return config_from_dict(cls, read_json(Path(path)), str(path))


# --------------------------------------------------------------------------------------------------------------------
# The encoder


class CausalConv3d(nnx.Module):
    """3-D convolution on channels-last video (batch, frames, height, width, channels), with PyTorch's weight layout
    `(out_channels, in_channels, kt, kh, kw)`. Spatial padding is symmetric in `padding_mode` (reflect in the
    release); temporal padding is causal: `temporal_padding` zero frames before the first, none after the last."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, *,
                 stride: tuple[int, int, int] = (1, 1, 1), spatial_padding: int = 0, temporal_padding: int = 0,
                 padding_mode: str = "reflect", dtype, rngs: nnx.Rngs):
        fan_in = in_channels * kernel_size**3
        shape = (out_channels, in_channels, kernel_size, kernel_size, kernel_size)
        self.weight = nnx.Param(jax.random.normal(rngs.params(), shape, dtype) * fan_in**-0.5)
        self.bias = nnx.Param(jnp.zeros((out_channels,), dtype))
        self.stride = tuple(stride)
        self.spatial_padding, self.temporal_padding = spatial_padding, temporal_padding
        self.padding_mode = _PAD_MODES[padding_mode]

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.spatial_padding:
            p = self.spatial_padding
            x = jnp.pad(x, ((0, 0), (0, 0), (p, p), (p, p), (0, 0)), mode=self.padding_mode)
        if self.temporal_padding:
            x = jnp.pad(x, ((0, 0), (self.temporal_padding, 0), (0, 0), (0, 0), (0, 0)))
        y = jax.lax.conv_general_dilated(x, self.weight[...], self.stride, "VALID",
                                         dimension_numbers=("NDHWC", "OIDHW", "NDHWC"))
        return y + self.bias[...]


class GroupNorm(nnx.Module):
    """torch.nn.GroupNorm applied to each frame on its own (statistics never mix frames), in float32."""

    def __init__(self, groups: int, channels: int, eps: float):
        self.groups, self.eps = groups, eps
        self.weight = nnx.Param(jnp.ones((channels,), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((channels,), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: (batch, frames, height, width, channels)."""
        shape = x.shape
        x32 = x.astype(jnp.float32).reshape(*shape[:2], -1, self.groups, shape[-1] // self.groups)
        mean = jnp.mean(x32, axis=(2, 4), keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=(2, 4), keepdims=True)
        y = ((x32 - mean) * jax.lax.rsqrt(var + self.eps)).reshape(shape)
        return (y * self.weight[...] + self.bias[...]).astype(x.dtype)


class ResnetBlock3d(nnx.Module):
    def __init__(self, in_channels: int, out_channels: int, cfg: MiniMaxH3VAEConfig, *, dtype, rngs: nnx.Rngs):
        conv = dict(spatial_padding=1, temporal_padding=2, padding_mode=cfg.spatial_padding_mode, dtype=dtype,
                    rngs=rngs)
        self.norm1 = GroupNorm(cfg.norm_num_groups, in_channels, cfg.norm_eps)
        self.conv1 = CausalConv3d(in_channels, out_channels, 3, **conv)
        self.norm2 = GroupNorm(cfg.norm_num_groups, out_channels, cfg.norm_eps)
        self.conv2 = CausalConv3d(out_channels, out_channels, 3, **conv)
        self.conv_shortcut = (CausalConv3d(in_channels, out_channels, 1, dtype=dtype, rngs=rngs)
                              if in_channels != out_channels else None)

    def __call__(self, x: jax.Array) -> jax.Array:
        residual = x if self.conv_shortcut is None else self.conv_shortcut(x)
        x = self.conv1(jax.nn.silu(self.norm1(x)))
        x = self.conv2(jax.nn.silu(self.norm2(x)))
        return residual + x


class Downsample3d(nnx.Module):
    """Strided 3x3x3 causal convolution. A spatial stride of 2 is preceded by a one-pixel bottom/right pad (in the
    padding mode), so the output is exactly half the (even) input size."""

    def __init__(self, channels: int, temporal_stride: int, spatial_stride: int, cfg: MiniMaxH3VAEConfig, *, dtype,
                 rngs: nnx.Rngs):
        self.spatial_stride = spatial_stride
        self.padding_mode = _PAD_MODES[cfg.spatial_padding_mode]
        self.conv = CausalConv3d(channels, channels, 3, stride=(temporal_stride, spatial_stride, spatial_stride),
                                 temporal_padding=2, padding_mode=cfg.spatial_padding_mode, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.spatial_stride == 2:
            x = jnp.pad(x, ((0, 0), (0, 0), (0, 1), (0, 1), (0, 0)), mode=self.padding_mode)
        return self.conv(x)


class DownBlock3d(nnx.Module):
    def __init__(self, in_channels: int, out_channels: int, temporal_factor: int, spatial_factor: int,
                 cfg: MiniMaxH3VAEConfig, *, dtype, rngs: nnx.Rngs):
        self.resnets = nnx.List([ResnetBlock3d(in_channels if i == 0 else out_channels, out_channels, cfg, dtype=dtype,
                                               rngs=rngs) for i in range(cfg.layers_per_block)])
        downsample = temporal_factor * spatial_factor > 1
        self.downsamplers = nnx.List([Downsample3d(out_channels, temporal_factor, spatial_factor, cfg, dtype=dtype,
                                                   rngs=rngs)]) if downsample else None

    def __call__(self, x: jax.Array) -> jax.Array:
        for resnet in self.resnets:
            x = resnet(x)
        return x if self.downsamplers is None else self.downsamplers[0](x)


class Encoder3d(nnx.Module):
    """Causal 3-D CNN: pixels (batch, frames, h, w, in_channels) -> moments (batch, latent_frames, h / s, w / s,
    2 * latent_channels), s the spatial compression; frames go to `(frames - 1) // t + 1` for each temporal stride t."""

    def __init__(self, cfg: MiniMaxH3VAEConfig, *, dtype, rngs: nnx.Rngs):
        channels = cfg.block_out_channels
        conv = dict(spatial_padding=1, temporal_padding=2, padding_mode=cfg.spatial_padding_mode, dtype=dtype,
                    rngs=rngs)
        self.conv_in = CausalConv3d(cfg.in_channels, channels[0], 3, **conv)
        block_in = (channels[0], *channels[:-1])
        self.down_blocks = nnx.List([
            DownBlock3d(block_in[i], channels[i], cfg.temporal_downsample_factors[i], cfg.spatial_downsample_factors[i],
                        cfg, dtype=dtype, rngs=rngs)
            for i in range(len(channels))
        ])
        self.norm_out = GroupNorm(cfg.norm_num_groups, channels[-1], cfg.norm_eps)
        self.conv_out = CausalConv3d(channels[-1], 2 * cfg.latent_channels, 3, **conv)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        return self.conv_out(jax.nn.silu(self.norm_out(x)))


# --------------------------------------------------------------------------------------------------------------------
# The ViT decoder


def rotary_tables(frames: int, height: int, width: int, extra: int, rope_dim: int,
                  theta: float) -> tuple[jax.Array, jax.Array]:
    """cos and sin, each (frames * height * width + extra, rope_dim) float32, for the decoder's tokens in (t, h, w)
    order followed by `extra` tokens at position 0. Each axis's coordinate is normalised to [-1, 1) (pixel centres)
    and scaled by 2 pi; the three axes' angles side by side, the whole repeated for the two halves that
    `apply_rotary` pairs (rotate-half)."""
    inv_freq = jnp.asarray(1.0 / theta ** (np.arange(rope_dim // 6, dtype=np.float32) * np.float32(6 / rope_dim)))
    grids = [2.0 * (jnp.arange(0.5, size, dtype=jnp.float32) / size) - 1.0 for size in (frames, height, width)]
    positions = jnp.stack(jnp.meshgrid(*grids, indexing="ij"), axis=-1).reshape(-1, 3)
    positions = jnp.concatenate([positions, jnp.zeros((extra, 3), jnp.float32)])
    angles = (2.0 * math.pi * positions)[:, :, None] * inv_freq  # diffusers' order of the products, for equal rounding
    angles = jnp.tile(angles.reshape(positions.shape[0], -1), 2)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the leading `cos.shape[-1]` channels of each head of x (batch, seq, heads, head_dim), channel i paired
    with channel i + half of them; the others pass through. In x's dtype, as diffusers does."""
    rotated = cos.shape[-1]
    head, rest = x[..., :rotated], x[..., rotated:]
    first, second = jnp.split(head, 2, axis=-1)
    cos, sin = cos[:, None, :].astype(x.dtype), sin[:, None, :].astype(x.dtype)  # broadcast over heads
    return jnp.concatenate([head * cos + jnp.concatenate([-second, first], axis=-1) * sin, rest], axis=-1)


def rms_norm(x: jax.Array, eps: float) -> jax.Array:
    """torch.nn.RMSNorm without a weight, in float32, cast back."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


class Attention(nnx.Module):
    """Full self-attention: q, k, v projections with biases, per-head q/k RMSNorm (no weight) in float32, rotary
    embedding on the first `rope_dim` channels of every head, the output projection."""

    def __init__(self, dim: int, heads: int, head_dim: int, eps: float, *, dtype, rngs: nnx.Rngs):
        self.heads, self.head_dim, self.eps = heads, head_dim, eps
        inner = heads * head_dim
        self.to_q = Linear(dim, inner, bias=True, dtype=dtype, rngs=rngs)
        self.to_k = Linear(dim, inner, bias=True, dtype=dtype, rngs=rngs)
        self.to_v = Linear(dim, inner, bias=True, dtype=dtype, rngs=rngs)
        self.to_out = nnx.List([Linear(inner, dim, bias=True, dtype=dtype, rngs=rngs), NoParams()])

    def __call__(self, x: jax.Array, rotary: tuple[jax.Array, jax.Array], implementation: AttentionKernel) -> jax.Array:
        """x: (batch, seq, dim) -> (batch, seq, dim)."""
        batch, seq, _ = x.shape
        q, k, v = (layer(x).reshape(batch, seq, self.heads, self.head_dim)
                   for layer in (self.to_q, self.to_k, self.to_v))
        q, k = rms_norm(q, self.eps), rms_norm(k, self.eps)
        q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        out = attention(q, k, v, None, implementation)  # every token attends to every token
        return self.to_out[0](out.reshape(batch, seq, -1))


class TransformerBlock(nnx.Module):
    """Pre-norm attention and SwiGLU, each added back scaled per channel by a learned `scale1` / `scale2`. The norms,
    the scales and so the residual stream are float32 whatever `dtype` the projections have."""

    def __init__(self, cfg: MiniMaxH3VAEConfig, *, dtype, rngs: nnx.Rngs):
        dim = cfg.decoder_num_attention_heads * cfg.decoder_attention_head_dim
        eps = cfg.decoder_norm_eps
        self.dtype = dtype
        self.norm1 = RMSNorm(dim, eps, dtype=jnp.float32)
        self.attn = Attention(dim, cfg.decoder_num_attention_heads, cfg.decoder_attention_head_dim, eps, dtype=dtype,
                              rngs=rngs)
        self.scale1 = nnx.Param(jnp.zeros((dim,), jnp.float32))
        self.norm2 = RMSNorm(dim, eps, dtype=jnp.float32)
        self.ff = FeedForward(dim, dim * cfg.decoder_ffn_mult, bias=True, dtype=dtype, rngs=rngs)
        self.scale2 = nnx.Param(jnp.zeros((dim,), jnp.float32))

    def __call__(self, x: jax.Array, rotary: tuple[jax.Array, jax.Array], implementation: AttentionKernel) -> jax.Array:
        x = x + self.attn(self.norm1(x.astype(jnp.float32)).astype(self.dtype), rotary,
                          implementation) * self.scale1[...]
        return x + self.ff(self.norm2(x.astype(jnp.float32)).astype(self.dtype)) * self.scale2[...]


class LayerNorm(nnx.Module):
    """torch.nn.LayerNorm with weight and bias, in float32."""

    def __init__(self, dim: int, eps: float):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((dim,), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        return (x32 - mean) * jax.lax.rsqrt(var + self.eps) * self.weight[...] + self.bias[...]


class ViTDecoder3d(nnx.Module):
    """Non-causal ViT decoder. Every latent voxel becomes one token; `num_register_tokens` learned register tokens
    and one all-zero token are appended (all at rotary position 0), the blocks attend over all of them, and the extra
    tokens are dropped before `proj_out` expands each voxel into a (t, s, s) block of pixels, s and t the VAE's
    spatial and temporal compression."""

    def __init__(self, cfg: MiniMaxH3VAEConfig, *, dtype, rngs: nnx.Rngs):
        dim = cfg.decoder_num_attention_heads * cfg.decoder_attention_head_dim
        self.cfg = cfg
        self.patch_size, self.patch_size_t = cfg.spatial_compression, cfg.temporal_compression
        patch = cfg.out_channels * self.patch_size_t * self.patch_size**2
        self.proj_in = Linear(cfg.latent_channels, dim, bias=True, dtype=dtype, rngs=rngs)
        self.register_tokens = nnx.Param(jnp.zeros((1, cfg.decoder_num_register_tokens, dim), dtype))
        self.transformer_blocks = nnx.List([TransformerBlock(cfg, dtype=dtype, rngs=rngs)
                                            for _ in range(cfg.decoder_num_layers)])
        self.norm_out = LayerNorm(dim, cfg.decoder_norm_eps)
        self.proj_out = Linear(dim, patch, bias=True, dtype=dtype, rngs=rngs)

    def __call__(self, z: jax.Array, implementation: AttentionKernel) -> jax.Array:
        """z: (batch, frames, h, w, latent_channels) -> (batch, frames * t, h * s, w * s, out_channels)."""
        cfg = self.cfg
        batch, frames, height, width, channels = z.shape
        x = self.proj_in(z.reshape(batch, frames * height * width, channels))
        patches = x.shape[1]
        registers = jnp.broadcast_to(self.register_tokens[...], (batch, *self.register_tokens.shape[1:]))
        x = jnp.concatenate([x, registers.astype(x.dtype), jnp.zeros_like(x[:, :1])], axis=1)
        rotary = rotary_tables(frames, height, width, cfg.decoder_num_register_tokens + 1, cfg.rope_dim,
                               cfg.decoder_rope_theta)
        for block in self.transformer_blocks:
            x = block(x, rotary, implementation)
        x = self.proj_out(self.norm_out(x).astype(self.proj_out.weight.dtype))[:, :patches]
        p, pt = self.patch_size, self.patch_size_t
        x = x.reshape(batch, frames, height, width, cfg.out_channels, pt, p, p)
        x = x.transpose(0, 1, 5, 2, 6, 3, 7, 4)  # (batch, frames, pt, height, p, width, p, channels)
        return x.reshape(batch, frames * pt, height * p, width * p, cfg.out_channels)


# --------------------------------------------------------------------------------------------------------------------
# The VAE


@dataclasses.dataclass(frozen=True)
class SpatialTiling:
    """diffusers' tile geometry, in pixels: square tiles of `tile_size`, neighbours overlapping by at least
    `min_overlap` (widened in whole latents so the tiles cover the frame exactly), overlaps cross-faded linearly.
    The release was run with the defaults, so its frames are the tiled ones."""

    tile_size: int = 256
    min_overlap: int = 64


class MiniMaxH3VideoVAE(PerChannelLatents, nnx.Module):
    """Encode videos to latents and decode them back.

    `encode` returns the posterior mean (`encode_moments` also its log-variance, for sampling as the pipeline does),
    `decode` the video; both go clip by clip along time (see the module docstring) and, by default, tile by tile in
    space as the release does (`tiling=None` turns that off). `normalize_latents` and `denormalize_latents` convert
    between the VAE's latents and the normalised ones the transformer sees.

    The encoder, the quant conv, the decoder's norms and its block scales are float32 (the checkpoint is float32 and
    diffusers pins these); `dtype` is the decoder's projections' (float32 by default).
    """

    def __init__(self, config: MiniMaxH3VAEConfig, *, dtype: jnp.dtype = jnp.float32,
                 attention: AttentionKernel | str | None = None, rngs: nnx.Rngs):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.attention = attention_implementation(attention, self.dtype)
        latent = config.latent_channels
        self.encoder = Encoder3d(config, dtype=jnp.float32, rngs=rngs)
        self.quant_conv = CausalConv3d(2 * latent, 2 * latent, 1, dtype=jnp.float32, rngs=rngs)
        self.post_quant_conv = CausalConv3d(latent, latent, 1, dtype=dtype, rngs=rngs)
        self.decoder = ViTDecoder3d(config, dtype=dtype, rngs=rngs)

    # -- pixel and latent conventions ----------------------------------------------------------------------------------

    @staticmethod
    def to_vae_pixels(video: jax.Array) -> jax.Array:
        """Video in [-1, 1] -> the ImageNet-normalised RGB the network takes, float32."""
        mean, std = jnp.asarray(IMAGENET_MEAN), jnp.asarray(IMAGENET_STD)
        return ((jnp.asarray(video, jnp.float32) + 1.0) * 0.5 - mean) / std

    @staticmethod
    def from_vae_pixels(pixels: jax.Array) -> jax.Array:
        """Inverse of `to_vae_pixels` (unclamped), float32."""
        mean, std = jnp.asarray(IMAGENET_MEAN), jnp.asarray(IMAGENET_STD)
        return (pixels.astype(jnp.float32) * std + mean) * 2.0 - 1.0

    # -- encode --------------------------------------------------------------------------------------------------------

    def encode_moments(self, video: jax.Array, *,
                       tiling: SpatialTiling | None = SpatialTiling()) -> tuple[jax.Array, jax.Array]:
        """video (batch, frames, height, width, 3) in [-1, 1], height and width multiples of the spatial compression
        (16) -> posterior (mean, logvar), each (batch, latent_frames, height / 16, width / 16, latent_channels),
        float32; logvar clipped to [-30, 20] as diffusers does. One frame gives one latent frame; longer videos
        are padded to whole clips by repeating the last frame (`17 n + 5` frames give `5 n + 2` latent frames)."""
        cfg = self.config
        shape = tuple(np.shape(video))
        if len(shape) != 5 or shape[-1] != cfg.in_channels:
            raise ValueError(f"video must have shape (batch, frames, height, width, {cfg.in_channels}) (channels "
                             f"last, in [-1, 1]), got {shape}")
        r = cfg.spatial_compression
        if shape[1] < 1 or shape[2] % r or shape[3] % r:
            raise ValueError(f"video needs at least one frame and a height and width that are multiples of {r}, got "
                             f"{shape[1]} frames of {shape[2]}x{shape[3]}")
        pixels = self.to_vae_pixels(video)
        frames, clip = shape[1], cfg.clip_length
        if frames == 1:  # an image has no temporal extent to chunk: the encoder alone, one latent frame
            moments = self._encode_clip(pixels, tiling)
        else:
            if frames % clip:
                pad = jnp.repeat(pixels[:, -1:], (-frames) % clip, axis=1)
                pixels = jnp.concatenate([pixels, pad], axis=1)
            moments = jnp.concatenate([self._encode_clip(pixels[:, i : i + clip], tiling)
                                       for i in range(0, pixels.shape[1], clip)], axis=1)
            if cfg.token_drop:
                moments = moments[:, : -cfg.token_drop]
        mean, logvar = jnp.split(moments, 2, axis=-1)
        return mean, jnp.clip(logvar, -30.0, 20.0)

    def encode(self, video: jax.Array, *, tiling: SpatialTiling | None = SpatialTiling()) -> jax.Array:
        """video (batch, frames, height, width, 3) in [-1, 1] -> latent mean (batch, latent_frames, height / 16,
        width / 16, latent_channels), float32, not normalised. See `encode_moments`."""
        return self.encode_moments(video, tiling=tiling)[0]

    def _encode_clip(self, pixels: jax.Array, tiling: SpatialTiling | None) -> jax.Array:
        height, width = pixels.shape[2:4]
        if tiling is None or (tiling.tile_size >= height and tiling.tile_size >= width):
            return _encode_fn(self, pixels)
        r = self.config.spatial_compression
        ys, y_overlaps = _split_tiles(height, tiling, r)
        xs, x_overlaps = _split_tiles(width, tiling, r)
        size = tiling.tile_size
        tiles = [[_encode_fn(self, pixels[:, :, y : y + size, x : x + size]) for x in xs] for y in ys]
        return _stitch_tiles(tiles, [o // r for o in y_overlaps], [o // r for o in x_overlaps])

    # -- decode --------------------------------------------------------------------------------------------------------

    def decode(self, latents: jax.Array, *, tiling: SpatialTiling | None = SpatialTiling(),
               clamp: bool = True) -> jax.Array:
        """latents (batch, latent_frames, h, w, latent_channels), not normalised -> video (batch, frames, 16 h, 16 w,
        3) in [-1, 1] (clamped unless `clamp=False`), float32. `5 n + 2` latent frames give `17 n + 5` frames; other
        counts are padded by repeating the last latent frame and the frames that gives are cut off again, as
        diffusers does."""
        cfg = self.config
        shape = tuple(np.shape(latents))
        if len(shape) != 5 or shape[-1] != cfg.latent_channels:
            raise ValueError(f"latents must have shape (batch, latent_frames, height, width, {cfg.latent_channels}) "
                             f"(channels last), got {shape}")
        chunk, drop, ratio = cfg.tokens_chunk_size, cfg.token_drop, cfg.temporal_compression
        num_tokens = shape[1] + drop
        pad_tokens = (-num_tokens) % chunk
        num_chunks = (num_tokens + pad_tokens) // chunk - int(drop > 0)
        if num_chunks < 1:
            raise ValueError(f"latents has {shape[1]} latent frames; decoding needs at least {chunk - drop + 1} "
                             f"(5 n + 2 latent frames decode to 17 n + 5 frames in the release)")
        z = jnp.asarray(latents, self.dtype)
        if pad_tokens:
            z = jnp.concatenate([z, jnp.repeat(z[:, -1:], pad_tokens, axis=1)], axis=1)

        # Each clip's decode covers its own frames and, past them, the frames the next clip starts with (the
        # latents token_drop removed from every encoded clip but the last): those overlap and are cross-faded.
        clip_frames, pre = chunk * ratio, cfg.frame_pre_padding
        decoded, overlap = [], None
        for i in range(num_chunks):
            clip = self._decode_clip(z[:, i * chunk : i * chunk + chunk + cfg.token_overlap], tiling)
            for j in range(int(drop > 0) + 1):
                part = clip[:, j * clip_frames : (j + 1) * clip_frames][:, pre:]
                if j == 0:
                    if overlap is not None:
                        part = _blend(overlap, part, cfg.frame_overlap, axis=1)
                    decoded.append(part)
                else:
                    overlap = part
        if overlap is not None:
            decoded.append(overlap)
        video = jnp.concatenate(decoded, axis=1)

        # The repeated latents decoded to trailing frames nobody asked for. A clip's last latent frame covers only
        # `clip_length % ratio` frames, the others `ratio`.
        if pad_tokens:
            tail = cfg.clip_length % ratio
            pad_frames = sum(tail if tail and (shape[1] + k) % chunk == 0 else ratio for k in range(pad_tokens))
            video = video[:, :-pad_frames]
        video = self.from_vae_pixels(video)  # in float32; the cross-fades above ran in `dtype`, as diffusers'
        return jnp.clip(video, -1.0, 1.0) if clamp else video

    def _decode_clip(self, z: jax.Array, tiling: SpatialTiling | None) -> jax.Array:
        r = self.config.spatial_compression
        height, width = z.shape[2] * r, z.shape[3] * r
        if tiling is None or (tiling.tile_size >= height and tiling.tile_size >= width):
            return _decode_fn(self, z)
        ys, y_overlaps = _split_tiles(height, tiling, r)
        xs, x_overlaps = _split_tiles(width, tiling, r)
        size = tiling.tile_size // r
        tiles = [[_decode_fn(self, z[:, :, y // r : y // r + size, x // r : x // r + size]) for x in xs] for y in ys]
        return _stitch_tiles(tiles, y_overlaps, x_overlaps)

    # -- loading -------------------------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: jnp.dtype = jnp.float32, *,
                        config: MiniMaxH3VAEConfig | str | Path | None = None,
                        attention: AttentionKernel | str | None = None) -> "MiniMaxH3VideoVAE":
        """Load a diffusers `vae/` folder (config.json and diffusion_pytorch_model.safetensors), or a single
        `.safetensors` file with diffusers key names and `config`."""
        path = Path(path)
        config = folder_config(MiniMaxH3VAEConfig, path, config)
        keys = KeyMap(open_checkpoint(path, "diffusion_pytorch_model"))
        return load_state(lambda: cls(config, dtype=dtype, attention=attention, rngs=nnx.Rngs(0)), keys,
                          source=str(path))


@stored_jit  # the module as a pytree: less host time a call than nnx.jit's graph traversal
def _encode_fn(vae: MiniMaxH3VideoVAE, pixels: jax.Array) -> jax.Array:
    return vae.quant_conv(vae.encoder(pixels))


@stored_jit
def _decode_fn(vae: MiniMaxH3VideoVAE, latents: jax.Array) -> jax.Array:
    return vae.decoder(vae.post_quant_conv(latents), vae.attention)


# --------------------------------------------------------------------------------------------------------------------
# Spatial tiling, diffusers' algorithm


def _split_tiles(length: int, tiling: SpatialTiling, ratio: int) -> tuple[list[int], list[int]]:
    """Tile starts over `length` pixels and the overlaps between neighbours: the fewest tiles that cover `length`
    with every overlap at least `min_overlap`, the slack spread round-robin over the overlaps in whole latents."""
    size, min_overlap = tiling.tile_size, tiling.min_overlap
    if size >= length:
        return [0], []
    count = math.ceil(length / size)
    while size * count - min_overlap * (count - 1) - length < 0:
        count += 1
    overlaps = [min_overlap] * (count - 1)
    for i in range((size * count - sum(overlaps) - length) // ratio):
        overlaps[i % (count - 1)] += ratio
    starts = [0]
    for overlap in overlaps:
        starts.append(starts[-1] + size - overlap)
    return starts, overlaps


def _blend(previous: jax.Array, current: jax.Array, extent: int, axis: int) -> jax.Array:
    """Cross-fade the first `extent` entries of `current` along `axis` with the last ones of `previous`: weight
    k / extent on `current` at offset k."""
    extent = min(previous.shape[axis], current.shape[axis], extent)
    if extent == 0:
        return current
    shape = [1] * current.ndim
    shape[axis] = extent
    weight = (jnp.arange(extent, dtype=current.dtype) / extent).reshape(shape)
    tail = jax.lax.slice_in_dim(previous, previous.shape[axis] - extent, previous.shape[axis], axis=axis)
    head = jax.lax.slice_in_dim(current, 0, extent, axis=axis)
    blended = tail * (1 - weight) + head * weight
    return jax.lax.dynamic_update_slice_in_dim(current, blended, 0, axis=axis)


def _stitch_tiles(tiles: list[list[jax.Array]], y_overlaps: list[int], x_overlaps: list[int]) -> jax.Array:
    """Blend each tile (batch, frames, h, w, c) with its upper and left neighbours as computed (not as blended:
    diffusers' order), drop the overlap each tile shares with its lower and right neighbours, and join them."""
    rows = []
    for i, row in enumerate(tiles):
        kept = []
        for j, tile in enumerate(row):
            if i > 0:
                tile = _blend(tiles[i - 1][j], tile, y_overlaps[i - 1], axis=2)
            if j > 0:
                tile = _blend(row[j - 1], tile, x_overlaps[j - 1], axis=3)
            if i < len(tiles) - 1:
                tile = tile[:, :, : tile.shape[2] - y_overlaps[i]]
            if j < len(row) - 1:
                tile = tile[:, :, :, : tile.shape[3] - x_overlaps[j]]
            kept.append(tile)
        rows.append(jnp.concatenate(kept, axis=3))
    return jnp.concatenate(rows, axis=2)
