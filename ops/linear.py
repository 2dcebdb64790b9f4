"""The products of the models' linear layers, by weight: the low-precision GEMM kernels of `pallas_kernels.gemm` for
their weights (`GemmWeight`, which `quant.model` makes), XLA's product otherwise; and the fused producers of
`pallas_kernels.activations` that hand a layer its input already quantized to FP8 (`FP8Activations`).

With the kernels, an activation or the DiT's gated residual runs in the GEMM's epilogue (float32, one rounding), so
the product is never written out and read back.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from mxdit.pallas_kernels import activations, gemm

from .kernels import jitted, kernel_family, on_gpu

# The epilogues XLA's product applies itself; "swiglu" exists only for a `gemm.swiglu_weight`, in the kernels.
_ACTIVATIONS = {"none": lambda y: y, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
                "silu": jax.nn.silu}


@functools.partial(jax.tree_util.register_dataclass, data_fields=["values", "scales"], meta_fields=["dtype"])
@dataclasses.dataclass(frozen=True)
class FP8Activations:
    """A linear layer's input already quantized for the GEMM kernels by a fused producer (`fused_fp8_producer`):
    values (..., k') FP8 E4M3 (k' = k padded to 128), scales (...) float32 per token; `dtype`: the product's dtype.
    Only a layer for which `fp8_input_backend` is not None takes it."""

    values: jax.Array
    scales: jax.Array
    dtype: jnp.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape


def is_gemm_weight(weight) -> bool:
    """A weight the GEMM kernels multiply (`pallas_kernels.gemm.GemmWeight`)."""
    return isinstance(weight, gemm.GemmWeight)


def linear(x: jax.Array | FP8Activations, weight, bias: jax.Array | None = None, *, activation: str = "none",
           residual: jax.Array | None = None, gate: jax.Array | None = None,
           adapter: Callable[[jax.Array, jax.Array], jax.Array] | None = None) -> jax.Array:
    """`residual + gate * activation(adapter(x, x @ weight^T + bias))`, each part when given; x (..., k), weight
    (n, k), residual (batch, seq, n), gate (batch, 1, n); returns (..., n) in x's dtype.

    - A `GemmWeight`, or x from a fused producer: the GEMM kernels (`kernel_matmul`). Without an adapter they apply
      the activation and, for one image in the batch (one gate vector), the gated residual in their epilogue.
    - A `quant.QuantizedArray` (training's frozen quantized base): dequantized for the product, on every call.
    - An array: XLA's product.

    `adapter`: a low-rank adapter `(x, y) -> y + update` (model/lora.py). `activation`: "none", "gelu_tanh",
    "silu", or "swiglu" (a `gemm.swiglu_weight`: `silu(gate) * up`, (..., n / 2))."""
    kernels = isinstance(x, FP8Activations) or is_gemm_weight(weight)
    if kernels and adapter is None and (residual is None or x.shape[0] == 1):
        return kernel_matmul(x, weight, bias, activation=activation, residual=residual,
                             gate=None if gate is None else gate.reshape(-1))
    if kernels:
        y = kernel_matmul(x, weight, bias)
    else:
        if hasattr(weight, "dequantize"):
            weight = weight.dequantize(x.dtype)
        y = jax.lax.dot_general(x, weight, (((x.ndim - 1,), (1,)), ((), ())))
        if bias is not None:
            y = y + bias
    if adapter is not None:
        y = adapter(x, y)
    y = _ACTIVATIONS[activation](y)
    return y if residual is None else residual + gate * y


def kernel_matmul(x: jax.Array | FP8Activations, weight: gemm.GemmWeight, bias: jax.Array | None, *,
                  activation: str = "none", residual: jax.Array | None = None,
                  gate: jax.Array | None = None) -> jax.Array:
    """x (..., k) @ weight^T through `pallas_kernels.gemm.scaled_matmul` (activations quantized per token on the
    fly, unless x comes quantized), in x's dtype; with `residual` (..., n) and `gate` (n,): `residual + gate *
    product` in the epilogue; `activation` as the kernel's.

    Differentiable in x, the bias, the residual and the gate (`_product_with_gradient`): the frozen weight takes no
    gradient, and the activations' quantization passes the gradient straight through. An x quantized by a fused
    producer is not differentiated (`differentiated_products` keeps the producers out of a loss)."""
    lead = x.shape[:-1]
    residual = None if residual is None else residual.reshape(-1, weight.n)
    if isinstance(x, FP8Activations):
        y = jitted(gemm.scaled_matmul)(x.values.reshape(-1, x.shape[-1]), weight, x.scales.reshape(-1), bias=bias,
                                       residual=residual, gate=gate, activation=activation, out_dtype=x.dtype,
                                       backend=gemm_backend(weight))
    else:
        y = _product_with_gradient(activation)(x.reshape(-1, x.shape[-1]), weight, bias, residual, gate)
    return y.reshape(*lead, y.shape[-1])


@functools.cache
def _product_with_gradient(activation: str) -> Callable:
    """`scaled_matmul(x, weight, ...)` with `activation`, whose gradient is that of the float32 product of x and the
    dequantized weight (`transposed_product`), through the epilogue at the kernel's own product."""

    def product(x, weight, bias, residual, gate, *, epilogue: bool = True, out_dtype=None):
        if not epilogue:
            bias = residual = gate = None
        return jitted(gemm.scaled_matmul)(x, weight, bias=bias, residual=residual, gate=gate,
                                          activation=activation if epilogue else "none",
                                          out_dtype=out_dtype or x.dtype, backend=gemm_backend(weight))

    @jax.custom_vjp
    def with_gradient(x, weight, bias, residual, gate):
        return product(x, weight, bias, residual, gate)

    def forward(x, weight, bias, residual, gate):
        return product(x, weight, bias, residual, gate), (x, weight, bias, residual, gate)

    def backward(saved, dy):
        from mxdit.pallas_kernels.gemm.reference import _epilogue

        x, weight, bias, residual, gate = saved
        if activation == "none" and gate is None:  # a linear epilogue: its gradient does not depend on the product
            pre = jnp.zeros(dy.shape, jnp.float32)
        else:
            pre = product(x, weight, None, None, None, epilogue=False, out_dtype=jnp.float32)

        def epilogue(pre, bias, residual, gate):
            y = _epilogue(pre, bias, activation, residual, gate, weight.swiglu_width, x.dtype)
            return y.astype(x.dtype)

        _, epilogue_vjp = jax.vjp(epilogue, pre, bias, residual, gate)
        d_pre, d_bias, d_residual, d_gate = epilogue_vjp(dy)
        return transposed_product(d_pre, weight, x.shape[-1], x.dtype), None, d_bias, d_residual, d_gate

    with_gradient.defvjp(forward, backward)
    return with_gradient


def transposed_product(dy: jax.Array, weight: gemm.GemmWeight, k: int, dtype=jnp.float32) -> jax.Array:
    """dy (m, n) @ W (n, k) for a `GemmWeight` W: the gradient of a product with W with respect to its input (k of
    W's padded columns), multiplied in `dtype` (the input's) and summed in float32. Per-channel weights (FP8, INT8)
    fold their scales into dy and multiply their codes as they are (converted in the product, never a dequantized
    copy of W); an INT8 weight in the rotated basis rotates the result back. Block-scaled and MX weights multiply
    their dequantized values."""
    from mxdit.pallas_kernels.gemm.reference import dequantize_weight
    from mxdit.quant.formats import FORMATS, _rotate

    dims = (((1,), (0,)), ((), ()))
    if weight.layout == "channel":
        dy, w = dy.astype(jnp.float32) * weight.scale, weight.data
    else:
        w = dequantize_weight(weight)
    dx = jax.lax.dot_general(dy.astype(dtype), w.astype(dtype), dims, preferred_element_type=jnp.float32)
    if weight.layout == "channel" and FORMATS[weight.fmt].rotated:
        dx = _rotate(dx, FORMATS[weight.fmt].block)
    return dx[:, :k].astype(dtype)


def gemm_backend(weight: gemm.GemmWeight) -> str:
    """The GEMM kernel for `weight`: on Hopper the Mosaic kernel for FP8 operands, the Triton one for INT8 weights
    (wgmma takes no INT8) and packed MX codes; on other GPUs the Triton one; elsewhere the jnp reference."""
    family = kernel_family()
    if family != "mosaic":
        return family
    return "triton" if weight.layout == "mx" or gemm.FORMATS[weight.fmt].kind == "int8" else "mosaic"


_DIFFERENTIATED = contextvars.ContextVar("differentiated_products", default=False)


@contextlib.contextmanager
def differentiated_products():
    """While active (`training.train.flow_matching_loss`), the layers' inputs are never quantized by a fused producer
    (`fp8_input_backend` is None): each product quantizes its own input, through which `kernel_matmul`'s gradient
    passes straight."""
    token = _DIFFERENTIATED.set(True)
    try:
        yield
    finally:
        _DIFFERENTIATED.reset(token)


def fp8_input_backend(*layers) -> str | None:
    """How a fused producer makes the input that `layers` (linear layers: `weight`, `lora`) share: "triton" on a GPU,
    "reference" elsewhere; None when one of them does not multiply FP8 activations (bf16 or INT8 weights, or an
    adapter, which needs the unquantized input), or inside `differentiated_products`."""
    if _DIFFERENTIATED.get():
        return None
    for layer in layers:
        weight = layer.weight.get_value()
        if not is_gemm_weight(weight) or layer.lora is not None or gemm.FORMATS[weight.fmt].kind == "int8":
            return None
    return "triton" if on_gpu() else "reference"


def fused_fp8_producer(name: str, backend: str) -> Callable:
    """`pallas_kernels.activations.<name>` ("modulated_rms_norm_fp8", "modulated_layer_norm_fp8", "swiglu_fp8",
    "tokens_fp8", "sigmoid_gated_fp8") for `backend`: the kernel under its own jit on the GPU, the jnp reference
    elsewhere and for rows the kernel does not take (a small model's widths that 16 does not divide: the same
    values). Returns a function giving (values, scales), the parts of `FP8Activations`."""
    function = getattr(activations, name)
    if backend != "triton":
        return functools.partial(function, backend=backend)
    kernel = functools.partial(jitted(function), backend="triton")
    reference = functools.partial(function, backend="reference")

    def produce(x, *args, **kwargs):
        width = x.shape[-1] // 2 if name == "swiglu_fp8" else x.shape[-1]  # swiglu: [gate | up]
        return (kernel if activations.kernel_takes_row(width) else reference)(x, *args, **kwargs)

    return produce


def stacked_weight(weights: list, biases: list[jax.Array] | None, *,
                   swiglu: bool = False) -> tuple[object, jax.Array | None] | None:
    """The weights (and biases) of linear layers that share an input, stacked along the outputs: one product
    computing them side by side, closer to the GEMMs' peak than several narrow ones. All arrays, or all
    `GemmWeight`s of one format (`gemm.concat_weights`); `swiglu`: SwiGLU's gate and up, FP8 kernel weights without
    a bias then paired for the GEMM's SwiGLU epilogue (`gemm.swiglu_weight`). None when they cannot be stacked."""
    # Weights streamed from host memory (`--offload`) are stacked on the device and put back: XLA would otherwise
    # run the concatenation as host compute, far slower.
    home = _host_sharding(weights)
    if home is not None:
        device = home.with_memory_kind(next(iter(home.device_set)).default_memory().kind)
        weights, biases = jax.device_put((weights, biases), device)
    if all(is_gemm_weight(w) for w in weights):
        weight = None
        if swiglu and biases is None and all(w.layout != "mx" and gemm.FORMATS[w.fmt].kind != "int8"
                                             for w in weights):
            try:
                weight = gemm.swiglu_weight(*weights)
            except ValueError:  # widths the pairs do not divide: stacked plainly
                pass
        try:
            weight = gemm.concat_weights(weights) if weight is None else weight
        except ValueError:
            return None
    elif all(isinstance(w, jax.Array) for w in weights):
        weight = jnp.concatenate(weights)
    else:
        return None
    bias = None if biases is None else jnp.concatenate(biases)
    if home is not None:
        weight, bias = jax.device_put((weight, bias), home)
    return weight, bias


def _host_sharding(tree):
    """The sharding of `tree`'s arrays when they live in host memory (not their device's default memory), else None."""
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        kind = getattr(sharding, "memory_kind", None)
        if kind is not None and kind != next(iter(sharding.device_set)).default_memory().kind:
            return sharding
    return None
