"""Generate images from text with Krea 2 or FLUX.1.

    python scripts/generate.py --model /models/Krea-2-Turbo --prompt "a red fox in the snow" --output fox.png
    python scripts/generate.py --model /models/FLUX.1-dev --prompt "a red fox in the snow" --output fox.png
    python scripts/generate.py --demo --prompt "a red fox" --output demo.png     # tiny RANDOM-weight model, CPU
    python scripts/generate.py --model /models/Krea-2-Turbo --lora style.safetensors:0.8 --lora detail.safetensors ...
    python scripts/generate.py --model /models/Krea-2-Turbo --prompts prompts.jsonl --batch-size 4 --output out/img.png

The model family comes from the folder's model_index.json. Krea 2: Turbo or Base from `is_distilled` (Turbo 8 steps
without guidance, Base 28 steps with CFG 4.5 and the negative prompt). FLUX.1: dev embeds --guidance (default 3.5,
28 steps), schnell takes 4 steps; --true-cfg > 1 with --negative-prompt adds true classifier-free guidance. With
several images, `--output x.png` writes x_0.png, x_1.png, ... An existing file is never overwritten unless
--overwrite is given. `--lora FILE[:WEIGHT]` (repeatable) applies LoRA files in the diffusers/PEFT, kohya or ComfyUI
layout (model/lora_files.py), at run time or, with --fuse-lora, fused into the weights. `--precision fp8` (or
mxfp8, mxfp6, mxfp4, int8) quantizes the transformer's block matrices as they load; `--quantized FILE` reads a
checkpoint that scripts/quantize.py wrote instead.

`--prompts FILE` generates many images in one process: a text file holds a prompt a line, a .jsonl file a JSON
object a line with any of prompt, negative_prompt, seed, height, width, steps, guidance, loras ({"style": 0.8}: the
--lora files by their stems, the others off for that line) and output (a file name in --output's folder); the flags
give the defaults. Lines of one size, step count, guidance and LoRA weights run in batches of --batch-size through one
compiled program; line N's image is <output stem>_<N>.png. A line that cannot run is reported by its number and the
others go on; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path
from typing import NamedTuple

from mxdit.cli import (OneLineErrorParser, add_model_arguments, check_model_arguments, compile_caches, inference_options,
                       mesh_from_arguments, run_description)
from mxdit.model.requests import MAX_SIDE, MIN_SIDE, MULTIPLE


def build_parser() -> OneLineErrorParser:
    parser = OneLineErrorParser(prog="generate.py", description="Generate images from text with Krea 2 or FLUX.1.")
    add_model_arguments(parser)
    prompts = parser.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", action="append", help="repeat for a batch of prompts")
    prompts.add_argument("--prompts", type=Path, default=None, metavar="FILE",
                         help="many images: a prompt a line, or JSONL with a request a line (see the top of this file)")
    parser.add_argument("--batch-size", type=int, default=1,
                        help="with --prompts: images per pipeline call (lines of one shape are batched)")
    parser.add_argument("--negative-prompt", default=None, help="used with guidance > 0 (default: empty)")
    parser.add_argument("--steps", type=int, default=None,
                        help="denoising steps (default: Krea 2 Turbo 8, Base 28; FLUX.1-dev 28, schnell 4)")
    parser.add_argument("--guidance", type=float, default=None,
                        help="Krea 2: CFG scale (0 turns it off); FLUX.1-dev: the embedded guidance (default 3.5)")
    parser.add_argument("--true-cfg", type=float, default=1.0, help="FLUX.1: true CFG scale with --negative-prompt")
    parser.add_argument("--seed", type=int, default=0, help="the initial noise's seed: the same seed, the same image")
    parser.add_argument("--height", type=int, default=None, help="pixels, a multiple of 16 (default 1024; demo 256)")
    parser.add_argument("--width", type=int, default=None, help="pixels, a multiple of 16 (default 1024; demo 256)")
    parser.add_argument("--num-images", type=int, default=1, help="images per prompt")
    parser.add_argument("--output", type=Path, default=Path("output.png"), help="PNG path")
    parser.add_argument("--overwrite", action="store_true", help="replace existing output files")
    parser.add_argument("--tiled-decode", action="store_true", help="decode the VAE in tiles (large images)")
    parser.add_argument("--progress", action="store_true",
                        help="a progress bar per denoising step (waits for each step; without it all steps run as "
                             "one program)")
    parser.add_argument("--max-sequence-length", type=int, default=None,
                        help="text tokens (default: Krea 2 512, FLUX.1-dev 512, schnell 256)")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_model_arguments(parser, args)

    default_side = 256 if args.demo else 1024
    args.height = args.height or default_side
    args.width = args.width or default_side
    for name in ("height", "width"):
        value = getattr(args, name)
        if value % MULTIPLE or not MIN_SIDE <= value <= MAX_SIDE:
            parser.error(f"--{name} {value}: must be a multiple of {MULTIPLE} between {MIN_SIDE} and {MAX_SIDE}")
    if args.steps is not None and not 1 <= args.steps <= 1000:
        parser.error(f"--steps {args.steps}: must be between 1 and 1000")
    if args.guidance is not None and args.guidance < 0:
        parser.error(f"--guidance {args.guidance}: must be >= 0")
    if args.num_images < 1:
        parser.error(f"--num-images {args.num_images}: must be >= 1")
    if args.batch_size < 1:
        parser.error(f"--batch-size {args.batch_size}: must be >= 1")
    if args.prompts is not None:
        if not args.prompts.is_file():
            parser.error(f"--prompts {args.prompts}: no such file")
        if args.num_images != 1:
            parser.error("--num-images with --prompts: repeat the line (with its own seed) instead")
        if args.mesh is not None:
            from mxdit.sharding.mesh import parse_mesh

            data = parse_mesh(args.mesh).get("data", 1)
            if args.batch_size % data:
                parser.error(f"--batch-size {args.batch_size} with --mesh {args.mesh}: the batch must divide into "
                             f"data={data} parts")
    if args.output.suffix.lower() != ".png":
        parser.error(f"--output {args.output}: must end in .png")
    args.outputs = [] if args.prompts else output_paths(args.output, len(args.prompt) * args.num_images)
    existing = [str(p) for p in args.outputs if p.exists()]
    if existing and not args.overwrite:
        parser.error(f"--output: {', '.join(existing)} already exists (pass --overwrite to replace)")
    if not args.output.parent.exists():
        parser.error(f"--output {args.output}: folder {args.output.parent} does not exist")
    args.jobs, args.bad_lines = read_jobs(args) if args.prompts else ([], [])
    if args.prompts and not args.jobs and not args.bad_lines:
        parser.error(f"--prompts {args.prompts}: no prompts in the file")
    return args


class Job(NamedTuple):
    """A line of --prompts: its number, request and PNG path."""

    line: int
    request: object  # mxdit.model.requests.GenerationRequest
    path: Path


def read_jobs(args: argparse.Namespace) -> tuple[list[Job], list[tuple[int, str]]]:
    """The --prompts lines that can run, and (line, error) for those that cannot: not a request, a LoRA not given
    with --lora, an output that exists (without --overwrite) or that an earlier line writes."""
    from mxdit.model.requests import GenerationRequest, read_requests

    # Each line's LoRA weights default to the --lora ones; fused, they are in the weights and a line names none.
    loras = () if args.fuse_lora else tuple((path.stem, weight) for path, weight in args.loras)
    defaults = GenerationRequest(prompt="", negative_prompt=args.negative_prompt, seed=args.seed, height=args.height,
                                 width=args.width, steps=args.steps, guidance=args.guidance, loras=loras)
    try:
        requests, bad = read_requests(args.prompts, defaults)
    except (OSError, UnicodeDecodeError) as e:
        raise SystemExit(f"generate.py: error: --prompts {args.prompts}: {e}")
    known, jobs, taken = {name for name, _ in loras}, [], {}
    for line, request in requests:
        path = (args.output.parent / request.output if request.output
                else args.output.with_name(f"{args.output.stem}_{line}{args.output.suffix}"))
        unknown = [name for name, _ in request.loras if name not in known]
        if request.loras and args.fuse_lora:
            bad.append((line, "loras: the --lora files are fused (--fuse-lora); a line cannot weight them"))
        elif unknown:
            bad.append((line, f"loras: {unknown[0]!r} is not a --lora file's name (given: {', '.join(sorted(known)) or 'none'})"))
        elif path in taken:
            bad.append((line, f"output {path} is also line {taken[path]}'s"))
        elif path.exists() and not args.overwrite:
            bad.append((line, f"output {path} already exists (pass --overwrite to replace)"))
        elif not path.parent.is_dir():
            bad.append((line, f"output {path}: folder {path.parent} does not exist"))
        else:
            taken[path] = line
            jobs.append(Job(line, request, path))
    return jobs, sorted(bad)


def output_paths(output: Path, count: int) -> list[Path]:
    return [output] if count == 1 else [output.with_name(f"{output.stem}_{i}{output.suffix}") for i in range(count)]


def save_png(image, path: Path) -> None:
    """Write atomically: to a temporary file in the same folder, then renamed over the target."""
    from mxdit.model.loading import write_atomically

    write_atomically(path, lambda tmp: image.save(tmp, format="PNG"))


def out_of_memory_message(error: Exception, stage: str, args) -> str | None:
    """One line for a device out-of-memory error (None for other errors), with what would make the run fit."""
    text = str(error)
    if "RESOURCE_EXHAUSTED" not in text and "out of memory" not in text.lower():
        return None
    hints = []
    if args.precision == "bf16" and args.quantized is None:
        hints.append("--precision fp8 (half the transformer's weight memory)")
    hints.append("--offload N (keep N transformer blocks on the device, stream the others)" if args.offload is None
                 else f"a smaller --offload than {args.offload}")
    if not args.tiled_decode:
        hints.append("--tiled-decode (large images)")
    if args.num_images > 1:
        hints.append("fewer --num-images")
    first_line = text.strip().splitlines()[0][:300] if text.strip() else type(error).__name__
    return f"generate.py: error: the device ran out of memory while {stage} ({first_line}); try {', '.join(hints)}"


def main(argv=None) -> int:
    started = time.perf_counter()  # the stage table's total runs from here to the last PNG written
    args = parse_args(argv)
    from mxdit.cli import CompileLog

    with CompileLog() as compiles, compile_caches(args.compile_cache) as store:
        run = generation_run(args)
        code = generate(args, started, run)
        if code == 0 and store is not None:
            store.note_run(run)
    if code in (0, 1):  # 1: some --prompts lines failed, the others ran
        if store is not None:
            print(store.summary())
        print(compiles.summary(store is not None))
    return code


def generate(args: argparse.Namespace, started: float, run: str) -> int:
    """The run after parsing: load, generate, write the PNGs, print the stage table (seconds since `started`);
    `run`: its `generation_run`, under which the compile cache records its programs."""
    import jax
    from tqdm import tqdm

    from mxdit.model.inference import build_pipeline, build_pipeline_ahead
    from mxdit.model.loading import CheckpointError
    from mxdit.model.requests import group_batches

    for line, error in args.bad_lines:  # before the model loads: the user sees them at once
        print(f"generate.py: --prompts {args.prompts} line {line}: {error}", file=sys.stderr)
    if args.prompts and not args.jobs:
        return 1
    t0 = time.perf_counter()
    stages = {"start-up": t0 - started}  # parsing, importing jax and mxdit
    batches = list(group_batches(args.jobs, args.batch_size, key=lambda job: job.request.batch_key()))

    stage = ["loading the model"]  # what an out-of-memory error interrupted

    def dry_run(pipe) -> None:
        """The first run's pipeline calls, whose programs --compile-ahead compiles (the results are thrown away)."""
        stage[0] = "generating"
        if args.prompts:
            first_batches(batch_runner(args, pipe), batches)
        else:
            image_call(args, pipe)[0](callback=(lambda *_: None) if args.progress else None)
        stage[0] = "loading the model"  # the read may still go on

    try:
        options = inference_options(args, mesh_from_arguments(args), swap_loras=args.prompts is not None)
        if args.demo:
            print("mxdit demo: tiny Krea 2-shaped model with RANDOM weights -- the image is noise, not a picture.")
        model = None if args.demo else args.model
        if args.compile_ahead:
            pipe, loading = build_pipeline_ahead(model, options, dry_run, run=run)
        else:
            pipe, loading = build_pipeline(model, options), {}
    except (CheckpointError, ValueError) as e:
        print(f"generate.py: error: {e}", file=sys.stderr)
        return 2
    except jax.errors.JaxRuntimeError as e:
        if (message := out_of_memory_message(e, stage[0], args)) is None:
            raise
        print(message, file=sys.stderr)
        return 2
    loaded = time.perf_counter()  # the stages follow each other without gaps: their sum is the total
    stages.update(loading or {"load": loaded - t0})

    if args.prompts:
        return generate_jobs(args, pipe, batches, stages, started)
    call, steps = image_call(args, pipe)
    with tqdm(total=steps, desc="denoise", unit="step", disable=not args.progress) as bar:
        def on_step(i, t, latents):
            jax.block_until_ready(latents)  # so the bar moves with the device, not with dispatch
            bar.update(1)

        if not args.progress:
            print(f"denoising: {steps} steps")
        try:
            # Without a per-step callback the pipelines run all steps as one program (no host round trip).
            out = call(callback=on_step if args.progress else None)
        except ValueError as e:
            print(f"generate.py: error: {e}", file=sys.stderr)
            return 2
        except jax.errors.JaxRuntimeError as e:
            if (message := out_of_memory_message(e, "generating", args)) is None:
                raise
            print(message, file=sys.stderr)
            return 2
    generated = time.perf_counter()
    for image, path in zip(out.images, args.outputs, strict=True):
        save_png(image, path)
        print(f"wrote {path} ({image.width}x{image.height})")
    done = time.perf_counter()
    pipeline_stages = {k: v for k, v in out.timings.items() if k != "total"}
    stages.update(pipeline_stages)
    # what the pipeline's stages leave out: noise, schedule, the progress bar
    stages["other"] = generated - loaded - sum(pipeline_stages.values())
    stages["write"] = done - generated
    print_stages({**stages, "total": done - started})
    return 0


