"""LoRA files as the ecosystem writes them: read (diffusers/PEFT, kohya, ComfyUI / original layouts), apply several at
once with weights (at run time or fused into the weights, quantized ones included), export (diffusers, ComfyUI).

A LoRA updates a Linear's weight W (out, in) by `scale * B @ A`, A (rank, in), B (out, rank), scale = alpha / rank.
The layouts differ in key names and in where alpha lives:

- diffusers/PEFT: `transformer.<module>.lora_A.weight` / `.lora_B.weight` (also without the `transformer.` prefix,
  with PEFT's `.default` adapter name, or PEFT's `base_model.model.` prefix); alpha in the safetensors metadata
  `lora_adapter_metadata` (diffusers' `save_lora_weights`), in an `adapter_config.json` beside the file (PEFT's
  `save_pretrained`), or in `<module>.alpha` tensors; none of them: alpha = rank.
- kohya: `lora_unet_<module with dots as underscores>.lora_down.weight` (A) / `.lora_up.weight` (B) / `.alpha`.
- ComfyUI and the model authors' trainers: `diffusion_model.<module>.lora_A.weight` / `.lora_B.weight` (or
  lora_down / lora_up), alpha as `.alpha` tensors or folded into B.

`<module>` is either diffusers' module path (`transformer_blocks.0.attn.to_q`) or the original release's
(`blocks.0.attn.wq`, FLUX's `double_blocks.0.img_attn.qkv`): names are resolved against the model's own Linear
layers, so kohya's ambiguous underscores are matched with the real paths, and an original layer that fuses several of
ours (FLUX's qkv, linear1) is split by rows of B (A is shared). Keys that match no layer are reported, never dropped.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .loading import CheckpointError, SafetensorsCheckpoint, save_safetensors
from .lora import LoRA, adapters, linear_layers

# (suffix, part): what each key of a LoRA file holds. "A" (rank, in), "B" (out, rank), "alpha" a scalar.
_SUFFIXES = (
    (".lora_A.weight", "A"), (".lora_B.weight", "B"),
    (".lora_A.default.weight", "A"), (".lora_B.default.weight", "B"),
    (".lora_down.weight", "A"), (".lora_up.weight", "B"),
    (".alpha", "alpha"),
)
# Prefixes of the module names, stripped before the name is looked up (longest first).
_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "base_model.model.", "transformer.", "unet.")
_KOHYA_PREFIXES = ("lora_unet_", "lora_transformer_")
LAYOUTS = ("diffusers", "comfyui")
DIFFUSERS_METADATA_KEY = "lora_adapter_metadata"  # diffusers' loaders/lora_base.py LORA_ADAPTER_METADATA_KEY

# A target of a file's module: our module path and the rows of B it takes (None: all; else an index array, for an
# original layer that fuses several of ours or orders its rows otherwise).
Target = tuple[str, "np.ndarray | None"]


class LoraFileError(ValueError):
    """A LoRA file that cannot be used with the model; the message names the file and the keys at fault."""


@dataclasses.dataclass(frozen=True)
class LoraUpdate:
    """One Linear's update `scale * B @ A`: A (rank, in) and B (out, rank) float32 numpy."""

    A: np.ndarray
    B: np.ndarray
    scale: float

    def delta(self) -> np.ndarray:
        """(out, in) float32."""
        return (self.scale * (self.B.astype(np.float64) @ self.A.astype(np.float64))).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class LoraFile:
    """What `read_lora` found: updates by our module path, and the keys that matched no layer (`strict=False`)."""

    path: Path
    updates: dict[str, LoraUpdate]
    unknown: tuple[str, ...] = ()


# --------------------------------------------------------------------------------------------------------------------
# Module names of a model: ours, and the original release's


def _krea2_original_names(paths: Sequence[str]) -> dict[str, list[Target]]:
    from mxdit.model.krea2 import diffusers_key_to_original

    return {diffusers_key_to_original(p + ".weight").removesuffix(".weight"): [(p, None)] for p in paths}


