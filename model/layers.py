"""Layers shared by every model in `model/`."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.core.spmd import get_logical_axis_rules


# The INT8-QK kernels of pallas_kernels/attention.py: (lowering, P.V precision). Triton is portable, Mosaic GPU
# Hopper's; "_fp8" names take P.V in FP8 (V per channel, P scaled by 448) where the others take it in bf16.
_INT8_KERNELS = {"int8": ("triton", "bf16"), "int8_fp8": ("triton", "fp8"), "int8_mosaic": ("mosaic", "bf16"),
                 "int8_mosaic_fp8": ("mosaic", "fp8")}
INT8_ATTENTION = tuple(_INT8_KERNELS)
ATTENTION_KERNELS = ("xla", "cudnn", *INT8_ATTENTION)


def attention_implementation(requested: str | None, dtype) -> str:
    """The attention kernel a model uses: "cudnn" on a GPU for 16-bit dtypes unless asked otherwise, else "xla";
    "int8" is the INT8-QK kernel of pallas_kernels/attention.py through the Triton lowering, "int8_mosaic" the
    Hopper one (head_dim a multiple of 64), both with P.V in bf16; "int8_fp8" and "int8_mosaic_fp8" the same with
    P.V in FP8 (faster on Hopper, less exact). Only when asked: they trade attention's accuracy for speed (NOTES.md)."""
    if requested is None:
        on_gpu = jax.default_backend() == "gpu"
        requested = "cudnn" if on_gpu and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) else "xla"
    if requested not in ATTENTION_KERNELS:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION_KERNELS)}, got {requested!r}")
    return requested


def attention(q: jax.Array, k: jax.Array, v: jax.Array, kv_lengths: jax.Array | None, implementation) -> jax.Array:
    """Non-causal attention, q (batch, seq, heads, head_dim), k and v (batch, kv_seq, kv_heads, head_dim) with heads a
    multiple of kv_heads (GQA), keys at positions >= kv_lengths[b] masked. `implementation`: a name of
    `ATTENTION_KERNELS` or a function (q, k, v, kv_lengths) -> out (sharding/'s sequence-parallel attention)."""
    if callable(implementation):
        return implementation(q, k, v, kv_lengths)
    if implementation in _INT8_KERNELS:
        return _int8_kernel("int8_attention")(q, k, v, kv_lengths=kv_lengths, out_dtype=q.dtype,
                                              **_int8_options(implementation))
    if implementation == "cudnn" and not cudnn_takes_head_dim(q.shape[-1]):
        implementation = "xla"  # a small model's narrow heads (a tiny fixture's text blocks): XLA's attention
    return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=kv_lengths, implementation=implementation)


def cudnn_takes_head_dim(head_dim: int) -> bool:
    """cuDNN's fused attention takes head dims that are multiples of 8 up to 128 (256 on Hopper): the released
    models' 128 always; anything else runs XLA's attention instead."""
    return head_dim % 8 == 0 and head_dim <= 128


def _int8_kernel(name: str):
    """An INT8 attention entry point: on the GPU under its own jit (see `_jitted_kernel`); elsewhere in interpret mode
    (tests), called directly: under that jit the Mosaic GPU interpreter did not finish (minutes at idle CPU)."""
    if jax.default_backend() == "gpu":
        return functools.partial(_jitted_kernel(name), interpret=False)
    from mxdit.pallas_kernels import attention as attention_kernels

    return functools.partial(getattr(attention_kernels, name), interpret=True)


def _int8_options(implementation: str) -> dict:
    backend, pv = _INT8_KERNELS[implementation]
    options = {"backend": backend, "pv": pv, "block_q": 64, "block_k": 128 if backend == "mosaic" else 64}
    if backend == "mosaic" and pv == "fp8" and jax.default_backend() == "gpu":
        # FP8 P.V accumulated in place: 9% faster than two-level on the H200 at 4608 tokens, its error against
        # exact attention the same within 0.1% (0.4% at 16384 tokens) of that error (NOTES.md, session 9). (The
        # CPU's interpreter runs the two-level path only.)
        options["pv_accumulation"] = "in_place"
    return options


