"""LoRA training on a frozen model: target presets, adding adapters, merge, unmerge, quantized base, save, load.

The adapter itself (`LoRA`, `LoraConfig`, `linear_layers`, `adapters`, `remove_lora`) is `model/lora.py`'s: an
adapter on the layer `W` (out, in) adds `scale * B @ A @ dropout(x)`, A (rank, in), B (out, rank), held at
`<module path>.lora.A` / `.B` beside the untouched `<module path>.weight`, the module path being diffusers' module
name (`transformer_blocks.3.attn.to_q`). The saved file uses diffusers' LoRA keys
`transformer.<module path>.lora_A.weight` / `.lora_B.weight` (PEFT's layout: lora_A (rank, in), lora_B (out, rank)).

`nnx.split(model, nnx.LoRAParam, ...)` separates the float32 adapters from the frozen base, which is never
differentiated and may hold the GEMM kernels' quantized weights (see `quantize_base`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mxdit.model.loading import save_safetensors, unreadable_safetensors
from mxdit.model.lora import LoRA, LoraConfig, adapters, linear_layers, remove_lora
from mxdit.model.lora_files import DIFFUSERS_METADATA_KEY, diffusers_metadata
from mxdit.ops.linear import is_gemm_weight
from mxdit.pallas_kernels.gemm.reference import dequantize_weight
from mxdit.quant.model import quantize_linear_layers

# The attention projections (q, k, v, the sigmoid gate, out) and the SwiGLU projections (gate, up, down) of every
# joint block and every text-fusion block: what PEFT's suffix matching of diffusers' Krea 2 names selects.
KREA2_ATTENTION_AND_MLP = (
    r"(transformer_blocks|text_fusion\.(layerwise|refiner)_blocks)\.\d+\."
    r"(attn\.(to_q|to_k|to_v|to_gate|to_out\.0)|ff\.(gate|up|down))",
)
# Attention only: what the Krea 2 authors suggest for long runs.
KREA2_ATTENTION = (r"(transformer_blocks|text_fusion\.(layerwise|refiner)_blocks)\.\d+\.attn\.(to_q|to_k|to_v|to_gate|to_out\.0)",)
# The default set of diffusers' train_dreambooth_lora_krea2.py (the authors' recommendation), as PEFT matches its
# name suffixes: attention and ff.up/ff.down everywhere, plus the input, time, text and output projections.
KREA2_AUTHORS = (
    r"(.*\.)?(to_q|to_k|to_v|to_out\.0|to_gate|ff\.up|ff\.down)",
    r"img_in|final_layer\.linear|text_fusion\.projector|txt_in\.linear_[12]|time_embed\.linear_[12]|time_mod_proj",
)
# FLUX.1: every attention projection (both streams of the double blocks) and the feed-forwards: the default of
# diffusers' train_dreambooth_lora_flux.py (PEFT suffixes, so the single blocks' q/k/v too), plus the single
# blocks' proj_mlp and proj_out, their MLP.
FLUX_ATTENTION_AND_MLP = (
    r"transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)"
    r"|ff\.net\.(0\.proj|2)|ff_context\.net\.(0\.proj|2))",
    r"single_transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v)|proj_mlp|proj_out)",
)
FLUX_ATTENTION = (
    r"transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)",
    r"single_transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v)",
)
# Target presets by model family (`model_family`); "attention+mlp" is each family's default.
TARGET_PRESETS = {
    "krea2": {"attention+mlp": KREA2_ATTENTION_AND_MLP, "attention": KREA2_ATTENTION, "authors": KREA2_AUTHORS},
    "flux": {"attention+mlp": FLUX_ATTENTION_AND_MLP, "attention": FLUX_ATTENTION},
}


# --------------------------------------------------------------------------------------------------------------------
# Adding, finding, removing


def model_family(model: nnx.Module) -> str:
    """"krea2" or "flux": which target presets apply."""
    from mxdit.model.flux import FluxTransformer
    from mxdit.model.krea2 import Krea2Transformer

    if isinstance(model, Krea2Transformer):
        return "krea2"
    if isinstance(model, FluxTransformer):
        return "flux"
    raise ValueError(f"LoRA target presets: no presets for {type(model).__name__}; give the patterns")


def target_preset(model: nnx.Module, name: str) -> tuple[str, ...]:
    """The patterns of preset `name` for `model`'s family; an error names the presets there are."""
    presets = TARGET_PRESETS[model_family(model)]
    if name not in presets:
        raise ValueError(f"LoRA targets: no preset {name!r} for {model_family(model)}; presets: {', '.join(presets)}")
    return presets[name]


