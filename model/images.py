"""Images in and out of the models: uint8 (batch, height, width, 3) arrays and PIL images on one side, float arrays in
[-1, 1] on the other. The conversion lives here and nowhere else."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from PIL import Image


def uint8_to_unit_range(images: np.ndarray) -> np.ndarray:
    """uint8 images (h, w, 3) or (batch, h, w, 3) -> float32 in [-1, 1], same shape."""
    images = np.asarray(images)
    if images.dtype != np.uint8:
        raise ValueError(f"expected uint8 images, got dtype {images.dtype}")
    if images.shape[-1] != 3 or images.ndim not in (3, 4):
        raise ValueError(f"expected RGB images of shape (height, width, 3) or (batch, height, width, 3), got {images.shape}")
    return images.astype(np.float32) / 127.5 - 1.0


def unit_range_to_uint8(images) -> np.ndarray:
    """Float images in [-1, 1] -> uint8, as diffusers' image processor does: clip (x + 1) / 2 to [0, 1], scale by 255,
    round to nearest."""
    images = np.asarray(images, np.float32)
    return np.round(np.clip(images / 2 + 0.5, 0.0, 1.0) * 255).astype(np.uint8)


def to_pil(images) -> list[Image.Image]:
    """Float images in [-1, 1], (batch, h, w, 3) or (h, w, 3), -> a list of RGB PIL images."""
    images = unit_range_to_uint8(images)
    return [Image.fromarray(image) for image in (images[None] if images.ndim == 3 else images)]


def from_pil(images: Image.Image | Sequence[Image.Image]) -> np.ndarray:
    """PIL images of one size -> float32 (batch, h, w, 3) in [-1, 1]."""
    images = [images] if isinstance(images, Image.Image) else list(images)
    sizes = {image.size for image in images}
    if len(sizes) != 1:
        raise ValueError(f"images must all have one size, got {sorted(sizes)}")
    return uint8_to_unit_range(np.stack([np.asarray(image.convert("RGB")) for image in images]))
