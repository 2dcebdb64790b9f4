"""Open a diffusers-layout model folder as the pipeline its model_index.json names."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp

from .loading import CheckpointError, read_json
from .pipeline_flux import FluxPipeline
from .pipeline_krea2 import Krea2Pipeline

PIPELINES = {"Krea2Pipeline": Krea2Pipeline, "FluxPipeline": FluxPipeline}


def load_pipeline(folder: str | Path, dtype: jnp.dtype = jnp.bfloat16) -> Krea2Pipeline | FluxPipeline:
    """Krea 2 or FLUX.1, by the `_class_name` of the folder's model_index.json."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such folder")
    index = folder / "model_index.json"
    if not index.is_file():
        raise CheckpointError(f"{index}: file not found (a diffusers model folder names its pipeline there)")
    name = read_json(index).get("_class_name")
    if name not in PIPELINES:
        raise CheckpointError(f"{index}: pipeline {name!r} is not supported (supported: {', '.join(PIPELINES)})")
    return PIPELINES[name].from_pretrained(folder, dtype)
