"""LoRA adapters on the `Linear` layers of a model: the adapter, and finding the layers and the adapters on them.

An adapter on the layer `W` (out, in) adds `scale * B @ A @ dropout(x)` to its output, with `A` (rank, in) and `B`
(out, rank), `scale = alpha / rank`, as PEFT does. It lives in the layer's `lora` attribute, so its matrices sit at
`<module path>.lora.A` / `.B` beside the untouched `<module path>.weight`: the module path is diffusers' module name
(`transformer_blocks.3.attn.to_q`).

`A` and `B` are `nnx.LoRAParam`s in float32 (the master weights); the forward casts them to the input's dtype, so a
bf16 model computes in bf16. Adapters come from a LoRA file (`lora_files.apply_loras`) or are trained
(`training/lora.py`: `add_lora`, merging, saving).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from flax import nnx

from .layers import Linear
from .loading import module_key


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """rank and alpha (scale = alpha / rank), dropout on the adapter's input while training, and the layers adapted:
    regular expressions matched in full against each Linear's module path (`transformer_blocks.3.attn.to_q`); empty
    (the default): the model family's attention and MLP projections (`training.lora.target_preset(model,
    "attention+mlp")`)."""

    rank: int = 32
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ()

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        for pattern in self.targets:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"LoRA target {pattern!r} is not a regular expression ({e})") from None

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class LoRA(nnx.Module):
    """The adapter of one Linear: `y + scale * (dropout(x) @ A.T) @ B.T`, A (rank, in) and B (out, rank) float32.

    `dropout_key` is set (to a fresh key each step) only on the copy of the model a training step traces; with it
    None, as in the model you hold, there is no dropout. `merged`: the update is in the layer's weight (see
    `training.lora.merge_lora`), so the adapter adds nothing.
    """

    def __init__(self, in_features: int, out_features: int, config: LoraConfig, key: jax.Array):
        # PEFT's "gaussian" init (diffusers' Krea 2 trainer): A ~ N(0, 1/rank^2), B = 0, so training starts at the base.
        self.A = nnx.LoRAParam(jax.random.normal(key, (config.rank, in_features), jnp.float32) / config.rank)
        self.B = nnx.LoRAParam(jnp.zeros((out_features, config.rank), jnp.float32))
        self.scale = config.scale
        self.dropout = config.dropout
        self.dropout_key = nnx.data(None)
        self.merged = False

    @classmethod
    def from_matrices(cls, A: jax.Array, B: jax.Array, scale: float) -> "LoRA":
        """An adapter with given matrices (a LoRA read from a file): A (rank, in), B (out, rank), float32."""
        rank = A.shape[0]
        lora = cls(A.shape[1], B.shape[0], LoraConfig(rank=rank, alpha=scale * rank), jax.random.key(0))
        lora.A.set_value(jnp.asarray(A, jnp.float32))
        lora.B.set_value(jnp.asarray(B, jnp.float32))
        return lora

    def delta(self) -> jax.Array:
        """The update of the layer's weight, `scale * B @ A` (out, in), float32."""
        return self.scale * jnp.dot(self.B[...], self.A[...], precision=jax.lax.Precision.HIGHEST)

    def __call__(self, x: jax.Array, y: jax.Array) -> jax.Array:
        """x: (..., in), the layer's input; y: (..., out), its output without the adapter."""
        if self.merged:
            return y
        if self.dropout_key is not None and self.dropout > 0:
            keep = jax.random.bernoulli(self.dropout_key, 1.0 - self.dropout, x.shape)
            x = jnp.where(keep, x / (1.0 - self.dropout), 0).astype(x.dtype)
        dims = (((x.ndim - 1,), (1,)), ((), ()))
        h = jax.lax.dot_general(x, self.A[...].astype(x.dtype), dims)
        h = jax.lax.dot_general(h, self.B[...].astype(x.dtype), dims)
        return y + (self.scale * h).astype(y.dtype)


def linear_layers(model: nnx.Module) -> Iterator[tuple[str, Linear]]:
    """(module path, layer) for every Linear of `model`, in graph order."""
    for path, node in nnx.iter_graph(model):
        if isinstance(node, Linear):
            yield module_key(path), node


def adapters(model: nnx.Module) -> Iterator[tuple[str, LoRA]]:
    """(module path of the adapted Linear, adapter), in graph order."""
    for name, layer in linear_layers(model):
        if layer.lora is not None:
            yield name, layer.lora


def remove_lora(model: nnx.Module) -> None:
    """Detach every adapter (a merged update stays in the weights: unmerge first to drop it)."""
    for _, layer in linear_layers(model):
        layer.lora = nnx.data(None)
