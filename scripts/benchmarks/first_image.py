"""Time to the first image: a new process from its start to the PNG on disk, with a model folder (Krea 2 Turbo or
FLUX.1-dev) of random full-size weights on local disk (written by diffusers' `save_pretrained`, so that both sides
read the same files). Ours starts twice, the second time from the first one's compile caches (generate.py
--compile-cache: XLA's cache and the serialized executables); diffusers' eager pipeline starts once. Beside them: the
disk's read speed (dd) and our read of the transformer's weights into device memory, each after the page cache is
dropped where the machine lets us. `--one-by-one-too` adds two starts with --no-compile-ahead (the first one's
programs compiled each when first needed; the second's denoise is then the warm speed of those programs)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .rows import CLI, emit, error_text, flags, subprocess_rows, write_json

GENERATE = CLI.parent / "generate.py"


@dataclasses.dataclass(frozen=True)
class BenchmarkModel:
    """A model the first-image and throughput benchmarks run: its image size, steps and guidance (the settings its
    users run; FLUX.1-dev's are the AMD Quark seed's), diffusers' pipeline class and the function of
    `diffusers_side` that builds that pipeline with random full-size weights."""

    title: str
    height: int
    width: int
    steps: int
    guidance: float
    pipeline: str
    random_pipeline: str


MODELS = {
    "krea2-turbo": BenchmarkModel("Krea 2 Turbo", 1024, 1024, 8, 0.0, "Krea2Pipeline", "_krea2_pipeline"),
    "flux-dev": BenchmarkModel("FLUX.1-dev", 768, 1024, 20, 3.5, "FluxPipeline", "_flux_dev_pipeline"),
}


def model_settings(args) -> BenchmarkModel:
    """--model's settings; the size, steps, guidance and folder not given on the command line set from them."""
    spec = MODELS[args.model]
    for name in ("height", "width", "steps", "guidance"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(spec, name))
    if args.model_folder is None:
        args.model_folder = str(Path(tempfile.gettempdir()) / "mxdit-first-image" / args.model)
    return spec


def diffusers_pipeline(args):
    """diffusers' pipeline of --model from --model-folder in bf16 on the GPU (the CPU: a smoke run)."""
    import diffusers
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    pipe = getattr(diffusers, MODELS[args.model].pipeline).from_pretrained(args.model_folder,
                                                                          torch_dtype=torch.bfloat16).to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe, device


def drop_page_cache() -> bool:
    """Flush and drop the kernel's page cache (root on Linux), so that the next read comes from the disk."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def model_folder(args) -> tuple[Path | None, list[dict]]:
    """--model-folder, written first with random weights (`write_model`, in a subprocess) if it holds no model; and
    the rows of that. None where it could not be written."""
    folder = Path(args.model_folder)
    rows = []
    if not (folder / "model_index.json").is_file():
        rows = subprocess_rows(args, "first-image-write", ["--model-folder", str(folder)]
                               + flags(args, "model", "num_layers", "tokenizers"))
    if not (folder / "model_index.json").is_file():
        print(f"{args.command}: the model folder was not written:", rows[-1] if rows else "")
        return None, rows
    return folder, rows


def first_image(args) -> None:
    folder, rows = model_folder(args)
    if folder is None:
        return write_json(args, rows)
    spec = MODELS[args.model]
    rows.append(emit(disk_read(folder / "transformer")))
    rows += subprocess_rows(args, "first-image-read", ["--model-folder", str(folder), "--model", args.model])
    settings = ["--prompt", args.prompt, "--steps", str(args.steps), "--guidance", str(args.guidance), "--height",
                str(args.height), "--width", str(args.width)]
    common = ["--model", str(folder), *settings, "--overwrite"]
    with tempfile.TemporaryDirectory(prefix="mxdit-first-image-") as work:
        work = Path(work)
        ours = common + ["--precision", args.precision, "--attention", args.attention, "--compile-cache"]
        starts = [("first start", "cache", []), ("second start", "cache", [])]
        if args.one_by_one_too:  # programs compiled as first needed: the start, and the warm speed of its programs
            starts += [("first start, --no-compile-ahead", "cache_one_by_one", ["--no-compile-ahead"]),
                       ("second start, --no-compile-ahead", "cache_one_by_one", ["--no-compile-ahead"])]
        for i, (start, cache, extra) in enumerate(starts):
            rows.append(emit(timed_start(f"mxdit {args.precision}, {start}", [sys.executable, str(GENERATE)],
                                         ours + [str(work / cache), *extra], work / f"mxdit_{i}.png")))
        if args.diffusers:
            rows.append(emit(timed_start("diffusers eager bf16", [sys.executable, str(CLI), "first-image-diffusers",
                                                                   "--model-folder", str(folder), "--model",
                                                                   args.model], settings, work / "diffusers.png")))
    print(f"\nTime to the first image: {spec.title}, {args.height}x{args.width}, {args.steps} steps, random full-size "
          f"weights read from {folder}")
    for r in rows:
        if "error" in r:
            print(f"{r.get('name', '?'):<36} error: {r['error']}")
        elif "to_png_s" in r:
            stages = ", ".join(f"{k} {v:.2f}" for k, v in r.get("stages", {}).items())
            print(f"{r['name']:<36} {r['to_png_s']:7.2f} s to the PNG (page cache dropped: {r['cache_dropped']}); "
                  f"{stages}")
            for line in r.get("notes", []):
                print(f"{'':<36} {line}")
        elif "gb_per_s" in r:
            print(f"{r['name']:<36} {r['gb']:.1f} GB in {r['seconds']:.2f} s: {r['gb_per_s']:.2f} GB/s "
                  f"(page cache dropped: {r['cache_dropped']})")
    write_json(args, rows)


def timed_start(name: str, program: list[str], argv: list[str], png: Path) -> dict:
    """Run `program argv --output png` as a new process: seconds from just before it starts to the PNG's
    modification time (written whole, then renamed), and what it printed of its stages."""
    png.unlink(missing_ok=True)
    dropped = drop_page_cache()
    start = time.time()
    proc = subprocess.run(program + argv + ["--output", str(png)], capture_output=True, text=True)
    exited = time.time() - start
    row = {"name": name, "cache_dropped": dropped, "exit_s": exited}
    if proc.returncode or not png.is_file():
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])[-600:]
        return {**row, "error": f"exit {proc.returncode}: {tail}"}
    row["to_png_s"] = png.stat().st_mtime - start
    row["stages"], row["notes"] = {}, []
    for line in proc.stdout.splitlines():
        parts = line.split()
        if line.startswith(("executables:", "compilation:")):
            row["notes"].append(line)
        elif len(parts) >= 2 and parts[-1].replace(".", "", 1).isdigit() and not line.startswith("{"):
            row["stages"][" ".join(parts[:-1])] = float(parts[-1])
        elif line.startswith("{"):  # the diffusers half's own row
            import json

            row["stages"].update({k: v for k, v in json.loads(line).items() if isinstance(v, float)})
    return row


def disk_read(folder: Path) -> dict:
    """dd of the folder's safetensors files to /dev/null in 64 MiB blocks, after dropping the page cache."""
    files = sorted(folder.glob("*.safetensors"))
    dropped = drop_page_cache()
    start = time.perf_counter()
    for f in files:
        subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=64M"], check=True, capture_output=True)
    seconds = time.perf_counter() - start
    gb = sum(f.stat().st_size for f in files) / 1e9
    return {"name": "disk read (dd)", "gb": gb, "seconds": seconds, "gb_per_s": gb / seconds, "cache_dropped": dropped}


