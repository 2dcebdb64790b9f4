"""Training data: a folder of captioned images, aspect-ratio buckets, a latent + text-embedding cache on disk, and the
order in which batches are drawn (a pure function of the seed and the epoch, so a run resumes exactly).

Captions come from `metadata.jsonl` in the folder (one JSON object per line: `{"file_name": "a.png", "text": "..."}`,
as Hugging Face's imagefolder; "caption" is accepted for "text"), or else from a `.txt` file beside each image.

Each image goes to the bucket whose aspect ratio is nearest its own (in log ratio), is resized to cover the bucket and
centre-cropped. The VAE latents (normalised, as the transformer sees them) and the text encoder's tapped states are
computed once and stored in the cache folder, one `.npz` per image, named by a hash of the image bytes, the caption,
the bucket and the model tag; later runs (and resumed ones) read them back.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
DEFAULT_ASPECTS = (1 / 2, 9 / 16, 2 / 3, 3 / 4, 1.0, 4 / 3, 3 / 2, 16 / 9, 2.0)  # width / height
PIXELS_PER_TOKEN_SIDE = 16  # VAE 8x, then 2x2 patches: a bucket's sides are multiples of 16


class DataError(ValueError):
    """Training data that cannot be used; the message names the file (and line) at fault."""


@dataclasses.dataclass(frozen=True)
class Example:
    image: Path
    caption: str


def read_folder(folder: str | Path) -> list[Example]:
    """The captioned images of `folder`, sorted by file name. Errors: no folder, no images, an image without a
    caption, a caption without an image, a malformed metadata.jsonl line."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"{folder}: no such data folder")
    images = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not images:
        raise DataError(f"{folder}: no images ({', '.join(IMAGE_SUFFIXES)}) in the data folder")
    metadata = folder / "metadata.jsonl"
    if metadata.is_file():
        captions = _read_metadata(metadata)
        missing = [p.name for p in images if p.name not in captions]
        if missing:
            raise DataError(f"{metadata}: no caption for {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        unknown = sorted(set(captions) - {p.name for p in images})
        if unknown:
            raise DataError(f"{metadata}: captions for files not in the folder: {', '.join(unknown[:5])}")
        return [Example(p, captions[p.name]) for p in images]
    examples = []
    for image in images:
        caption_file = image.with_suffix(".txt")
        if not caption_file.is_file():
            raise DataError(f"{image}: caption missing (expected {caption_file.name} beside it, or a metadata.jsonl)")
        try:
            caption = caption_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"{caption_file}: unreadable caption ({e})") from None
        examples.append(Example(image, caption))
    return examples


def _read_metadata(path: Path) -> dict[str, str]:
    captions = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: unreadable ({e})") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{number}: not a JSON object ({e.msg})") from None
        caption = row.get("text", row.get("caption")) if isinstance(row, dict) else None
        if not isinstance(row, dict) or not isinstance(row.get("file_name"), str) or not isinstance(caption, str):
            raise DataError(f'{path}:{number}: expected {{"file_name": ..., "text": ...}}')
        captions[Path(row["file_name"]).name] = caption.strip()
    return captions


# --------------------------------------------------------------------------------------------------------------------
# Buckets


def make_buckets(resolution: int, aspects: Sequence[float] = DEFAULT_ASPECTS, multiple: int = 64) -> list[tuple[int, int]]:
    """(height, width) buckets of about resolution^2 pixels, one per aspect ratio (width / height), sides rounded to
    `multiple` (a multiple of 16); duplicates dropped, sorted by aspect ratio."""
    if multiple % PIXELS_PER_TOKEN_SIDE or multiple <= 0:
        raise ValueError(f"bucket multiple must be a positive multiple of {PIXELS_PER_TOKEN_SIDE}, got {multiple}")
    buckets = set()
    for aspect in aspects:
        height = max(multiple, round(resolution / math.sqrt(aspect) / multiple) * multiple)
        width = max(multiple, round(resolution * math.sqrt(aspect) / multiple) * multiple)
        buckets.add((height, width))
    return sorted(buckets, key=lambda hw: hw[1] / hw[0])