def generation_run(args: argparse.Namespace) -> str:
    """`run_description` of generate.py: not the prompts' words, seeds or file names, but how many images, whether
    there is a negative prompt, and the --prompts lines' batch shapes."""
    return run_description(args, ignore=("prompt", "prompts", "negative_prompt", "seed", "output", "outputs",
                                         "overwrite", "jobs", "bad_lines"),
                           images=len(args.prompt or ()), negative_prompt=args.negative_prompt is not None,
                           batches=sorted({repr(job.request.batch_key()) for job in args.jobs}))


def image_call(args: argparse.Namespace, pipe):
    """--prompt's pipeline call (all but its `callback`) and its number of steps."""
    from mxdit.model.pipeline_flux import FluxPipeline

    flux = isinstance(pipe, FluxPipeline)
    steps = args.steps or ((28 if pipe.is_dev else 4) if flux else pipe.config.default_steps)
    options = dict(guidance_scale=3.5 if args.guidance is None else args.guidance, true_cfg_scale=args.true_cfg) if flux \
        else dict(guidance_scale=args.guidance)
    if args.max_sequence_length:
        options["max_sequence_length"] = args.max_sequence_length
    call = functools.partial(pipe, args.prompt, args.negative_prompt, height=args.height, width=args.width,
                             num_inference_steps=steps, num_images_per_prompt=args.num_images, seed=args.seed,
                             tiled_decode=args.tiled_decode, **options)
    return call, steps


