"""The FLUX.1 transformer in Flax NNX, equal in function to diffusers' `FluxTransformer2DModel` (0.42.1).

Read top to bottom: norms, time/text embeddings, attention, feed-forward, the double-stream block (separate text and
image weights, joint attention), the single-stream block (fused attention and MLP), the model, then loading, including
the original single-file layout (`flux1-dev.safetensors`), whose fused QKV tensors are split on the fly.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mxdit.ops.attention import AttentionFn, apply_rotary, attention, attention_implementation
from mxdit.ops.linear import FP8Activations, fp8_input_backend, fused_fp8_producer
from mxdit.ops.names import AttentionKernel

from .layers import Linear, MLPEmbedder, NoParams, remat_call, rotary_tables, stacked_linear, timestep_sinusoids
from .loading import (Checkpoint, CheckpointError, DerivedCheckpoint, KeyMap, Rows, config_from_dict, load_state,
                      open_checkpoint, read_json)


@dataclasses.dataclass(frozen=True)
class FluxConfig:
    """The transformer's config.json (diffusers names); defaults are FLUX.1-dev's."""

    patch_size: int = 1
    in_channels: int = 64
    out_channels: int | None = None
    num_layers: int = 19
    num_single_layers: int = 38
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 4096
    pooled_projection_dim: int = 768
    guidance_embeds: bool = True
    axes_dims_rope: tuple[int, int, int] = (16, 56, 56)

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @classmethod
    def from_json(cls, path: str | Path) -> "FluxConfig":
        return config_from_dict(cls, read_json(Path(path)), str(path))


def layer_norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """LayerNorm without learned scale or shift, computed in float32."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + eps)).astype(x.dtype)


def _adaptive_norm(x, scale, shift, consumers: list[Linear]):
    """`layer_norm(x) * (1 + scale) + shift`; for layers that multiply FP8 activations, quantized in the same pass
    (pallas_kernels/activations.py), so the modulated tensor is never written out in x's dtype."""
    backend = fp8_input_backend(*consumers)
    if backend is None:
        return layer_norm(x) * (1 + scale) + shift
    values, scales = fused_fp8_producer("modulated_layer_norm_fp8", backend)(x, scale, shift, eps=1e-6)
    return FP8Activations(values, scales, x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.weight[...].astype(jnp.float32)).astype(x.dtype)


def _rounded(x: jax.Array, dtype) -> jax.Array:
    """float32 `x` rounded to `dtype`'s precision. A cast to bfloat16 and back is not enough inside jit: XLA may keep
    the float32 value (excess precision), and then bfloat16 FLUX sees another timestep than diffusers'."""
    info = jnp.finfo(dtype)
    return jax.lax.reduce_precision(jnp.asarray(x, jnp.float32), exponent_bits=info.nexp, mantissa_bits=info.nmant)


class TimeTextEmbedding(nnx.Module):
    """Sum of the timestep embedding, the guidance embedding (FLUX.1-dev) and the pooled CLIP text projection."""

    def __init__(self, cfg: FluxConfig, *, dtype, rngs):
        self.timestep_embedder = MLPEmbedder(256, cfg.inner_dim, dtype=dtype, rngs=rngs)
        self.guidance_embedder = MLPEmbedder(256, cfg.inner_dim, dtype=dtype, rngs=rngs) if cfg.guidance_embeds else None
        self.text_embedder = MLPEmbedder(cfg.pooled_projection_dim, cfg.inner_dim, dtype=dtype, rngs=rngs)

    def __call__(self, timestep, guidance, pooled):
        emb = self.timestep_embedder(timestep_sinusoids(timestep).astype(pooled.dtype))
        if self.guidance_embedder is not None:
            emb = emb + self.guidance_embedder(timestep_sinusoids(guidance).astype(pooled.dtype))
        return emb + self.text_embedder(pooled)


