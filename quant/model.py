"""Model quantization: a model's parameters quantized by rules, their storage size, the quantized checkpoint format,
and the models' Linear layers quantized in place for the GEMM kernels or simulated in their own precision.

Parameters are a flat mapping of checkpoint keys (diffusers names, as `model.loading.iter_params` yields them) to
arrays. A rule set is an ordered list of (regular expression, format or None); the first rule whose pattern matches
a key decides, None keeping the tensor as it is. The default rule sets quantize the large matrices of the repeated
blocks and keep in 16-bit the small, sensitive rest: embeddings and input projections, time and text projections,
modulation tables, norms and the final layer.

Quantized checkpoint: one safetensors file. A QuantizedArray under key K is stored as `K.qdata`, `K.qscale` (and
`K.qtensor_scale` for NVFP4), as raw bytes (uint8) or int8/float32; the file's metadata `mxdit.quant` is a JSON map
K -> {"format", "shape", "axis", "dtypes"} from which the arrays are rebuilt bit for bit.

In a model: `quantize_linear_layers` (in place), `quantize_on_load` (as the checkpoint is read) and
`load_quantized_model` (from a quantized checkpoint) make the Linear layers' weights the GEMM kernels' (`GemmWeight`,
inference) or `QuantizedArray`s dequantized per call (training's frozen base); `with_params` and
`quantize_activations` simulate a format in the model's own precision (weights, activations).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from mxdit.model.layers import Linear
from mxdit.model.loading import (CheckpointError, key_problems, module_key, placed, save_safetensors,
                                 unreadable_safetensors)
from mxdit.ops.linear import is_gemm_weight
from mxdit.pallas_kernels.gemm import WEIGHT_FORMATS, concat_weights, prepare_weight

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


def minimax_h3_rules(fmt: str) -> list[tuple[str, str | None]]:
    """MiniMax H3: the attention (q, k, v, out) and SwiGLU matrices of the blocks and of the text refiner in `fmt`;
    the AdaLN projections (a few rows each: one per timestep and modality), the input and output projections and the
    timestep MLP stay."""
    matrices = r"\.(attn\.(to_q|to_k|to_v|to_out\.0)|ff\.net\.(0\.proj|2))\.weight$"
    return [(r"^(transformer_blocks|token_refiner\.refiner_blocks)\.\d+" + matrices, fmt)]


def any_family_rules(fmt: str) -> list[tuple[str, str | None]]:
    """Krea 2's and FLUX.1's rules together: each selects only its own blocks' matrices (the text encoders' keys match
    neither), so a loader can quantize as it reads before it knows the family, and any transformer takes them."""
    return krea2_rules(fmt) + flux_rules(fmt)


def format_for(key: str, shape: tuple[int, ...], rules: Rules) -> str | None:
    """The format `rules` give the parameter `key` (None: kept as it is)."""
    for pattern, fmt in rules:
        if re.search(pattern, key):
            return fmt if len(shape) == 2 else None  # only matrices are quantized (norm gains are vectors)
    return None


def quantize_model(params: Mapping[str, jax.Array], rules: Rules) -> dict[str, jax.Array | QuantizedArray]:
    """Quantize the parameters the rules select (along the reduction axis, the last); others are returned as given."""
    return dict(_quantized(params, rules))


def fake_quantize_model(params: Mapping[str, jax.Array | np.ndarray], rules: Rules,
                        dtype=jnp.bfloat16) -> dict[str, jax.Array | np.ndarray]:
    """`dequantize_model(quantize_model(params, rules), dtype)` a tensor at a time: the weights in a format, back in
    `dtype`, with the codes of one tensor alive at once, not the whole model's beside its two copies."""
    return {key: _dequantize(value, dtype) if isinstance(value, QuantizedArray) else value
            for key, value in _quantized(params, rules)}


def _quantized(params: Mapping[str, jax.Array | np.ndarray],
               rules: Rules) -> Iterator[tuple[str, jax.Array | np.ndarray | QuantizedArray]]:
    unknown = {fmt for _, fmt in rules if fmt is not None and fmt not in FORMATS}
    if unknown:
        raise ValueError(f"unknown format(s) in rules: {sorted(unknown)}; known: {', '.join(FORMATS)}")
    quantize_jit = jax.jit(quantize, static_argnames=("fmt", "axis", "per_tensor"))
    for key, value in params.items():
        fmt = format_for(key, tuple(value.shape), rules)
        yield key, (quantize_jit(value, fmt=fmt) if fmt else value)


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


