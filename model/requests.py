"""Generation requests: what one image needs, read from a prompts file or an HTTP body, grouped into batches of one
shape, and run on a pipeline. An image depends only on its request: each has its own seed's noise
(`pipeline_common.initial_noise`), so it comes out the same alone or in any batch.

generate.py's `--prompts` and scripts/serve.py both run requests through `generate_batch`.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path, PurePosixPath

MIN_SIDE, MAX_SIDE, MULTIPLE = 64, 4096, 16
MAX_SEED = 2**32 - 1  # jax.random.key keeps 32 bits of a seed (without x64): a larger one would repeat a smaller
FIELDS = ("prompt", "negative_prompt", "seed", "height", "width", "steps", "guidance", "loras", "output")


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One image. `steps` / `guidance` None: the model's defaults. `loras`: (name, weight) of LoRAs the pipeline holds
    (`lora_files.LoraSlots`); the others are off. `output`: a file name for the PNG (a prompts file's `output`)."""

    prompt: str
    negative_prompt: str | None = None
    seed: int = 0
    height: int = 1024
    width: int = 1024
    steps: int | None = None
    guidance: float | None = None
    loras: tuple[tuple[str, float], ...] = ()
    output: str | None = None

    def batch_key(self) -> tuple:
        """Requests with equal keys run as one batch: one program shape, one guidance, one set of LoRA weights."""
        return (self.height, self.width, self.steps, self.guidance, self.negative_prompt is not None,
                tuple(sorted(self.loras)))


def parse_request(fields: Mapping, defaults: GenerationRequest | None = None) -> GenerationRequest:
    """A request from a JSON object; absent fields take `defaults`' values. Raises ValueError with one line naming the
    field at fault."""
    if not isinstance(fields, Mapping):
        raise ValueError(f"a request is a JSON object, got {type(fields).__name__}")
    unknown = [k for k in fields if k not in FIELDS]
    if unknown:
        raise ValueError(f"unknown field {unknown[0]!r} (known: {', '.join(FIELDS)})")
    base = defaults or GenerationRequest(prompt="")
    values = {**dataclasses.asdict(base), **fields}
    prompt = values["prompt"]
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("prompt: a non-empty string is required")
    negative = values["negative_prompt"]
    if negative is not None and not isinstance(negative, str):
        raise ValueError("negative_prompt: must be a string")
    seed = _integer(values, "seed", 0, MAX_SEED)
    height, width = _integer(values, "height", MIN_SIDE, MAX_SIDE), _integer(values, "width", MIN_SIDE, MAX_SIDE)
    for name, side in (("height", height), ("width", width)):
        if side % MULTIPLE:
            raise ValueError(f"{name}: {side} is not a multiple of {MULTIPLE}")
    steps = None if values["steps"] is None else _integer(values, "steps", 1, 1000)
    guidance = values["guidance"]
    if guidance is not None:
        if isinstance(guidance, bool) or not isinstance(guidance, (int, float)) or not 0 <= guidance < 1e4:
            raise ValueError(f"guidance: {guidance!r} must be a number >= 0")
        guidance = float(guidance)
    loras = _loras(values["loras"])
    output = values["output"]
    if output is not None:
        if not isinstance(output, str) or not output.lower().endswith(".png"):
            raise ValueError(f"output: {output!r} must be a file name ending in .png")
        parts = PurePosixPath(output.replace("\\", "/")).parts
        if not parts or output.startswith(("/", "\\")) or ".." in parts:
            raise ValueError(f"output: {output!r} must be a relative name inside the output folder")
    return GenerationRequest(prompt, negative, seed, height, width, steps, guidance, loras, output)


def _integer(values: Mapping, name: str, low: int, high: int) -> int:
    value = values[name]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name}: {value!r} must be an integer between {low} and {high}")
    return value


def _loras(value) -> tuple[tuple[str, float], ...]:
    """{"name": weight, ...}, or already (name, weight) pairs."""
    if value is None:
        return ()
    items = value.items() if isinstance(value, Mapping) else value
    try:
        pairs = tuple((str(name), weight) for name, weight in items)
    except (TypeError, ValueError):
        raise ValueError('loras: must be an object of LoRA names and weights, e.g. {"style": 0.8}') from None
    for name, weight in pairs:
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not -100 <= weight <= 100:
            raise ValueError(f"loras: the weight of {name!r} must be a number, got {weight!r}")
    return tuple((name, float(weight)) for name, weight in pairs)


def read_requests(path: str | Path, defaults: GenerationRequest | None = None
                  ) -> tuple[list[tuple[int, GenerationRequest]], list[tuple[int, str]]]:
    """The requests of a prompts file as (line number, request), and the lines that are not one as (line number,
    error). A `.jsonl` file holds a JSON object a line (the fields of `GenerationRequest`); any other file a prompt a
    line. Blank lines are skipped."""
    path = Path(path)
    jsonl = path.suffix.lower() == ".jsonl"
    requests, errors = [], []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            if jsonl:
                try:
                    fields = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"not JSON ({e.msg} at column {e.colno})") from None
            else:
                fields = {"prompt": line.strip()}
            requests.append((number, parse_request(fields, defaults)))
        except ValueError as e:
            errors.append((number, str(e)))
    return requests, errors


def group_batches(requests: Sequence, batch_size: int, key=lambda item: item.batch_key()) -> Iterator[list]:
    """`requests` in batches of at most `batch_size` whose items share `key`, in the order of each key's first item."""
    groups: dict = {}
    for item in requests:
        groups.setdefault(key(item), []).append(item)
    for items in groups.values():
        for start in range(0, len(items), batch_size):
            yield items[start:start + batch_size]


def generate_batch(pipe, requests: Sequence[GenerationRequest], *, pad_to: int | None = None, lora_slots=None,
                   tiled_decode: bool = False, true_cfg: float = 1.0, max_sequence_length: int | None = None):
    """Run requests sharing one `batch_key` as one pipeline call; returns (PIL images, one per request; the
    pipeline's stage timings). `pad_to`: repeat the last request up to this batch size so that every batch runs the
    same compiled program (the extra images are dropped). `lora_slots`: the pipeline's `LoraSlots`, set to the
    requests' LoRA weights first."""
    from .pipeline_flux import FluxPipeline

    if not requests or len({r.batch_key() for r in requests}) != 1:
        raise ValueError("generate_batch takes one or more requests of one batch_key")
    first = requests[0]
    padded = list(requests) + [requests[-1]] * max(0, (pad_to or 0) - len(requests))
    if lora_slots is not None:
        lora_slots.set_weights(dict(first.loras))
    elif first.loras:
        raise ValueError(f"loras: {first.loras[0][0]!r} is not loaded (no LoRAs are)")
    negatives = None if first.negative_prompt is None else [r.negative_prompt for r in padded]
    options = {}
    if isinstance(pipe, FluxPipeline):
        options.update(guidance_scale=3.5 if first.guidance is None else first.guidance, true_cfg_scale=true_cfg)
    else:
        options.update(guidance_scale=first.guidance)
    if max_sequence_length:
        options["max_sequence_length"] = max_sequence_length
    t0 = time.perf_counter()
    out = pipe([r.prompt for r in padded], negatives, height=first.height, width=first.width,
               num_inference_steps=first.steps, seed=[r.seed for r in padded], tiled_decode=tiled_decode, **options)
    timings = {**{k: v for k, v in out.timings.items() if k != "total"}, "total": time.perf_counter() - t0}
    return out.images[:len(requests)], timings