def _flux_original_names(paths: Sequence[str], dim: int) -> dict[str, list[Target]]:
    """The original FLUX module names (black-forest-labs' layout, as kohya and ComfyUI name FLUX LoRAs), mapped to our
    modules as `flux.original_checkpoint_view` maps the weights: fused qkv and linear1 split by rows, the final
    modulation's (shift, scale) halves swapped to diffusers' (scale, shift)."""
    have = set(paths)
    names: dict[str, list[Target]] = {}

    def add(original: str, targets: list[Target]):
        if all(t in have for t, _ in targets):
            names[original] = targets

    def rows(lo: int, hi: int) -> np.ndarray:
        return np.arange(lo, hi)

    for src, dst in (("time_in", "timestep_embedder"), ("vector_in", "text_embedder"), ("guidance_in", "guidance_embedder")):
        add(f"{src}.in_layer", [(f"time_text_embed.{dst}.linear_1", None)])
        add(f"{src}.out_layer", [(f"time_text_embed.{dst}.linear_2", None)])
    add("txt_in", [("context_embedder", None)])
    add("img_in", [("x_embedder", None)])
    add("final_layer.linear", [("proj_out", None)])
    add("final_layer.adaLN_modulation.1", [("norm_out.linear", np.concatenate([rows(dim, 2 * dim), rows(0, dim)]))])
    doubles = sorted({int(p.split(".")[1]) for p in paths if p.startswith("transformer_blocks.")})
    singles = sorted({int(p.split(".")[1]) for p in paths if p.startswith("single_transformer_blocks.")})
    for i in doubles:
        o, n = f"double_blocks.{i}.", f"transformer_blocks.{i}."
        add(f"{o}img_mod.lin", [(f"{n}norm1.linear", None)])
        add(f"{o}txt_mod.lin", [(f"{n}norm1_context.linear", None)])
        add(f"{o}img_attn.qkv", [(f"{n}attn.{x}", rows(j * dim, (j + 1) * dim)) for j, x in enumerate(("to_q", "to_k", "to_v"))])
        add(f"{o}txt_attn.qkv", [(f"{n}attn.add_{x}_proj", rows(j * dim, (j + 1) * dim)) for j, x in enumerate("qkv")])
        add(f"{o}img_attn.proj", [(f"{n}attn.to_out.0", None)])
        add(f"{o}txt_attn.proj", [(f"{n}attn.to_add_out", None)])
        add(f"{o}img_mlp.0", [(f"{n}ff.net.0.proj", None)])
        add(f"{o}img_mlp.2", [(f"{n}ff.net.2", None)])
        add(f"{o}txt_mlp.0", [(f"{n}ff_context.net.0.proj", None)])
        add(f"{o}txt_mlp.2", [(f"{n}ff_context.net.2", None)])
    for i in singles:
        o, n = f"single_blocks.{i}.", f"single_transformer_blocks.{i}."
        add(f"{o}modulation.lin", [(f"{n}norm.linear", None)])
        add(f"{o}linear2", [(f"{n}proj_out", None)])
        bounds = [0, dim, 2 * dim, 3 * dim, 7 * dim]  # linear1 stacks q, k, v and the MLP input (4 * dim rows)
        add(f"{o}linear1", [(f"{n}{x}", rows(bounds[j], bounds[j + 1]))
                            for j, x in enumerate(("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"))])
    return names


