"""Serve a loaded, compiled Krea 2 or FLUX.1 pipeline over HTTP on this machine (the API: server.py).

    python scripts/serve.py --model /models/Krea-2-Turbo --precision fp8 --lora style.safetensors --port 8000
    curl -s localhost:8000/v1/generate -d '{"prompt": "a red fox in the snow", "seed": 7, "loras": {"style": 0.8}}'
    curl -s localhost:8000/v1/images/<id>.png -o fox.png

Requests of one size, step count, guidance and LoRA weights are batched (--max-batch); --lora files are named by
their stems and weighted per request without recompiling; --warmup compiles the default request's shapes (every
batch size) before the first request, and --compile-cache keeps them for the next start.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from pathlib import Path

from mxdit.cli import (OneLineErrorParser, add_model_arguments, check_model_arguments, compile_caches, inference_options,
                       mesh_from_arguments, run_description)


def build_parser() -> OneLineErrorParser:
    parser = OneLineErrorParser(prog="serve.py", description="Serve a Krea 2 or FLUX.1 pipeline over HTTP.")
    add_model_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="the TCP port (default 8000)")
    parser.add_argument("--max-batch", type=int, default=4, help="images per pipeline call")
    parser.add_argument("--max-queue", type=int, default=64, help="requests waiting before the server answers 503")
    parser.add_argument("--batch-wait-ms", type=float, default=20.0,
                        help="how long the oldest request waits for others to batch with")
    parser.add_argument("--keep-images", type=int, default=256, help="finished PNGs kept for GET /v1/images/<id>.png")
    parser.add_argument("--output-dir", type=Path, default=None, help="also write each PNG there as <id>.png")
    parser.add_argument("--height", type=int, default=None, help="a request's default (1024; demo 256)")
    parser.add_argument("--width", type=int, default=None, help="a request's default (1024; demo 256)")
    parser.add_argument("--steps", type=int, default=None, help="a request's default (the model's)")
    parser.add_argument("--guidance", type=float, default=None, help="a request's default (the model's)")
    parser.add_argument("--true-cfg", type=float, default=1.0, help="FLUX.1: true CFG scale with a negative prompt")
    parser.add_argument("--max-sequence-length", type=int, default=None, help="text tokens (default: the model's)")
    parser.add_argument("--tiled-decode", action="store_true", help="decode the VAE in tiles (large images)")
    parser.add_argument("--sizes", nargs="+", default=[], metavar="HxW",
                        help="the only image sizes served, e.g. 1024x1024 768x1344 (default: any); with --warmup each "
                             "is compiled before serving")
    parser.add_argument("--warmup", action="store_true",
                        help="compile (or load) the default request's programs for every batch size before serving")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    from mxdit.model.requests import MAX_SIDE, MIN_SIDE, MULTIPLE, GenerationRequest, parse_request

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.compile_ahead and not args.warmup:
        parser.error("--compile-ahead: with --warmup, whose programs it compiles")
    check_model_arguments(parser, args)
    for name in ("max_batch", "max_queue", "keep_images"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if not 0 <= args.port <= 65535:
        parser.error(f"--port {args.port}: must be between 0 and 65535")
    args.min_batch = 1
    try:
        args.size_pairs = tuple((int(h), int(w)) for h, w in (text.lower().split("x") for text in args.sizes))
    except ValueError:
        parser.error(f"--sizes {' '.join(args.sizes)}: each size is HEIGHTxWIDTH, e.g. 1024x1024")
    for h, w in args.size_pairs:
        if h % MULTIPLE or w % MULTIPLE or not (MIN_SIDE <= h <= MAX_SIDE and MIN_SIDE <= w <= MAX_SIDE):
            parser.error(f"--sizes {h}x{w}: sides must be multiples of {MULTIPLE} between {MIN_SIDE} and {MAX_SIDE}")
    if args.mesh is not None:
        from mxdit.sharding.mesh import parse_mesh

        args.min_batch = parse_mesh(args.mesh).get("data", 1)
        if args.max_batch % args.min_batch:
            parser.error(f"--max-batch {args.max_batch} with --mesh {args.mesh}: must divide into data={args.min_batch} "
                         "parts")
    if args.output_dir is not None and not args.output_dir.is_dir():
        parser.error(f"--output-dir {args.output_dir}: no such folder")
    side = 256 if args.demo else 1024
    # A request without "loras" runs the --lora files at their given weights, as generate.py does.
    fields = {"prompt": "-", "height": args.height or side, "width": args.width or side, "steps": args.steps,
              "guidance": args.guidance,
              "loras": {} if args.fuse_lora else {path.stem: weight for path, weight in args.loras}}
    try:
        # a body without a prompt is refused: the defaults' prompt is empty
        args.defaults = dataclasses.replace(parse_request(fields, GenerationRequest(prompt="-")), prompt="")
    except ValueError as e:
        parser.error(f"--{str(e).split(':')[0]}: {str(e).split(': ', 1)[1]}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from aiohttp import web

    from mxdit.model.inference import build_pipeline, build_pipeline_ahead
    from mxdit.model.loading import CheckpointError
    from mxdit.model.requests import generate_batch
    from mxdit.server import GenerationServer, ServerConfig, padded_batch_size

    config = ServerConfig(max_batch=args.max_batch, min_batch=args.min_batch, max_queue=args.max_queue,
                          batch_wait_s=args.batch_wait_ms / 1000, keep_images=args.keep_images,
                          output_dir=args.output_dir, tiled_decode=args.tiled_decode, true_cfg=args.true_cfg,
                          max_sequence_length=args.max_sequence_length, sizes=args.size_pairs)
    shapes = args.size_pairs or ((args.defaults.height, args.defaults.width),)
    # --warmup: the default request at every served size and batch size
    batches = [[dataclasses.replace(args.defaults, prompt="warm-up", height=height, width=width)] * size
               for (height, width), size in itertools.product(shapes, sorted(
                   {padded_batch_size(n, args.max_batch, args.min_batch) for n in range(1, args.max_batch + 1)}))]

    def warm_up(pipe):
        for batch in batches:
            _, timings = generate_batch(pipe, batch, tiled_decode=args.tiled_decode, true_cfg=args.true_cfg,
                                        max_sequence_length=args.max_sequence_length)
            yield batch, timings

    # the warm-up's programs: not where the server listens or keeps its images, nor its queue
    run = run_description(args, ignore=("host", "port", "output_dir", "keep_images", "max_queue", "batch_wait_ms"))
    with compile_caches(args.compile_cache) as store:
        try:
            options = inference_options(args, mesh_from_arguments(args), swap_loras=True)
            model = None if args.demo else args.model
            if args.warmup and args.compile_ahead:
                pipe, stages = build_pipeline_ahead(model, options, lambda pipeline: list(warm_up(pipeline)), run=run)
                print("loaded, warm-up programs compiled ahead: " + ", ".join(f"{k} {v:.1f} s" for k, v in stages.items()))
            else:
                pipe = build_pipeline(model, options)
        except (CheckpointError, ValueError) as e:
            print(f"serve.py: error: {e}", file=sys.stderr)
            return 2
        if args.warmup:
            for batch, timings in warm_up(pipe):
                print(f"warm-up: {batch[0].height}x{batch[0].width}, batch {len(batch)} in {timings['total']:.1f} s")
            if store is not None:
                store.note_run(run)
        server = GenerationServer(pipe, config, args.defaults, program_store=store,
                                  model_name="demo" if args.demo else args.model.name)
        server.start()
        try:
            web.run_app(server.app(), host=args.host, port=args.port, print=lambda line: print(f"serve.py: {line}"))
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
