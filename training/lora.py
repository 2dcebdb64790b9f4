"""LoRA adapters on the `Linear` layers of a frozen model: add, split out for training, merge, unmerge, save, load.

An adapter on the layer `W` (out, in) adds `scale * B @ A @ dropout(x)` to its output, with `A` (rank, in) and `B`
(out, rank), `scale = alpha / rank`, as PEFT does. It lives in the layer's `lora` attribute, so its matrices sit at
`<module path>.lora.A` / `.B` beside the untouched `<module path>.weight`: the module path is diffusers' module name
(`transformer_blocks.3.attn.to_q`), and the saved file uses diffusers' LoRA keys
`transformer.<module path>.lora_A.weight` / `.lora_B.weight` (PEFT's layout: lora_A (rank, in), lora_B (out, rank)).

`A` and `B` are `nnx.LoRAParam`s in float32 (the master weights); the forward casts them to the input's dtype, so a
bf16 model computes in bf16. `nnx.split(model, nnx.LoRAParam, ...)` separates them from the frozen base, which is
never differentiated and may hold `quant.QuantizedArray` weights (see `quantize_base`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mxdit.model.layers import Linear
from mxdit.model.loading import module_key, save_safetensors, unreadable_safetensors
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


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """rank and alpha (scale = alpha / rank), dropout on the adapter's input while training, and the layers adapted:
    regular expressions matched in full against each Linear's module path (`transformer_blocks.3.attn.to_q`); empty
    (the default): the model family's attention and MLP projections (`target_preset(model, "attention+mlp")`)."""

    rank: int = 32
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ()

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        for pattern in self.targets:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"LoRA target {pattern!r} is not a regular expression ({e})") from None

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class LoRA(nnx.Module):
    """The adapter of one Linear: `y + scale * (dropout(x) @ A.T) @ B.T`, A (rank, in) and B (out, rank) float32.

    `dropout_key` is set (to a fresh key each step) only on the copy of the model a training step traces; with it
    None, as in the model you hold, there is no dropout. `merged`: the update is in the layer's weight (see
    `merge_lora`), so the adapter adds nothing.
    """

    def __init__(self, in_features: int, out_features: int, config: LoraConfig, key: jax.Array):
        # PEFT's "gaussian" init (diffusers' Krea 2 trainer): A ~ N(0, 1/rank^2), B = 0, so training starts at the base.
        self.A = nnx.LoRAParam(jax.random.normal(key, (config.rank, in_features), jnp.float32) / config.rank)
        self.B = nnx.LoRAParam(jnp.zeros((out_features, config.rank), jnp.float32))
        self.scale = config.scale
        self.dropout = config.dropout
        self.dropout_key = nnx.data(None)
        self.merged = False

    @classmethod
    def from_matrices(cls, A: jax.Array, B: jax.Array, scale: float) -> "LoRA":
        """An adapter with given matrices (a LoRA read from a file): A (rank, in), B (out, rank), float32."""
        rank = A.shape[0]
        lora = cls(A.shape[1], B.shape[0], LoraConfig(rank=rank, alpha=scale * rank), jax.random.key(0))
        lora.A.set_value(jnp.asarray(A, jnp.float32))
        lora.B.set_value(jnp.asarray(B, jnp.float32))
        return lora

    def delta(self) -> jax.Array:
        """The update of the layer's weight, `scale * B @ A` (out, in), float32."""
        return self.scale * jnp.dot(self.B[...], self.A[...], precision=jax.lax.Precision.HIGHEST)

    def __call__(self, x: jax.Array, y: jax.Array) -> jax.Array:
        """x: (..., in), the layer's input; y: (..., out), its output without the adapter."""
        if self.merged:
            return y
        if self.dropout_key is not None and self.dropout > 0:
            keep = jax.random.bernoulli(self.dropout_key, 1.0 - self.dropout, x.shape)
            x = jnp.where(keep, x / (1.0 - self.dropout), 0).astype(x.dtype)
        dims = (((x.ndim - 1,), (1,)), ((), ()))
        h = jax.lax.dot_general(x, self.A[...].astype(x.dtype), dims)
        h = jax.lax.dot_general(h, self.B[...].astype(x.dtype), dims)
        return y + (self.scale * h).astype(y.dtype)


# --------------------------------------------------------------------------------------------------------------------
# Adding, finding, removing


def linear_layers(model: nnx.Module) -> Iterator[tuple[str, Linear]]:
    """(module path, layer) for every Linear of `model`, in graph order."""
    for path, node in nnx.iter_graph(model):
        if isinstance(node, Linear):
            yield module_key(path), node


def adapters(model: nnx.Module) -> Iterator[tuple[str, LoRA]]:
    """(module path of the adapted Linear, adapter), in graph order."""
    for name, layer in linear_layers(model):
        if layer.lora is not None:
            yield name, layer.lora


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


def remove_lora(model: nnx.Module) -> None:
    """Detach every adapter (a merged update stays in the weights: unmerge first to drop it)."""
    for _, layer in linear_layers(model):
        layer.lora = nnx.data(None)


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
        quantized = hasattr(weight, "dequantize")
        target = jnp.dtype(dtype or jnp.bfloat16) if quantized else weight.dtype
        dense = weight.dequantize(jnp.float32) if quantized else weight.astype(jnp.float32)
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
    on checkpoint keys) in place, to `quant.QuantizedArray`s that Linear dequantizes per call (QLoRA-style: the
    memory of the base shrinks, the adapters stay float32). Returns the quantized keys."""
    return quantize_linear_layers(model, rules, kernels=False)


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


DIFFUSERS_METADATA_KEY = "lora_adapter_metadata"  # diffusers' loaders/lora_base.py LORA_ADAPTER_METADATA_KEY


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
