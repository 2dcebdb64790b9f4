"""Generate a video with sound from text with MiniMax H3.

    python scripts/generate_video.py --model /models/MiniMax-H3 --prompt "waves on a rocky shore" --output waves.mp4
    python scripts/generate_video.py --model /models/MiniMax-H3 --prompt "x" --num-frames 240 --height 1344 --width 768
    python scripts/generate_video.py --model /models/MiniMax-H3 --prompt "x" --precision fp8 --offload 30  # 48 GB card
    python scripts/generate_video.py --model /models/MiniMax-H3 --prompt "x" --mesh seq=8     # 8 GPUs, one video
    python scripts/generate_video.py --demo --prompt "a red fox" --output demo.mp4    # tiny RANDOM-weight model, CPU

The video is 24 fps, 5 to 15 seconds: --num-frames is rounded up to 17 * n + 5 (the default 124 is the shortest).
Without --height and --width, the 16:9 canvas (768 x 1344). The soundtrack is stereo at 32 kHz, in the same MP4
(H.264 + AAC, through PyAV: pip install 'mxdit[video]'). An existing file is never overwritten unless --overwrite is
given. The checkpoint is guidance-distilled: no guidance scale, no negative prompt.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from mxdit.cli import (OneLineErrorParser, add_device_arguments, check_device_arguments, check_output,
                       mesh_from_arguments)

MULTIPLE = 32  # the VAE's 16x times the transformer's 2x2 patch


def build_parser() -> OneLineErrorParser:
    parser = OneLineErrorParser(prog="generate_video.py", description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", type=Path, help="a diffusers-layout MiniMax H3 folder")
    source.add_argument("--demo", action="store_true", help="a tiny model with RANDOM weights (runs on a CPU)")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--num-frames", type=int, default=None,
                        help="at 24 fps, rounded up to 17 * n + 5 (default 124)")
    parser.add_argument("--height", type=int, default=None, help=f"pixels, a multiple of {MULTIPLE} (default 768)")
    parser.add_argument("--width", type=int, default=None, help=f"pixels, a multiple of {MULTIPLE} (default 1344)")
    parser.add_argument("--steps", type=int, default=None, help="sigmas of the schedule, the final 0 included "
                                                                "(default 50; demo 3)")
    parser.add_argument("--seed", type=int, default=0, help="the noise's seed: the same seed, the same video")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="the transformer's and text encoder's (the VAEs run in float32)")
    parser.add_argument("--precision", choices=["bf16", "fp8", "mxfp8", "mxfp6", "mxfp4", "int8", "int8_rot"],
                        default="bf16", help="the transformer blocks' attention and SwiGLU matrices, quantized as they "
                                             "are read and multiplied by the GEMM kernels (int8_rot: rotated INT8)")
    parser.add_argument("--offload", type=int, default=None, metavar="N",
                        help="keep the first N of the transformer's 50 blocks on the device and stream the others "
                             "from host memory (a card smaller than the model)")
    parser.add_argument("--prefetch", type=int, default=2,
                        help="with --offload: copy streamed blocks this many blocks ahead")
    add_device_arguments(parser, "one video's sequence over several devices: seq=N (Ulysses attention, or ring where "
                                 "the 56 heads do not divide by N)")
    parser.add_argument("--sharded-weights", action="store_true",
                        help="with --mesh: the weights split over the devices, not copied to each")
    parser.add_argument("--output", type=Path, default=Path("output.mp4"), help="MP4 path")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    from mxdit.model.pipeline_minimax_h3 import (DEFAULT_FRAMES, DEFAULT_STEPS, FPS, MAX_SECONDS, MIN_SECONDS,
                                                 align_num_frames)

    if args.model is not None and not args.model.is_dir():
        parser.error(f"--model {args.model}: no such folder")
    if not args.prompt.strip():
        parser.error("--prompt: empty")
    if (args.height is None) != (args.width is None):
        parser.error("--height and --width: give both or neither")
    for name in ("height", "width"):
        value = getattr(args, name)
        if value is not None and (value <= 0 or value % MULTIPLE):
            parser.error(f"--{name} {value}: must be a positive multiple of {MULTIPLE}")
    args.num_frames = args.num_frames or DEFAULT_FRAMES
    frames = align_num_frames(max(args.num_frames, 1))
    if args.num_frames < 1 or not MIN_SECONDS <= frames / FPS <= MAX_SECONDS:
        parser.error(f"--num-frames {args.num_frames}: rounded to 17 * n + 5, must give {MIN_SECONDS:g} to "
                     f"{MAX_SECONDS:g} s at {FPS} fps ({int(MIN_SECONDS * FPS)} to {int(MAX_SECONDS * FPS)} frames)")
    if args.offload is not None and args.offload < 0:
        parser.error(f"--offload {args.offload}: the number of resident blocks must be >= 0")
    if args.prefetch < 1:
        parser.error(f"--prefetch {args.prefetch}: must be >= 1")
    check_device_arguments(parser, args)
    if args.mesh is not None and args.offload is not None:
        parser.error("--mesh with --offload: not supported together")
    if args.mesh is not None and args.precision != "bf16":
        parser.error(f"--precision {args.precision} with --mesh: sharded runs take bf16 weights for now")
    if args.sharded_weights and args.mesh is None:
        parser.error("--sharded-weights: only with --mesh")
    args.steps = args.steps or (3 if args.demo else DEFAULT_STEPS)
    if not 2 <= args.steps <= 1000:
        parser.error(f"--steps {args.steps}: must be between 2 and 1000")
    if args.output.suffix.lower() != ".mp4":
        parser.error(f"--output {args.output}: must end in .mp4")
    check_output(parser, args.output, args.overwrite)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax.numpy as jnp
    from tqdm import tqdm

    from mxdit.model.loading import CheckpointError
    from mxdit.model.pipeline_minimax_h3 import MiniMaxH3Pipeline, demo_pipeline
    from mxdit.model.video_file import write_mp4

    try:
        mesh = mesh_from_arguments(args)
        if args.demo:
            print("demo: RANDOM weights -- the video and sound are noise; this shows the path works")
            pipe = demo_pipeline(Path(tempfile.mkdtemp(prefix="mxdit-demo-tokenizer-")), precision=args.precision)
            if args.offload is not None:
                pipe = pipe.offloaded(args.offload, args.prefetch)
        else:
            pipe = MiniMaxH3Pipeline.from_pretrained(args.model, jnp.dtype(args.dtype), args.precision,
                                                     offload=args.offload, prefetch=args.prefetch)
        if mesh is not None:
            from mxdit.sharding.minimax_h3 import shard_minimax_h3_pipeline

            pipe = shard_minimax_h3_pipeline(pipe, mesh, weights="sharded" if args.sharded_weights else "replicated")
    except (CheckpointError, ValueError) as e:
        print(f"generate_video.py: error: {e}", file=sys.stderr)
        return 2
    with tqdm(desc="denoising", unit="step") as bar:
        def advance(step: int, evaluations: int) -> None:
            bar.total = evaluations  # the pipeline's count: the schedule's sigmas less the final 0
            bar.update(1)

        out = pipe(args.prompt, num_frames=args.num_frames, height=args.height, width=args.width,
                   num_steps=args.steps, seed=args.seed, callback=advance)
    write_mp4(args.output, out.frames, out.fps, out.audio, out.sample_rate)
    seconds = out.frames.shape[0] / out.fps
    print(f"wrote {args.output}: {out.frames.shape[0]} frames of {out.frames.shape[2]}x{out.frames.shape[1]} "
          f"({seconds:.2f} s at {out.fps} fps), stereo at {out.sample_rate} Hz; "
          + ", ".join(f"{k} {v:.1f} s" for k, v in out.timings.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
