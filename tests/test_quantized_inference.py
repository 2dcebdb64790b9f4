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
from mxdit.model.loading import iter_params
from mxdit.ops.names import Precision
from mxdit.pallas_kernels.gemm import GemmWeight
from mxdit.quant.gates import cosine, relative_l2
from mxdit.quant.model import (fake_quantize_model, krea2_rules, load_quantized_model, quantize_activations,
                               quantize_linear_layers, quantize_model, quantize_on_load, save_quantized, with_params)


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


# MX weights take fp8's path (FP8 activations) but for the weights' format, whose kernel form holds the format's values
# (test_gemm.py's test_kernel_packing_of_mx_codes_keeps_every_value); ~20 s on 2 cores each
@pytest.mark.parametrize("precision", ["fp8", pytest.param("mxfp6", marks=pytest.mark.slow),
                                       pytest.param("mxfp4", marks=pytest.mark.slow), "int8"])
def test_kernel_weights_compute_the_simulated_quantization(tiny, precision):
    """W8A8 (or MX weights with FP8 activations) through the GEMM path equals the simulation of the same
    quantization in float32 (weights quantized and dequantized, inputs quantized per token): only the summation
    order differs. And it stays close to the unquantized model."""
    model, inputs = tiny
    rules = krea2_rules(Precision(precision).weight_format)
    kernels = nnx.clone(model)
    keys = quantize_linear_layers(kernels, rules, kernels=True)
    assert len(keys) == (2 + 2 + 2) * 8  # every matrix of the joint, layerwise and refiner blocks
    assert isinstance(kernels.transformer_blocks[0].ff.down.weight.get_value(), GemmWeight)
    params = dict(iter_params(model))
    activations = krea2_rules("int8" if precision == "int8" else "fp8_e4m3")  # what the kernels take for x
    simulated = quantize_activations(with_params(model, fake_quantize_model(params, rules, jnp.float32)),
                                     activations)
    out, sim, exact = (np.asarray(jax.jit(lambda *a, m=m: m(*a))(*inputs)) for m in (kernels, simulated, model))
    assert relative_l2(out, sim) <= 1e-5
    assert cosine(out, exact) >= {"fp8": 0.999, "mxfp6": 0.999, "mxfp4": 0.98, "int8": 0.999}[precision]


def test_bf16_precision_quantizes_nothing(tiny):
    model, _ = tiny
    assert Precision.BF16.weight_format is None
    assert quantize_linear_layers(nnx.clone(model), krea2_rules(None), kernels=True) == []


@pytest.mark.parametrize("precision", ["bf16", "fp8", "int8"])
def test_stacked_projections_give_the_same_velocity(tiny, precision):
    """Q, K, V and the gate (and SwiGLU's gate and up) as one product each: the same output, as the weights are
    stacked exactly and the activations' per-token scales do not depend on the output columns."""
    from mxdit.model.krea2 import stack_projections

    model, inputs = tiny
    separate = nnx.clone(model)
    if precision != "bf16":
        quantize_linear_layers(separate, krea2_rules(Precision(precision).weight_format), kernels=True)
    stacked = nnx.clone(separate)
    assert stack_projections(stacked) == (2 + 2 + 2) * 2  # attention and SwiGLU of every block
    assert stacked.transformer_blocks[0].attn.to_q is None and stack_projections(stacked) == 0
    out, expected = (np.asarray(jax.jit(lambda *a, m=m: m(*a))(*inputs)) for m in (stacked, separate))
    assert relative_l2(out, expected) <= 1e-6


