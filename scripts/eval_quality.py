"""Image quality of each quantization format against the unquantized model (weight-only quantization).

    python scripts/eval_quality.py --model /models/Krea-2-Turbo --prompt "a red fox in the snow" --seeds 0 1 2
    python scripts/eval_quality.py --model /models/Krea-2-Turbo --prompts coco100 --sheet sheet.png --json table.json
    python scripts/eval_quality.py --model /models/FLUX.1-dev --formats mxfp4_e2m1 --kernels --prompts coco100 \
        --height 768 --width 1024 --steps 20 --guidance 3.5 --clip /models/clip-vit-base-patch16   # AMD Quark's
    python scripts/eval_quality.py --model /models/Krea-2-Turbo --lora style.safetensors:0.8 --prompts coco100
    python scripts/eval_quality.py --model /models/Krea-2-Turbo --prompts coco100 --formats mxfp4_e2m1 \
        --reference krea2-coco100.npz     # the reference images once: later runs of other formats read them
    python scripts/eval_quality.py --demo        # the built-in random-weight model: exercises the path, no quality claim

Prints, per format: SSIM and PSNR of the decoded images against the unquantized ones, the transformer output's cosine
and relative L2 on fixed inputs and its lowest cosine step by step along the images' denoising, the weight bytes, and
whether the format passes its gate (quant/gates.py). With `--lora`, the LoRAs are fused into the unquantized weights
first, so that every format quantizes the fused weights (generate.py --fuse-lora). `--prompts` takes a text file (a
prompt a line) or `coco100`, 100 everyday scenes written for this table; `--sheet` writes a contact sheet (a row a
prompt, a column a format, each image captioned with its SSIM, PSNR and, with `--clip DIR`, its CLIP score), `--json`
the table (rewritten as each row is finished). `--reference FILE.npz` keeps the unquantized model's images: a later
run of other formats with the same model and settings reads them instead of making them again.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from mxdit.cli import progress
from mxdit.ops.names import AttentionKernel


def main(argv=None) -> int:
    from mxdit.quant.formats import formats

    parser = argparse.ArgumentParser(prog="eval_quality.py", description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", type=Path, help="a diffusers-layout Krea 2 or FLUX.1 folder")
    source.add_argument("--demo", action="store_true")
    prompts = parser.add_mutually_exclusive_group()
    prompts.add_argument("--prompt", action="append", default=None)
    prompts.add_argument("--prompts", default=None, metavar="FILE|coco100",
                         help="a text file of prompts, a prompt a line, or the built-in set coco100")
    parser.add_argument("--clip", type=Path, default=None, metavar="DIR",
                        help="a transformers CLIP folder (openai/clip-vit-base-patch16 in the seeds' protocol): each "
                             "image's CLIP score with its prompt, gated at a drop of 0.5 from the reference")
    parser.add_argument("--sheet", type=Path, default=None, metavar="PNG", help="write the contact sheet here")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE",
                        help="write the table here as JSON, after each row")
    parser.add_argument("--reference", type=Path, default=None, metavar="NPZ",
                        help="the unquantized model's images (and the figures they are measured by): read from this "
                             "file where it exists, made with the same model and settings, else made and written "
                             "there before the formats' rows")
    parser.add_argument("--lora", action="append", default=[], metavar="FILE[:WEIGHT]",
                        help="a LoRA file (diffusers/PEFT, kohya or ComfyUI layout) fused into the model before "
                             "each format quantizes it; repeat for several")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--batch-size", type=int, default=4, help="prompts per pipeline call (each image's noise is its "
                                                                  "seed's alone)")
    parser.add_argument("--formats", nargs="+", default=formats(), choices=formats())
    parser.add_argument("--size", type=int, default=None, help="image side (default 1024; demo 64)")
    parser.add_argument("--height", type=int, default=None, help="instead of --size's (FLUX.1's protocol: 768)")
    parser.add_argument("--width", type=int, default=None, help="instead of --size's")
    parser.add_argument("--steps", type=int, default=None, help="default: the pipeline's (FLUX.1's protocol: 20)")
    parser.add_argument("--guidance", type=float, default=None,
                        help="the pipeline's guidance scale (default its own; FLUX.1-dev's protocol: 3.5)")
    parser.add_argument("--max-sequence-length", type=int, default=None)
    parser.add_argument("--activations", action="store_true", help="also rows with the layers' inputs quantized (W+A)")
    parser.add_argument("--kernels", action="store_true",
                        help="also rows through the inference path: the GEMM kernels' numerics (generate.py "
                             "--precision), for the formats the kernels take")
    parser.add_argument("--attention", choices=[a.value for a in AttentionKernel if a.is_int8], default=None,
                        help="with --kernels: also rows with this attention kernel (generate.py --attention)")
    args = parser.parse_args(argv)

    from mxdit.cli import lora_flags
    from mxdit.model.inference import InferenceOptions, build_pipeline
    from mxdit.model.loading import CheckpointError, write_atomically
    from mxdit.model.quality import (ReferenceFileError, format_table, quality_sheet, quality_table, read_prompts,
                                     table_json)

    if args.attention and not args.kernels:
        parser.error("--attention: only with --kernels (it adds rows to the inference path's)")
    size = args.size or (64 if args.demo else 1024)
    height, width = args.height or size, args.width or size
    for flag, value in (("--size", size), ("--height", height), ("--width", width)):
        if value % 16 or value <= 0:
            parser.error(f"{flag} {value}: must be a positive multiple of 16")
    for flag, path in (("--sheet", args.sheet), ("--json", args.json), ("--reference", args.reference)):
        if path is not None and not path.parent.is_dir():
            parser.error(f"{flag} {path}: folder {path.parent} does not exist")
    try:
        prompt_list = read_prompts(args.prompts) if args.prompts else args.prompt or ["a red fox in the snow, photo"]
    except ValueError as e:
        parser.error(str(e))
    if args.clip is not None and not args.clip.is_dir():
        parser.error(f"--clip {args.clip}: no such folder")
    if args.batch_size < 1:
        parser.error(f"--batch-size {args.batch_size}: must be at least 1")
    loras = lora_flags(parser, args.lora)
    # The reference as loaded (its LoRAs fused): the table quantizes (and, for the GEMM rows, stacks) copies of it.
    options = InferenceOptions(dtype="float32" if args.demo else "bfloat16", stack=False, loras=tuple(loras),
                               fuse_loras=bool(loras))
    try:
        if args.demo:
            print("demo: RANDOM weights -- the figures show the machinery works, not how good a format is")
        start = time.perf_counter()
        pipe = build_pipeline(None if args.demo else args.model, options)
        progress(f"pipeline loaded in {time.perf_counter() - start:.1f} s")
        clip = None
        if args.clip is not None:
            from mxdit.model.clip import load_clip

            clip = load_clip(args.clip)
    except (CheckpointError, ValueError) as e:
        print(f"eval_quality.py: error: {e}", file=sys.stderr)
        return 2

    def write_json(rows) -> None:  # after each row: a later row's failure leaves the rows before it in the file
        import json

        write_atomically(args.json, lambda tmp: tmp.write_text(json.dumps(table_json(rows), indent=1)))

    try:
        rows = quality_table(pipe, args.formats, prompt_list, args.seeds, height=height, width=width,
                             steps=args.steps or (2 if args.demo else None),
                             max_sequence_length=args.max_sequence_length or (64 if args.demo else 512),
                             guidance=args.guidance, activations=args.activations, kernels=args.kernels,
                             attention=args.attention, clip=clip, batch_size=args.batch_size,
                             reference_file=args.reference, progress=progress,
                             row_done=write_json if args.json is not None else None)
    except ReferenceFileError as e:
        print(f"eval_quality.py: error: {e}", file=sys.stderr)
        return 2
    print(format_table(rows))
    if args.sheet is not None:
        title = ("demo model, RANDOM weights: the figures show the machinery, not a format's quality" if args.demo
                 else f"{args.model.name}: each format against the unquantized model, seed {args.seeds[0]}")
        if loras:
            title += ", LoRAs fused: " + ", ".join(f"{path.name}:{weight:g}" for path, weight in loras)
        sheet = quality_sheet(rows, prompt_list, width, title)
        write_atomically(args.sheet, lambda tmp: sheet.save(tmp, format="PNG"))
        print(f"wrote {args.sheet} ({len(prompt_list)} prompts x {len(rows)} columns)")
    if args.json is not None:
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
