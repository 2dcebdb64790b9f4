"""What the text-to-image pipelines share: latent packing, image token positions, the output type."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import jax
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