# --------------------------------------------------------------------------------------------------------------------
# A model's Linear layers


@functools.cache
def _weight_quantizers():
    """The jitted quantizer and kernel-layout preparation, made once per process (not per model or per load)."""
    return jax.jit(quantize, static_argnames=("fmt",)), jax.jit(prepare_weight, static_argnames=("backend",))


def weight_layout() -> str:
    """The GEMM weights' layout for this device's kernels (`gemm.prepare_weight`'s backend): Triton's (MX codes
    packed, unpacked in the kernel) where the Triton GEMM runs every format, else Mosaic's, which also serves the
    reference off a GPU."""
    from mxdit.ops.kernels import kernel_family

    return "triton" if kernel_family() == "triton" else "mosaic"


def _quantized_weight(weight: jax.Array, fmt: str, kernels: bool):
    """`weight` in `fmt`: a `GemmWeight` for the kernels, else a `QuantizedArray`. The Mosaic layout (MX exponents
    folded per 128 x 128 tile) also serves the reference; INT8 weights keep theirs (channel scales) for Triton."""
    quantize_jit, prepare_jit = _weight_quantizers()
    q = quantize_jit(weight, fmt=fmt)
    return prepare_jit(q, backend=weight_layout()) if kernels else q


def quantize_linear_layers(model: nnx.Module, rules: Rules, *, kernels: bool) -> list[str]:
    """Quantize, in place, the weights of the Linear layers that `rules` select (`krea2_rules(fmt)` and the like).
    `kernels`: to `GemmWeight`s that the low-precision GEMM kernels multiply directly (inference: activations
    quantized per token, W8A8 / MX weights); else to `QuantizedArray`s dequantized per call (training's frozen
    base). One weight at a time, so the device never holds a second full copy of the model. Stacked projections
    (`stack_projections`) are quantized as their sources would have been, or refused with the reason. Returns the
    quantized keys."""
    done = []
    for path, layer in nnx.iter_graph(model):
        if not isinstance(layer, Linear):
            continue
        key = module_key(path) + ".weight"
        weight = layer.weight.get_value()
        if isinstance(weight, QuantizedArray) or is_gemm_weight(weight):  # quantized already
            continue
        if getattr(layer, "stacked_from", None):
            if (stacked := _quantized_stacked_weight(key, weight, layer.stacked_from, rules, kernels)) is not None:
                layer.weight.set_value(stacked)
                done.append(key)
            continue
        fmt = format_for(key, tuple(weight.shape), rules)
        if fmt:
            layer.weight.set_value(_quantized_weight(weight, fmt, kernels))
            done.append(key)
    return done


def _quantized_stacked_weight(key: str, weight: jax.Array, stacked_from, rules: Rules, kernels: bool):
    """A stacked Linear's weight quantized as its sources would have been (the rules name the checkpoint's
    projections, not the stacked one), then stacked: the same weight as quantizing before stacking. None when the
    rules select none of them."""
    parent = key.rsplit(".", 2)[0]
    parts, start, formats = [], 0, []
    for name, width in stacked_from:
        part = weight[start:start + width]
        start += width
        parts.append(part)
        formats.append(format_for(f"{parent}.{name}.weight", tuple(part.shape), rules))
    if not any(formats):
        return None
    names = ", ".join(name for name, _ in stacked_from)
    if len(set(formats)) > 1 or not kernels:
        why = (f"its rules give different formats ({', '.join(str(f) for f in formats)})" if len(set(formats)) > 1
               else "stacked layers are for inference (kernels=True)")
        raise ValueError(f"quantize_linear_layers: {key} is stacked from {names} and {why}; quantize before stacking "
                         f"the projections")
    try:
        return concat_weights([_quantized_weight(part, formats[0], kernels) for part in parts])
    except ValueError as e:
        raise ValueError(f"quantize_linear_layers: {key} (stacked from {names}): {e}; quantize before stacking the "
                         f"projections") from None