def int8_attention_from_projections(q, k, v, norm_q: jax.Array, norm_k: jax.Array, eps: float,
                                    rotary: tuple[jax.Array, jax.Array], kv_lengths: jax.Array | None,
                                    implementation: str = "int8") -> jax.Array:
    """An INT8 kernel (a name of `INT8_ATTENTION`) with its fused prologue: q and k straight from their projections;
    the per-head RMSNorm (weights `norm_q`, `norm_k`, zero-centred scale), the rotary embedding and the INT8
    quantization run in one pass (pallas_kernels/attention.py). Shapes as `attention`; returns q's dtype."""
    return _int8_kernel("int8_attention_fused")(q, k, v, norm_q, norm_k, eps, *rotary, kv_lengths=kv_lengths,
                                                out_dtype=q.dtype, **_int8_options(implementation))


def int8_attention_from_stacked(qkv, num_heads: int, num_kv_heads: int, norm_q: jax.Array, norm_k: jax.Array,
                                eps: float, rotary: tuple[jax.Array, jax.Array], kv_lengths: jax.Array | None,
                                implementation: str = "int8") -> jax.Array:
    """`int8_attention_from_projections` from one stacked projection (batch, seq, [Q | K | V | ...] channels): the
    prologue reads Q and K in place. Returns (batch, seq, num_heads, head_dim) in qkv's dtype."""
    return _int8_kernel("int8_attention_fused_stacked")(
        qkv, num_heads, num_kv_heads, norm_q, norm_k, eps, *rotary, kv_lengths=kv_lengths, out_dtype=qkv.dtype,
        **_int8_options(implementation))


def remat_call(block: nnx.Module, policy, *args, implementation):
    """`block(*args, implementation)`, as one `jax.checkpoint` unit when `policy` (a `jax.checkpoint_policies`
    policy) is given: its backward pass recomputes what the policy does not save (training). The block's state goes
    in as an argument and the block is rebuilt inside, so the checkpointed function is pure; `implementation` (an
    attention kernel name or function) stays outside the traced arguments."""
    if policy is None:
        return block(*args, implementation)
    graphdef, state = nnx.split(block)

    def run(state, *args):
        return nnx.merge(graphdef, state)(*args, implementation)

    return jax.checkpoint(run, policy=policy)(state, *args)


def shard_activation(x: jax.Array, *axes: str | None) -> jax.Array:
    """A named sharding constraint: `axes` names each dimension of x logically ("batch", "sequence") or None.

    sharding/ maps the names to mesh axes (`nnx.logical_axis_rules`) and sets the mesh (`jax.set_mesh`) while it
    traces a multi-device step; without both this returns x unchanged, and a name without a rule leaves its
    dimension to XLA. The constraints pin the layout where XLA's propagation could otherwise pick a costly one.
    """
    rules = dict(get_logical_axis_rules())
    if not rules or jax.sharding.get_abstract_mesh().empty:
        return x
    spec = jax.sharding.PartitionSpec
    return jax.lax.with_sharding_constraint(x, spec(*(rules.get(a, spec.UNCONSTRAINED) if a else None for a in axes)))


@functools.partial(jax.tree_util.register_dataclass, data_fields=["values", "scales"], meta_fields=["dtype"])
@dataclasses.dataclass(frozen=True)
class FP8Activations:
    """A Linear layer's input already quantized for the GEMM kernels by a fused producer (pallas_kernels/activations):
    values (..., k') FP8 E4M3 (k' = k padded to 128), scales (...) float32 per token; `dtype`: the product's dtype.
    Only a layer for which `fp8_input_backend` is not None takes it."""

    values: jax.Array
    scales: jax.Array
    dtype: jnp.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape


