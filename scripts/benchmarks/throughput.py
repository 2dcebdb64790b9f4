"""Images per second of a warm process at several batch sizes: ours (`model.requests.generate_batch`, as
generate.py --prompts and the server run batches) and diffusers' eager pipeline, on the same folder of random
full-size weights (Krea 2 Turbo or FLUX.1-dev) that `first-image` writes, each in its own process."""

from __future__ import annotations

import statistics
import time
from .first_image import MODELS, diffusers_pipeline, model_folder
from .rows import emit, error_text, flags, subprocess_rows, write_json


def throughput(args) -> None:
    folder, rows = model_folder(args)
    if folder is None:
        return write_json(args, rows)
    forwarded = ["--model-folder", str(folder)] + flags(args, "model", "batches", "height", "width", "steps",
                                                        "guidance", "repeats", "prompt")
    if args.diffusers:
        rows += subprocess_rows(args, "throughput-diffusers", forwarded)
    rows += subprocess_rows(args, "throughput-jax", forwarded + flags(args, "precision", "attention"))
    print(f"\nImages per second, warm: {MODELS[args.model].title} {args.height}x{args.width}, {args.steps} steps, "
          f"guidance {args.guidance}, random full-size weights from {folder}")
    for r in rows:
        if "error" in r:
            print(f"{r.get('name', '?'):<40} error: {r['error']}")
        elif "images_per_s" in r:
            print(f"{r['name']:<40} batch {r['batch']:>3}: {r['images_per_s']:6.2f} images/s "
                  f"({r['s_per_batch']:.3f} s a batch, first call {r['first_call_s']:.1f} s)")
    write_json(args, rows)


def _timed_batches(name: str, run, args) -> list[dict]:
    """`run(batch)` once (compiles, warms up), then --repeats timed calls per batch size: the median's images/s."""
    rows = []
    for batch in args.batches:
        try:
            start = time.perf_counter()
            run(batch)
            first = time.perf_counter() - start
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                run(batch)
                times.append(time.perf_counter() - start)
            seconds = statistics.median(times)
            rows.append(emit({"name": name, "batch": batch, "s_per_batch": seconds, "images_per_s": batch / seconds,
                              "first_call_s": first}))
        except Exception as e:  # one batch size that does not fit is a result; the others go on
            rows.append(emit({"name": f"{name}, batch {batch}", "error": error_text(e)}))
    return rows


def jax_throughput(args) -> list[dict]:
    """Ours: the folder built as generate.py builds it, batches of distinct prompts and seeds."""
    from mxdit.model.inference import InferenceOptions, build_pipeline
    from mxdit.model.requests import GenerationRequest, generate_batch

    pipe = build_pipeline(args.model_folder, InferenceOptions(precision=args.precision, attention=args.attention))

    def run(batch: int):
        requests = [GenerationRequest(prompt=f"{args.prompt}, {i}", seed=i, height=args.height, width=args.width,
                                      steps=args.steps, guidance=args.guidance) for i in range(batch)]
        images, _ = generate_batch(pipe, requests)
        assert len(images) == batch

    return _timed_batches(f"mxdit {args.precision}, {args.attention}", run, args)


def diffusers_throughput(args) -> list[dict]:
    """diffusers' eager pipeline in bf16, a batch of distinct prompts a call, decoded to PIL images. Its VAE decodes
    a batch one image at a time (`enable_slicing`, diffusers' advice for large batches; the images are the same)."""
    import torch

    pipe, device = diffusers_pipeline(args)
    pipe.vae.enable_slicing()

    def run(batch: int):
        with torch.inference_mode():
            images = pipe([f"{args.prompt}, {i}" for i in range(batch)], height=args.height, width=args.width,
                          num_inference_steps=args.steps, guidance_scale=args.guidance,
                          generator=[torch.Generator(device).manual_seed(i) for i in range(batch)]).images
        if device == "cuda":
            torch.cuda.synchronize()
        assert len(images) == batch

    return _timed_batches("diffusers eager bf16, VAE slicing", run, args)
