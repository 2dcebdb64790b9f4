"""What the text-to-image pipelines share: latent packing, image token positions, the output type."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from .loading import CheckpointError


@dataclasses.dataclass
class PipelineOutput:
    images: list | np.ndarray | None  # PIL images, or float (batch, h, w, 3) in [0, 1] for output_type="np"
    latents: np.ndarray  # final packed latents (batch, seq, channels), float32
    timings: dict[str, float]  # seconds per stage


def pack_latents(latents: jax.Array, p: int = 2) -> jax.Array:
    """(batch, h, w, c) -> (batch, h/p * w/p, c * p * p), channels ordered (c, py, px) as diffusers packs them."""
    b, h, w, c = latents.shape
    x = latents.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 5, 2, 4)
    return x.reshape(b, (h // p) * (w // p), c * p * p)


def initial_noise(seed: int | Sequence[int], batch: int, grid_h: int, grid_w: int, channels: int, p: int = 2
                  ) -> jax.Array:
    """The packed initial noise (batch, grid_h * grid_w, channels) float32. One seed: `normal(key(seed))` drawn for
    the whole batch, as a pipeline call with `seed=` has always drawn it. One seed per image: each image's noise as
    if it were a batch of one with that seed, so that an image does not depend on the batch it was generated in."""
    shape = (grid_h * p, grid_w * p, channels // (p * p))
    if isinstance(seed, (int, np.integer)):
        return pack_latents(jax.random.normal(jax.random.key(seed), (batch, *shape), jnp.float32), p)
    seeds = list(seed)
    if len(seeds) != batch:
        raise ValueError(f"{len(seeds)} seeds for a batch of {batch} images")
    return jnp.concatenate([pack_latents(jax.random.normal(jax.random.key(s), (1, *shape), jnp.float32), p)
                            for s in seeds])


def unpack_latents(packed: jax.Array, grid_h: int, grid_w: int, p: int = 2) -> jax.Array:
    """Inverse of `pack_latents`: (batch, grid_h * grid_w, c * p * p) -> (batch, grid_h * p, grid_w * p, c)."""
    b, _, cpp = packed.shape
    c = cpp // (p * p)
    x = packed.reshape(b, grid_h, grid_w, c, p, p).transpose(0, 1, 4, 2, 5, 3)
    return x.reshape(b, grid_h * p, grid_w * p, c)


def image_position_ids(grid_h: int, grid_w: int) -> np.ndarray:
    """(grid_h * grid_w, 3) rotary coordinates of packed image tokens: (0, row, column), float32."""
    rows, cols = np.meshgrid(np.arange(grid_h), np.arange(grid_w), indexing="ij")
    return np.stack([np.zeros_like(rows), rows, cols], axis=-1).reshape(-1, 3).astype(np.float32)


def check_components(folder: str | Path, components: Sequence[str], family: str) -> Path:
    """`folder` as a Path, after checking it is a folder holding every component subfolder (errors name them)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such folder")
    missing = [c for c in components if not (folder / c).is_dir()]
    if missing:
        raise CheckpointError(f"{folder}: missing component folder(s) {', '.join(m + '/' for m in missing)} "
                              f"(a {family} folder has {', '.join(c + '/' for c in components)})")
    return folder