def test_swiglu_in_the_gemm_epilogue_gives_the_unfused_velocity(tiny):
    """FP8 gate and up stacked in the SwiGLU epilogue's paired order (widths divisible by `gemm.SWIGLU_WIDTH`: the
    tiny fixture's 48 are not, so its blocks get 64 here): the same velocity as gate and up apart."""
    import dataclasses

    from mxdit.model.krea2 import Krea2Config, stack_projections

    model, inputs = tiny
    cfg = dataclasses.replace(model.config, intermediate_size=64, text_intermediate_size=128)
    separate = Krea2Transformer(cfg, dtype=jnp.float32, rngs=nnx.Rngs(5))
    assert isinstance(cfg, Krea2Config)
    quantize_linear_layers(separate, krea2_rules("fp8_e4m3"), kernels=True)
    stacked = nnx.clone(separate)
    stack_projections(stacked)
    for ff in (stacked.transformer_blocks[0].ff, stacked.text_fusion.layerwise_blocks[0].ff):
        assert ff.gate_up.weight.get_value().swiglu_width == 64
    out, expected = (np.asarray(jax.jit(lambda *a, m=m: m(*a))(*inputs)) for m in (stacked, separate))
    assert relative_l2(out, expected) <= 1e-5


@pytest.mark.parametrize("precision", ["fp8", "int8"])
def test_quantizing_after_stacking_gives_the_weights_of_quantizing_before(tiny, precision):
    """The rules name the checkpoint's projections; a stacked Linear is quantized as its sources would have been."""
    from mxdit.model.krea2 import stack_projections

    model, inputs = tiny
    rules = krea2_rules(Precision(precision).weight_format)
    before = nnx.clone(model)
    quantize_linear_layers(before, rules, kernels=True)
    stack_projections(before)
    after = nnx.clone(model)
    stack_projections(after)
    keys = quantize_linear_layers(after, rules, kernels=True)
    assert "transformer_blocks.0.attn.to_qkvg.weight" in keys and "transformer_blocks.0.ff.gate_up.weight" in keys
    assert len(keys) == (2 + 2 + 2) * 4  # stacked QKVG, out, stacked gate/up, down
    for a, b in zip(jax.tree.leaves(nnx.state(before)), jax.tree.leaves(nnx.state(after)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_quantizing_after_stacking_refuses_what_would_not_have_stacked(tiny):
    """Sources in different formats (or MX weights whose widths are no multiple of the fold) name the stacked key."""
    from mxdit.model.krea2 import stack_projections

    model, _ = tiny
    stacked = nnx.clone(model)
    stack_projections(stacked)
    mixed = [(r"\.to_gate\.weight$", None)] + krea2_rules("fp8_e4m3")
    with pytest.raises(ValueError, match=r"layerwise_blocks\.0\.attn\.to_qkvg\.weight is stacked from to_q, to_k, "
                                         r"to_v, to_gate and its rules give different formats"):
        quantize_linear_layers(nnx.clone(stacked), mixed, kernels=True)
    with pytest.raises(ValueError, match=r"to_qkvg\.weight \(stacked from .*cannot stack.*quantize before stacking"):
        quantize_linear_layers(nnx.clone(stacked), krea2_rules("mxfp6_e2m3"), kernels=True)


@pytest.mark.parametrize("fmt", [pytest.param("mxfp6_e2m3", marks=pytest.mark.slow), "fp8_e4m3"])  # mxfp6: ~26 s
def test_concatenated_gemm_weights_multiply_as_the_separate_ones(fmt):
    """MX weights folded per 128 x 128 tile stack when each output count is a multiple of 128 (Krea 2's 6144 and
    1536), and refuse otherwise (the tiny models' 64)."""
    from mxdit.pallas_kernels.gemm import concat_weights, prepare_weight, scaled_matmul

    keys = jax.random.split(jax.random.key(5), 4)
    x = jax.random.normal(keys[0], (8, 256))
    ws = [prepare_weight(jax.random.normal(k, (n, 256)), fmt) for k, n in zip(keys[1:], (128, 256, 128))]
    stacked = scaled_matmul(x, concat_weights(ws), backend="reference", out_dtype=jnp.float32)
    separate = jnp.concatenate([scaled_matmul(x, w, backend="reference", out_dtype=jnp.float32) for w in ws], -1)
    np.testing.assert_allclose(np.asarray(stacked), np.asarray(separate), rtol=1e-5, atol=1e-5)  # sum order only
    if fmt.startswith("mx"):
        with pytest.raises(ValueError, match="cannot stack"):
            concat_weights([prepare_weight(jax.random.normal(keys[1], (64, 256)), fmt)] * 2)


def test_quantizing_as_the_checkpoint_loads_gives_the_in_place_result(tiny):
    """`quantize_on_load` (generate.py --precision with a model folder: never the whole model in bf16 on the device)
    makes the same kernel weights as quantizing the loaded model in place."""
    from mxdit.model.loading import place_parameters

    model, inputs = tiny
    rules = krea2_rules(Precision.FP8.weight_format)
    with place_parameters(quantize_on_load(rules)):
        loaded = Krea2Transformer.from_pretrained(FIXTURES / "krea2" / "tiny", jnp.float32)
    assert isinstance(loaded.transformer_blocks[1].attn.to_k.weight.get_value(), GemmWeight)
    in_place = nnx.clone(model)
    quantize_linear_layers(in_place, rules, kernels=True)
    out, expected = (np.asarray(jax.jit(lambda *a, m=m: m(*a))(*inputs)) for m in (loaded, in_place))
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("batch", [1, 2])
def test_gated_residual_in_the_gemm_epilogue(batch, monkeypatch):
    """`Linear.gated_residual` (the DiT's `x + gate * proj(h)`): with a kernel weight and one image, the GEMM's
    epilogue adds it (float32, one rounding); with two (per-image gates) the plain form. Both give the plain value."""
    from mxdit.model.layers import Linear
    from mxdit.ops import linear as linear_ops

    linear = Linear(64, 32, bias=True, dtype=jnp.float32, rngs=nnx.Rngs(0))
    linear.bias.set_value(jax.random.normal(jax.random.key(1), (32,)))
    quantize_linear_layers(linear, [(r".*", "fp8_e4m3")], kernels=True)
    k = jax.random.split(jax.random.key(2), 3)
    x, residual = jax.random.normal(k[0], (batch, 8, 64)), jax.random.normal(k[1], (batch, 8, 32))
    gate = jax.random.normal(k[2], (batch, 1, 32))
    calls = []
    kernel = linear_ops.kernel_matmul
    monkeypatch.setattr(linear_ops, "kernel_matmul", lambda *a, **kw: calls.append(kw.get("residual") is not None)
                        or kernel(*a, **kw))
    out = linear.gated_residual(x, residual, gate)
    assert calls == [batch == 1]
    np.testing.assert_allclose(np.asarray(out), np.asarray(residual + gate * linear(x)), rtol=1e-5, atol=1e-5)


# mxfp6: fp8's path for a format that test_quant_model.py's test_quantized_checkpoint_reloads_bit_for_bit saves and
# reloads bit for bit; ~12 s on 2 cores
@pytest.mark.parametrize("precision", ["fp8", pytest.param("mxfp6", marks=pytest.mark.slow)])
def test_quantized_checkpoint_loads_straight_into_kernel_weights(tiny, tmp_path, precision):
    """A checkpoint written by `quant.model.save_quantized` (scripts/quantize.py) loads with its matrices as the
    GEMM kernels' weights (`load_quantized_model`): the model quantizing the bf16 checkpoint as it loads makes."""
    from mxdit.model.loading import place_parameters

    model, inputs = tiny
    rules = krea2_rules(Precision(precision).weight_format)
    path = tmp_path / "transformer.safetensors"
    save_quantized(quantize_model(dict(iter_params(model)), rules), path)
    loaded = load_quantized_model(lambda: Krea2Transformer(model.config, dtype=jnp.float32, rngs=nnx.Rngs(0)), path)
    assert isinstance(loaded.transformer_blocks[0].ff.down.weight.get_value(), GemmWeight)
    with place_parameters(quantize_on_load(rules)):
        on_load = Krea2Transformer.from_pretrained(FIXTURES / "krea2" / "tiny", jnp.float32)
    for (key, a), (_, b) in zip(iter_params(loaded), iter_params(on_load), strict=True):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=key)
    out, expected = (np.asarray(jax.jit(lambda *a, m=m: m(*a))(*inputs)) for m in (loaded, on_load))
    np.testing.assert_array_equal(out, expected)


def test_bad_quantized_checkpoints_are_named(tiny, tmp_path):
    from mxdit.model.loading import CheckpointError

    model, _ = tiny
    build = lambda: Krea2Transformer(model.config, dtype=jnp.float32, rngs=nnx.Rngs(0))  # noqa: E731
    params = dict(iter_params(model))
    with pytest.raises(CheckpointError, match="nothere.safetensors: no such file"):
        load_quantized_model(build, tmp_path / "nothere.safetensors")
    nvfp4 = tmp_path / "nvfp4.safetensors"
    save_quantized(quantize_model(params, krea2_rules("nvfp4")), nvfp4)
    with pytest.raises(CheckpointError, match=r"nvfp4.safetensors: .* 48 quantized tensors the GEMM kernels do not take \(text_fusion.*: nvfp4"):
        load_quantized_model(build, nvfp4)
    partial = tmp_path / "partial.safetensors"
    save_quantized({k: v for k, v in params.items() if k != "img_in.weight"}, partial)
    with pytest.raises(CheckpointError, match=r"partial.safetensors.*missing keys \(1\): img_in.weight"):
        load_quantized_model(build, partial)


@pytest.mark.parametrize("precision", ["fp8", "mxfp4", "int8"])
def test_fused_fp8_producers_feed_the_kernel_weights(tiny, monkeypatch, precision):
    """With FP8-activation kernel weights, each joint block's two adaptive norms, (stacked) SwiGLU and gated
    attention output quantize their output in the same pass (pallas_kernels/activations.py; here its reference): the velocity of the unfused
    path. INT8 weights take INT8 activations: nothing fused."""
    from mxdit.model import krea2
    from mxdit.model.krea2 import stack_projections

    model, inputs = tiny
    kernels = nnx.clone(model)
    quantize_linear_layers(kernels, krea2_rules(Precision(precision).weight_format), kernels=True)
    stack_projections(kernels)
    calls = []
    producer = krea2.fused_fp8_producer
    monkeypatch.setattr(krea2, "fused_fp8_producer", lambda name, backend: calls.append(name) or producer(name, backend))
    fused = np.asarray(kernels(*inputs))
    # the joint blocks' norms; every stacked SwiGLU (joint and text-fusion blocks; the tiny MX weights do not stack)
    stacked = sum(1 for _, m in nnx.iter_graph(kernels) if isinstance(m, krea2.SwiGLU) and m.gate_up is not None)
    norms = 2 * len(kernels.transformer_blocks)
    attentions = sum(1 for _, m in nnx.iter_graph(kernels) if isinstance(m, krea2.Attention) and m.to_qkvg is not None)
    expected = {} if precision == "int8" else {"modulated_rms_norm_fp8": norms, "swiglu_fp8": stacked,
                                               "sigmoid_gated_fp8": attentions}
    assert {name: calls.count(name) for name in set(calls)} == {k: v for k, v in expected.items() if v}
    assert precision != "fp8" or stacked == sum(1 for _, m in nnx.iter_graph(kernels) if isinstance(m, krea2.SwiGLU))
    monkeypatch.setattr(krea2, "fp8_input_backend", lambda *layers: None)
    unfused = np.asarray(kernels(*inputs))
    np.testing.assert_allclose(fused, unfused, rtol=0, atol=1e-5 * np.abs(unfused).max())