def module_names(model: nnx.Module) -> dict[str, list[Target]]:
    """Every name a LoRA file may use for a Linear of `model`: our module paths (diffusers'), and for Krea 2 and
    FLUX.1 the original release's names. name -> [(our module path, rows of B or None)]."""
    from mxdit.model.flux import FluxTransformer
    from mxdit.model.krea2 import Krea2Transformer

    paths = [name for name, _ in linear_layers(model)]
    names: dict[str, list[Target]] = {p: [(p, None)] for p in paths}
    if isinstance(model, Krea2Transformer):
        original = _krea2_original_names(paths)
    elif isinstance(model, FluxTransformer):
        original = _flux_original_names(paths, model.config.inner_dim)
    else:
        original = {}
    for name, targets in original.items():
        if name in names and names[name] != targets:  # would make the layout ambiguous: a bug in the map
            raise AssertionError(f"{type(model).__name__}: original name {name} is also one of our module paths")
        names[name] = targets
    return names


def _kohya_names(names: Mapping[str, list[Target]]) -> dict[str, str | None]:
    """kohya's name (dots as underscores) -> the dotted name; None where two dotted names collide."""
    out: dict[str, str | None] = {}
    for name in names:
        flat = name.replace(".", "_")
        out[flat] = None if flat in out and out[flat] != name else name
    return out


# --------------------------------------------------------------------------------------------------------------------
# Reading


def _split_key(key: str) -> tuple[str, str] | None:
    for suffix, part in _SUFFIXES:
        if key.endswith(suffix):
            return key[: -len(suffix)], part
    return None


def _strip(name: str) -> tuple[str, bool]:
    """(module name without its layout prefix, whether it is kohya's underscore form)."""
    for prefix in _KOHYA_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :], True
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :], False
    return name, False


def _alpha_source(path: Path, metadata: Mapping[str, str]) -> tuple[float | None, dict[str, float]]:
    """(default alpha, per-module alpha patterns) from diffusers' metadata, mxdit's, or an adapter_config.json beside
    the file (PEFT); (None, {}) when none says (alpha = rank)."""
    config = None
    if DIFFUSERS_METADATA_KEY in metadata:
        packed = json.loads(metadata[DIFFUSERS_METADATA_KEY])
        config = {k.removeprefix("transformer."): v for k, v in packed.items() if k.startswith("transformer.")}
    elif "mxdit.lora" in metadata:
        mx = json.loads(metadata["mxdit.lora"])
        config = {"lora_alpha": mx["alpha"]}  # (files written before save_lora wrote diffusers' metadata too)
    elif (path.parent / "adapter_config.json").is_file():
        config = json.loads((path.parent / "adapter_config.json").read_text())
    if not config or config.get("lora_alpha") is None:
        return None, {}
    return float(config["lora_alpha"]), {k: float(v) for k, v in (config.get("alpha_pattern") or {}).items()}


def _pattern_alpha(name: str, patterns: Mapping[str, float]) -> float | None:
    # PEFT matches a pattern against the end of the module name, at a dot boundary.
    for pattern, alpha in patterns.items():
        if re.fullmatch(rf"(.*\.)?{pattern}", name):
            return alpha
    return None