class AdaNorm(nnx.Module):
    """Adaptive LayerNorm: `linear(silu(temb))` gives `chunks` modulation vectors (diffusers' AdaLayerNormZero with 6,
    AdaLayerNormZeroSingle with 3, AdaLayerNormContinuous with 2)."""

    def __init__(self, dim: int, chunks: int, *, dtype, rngs):
        self.chunks = chunks
        self.linear = Linear(dim, chunks * dim, bias=True, dtype=dtype, rngs=rngs)

    def __call__(self, temb: jax.Array) -> list[jax.Array]:
        """temb (batch, dim) -> `chunks` arrays of shape (batch, 1, dim)."""
        return jnp.split(self.linear(jax.nn.silu(temb))[:, None], self.chunks, axis=-1)


class Attention(nnx.Module):
    """Multi-head attention with q/k RMSNorm and rotary embedding; in double blocks also the text stream's own
    projections (`add_*`), the two streams attending jointly as [text, image]."""

    def __init__(self, cfg: FluxConfig, *, joint: bool, pre_only: bool, dtype, rngs):
        dim, self.heads, self.head_dim = cfg.inner_dim, cfg.num_attention_heads, cfg.attention_head_dim
        self.to_q = Linear(dim, dim, bias=True, dtype=dtype, rngs=rngs)
        self.to_k = Linear(dim, dim, bias=True, dtype=dtype, rngs=rngs)
        self.to_v = Linear(dim, dim, bias=True, dtype=dtype, rngs=rngs)
        self.norm_q = RMSNorm(self.head_dim)
        self.norm_k = RMSNorm(self.head_dim)
        self.to_out = None if pre_only else nnx.List([Linear(dim, dim, bias=True, dtype=dtype, rngs=rngs)])
        if joint:
            self.add_q_proj = Linear(dim, dim, bias=True, dtype=dtype, rngs=rngs)
            self.add_k_proj = Linear(dim, dim, bias=True, dtype=dtype, rngs=rngs)
            self.add_v_proj = Linear(dim, dim, bias=True, dtype=dtype, rngs=rngs)
            self.norm_added_q = RMSNorm(self.head_dim)
            self.norm_added_k = RMSNorm(self.head_dim)
            self.to_add_out = Linear(dim, dim, bias=True, dtype=dtype, rngs=rngs)
        # `stack_projections`: Q, K and V as one Linear (inference); the text stream's likewise
        self.to_qkv = nnx.data(None)
        self.add_qkv = nnx.data(None)

    def stack_projections(self) -> bool:
        """Q, K and V (and the text stream's) as one product each; the separate layers are gone afterwards. In
        single blocks the block stacks its MLP projection with them instead (`SingleStreamBlock`)."""
        stacked = False
        if self.to_qkv is None and (
                qkv := stacked_linear([self.to_q, self.to_k, self.to_v], ("to_q", "to_k", "to_v"))) is not None:
            self.to_qkv, self.to_q, self.to_k, self.to_v, stacked = qkv, None, None, None, True
        if getattr(self, "add_q_proj", None) is not None and (
                qkv := stacked_linear([self.add_q_proj, self.add_k_proj, self.add_v_proj],
                                     ("add_q_proj", "add_k_proj", "add_v_proj"))) is not None:
            self.add_qkv, self.add_q_proj, self.add_k_proj, self.add_v_proj, stacked = qkv, None, None, None, True
        return stacked

    def input_layers(self, context: bool = False) -> list[Linear]:
        """The layers that take the image (or joint) input, or with `context` the text input."""
        if context:
            return [self.add_qkv] if self.add_qkv is not None else [self.add_q_proj, self.add_k_proj, self.add_v_proj]
        return [self.to_qkv] if self.to_qkv is not None else [self.to_q, self.to_k, self.to_v]

    def _projections(self, x, stacked, q_proj, k_proj, v_proj):
        if stacked is not None:
            return jnp.split(stacked(x), 3, axis=-1)
        return q_proj(x), k_proj(x), v_proj(x)

    def _heads(self, q, k, v, norm_q, norm_k):
        shape = (*q.shape[:2], self.heads, self.head_dim)
        return norm_q(q.reshape(shape)), norm_k(k.reshape(shape)), v.reshape(shape)

    def __call__(self, x, rotary, implementation: AttentionKernel | AttentionFn, context=None, projections=None,
                 residuals=None):
        """x: (batch, seq, dim) image (or joint, in single blocks); context: (batch, text, dim) for double blocks;
        `projections`: x's (q, k, v) computed already (a single block's stacked product). `residuals` (double
        blocks): ((image residual, gate), (text residual, gate)): each output is `residual + gate * that`, in the
        output projections' epilogues with kernel weights (`Linear.gated_residual`)."""
        q, k, v = projections or self._projections(x, self.to_qkv, self.to_q, self.to_k, self.to_v)
        q, k, v = self._heads(q, k, v, self.norm_q, self.norm_k)
        if context is not None:
            cq, ck, cv = self._heads(*self._projections(context, self.add_qkv, self.add_q_proj, self.add_k_proj,
                                                        self.add_v_proj), self.norm_added_q, self.norm_added_k)
            q, k, v = (jnp.concatenate(pair, axis=1) for pair in ((cq, q), (ck, k), (cv, v)))
        q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        out = attention(q, k, v, None, implementation)
        out = out.reshape(*out.shape[:2], -1)
        if context is None:
            return out
        text = context.shape[1]
        if residuals is not None:
            (image, gate), (text_residual, text_gate) = residuals
            return (self.to_out[0].gated_residual(out[:, text:], image, gate),
                    self.to_add_out.gated_residual(out[:, :text], text_residual, text_gate))
        return self.to_out[0](out[:, text:]), self.to_add_out(out[:, :text])


