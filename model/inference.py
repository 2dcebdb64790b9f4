"""The one way to assemble a pipeline for inference: `InferenceOptions` say how (precision, attention kernel, weight
streaming, LoRAs, a quantized checkpoint, stacked projections, a device mesh, dtype) and `build_pipeline` loads and
prepares the model accordingly. generate.py, eval_quality.py, train_lora.py (its validation model) and the benchmarks
call it.

This module imports no jax until `build_pipeline` runs, so that a command line checks its options
(`options_error`) before it imports the models.
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from mxdit.ops.names import AttentionKernel, Precision

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from .pipeline_flux import FluxPipeline
    from .pipeline_krea2 import Krea2Pipeline

QUANTIZED_NEEDS_MODEL = "--quantized needs --model (the folder with the other components and transformer/config.json)"
TRANSFORMER_NEEDS_MODEL = ("--transformer needs --model (the folder with the other components and "
                           "transformer/config.json)")


def options_error(*, precision: Precision | str, quantized: bool, sharded: bool, offload: int | None, prefetch: int,
                  fuse_loras: bool, transformer: bool = False) -> str | None:
    """What is wrong with these options together, as one line naming generate.py's flags, or None when they go
    together. `quantized`: a quantized checkpoint is read; `transformer`: a single transformer file; `sharded`: a
    device mesh is used."""
    if quantized and transformer:
        return "--transformer with --quantized: both name the transformer's weights; give one"
    if quantized:
        for given, name in ((precision != Precision.BF16, "--precision"), (sharded, "--mesh"),
                            (fuse_loras, "--fuse-lora")):
            if given:
                return f"--quantized with {name}: the file's formats are the precision; {name} is not supported with it"
    if sharded and precision != Precision.BF16:
        return f"--precision {precision} with --mesh: sharded runs take bf16 weights for now"
    if offload is not None:
        if offload < 0:
            return f"--offload {offload}: the number of resident blocks must be >= 0"
        if prefetch < 1:
            return f"--prefetch {prefetch}: must be >= 1"
        for given, name in ((sharded, "--mesh"), (fuse_loras, "--fuse-lora")):
            if given:
                return f"--offload with {name}: not supported together yet"
    return None


@dataclasses.dataclass(frozen=True)
class InferenceOptions:
    """How `build_pipeline` prepares a model. Options that do not go together raise ValueError (`options_error`).

    precision: the transformer blocks' matrices in this format, multiplied by the low-precision GEMM kernels with
        activations quantized per token (BF16: the `dtype` weights as they are).
    attention: the attention kernel; None: the device's default (cuDNN on a GPU for 16-bit dtypes, XLA elsewhere).
    dtype: the weights' and the compute's dtype, a `jax.numpy` name ("bfloat16", "float32").
    offload: keep the first `offload` transformer blocks (in running order) on the device and stream the others from
        host memory, where they are loaded straight to; None: all on the device. prefetch: with `offload`, copy the
        streamed blocks this many blocks ahead (prefetch + 1 blocks' device memory).
    loras: (LoRA file, weight) pairs, files in any layout `lora_files.read_lora` reads; applied at run time, or fused
        into the weights with `fuse_loras`. swap_loras: at run time as `lora_files.LoraSlots` (`pipe.lora_slots`,
        named by the files' stems), whose weights can change between calls without recompiling.
    quantized: a quantized checkpoint of the transformer (scripts/quantize.py) read in place of the model folder's
        transformer weights; its formats are the precision.
    transformer: a single file of the transformer's weights read in place of the model folder's (its config.json
        still gives the sizes): `.safetensors` in diffusers' or the original release's key names (ComfyUI's quantized
        files too) or `.gguf` (`gguf_checkpoint`), dequantized as read, then in `precision`; but a block matrix the
        file holds in a format that `precision` keeps is read as stored (`_load`: Q8_0 and NVFP4 at bf16, E4M3 at
        fp8, MXFP8 at mxfp8).
    stack: the projections that share an input (Q/K/V/gate, gate/up) as one product each; never with a `mesh`, whose
        sharding places them by name.
    mesh: run the denoising loop on this device mesh (Krea 2); sequence_attention: with a `seq` axis above 1,
        "ulysses" or "ring" (None: Ulysses when the heads divide by seq, else ring).
    """

    precision: Precision = Precision.BF16
    attention: AttentionKernel | None = None
    dtype: str = "bfloat16"
    offload: int | None = None
    prefetch: int = 2
    loras: tuple[tuple[Path, float], ...] = ()
    fuse_loras: bool = False
    swap_loras: bool = False
    quantized: Path | None = None
    transformer: Path | None = None
    stack: bool = True
    mesh: Mesh | None = None
    sequence_attention: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "precision", Precision(self.precision))
        if self.attention is not None:
            object.__setattr__(self, "attention", AttentionKernel(self.attention))
        object.__setattr__(self, "loras", tuple((Path(path), float(weight)) for path, weight in self.loras))
        if self.quantized is not None:
            object.__setattr__(self, "quantized", Path(self.quantized))
        if self.transformer is not None:
            object.__setattr__(self, "transformer", Path(self.transformer))
        error = options_error(precision=self.precision, quantized=self.quantized is not None,
                              sharded=self.mesh is not None, offload=self.offload, prefetch=self.prefetch,
                              fuse_loras=self.fuse_loras, transformer=self.transformer is not None)
        if error is not None:
            raise ValueError(error)
        if self.swap_loras and self.fuse_loras:
            raise ValueError("swap_loras with fuse_loras: fused LoRAs cannot change their weights")


def build_pipeline(model: str | Path | None, options: InferenceOptions = InferenceOptions()
                   ) -> Krea2Pipeline | FluxPipeline:
    """A pipeline ready to call: `model`, a diffusers-layout Krea 2 or FLUX.1 folder (None: the built-in tiny Krea 2
    model with RANDOM weights, seed 0), prepared as `options` say. In this order: the weights read (quantized to
    `precision` as they are read unless LoRAs are fused first; streamed blocks straight to host memory), the
    attention kernel set, the LoRAs applied or fused (before sharding: it places the adapters), the blocks' matrices
    quantized (the demo's, or the fused weights) and the projections stacked, the blocks streamed, the denoising
    loop sharded over the mesh.

    Raises CheckpointError for a folder or file that cannot be read, ValueError for a LoRA that does not fit the
    model or an option the model does not take (one line naming the file or the flag), and jax's JaxRuntimeError
    when the device runs out of memory.
    """
    import jax.numpy as jnp

    return prepare_pipeline(_load(model, options, getattr(jnp, options.dtype)), options)


def shapes_known_first(model: str | Path | None, options: InferenceOptions) -> bool:
    """Whether `pipeline_shapes` can build this pipeline: from a model folder, with nothing read from other files
    into its weights (LoRAs, a quantized checkpoint) and on one device without streaming (no mesh, no offload)."""
    return (model is not None and not options.loras and options.quantized is None and options.offload is None
            and options.mesh is None and not _file_blocks_may_stay(model, options))


def _file_blocks_may_stay(model: str | Path, options: InferenceOptions) -> bool:
    """Whether the transformer may load some matrices in a file's own block format (`loading.keep_file_blocks`),
    which only reading the file tells: a `--transformer` file (ComfyUI's or GGUF), or a GGUF file in the folder's
    transformer/."""
    if options.transformer is not None:
        return True
    from .loading import gguf_files

    folder = Path(model) / "transformer"
    return folder.is_dir() and bool(gguf_files(folder))


def pipeline_shapes(model: str | Path, options: InferenceOptions = InferenceOptions()) -> Krea2Pipeline | FluxPipeline:
    """The pipeline `build_pipeline(model, options)` returns, holding `jax.ShapeDtypeStruct`s instead of weights
    (`loading.shapes_only`): only the checkpoints' headers are read. Its programs are the real pipeline's, so a dry
    run of it can compile them ahead (`programs.compile_ahead`) while the weights are read; it computes nothing
    else. Only where `shapes_known_first` (ValueError otherwise); the checkpoint errors are `build_pipeline`'s."""
    import jax.numpy as jnp

    from .loading import shapes_only

    if not shapes_known_first(model, options):
        raise ValueError("pipeline_shapes: a model folder without LoRAs, a quantized checkpoint, offload or a mesh")
    with shapes_only():
        return prepare_pipeline(_load(model, options, getattr(jnp, options.dtype)), options)


def build_pipeline_ahead(model: str | Path | None, options: InferenceOptions, dry_run: Callable[[object], object],
                         run: str | None = None) -> tuple[Krea2Pipeline | FluxPipeline, dict[str, float]]:
    """`build_pipeline(model, options)` with the programs that `dry_run(pipeline)` calls compiled ahead into the
    active program store (`programs.compile_ahead`; without a store, or when the store holds every program of `run`
    (`ProgramStore.stored_run`), this is `build_pipeline`). Where the shapes are known first (`shapes_known_first`)
    the dry run runs on `pipeline_shapes` while another thread reads the weights: the compiles overlap the read.
    Returns the pipeline and the seconds of its stages: {"load and compile ahead"} when they overlapped, else
    {"load", "compile ahead"} ({"load"} alone without a dry run). A dry run's error is raised at once (the read goes
    on in its thread until it ends, then is dropped)."""
    import threading
    import time
    from concurrent.futures import Future

    from .programs import active_store, compile_ahead

    t0 = time.perf_counter()
    store = active_store()
    if store is None or (run is not None and store.stored_run(run)):
        pipe = build_pipeline(model, options)
        return pipe, {"load": time.perf_counter() - t0}
    if not shapes_known_first(model, options):
        pipe = build_pipeline(model, options)
        loaded = time.perf_counter()
        return pipe, {"load": loaded - t0, "compile ahead": compile_ahead(lambda: dry_run(pipe))}
    shapes = pipeline_shapes(model, options)  # a folder that does not load fails here, before any read
    pipe: Future = Future()

    def read() -> None:
        try:
            pipe.set_result(build_pipeline(model, options))
        except BaseException as e:  # raised in the caller's thread
            pipe.set_exception(e)

    # A daemon: a failed dry run ends the process without waiting for the read.
    threading.Thread(target=read, name="mxdit-load", daemon=True).start()
    compile_ahead(lambda: dry_run(shapes))
    return pipe.result(), {"load and compile ahead": time.perf_counter() - t0}


def prepare_pipeline(pipe: Krea2Pipeline | FluxPipeline, options: InferenceOptions = InferenceOptions()
                     ) -> Krea2Pipeline | FluxPipeline:
    """`build_pipeline`'s steps after the weights are read, on a pipeline built in memory (the benchmarks' models of
    random full-size weights): the attention kernel, the LoRAs, the blocks' matrices quantized to `precision` and
    stacked, offload, sharding. Returns the pipeline (offload and sharding return a new one)."""
    import jax.numpy as jnp

    from .loading import holds_shapes
    from .pipeline_flux import FluxPipeline
    from .pipelines import prepare_transformer

    dtype = getattr(jnp, options.dtype)
    if options.attention is not None:
        from mxdit.ops.attention import attention_implementation

        pipe.transformer.attention = attention_implementation(options.attention, dtype)
    slots = None
    if options.loras and options.swap_loras:
        from .lora_files import lora_slots

        names = [path.stem for path, _ in options.loras]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora: two files named {next(n for n in names if names.count(n) > 1)!r}; LoRAs are "
                             "told apart by their file names")
        slots = lora_slots(pipe.transformer, {path.stem: path for path, _ in options.loras})
        slots.set_weights({path.stem: weight for path, weight in options.loras})
    elif options.loras:
        from .lora_files import apply_loras, read_lora

        loras = [(read_lora(path, pipe.transformer), weight) for path, weight in options.loras]  # read once
        apply_loras(pipe.transformer, loras, fuse=options.fuse_loras)
        if options.fuse_loras and options.precision.weight_format is not None:
            _warn_of_fused_loss(pipe.transformer, loras, options.precision)
    # Quantized here for the demo, or after fusing LoRAs (the fused weights are what gets quantized); Q/K/V(/gate,
    # /MLP) and gate/up as one product each (not the layers with run-time LoRAs).
    stack = options.stack and options.mesh is None
    if holds_shapes(pipe.transformer):  # `pipeline_shapes`: the same steps on the shapes
        from flax import nnx

        from .loading import on_default_device

        pipe.transformer = on_default_device(nnx.eval_shape(
            lambda transformer: prepare_transformer(transformer, options.precision, stack=stack), pipe.transformer))
    else:
        prepare_transformer(pipe.transformer, options.precision, stack=stack)
    if options.offload is not None:
        from .offload import offload_pipeline

        pipe = offload_pipeline(pipe, resident=options.offload, prefetch=options.prefetch)
    if options.mesh is not None:
        if isinstance(pipe, FluxPipeline):
            raise ValueError("--mesh: FLUX.1 runs on one device for now (sharding covers Krea 2)")
        from mxdit.sharding.krea2 import shard_krea2_pipeline

        pipe = shard_krea2_pipeline(pipe, options.mesh, method=options.sequence_attention)
    pipe.lora_slots = slots
    return pipe


FUSED_LOSS_WARNING = 0.05  # warn when re-quantizing fused weights loses more of the LoRAs' update than this


def _warn_of_fused_loss(transformer, loras, precision: Precision) -> None:
    """LoRAs fused into weights that are quantized next lose the part of their update that the format's rounding of
    the sum swallows (`lora_files.fused_update_loss`); say how much where that is more than FUSED_LOSS_WARNING."""
    import warnings

    from mxdit.quant.model import any_family_rules

    from .lora_files import fused_update_loss

    loss = fused_update_loss(transformer, loras, any_family_rules(precision.weight_format))
    if loss > FUSED_LOSS_WARNING:
        warnings.warn(f"--fuse-lora with --precision {precision.value}: quantizing the fused weights errs by "
                      f"{loss:.0%} of the LoRAs' update (relative L2); without --fuse-lora they run exactly, after "
                      "the product", FusedLoraWarning, stacklevel=3)


class FusedLoraWarning(UserWarning):
    """LoRAs fused into weights then quantized lose part of their update (`_warn_of_fused_loss`)."""


def _load(model: str | Path | None, options: InferenceOptions, dtype) -> Krea2Pipeline | FluxPipeline:
    """The pipeline as read from `model` (None: the demo), with the quantization and the placement that happen as
    the weights are read."""
    if model is None:
        if options.quantized is not None:
            raise ValueError(QUANTIZED_NEEDS_MODEL)
        if options.transformer is not None:
            raise ValueError(TRANSFORMER_NEEDS_MODEL)
        from .pipeline_krea2 import demo_pipeline

        with tempfile.TemporaryDirectory(prefix="mxdit-demo-tokenizer-") as folder:  # read, then removed
            return demo_pipeline(Path(folder), seed=0, dtype=dtype)
    from .loading import place_parameters
    from .pipelines import load_pipeline

    places = []  # applied to each tensor as it is read
    if options.quantized is None and options.precision is not Precision.BF16 and not options.fuse_loras:
        # quantized as read: never all in bf16 on the device
        from mxdit.quant.model import any_family_rules, quantize_on_load

        places.append(quantize_on_load(any_family_rules(options.precision.weight_format)))
    if options.offload is not None:  # the streamed blocks go straight to host memory (after quantizing)
        from .offload import streamed_placement_for_folder

        places.append(streamed_placement_for_folder(model, options.offload))
    keep = contextlib.nullcontext()
    if options.quantized is None and not options.fuse_loras:
        # Block matrices a file holds in the format asked for stay as they are: fp8 keeps a ComfyUI fp8_scaled
        # file's codes, mxfp8 its MXFP8; bf16 keeps the formats no kernel takes, dequantized for each product: a GGUF
        # file's Q8_0 (int8_b32: 1.06 bytes a weight on the device) and ComfyUI's NVFP4 (0.56)
        from mxdit.quant.model import any_family_rules, format_for

        from .loading import keep_file_blocks

        fmt = options.precision.weight_format
        rules, kept = any_family_rules(fmt or "int8_b32"), (fmt,) if fmt else ("int8_b32", "nvfp4")
        keep = keep_file_blocks(lambda key: kept if format_for(key, (1, 1), rules) else ())
    with place_parameters(*places), keep:
        return load_pipeline(model, dtype=dtype, quantized_transformer=options.quantized,
                             transformer_file=options.transformer)
