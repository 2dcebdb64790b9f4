"""What the command-line scripts (scripts/) share: one-line errors, the model and device flags and the inference
options they make, the compilation caches, the count of compilations."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
from pathlib import Path

from mxdit.ops.names import AttentionKernel, Precision

DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


class OneLineErrorParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line naming what is wrong (no usage dump), exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def default_compile_cache() -> Path:
    """Where compiled programs are kept between runs: the XDG cache folder's `mxdit/jax`."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mxdit" / "jax"


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that say which model to load and how (`inference_options` turns them into `InferenceOptions`)."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", type=Path, help="a diffusers-layout Krea 2 or FLUX.1 folder")
    source.add_argument("--demo", action="store_true", help="the built-in tiny model with random weights")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bf16 (demo: fp32)")
    parser.add_argument("--precision", choices=[p.value for p in Precision], default=Precision.BF16.value,
                        help="the transformer blocks' matrices in this format, multiplied by the low-precision GEMM "
                             "kernels with activations quantized per token (default bf16: the --dtype weights as "
                             "they are)")
    parser.add_argument("--quantized", type=Path, default=None, metavar="FILE",
                        help="the transformer's weights from this quantized checkpoint (scripts/quantize.py) instead "
                             "of --model's transformer/ folder; its matrices run through the low-precision GEMM kernels")
    parser.add_argument("--transformer", type=Path, default=None, metavar="FILE",
                        help="the transformer's weights from this single file instead of --model's transformer/ "
                             "folder: .safetensors (diffusers' or the original release's key names, ComfyUI's "
                             "FP8-scaled, MXFP8, NVFP4 and INT8/ConvRot files) or .gguf (Q8_0, Q4_0, K-quants...), "
                             "dequantized as read, then in --precision")
    parser.add_argument("--attention", choices=[a.value for a in AttentionKernel], default=None,
                        help="the attention kernel (default cuDNN on a GPU, XLA elsewhere; int8: INT8-QK, Triton "
                             "lowering; int8_mosaic: INT8-QK, Hopper; _fp8: with P.V in FP8, faster, less exact)")
    parser.add_argument("--offload", type=int, default=None, metavar="RESIDENT",
                        help="a GPU smaller than the model: keep the first RESIDENT transformer blocks on the "
                             "device and stream the others from host memory, loaded straight there (in --precision's or "
                             "--quantized's format)")
    parser.add_argument("--prefetch", type=int, default=2, metavar="N",
                        help="with --offload: copy streamed blocks N blocks ahead (N + 1 blocks' device memory); more "
                             "hides more of the copies when there is room")
    parser.add_argument("--compile-cache", type=Path, default=default_compile_cache(),
                        help="compiled programs kept between runs, so that a second start skips tracing and "
                             "compiling ('' : off; default: $XDG_CACHE_HOME/mxdit/jax, or ~/.cache/mxdit/jax)")
    parser.add_argument("--compile-ahead", action=argparse.BooleanOptionalAction, default=None,
                        help="compile the programs of the first run (generate.py) or of the warm-up (serve.py "
                             "--warmup) all at once and concurrently, from a dry run of the pipeline on its weights' "
                             "shapes while the weights are read (default: on with --compile-cache and without --mesh; "
                             "--no-compile-ahead: each program when first needed)")
    add_device_arguments(parser, "Krea 2 on several devices, e.g. data=2,seq=4,cfg=2 (axes data, cfg, seq, fsdp; "
                                 "default: one device)")
    parser.add_argument("--sequence-attention", choices=["ulysses", "ring"], default=None,
                        help="with seq > 1 (default: Ulysses when the heads divide by seq, else ring)")
    parser.add_argument("--lora", action="append", default=[], metavar="FILE[:WEIGHT]",
                        help="a LoRA safetensors file (diffusers/PEFT, kohya or ComfyUI layout) and its weight "
                             "(default 1.0); repeat for several")
    parser.add_argument("--fuse-lora", action="store_true",
                        help="fuse the LoRAs into the weights (no cost per step) instead of applying them at run time")


