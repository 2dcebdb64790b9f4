"""Inference on low-precision weights: the Linear layers' weights quantized in place to the GEMM kernels' form
(`quantize_linear_layers(kernels=True)`), multiplied by `pallas_kernels.gemm` with activations quantized per token.
On the CPU the kernels' jnp reference runs; the Pallas kernels themselves are tested in test_gemm.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import FIXTURES
from mxdit.model.krea2 import Krea2Transformer
from mxdit.model.layers import PRECISIONS, quantize_linear_layers
from mxdit.model.loading import iter_params
from mxdit.model.quality import quantize_activations, with_params
from mxdit.pallas_kernels.gemm import GemmWeight
from mxdit.quant.gates import cosine, relative_l2
from mxdit.quant.model import dequantize_model, krea2_rules, quantize_model


@pytest.fixture(scope="module")
def tiny():
    model = Krea2Transformer.from_pretrained(FIXTURES / "krea2" / "tiny", jnp.float32)
    cfg = model.config
    k = jax.random.split(jax.random.key(3), 2)
    text_len, grid = 6, 4
    inputs = (jax.random.normal(k[0], (1, grid * grid, cfg.in_channels)),
              jax.random.normal(k[1], (1, text_len, cfg.num_text_layers, cfg.text_hidden_dim)),
              jnp.full((1,), 0.6),
              jnp.concatenate([jnp.zeros((text_len, 3)), jnp.stack(jnp.meshgrid(
                  jnp.zeros(1), jnp.arange(grid), jnp.arange(grid), indexing="ij"), -1).reshape(-1, 3)]),
              jnp.arange(text_len)[None] < 4)
    return model, inputs


@pytest.mark.parametrize("precision", ["fp8", "mxfp6", "mxfp4", "int8"])
def test_kernel_weights_compute_the_simulated_quantization(tiny, precision):
    """W8A8 (or MX weights with FP8 activations) through the GEMM path equals the simulation of the same
    quantization in float32 (weights quantized and dequantized, inputs quantized per token): only the summation
    order differs. And it stays close to the unquantized model."""
    model, inputs = tiny
    rules = krea2_rules(PRECISIONS[precision])
    kernels = nnx.clone(model)
    keys = quantize_linear_layers(kernels, rules, kernels=True)
    assert len(keys) == (2 + 2 + 2) * 8  # every matrix of the joint, layerwise and refiner blocks
    assert isinstance(kernels.transformer_blocks[0].ff.down.weight.get_value(), GemmWeight)
    params = dict(iter_params(model))
    activations = krea2_rules("int8" if precision == "int8" else "fp8_e4m3")  # what the kernels take for x
    simulated = quantize_activations(with_params(model, dequantize_model(quantize_model(params, rules), jnp.float32)),
                                     activations)
    out, sim, exact = (np.asarray(jax.jit(lambda *a, m=m: m(*a))(*inputs)) for m in (kernels, simulated, model))
    assert relative_l2(out, sim) <= 1e-5
    assert cosine(out, exact) >= {"fp8": 0.999, "mxfp6": 0.999, "mxfp4": 0.98, "int8": 0.999}[precision]


def test_bf16_precision_quantizes_nothing(tiny):
    model, _ = tiny
    assert PRECISIONS["bf16"] is None
    assert quantize_linear_layers(nnx.clone(model), krea2_rules(None), kernels=True) == []