def read_lora(path: str | Path, model: nnx.Module, strict: bool = True) -> LoraFile:
    """Read a LoRA safetensors file (or a PEFT folder holding `adapter_model.safetensors`) for `model`, in any layout
    of the module docstring. Returns the updates by our module path, A (rank, in) and B (out, rank) float32 with the
    scale alpha / rank. `strict`: keys that match no Linear of `model` (text-encoder LoRAs, DoRA scales, biases, ...)
    raise a `LoraFileError` listing them; False: they are returned in `.unknown`."""
    path = Path(path)
    if path.is_dir():  # a PEFT folder; its adapter_model.bin (a pickle) gets that error
        path = next((path / n for n in ("adapter_model.safetensors", "adapter_model.bin") if (path / n).is_file()),
                    path / "adapter_model.safetensors")
    try:
        checkpoint = SafetensorsCheckpoint([path])
    except CheckpointError as e:
        raise LoraFileError(str(e)) from None
    metadata = checkpoint._open(path).metadata() or {}
    default_alpha, alpha_patterns = _alpha_source(path, metadata)
    names = module_names(model)
    kohya = _kohya_names(names)
    layers = dict(linear_layers(model))

    groups: dict[str, dict[str, str]] = {}  # file's module name (prefix stripped) -> part -> key
    resolved: dict[str, str] = {}  # file's module name -> name in `names`
    unknown = []
    for key in checkpoint.keys():
        split = _split_key(key)
        if split is None:
            unknown.append(key)
            continue
        raw, part = split
        name, is_kohya = _strip(raw)
        found = kohya.get(name) if is_kohya else (name if name in names else None)
        if found is None:
            unknown.append(key)
            continue
        resolved[raw] = found
        groups.setdefault(raw, {})[part] = key
    if unknown and strict:
        raise LoraFileError(f"{path}: keys that match no Linear layer of {type(model).__name__} "
                            f"({len(unknown)}): {_listing(unknown)}")

    updates: dict[str, LoraUpdate] = {}
    for raw, parts in groups.items():
        missing = [p for p in ("A", "B") if p not in parts]
        if missing:
            raise LoraFileError(f"{path}: {raw} has no lora_{'/lora_'.join(missing)} weight")
        A = np.asarray(checkpoint.get(parts["A"]), np.float32)
        B = np.asarray(checkpoint.get(parts["B"]), np.float32)
        if A.ndim != 2 or B.ndim != 2 or A.shape[0] != B.shape[1]:
            raise LoraFileError(f"{path}: {raw}: lora_A {A.shape} and lora_B {B.shape} are not (rank, in), (out, rank)")
        rank = A.shape[0]
        name = resolved[raw]
        if "alpha" in parts:
            alpha = float(np.asarray(checkpoint.get(parts["alpha"]), np.float32).reshape(-1)[0])
        else:
            alpha = _pattern_alpha(name, alpha_patterns)
            if alpha is None:
                alpha = float(rank) if default_alpha is None else default_alpha
        targets = names[name]
        total_rows = sum(layers[t].out_features if rows is None else len(rows) for t, rows in targets)
        if B.shape[0] != total_rows:
            raise LoraFileError(f"{path}: {raw}: lora_B has {B.shape[0]} rows, the layer ({name}) has {total_rows}")
        for target, rows in targets:
            layer = layers[target]
            if A.shape[1] != layer.in_features:
                raise LoraFileError(f"{path}: {raw}: lora_A has {A.shape[1]} inputs, {target} has {layer.in_features}")
            if target in updates:
                raise LoraFileError(f"{path}: {target} is adapted twice (by {raw} and another key)")
            updates[target] = LoraUpdate(A, B if rows is None else B[rows], alpha / rank)
    return LoraFile(path, updates, tuple(sorted(unknown)))


def _listing(keys: Sequence[str], limit: int = 8) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:limit])
    return f"{shown} (and {len(keys) - limit} more)" if len(keys) > limit else shown


# --------------------------------------------------------------------------------------------------------------------
# Applying


def parse_lora_arg(spec: str) -> tuple[Path, float]:
    """`FILE[:WEIGHT]` (generate.py's --lora) -> (path, weight); the weight defaults to 1.0. A `spec` that names an
    existing file is that file, colons and all; otherwise the text after the last colon is the weight, unless it reads
    as part of a path (a separator or a dot in it, as in C:/x.safetensors). A weight that is not a finite number
    raises ValueError naming it (and the file, when that is missing too)."""
    if Path(spec).is_file():
        return Path(spec), 1.0
    path, sep, weight = spec.rpartition(":")
    if not sep or not path:
        return Path(spec), 1.0
    try:
        value = float(weight)
    except ValueError:
        value = None
    if value is not None and math.isfinite(value):
        return Path(path), value
    if value is None and not Path(path).is_file() and any(c in weight for c in "/\\."):
        return Path(spec), 1.0  # a path with a colon, not a weight
    missing = "" if Path(path).is_file() else f"; and {path}: no such file"
    raise ValueError(f"weight {weight!r} is not a finite number (FILE[:WEIGHT], e.g. {path}:0.8){missing}")