def check_model_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`add_model_arguments`' flags checked before anything loads (one line naming the flag); sets `args.loras` to
    (path, weight) pairs and the default dtype."""
    from mxdit.model.inference import QUANTIZED_NEEDS_MODEL, TRANSFORMER_NEEDS_MODEL, options_error

    if args.model is not None and not args.model.is_dir():
        parser.error(f"--model {args.model}: no such folder")
    args.loras = lora_flags(parser, args.lora)
    check_device_arguments(parser, args)
    if args.quantized is not None:
        if args.model is None:
            parser.error(QUANTIZED_NEEDS_MODEL)
        if not args.quantized.is_file():
            parser.error(f"--quantized {args.quantized}: no such file")
    if args.transformer is not None:
        if args.model is None:
            parser.error(TRANSFORMER_NEEDS_MODEL)
        if not args.transformer.is_file():
            parser.error(f"--transformer {args.transformer}: no such file")
    error = options_error(precision=args.precision, quantized=args.quantized is not None, sharded=args.mesh is not None,
                          offload=args.offload, prefetch=args.prefetch, fuse_loras=args.fuse_lora,
                          transformer=args.transformer is not None)
    if error is not None:
        parser.error(error)
    # The dry run returns zeros only from programs the store serves, and those run on one device.
    can_compile_ahead = args.mesh is None and str(args.compile_cache) not in ("", ".")
    if args.compile_ahead and not can_compile_ahead:
        parser.error("--compile-ahead: needs --compile-cache and runs without --mesh")
    if args.compile_ahead is None:
        args.compile_ahead = can_compile_ahead
    args.dtype = args.dtype or ("fp32" if args.demo else "bf16")


def progress(line: str) -> None:
    """What a long run has done so far, on standard error, as it happens (a benchmark's phases, a quality
    protocol's rows)."""
    print(line, file=sys.stderr, flush=True)


def check_output(parser: argparse.ArgumentParser, output: Path, overwrite: bool) -> None:
    """--output's one-line refusals: a file that exists without --overwrite (nothing a user has is replaced unasked),
    a folder that does not."""
    if output.exists() and not overwrite:
        parser.error(f"--output {output}: already exists (pass --overwrite to replace)")
    if not output.parent.is_dir():
        parser.error(f"--output {output}: folder {output.parent} does not exist")


def lora_flags(parser: argparse.ArgumentParser, specs: list[str]) -> list[tuple[Path, float]]:
    """--lora FILE[:WEIGHT] flags as (path, weight) pairs; a bad weight or a missing file exits naming it."""
    if not specs:
        return []  # and no import of the models (with jax) while parsing
    from mxdit.model.lora_files import parse_lora_arg

    loras = []
    for spec in specs:
        try:
            path, weight = parse_lora_arg(spec)
        except ValueError as e:
            parser.error(f"--lora {spec}: {e}")
        if not path.is_file():
            parser.error(f"--lora {path}: no such file")
        loras.append((path, weight))
    return loras


def run_description(args: argparse.Namespace, ignore: tuple[str, ...] = (), **extra) -> str:
    """The settings of a command line that choose its programs, as `ProgramStore.note_run` and `stored_run` key a
    run: every parsed flag but those in `ignore` and the compile cache's own, the model folder resolved, and
    `extra`. A later run with the same ones finds its programs stored."""
    skip = {"compile_cache", "compile_ahead", "model", *ignore}
    settings = {k: str(v) for k, v in vars(args).items() if k not in skip}
    settings.update(model=str(args.model.resolve()) if args.model else "demo", **extra)
    return repr(sorted(settings.items()))


def inference_options(args: argparse.Namespace, mesh=None, swap_loras: bool = False):
    """The parsed model flags as `build_pipeline`'s `InferenceOptions`; `mesh`: the --mesh's `jax.sharding.Mesh`;
    `swap_loras`: the --lora files' weights can change per call (not with --fuse-lora)."""
    from mxdit.model.inference import InferenceOptions

    return InferenceOptions(
        precision=Precision(args.precision), attention=AttentionKernel(args.attention) if args.attention else None,
        dtype=DTYPES[args.dtype], offload=args.offload, prefetch=args.prefetch, loras=tuple(args.loras),
        fuse_loras=args.fuse_lora, swap_loras=swap_loras and not args.fuse_lora, quantized=args.quantized,
        transformer=args.transformer, mesh=mesh,
        sequence_attention=args.sequence_attention)


@contextlib.contextmanager
def compile_caches(folder: Path | None):
    """Within the block, in this thread: JAX's persistent compilation cache in `folder` (every compile, however
    short) and the serialized executables of `model.programs` in `folder/executables`. Yields the `ProgramStore`,
    or None when `folder` is None or empty (both off)."""
    import jax

    from mxdit.model.programs import use_program_store

    if folder is None or str(folder) in ("", "."):
        yield None
        return
    from jax.experimental.compilation_cache import compilation_cache

    compilation_cache.reset_cache()  # a cache already opened in this process (tests) would keep its folder
    jax.config.update("jax_compilation_cache_dir", str(folder))
    # Every compile: a second start then compiles nothing, however small (eager operations cost ~0.1 s each).
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    with use_program_store(Path(folder) / "executables") as store:
        yield store


def add_device_arguments(parser, mesh_help: str) -> None:
    """--mesh (named axes, e.g. data=2,seq=4) and --distributed (jax.distributed.initialize() first)."""
    parser.add_argument("--mesh", default=None, help=mesh_help)
    parser.add_argument("--distributed", action="store_true",
                        help="call jax.distributed.initialize() first (one process per host, same command on each)")


def check_device_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject a malformed --mesh at parse time, before any model is loaded."""
    if args.mesh is not None:
        from mxdit.sharding.mesh import parse_mesh

        try:
            parse_mesh(args.mesh)
        except ValueError as e:
            parser.error(f"--mesh: {e}")


def mesh_from_arguments(args: argparse.Namespace):
    """jax.distributed.initialize() if --distributed, then the --mesh's `jax.sharding.Mesh` (None without --mesh).
    A mesh that does not fit the devices raises ValueError starting with "--mesh:"."""
    if args.distributed:
        import jax

        jax.distributed.initialize()  # coordinator, process count and id from the launcher's environment
    if args.mesh is None:
        return None
    from mxdit.sharding.mesh import make_mesh

    try:
        return make_mesh(args.mesh)
    except ValueError as e:
        raise ValueError(f"--mesh: {e}") from None


BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # each program XLA hands back: compiled or read
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"  # ...of which read from the persistent compilation cache


class CompileLog:
    """While active (a context manager), counts the programs JAX compiled and those it read from the persistent
    compilation cache instead, with their seconds, from `jax.monitoring`'s events: each program XLA hands back
    records BACKEND_COMPILE_EVENT's duration, preceded (in the same thread) by CACHE_HIT_EVENT when the persistent
    cache served it. Programs found in this process's in-memory caches record neither."""

    def __init__(self):
        self.compiled, self.compile_s = 0, 0.0
        self.cached, self.cache_s = 0, 0.0
        self._hit = threading.local()

    def _on_event(self, event: str, **kwargs) -> None:
        if event == CACHE_HIT_EVENT:
            self._hit.pending = True

    def _on_duration(self, event: str, seconds: float, **kwargs) -> None:
        if event != BACKEND_COMPILE_EVENT:
            return
        if getattr(self._hit, "pending", False):
            self._hit.pending = False
            self.cached, self.cache_s = self.cached + 1, self.cache_s + seconds
        else:
            self.compiled, self.compile_s = self.compiled + 1, self.compile_s + seconds

    def __enter__(self) -> "CompileLog":
        from jax import monitoring

        monitoring.register_event_listener(self._on_event)
        monitoring.register_event_duration_secs_listener(self._on_duration)
        return self

    def __exit__(self, *exc) -> None:
        from jax import monitoring

        monitoring.unregister_event_listener(self._on_event)
        monitoring.unregister_event_duration_listener(self._on_duration)

    def summary(self, cache_on: bool) -> str:
        """One line: what was compiled and what the persistent cache (`cache_on`: in use) served, e.g. "compilation:
        3 programs compiled (1.2 s), 11 programs read from the compile cache (0.4 s)"."""
        def programs(n: int) -> str:
            return f"{n} program{'s' if n != 1 else ''}"

        if not self.compiled and not self.cached:
            return "compilation: none (every program was already compiled in this process)"
        compiled = f"{programs(self.compiled)} compiled ({self.compile_s:.1f} s)" if self.compiled else "none compiled"
        if not cache_on:
            cached = "compile cache off"
        elif self.cached:
            cached = f"{programs(self.cached)} read from the compile cache ({self.cache_s:.1f} s)"
        else:
            cached = "none read from the compile cache"
        return f"compilation: {compiled}, {cached}"