def quantize_on_load(rules: Rules):
    """For `model.loading.place_parameters`: the matrices `rules` select become kernel weights (as
    `quantize_linear_layers` makes them) as they are read, so that the device never holds the model in bf16, one
    tensor at most."""

    def place(key: str, value: jax.Array):
        if isinstance(value, QuantizedArray):  # read in its format as stored (`loading.keep_file_blocks`)
            _, prepare_jit = _weight_quantizers()
            return prepare_jit(value, backend=weight_layout()) if value.fmt in WEIGHT_FORMATS else value
        fmt = format_for(key, tuple(value.shape), rules)
        return _quantized_weight(value, fmt, kernels=True) if fmt else value

    return place


def load_quantized_model(build, path) -> nnx.Module:
    """The module `build()` makes (only traced) with its parameters from mxdit's quantized checkpoint (one file from
    scripts/quantize.py, `save_quantized`): the quantized matrices become the GEMM kernels' weights as they are read
    (as `quantize_linear_layers(kernels=True)` makes them: the device never holds them in bf16), the other tensors
    are cast to the module's dtypes; the file is read into host memory and each tensor moves to the device as it is
    placed (through `model.loading.place_parameters`, e.g. streamed blocks on to host memory). Errors name the file
    and the keys."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    try:
        params = load_quantized(path, on_host=True)
    except QuantizedCheckpointError as e:
        raise CheckpointError(str(e)) from None
    abstract = nnx.eval_shape(build)
    graphdef, state = nnx.split(abstract)
    flat = nnx.to_flat_state(state)
    expected = {module_key(p): v for p, v in flat}
    problems = key_problems(expected, params)
    untaken = []  # quantized tensors the GEMM kernels cannot multiply
    for key in sorted(set(expected) & set(params)):
        value, want = params[key], expected[key].get_value()
        if tuple(value.shape) != tuple(want.shape):
            problems.append(f"{key}: file has shape {tuple(value.shape)}, model expects {tuple(want.shape)}")
        elif isinstance(value, QuantizedArray) and (value.fmt not in WEIGHT_FORMATS or len(value.shape) != 2
                                                     or value.axis != 1):
            untaken.append(f"{key}: {value.fmt} along axis {value.axis}")
    if untaken:
        problems.append(f"{len(untaken)} quantized tensors the GEMM kernels do not take ({', '.join(untaken[:3])}"
                        f"{', ...' if len(untaken) > 3 else ''}); they take 2-D weights quantized along their last "
                        f"axis in {', '.join(WEIGHT_FORMATS)}")
    if problems:
        raise CheckpointError(f"{path}: cannot load into {type(abstract).__name__}: " + " | ".join(problems[:12]))
    _, prepare_jit = _weight_quantizers()
    for p, variable in flat:
        key = module_key(p)
        value = params.pop(key)  # dropped as used: the file's arrays are freed one by one
        if isinstance(value, QuantizedArray):
            value = prepare_jit(value, backend=weight_layout())
        else:
            value = jax.device_put(value).astype(variable.get_value().dtype)
        variable.set_value(placed(key, value))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def with_params(module: nnx.Module, params: Mapping[str, jax.Array | np.ndarray]) -> nnx.Module:
    """A copy of `module` whose parameters (by checkpoint key) are replaced by `params`, cast to their dtypes, on the
    device: with `fake_quantize_model`, the model's weights in a format, computed in its own precision."""
    module = nnx.clone(module)
    set_params(module, params, cast=True)
    return module


def set_params(module: nnx.Module, params: Mapping[str, jax.Array | np.ndarray], *, cast: bool = False) -> None:
    """Replace `module`'s variables named in `params` (by checkpoint key), in place: as given (host arrays stay on
    the host), or with `cast` as device arrays of the variables' dtypes."""
    flat = nnx.to_flat_state(nnx.state(module))
    for path, variable in flat:
        key = module_key(path)
        if key in params:
            value = params[key]
            variable.set_value(jnp.asarray(value, variable.get_value().dtype) if cast else value)
    nnx.update(module, nnx.from_flat_state(flat))


def quantize_activations(module: nnx.Module, rules: Rules) -> nnx.Module:
    """A copy of `module` whose Linear layers selected by `rules` (by their weight's key) quantize their inputs and
    dequantize them again before the product (`Linear.activation_format`)."""
    module = nnx.clone(module)
    for path, node in nnx.iter_graph(module):
        if isinstance(node, Linear):
            node.activation_format = format_for(module_key(path) + ".weight", tuple(node.weight.shape), rules)
    return module