def fp8_input_backend(*layers: "Linear") -> str | None:
    """How a fused producer makes the input of `layers` (which share it): "triton" on a GPU, "reference" elsewhere;
    None when one of them does not multiply FP8 activations (bf16 or INT8 weights, or an adapter that needs the
    unquantized input)."""
    from mxdit.pallas_kernels.gemm import FORMATS

    for layer in layers:
        weight = layer.weight.get_value()
        if not _is_gemm_weight(weight) or layer.lora is not None or FORMATS[weight.fmt].kind == "int8":
            return None
    return "triton" if jax.default_backend() == "gpu" else "reference"


def fused_fp8_producer(name: str, backend: str):
    """`pallas_kernels.activations.<name>` ("modulated_rms_norm_fp8", "modulated_layer_norm_fp8", "swiglu_fp8",
    "tokens_fp8", "sigmoid_gated_fp8") for `backend`: the kernel under its own jit on the GPU (see
    `_jitted_kernel`), the jnp reference elsewhere and for rows the kernel does not take (a small model's widths
    that 16 does not divide: the same values)."""
    from mxdit.pallas_kernels import activations

    if backend != "triton":
        return functools.partial(getattr(activations, name), backend=backend)
    kernel = functools.partial(_jitted_kernel(name), backend="triton")
    reference = functools.partial(getattr(activations, name), backend="reference")

    def produce(x, *args, **kwargs):
        width = x.shape[-1] // 2 if name == "swiglu_fp8" else x.shape[-1]  # swiglu: [gate | up]
        return (kernel if activations.kernel_takes_row(width) else reference)(x, *args, **kwargs)

    return produce


class Linear(nnx.Module):
    """`y = x @ weight.T + bias`, with `weight` of shape `(out_features, in_features)`.

    The weight keeps PyTorch's layout (unlike `nnx.Linear`'s `(in, out)` kernel) so that checkpoint tensors stream in
    without a transpose, and so that the reduction axis is the last, contiguous one: the axis along which the
    block-scaled formats of `quant/` group their 32 or 128 elements.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nnx.Param(
            jax.random.normal(rngs.params(), (out_features, in_features), dtype) * in_features**-0.5
        )
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None
        # A quant format name: the input is quantized and dequantized per token (or block) before the product, which
        # simulates weight+activation quantization (see model/quality.py). None: the input is used as it is.
        self.activation_format = None
        # A low-rank adapter (training/lora.py's LoRA) called as `lora(x, y)` after the product: it adds its update
        # to y. None: a plain linear layer. Data, not static: its matrices are state of the model.
        self.lora = nnx.data(None)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: (..., in_features) -> (..., out_features)."""
        weight = self.weight.get_value()
        if isinstance(x, FP8Activations):  # quantized by a fused producer: only the GEMM kernels take it
            return _kernel_matmul(x, weight, None if self.bias is None else self.bias[...])
        if _is_gemm_weight(weight):  # a low-precision weight for the GEMM kernels (`quantize_linear_layers`)
            y = _kernel_matmul(x, weight, None if self.bias is None else self.bias[...])
            return y if self.lora is None else self.lora(x, y)
        if self.activation_format is not None:
            from mxdit.quant.formats import quantize  # formats by name: the one way model/ reaches quant/

            x = quantize(x, self.activation_format, axis=-1).dequantize(x.dtype)
        if hasattr(weight, "dequantize"):  # a quant.QuantizedArray (a frozen quantized base): dequantized per call
            weight = weight.dequantize(x.dtype)
        y = jax.lax.dot_general(x, weight, (((x.ndim - 1,), (1,)), ((), ())))
        if self.bias is not None:
            y = y + self.bias[...]
        if self.lora is not None:
            y = self.lora(x, y)
        return y

    def activated(self, x: jax.Array, activation: str) -> jax.Array:
        """`activation(self(x))` ("gelu_tanh" or "silu"); with a kernel weight (and no adapter), inside the GEMM's
        epilogue in float32, so the pre-activation product is never written out and read back."""
        function = {"gelu_tanh": functools.partial(jax.nn.gelu, approximate=True), "silu": jax.nn.silu}[activation]
        weight = self.weight.get_value()
        if (isinstance(x, FP8Activations) or _is_gemm_weight(weight)) and self.lora is None:
            return _kernel_matmul(x, weight, None if self.bias is None else self.bias[...], activation=activation)
        return function(self(x))

    def swiglu(self, x: jax.Array) -> jax.Array:
        """`silu(gate) * up` (..., out_features / 2) inside the GEMM's epilogue, for a Linear whose weight is a
        `gemm.swiglu_weight` (`stacked_linear(..., swiglu=True)` makes one from SwiGLU's gate and up): the stacked
        product is never written out."""
        return _kernel_matmul(x, self.weight.get_value(), None if self.bias is None else self.bias[...],
                              activation="swiglu")

    def gated_residual(self, x: jax.Array, residual: jax.Array, gate: jax.Array) -> jax.Array:
        """`residual + gate * self(x)`, the DiT's gated residual: x (batch, seq, in), residual (batch, seq, out), gate
        (batch, 1, out). With a kernel weight and one image in the batch, inside the GEMM's epilogue (float32, one
        rounding), so the product is never written out and read back."""
        weight = self.weight.get_value()
        if x.shape[0] == 1 and (isinstance(x, FP8Activations) or (_is_gemm_weight(weight) and self.lora is None)):
            bias = None if self.bias is None else self.bias[...]
            return _kernel_matmul(x, weight, bias, residual=residual, gate=gate.reshape(-1))
        return residual + gate * self(x)


