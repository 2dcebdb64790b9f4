"""The building blocks every model in `model/` shares: the linear layer, the convolution, rotary tables, timestep
sinusoids and their MLP, torch's RMSNorm and LayerNorm, diffusers' SwiGLU feed-forward, nearest upsampling,
rematerialization of a block and named sharding constraints. Which kernel computes a product or an attention is
`ops/`'s choice."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.core.spmd import get_logical_axis_rules

from mxdit.ops.linear import FP8Activations, linear, stacked_weight
from mxdit.quant.formats import quantize


def remat_call(block: nnx.Module, policy, *args, implementation):
    """`block(*args, implementation)`, as one `jax.checkpoint` unit when `policy` (a `jax.checkpoint_policies`
    policy) is given: its backward pass recomputes what the policy does not save (training). The block's state goes
    in as an argument and the block is rebuilt inside, so the checkpointed function is pure; `implementation` (an
    attention kernel name or function) stays outside the traced arguments."""
    if policy is None:
        return block(*args, implementation)
    graphdef, state = nnx.split(block)

    def run(state, *args):
        return nnx.merge(graphdef, state)(*args, implementation)

    return jax.checkpoint(run, policy=policy)(state, *args)


def shard_activation(x: jax.Array, *axes: str | None) -> jax.Array:
    """A named sharding constraint: `axes` names each dimension of x logically ("batch", "sequence") or None.

    sharding/ maps the names to mesh axes (`nnx.logical_axis_rules`) and sets the mesh (`jax.set_mesh`) while it
    traces a multi-device step; without both this returns x unchanged, and a name without a rule leaves its
    dimension to XLA. The constraints pin the layout where XLA's propagation could otherwise pick a costly one.
    """
    rules = dict(get_logical_axis_rules())
    if not rules or jax.sharding.get_abstract_mesh().empty:
        return x
    spec = jax.sharding.PartitionSpec
    return jax.lax.with_sharding_constraint(x, spec(*(rules.get(a, spec.UNCONSTRAINED) if a else None for a in axes)))


class Linear(nnx.Module):
    """`y = x @ weight.T + bias`, with `weight` of shape `(out_features, in_features)`.

    The weight keeps PyTorch's layout (unlike `nnx.Linear`'s `(in, out)` kernel) so that checkpoint tensors stream in
    without a transpose, and so that the reduction axis is the last, contiguous one: the axis along which the
    block-scaled formats of `quant/` group their 32 or 128 elements. The product is `ops.linear.linear`'s: the GEMM
    kernels for a low-precision weight (`quant.model.quantize_linear_layers`), XLA's otherwise.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nnx.Param(
            jax.random.normal(rngs.params(), (out_features, in_features), dtype) * in_features**-0.5
        )
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None
        # A quant format name: the input is quantized and dequantized per token (or block) before the product, which
        # simulates weight+activation quantization (`quant.model.quantize_activations`). None: the input as it is.
        self.activation_format = None
        # A low-rank adapter (model/lora.py's LoRA) called as `lora(x, y)` after the product: it adds its update
        # to y. None: a plain linear layer. Data, not static: its matrices are state of the model.
        self.lora = nnx.data(None)

    def __call__(self, x: jax.Array | FP8Activations) -> jax.Array:
        """x: (..., in_features) -> (..., out_features)."""
        return self._product(x)

    def activated(self, x: jax.Array | FP8Activations, activation: str) -> jax.Array:
        """`activation(self(x))` ("gelu_tanh" or "silu"); with a kernel weight (and no adapter) in the GEMM's
        epilogue."""
        return self._product(x, activation=activation)

    def swiglu(self, x: jax.Array | FP8Activations) -> jax.Array:
        """`silu(gate) * up` (..., out_features / 2) in the GEMM's epilogue, for a Linear whose weight is a
        `gemm.swiglu_weight` (`stacked_linear(..., swiglu=True)` makes one from SwiGLU's gate and up)."""
        return self._product(x, activation="swiglu")

    def gated_residual(self, x: jax.Array | FP8Activations, residual: jax.Array, gate: jax.Array) -> jax.Array:
        """`residual + gate * self(x)`, the DiT's gated residual: x (batch, seq, in), residual (batch, seq, out), gate
        (batch, 1, out); with a kernel weight and one image in the batch, in the GEMM's epilogue."""
        return self._product(x, residual=residual, gate=gate)

    def _product(self, x, **epilogue) -> jax.Array:
        if self.activation_format is not None:
            x = quantize(x, self.activation_format, axis=-1).dequantize(x.dtype)
        bias = None if self.bias is None else self.bias[...]
        return linear(x, self.weight.get_value(), bias, adapter=self.lora, **epilogue)


def stacked_linear(layers: list[Linear], sources: tuple[str, ...], *, swiglu: bool = False) -> Linear | None:
    """One Linear computing `layers` (same input, no adapter, all with a bias or none) side by side: their outputs
    concatenated (`ops.linear.stacked_weight`). None when the layers cannot be stacked (an adapter, biases on some
    only, different weight formats). `sources`: the layers' names relative to the module that will hold the stacked
    one (its `stacked_from` keeps them with their widths, so that `quant.model.quantize_linear_layers` can still
    apply the checkpoint's rules). `swiglu`: the layers are SwiGLU's gate and up, called through `Linear.swiglu`
    when their weights pair for the GEMM's SwiGLU epilogue."""
    if any(layer.lora is not None or layer.activation_format for layer in layers):
        return None
    if len({layer.bias is None for layer in layers}) > 1:
        return None
    biases = [layer.bias[...] for layer in layers] if layers[0].bias is not None else None
    parameters = stacked_weight([layer.weight.get_value() for layer in layers], biases, swiglu=swiglu)
    if parameters is None:
        return None
    weight, bias = parameters
    stacked = Linear(1, 1, bias=bias is not None, dtype=jnp.float32, rngs=nnx.Rngs(0))  # given the stacked weight
    stacked.in_features, stacked.out_features = layers[0].in_features, sum(layer.out_features for layer in layers)
    stacked.weight = nnx.Param(weight)
    stacked.stacked_from = tuple((name, layer.out_features) for name, layer in zip(sources, layers, strict=True))
    if bias is not None:
        stacked.bias = nnx.Param(bias)
    return stacked


