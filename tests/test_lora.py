"""training/lora.py and the adapter of model/lora.py on a tiny random Krea 2 transformer (float32): which layers get
adapters, a fresh adapter leaves the model unchanged, merge equals the adapter and unmerge restores the weights bit
for bit, a quantized frozen base, remat policies, saving in diffusers' key names and loading back."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import relative_l2
from mxdit.model.krea2 import Krea2Config, Krea2Transformer
from mxdit.model.pipeline_common import image_position_ids
from mxdit.model.lora import LoraConfig, adapters, linear_layers, remove_lora
from mxdit.training.lora import (KREA2_AUTHORS, add_lora, load_lora, lora_state_dict, merge_lora, quantize_base,
                                 save_lora, unmerge_lora)
from mxdit.training.train import REMAT_POLICIES, flow_matching_loss

CFG = Krea2Config(in_channels=64, num_layers=2, attention_head_dim=32, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=256, timestep_embed_dim=64, text_hidden_dim=64, num_text_layers=3,
                  text_num_attention_heads=4, text_num_key_value_heads=4, text_intermediate_size=128,
                  num_layerwise_text_blocks=1, num_refiner_text_blocks=1, axes_dims_rope=(8, 12, 12))
TEXT, GRID = 6, (2, 3)


def make_model(seed=0):
    return Krea2Transformer(CFG, dtype=jnp.float32, rngs=nnx.Rngs(jax.random.key(seed, impl="rbg")))


def inputs(batch=2):
    keys = jax.random.split(jax.random.key(1), 3)
    latents = jax.random.normal(keys[0], (batch, GRID[0] * GRID[1], 64))
    text = jax.random.normal(keys[1], (batch, TEXT, CFG.num_text_layers, CFG.text_hidden_dim))
    ids = jnp.asarray(np.concatenate([np.zeros((TEXT, 3), np.float32), image_position_ids(*GRID)]))
    mask = jnp.asarray(np.arange(TEXT)[None, :] < np.array([[4], [6]]))[:batch]
    return latents, text, jnp.full((batch,), 0.6), ids, mask


def randomize_b(model, seed=2):
    for i, (_, adapter) in enumerate(adapters(model)):
        adapter.B.set_value(0.05 * jax.random.normal(jax.random.key(seed + i), adapter.B.shape))


def test_default_targets_are_attention_and_swiglu_of_every_block():
    model = make_model()
    names = add_lora(model, LoraConfig(rank=4, alpha=8))
    blocks = ["transformer_blocks.0", "transformer_blocks.1", "text_fusion.layerwise_blocks.0",
              "text_fusion.refiner_blocks.0"]
    layers = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_gate", "attn.to_out.0", "ff.gate", "ff.up", "ff.down"]
    assert sorted(names) == sorted(f"{b}.{layer}" for b in blocks for layer in layers)
    adapter = model.transformer_blocks[1].attn.to_k.lora
    assert adapter.A.shape == (4, CFG.hidden_size) and adapter.B.shape == (64, 4) and adapter.scale == 2.0
    # diffusers' Krea 2 trainer default: no ff.gate, but the input/time/text/output projections
    authors = {name for name, _ in linear_layers(make_model())
               if any(__import__("re").fullmatch(p, name) for p in KREA2_AUTHORS)}
    assert "img_in" in authors and "time_mod_proj" in authors and "transformer_blocks.0.ff.gate" not in authors
    with pytest.raises(ValueError, match="match no Linear layer"):
        add_lora(make_model(), LoraConfig(targets=("nothing_here",)))
    with pytest.raises(ValueError, match="already has a LoRA adapter"):
        add_lora(model, LoraConfig(rank=4))


def test_fresh_adapter_leaves_the_output_unchanged_and_base_is_not_a_lora_param():
    model = make_model()
    before = model(*inputs())
    add_lora(model, LoraConfig(rank=4))
    np.testing.assert_array_equal(model(*inputs()), before)  # B = 0
    _, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)
    lora_keys = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(lora)}
    assert "transformer_blocks.0.attn.to_q.lora.A" in lora_keys and len(lora_keys) == 2 * 32
    assert all(not isinstance(v, nnx.LoRAParam) for _, v in nnx.to_flat_state(frozen))


def test_merge_equals_the_adapter_and_unmerge_restores_the_weights_exactly():
    model = make_model()
    add_lora(model, LoraConfig(rank=4, alpha=4))
    randomize_b(model)
    weights = {n: np.asarray(layer.weight.get_value()) for n, layer in linear_layers(model)}
    with_adapter = model(*inputs())
    assert relative_l2(with_adapter, make_model()(*inputs())) > 1e-3  # the adapters do something
    originals = merge_lora(model)
    assert len(originals) == 32 and all(a.merged for _, a in adapters(model))
    assert relative_l2(model(*inputs()), with_adapter) < 1e-5
    unmerge_lora(model, originals)
    for name, layer in linear_layers(model):
        np.testing.assert_array_equal(layer.weight.get_value(), weights[name])
    np.testing.assert_array_equal(model(*inputs()), with_adapter)


@pytest.mark.slow
def test_quantized_frozen_base_trains_the_adapters_only():
    from mxdit.pallas_kernels import gemm
    from mxdit.quant.model import krea2_rules

    model = make_model()
    add_lora(model, LoraConfig(rank=4))
    randomize_b(model)
    layer = model.transformer_blocks[0].ff.up
    dense = layer.weight.get_value()
    quantized = quantize_base(model, krea2_rules("mxfp8_e4m3"))
    assert "transformer_blocks.0.attn.to_q.weight" in quantized and "img_in.weight" not in quantized
    weight = layer.weight.get_value()
    values = gemm.dequantize_weight(weight)[:, :CFG.hidden_size]
    assert isinstance(weight, gemm.GemmWeight) and relative_l2(values, dense) < 0.05
    # the layer computes the GEMM kernels' product (activations quantized per token), plus its adapter
    x = jax.random.normal(jax.random.key(3), (5, CFG.hidden_size))
    expected = (gemm.scaled_matmul(x, weight, backend="reference", out_dtype=jnp.float32)
                + layer.lora.scale * (x @ layer.lora.A[...].T) @ layer.lora.B[...].T)
    np.testing.assert_allclose(layer(x), expected, rtol=1e-5, atol=1e-5)

    graphdef, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)
    latents, text, _, ids, mask = inputs()

    @jax.jit
    @jax.grad
    def grads(lora):
        m = nnx.merge(graphdef, lora, frozen)
        return flow_matching_loss(m, latents, text, mask, ids, jnp.ones_like(latents), jnp.array([0.3, 0.8]))

    norms = [float(jnp.linalg.norm(g)) for g in jax.tree.leaves(grads(lora))]
    assert len(norms) == 64 and min(norms) > 0  # only the 64 adapter matrices are differentiated
    merged = merge_lora(model)  # a quantized weight merges into a dense one
    assert layer.weight.get_value().shape == dense.shape
    unmerge_lora(model, merged)
    restored = layer.weight.get_value()
    assert isinstance(restored, gemm.GemmWeight) and restored.fmt == weight.fmt
    np.testing.assert_array_equal(restored.data, weight.data)
    np.testing.assert_array_equal(restored.scale, weight.scale)


@pytest.mark.slow  # ~30 s on 2 cores; test_flux_remat_changes_memory_not_the_gradients runs by default
def test_remat_policies_give_the_same_loss_and_gradients():
    model = make_model()
    add_lora(model, LoraConfig(rank=4))
    randomize_b(model)
    latents, text, _, ids, mask = inputs()
    noise = jax.random.normal(jax.random.key(5), latents.shape)

    def value_and_grad(remat):
        model.remat_policy = REMAT_POLICIES[remat]
        graphdef, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)

        @jax.jit
        def f(lora):
            m = nnx.merge(graphdef, lora, frozen)
            return flow_matching_loss(m, latents, text, mask, ids, noise, jnp.array([0.3, 0.8]))

        loss, grads = jax.value_and_grad(f)(lora)
        return float(loss), np.concatenate([np.ravel(g) for g in jax.tree.leaves(grads)])

    loss, grads = value_and_grad("none")
    for policy in ("block", "dots"):
        loss_r, grads_r = value_and_grad(policy)
        # the same math; XLA fuses the recomputed graph differently, so float32 rounding differs slightly
        assert abs(loss_r - loss) <= 1e-6 * abs(loss)
        assert relative_l2(grads_r, grads) < 1e-5


def test_save_in_diffusers_names_and_load_onto_another_model(tmp_path):
    model = make_model()
    config = LoraConfig(rank=4, alpha=2)
    add_lora(model, config)
    randomize_b(model)
    state = lora_state_dict(model)
    assert state["transformer.transformer_blocks.1.attn.to_out.0.lora_A.weight"].shape == (4, CFG.hidden_size)
    assert state["transformer.transformer_blocks.1.ff.down.lora_B.weight"].shape == (CFG.hidden_size, 4)
    path = tmp_path / "lora.safetensors"
    save_lora(model, path, config)
    other = make_model()  # same base weights (same seed): the outputs must agree exactly
    assert load_lora(other, path) == config
    np.testing.assert_array_equal(other(*inputs()), model(*inputs()))
    remove_lora(other)
    np.testing.assert_array_equal(other(*inputs()), make_model()(*inputs()))
    with pytest.raises(ValueError, match="is not a Linear layer"):
        small = make_model()
        small_cfg = dataclasses.replace(CFG, num_layers=1)
        load_lora(Krea2Transformer(small_cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)), path)
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="bad.safetensors: not a readable safetensors file"):
        load_lora(small, tmp_path / "bad.safetensors")


def test_config_errors_name_the_setting():
    with pytest.raises(ValueError, match="rank must be >= 1"):
        LoraConfig(rank=0)
    with pytest.raises(ValueError, match="dropout"):
        LoraConfig(dropout=1.0)
    with pytest.raises(ValueError, match="not a regular expression"):
        LoraConfig(targets=("to_q(",))


def test_dropout_acts_only_with_a_key():
    from mxdit.model.layers import Linear

    layer = Linear(64, 32, bias=False, dtype=jnp.float32, rngs=nnx.Rngs(0))
    model = nnx.List([layer])
    add_lora(model, LoraConfig(rank=4, dropout=0.5, targets=(r"0",)))
    randomize_b(model)
    x = jax.random.normal(jax.random.key(4), (8, 64))
    plain = layer(x)
    layer.lora.dropout_key = nnx.data(jax.random.key(0))
    dropped = layer(x)
    assert relative_l2(dropped, plain) > 1e-3
    base = x @ layer.weight[...].T  # dropout touches the adapter's input only
    keep = jax.random.bernoulli(jax.random.key(0), 0.5, x.shape)
    expected = base + layer.lora.scale * ((jnp.where(keep, 2 * x, 0) @ layer.lora.A[...].T) @ layer.lora.B[...].T)
    np.testing.assert_allclose(dropped, expected, rtol=1e-5, atol=1e-6)


def test_bf16_base_computes_in_bf16_with_float32_master_weights():
    from mxdit.model.layers import Linear

    model = nnx.List([Linear(64, 32, bias=True, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))])
    add_lora(model, LoraConfig(rank=4, targets=(r"0",)))
    randomize_b(model)
    adapter = model[0].lora
    assert adapter.A.dtype == adapter.B.dtype == jnp.float32
    x = jax.random.normal(jax.random.key(4), (8, 64), jnp.bfloat16)
    assert model[0](x).dtype == jnp.bfloat16
    graphdef, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)
    grads = jax.grad(lambda lora: jnp.sum(nnx.merge(graphdef, lora, frozen)[0](x).astype(jnp.float32) ** 2))(lora)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))