def stacked_linear(layers: list[Linear], sources: tuple[str, ...], *, swiglu: bool = False) -> Linear | None:
    """One Linear computing `layers` (same input, no adapter, all with a bias or none) side by side: their outputs
    concatenated. Bigger products run closer to the GEMMs' peak than several narrow ones (Krea 2's K and V have 1536
    outputs). None when the layers cannot be stacked (an adapter, biases on some only, different weight formats).
    `sources`: the layers' names relative to the module that will hold the stacked one (its `stacked_from` keeps
    them with their widths, so that `quantize_linear_layers` can still apply the checkpoint's rules).
    `swiglu`: the layers are SwiGLU's gate and up; FP8 kernel weights without a bias are then paired for the GEMM's
    SwiGLU epilogue (`gemm.swiglu_weight`; called through `Linear.swiglu`, which returns `silu(gate) * up`)."""
    from mxdit.pallas_kernels.gemm import FORMATS, concat_weights, swiglu_weight

    if any(layer.lora is not None or layer.activation_format for layer in layers):
        return None
    if len({layer.bias is None for layer in layers}) > 1:
        return None
    weights = [layer.weight.get_value() for layer in layers]
    biases = [layer.bias[...] for layer in layers] if layers[0].bias is not None else None
    # Weights streamed from host memory (`--offload`) are stacked on the device and put back: XLA would otherwise
    # run the concatenation as host compute, which took tens of seconds for a model (session 6).
    home = _host_sharding(weights)
    if home is not None:
        device = home.with_memory_kind(next(iter(home.device_set)).default_memory().kind)
        weights, biases = jax.device_put((weights, biases), device)
    if all(_is_gemm_weight(w) for w in weights):
        weight = None
        if swiglu and biases is None and all(w.layout != "mx" and FORMATS[w.fmt].kind != "int8" for w in weights):
            try:
                weight = swiglu_weight(*weights)
            except ValueError:  # widths the pairs do not divide: stacked plainly
                pass
        try:
            weight = concat_weights(weights) if weight is None else weight
        except ValueError:
            return None
    elif all(isinstance(w, jax.Array) for w in weights):
        weight = jnp.concatenate(weights)
    else:
        return None
    bias = None if biases is None else jnp.concatenate(biases)
    if home is not None:
        weight, bias = jax.device_put((weight, bias), home)
    stacked = Linear(1, 1, bias=bias is not None, dtype=jnp.float32, rngs=nnx.Rngs(0))  # then given the stacked weight
    stacked.in_features, stacked.out_features = layers[0].in_features, sum(layer.out_features for layer in layers)
    stacked.weight = nnx.Param(weight)
    stacked.stacked_from = tuple((name, layer.out_features) for name, layer in zip(sources, layers, strict=True))
    if bias is not None:
        stacked.bias = nnx.Param(bias)
    return stacked