def batch_runner(args: argparse.Namespace, pipe):
    """--prompts' call of a batch: `generate_batch` on `pipe` with the flags' settings."""
    from mxdit.model.requests import generate_batch

    return functools.partial(generate_batch, pipe, lora_slots=pipe.lora_slots, tiled_decode=args.tiled_decode,
                             true_cfg=args.true_cfg, max_sequence_length=args.max_sequence_length)


def print_stages(stages: dict[str, float]) -> None:
    """The stage table: seconds per stage, the total last."""
    print(f"\n{'stage':<14}{'seconds':>9}")
    for stage, seconds in stages.items():
        print(f"{stage:<14}{seconds:9.3f}")


def generate_jobs(args: argparse.Namespace, pipe, batches: list[list[Job]], stages: dict[str, float],
                  started: float) -> int:
    """--prompts: the jobs in `batches` (of one shape each; the last batch of a shape padded to --batch-size, so that
    all run one program), each PNG written as its batch ends; a batch that fails is reported by its lines and the
    others go on. Returns 0, or 1 when any line failed."""
    import jax
    from tqdm import tqdm

    failed = [line for line, _ in args.bad_lines]
    # The batch keys that have run a full batch: their last, shorter batch is padded to the same shape. On a mesh
    # every batch is: its data axis splits the batch.
    full = set()
    totals: dict[str, float] = {}
    run_batch = batch_runner(args, pipe)
    t0 = time.perf_counter()
    with tqdm(total=len(args.jobs), desc="images", unit="image", dynamic_ncols=True) as bar:
        for batch in batches:
            key = batch[0].request.batch_key()
            if len(batch) == args.batch_size:
                full.add(key)
            try:
                images, timings = run_batch([job.request for job in batch],
                                            pad_to=args.batch_size if key in full or args.mesh is not None else None)
                for image, job in zip(images, batch, strict=True):
                    save_png(image, job.path)
            except Exception as e:  # this batch's lines fail; the others still run
                message = isinstance(e, jax.errors.JaxRuntimeError) and out_of_memory_message(e, "generating", args)
                message = message or f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
                for job in batch:
                    bar.write(f"generate.py: --prompts {args.prompts} line {job.line}: {message}", file=sys.stderr)
                failed.extend(job.line for job in batch)
            else:
                for stage, seconds in timings.items():
                    totals[stage] = totals.get(stage, 0.0) + seconds
            bar.update(len(batch))
    done = time.perf_counter()
    written = len(args.jobs) - (len(failed) - len(args.bad_lines))
    print(f"wrote {written} images to {args.output.parent} in {done - t0:.1f} s ({written / (done - t0):.2f} images/s)")
    if failed:
        print(f"generate.py: {len(failed)} lines failed: {', '.join(map(str, sorted(failed)))}", file=sys.stderr)
    print_stages({**stages, **{k: v for k, v in totals.items() if k != "total"}, "total": done - started})
    return 1 if failed else 0


def first_batches(run_batch, batches: list[list[Job]]) -> None:
    """The first batch of each shape through `run_batch` (`batch_runner`), for --compile-ahead's dry run: its
    results are thrown away. A batch that fails here is reported when it runs."""
    first = {}
    for batch in batches:
        first.setdefault(batch[0].request.batch_key(), batch)
    for batch in first.values():
        try:
            run_batch([job.request for job in batch])
        except Exception:
            pass


if __name__ == "__main__":
    sys.exit(main())
