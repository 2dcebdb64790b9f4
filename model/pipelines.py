"""Open a diffusers-layout model folder as the pipeline its model_index.json names."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
from flax import nnx

from mxdit.ops.names import Precision
from mxdit.quant.model import flux_rules, krea2_rules, load_quantized_model, quantize_linear_layers

from . import flux, krea2
from .flux import FluxConfig, FluxTransformer
from .krea2 import Krea2Config, Krea2Transformer
from .loading import CheckpointError, read_json
from .pipeline_flux import FluxPipeline
from .pipeline_krea2 import Krea2Pipeline

PIPELINES = {"Krea2Pipeline": Krea2Pipeline, "FluxPipeline": FluxPipeline}
TRANSFORMERS = {"Krea2Pipeline": (Krea2Transformer, Krea2Config), "FluxPipeline": (FluxTransformer, FluxConfig)}


def load_pipeline(folder: str | Path, dtype: jnp.dtype = jnp.bfloat16, *,
                  quantized_transformer: str | Path | None = None,
                  transformer_file: str | Path | None = None) -> Krea2Pipeline | FluxPipeline:
    """Krea 2 or FLUX.1, by the `_class_name` of the folder's model_index.json. `quantized_transformer`: mxdit's
    quantized checkpoint of the transformer (scripts/quantize.py), read in place of transformer/'s weights (its
    config.json still gives the sizes): the quantized matrices go straight to the GEMM kernels' form.
    `transformer_file`: a single `.safetensors` or `.gguf` file of the transformer's weights (any layout
    `from_pretrained` reads), read in place of transformer/'s, with transformer/config.json's sizes."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such folder")
    index = folder / "model_index.json"
    if not index.is_file():
        raise CheckpointError(f"{index}: file not found (a diffusers model folder names its pipeline there)")
    name = read_json(index).get("_class_name")
    if name not in PIPELINES:
        raise CheckpointError(f"{index}: pipeline {name!r} is not supported (supported: {', '.join(PIPELINES)})")
    transformer = None
    model_cls, config_cls = TRANSFORMERS[name]
    config_file = folder / "transformer" / "config.json"
    if quantized_transformer is not None:
        config = config_cls.from_json(config_file)
        transformer = load_quantized_model(lambda: model_cls(config, dtype=dtype, rngs=nnx.Rngs(0)),
                                           quantized_transformer)
    elif transformer_file is not None:
        transformer = model_cls.from_pretrained(transformer_file, dtype, config=config_file)
    return PIPELINES[name].from_pretrained(folder, dtype, transformer=transformer)


def prepare_transformer(transformer: Krea2Transformer | FluxTransformer, precision: Precision | str = "bf16", *,
                        stack: bool = True):
    """A transformer prepared for inference, in place, as generate.py runs it: the blocks' matrices in `precision`
    for the GEMM kernels (the family's quantization rules; matrices quantized already, e.g. as they loaded, are
    kept; bf16: none), then the projections that share an input stacked (`stack`). Returns it."""
    family_rules, family = (flux_rules, flux) if isinstance(transformer, FluxTransformer) else (krea2_rules, krea2)
    fmt = Precision(precision).weight_format
    if fmt is not None:
        quantize_linear_layers(transformer, family_rules(fmt), kernels=True)
    if stack:
        family.stack_projections(transformer)
    return transformer