def apply_loras(model: nnx.Module, loras: Sequence[tuple[str | Path | LoraFile, float]], fuse: bool = False) -> list[str]:
    """Apply LoRA files, each `(path or LoraFile, weight)`, to `model`; returns the module paths changed.

    Run time (`fuse=False`): each adapted Linear gets one adapter (`Linear.lora`) holding all files' updates stacked
    along the rank, A = [A_1; A_2; ...], B = [w_1 s_1 B_1, w_2 s_2 B_2, ...], scale 1: the sum of the weighted
    updates at the cost of rank_1 + rank_2 + ... extra columns. `remove_lora(model)` takes them off. The model must
    have no adapters yet.

    Fused (`fuse=True`): `W + sum_i w_i s_i B_i @ A_i`, computed in float32 and cast to W's dtype; no cost per call,
    not undoable. A quantized weight (`quant.QuantizedArray`) is dequantized to float32, the update added and the
    result re-quantized in the same format and axis: the fused weight then carries that format's rounding error of
    the sum (e.g. fp8 e4m3's ~2^-4 relative per element), not of the base alone. Measured on the tiny Krea 2
    fixture with an MXFP8 (E4M3) base: output relative L2 to diffusers' float32 2.0e-2 without the LoRA, 3.2e-2 with
    it fused (float32 dense: 4e-7).
    """
    layers = dict(linear_layers(model))
    by_module = _updates_by_module(model, loras)
    if fuse:
        for name, updates in by_module.items():
            _fuse(layers[name], sum(w * u.delta() for u, w in updates))
        return list(by_module)
    adapted = [name for name, layer in layers.items() if layer.lora is not None]
    if adapted:
        raise ValueError(f"{type(model).__name__} already has LoRA adapters ({adapted[0]}, ...); remove_lora(model) "
                         "first, or fuse=True")
    for name, updates in by_module.items():
        A = np.concatenate([u.A for u, _ in updates], axis=0)
        B = np.concatenate([w * u.scale * u.B for u, w in updates], axis=1)
        layers[name].lora = nnx.data(LoRA.from_matrices(A, B, 1.0))
    return list(by_module)


def _updates_by_module(model: nnx.Module, loras) -> dict[str, list[tuple[LoraUpdate, float]]]:
    files = [(lora if isinstance(lora, LoraFile) else read_lora(lora, model), float(weight)) for lora, weight in loras]
    by_module: dict[str, list[tuple[LoraUpdate, float]]] = {}
    for file, weight in files:
        for name, update in file.updates.items():
            by_module.setdefault(name, []).append((update, weight))
    return by_module


def fused_update_loss(model: nnx.Module, loras, rules) -> float:
    """How much of the LoRAs fused into `model` (`apply_loras(fuse=True)`) quantizing the weights as `rules` say
    (`quant.model.krea2_rules(fmt)` and the like) loses: for each fused layer the rules quantize, its weight W and
    W - update, each quantized and dequantized; the relative L2 of their difference against the update, over all
    those layers. 0: the update survives exactly; 1: its error is as large as the update (a small update can round
    away entirely in INT8 or 4-bit storage). 0.0 where the rules quantize none of them."""
    from mxdit.quant.model import format_for

    layers = dict(linear_layers(model))
    error = total = 0.0
    for name, updates in _updates_by_module(model, loras).items():
        fused = jnp.asarray(layers[name].weight.get_value(), jnp.float32)
        fmt = format_for(name + ".weight", tuple(fused.shape), rules)
        if not fmt:
            continue
        layer_error, layer_total = _update_rounding(fused, jnp.asarray(sum(w * u.delta() for u, w in updates)), fmt)
        error += float(layer_error)
        total += float(layer_total)
    return (error / total) ** 0.5 if total else 0.0