class GELUProj(nnx.Module):
    def __init__(self, dim: int, hidden: int, *, dtype, rngs):
        self.proj = Linear(dim, hidden, bias=True, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.proj.activated(x, "gelu_tanh")  # in the GEMM's epilogue with kernel weights


class FeedForward(nnx.Module):
    def __init__(self, dim: int, *, dtype, rngs):
        self.net = nnx.List([GELUProj(dim, 4 * dim, dtype=dtype, rngs=rngs), NoParams(),
                             Linear(4 * dim, dim, bias=True, dtype=dtype, rngs=rngs)])

    def __call__(self, x, residual=None, residual_gate=None):
        """With `residual` and `residual_gate` (batch, 1, dim): `residual + residual_gate * ff(x)`, in the output
        projection's epilogue with kernel weights (`Linear.gated_residual`)."""
        if residual is not None:
            return self.net[2].gated_residual(self.net[0](x), residual, residual_gate)
        return self.net[2](self.net[0](x))


class DoubleStreamBlock(nnx.Module):
    """Text and image each with their own modulation, projections and MLP; attention over the joint sequence."""

    def __init__(self, cfg: FluxConfig, *, dtype, rngs):
        dim = cfg.inner_dim
        self.norm1 = AdaNorm(dim, 6, dtype=dtype, rngs=rngs)
        self.norm1_context = AdaNorm(dim, 6, dtype=dtype, rngs=rngs)
        self.attn = Attention(cfg, joint=True, pre_only=False, dtype=dtype, rngs=rngs)
        self.ff = FeedForward(dim, dtype=dtype, rngs=rngs)
        self.ff_context = FeedForward(dim, dtype=dtype, rngs=rngs)

    def stack_projections(self) -> bool:
        """Q, K and V of each stream as one product (`Attention.stack_projections`)."""
        return self.attn.stack_projections()

    def __call__(self, x, context, temb, rotary, implementation):
        shift, scale, gate, shift_mlp, scale_mlp, gate_mlp = self.norm1(temb)
        c_shift, c_scale, c_gate, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(temb)
        x, context = self.attn(_adaptive_norm(x, scale, shift, self.attn.input_layers()), rotary, implementation,
                               context=_adaptive_norm(context, c_scale, c_shift, self.attn.input_layers(context=True)),
                               residuals=((x, gate), (context, c_gate)))
        x = self.ff(_adaptive_norm(x, scale_mlp, shift_mlp, [self.ff.net[0].proj]), residual=x,
                    residual_gate=gate_mlp)
        context = self.ff_context(_adaptive_norm(context, c_scale_mlp, c_shift_mlp, [self.ff_context.net[0].proj]),
                                  residual=context, residual_gate=c_gate_mlp)
        return x, context


class SingleStreamBlock(nnx.Module):
    """One stream over [text, image]: attention and a GELU MLP in parallel, one output projection of both."""

    def __init__(self, cfg: FluxConfig, *, dtype, rngs):
        dim = cfg.inner_dim
        self.norm = AdaNorm(dim, 3, dtype=dtype, rngs=rngs)
        self.proj_mlp = Linear(dim, 4 * dim, bias=True, dtype=dtype, rngs=rngs)
        self.attn = Attention(cfg, joint=False, pre_only=True, dtype=dtype, rngs=rngs)
        self.proj_out = Linear(5 * dim, dim, bias=True, dtype=dtype, rngs=rngs)
        self.qkv_mlp = nnx.data(None)  # `stack_projections`: Q, K, V and the MLP's projection as one Linear

    def stack_projections(self) -> bool:
        """The attention's Q, K, V and the MLP projection (all of the same normed input) as one product."""
        if self.qkv_mlp is not None:
            return False
        stacked = stacked_linear([self.attn.to_q, self.attn.to_k, self.attn.to_v, self.proj_mlp],
                                 ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"))
        if stacked is not None:
            self.qkv_mlp, self.proj_mlp = stacked, None
            self.attn.to_q = self.attn.to_k = self.attn.to_v = None
        return stacked is not None

    def __call__(self, x, temb, rotary, implementation):
        shift, scale, gate = self.norm(temb)
        consumers = [self.qkv_mlp] if self.qkv_mlp is not None else [*self.attn.input_layers(), self.proj_mlp]
        h = _adaptive_norm(x, scale, shift, consumers)
        if self.qkv_mlp is not None:
            dim = x.shape[-1]
            q, k, v, mlp = jnp.split(self.qkv_mlp(h), [dim, 2 * dim, 3 * dim], axis=-1)
            attn = self.attn(h, rotary, implementation, projections=(q, k, v))
        else:
            mlp, attn = self.proj_mlp(h), self.attn(h, rotary, implementation)
        return self.proj_out.gated_residual(jnp.concatenate([attn, jax.nn.gelu(mlp, approximate=True)], axis=-1), x,
                                            gate)


class FinalNorm(nnx.Module):
    """diffusers' AdaLayerNormContinuous: (scale, shift) from the time embedding; note scale comes first here."""

    def __init__(self, dim: int, *, dtype, rngs):
        self.linear = Linear(dim, 2 * dim, bias=True, dtype=dtype, rngs=rngs)

    def __call__(self, x, temb):
        scale, shift = jnp.split(self.linear(jax.nn.silu(temb).astype(x.dtype))[:, None], 2, axis=-1)
        return layer_norm(x) * (1 + scale) + shift


def stack_projections(model: nnx.Module) -> int:
    """Stack the projections that share an input in every block of a FLUX `model`: Q/K/V of each stream in double
    blocks, Q/K/V with the MLP projection in single blocks. For inference, after quantizing and after fusing LoRAs.
    Returns how many modules were stacked."""
    modules = [node for _, node in nnx.iter_graph(model) if isinstance(node, (DoubleStreamBlock, SingleStreamBlock))]
    return sum(node.stack_projections() for node in modules)  # listed first: stacking changes the graph


class FluxTransformer(nnx.Module):
    """FLUX.1: `model(hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids,
    guidance=None)` as diffusers' forward. RMSNorm weights stay float32; `attention` as in `Krea2Transformer`."""

    def __init__(self, config: FluxConfig, *, dtype: jnp.dtype = jnp.bfloat16,
                 attention: AttentionKernel | str | None = None, rngs: nnx.Rngs):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.attention = attention_implementation(attention, self.dtype)
        dim = config.inner_dim
        out = (config.out_channels or config.in_channels) * config.patch_size**2
        self.time_text_embed = TimeTextEmbedding(config, dtype=dtype, rngs=rngs)
        self.context_embedder = Linear(config.joint_attention_dim, dim, bias=True, dtype=dtype, rngs=rngs)
        self.x_embedder = Linear(config.in_channels, dim, bias=True, dtype=dtype, rngs=rngs)
        self.transformer_blocks = nnx.List([DoubleStreamBlock(config, dtype=dtype, rngs=rngs)
                                            for _ in range(config.num_layers)])
        self.single_transformer_blocks = nnx.List([SingleStreamBlock(config, dtype=dtype, rngs=rngs)
                                                   for _ in range(config.num_single_layers)])
        self.norm_out = FinalNorm(dim, dtype=dtype, rngs=rngs)
        self.proj_out = Linear(dim, out, bias=True, dtype=dtype, rngs=rngs)
        # Training: a `jax.checkpoint_policies` policy makes each block a `jax.checkpoint` (remat) unit (see
        # layers.remat_call). None: no rematerialization; inference is unaffected either way.
        self.remat_policy = None

    def __call__(self, hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids,
                 guidance=None) -> jax.Array:
        """Args:
            hidden_states: (batch, image_seq, in_channels) packed latents.
            encoder_hidden_states: (batch, text_seq, joint_attention_dim) T5 states.
            pooled_projections: (batch, pooled_projection_dim) CLIP pooled output.
            timestep: (batch,) in [0, 1]; guidance: (batch,) guidance scale (FLUX.1-dev), else None.
            img_ids: (image_seq, 3), txt_ids: (text_seq, 3) rotary coordinates.
        Returns: (batch, image_seq, out_channels * patch_size**2).
        """
        x, context, temb, rotary = self.embed(hidden_states, encoder_hidden_states, pooled_projections, timestep,
                                              img_ids, txt_ids, guidance)
        for block in self.transformer_blocks:
            x, context = self.run_double_block(block, x, context, temb, rotary)
        text = context.shape[1]
        x = jnp.concatenate([context, x], axis=1)
        for block in self.single_transformer_blocks:
            x = self.run_single_block(block, x, temb, rotary)
        return self.finish(x, temb, text)

    def embed(self, hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids,
              guidance=None):
        """Everything before the blocks (arguments as `__call__`): the image and text streams, the time embedding and
        the rotary tables. `__call__` is `embed`, the double blocks, the streams joined [text, image], the single
        blocks, then `finish` (model/offload.py runs them apart)."""
        if self.config.guidance_embeds and guidance is None:
            raise ValueError("this FLUX transformer embeds guidance (FLUX.1-dev): pass guidance=")
        x = self.x_embedder(jnp.asarray(hidden_states, self.dtype))
        pooled = jnp.asarray(pooled_projections, self.dtype)
        # 1000 * t in the model dtype, rounded before and after the product, as diffusers (and the release) computes it
        timestep = _rounded(_rounded(timestep, self.dtype) * 1000, self.dtype)
        if guidance is not None:
            guidance = _rounded(_rounded(guidance, self.dtype) * 1000, self.dtype)
        temb = self.time_text_embed(timestep, guidance, pooled)
        context = self.context_embedder(jnp.asarray(encoder_hidden_states, self.dtype))
        rotary = rotary_tables(jnp.concatenate([txt_ids, img_ids], axis=0), self.config.axes_dims_rope, 10000.0)
        return x, context, temb, rotary

    def run_double_block(self, block: DoubleStreamBlock, x, context, temb, rotary):
        return remat_call(block, self.remat_policy, x, context, temb, rotary, implementation=self.attention)

    def run_single_block(self, block: SingleStreamBlock, x, temb, rotary):
        return remat_call(block, self.remat_policy, x, temb, rotary, implementation=self.attention)

    def finish(self, x, temb, text_len: int):
        """The output layers on the image rows of the joined sequence."""
        return self.proj_out(self.norm_out(x[:, text_len:], temb))

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: jnp.dtype = jnp.bfloat16, *,
                        config: FluxConfig | str | Path | None = None,
                        attention: AttentionKernel | str | None = None) -> "FluxTransformer":
        """Load a diffusers `transformer/` folder (one file or shards) or a single `.safetensors` file with diffusers
        key names or the original release's (`flux1-dev.safetensors`, `flux1-schnell.safetensors`, optionally
        prefixed `model.diffusion_model.`). A single file without `config` gets FLUX.1's sizes read from the weights
        (guidance embedding if present: dev; absent: schnell)."""
        path = Path(path)
        if isinstance(config, (str, Path)):
            config = FluxConfig.from_json(config)
        if path.is_dir() and config is None:
            config = FluxConfig.from_json(path / "config.json")
        config, keys = cls.key_map(open_checkpoint(path, "diffusion_pytorch_model"), config, str(path))
        return load_state(lambda: cls(config, dtype=dtype, attention=attention, rngs=nnx.Rngs(0)), keys,
                          source=str(path))

    @staticmethod
    def key_map(checkpoint: Checkpoint, config: FluxConfig | None = None,
                source: str = "checkpoint") -> tuple[FluxConfig, KeyMap]:
        """How `checkpoint` (diffusers' key names, or the original release's seen through `original_checkpoint_view`)
        maps onto the module, and its config: `config`, or FLUX.1's sizes read from the weights."""
        if any(k.replace("model.diffusion_model.", "").startswith("double_blocks.") for k in checkpoint.keys()):
            checkpoint = original_checkpoint_view(checkpoint)
        if config is None:
            config = _config_from_shapes(checkpoint, source)
        return config, KeyMap(checkpoint)


# --------------------------------------------------------------------------------------------------------------------
# The original single-file layout (black-forest-labs' flux1-dev.safetensors), as diffusers'
# `convert_flux_transformer_checkpoint_to_diffusers` maps it


def _split(parts: int, index: int, rows: int) -> Rows:
    """Part `index` of `parts` equal row ranges of a tensor of `rows` rows."""
    size = rows // parts
    return Rows(index * size, (index + 1) * size)


def _swap_halves(array):
    # The original final modulation is (shift, scale); diffusers' AdaLayerNormContinuous wants (scale, shift).
    shift, scale = np.split(array, 2, axis=0)
    return np.concatenate([scale, shift], axis=0)


def original_checkpoint_view(checkpoint: Checkpoint) -> DerivedCheckpoint:
    """The original FLUX layout presented under diffusers' names, fused tensors split lazily on read."""
    keys = {k.replace("model.diffusion_model.", ""): k for k in checkpoint.keys()}
    derived = {}

    def add(new, old, fn=None, shape=None):
        if old not in keys:
            return
        stored = checkpoint.shape(keys[old])
        derived[new] = (keys[old], fn, shape or stored)

    for src, dst in (("time_in", "timestep_embedder"), ("vector_in", "text_embedder"), ("guidance_in", "guidance_embedder")):
        for p in ("weight", "bias"):
            add(f"time_text_embed.{dst}.linear_1.{p}", f"{src}.in_layer.{p}")
            add(f"time_text_embed.{dst}.linear_2.{p}", f"{src}.out_layer.{p}")
    for p in ("weight", "bias"):
        add(f"context_embedder.{p}", f"txt_in.{p}")
        add(f"x_embedder.{p}", f"img_in.{p}")
        add(f"proj_out.{p}", f"final_layer.linear.{p}")
        if f"final_layer.adaLN_modulation.1.{p}" in keys:
            add(f"norm_out.linear.{p}", f"final_layer.adaLN_modulation.1.{p}", _swap_halves)
    doubles = sorted({int(k.split(".")[1]) for k in keys if k.startswith("double_blocks.")})
    singles = sorted({int(k.split(".")[1]) for k in keys if k.startswith("single_blocks.")})
    for i in doubles:
        o, n = f"double_blocks.{i}.", f"transformer_blocks.{i}."
        for p in ("weight", "bias"):
            add(f"{n}norm1.linear.{p}", f"{o}img_mod.lin.{p}")
            add(f"{n}norm1_context.linear.{p}", f"{o}txt_mod.lin.{p}")
            for stream, names in (("img", ("to_q", "to_k", "to_v")), ("txt", ("add_q_proj", "add_k_proj", "add_v_proj"))):
                qkv = f"{o}{stream}_attn.qkv.{p}"
                if qkv in keys:
                    shape = checkpoint.shape(keys[qkv])
                    for j, name in enumerate(names):
                        add(f"{n}attn.{name}.{p}", qkv, _split(3, j, shape[0]), (shape[0] // 3, *shape[1:]))
            add(f"{n}ff.net.0.proj.{p}", f"{o}img_mlp.0.{p}")
            add(f"{n}ff.net.2.{p}", f"{o}img_mlp.2.{p}")
            add(f"{n}ff_context.net.0.proj.{p}", f"{o}txt_mlp.0.{p}")
            add(f"{n}ff_context.net.2.{p}", f"{o}txt_mlp.2.{p}")
            add(f"{n}attn.to_out.0.{p}", f"{o}img_attn.proj.{p}")
            add(f"{n}attn.to_add_out.{p}", f"{o}txt_attn.proj.{p}")
        add(f"{n}attn.norm_q.weight", f"{o}img_attn.norm.query_norm.scale")
        add(f"{n}attn.norm_k.weight", f"{o}img_attn.norm.key_norm.scale")
        add(f"{n}attn.norm_added_q.weight", f"{o}txt_attn.norm.query_norm.scale")
        add(f"{n}attn.norm_added_k.weight", f"{o}txt_attn.norm.key_norm.scale")
    for i in singles:
        o, n = f"single_blocks.{i}.", f"single_transformer_blocks.{i}."
        for p in ("weight", "bias"):
            add(f"{n}norm.linear.{p}", f"{o}modulation.lin.{p}")
            add(f"{n}proj_out.{p}", f"{o}linear2.{p}")
            fused = f"{o}linear1.{p}"
            if fused in keys:
                # linear1 stacks q, k, v (inner_dim rows each) and the MLP input (4 * inner_dim rows)
                shape = checkpoint.shape(keys[fused])
                dim = shape[0] // 7
                bounds = np.cumsum([0, dim, dim, dim, 4 * dim])
                for j, name in enumerate(("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")):
                    lo, hi = int(bounds[j]), int(bounds[j + 1])
                    add(f"{n}{name}.{p}", fused, Rows(lo, hi), (hi - lo, *shape[1:]))
        add(f"{n}attn.norm_q.weight", f"{o}norm.query_norm.scale")
        add(f"{n}attn.norm_k.weight", f"{o}norm.key_norm.scale")
    used = {src for src, _, _ in derived.values()}
    unknown = sorted(k for k in checkpoint.keys() if k not in used)
    return DerivedCheckpoint(checkpoint, derived, unknown)


def _config_from_shapes(checkpoint: Checkpoint, path: str) -> FluxConfig:
    keys = set(checkpoint.keys())
    if "x_embedder.weight" not in keys:
        raise CheckpointError(f"{path}: not a FLUX transformer checkpoint (no x_embedder / img_in weight)")
    dim, in_channels = checkpoint.shape("x_embedder.weight")
    head_dim = checkpoint.shape("transformer_blocks.0.attn.norm_q.weight")[0]
    defaults = FluxConfig()
    if head_dim != defaults.attention_head_dim:
        raise CheckpointError(f"{path}: head_dim {head_dim} differs from FLUX.1's; the rotary split cannot be read "
                              "from the weights, pass config= (a FluxConfig or a config.json path)")
    return FluxConfig(
        in_channels=in_channels, attention_head_dim=head_dim, num_attention_heads=dim // head_dim,
        num_layers=len({k.split(".")[1] for k in keys if k.startswith("transformer_blocks.")}),
        num_single_layers=len({k.split(".")[1] for k in keys if k.startswith("single_transformer_blocks.")}),
        joint_attention_dim=checkpoint.shape("context_embedder.weight")[1],
        pooled_projection_dim=checkpoint.shape("time_text_embed.text_embedder.linear_1.weight")[1],
        guidance_embeds="time_text_embed.guidance_embedder.linear_1.weight" in keys,
    )