def matching_layers(model: nnx.Module, targets: Sequence[str]) -> list[str]:
    """Module paths of the Linears whose path matches one of the `targets` patterns in full."""
    compiled = [re.compile(p) for p in targets]
    return [name for name, _ in linear_layers(model) if any(p.fullmatch(name) for p in compiled)]


def add_lora(model: nnx.Module, config: LoraConfig, seed: int = 0) -> list[str]:
    """Attach a fresh adapter (B = 0: the model's function is unchanged) to every Linear that `config.targets`
    selects; returns their module paths. The base weights are not touched."""
    targets = config.targets or target_preset(model, "attention+mlp")
    names = set(matching_layers(model, targets))
    if not names:
        raise ValueError(f"LoRA targets {list(targets)} match no Linear layer of {type(model).__name__}")
    key = jax.random.key(seed)
    added = []
    for i, (name, layer) in enumerate(linear_layers(model)):
        if name not in names:
            continue
        if layer.lora is not None:
            raise ValueError(f"{name} already has a LoRA adapter; remove_lora(model) first")
        layer.lora = nnx.data(LoRA(layer.in_features, layer.out_features, config, jax.random.fold_in(key, i)))
        added.append(name)
    return added


def lora_config_of(model: nnx.Module) -> tuple[int, float, float]:
    """(rank, scale, dropout) shared by the model's adapters; an error if it has none or they differ."""
    found = {(a.A.shape[0], a.scale, a.dropout) for _, a in adapters(model)}
    if len(found) != 1:
        raise ValueError("the model has no LoRA adapters" if not found else f"adapters differ: {sorted(found)}")
    return found.pop()


# --------------------------------------------------------------------------------------------------------------------
# Merging


def merge_lora(model: nnx.Module, dtype: jnp.dtype | None = None) -> dict[str, jax.Array]:
    """Fold every adapter into its layer's weight, `W + scale * B @ A` computed in float32 and cast to W's dtype (a
    quantized weight becomes a dense one of `dtype`, default bfloat16); the adapters stay attached, switched off.

    Returns the original weights by module path: `unmerge_lora(model, originals)` puts them back bit for bit.
    Dropping them frees their memory (the merge is then permanent)."""
    originals = {}
    for name, layer in linear_layers(model):
        lora = layer.lora
        if lora is None or lora.merged:
            continue
        weight = layer.weight.get_value()
        if is_gemm_weight(weight):  # `quantize_base`'s: k padded to 128
            dense, target = dequantize_weight(weight)[:, :layer.in_features], jnp.dtype(dtype or jnp.bfloat16)
        elif hasattr(weight, "dequantize"):
            dense, target = weight.dequantize(jnp.float32), jnp.dtype(dtype or jnp.bfloat16)
        else:
            dense, target = weight.astype(jnp.float32), weight.dtype
        layer.weight.set_value((dense + lora.delta()).astype(target))
        lora.merged = True
        originals[name] = weight
    return originals


def unmerge_lora(model: nnx.Module, originals: Mapping[str, jax.Array]) -> None:
    """Undo `merge_lora`: the original weights back in place (exactly), the adapters switched on again."""
    for name, layer in linear_layers(model):
        if layer.lora is not None and layer.lora.merged:
            if name not in originals:
                raise ValueError(f"{name}: merged, but its original weight is not in `originals`")
            layer.weight.set_value(originals[name])
            layer.lora.merged = False