@functools.partial(jax.jit, static_argnames="fmt")
def _update_rounding(fused: jax.Array, update: jax.Array, fmt: str) -> tuple[jax.Array, jax.Array]:
    """The squared error of `update` as quantizing W = `fused` and W - update in `fmt` leaves it, and its squared
    norm (one program a shape and format)."""
    from mxdit.quant.formats import quantize

    survived = quantize(fused, fmt).dequantize() - quantize(fused - update, fmt).dequantize()
    return jnp.sum(jnp.square(survived - update)), jnp.sum(jnp.square(update))


class LoraSlots:
    """LoRA files held at run time with a weight each that can change between calls without recompiling: every
    adapted Linear gets one adapter stacking all files' updates along the rank (as `apply_loras`), whose shapes never
    change; `set_weights` only rescales the columns of B (a weight of 0 turns a file off). Made by `lora_slots`."""

    def __init__(self, layers: dict, parts: dict[str, list[tuple[str, jax.Array]]], names: Sequence[str]):
        self._layers, self._parts, self.names = layers, parts, tuple(names)
        self.weights = dict.fromkeys(self.names, 0.0)

    def set_weights(self, weights: Mapping[str, float]) -> None:
        """The weight of each file by name; names not given get 0. Raises ValueError naming an unknown LoRA."""
        unknown = [name for name in weights if name not in self.weights]
        if unknown:
            raise ValueError(f"unknown LoRA {unknown[0]!r} (loaded: {', '.join(self.names) or 'none'})")
        new = {name: float(weights.get(name, 0.0)) for name in self.names}
        if new == self.weights:
            return
        for module, parts in self._parts.items():
            B = jnp.concatenate([new[name] * b for name, b in parts], axis=1)
            old = self._layers[module].lora.B.get_value()
            # where the old one was: on a mesh, the sharded programs take the adapters placed as sharding left them
            self._layers[module].lora.B.set_value(jax.device_put(B, old.sharding))
        self.weights = new


def lora_slots(model: nnx.Module, files: Mapping[str, str | Path | LoraFile]) -> LoraSlots:
    """Attach LoRA files by name (`{"style": "style.safetensors"}`), all at weight 0, as `LoraSlots`. The model must
    have no adapters yet; `remove_lora(model)` takes them off."""
    read = {name: (f if isinstance(f, LoraFile) else read_lora(f, model)) for name, f in files.items()}
    layers = dict(linear_layers(model))
    adapted = [name for name, layer in layers.items() if layer.lora is not None]
    if adapted:
        raise ValueError(f"{type(model).__name__} already has LoRA adapters ({adapted[0]}, ...)")
    parts: dict[str, list[tuple[str, jax.Array]]] = {}
    for module in sorted({m for f in read.values() for m in f.updates}):
        updates = [(name, f.updates[module]) for name, f in read.items() if module in f.updates]
        A = np.concatenate([u.A for _, u in updates], axis=0)
        parts[module] = [(name, jnp.asarray(u.scale * u.B, jnp.float32)) for name, u in updates]
        out_features = updates[0][1].B.shape[0]
        layers[module].lora = nnx.data(LoRA.from_matrices(A, np.zeros((out_features, A.shape[0]), np.float32), 1.0))
    return LoraSlots(layers, parts, list(read))


def _fuse(layer, delta: np.ndarray) -> None:
    weight = layer.weight.get_value()
    if hasattr(weight, "dequantize"):
        per_tensor = weight.format.kind == "fp8" and weight.scale.size == 1
        layer.weight.set_value(_fused_quantized(weight, jnp.asarray(delta), per_tensor=per_tensor))
    else:
        layer.weight.set_value((weight.astype(jnp.float32) + jnp.asarray(delta)).astype(weight.dtype))


