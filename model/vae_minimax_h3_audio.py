"""The MiniMax H3 audio VAE in Flax NNX, equal in function to diffusers' `AutoencoderKLMiniMaxH3Audio` (0.42.1).

Waveform in, waveform out, mono at 32 kHz: a DAC-style strided convolutional encoder with Snake activations
(hop `prod(encoder_rates)` = 800 samples a latent), a causal-attention block (`pre_block`) that narrows the encoder's
2048 channels to the 32 latent channels, the posterior heads `mean_proj` / `logs_proj`, and a BigVGAN decoder
(transposed-convolution upsamplers, anti-aliased SnakeBeta activations, AMP residual blocks) after `dec_in_proj`.
MiniMax H3 carries stereo as two batch items, and takes the posterior mean of reference audio, never a sample.

Read top to bottom: convolutions, activations and the anti-aliased resampling, the encoder, the attention projection,
the decoder, then the VAE with its latent normalisation and loading. Attribute names follow diffusers', so a
parameter's path in the module is its key in a diffusers checkpoint, except that weight-normed convolutions hold the
`weight` that diffusers recomputes from `weight_g` / `weight_v` at every call: it is computed once, at load time.

Arrays are channels-last: waveforms (batch, samples) in [-1, 1], latents (batch, frames, latent_channels), the
layout of the transformer's audio rows. The release keeps the whole VAE in float32 (diffusers' `_keep_in_fp32_modules`:
bfloat16 decodes are audibly worse), so float32 is the default dtype here.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .layers import LayerNorm, Linear
from .loading import (Checkpoint, CheckpointError, DerivedCheckpoint, KeyMap, config_from_dict, folder_config,
                      load_state, open_checkpoint, read_json)
from .programs import stored_jit
from .vae_common import PerChannelLatents


@dataclasses.dataclass(frozen=True)
class MiniMaxH3AudioVAEConfig:
    """The audio VAE's config.json (diffusers names); defaults are diffusers' (the released model's structure).

    `latents_mean` / `latents_std` (one value a latent channel) normalise latents for the transformer; the released
    config.json holds them, diffusers' defaults leave them unset."""

    encoder_dim: int = 64
    encoder_rates: tuple[int, ...] = (2, 4, 4, 5, 5)
    latent_dim: int = 2048
    latent_channels: int = 32
    num_attention_heads: int = 8
    decoder_dim: int = 1024
    decoder_rates: tuple[int, ...] = (5, 5, 2, 2, 2, 2, 2)
    decoder_kernel_sizes: tuple[int, ...] = (9, 9, 4, 4, 4, 4, 4)
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    sampling_rate: int = 32000
    latents_mean: tuple[float, ...] | None = None
    latents_std: tuple[float, ...] | None = None

    def __post_init__(self):
        # config.json holds lists, nested ones too: tuples keep the config hashable (a static part of jitted calls)
        for name in ("encoder_rates", "decoder_rates", "decoder_kernel_sizes", "resblock_kernel_sizes"):
            object.__setattr__(self, name, tuple(int(v) for v in getattr(self, name)))
        object.__setattr__(self, "resblock_dilation_sizes",
                           tuple(tuple(int(d) for d in ds) for ds in self.resblock_dilation_sizes))
        for name in ("latents_mean", "latents_std"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, tuple(float(v) for v in getattr(self, name)))
                if len(getattr(self, name)) != self.latent_channels:
                    raise ValueError(f"{name} has {len(getattr(self, name))} entries, latent_channels is "
                                     f"{self.latent_channels}")
        if math.prod(self.decoder_rates) != self.hop_length:
            raise ValueError(f"decoder_rates {self.decoder_rates} upsample by {math.prod(self.decoder_rates)}, not by "
                             f"the encoder's hop {self.hop_length} (prod(encoder_rates))")
        if len(self.decoder_kernel_sizes) != len(self.decoder_rates):
            raise ValueError("decoder_kernel_sizes needs one kernel size per entry of decoder_rates")
        if len(self.resblock_dilation_sizes) != len(self.resblock_kernel_sizes):
            raise ValueError("resblock_dilation_sizes needs one tuple of dilations per entry of resblock_kernel_sizes")
        if self.latent_dim % self.latent_channels or self.latent_dim % self.num_attention_heads:
            raise ValueError(f"latent_dim ({self.latent_dim}) must be a multiple of latent_channels "
                             f"({self.latent_channels}) and of num_attention_heads ({self.num_attention_heads})")

    @property
    def hop_length(self) -> int:
        """Waveform samples a latent frame."""
        return math.prod(self.encoder_rates)

    @classmethod
    def from_json(cls, path: str | Path) -> "MiniMaxH3AudioVAEConfig":
        return config_from_dict(cls, read_json(Path(path)), str(path))


# --------------------------------------------------------------------------------------------------------------------
# Convolutions, norms, activations


class Conv1d(nnx.Module):
    """1-D convolution on channels-last input (batch, length, channels), with PyTorch's weight layout
    `(out_channels, in_channels, kernel_size)` and zero padding on both ends."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, *, stride: int = 1, dilation: int = 1,
                 padding: int = 0, bias: bool = True, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (out_channels, in_channels, kernel_size), dtype)
                                * (in_channels * kernel_size) ** -0.5)
        self.bias = nnx.Param(jnp.zeros((out_channels,), dtype)) if bias else None
        self.stride, self.dilation, self.padding = stride, dilation, padding

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jax.lax.conv_general_dilated(x, self.weight[...], (self.stride,), [(self.padding, self.padding)],
                                         rhs_dilation=(self.dilation,), dimension_numbers=("NWC", "OIW", "NWC"))
        return y if self.bias is None else y + self.bias[...]


class ConvTranspose1d(nnx.Module):
    """PyTorch's `ConvTranspose1d` on channels-last input, with its weight layout `(in_channels, out_channels,
    kernel_size)`: (batch, length, in) -> (batch, (length - 1) * stride - 2 * padding + kernel_size, out)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int, padding: int, *, dtype,
                 rngs: nnx.Rngs):
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (in_channels, out_channels, kernel_size), dtype)
                                * (in_channels * kernel_size) ** -0.5)
        self.bias = nnx.Param(jnp.zeros((out_channels,), dtype))
        self.kernel_size, self.stride, self.padding = kernel_size, stride, padding

    def __call__(self, x: jax.Array) -> jax.Array:
        # A transposed convolution is the plain one of the flipped kernel over the input dilated by the stride.
        edge = self.kernel_size - 1 - self.padding
        y = jax.lax.conv_general_dilated(x, jnp.flip(self.weight[...], -1), (1,), [(edge, edge)],
                                         lhs_dilation=(self.stride,), dimension_numbers=("NWC", "IOW", "NWC"))
        return y + self.bias[...]


class Snake1d(nnx.Module):
    """The encoder's activation, `x + sin(alpha * x)^2 / (alpha + 1e-9)`, with alpha stored as diffusers does,
    (1, channels, 1)."""

    def __init__(self, channels: int, *, dtype):
        self.alpha = nnx.Param(jnp.ones((1, channels, 1), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        alpha = self.alpha[...].reshape(-1)
        return x + jnp.reciprocal(alpha + 1e-9) * jnp.square(jnp.sin(alpha * x))


class SnakeBeta(nnx.Module):
    """The decoder's activation, `x + sin(exp(alpha) * x)^2 / (exp(beta) + 1e-9)`: frequency and magnitude per
    channel, both stored in log space."""

    def __init__(self, channels: int, *, dtype):
        self.alpha = nnx.Param(jnp.zeros((channels,), dtype))
        self.beta = nnx.Param(jnp.zeros((channels,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        alpha, beta = jnp.exp(self.alpha[...]), jnp.exp(self.beta[...])
        return x + jnp.reciprocal(beta + 1e-9) * jnp.square(jnp.sin(alpha * x))


def kaiser_sinc_filter(cutoff: float, half_width: float, kernel_size: int) -> tuple[float, ...]:
    """The Kaiser-windowed sinc low-pass filter of `alias-free-torch` (and diffusers' `kaiser_sinc_filter1d`),
    `kernel_size` taps summing to 1, computed in float64 and rounded to float32.

    Checkpoints store it as a `filter` buffer in every resampler; being a function of the config, it is computed here
    instead of loaded (the tests compare the two)."""
    half_size = kernel_size // 2
    attenuation = 2.285 * (half_size - 1) * math.pi * (4 * half_width) + 7.95
    if attenuation > 50.0:
        beta = 0.1102 * (attenuation - 8.7)
    elif attenuation >= 21.0:
        beta = 0.5842 * (attenuation - 21) ** 0.4 + 0.07886 * (attenuation - 21.0)
    else:
        beta = 0.0
    window = np.kaiser(kernel_size, beta)
    time = np.arange(-half_size, half_size) + 0.5 if kernel_size % 2 == 0 else np.arange(kernel_size) - half_size
    taps = 2 * cutoff * window * np.sinc(2 * cutoff * time)
    return tuple(float(t) for t in (taps / taps.sum()).astype(np.float32))


def _depthwise(x: jax.Array, taps: tuple[float, ...], *, stride: int = 1, dilate: int = 1,
               padding: tuple[int, int] = (0, 0)) -> jax.Array:
    """Every channel of x (batch, length, channels) correlated with the same filter `taps`; `dilate` spreads the
    input (stride - 1 zeros between samples) for a transposed convolution."""
    channels = x.shape[-1]
    kernel = jnp.broadcast_to(jnp.asarray(taps, x.dtype), (channels, 1, len(taps)))
    return jax.lax.conv_general_dilated(x, kernel, (stride,), [padding], lhs_dilation=(dilate,),
                                        dimension_numbers=("NWC", "OIW", "NWC"), feature_group_count=channels)


def _replicate_pad(x: jax.Array, left: int, right: int) -> jax.Array:
    return jnp.pad(x, ((0, 0), (left, right), (0, 0)), mode="edge")


class UpSample1d(nnx.Module):
    """Anti-aliased `ratio`x upsampling: edge-replicated input, a transposed depthwise Kaiser-sinc convolution times
    `ratio`, cropped to `ratio * length`."""

    def __init__(self, ratio: int = 2, kernel_size: int = 12):
        self.ratio = ratio
        self.pad = kernel_size // ratio - 1
        self.crop_left = self.pad * ratio + (kernel_size - ratio) // 2
        self.crop_right = self.pad * ratio + (kernel_size - ratio + 1) // 2
        self.taps = kaiser_sinc_filter(0.5 / ratio, 0.6 / ratio, kernel_size)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = _replicate_pad(x, self.pad, self.pad)
        # transposed: the flipped filter over the input spread by the ratio, padded to the full output
        edge = len(self.taps) - 1
        y = self.ratio * _depthwise(x, self.taps[::-1], dilate=self.ratio, padding=(edge, edge))
        return y[:, self.crop_left : y.shape[1] - self.crop_right]


class LowPassFilter1d(nnx.Module):
    """Depthwise Kaiser-sinc low-pass filter with a stride over edge-replicated input: the anti-aliased downsampler."""

    def __init__(self, cutoff: float, half_width: float, stride: int, kernel_size: int):
        self.pad_left = kernel_size // 2 - int(kernel_size % 2 == 0)
        self.pad_right = kernel_size // 2
        self.stride = stride
        self.taps = kaiser_sinc_filter(cutoff, half_width, kernel_size)

    def __call__(self, x: jax.Array) -> jax.Array:
        return _depthwise(_replicate_pad(x, self.pad_left, self.pad_right), self.taps, stride=self.stride)


class DownSample1d(nnx.Module):
    def __init__(self, ratio: int = 2, kernel_size: int = 12):
        self.lowpass = LowPassFilter1d(0.5 / ratio, 0.6 / ratio, ratio, kernel_size)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.lowpass(x)


class Activation1d(nnx.Module):
    """BigVGAN's alias-free activation: SnakeBeta at twice the sample rate (upsample, activate, downsample)."""

    def __init__(self, channels: int, *, dtype):
        self.act = SnakeBeta(channels, dtype=dtype)
        self.upsample = UpSample1d()
        self.downsample = DownSample1d()

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.downsample(self.act(self.upsample(x)))


# --------------------------------------------------------------------------------------------------------------------
# Encoder: waveform -> (batch, samples / hop, latent_dim)


class ResidualUnit(nnx.Module):
    """DAC's residual unit: Snake, dilated conv (k=7), Snake, conv (k=1), plus the input."""

    def __init__(self, dim: int, dilation: int, *, dtype, rngs: nnx.Rngs):
        self.block = nnx.List([
            Snake1d(dim, dtype=dtype),
            Conv1d(dim, dim, 7, dilation=dilation, padding=3 * dilation, dtype=dtype, rngs=rngs),
            Snake1d(dim, dtype=dtype),
            Conv1d(dim, dim, 1, dtype=dtype, rngs=rngs),
        ])

    def __call__(self, x: jax.Array) -> jax.Array:
        residual = x
        for layer in self.block:
            residual = layer(residual)
        return x + residual  # the padding keeps the length, so diffusers' centre crop of x never applies


class EncoderBlock(nnx.Module):
    """Residual units at dilations 1, 3, 9, then a strided convolution that doubles the channels to `dim`."""

    def __init__(self, dim: int, stride: int, *, dtype, rngs: nnx.Rngs):
        half = dim // 2
        self.block = nnx.List([
            *(ResidualUnit(half, d, dtype=dtype, rngs=rngs) for d in (1, 3, 9)),
            Snake1d(half, dtype=dtype),
            Conv1d(half, dim, 2 * stride, stride=stride, padding=math.ceil(stride / 2), dtype=dtype, rngs=rngs),
        ])

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.block:
            x = layer(x)
        return x


class Encoder(nnx.Module):
    """(batch, samples, 1) -> (batch, samples / hop, latent_dim), samples a multiple of the hop."""

    def __init__(self, cfg: MiniMaxH3AudioVAEConfig, *, dtype, rngs: nnx.Rngs):
        dim = cfg.encoder_dim
        layers: list[nnx.Module] = [Conv1d(1, dim, 7, padding=3, dtype=dtype, rngs=rngs)]
        for stride in cfg.encoder_rates:
            dim *= 2
            layers.append(EncoderBlock(dim, stride, dtype=dtype, rngs=rngs))
        layers += [Snake1d(dim, dtype=dtype), Conv1d(dim, cfg.latent_dim, 3, padding=1, dtype=dtype, rngs=rngs)]
        self.block = nnx.List(layers)

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.block:
            x = layer(x)
        return x


# --------------------------------------------------------------------------------------------------------------------
# The attention projection (`pre_block`): latent_dim -> latent_channels


def adaptive_avg_pool(x: jax.Array, size: int) -> jax.Array:
    """`torch.nn.functional.adaptive_avg_pool1d` over the last axis: (..., n) -> (..., size), output i the mean of
    inputs floor(i * n / size) to ceil((i + 1) * n / size); windows overlap when size does not divide n."""
    n = x.shape[-1]
    if n % size == 0:
        return jnp.mean(x.reshape(*x.shape[:-1], size, n // size), axis=-1)
    windows = [(i * n // size, -(-(i + 1) * n // size)) for i in range(size)]
    return jnp.stack([jnp.mean(x[..., a:b], axis=-1) for a, b in windows], axis=-1)


class CausalAttention(nnx.Module):
    """Causal self-attention that narrows the width from `in_dim` to `out_dim`: the heads' outputs are averaged
    (not concatenated), and the head dimension is average-pooled down to `out_dim` before the output projection.

    The key has no bias: diffusers' `zero_k_bias` is a zero buffer, not loaded."""

    def __init__(self, in_dim: int, out_dim: int, heads: int, *, dtype, rngs: nnx.Rngs):
        self.heads, self.out_dim = heads, out_dim
        self.qkv = Linear(in_dim, 3 * in_dim, bias=False, dtype=dtype, rngs=rngs)
        self.q_bias = nnx.Param(jnp.zeros((in_dim,), dtype))
        self.v_bias = nnx.Param(jnp.zeros((in_dim,), dtype))
        self.proj = Linear(out_dim, out_dim, bias=True, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x (batch, frames, in_dim) -> (batch, frames, out_dim)."""
        batch, frames, dim = x.shape
        qkv = self.qkv(x).reshape(batch, frames, 3, self.heads, dim // self.heads)
        q = qkv[:, :, 0] + self.q_bias[...].reshape(self.heads, -1)
        v = qkv[:, :, 2] + self.v_bias[...].reshape(self.heads, -1)
        out = jax.nn.dot_product_attention(q, qkv[:, :, 1], v, is_causal=True)
        return self.proj(adaptive_avg_pool(jnp.mean(out, axis=2), self.out_dim))


class GeGluMlp(nnx.Module):
    """Pre-norm GeGLU: `w2(gelu_tanh(w0(norm(x))) * w1(norm(x)))`."""

    def __init__(self, dim: int, hidden: int, *, dtype, rngs: nnx.Rngs):
        self.norm = LayerNorm(dim, 1e-5, dtype=dtype)
        self.w0 = Linear(dim, hidden, bias=True, dtype=dtype, rngs=rngs)
        self.w1 = Linear(dim, hidden, bias=True, dtype=dtype, rngs=rngs)
        self.w2 = Linear(hidden, dim, bias=True, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.norm(x)
        return self.w2(jax.nn.gelu(self.w0(x), approximate=True) * self.w1(x))


class AttnProjection(nnx.Module):
    """`pre_block`: a linear shortcut plus causal attention from `in_dim` to `out_dim` channels, then a residual
    GeGLU MLP."""

    def __init__(self, in_dim: int, out_dim: int, heads: int, mlp_ratio: int = 2, *, dtype, rngs: nnx.Rngs):
        self.norm1 = LayerNorm(in_dim, 1e-5, dtype=dtype)
        self.attn = CausalAttention(in_dim, out_dim, heads, dtype=dtype, rngs=rngs)
        self.proj = Linear(in_dim, out_dim, bias=True, dtype=dtype, rngs=rngs)
        self.norm3 = LayerNorm(in_dim, 1e-5, dtype=dtype)
        self.norm2 = LayerNorm(out_dim, 1e-5, dtype=dtype)
        self.mlp = GeGluMlp(out_dim, out_dim * mlp_ratio, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x (batch, frames, in_dim) -> (batch, frames, out_dim)."""
        x = self.proj(self.norm3(x)) + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


# --------------------------------------------------------------------------------------------------------------------
# Decoder (BigVGAN): (batch, frames, latent_dim) -> (batch, frames * hop, 1)


class AMPBlock(nnx.Module):
    """BigVGAN's anti-aliased multi-periodicity block: per dilation, activation -> dilated conv -> activation -> conv,
    added to the input."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...], *, dtype, rngs: nnx.Rngs):
        self.convs1 = nnx.List([
            Conv1d(channels, channels, kernel_size, dilation=d, padding=(kernel_size * d - d) // 2, dtype=dtype,
                   rngs=rngs)
            for d in dilations
        ])
        self.convs2 = nnx.List([
            Conv1d(channels, channels, kernel_size, padding=(kernel_size - 1) // 2, dtype=dtype, rngs=rngs)
            for _ in dilations
        ])
        self.activations = nnx.List([Activation1d(channels, dtype=dtype) for _ in range(2 * len(dilations))])

    def __call__(self, x: jax.Array) -> jax.Array:
        for i, (conv1, conv2) in enumerate(zip(self.convs1, self.convs2)):
            residual = conv1(self.activations[2 * i](x))
            x = conv2(self.activations[2 * i + 1](residual)) + x
        return x


class Decoder(nnx.Module):
    """BigVGAN: conv_pre, then per rate a transposed-convolution upsampler (halving the channels) and the mean of
    `len(resblock_kernel_sizes)` AMP blocks, then an alias-free activation, conv_post and a clamp to [-1, 1]."""

    def __init__(self, cfg: MiniMaxH3AudioVAEConfig, *, dtype, rngs: nnx.Rngs):
        base = cfg.decoder_dim
        self.conv_pre = Conv1d(cfg.latent_dim, base, 7, padding=3, dtype=dtype, rngs=rngs)
        # diffusers (and the original checkpoint) wrap each upsampler in a one-element list: `ups.<i>.0`
        self.ups = nnx.List([
            nnx.List([ConvTranspose1d(base // 2**i, base // 2 ** (i + 1), kernel, rate, (kernel - rate) // 2,
                                      dtype=dtype, rngs=rngs)])
            for i, (rate, kernel) in enumerate(zip(cfg.decoder_rates, cfg.decoder_kernel_sizes))
        ])
        channels = [base // 2 ** (i + 1) for i in range(len(cfg.decoder_rates))]
        self.resblocks = nnx.List([
            AMPBlock(c, kernel, dilations, dtype=dtype, rngs=rngs)
            for c in channels for kernel, dilations in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes)
        ])
        self.activation_post = Activation1d(channels[-1], dtype=dtype)
        self.conv_post = Conv1d(channels[-1], 1, 7, padding=3, bias=False, dtype=dtype, rngs=rngs)
        self.num_kernels = len(cfg.resblock_kernel_sizes)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.conv_pre(x)
        for i, up in enumerate(self.ups):
            x = up[0](x)
            blocks = self.resblocks[i * self.num_kernels : (i + 1) * self.num_kernels]
            total = blocks[0](x)
            for block in blocks[1:]:
                total = total + block(x)
            x = total / self.num_kernels
        x = self.conv_post(self.activation_post(x))
        return jnp.clip(x, -1.0, 1.0)


# --------------------------------------------------------------------------------------------------------------------
# The VAE


class MiniMaxH3AudioVAE(PerChannelLatents, nnx.Module):
    """Encode mono waveforms to audio latents and decode them back.

    `encode` returns the posterior mean (what MiniMax H3 conditions on), `encode_posterior` the mean and log standard
    deviation, `decode` waveforms clamped to [-1, 1]. `normalize_latents` / `denormalize_latents` convert between the
    VAE's latents and the normalised ones of the transformer's audio rows. Stereo goes as two batch items.
    """

    def __init__(self, config: MiniMaxH3AudioVAEConfig, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        z = config.latent_channels
        self.encoder = Encoder(config, dtype=dtype, rngs=rngs)
        self.pre_block = AttnProjection(config.latent_dim, z, config.num_attention_heads, dtype=dtype, rngs=rngs)
        self.mean_proj = Conv1d(z, z, 1, dtype=dtype, rngs=rngs)
        self.logs_proj = Conv1d(z, z, 1, dtype=dtype, rngs=rngs)
        self.dec_in_proj = Conv1d(z, config.latent_dim, 1, dtype=dtype, rngs=rngs)
        self.decoder = Decoder(config, dtype=dtype, rngs=rngs)

    # -- encode / decode -----------------------------------------------------------------------------------------------

    def encode_posterior(self, waveform: jax.Array) -> tuple[jax.Array, jax.Array]:
        """waveform (batch, samples) in [-1, 1] -> posterior (mean, log standard deviation), each (batch,
        ceil(samples / hop), latent_channels). The waveform is zero-padded on the right to a multiple of the hop."""
        if waveform.ndim != 2:
            raise ValueError(f"waveform must be (batch, samples) mono audio, got shape {tuple(waveform.shape)}")
        hop = self.config.hop_length
        waveform = jnp.asarray(waveform, self.dtype)
        waveform = jnp.pad(waveform, ((0, 0), (0, -waveform.shape[1] % hop)))
        return _encode_fn(self, waveform[..., None])

    def encode(self, waveform: jax.Array) -> jax.Array:
        """waveform (batch, samples) in [-1, 1] -> latent mean (batch, ceil(samples / hop), latent_channels), not
        normalised."""
        return self.encode_posterior(waveform)[0]

    def decode(self, latents: jax.Array) -> jax.Array:
        """latents (batch, frames, latent_channels), not normalised -> waveform (batch, frames * hop) in [-1, 1]."""
        if latents.ndim != 3 or latents.shape[-1] != self.config.latent_channels:
            raise ValueError(f"latents must be (batch, frames, latent_channels={self.config.latent_channels}), got "
                             f"shape {tuple(latents.shape)}")
        return _decode_fn(self, jnp.asarray(latents, self.dtype))

    # -- loading -------------------------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: jnp.dtype = jnp.float32, *,
                        config: MiniMaxH3AudioVAEConfig | str | Path | None = None) -> "MiniMaxH3AudioVAE":
        """Load from a diffusers `audio_vae/` folder (config.json and diffusion_pytorch_model.safetensors), or a
        single `.safetensors` file with diffusers' key names and `config` given."""
        path = Path(path)
        config = folder_config(MiniMaxH3AudioVAEConfig, path, config)
        keys = cls.key_map(open_checkpoint(path, "diffusion_pytorch_model"))
        return load_state(lambda: cls(config, dtype=dtype, rngs=nnx.Rngs(0)), keys, source=str(path))

    @staticmethod
    def key_map(checkpoint: Checkpoint) -> KeyMap:
        """diffusers' keys are ours, once weight norm is folded into each convolution's `weight`; the resamplers'
        `filter` buffers and the attention's `zero_k_bias` (both functions of the config) are not loaded."""
        return KeyMap(fold_weight_norm(checkpoint), ignore=lambda key: key.endswith((".filter", ".zero_k_bias")))


@stored_jit  # the module as a pytree: less host time a call than nnx.jit's graph traversal
def _encode_fn(vae: MiniMaxH3AudioVAE, waveform: jax.Array) -> tuple[jax.Array, jax.Array]:
    x = vae.pre_block(vae.encoder(waveform))
    return vae.mean_proj(x), vae.logs_proj(x)


@stored_jit
def _decode_fn(vae: MiniMaxH3AudioVAE, latents: jax.Array) -> jax.Array:
    return vae.decoder(vae.dec_in_proj(latents))[..., 0]


# --------------------------------------------------------------------------------------------------------------------
# Checkpoint layout

# (magnitude, direction) suffixes of a weight-normed layer's `weight`: `torch.nn.utils.weight_norm` (what diffusers
# and the release store), and `torch.nn.utils.parametrizations.weight_norm`
_WEIGHT_NORM = ((".weight_g", ".weight_v"),
                (".parametrizations.weight.original0", ".parametrizations.weight.original1"))


def fold_weight_norm(checkpoint: Checkpoint) -> Checkpoint:
    """`checkpoint` with each weight-normed layer's (g, v) pair read as one `weight = g * v / |v|`, the norm taken
    per output row (dim 0: the input channel of a transposed convolution), in float64 and rounded to float32."""
    keys = checkpoint.keys()
    present = set(keys)
    derived, consumed = {}, set()
    for key in keys:
        for g_suffix, v_suffix in _WEIGHT_NORM:
            if not key.endswith(v_suffix):
                continue
            layer = key[: -len(v_suffix)]
            g_key = layer + g_suffix
            if g_key not in present:
                raise CheckpointError(f"{checkpoint.files[0]}: {key!r} has no weight-norm magnitude {g_key!r}")
            derived[layer + ".weight"] = (key, _folder(checkpoint, g_key), checkpoint.shape(key))
            consumed |= {key, g_key}
    if not derived:
        return checkpoint
    return DerivedCheckpoint(checkpoint, derived, [k for k in keys if k not in consumed])


def _folder(checkpoint: Checkpoint, g_key: str):
    def fold(v: np.ndarray) -> np.ndarray:
        v = v.astype(np.float64)
        g = checkpoint.get(g_key).astype(np.float64).reshape(-1, *([1] * (v.ndim - 1)))
        norm = np.sqrt(np.sum(v * v, axis=tuple(range(1, v.ndim)), keepdims=True))
        return (g * v / norm).astype(np.float32)

    return fold
