"""Image quality of each quantization format against the unquantized model (weight-only quantization).

    python scripts/eval_quality.py --model /models/Krea-2-Turbo --prompt "a red fox in the snow" --seeds 0 1 2
    python scripts/eval_quality.py --demo        # the built-in random-weight model: exercises the path, no quality claim

Prints, per format: SSIM and PSNR of the decoded images against the unquantized ones, the transformer output's
cosine and relative L2, the weight bytes, and whether the format passes its gate (quant/gates.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mxdit.ops.names import AttentionKernel


def main(argv=None) -> int:
    from mxdit.quant.formats import formats

    parser = argparse.ArgumentParser(prog="eval_quality.py", description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", type=Path, help="a diffusers-layout Krea 2 folder")
    source.add_argument("--demo", action="store_true")
    parser.add_argument("--prompt", action="append", default=None)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--formats", nargs="+", default=formats(), choices=formats())
    parser.add_argument("--size", type=int, default=None, help="image side (default 1024; demo 64)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--max-sequence-length", type=int, default=None)
    parser.add_argument("--activations", action="store_true", help="also rows with the layers' inputs quantized (W+A)")
    parser.add_argument("--kernels", action="store_true",
                        help="also rows through the inference path: the GEMM kernels' numerics (generate.py --precision)")
    parser.add_argument("--attention", choices=[a.value for a in AttentionKernel if a.is_int8], default=None,
                        help="with --kernels: also rows with this attention kernel (generate.py --attention)")
    args = parser.parse_args(argv)

    from mxdit.model.inference import InferenceOptions, build_pipeline
    from mxdit.model.loading import CheckpointError
    from mxdit.model.pipeline_krea2 import Krea2Pipeline
    from mxdit.model.quality import format_table, krea2_quality

    if args.attention and not args.kernels:
        parser.error("--attention: only with --kernels (it adds rows to the inference path's)")
    size = args.size or (64 if args.demo else 1024)
    if size % 16:
        parser.error(f"--size {size}: must be a multiple of 16")
    # The reference as loaded: the table quantizes (and, for the GEMM rows, stacks) copies of it itself.
    options = InferenceOptions(dtype="float32" if args.demo else "bfloat16", stack=False)
    try:
        if args.demo:
            print("demo: RANDOM weights -- the figures show the machinery works, not how good a format is")
        pipe = build_pipeline(None if args.demo else args.model, options)
        if not isinstance(pipe, Krea2Pipeline):
            raise ValueError(f"--model {args.model}: a {type(pipe).__name__}; the quality table is Krea 2's")
    except (CheckpointError, ValueError) as e:
        print(f"eval_quality.py: error: {e}", file=sys.stderr)
        return 2
    rows = krea2_quality(pipe, args.formats, args.prompt or ["a red fox in the snow, photo"], args.seeds,
                         height=size, width=size, steps=args.steps or (2 if args.demo else None),
                         max_sequence_length=args.max_sequence_length or (64 if args.demo else 512),
                         activations=args.activations, kernels=args.kernels, attention=args.attention)
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
