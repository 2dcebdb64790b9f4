"""What the VAEs share: checks of their inputs, their latents' per-channel normalisation, and tiled encoding and
decoding so that large images go through a VAE in bounded memory.

The input is cut into overlapping square tiles, each tile goes through the network alone (one compiled program per
tile shape), and neighbouring outputs are cross-faded over `blend` rows and columns. This is diffusers' algorithm,
kept exactly (including the order in which blended tiles feed the next blend), so our tiled output equals theirs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np


class PerChannelLatents:
    """`normalize_latents` / `denormalize_latents` for a VAE whose config holds `latents_mean` and `latents_std`, one
    value a latent channel (the last axis): the one place where those statistics are applied."""

    def normalize_latents(self, z: jax.Array) -> jax.Array:
        """VAE latents -> the normalised latents the transformer is trained on: (z - mean) / std per channel."""
        mean, std = self._latent_statistics()
        return ((z - mean) / std).astype(z.dtype)

    def denormalize_latents(self, z: jax.Array) -> jax.Array:
        """Inverse of `normalize_latents`: z * std + mean per channel."""
        mean, std = self._latent_statistics()
        return (z * std + mean).astype(z.dtype)

    def _latent_statistics(self) -> tuple[jax.Array, jax.Array]:
        if self.config.latents_mean is None or self.config.latents_std is None:
            raise ValueError("the config has no latents_mean / latents_std to normalise latents with")
        return jnp.asarray(self.config.latents_mean), jnp.asarray(self.config.latents_std)


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Tile side and stride in input pixels (or latents); `blend` and `keep` in output units: how many rows/columns
    are cross-faded with the previous tile, and how many of each tile end up in the result."""

    tile: int
    stride: int
    blend: int
    keep: int
    batch: int = 8  # tiles of one shape that go through the network together (bounds memory, saves dispatches)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _blend(previous: jax.Array, current: jax.Array, extent: int, axis: int) -> jax.Array:
    """Cross-fade the first `extent` rows (axis 1) or columns (axis 2) of `current` with the last ones of
    `previous`: weight y / extent on the current tile at offset y."""
    extent = min(previous.shape[axis], current.shape[axis], extent)
    if extent == 0:
        return current
    weight = jnp.asarray(np.arange(extent) / extent, current.dtype)
    weight = weight[:, None, None] if axis == 1 else weight[:, None]
    tail = jax.lax.slice_in_dim(previous, previous.shape[axis] - extent, previous.shape[axis], axis=axis)
    head = jax.lax.slice_in_dim(current, 0, extent, axis=axis)
    blended = tail * (1 - weight) + head * weight
    return jax.lax.dynamic_update_slice_in_dim(current, blended, 0, axis=axis)


def tiled_apply(fn: Callable[[jax.Array], jax.Array], x: jax.Array, tiling: Tiling, out_size: tuple[int, int]) -> jax.Array:
    """Apply `fn` (channels-last, batch first, each sample independent) tile by tile over `x` and blend the results;
    crop to `out_size`. Tiles of one shape go through `fn` up to `tiling.batch` at a time, stacked on the batch axis."""
    height, width = x.shape[1], x.shape[2]
    starts = [(i, j) for i in range(0, height, tiling.stride) for j in range(0, width, tiling.stride)]
    inputs = {start: x[:, start[0] : start[0] + tiling.tile, start[1] : start[1] + tiling.tile] for start in starts}
    outputs = {}
    for shape in dict.fromkeys(t.shape for t in inputs.values()):  # edge tiles are smaller: one group per shape
        group = [start for start in starts if inputs[start].shape == shape]
        for k in range(0, len(group), tiling.batch):
            chunk = group[k : k + tiling.batch]
            out = fn(jnp.concatenate([inputs[start] for start in chunk]))
            for n, start in enumerate(chunk):
                outputs[start] = out[n * x.shape[0] : (n + 1) * x.shape[0]]
    rows = [[outputs[(i, j)] for j in range(0, width, tiling.stride)] for i in range(0, height, tiling.stride)]
    result_rows = []
    for i, row in enumerate(rows):
        kept = []
        for j in range(len(row)):
            tile = row[j]
            if i > 0:
                tile = _blend(rows[i - 1][j], tile, tiling.blend, axis=1)
            if j > 0:
                tile = _blend(row[j - 1], tile, tiling.blend, axis=2)
            row[j] = tile  # later blends read the already blended tile, as in diffusers
            kept.append(tile[:, : tiling.keep, : tiling.keep])
        result_rows.append(jnp.concatenate(kept, axis=2))
    return jnp.concatenate(result_rows, axis=1)[:, : out_size[0], : out_size[1]]


def check_images(images, channels: int, multiple: int) -> None:
    """Raise a ValueError saying what was expected unless `images` is (batch, h, w, channels) with h and w multiples
    of `multiple`."""
    shape = tuple(np.shape(images))
    if len(shape) != 4 or shape[-1] != channels:
        raise ValueError(f"expected images of shape (batch, height, width, {channels}) in [-1, 1], got {shape}")
    if shape[1] % multiple or shape[2] % multiple:
        raise ValueError(f"image height and width must be multiples of {multiple}, got {shape[1]}x{shape[2]}")


def check_latents(latents, channels: int) -> None:
    """Raise a ValueError saying what was expected unless `latents` is (batch, h, w, channels)."""
    shape = tuple(np.shape(latents))
    if len(shape) != 4 or shape[-1] != channels:
        raise ValueError(f"expected latents of shape (batch, height, width, {channels}) (channels last), got {shape}")
