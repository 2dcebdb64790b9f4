"""Layers shared by every model in `model/`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class Linear(nnx.Module):
    """`y = x @ weight.T + bias`, with `weight` of shape `(out_features, in_features)`.

    The weight keeps PyTorch's layout (unlike `nnx.Linear`'s `(in, out)` kernel) so that checkpoint tensors stream in
    without a transpose, and so that the reduction axis is the last, contiguous one: the axis along which the
    block-scaled formats of `quant/` group their 32 or 128 elements.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nnx.Param(
            jax.random.normal(rngs.params(), (out_features, in_features), dtype) * in_features**-0.5
        )
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: (..., in_features) -> (..., out_features)."""
        y = jax.lax.dot_general(x, self.weight[...], (((x.ndim - 1,), (1,)), ((), ())))
        if self.bias is not None:
            y = y + self.bias[...]
        return y