def nearest_bucket(size: tuple[int, int], buckets: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The bucket whose aspect ratio is nearest (in log ratio) that of an image of (width, height) `size`."""
    ratio = math.log(size[0] / size[1])
    return min(buckets, key=lambda hw: abs(math.log(hw[1] / hw[0]) - ratio))


def load_image(path: Path, bucket: tuple[int, int]) -> np.ndarray:
    """The image as uint8 (height, width, 3) of the bucket's size: resized to cover it (Lanczos), centre-cropped."""
    height, width = bucket
    try:
        with Image.open(path) as image:
            image = image.convert("RGB")
    except Exception as e:  # PIL raises several types for a broken or foreign file
        raise DataError(f"{path}: unreadable image ({type(e).__name__}: {e})") from None
    scale = max(width / image.width, height / image.height)
    resized = image.resize((max(width, round(image.width * scale)), max(height, round(image.height * scale))),
                           Image.Resampling.LANCZOS)
    left, top = (resized.width - width) // 2, (resized.height - height) // 2
    return np.asarray(resized.crop((left, top, left + width, top + height)))


def image_size(path: Path) -> tuple[int, int]:
    """(width, height) of an image, reading only its header; a clear error if it is not one."""
    try:
        with Image.open(path) as image:
            image.verify()
            return image.size
    except Exception as e:
        raise DataError(f"{path}: unreadable image ({type(e).__name__}: {e})") from None


# --------------------------------------------------------------------------------------------------------------------
# The cache


@dataclasses.dataclass(frozen=True)
class CachedExample:
    """One cached training example: where its arrays are, its bucket and its number of real text tokens."""

    path: Path
    bucket: tuple[int, int]
    text_tokens: int
    pooled: bool = False  # FLUX.1: a CLIP pooled vector is stored too


def cache_key(example: Example, bucket: tuple[int, int], tag: str) -> str:
    digest = hashlib.sha256()
    digest.update(example.image.read_bytes())
    digest.update(json.dumps([example.caption, list(bucket), tag]).encode())
    return digest.hexdigest()[:32]


def build_cache(pipe, examples: Sequence[Example], buckets: Sequence[tuple[int, int]], cache_dir: Path, *,
                max_sequence_length: int, tag: str, progress=None) -> list[CachedExample]:
    """Encode each example once (VAE latents, normalised; the text encoder's tapped states of its real tokens) into
    `cache_dir`; examples already there are only read. Each file is written to a temporary name, then renamed.

    Krea 2: only the real text tokens are stored: Krea 2 attends to them alone (padded tokens are moved last and are
    no key), and its text positions are all zero, so padding them back with zeros at batch time gives the same output
    up to float rounding (a 13-token caption padded to 16 instead of 32 tokens: 1e-6 max abs difference, demo model,
    fp32). FLUX.1 (a pipeline whose `encode_prompt` returns T5 states and a CLIP pooled vector): all
    `max_sequence_length` T5 states, padding included (FLUX.1 attends to it), and the pooled vector.
    """
    import jax.numpy as jnp

    from mxdit.model.images import uint8_to_unit_range
    from mxdit.model.loading import write_atomically
    from mxdit.model.pipeline_flux import FluxPipeline

    cache_dir.mkdir(parents=True, exist_ok=True)
    cached = []
    for example in examples:
        bucket = nearest_bucket(image_size(example.image), buckets)
        path = cache_dir / f"{cache_key(example, bucket, tag)}.npz"
        if not path.is_file():
            pixels = uint8_to_unit_range(load_image(example.image, bucket))[None]
            latents = pipe.vae.normalize_latents(pipe.vae.encode(jnp.asarray(pixels, pipe.vae.dtype)))
            if isinstance(pipe, FluxPipeline):
                embeds, pooled = pipe.encode_prompt([example.caption], max_sequence_length=max_sequence_length)
                text = {"embeds": np.asarray(embeds[0], np.float32), "pooled": np.asarray(pooled[0], np.float32)}
            else:
                embeds, mask = pipe.encode_prompt([example.caption], max_sequence_length)
                text = {"embeds": np.asarray(embeds[0], np.float32)[np.asarray(mask[0])]}
            arrays = {"latents": np.asarray(latents[0], np.float32), **text}

            def write(tmp: Path) -> None:
                with open(tmp, "wb") as f:
                    np.savez(f, **arrays)

            write_atomically(path, write)
        with np.load(path) as data:
            tokens, pooled = int(data["embeds"].shape[0]), "pooled" in data.files
        cached.append(CachedExample(path, bucket, tokens, pooled))
        if progress is not None:
            progress.update(1)
    return cached


def load_batch(examples: Sequence[CachedExample], text_len: int) -> dict[str, np.ndarray]:
    """Stack cached examples of one bucket: latents (batch, h/8, w/8, 16), embeds (batch, text_len, ...)
    zero-padded after the real tokens, mask (batch, text_len) bool; FLUX.1's pooled (batch, dim) too."""
    latents, embeds, masks, pooled = [], [], [], []
    for example in examples:
        with np.load(example.path) as data:
            latents.append(data["latents"])
            real = data["embeds"][:text_len]
            if "pooled" in data.files:
                pooled.append(data["pooled"])
        padded = np.zeros((text_len, *real.shape[1:]), np.float32)
        padded[: len(real)] = real
        embeds.append(padded)
        masks.append(np.arange(text_len) < len(real))
    batch = {"latents": np.stack(latents), "embeds": np.stack(embeds), "mask": np.stack(masks)}
    if pooled:
        batch["pooled"] = np.stack(pooled)
    return batch


# --------------------------------------------------------------------------------------------------------------------
# Batch order


def epoch_batches(buckets_of: Sequence[tuple[int, int]], batch: int, seed: int, epoch: int) -> list[list[int]]:
    """The batches of one epoch, as lists of example indices: each bucket's examples shuffled, filled up to a whole
    number of batches by repeating its first ones, cut into batches; then the batches shuffled. A pure function of
    (seed, epoch), which is what makes the data position (epoch, batch index) enough to resume exactly."""
    rng = np.random.default_rng([seed, epoch])
    batches = []
    for bucket in sorted(set(buckets_of)):
        members = [i for i, b in enumerate(buckets_of) if b == bucket]
        order = [members[i] for i in rng.permutation(len(members))]
        order += [order[i % len(order)] for i in range((-len(order)) % batch)]
        batches += [order[i : i + batch] for i in range(0, len(order), batch)]
    return [batches[i] for i in rng.permutation(len(batches))]