def _host_sharding(tree):
    """The sharding of `tree`'s arrays when they live in host memory (not their device's default memory), else None."""
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        kind = getattr(sharding, "memory_kind", None)
        if kind is not None and kind != next(iter(sharding.device_set)).default_memory().kind:
            return sharding
    return None


def _is_gemm_weight(weight) -> bool:
    from mxdit.pallas_kernels.gemm import GemmWeight

    return isinstance(weight, GemmWeight)


def gemm_backend(weight) -> str:
    """The GEMM kernel for a `GemmWeight`: on a GPU the Mosaic (Hopper) kernel for FP8 operands, the Triton one for
    INT8 weights (wgmma here takes no INT8) and packed MX codes; elsewhere the jnp reference (CPU runs, tests)."""
    from mxdit.pallas_kernels.gemm import FORMATS

    if jax.default_backend() != "gpu":
        return "reference"
    return "triton" if weight.layout == "mx" or FORMATS[weight.fmt].kind == "int8" else "mosaic"


@functools.cache
def _jitted_kernel(name: str):
    """A Pallas kernel entry point under its own `jax.jit`: inside a model's program every call of one shape then
    lowers to one shared function, so each kernel is compiled once, not once per layer (196 GEMM calls in a Krea 2
    step: the difference between seconds and minutes of compilation)."""
    from mxdit.pallas_kernels import activations, gemm
    from mxdit.pallas_kernels import attention as attention_kernels

    function, static = {
        "scaled_matmul": (gemm.scaled_matmul, ("x_scaling", "activation", "out_dtype", "backend", "config",
                                               "interpret")),
        "int8_attention": (attention_kernels.int8_attention, ("pv", "block_q", "block_k", "scale", "interpret",
                                                              "num_warps", "num_stages", "backend", "out_dtype",
                                                              "pv_accumulation")),
        "modulated_rms_norm_fp8": (activations.modulated_rms_norm_fp8, ("eps", "backend", "interpret")),
        "modulated_layer_norm_fp8": (activations.modulated_layer_norm_fp8, ("eps", "backend", "interpret")),
        "swiglu_fp8": (activations.swiglu_fp8, ("backend", "interpret")),
        "tokens_fp8": (activations.tokens_fp8, ("backend", "interpret")),
        "sigmoid_gated_fp8": (activations.sigmoid_gated_fp8, ("gate_offset", "backend", "interpret")),
        "int8_attention_fused": (attention_kernels.int8_attention_fused, (
            "eps", "pv", "block_q", "block_k", "scale", "interpret", "num_warps", "num_stages", "backend",
            "out_dtype", "pv_accumulation")),
        "int8_attention_fused_stacked": (attention_kernels.int8_attention_fused_stacked, (
            "num_heads", "num_kv_heads", "eps", "pv", "block_q", "block_k", "scale", "interpret", "num_warps",
            "num_stages", "backend", "out_dtype", "pv_accumulation")),
    }[name]
    return jax.jit(function, static_argnames=static)


