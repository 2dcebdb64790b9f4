"""How much a quantization format costs in image quality: generate with the unquantized pipeline and with its
transformer's weights quantized to each format (weight-only: dequantized to the compute dtype), and compare the
transformer's output and the decoded images through `quant.gates`."""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mxdit.ops.names import AttentionKernel
from mxdit.pallas_kernels.gemm import WEIGHT_FORMATS
from mxdit.quant.gates import GateReport, evaluate
from mxdit.quant.model import (fake_quantize_model, flux_rules, krea2_rules, quantize_activations,
                               quantize_linear_layers, set_params, weight_bytes, with_params)

from .images import unit_range_to_uint8
from . import flux as flux_model
from . import krea2 as krea2_model
from .loading import iter_params
from .pipeline_common import image_position_ids, initial_noise
from .pipeline_flux import FluxPipeline
from .pipeline_krea2 import Krea2Pipeline


PROMPT_SETS = {"coco100": Path(__file__).parent / "prompts" / "coco100.txt"}  # everyday scenes, written for mxdit


@dataclasses.dataclass(frozen=True)
class QualityRow:
    fmt: str
    weight_bytes: int
    report: GateReport | None  # None for the unquantized reference
    images: np.ndarray | None = None  # uint8 (prompts, height, width * seeds, 3): each prompt's seeds side by side
    clip_scores: np.ndarray | None = None  # (prompts, seeds): each image's CLIP score with its prompt
    step_cosines: np.ndarray | None = None  # (steps,): the DiT output's cosine with the reference's, step by step
    seconds: float = 0.0  # wall time since the row before: quantizing, its images, their figures and CLIP scores

    @property
    def clip_score(self) -> float | None:
        return None if self.clip_scores is None else float(np.mean(self.clip_scores))


