"""Quantizing a model's parameters by rules, their storage size, and the quantized checkpoint format.

Parameters are a flat mapping of checkpoint keys (diffusers names, as `model.loading.iter_params` yields them) to
arrays. A rule set is an ordered list of (regular expression, format or None); the first rule whose pattern matches
a key decides, None keeping the tensor as it is. The default rule sets quantize the large matrices of the repeated
blocks and keep in 16-bit what the seeds' studies keep: embeddings and input projections, time and text
projections, modulation tables, norms and the final layer.

Quantized checkpoint: one safetensors file. A QuantizedArray under key K is stored as `K.qdata`, `K.qscale` (and
`K.qtensor_scale` for NVFP4), as raw bytes (uint8) or int8/float32; the file's metadata `mxdit.quant` is a JSON map
K -> {"format", "shape", "axis", "dtypes"} from which the arrays are rebuilt bit for bit.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from mxdit.model.loading import unreadable_safetensors

from .formats import FORMATS, QuantizedArray, quantize

Rules = Sequence[tuple[str, str | None]]


def krea2_rules(fmt: str) -> list[tuple[str, str | None]]:
    """Krea 2: the attention (q, k, v, gate, out) and SwiGLU matrices of the joint blocks and of the text-fusion
    blocks in `fmt`; the input, time, text and modulation projections, the tables and the final layer stay."""
    matrices = r"\.(attn\.(to_q|to_k|to_v|to_gate|to_out\.0)|ff\.(gate|up|down))\.weight$"
    return [(r"^(transformer_blocks|text_fusion\.(layerwise|refiner)_blocks)\.\d+" + matrices, fmt)]


def flux_rules(fmt: str) -> list[tuple[str, str | None]]:
    """FLUX.1: every linear weight of the double and single blocks (not their modulation) in `fmt`."""
    return [
        (r"^(transformer_blocks|single_transformer_blocks)\.\d+\.(norm1|norm1_context|norm)\.linear\.weight$", None),
        (r"^(transformer_blocks|single_transformer_blocks)\.\d+\..*\.weight$", fmt),
    ]


def format_for(key: str, shape: tuple[int, ...], rules: Rules) -> str | None:
    """The format `rules` give the parameter `key` (None: kept as it is)."""
    for pattern, fmt in rules:
        if re.search(pattern, key):
            return fmt if len(shape) == 2 else None  # only matrices are quantized (norm gains are vectors)
    return None


def quantize_model(params: Mapping[str, jax.Array], rules: Rules) -> dict[str, jax.Array | QuantizedArray]:
    """Quantize the parameters the rules select (along the reduction axis, the last); others are returned as given."""
    unknown = {fmt for _, fmt in rules if fmt is not None and fmt not in FORMATS}
    if unknown:
        raise ValueError(f"unknown format(s) in rules: {sorted(unknown)}; known: {', '.join(FORMATS)}")
    quantize_jit = jax.jit(quantize, static_argnames=("fmt", "axis", "per_tensor"))
    out = {}
    for key, value in params.items():
        fmt = format_for(key, tuple(value.shape), rules)
        out[key] = quantize_jit(value, fmt=fmt) if fmt else value
    return out


def dequantize_model(params: Mapping[str, jax.Array | QuantizedArray], dtype=jnp.bfloat16) -> dict[str, jax.Array]:
    """Every QuantizedArray back to `dtype` (for weight-only fake quantization); others untouched."""
    return {k: _dequantize(v, dtype) if isinstance(v, QuantizedArray) else v for k, v in params.items()}


@functools.partial(jax.jit, static_argnames="dtype")
def _dequantize(q: QuantizedArray, dtype) -> jax.Array:
    """One compiled program per format and shape: run op by op, NVFP4's decoding alone compiles dozens of programs."""
    return q.dequantize(dtype)


def weight_bytes(shapes: Mapping[str, tuple[tuple[int, ...], jnp.dtype]], rules: Rules) -> int:
    """Bytes of the parameters `shapes` (key -> (shape, dtype)) once quantized by `rules`; computed from shapes
    alone (`jax.eval_shape`), so it works for full-size models without their weights."""
    total = 0
    for key, (shape, dtype) in shapes.items():
        fmt = format_for(key, tuple(shape), rules)
        total += _quantized_nbytes(tuple(shape), fmt) if fmt else int(np.prod(shape)) * jnp.dtype(dtype).itemsize
    return total


@functools.lru_cache(maxsize=None)
def _quantized_nbytes(shape: tuple[int, ...], fmt: str) -> int:
    return jax.eval_shape(lambda x: quantize(x, fmt), jax.ShapeDtypeStruct(shape, jnp.float32)).nbytes


class QuantizedCheckpointError(ValueError):
    """A quantized checkpoint that cannot be read; the message names the file and key."""


def save_quantized(params: Mapping[str, jax.Array | QuantizedArray], path: str | Path) -> None:
    """Write parameters, some quantized, to one safetensors file (atomically) with the metadata that rebuilds them."""
    from mxdit.model.loading import save_safetensors

    tensors, meta = {}, {}
    for key, value in params.items():
        if isinstance(value, QuantizedArray):
            parts = {"qdata": value.data, "qscale": value.scale}
            if value.tensor_scale is not None:
                parts["qtensor_scale"] = value.tensor_scale
            meta[key] = {"format": value.fmt, "shape": list(value.shape), "axis": value.axis,
                         "dtypes": {name: jnp.dtype(a.dtype).name for name, a in parts.items()}}
            for name, array in parts.items():
                tensors[f"{key}.{name}"] = _storable(np.asarray(array))
        else:
            tensors[key] = np.asarray(value)
    save_safetensors(tensors, path, metadata={"mxdit.quant": json.dumps(meta)})  # atomic: never half-written


def load_quantized(path: str | Path, *, on_host: bool = False) -> dict[str, jax.Array | QuantizedArray]:
    """Inverse of `save_quantized`: the same parameters, QuantizedArrays rebuilt bit for bit. `on_host`: numpy arrays
    (host memory) instead of device arrays, for a caller that moves them one at a time."""
    to_array = np.asarray if on_host else jnp.asarray
    from safetensors import safe_open

    path = Path(path)
    try:
        handle = safe_open(str(path), framework="numpy")
    except Exception as e:
        raise QuantizedCheckpointError(unreadable_safetensors(path, e)) from None
    meta = json.loads((handle.metadata() or {}).get("mxdit.quant", "{}"))
    out, used = {}, set()
    for key, info in meta.items():
        arrays = {}
        for name, dtype in info["dtypes"].items():
            stored = f"{key}.{name}"
            if stored not in handle.keys():
                raise QuantizedCheckpointError(f"{path}: {key} is quantized ({info['format']}) but {stored} is missing")
            arrays[name] = to_array(_restore(handle.get_tensor(stored), dtype))
            used.add(stored)
        out[key] = QuantizedArray(arrays["qdata"], arrays["qscale"], arrays.get("qtensor_scale"), info["format"],
                                  tuple(info["shape"]), int(info["axis"]))
    for key in handle.keys():
        if key not in used:
            out[key] = to_array(handle.get_tensor(key))
    return out


def _storable(array: np.ndarray) -> np.ndarray:
    # FP8 / E8M0 arrays travel as their bytes; safetensors' dtypes do not cover all of them.
    return array.view(np.uint8) if array.dtype.name.startswith("float8") else array


def _restore(array: np.ndarray, dtype: str) -> np.ndarray:
    target = jnp.dtype(dtype)
    return array.view(target) if array.dtype != target else array