def _kernel_matmul(x: jax.Array, weight, bias: jax.Array | None, residual: jax.Array | None = None,
                   gate: jax.Array | None = None, activation: str = "none") -> jax.Array:
    """x (..., k) @ weight^T through `pallas_kernels.gemm.scaled_matmul` (activations quantized per token on the
    fly), in x's dtype; with `residual` (..., n) and `gate` (n,): `residual + gate * product` in the epilogue;
    `activation` as the kernel's ("swiglu": (..., n / 2))."""
    lead = x.shape[:-1]
    residual = None if residual is None else residual.reshape(-1, weight.n)
    x_scale, out_dtype = None, x.dtype
    if isinstance(x, FP8Activations):
        x, x_scale = x.values, x.scales.reshape(-1)
    y = _jitted_kernel("scaled_matmul")(x.reshape(-1, x.shape[-1]), weight, x_scale, bias=bias, residual=residual,
                                        gate=gate, activation=activation, out_dtype=out_dtype,
                                        backend=gemm_backend(weight))
    return y.reshape(*lead, y.shape[-1])


PRECISIONS = {"bf16": None, "fp8": "fp8_e4m3", "mxfp8": "mxfp8_e4m3", "mxfp6": "mxfp6_e2m3", "mxfp4": "mxfp4_e2m1",
              "int8": "int8"}  # --precision name -> the quant format of the blocks' matrices (None: unquantized)


@functools.cache
def _weight_quantizers():
    """The jitted quantizer and kernel-layout preparation, made once per process (not per model or per load)."""
    from mxdit.pallas_kernels.gemm import prepare_weight
    from mxdit.quant.formats import quantize

    return jax.jit(quantize, static_argnames=("fmt",)), jax.jit(prepare_weight, static_argnames=("backend",))


def _quantized_weight(weight: jax.Array, fmt: str, kernels: bool):
    """`weight` in `fmt`: a `GemmWeight` for the kernels, else a `QuantizedArray`. The Mosaic layout (MX exponents
    folded per 128 x 128 tile) also serves the reference; INT8 weights keep theirs (channel scales) for Triton."""
    quantize_jit, prepare_jit = _weight_quantizers()
    q = quantize_jit(weight, fmt=fmt)
    return prepare_jit(q, backend="mosaic") if kernels else q


def quantize_linear_layers(model: nnx.Module, rules, *, kernels: bool) -> list[str]:
    """Quantize, in place, the weights of the Linear layers that `rules` select (`quant.model.krea2_rules(fmt)` and
    the like: (pattern, format) on checkpoint keys). `kernels`: to `GemmWeight`s that the low-precision GEMM
    kernels multiply directly (inference: activations quantized per token, W8A8 / MX weights); else to
    `QuantizedArray`s dequantized per call (training's frozen base). One weight at a time, so the device never holds
    a second full copy of the model. Stacked projections (`stack_projections`) are quantized as their sources would
    have been, or refused with the reason. Returns the quantized keys."""
    from mxdit.quant.model import format_for

    from .loading import module_key

    done = []
    for path, layer in nnx.iter_graph(model):
        if not isinstance(layer, Linear):
            continue
        key = module_key(path) + ".weight"
        weight = layer.weight.get_value()
        if hasattr(weight, "dequantize") or _is_gemm_weight(weight):  # quantized already
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


def _quantized_stacked_weight(key: str, weight: jax.Array, stacked_from, rules, kernels: bool):
    """A stacked Linear's weight quantized as its sources would have been (the rules name the checkpoint's
    projections, not the stacked one), then stacked: the same weight as quantizing before stacking. None when the
    rules select none of them."""
    from mxdit.pallas_kernels.gemm import concat_weights
    from mxdit.quant.model import format_for

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


def quantize_on_load(rules):
    """For `loading.place_parameters`: the matrices `rules` select become kernel weights (as `quantize_linear_layers`
    makes them) as they are read, so that the device never holds the model in bf16, one tensor at most."""
    from mxdit.quant.model import format_for

    def place(key: str, value: jax.Array):
        fmt = format_for(key, tuple(value.shape), rules)
        return _quantized_weight(value, fmt, kernels=True) if fmt else value

    return place