class Conv2d(nnx.Module):
    """2-D convolution on channels-last images (batch, height, width, channels), with PyTorch's weight layout
    `(out_channels, in_channels, kh, kw)` so checkpoints stream in unchanged.

    `padding` is an int (same on every side) or `((top, bottom), (left, right))`.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, *, stride: int = 1,
                 padding: int | tuple[tuple[int, int], tuple[int, int]] = 0, dtype: jnp.dtype, rngs: nnx.Rngs):
        fan_in = in_channels * kernel_size * kernel_size
        self.weight = nnx.Param(
            jax.random.normal(rngs.params(), (out_channels, in_channels, kernel_size, kernel_size), dtype) * fan_in**-0.5
        )
        self.bias = nnx.Param(jnp.zeros((out_channels,), dtype))
        self.stride = stride
        self.padding = ((padding, padding), (padding, padding)) if isinstance(padding, int) else padding

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jax.lax.conv_general_dilated(
            x, self.weight[...], (self.stride, self.stride), self.padding, dimension_numbers=("NHWC", "OIHW", "NHWC")
        )
        return y + self.bias[...]


def upsample_nearest_2x(x: jax.Array) -> jax.Array:
    """(batch, h, w, c) -> (batch, 2h, 2w, c), each pixel repeated 2x2 (nearest and nearest-exact agree at 2x)."""
    return jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)


def rotary_tables(position_ids: jax.Array, axes_dims: tuple[int, ...], theta: float) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables for 3-axis rotary embedding, each of shape `position_ids.shape[:-1] + (head_dim,)`.

    Axis i of the position (t, h, w) rotates `axes_dims[i]` channels; each frequency is repeated for the two channels
    of its (real, imaginary) pair, as in FLUX's `repeat_interleave_real` convention. `ops.attention.apply_rotary`
    rotates q and k by them.
    """
    cos, sin = [], []
    for i, dim in enumerate(axes_dims):
        # Frequencies are static: computed in float64 on the host, like diffusers, then rounded to float32.
        freqs = jnp.asarray(1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim), jnp.float32)
        angles = position_ids[..., i : i + 1].astype(jnp.float32) * freqs
        cos.append(jnp.repeat(jnp.cos(angles), 2, axis=-1))
        sin.append(jnp.repeat(jnp.sin(angles), 2, axis=-1))
    return jnp.concatenate(cos, axis=-1), jnp.concatenate(sin, axis=-1)


def timestep_sinusoids(t: jax.Array, dim: int = 256, max_period: float = 10000.0) -> jax.Array:
    """diffusers' `Timesteps(dim, flip_sin_to_cos=True, downscale_freq_shift=0)`: [cos, sin] of t * freqs, float32."""
    half = dim // 2
    freqs = jnp.exp(-math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / half)
    args = t.astype(jnp.float32)[:, None] * freqs[None]
    return jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)


class NoParams(nnx.Module):
    """Stands where diffusers keeps a parameterless module (a Dropout) in a list, so indices match its keys."""

    def __call__(self, x):
        return x


class RMSNorm(nnx.Module):
    """Normalise in float32, cast back, then scale by the weight in `dtype`: the order of operations of transformers'
    Qwen3 norm and of `torch.nn.RMSNorm`."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * y.astype(x.dtype)


class MLPEmbedder(nnx.Module):
    """linear_1 -> SiLU -> linear_2 (diffusers' TimestepEmbedding and PixArtAlphaTextProjection with act silu), to
    `out_dim` features (default `dim`)."""

    def __init__(self, in_dim: int, dim: int, out_dim: int | None = None, *, dtype, rngs):
        self.linear_1 = Linear(in_dim, dim, bias=True, dtype=dtype, rngs=rngs)
        self.linear_2 = Linear(dim, out_dim or dim, bias=True, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.linear_2(jax.nn.silu(self.linear_1(x)))


class SwiGLU(nnx.Module):
    """diffusers' SwiGLU: one projection to [hidden | gate], then `hidden * silu(gate)`."""

    def __init__(self, dim: int, inner: int, *, bias: bool, dtype, rngs: nnx.Rngs):
        self.proj = Linear(dim, 2 * inner, bias=bias, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        hidden, gate = jnp.split(self.proj(x), 2, axis=-1)
        return hidden * jax.nn.silu(gate)


class FeedForward(nnx.Module):
    """diffusers' `FeedForward(activation_fn="swiglu")`: `net.0` the SwiGLU, `net.1` its dropout, `net.2` the output
    projection."""

    def __init__(self, dim: int, inner: int, *, bias: bool, dtype, rngs: nnx.Rngs):
        self.net = nnx.List([SwiGLU(dim, inner, bias=bias, dtype=dtype, rngs=rngs), NoParams(),
                             Linear(inner, dim, bias=bias, dtype=dtype, rngs=rngs)])

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.net[2](self.net[0](x))


class LayerNorm(nnx.Module):
    """`torch.nn.LayerNorm` over the last axis, with weight and bias, computed in float32 and cast back."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, -1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), -1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)