# --------------------------------------------------------------------------------------------------------------------
# Quantized base


def quantize_base(model: nnx.Module, rules) -> list[str]:
    """Quantize the frozen weights `rules` select (`quant.model.krea2_rules(fmt)` and the like: (pattern, format)
    on checkpoint keys) in place, to the GEMM kernels' weights, as inference runs them: the forward multiplies
    through the kernels (activations quantized per token) and the backward to the activations multiplies the
    weights' codes (`ops.linear.transposed_product`), never a dequantized copy. The memory of the base shrinks, the
    adapters stay float32. Returns the quantized keys."""
    return quantize_linear_layers(model, rules, kernels=True)


# --------------------------------------------------------------------------------------------------------------------
# Saving and loading (diffusers' key names)

PREFIX = "transformer."
METADATA_KEY = "mxdit.lora"


def lora_state_dict(model: nnx.Module, prefix: str = PREFIX) -> dict[str, np.ndarray]:
    """The adapters as diffusers/PEFT name them: `{prefix}{module}.lora_A.weight` (rank, in) and `.lora_B.weight`
    (out, rank), float32 numpy. The scale alpha / rank is not in the tensors (see `save_lora`)."""
    out = {}
    for name, lora in adapters(model):
        out[f"{prefix}{name}.lora_A.weight"] = np.asarray(lora.A[...])
        out[f"{prefix}{name}.lora_B.weight"] = np.asarray(lora.B[...])
    return out


def save_lora(model: nnx.Module, path: str | Path, config: LoraConfig, extra: Mapping[str, str] | None = None) -> None:
    """Write the adapters to one safetensors file (atomically: temporary file, then rename), with `config` as JSON in
    the metadata key `mxdit.lora` (rank, alpha, targets), the ranks and alphas for diffusers (`diffusers_metadata`)
    and `extra` metadata."""
    metadata = {METADATA_KEY: json.dumps(dataclasses.asdict(config)), DIFFUSERS_METADATA_KEY: diffusers_metadata(model),
                **(extra or {})}
    save_safetensors(lora_state_dict(model), Path(path), metadata=metadata)


def load_lora(model: nnx.Module, path: str | Path) -> LoraConfig:
    """Attach the adapters saved by `save_lora` to `model` (e.g. trained on Krea 2 Base, loaded on Turbo). Errors
    name the file and the module path that does not fit."""
    from safetensors import safe_open

    path = Path(path)
    try:
        handle = safe_open(str(path), framework="numpy")
    except Exception as e:
        raise ValueError(unreadable_safetensors(path, e)) from None
    try:
        config = LoraConfig(**{k: tuple(v) if k == "targets" else v
                               for k, v in json.loads(handle.metadata()[METADATA_KEY]).items()})
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: no mxdit LoRA metadata ({METADATA_KEY!r}): {e}") from None
    tensors = {k: handle.get_tensor(k) for k in handle.keys()}
    layers = dict(linear_layers(model))
    modules = sorted({k[len(PREFIX):].rsplit(".lora_", 1)[0] for k in tensors})
    for name in modules:
        if name not in layers:
            raise ValueError(f"{path}: {name} is not a Linear layer of {type(model).__name__}")
    remove_lora(model)
    add_lora(model, dataclasses.replace(config, targets=tuple(re.escape(m) for m in modules)))
    for name in modules:
        lora = layers[name].lora
        for part, var in (("A", lora.A), ("B", lora.B)):
            key = f"{PREFIX}{name}.lora_{part}.weight"
            if key not in tensors:
                raise ValueError(f"{path}: {key} is missing")
            value = tensors[key]
            if value.shape != var.shape:
                raise ValueError(f"{path}: {name}.lora_{part} has shape {value.shape}, the layer needs {var.shape}")
            var.set_value(jnp.asarray(value, jnp.float32))
    return config