def load_quantized_model(build, path) -> nnx.Module:
    """The module `build()` makes (only traced) with its parameters from mxdit's quantized checkpoint (one file from
    scripts/quantize.py, `quant.model.save_quantized`): the quantized matrices become the GEMM kernels' weights as
    they are read (as `quantize_linear_layers(kernels=True)` makes them: the device never holds them in bf16), the
    other tensors are cast to the module's dtypes; the file is read into host memory and each tensor moves to the
    device as it is placed (through `loading.place_parameters`, e.g. streamed blocks on to host memory). Errors name
    the file and the keys."""
    from mxdit.pallas_kernels.gemm import WEIGHT_FORMATS
    from mxdit.quant.formats import QuantizedArray
    from mxdit.quant.model import QuantizedCheckpointError, load_quantized

    from .loading import CheckpointError, key_problems, module_key, placed

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
            value = prepare_jit(value, backend="mosaic")
        else:
            value = jax.device_put(value).astype(variable.get_value().dtype)
        variable.set_value(placed(key, value))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


class Conv2d(nnx.Module):
    """2-D convolution on channels-last images (batch, height, width, channels), with PyTorch's weight layout
    `(out_channels, in_channels, kh, kw)` so checkpoints stream in unchanged.

    `padding` is an int (same on every side) or `((top, bottom), (left, right))`.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, *, stride: int = 1,
                 padding: int | tuple[tuple[int, int], tuple[int, int]] = 0, dtype: jnp.dtype, rngs: nnx.Rngs):
        fan_in = in_channels * kernel_size * kernel_size
        self.weight = nnx.Param(
            jax.random.normal(rngs.params(), (out_channels, in_channels, kernel_size, kernel_size), dtype) * fan_in**-0.5
        )
        self.bias = nnx.Param(jnp.zeros((out_channels,), dtype))
        self.stride = stride
        self.padding = ((padding, padding), (padding, padding)) if isinstance(padding, int) else padding

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jax.lax.conv_general_dilated(
            x, self.weight[...], (self.stride, self.stride), self.padding, dimension_numbers=("NHWC", "OIHW", "NHWC")
        )
        return y + self.bias[...]


def upsample_nearest_2x(x: jax.Array) -> jax.Array:
    """(batch, h, w, c) -> (batch, 2h, 2w, c), each pixel repeated 2x2 (nearest and nearest-exact agree at 2x)."""
    return jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)


def rotary_tables(position_ids: jax.Array, axes_dims: tuple[int, ...], theta: float) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables for 3-axis rotary embedding, each of shape `position_ids.shape[:-1] + (head_dim,)`.

    Axis i of the position (t, h, w) rotates `axes_dims[i]` channels; each frequency is repeated for the two channels
    of its (real, imaginary) pair, as in FLUX's `repeat_interleave_real` convention.
    """
    cos, sin = [], []
    for i, dim in enumerate(axes_dims):
        # Frequencies are static: computed in float64 on the host, like diffusers, then rounded to float32.
        freqs = jnp.asarray(1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim), jnp.float32)
        angles = position_ids[..., i : i + 1].astype(jnp.float32) * freqs
        cos.append(jnp.repeat(jnp.cos(angles), 2, axis=-1))
        sin.append(jnp.repeat(jnp.sin(angles), 2, axis=-1))
    return jnp.concatenate(cos, axis=-1), jnp.concatenate(sin, axis=-1)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate interleaved channel pairs of x (batch, seq, heads, head_dim) by tables of shape (seq, head_dim) or
    (batch, seq, head_dim); computed in float32."""
    real, imag = x[..., 0::2], x[..., 1::2]
    rotated = jnp.stack([-imag, real], axis=-1).reshape(x.shape)
    cos, sin = cos[..., None, :], sin[..., None, :]  # broadcast over heads
    return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)