def each_image(images: np.ndarray, width: int) -> np.ndarray:
    """A row's images (prompts, height, width * seeds, 3), each prompt's seeds side by side, as one batch
    (prompts * seeds, height, width, 3): prompt by prompt, seed by seed."""
    prompts, height, side_by_side, channels = images.shape
    return (images.reshape(prompts, height, side_by_side // width, width, channels).swapaxes(1, 2)
            .reshape(-1, height, width, channels))


CLIP_MAX_DROP = 0.5  # a format may lose this much mean CLIP score against the reference (AMD Quark's MXFP4 bound)


def row_failures(row: QualityRow, reference: QualityRow) -> list[str]:
    """Why `row` fails its gate: the tensor and image gate's failures (`quant.gates`), and the CLIP gate's against
    the reference row where both have CLIP scores. Empty when it passes."""
    failures = list(row.report.failures)
    if row.clip_scores is not None and reference.clip_scores is not None:
        drop = reference.clip_score - row.clip_score
        if drop > CLIP_MAX_DROP:
            failures.append(f"CLIP {-drop:+.2f} vs reference (allowed -{CLIP_MAX_DROP})")
    return failures


def read_prompts(source: str) -> list[str]:
    """The prompts of a built-in set (`PROMPT_SETS`: "coco100") or of a text file, a prompt a line (blank lines
    skipped). Raises ValueError naming the file when it cannot be read or holds no prompt."""
    path = PROMPT_SETS.get(source, Path(source))
    try:
        prompts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--prompts {source}: {e}") from None
    if not prompts:
        raise ValueError(f"--prompts {source}: no prompts in the file")
    return prompts


def contact_sheet(images: Sequence[Sequence[np.ndarray]], row_labels: Sequence[str], column_labels: Sequence[str],
                  captions: Sequence[Sequence[str]] | None = None, label_width: int = 220, title: str | None = None):
    """A PIL image a person can read the figures against: one row an entry of `row_labels` (a prompt, wrapped in
    the left margin), one column an entry of `column_labels` (a format, over its column), each cell its uint8
    (h, w, 3) image with its caption under it (its figures, "SSIM 0.991 | PSNR 38.2": a line each). All images one
    size; `title`, if given, on a line above everything."""
    from PIL import Image, ImageDraw

    h, w = images[0][0].shape[:2]
    line = 12
    top_band = (line + 4 if title else 0)
    caption_lines = max((len(c.split("|")) for row in captions for c in row), default=0) if captions else 0
    header, caption_height = top_band + 2 * line + 4, caption_lines * line + 6
    sheet = Image.new("RGB", (label_width + w * len(column_labels), header + (h + caption_height) * len(row_labels)),
                      "white")
    draw = ImageDraw.Draw(sheet)
    if title:
        draw.text((4, 2), title, fill="black")
    for c, label in enumerate(column_labels):
        for i, text in enumerate(_wrap(label, max(4, w // 6))[:2]):
            draw.text((label_width + c * w + 2, top_band + 2 + i * line), text, fill="black")
    for r, label in enumerate(row_labels):
        top = header + r * (h + caption_height)
        for i, text in enumerate(_wrap(label, label_width // 7)[: (h + caption_height) // line]):
            draw.text((4, top + 2 + i * line), text, fill="black")
        for c, image in enumerate(images[r]):
            if image.shape[:2] != (h, w):
                raise ValueError(f"contact_sheet: image ({r}, {c}) is {image.shape[:2]}, the first {(h, w)}")
            sheet.paste(Image.fromarray(np.asarray(image, np.uint8)), (label_width + c * w, top))
            lines = [part.strip() for part in captions[r][c].split("|")] if captions else []
            for i, text in enumerate(lines):
                draw.text((label_width + c * w + 2, top + h + 3 + i * line), text, fill="black")
    return sheet


def _wrap(text: str, width: int) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width) or [""]


def quality_table(pipe: Krea2Pipeline | FluxPipeline, formats: Sequence[str], prompts: Sequence[str],
                  seeds: Sequence[int], *, height: int, width: int, steps: int | None = None,
                  max_sequence_length: int = 512, guidance: float | None = None, activations: bool = False,
                  kernels: bool = False, attention: str | None = None, clip=None, batch_size: int = 4,
                  reference_file: Path | None = None,
                  progress: Callable[[str], None] | None = None,
                  row_done: Callable[[list[QualityRow]], None] | None = None) -> list[QualityRow]:
    """The quality table of a Krea 2 or FLUX.1 pipeline: per format, SSIM and PSNR of the decoded images against
    the unquantized ones (SSIM: the mean of each image's; PSNR: of all their pixels together), the cosine of the
    transformer's output with the unquantized one's at each denoising step of those images, and cosine etc. of the
    transformer's output on fixed inputs. `guidance`: the pipeline's guidance scale (None: its default; FLUX.1-dev's
    embedded guidance, Krea 2's CFG). `clip`: (CLIPModel, its tokenizer) from `clip.load_clip`, for each image's CLIP
    score with its prompt. `batch_size`: prompts per pipeline call; each image's noise is its seed's alone, so the
    images do not depend on it (but for the float rounding of another batch shape).
    Weights only, or with `activations` also the inputs of the quantized layers (rows named `fmt W+A`, the inputs
    in the weights' format), or with `kernels` the inference path itself (rows `fmt GEMM`: `quantize_linear_layers`,
    the GEMM kernels' numerics with activations per token in FP8, or INT8 for INT8 weights, the projections stacked
    as generate.py stacks them), and with `attention` (a kernel name, e.g. "int8_mosaic_fp8") also that path with
    the attention kernel (rows `fmt GEMM+attention`; the reference keeps the pipeline's own attention).
    `reference_file`: the reference row's images, denoising changes and output on the fixed inputs are read from
    this file where it exists (`ReferenceRun`; `ReferenceFileError` where other settings or weights made it), else
    made and written there before the formats' rows: a later table of other formats, or one after a crash, reuses
    them.
    `progress(line)`: told of each batch of images made and each row finished; `row_done(rows)`: given the rows so
    far as each one is finished (a long table's finished rows outlive a failure in a later one)."""
    report = progress or (lambda line: None)
    done = row_done or (lambda rows: None)
    flux = isinstance(pipe, FluxPipeline)
    family_rules = flux_rules if flux else krea2_rules
    kwargs = dict(height=height, width=width, num_inference_steps=steps, max_sequence_length=max_sequence_length,
                  output_type="np", **({} if guidance is None else {"guidance_scale": guidance}))
    grid_h, grid_w, channels = height // 16, width // 16, pipe.transformer.config.in_channels

    def scores(images: np.ndarray) -> np.ndarray | None:  # `clip`: (CLIPModel, its tokenizer), `model.clip.load_clip`
        if clip is None:
            return None
        from .clip import clip_scores

        return clip_scores(*clip, list(each_image(images, width)),
                           [p for p in prompts for _ in seeds]).reshape(len(prompts), len(seeds))

    def generate(p, name: str) -> tuple[np.ndarray, np.ndarray]:
        """The images (prompts, height, width * seeds, 3) uint8, and each denoising step's change of the latents
        (steps, seeds * prompts, tokens, channels) float32: the (guided) transformer output times the step's sigma
        difference, which every row shares, so that the changes' cosines are the outputs'."""
        columns, changes = [], []
        for seed in seeds:
            tiles, seed_changes = [], []
            for start in range(0, len(prompts), batch_size):
                chunk = list(prompts[start:start + batch_size])
                noise = initial_noise([seed] * len(chunk), len(chunk), grid_h, grid_w, channels)
                trail = [np.asarray(noise)]
                out = p(chunk, seed=[seed] * len(chunk), latents=noise,
                        callback=lambda i, t, latents: trail.append(np.asarray(latents)), **kwargs)
                tiles.append(unit_range_to_uint8(out.images * 2 - 1))
                seed_changes.append(np.diff(np.stack(trail), axis=0))
                report(f"{name}: seed {seed}, {start + len(chunk)} of {len(prompts)} prompts")
            columns.append(np.concatenate(tiles))
            changes.append(np.concatenate(seed_changes, axis=1))
        return np.concatenate(columns, axis=2), np.concatenate(changes, axis=1)

    def velocity(model) -> np.ndarray:  # one transformer call on fixed inputs, as the gates' tensor check
        latents = jax.random.normal(jax.random.key(0), (1, grid_h * grid_w, model.config.in_channels))
        if flux:
            embeds, pooled = pipe.encode_prompt(list(prompts[:1]), max_sequence_length=max_sequence_length)
            g = jnp.full((1,), 3.5 if guidance is None else guidance) if model.config.guidance_embeds else None
            out = _flux_transformer(model, latents, embeds, pooled, jnp.full((1,), 0.7),
                                    jnp.asarray(image_position_ids(grid_h, grid_w)),
                                    jnp.zeros((embeds.shape[1], 3), jnp.float32), g)
            return np.asarray(out, np.float32)
        embeds, mask = pipe.encode_prompt(list(prompts[:1]), max_sequence_length)
        ids = np.concatenate([np.zeros((embeds.shape[1], 3), np.float32), image_position_ids(grid_h, grid_w)])
        return np.asarray(_transformer(model, latents, embeds, jnp.full((1,), 0.7), jnp.asarray(ids), mask), np.float32)

    params = dict(iter_params(pipe.transformer))
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in params.items()}
    settings = None if reference_file is None else {  # what a reference file is made with
        "pipeline": type(pipe).__name__, "weights": weights_fingerprint(params), "prompts": list(prompts),
        "seeds": [int(seed) for seed in seeds], "height": height, "width": width, "steps": steps,
        "max_sequence_length": max_sequence_length, "guidance": guidance, "batch_size": batch_size,
        "attention": AttentionKernel(pipe.transformer.attention).value, "device": jax.devices()[0].device_kind}
    start = time.perf_counter()
    if reference_file is not None and Path(reference_file).exists():
        reference = read_reference(reference_file, settings)
        report(f"reference: read from {reference_file} (made in {reference.seconds:.1f} s)")
    else:
        (images, changes), output = generate(pipe, "reference"), velocity(pipe.transformer)
        reference = ReferenceRun(settings, images, changes, output, time.perf_counter() - start)
        if reference_file is not None:
            write_reference(reference_file, reference)
            report(f"reference: written to {reference_file}")
    start = time.perf_counter()  # the row's seconds: the reference's making, then this run's CLIP scores
    reference_images, reference_changes, reference_velocity = reference.images, reference.changes, reference.velocity
    rows = [QualityRow("reference", weight_bytes(shapes, []), None, reference_images, scores(reference_images),
                       seconds=reference.seconds + time.perf_counter() - start)]
    report(f"reference: {rows[-1].seconds:.1f} s")
    done(rows)
    reference_each = each_image(reference_images, width)  # what every row's images are measured against, one by one
    # The formats' weights are made from a host copy of the unquantized ones, which leave the device meanwhile: the
    # device holds a full-size transformer's weights once, as for the reference row (twice, Krea 2's do not fit what
    # JAX takes of an 80 GB GPU beside its text encoder and VAE). The pipeline has them back on the device at the end.
    originals = {key: np.array(value) for key, value in params.items()}  # copies: on a CPU np.asarray is a view
    shardings = {key: value.sharding for key, value in params.items()}
    del params
    set_params(pipe.transformer, originals)

    def variants_of(fmt: str, rules) -> Iterator[tuple[str, nnx.Module]]:
        """The transformers of a format's rows, by row name, on the device, each made when its row starts: the
        device holds one variant's weights at a time (the W+A row and the attention row share their row before's)."""
        transformer = with_params(pipe.transformer, fake_quantize_model(originals, rules, pipe.transformer.dtype))
        yield fmt, transformer
        if activations:
            yield f"{fmt} W+A", quantize_activations(transformer, rules)
        del transformer
        if kernels and fmt in WEIGHT_FORMATS:  # (the formats the GEMM kernels take)
            gemm = nnx.clone(pipe.transformer)  # its weights are the host copies: onto the device a weight at a time,
            quantize_linear_layers(gemm, rules, kernels=True)  # quantized, and then the ones left as they are
            set_params(gemm, {key: value for key, value in iter_params(gemm) if isinstance(value, np.ndarray)},
                       cast=True)
            (flux_model if flux else krea2_model).stack_projections(gemm)  # as generate.py runs it
            yield f"{fmt} GEMM", gemm
            if attention is not None:
                with_attention = nnx.clone(gemm)
                with_attention.attention = AttentionKernel(attention)
                yield f"{fmt} GEMM+{attention}", with_attention

    try:
        for fmt in formats:
            start = time.perf_counter()
            rules = family_rules(fmt)
            for name, model in variants_of(fmt, rules):
                quantized = copy.copy(pipe)  # the same pipeline around the variant's transformer
                quantized.transformer = model
                candidate, changes = generate(quantized, name)
                gate = evaluate(fmt, velocity(model), reference_velocity, each_image(candidate, width),
                                reference_each)  # SSIM image by image
                rows.append(QualityRow(name, weight_bytes(shapes, rules), gate, candidate, scores(candidate),
                                       step_cosines(changes, reference_changes), time.perf_counter() - start))
                report(f"{name}: {rows[-1].seconds:.1f} s")
                done(rows)
                start = time.perf_counter()
                del model, quantized  # this variant's weights leave the device before the next one's are made
    finally:
        set_params(pipe.transformer, {key: jax.device_put(value, shardings[key]) for key, value in originals.items()})
    return rows


class ReferenceFileError(ValueError):
    """A quality table's reference file that cannot be read, or that other settings or weights made."""


@dataclasses.dataclass(frozen=True)
class ReferenceRun:
    """The unquantized model's share of a quality table, which every format's row is measured against: its images
    (as `QualityRow.images`), each denoising step's change of the latents, its transformer's output on the fixed
    inputs, the seconds they took, and the settings that made them (a table reuses them only for the same; None for a
    run that no file keeps)."""
    settings: dict | None
    images: np.ndarray
    changes: np.ndarray
    velocity: np.ndarray
    seconds: float


def weights_fingerprint(params: dict) -> str:
    """A digest of a model's weights: every parameter's name, shape and dtype, and a position-weighted sum of all its
    bits (`_bits_digest`, on the device where the weights are: no copy leaves it)."""
    import hashlib

    digest = hashlib.sha256()
    for key in sorted(params):
        value = params[key]
        digest.update(f"{key} {tuple(value.shape)} {value.dtype} {int(_bits_digest(value))}\n".encode())
    return digest.hexdigest()


@jax.jit
def _bits_digest(x: jax.Array) -> jax.Array:
    """The sum of each value's bits times an odd multiplier of its position, modulo 2**32: integer arithmetic, so the
    same on every device whatever order the sum takes, and changed by any one value changing (or two moving)."""
    unsigned = {1: jnp.uint8, 2: jnp.uint16}.get(x.dtype.itemsize, jnp.uint32)
    bits = jax.lax.bitcast_convert_type(x, unsigned).reshape(-1).astype(jnp.uint32)
    position = jnp.arange(bits.size, dtype=jnp.uint32)
    odd = position * jnp.uint32(2654435761) * jnp.uint32(2) + jnp.uint32(1)  # invertible modulo 2**32
    return jnp.sum(bits * odd, dtype=jnp.uint32)


def write_reference(path: Path, run: ReferenceRun) -> None:
    """`run` to the .npz file `path`, atomically (`write_atomically`)."""
    import json

    from .loading import write_atomically

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:  # (np.savez would add .npz to a name)
            np.savez(f, settings=np.array(json.dumps(run.settings)), images=run.images, changes=run.changes,
                     velocity=run.velocity, seconds=np.array(run.seconds))

    write_atomically(path, write)


def read_reference(path: Path, settings: dict) -> ReferenceRun:
    """The `ReferenceRun` in `path` (`write_reference`'s), checked against this table's `settings`:
    `ReferenceFileError` naming the file and what differs where they are not the same."""
    import json
    import zipfile

    try:
        with np.load(path, allow_pickle=False) as data:
            run = ReferenceRun(json.loads(str(data["settings"])), data["images"], data["changes"], data["velocity"],
                               float(data["seconds"]))
        if not isinstance(run.settings, dict):
            raise ValueError("no settings")
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as e:
        raise ReferenceFileError(f"--reference {path}: not one that eval_quality.py wrote ({e})") from None
    differ = [key for key in sorted(settings.keys() | run.settings.keys())
              if run.settings.get(key) != settings.get(key)]
    if differ:
        what = ", ".join(f"other {k}" if k in ("prompts", "weights") else
                         f"{k} {run.settings.get(k)!r} (this run: {settings.get(k)!r})" for k in differ)
        raise ReferenceFileError(f"--reference {path}: made with {what}; give another file, or remove this one to "
                                 "make it anew")
    return run


def step_cosines(changes: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Per step (the leading axis), the cosine of everything else, in float64: (steps,)."""
    out = []
    for a, b in zip(changes, reference):
        a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
        out.append(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), np.finfo(np.float64).tiny))
    return np.asarray(out)


@jax.jit
def _flux_transformer(model, latents, embeds, pooled, timestep, img_ids, txt_ids, guidance):
    return model(latents, embeds, pooled, timestep, img_ids, txt_ids, guidance)


@jax.jit
def _transformer(model, latents, embeds, timestep, ids, mask):
    """One compiled call of the transformer (the module as a pytree, as the pipeline's programs take it): run op by op,
    each layer and each activation quantization compiles programs of its own."""
    return model(latents, embeds, timestep, ids, mask)


def format_table(rows: Sequence[QualityRow]) -> str:
    """format | SSIM vs the unquantized images | relative SSIM | PSNR | DiT output cosine and rel. L2 on fixed inputs |
    the lowest of its cosines step by step along the images' denoising | weights | CLIP | the row's seconds | gate.
    The reference is the unquantized model itself, so relative SSIM (quality relative to the reference's) is SSIM / 1."""
    width = max([16] + [len(row.fmt) + 2 for row in rows])
    with_clip = rows[0].clip_scores is not None

    def clip(row: QualityRow) -> str:
        return f"{row.clip_score:8.2f}" if with_clip else ""

    lines = [f"{'format':<{width}}{'SSIM':>8}{'rel SSIM':>10}{'PSNR dB':>9}{'DiT cos':>10}{'DiT relL2':>11}"
             f"{'step cos':>10}{'weights MB':>12}{'CLIP' if with_clip else '':>{8 if with_clip else 0}}{'s':>8}  gate"]
    for row in rows:
        if row.report is None:
            lines.append(f"{row.fmt:<{width}}{1.0:8.4f}{'100.0%':>10}{'inf':>9}{1.0:10.6f}{0.0:11.4f}{1.0:10.6f}"
                         f"{row.weight_bytes / 1e6:12.2f}{clip(row)}{row.seconds:8.1f}  -")
            continue
        r = row.report
        failures = row_failures(row, rows[0])
        gate = "FAIL: " + "; ".join(failures) if failures else "pass"
        lines.append(f"{row.fmt:<{width}}{r.ssim:8.4f}{100 * r.ssim:9.1f}%{r.psnr:9.2f}{r.cosine:10.6f}"
                     f"{r.relative_l2:11.4f}{row.step_cosines.min():10.6f}{row.weight_bytes / 1e6:12.2f}{clip(row)}"
                     f"{row.seconds:8.1f}  {gate}")
    return "\n".join(lines)


def quality_sheet(rows: Sequence[QualityRow], prompts: Sequence[str], width: int, title: str | None = None,
                  thumbnail: int = 256):
    """`contact_sheet` of a quality table: one row a prompt (its first seed's image, scaled to `thumbnail` pixels
    wide where it is wider: 100 prompts of 1024-pixel images would make a sheet too large to open), one column a row
    of the table, captioned with that format's SSIM and PSNR against the reference image of the same prompt (at full
    size)."""
    from PIL import Image

    from mxdit.quant.gates import psnr, ssim

    def small(image: np.ndarray) -> np.ndarray:
        h, w = image.shape[:2]
        if w <= thumbnail:
            return image
        size = (thumbnail, round(h * thumbnail / w))
        return np.asarray(Image.fromarray(image).resize(size, Image.Resampling.LANCZOS))

    reference = rows[0].images
    cells, captions = [], []
    for p in range(len(prompts)):
        cells.append([small(row.images[p, :, :width]) for row in rows])
        line = []
        for row in rows:
            image, ref = row.images[p, :, :width], reference[p, :, :width]
            figures = [] if row.report is None else [f"SSIM {ssim(image, ref):.3f}", f"PSNR {psnr(image, ref):.1f}"]
            if row.clip_scores is not None:
                figures.append(f"CLIP {row.clip_scores[p, 0]:.1f}")
            line.append(" | ".join(figures or ["reference"]))
        captions.append(line)
    return contact_sheet(cells, prompts, [row.fmt for row in rows], captions, title=title)


def table_json(rows: Sequence[QualityRow]) -> list[dict]:
    """The table's rows as JSON-ready dicts: format, weight bytes, and the gate's figures and verdict."""
    out = []
    for row in rows:
        entry = {"format": row.fmt, "weight_bytes": row.weight_bytes, "seconds": row.seconds}
        if row.clip_scores is not None:
            entry["clip_score"] = row.clip_score
        if row.report is not None:
            entry.update({k: (str(v) if isinstance(v, float) and not np.isfinite(v) else v)  # PSNR of equal images
                          for k, v in dataclasses.asdict(row.report).items() if k != "fmt"})
            entry["step_cosines"] = [float(c) for c in row.step_cosines]
            entry["failures"] = row_failures(row, rows[0])
            entry["passed"] = not entry["failures"]
        out.append(entry)
    return out