@functools.partial(jax.jit, static_argnames="per_tensor")
def _fused_quantized(weight, delta: jax.Array, per_tensor: bool):
    """A quantized weight plus `delta`, quantized again in its format (one program a shape and format: op by op,
    every operation of the dequantization and the quantization would compile for each new shape)."""
    from mxdit.quant.formats import quantize

    return quantize(weight.dequantize(jnp.float32) + delta, weight.fmt, weight.axis, per_tensor=per_tensor)


# --------------------------------------------------------------------------------------------------------------------
# Exporting


def diffusers_metadata(model: nnx.Module) -> str:
    """The adapters' ranks and alphas as diffusers' `save_lora_weights` writes them in the safetensors metadata
    `lora_adapter_metadata` (PEFT LoraConfig fields prefixed `transformer.`), which `load_lora_weights` reads: the
    most common rank and alpha, others in rank_pattern / alpha_pattern. Without it diffusers takes alpha = rank.
    PEFT matches a pattern against the end of a module path, after any prefix ending in a dot, so each is anchored
    with `^` (as diffusers anchors its own): else FLUX's `proj_out` matches `single_transformer_blocks.N.proj_out`."""
    ranks = {name: int(a.A.shape[0]) for name, a in adapters(model)}
    alphas = {name: float(a.scale) * ranks[name] for name, a in adapters(model)}
    rank = max(set(ranks.values()), key=list(ranks.values()).count)
    alpha = max(set(alphas.values()), key=list(alphas.values()).count)
    config = {"r": rank, "lora_alpha": alpha, "target_modules": sorted(ranks),
              "rank_pattern": {"^" + re.escape(n): r for n, r in ranks.items() if r != rank},
              "alpha_pattern": {"^" + re.escape(n): a for n, a in alphas.items() if a != alpha}}
    return json.dumps({f"transformer.{k}": v for k, v in config.items()}, sort_keys=True)


def export_lora(model: nnx.Module, path: str | Path, layout: str = "diffusers") -> None:
    """Write the model's adapters (`lora.LoRA`s, merged or not) to the safetensors file `path`.

    "diffusers": `transformer.<module>.lora_A.weight` (rank, in) / `.lora_B.weight` (out, rank) float32, with rank and
    alpha in the metadata `lora_adapter_metadata` as diffusers' `save_lora_weights` writes them, which is what
    `pipe.load_lora_weights(file)` reads (a single file needs no adapter_config.json).
    "comfyui": `diffusion_model.<original module name>.lora_A.weight` / `.lora_B.weight` with the scale alpha / rank
    folded into lora_B, because diffusers' reader of that layout rejects `.alpha` keys and ComfyUI takes alpha = rank
    without them (Krea 2 only: the original names of its layers map one to one)."""
    from mxdit.model.krea2 import Krea2Transformer

    if layout not in LAYOUTS:
        raise ValueError(f"LoRA layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    found = list(adapters(model))
    if not found:
        raise ValueError(f"{type(model).__name__} has no LoRA adapters to export")
    tensors, metadata = {}, {"format": "pt"}
    if layout == "diffusers":
        metadata[DIFFUSERS_METADATA_KEY] = diffusers_metadata(model)
        for name, a in found:
            tensors[f"transformer.{name}.lora_A.weight"] = np.asarray(a.A[...], np.float32)
            tensors[f"transformer.{name}.lora_B.weight"] = np.asarray(a.B[...], np.float32)
    else:
        if not isinstance(model, Krea2Transformer):
            raise ValueError(f"the ComfyUI LoRA layout is written for Krea 2 only, not {type(model).__name__}")
        original = {targets[0][0]: name for name, targets in _krea2_original_names([n for n, _ in found]).items()}
        for name, a in found:
            tensors[f"diffusion_model.{original[name]}.lora_A.weight"] = np.asarray(a.A[...], np.float32)
            tensors[f"diffusion_model.{original[name]}.lora_B.weight"] = np.asarray(a.scale * a.B[...], np.float32)
    save_safetensors(tensors, Path(path), metadata=metadata)