def jax_read(args) -> list[dict]:
    """Our read of the transformer's weights into device memory (bf16, as generate.py reads them), after the page
    cache is dropped, then again from the page cache."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mxdit.model.flux import FluxTransformer
    from mxdit.model.krea2 import Krea2Transformer

    model_class = {"krea2-turbo": Krea2Transformer, "flux-dev": FluxTransformer}[args.model]
    folder = Path(args.model_folder) / "transformer"
    gb = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1e9
    jax.block_until_ready(jnp.zeros(1))  # the backend's start is not the read
    rows = []
    for label in ("from disk", "from the page cache"):
        dropped = drop_page_cache() if label == "from disk" else False
        start = time.perf_counter()
        model = model_class.from_pretrained(folder, jnp.bfloat16)
        jax.block_until_ready(nnx.state(model))
        seconds = time.perf_counter() - start
        rows.append(emit({"name": f"mxdit transformer read, {label}", "gb": gb, "seconds": seconds,
                          "gb_per_s": gb / seconds, "cache_dropped": dropped}))
        del model
    return rows


def write_model(args) -> list[dict]:
    """A folder of --model with random full-size bf16 weights, written by diffusers (its layout, its files)."""
    from . import diffusers_side

    start = time.perf_counter()
    pipe = getattr(diffusers_side, MODELS[args.model].random_pipeline)(args)
    pipe.save_pretrained(args.model_folder)
    return [emit({"name": "model folder written", "seconds": time.perf_counter() - start})]


def diffusers_first_image(args) -> list[dict]:
    """diffusers' eager pipeline in a new process: import, from_pretrained to the GPU, one image, the PNG."""
    start = time.perf_counter()
    try:
        import importlib

        import torch

        importlib.import_module("diffusers")  # its import is part of the start

        imported = time.perf_counter()
        pipe, device = diffusers_pipeline(args)
        if device == "cuda":
            torch.cuda.synchronize()
        loaded = time.perf_counter()
        with torch.inference_mode():
            image = pipe(args.prompt, height=args.height, width=args.width, num_inference_steps=args.steps,
                         guidance_scale=args.guidance).images[0]
        generated = time.perf_counter()
        image.save(args.output)
        done = time.perf_counter()
    except Exception as e:
        return [emit({"name": "diffusers first image", "error": error_text(e)})]
    return [emit({"import": imported - start, "load": loaded - imported, "generate": generated - loaded,
                  "write": done - generated})]
