"""Krea 2 transformer: parity with diffusers' Krea2Transformer2DModel on the tiny random fixture (float32)."""

import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from conftest import FIXTURES, relative_l2
from mxdit.model.krea2 import Krea2Config, Krea2Transformer, original_key_to_diffusers
from mxdit.model.loading import CheckpointError, iter_params, save_safetensors

TINY = FIXTURES / "krea2" / "tiny"
REFERENCE = FIXTURES / "krea2" / "reference.npz"


@pytest.fixture(scope="module")
def reference():
    return dict(np.load(REFERENCE))


@pytest.fixture(scope="module")
def tiny():
    return Krea2Transformer.from_pretrained(TINY, dtype=jnp.float32)


def run(model, ref, masked=True, jit=False):
    args = (ref["hidden_states"], ref["encoder_hidden_states"], ref["timestep"], ref["position_ids"])
    mask = ref["encoder_attention_mask"] if masked else None
    if jit:
        return nnx.jit(lambda m, *a: m(*a))(model, *args, mask)
    return model(*args, mask)


def params(model):
    return {k: np.asarray(v) for k, v in iter_params(model)}


def test_matches_diffusers_with_text_padding_mask(tiny, reference):
    out = run(tiny, reference, masked=True)
    assert out.shape == reference["output_masked"].shape  # batch 2, non-square 3x5 grid
    assert relative_l2(out, reference["output_masked"]) <= 2e-6


def test_matches_diffusers_without_mask(tiny, reference):
    assert relative_l2(run(tiny, reference, masked=False), reference["output_unmasked"]) <= 2e-6


def test_jitted_forward_matches_diffusers(tiny, reference):
    assert relative_l2(run(tiny, reference, jit=True), reference["output_masked"]) <= 2e-6


@pytest.mark.parametrize("masked", [True, False])
def test_text_stage_computed_once_gives_the_same_velocity(tiny, reference, masked):
    """`fuse_text` (what the pipeline runs once per prompt) passed in place of the tapped states: the same output
    as diffusers', which runs the text stage inside every call."""
    mask = reference["encoder_attention_mask"] if masked else None
    fused = tiny.fuse_text(reference["encoder_hidden_states"], mask)
    assert fused.shape == (*reference["encoder_hidden_states"].shape[:2], tiny.config.hidden_size)
    out = tiny(reference["hidden_states"], fused, reference["timestep"], reference["position_ids"], mask)
    expected = reference["output_masked" if masked else "output_unmasked"]
    assert relative_l2(out, expected) <= 2e-6
    np.testing.assert_allclose(np.asarray(out), np.asarray(run(tiny, reference, masked)), rtol=0, atol=1e-6)


@pytest.mark.parametrize("multiple, kept", [(1, 4), (3, 6), (64, 7)])
def test_trimmed_text_gives_diffusers_velocity(tiny, reference, multiple, kept):
    """`trim_padded_text` drops the padded tokens of the fused text (a shorter joint sequence): the same output as
    diffusers' run over all of them. The first fixture prompt has 4 real tokens of 7, padding in the middle."""
    from mxdit.model.krea2 import trim_padded_text

    ref = {k: v[:1] for k, v in reference.items() if k != "position_ids"}
    mask = ref["encoder_attention_mask"]
    assert mask.sum() == 4 and mask.shape == (1, 7)
    fused, trimmed_mask = trim_padded_text(tiny.fuse_text(ref["encoder_hidden_states"], mask), mask, multiple)
    assert fused.shape[1] == kept
    np.testing.assert_array_equal(np.asarray(trimmed_mask), np.arange(kept)[None] < 4)
    ids = np.concatenate([reference["position_ids"][:kept], reference["position_ids"][7:]])
    out = tiny(ref["hidden_states"], fused, ref["timestep"], ids, trimmed_mask)
    assert relative_l2(out, ref["output_masked"]) <= 2e-6
    full = tiny(ref["hidden_states"], ref["encoder_hidden_states"], ref["timestep"], reference["position_ids"], mask)
    np.testing.assert_allclose(np.asarray(out), np.asarray(full), rtol=0, atol=1e-5)


def test_trimmed_length_rounds_the_joint_sequence_when_asked():
    """`joint_multiple`: the shortest kept length (a multiple of `multiple`) that makes image + text a multiple of
    it; the plain rounding when none fits in the padded length."""
    from mxdit.model.krea2 import JOINT_TOKENS_MULTIPLE, trim_padded_text

    fused, mask = jnp.zeros((2, 512, 3)), np.arange(512)[None] < np.array([[13], [7]])
    kept = lambda **kw: trim_padded_text(fused, mask, **kw)[0].shape[1]
    assert kept() == 64
    assert kept(image_len=4096, joint_multiple=JOINT_TOKENS_MULTIPLE) == 128  # 1024x1024: 4224 tokens
    assert kept(image_len=4032, joint_multiple=JOINT_TOKENS_MULTIPLE) == 192  # 768x1344: 4224 tokens
    assert kept(image_len=4080, joint_multiple=JOINT_TOKENS_MULTIPLE) == 64   # no multiple of 64 fits: plain rounding
    out, out_mask = trim_padded_text(fused, mask, image_len=4096, joint_multiple=JOINT_TOKENS_MULTIPLE)
    np.testing.assert_array_equal(np.asarray(out_mask).sum(1), [13, 7])


def test_padded_text_tokens_do_not_change_image_tokens(tiny, reference):
    ref = dict(reference)
    mask = ref["encoder_attention_mask"]
    text = ref["encoder_hidden_states"].copy()
    text[~mask] = 1e3 * np.random.default_rng(0).standard_normal(text[~mask].shape)
    ref["encoder_hidden_states"] = text
    np.testing.assert_allclose(run(tiny, ref), run(tiny, reference), rtol=1e-5, atol=1e-5)
    # ...while the mask itself matters: the same inputs without it give another answer.
    assert relative_l2(run(tiny, ref, masked=False), reference["output_masked"]) > 1e-2


def test_config_is_read_from_config_json(tiny):
    cfg = tiny.config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.axes_dims_rope) == (4, 2, (4, 6, 6))
    assert cfg.num_attention_heads // cfg.num_key_value_heads > 1  # GQA is exercised


def test_sharded_checkpoint_loads_the_same_weights(tiny, reference):
    sharded = Krea2Transformer.from_pretrained(FIXTURES / "krea2" / "tiny_sharded", dtype=jnp.float32)
    a, b = params(tiny), params(sharded)
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_original_single_file_layout_matches_diffusers(tiny, reference):
    model = Krea2Transformer.from_pretrained(
        FIXTURES / "krea2" / "tiny_original.safetensors", dtype=jnp.float32, config=TINY / "config.json"
    )
    a, b = params(tiny), params(model)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    assert relative_l2(run(model, reference), reference["output_masked"]) <= 2e-6


def test_original_key_names_map_to_diffusers_names():
    assert original_key_to_diffusers("model.diffusion_model.blocks.3.attn.wq.weight") == (
        "transformer_blocks.3.attn.to_q.weight")
    assert original_key_to_diffusers("blocks.0.attn.qknorm.knorm.scale") == "transformer_blocks.0.attn.norm_k.weight"
    assert original_key_to_diffusers("txtfusion.refiner_blocks.1.prenorm.scale") == (
        "text_fusion.refiner_blocks.1.norm1.weight")
    assert original_key_to_diffusers("last.modulation.lin") == "final_layer.scale_shift_table"
    assert original_key_to_diffusers("tproj.1.bias") == "time_mod_proj.bias"


def test_single_file_with_diffusers_keys(tmp_path, tiny, reference):
    file = tmp_path / "krea2.safetensors"
    shutil.copy(TINY / "diffusion_pytorch_model.safetensors", file)
    model = Krea2Transformer.from_pretrained(file, dtype=jnp.float32, config=Krea2Config.from_json(TINY / "config.json"))
    assert relative_l2(run(model, reference), reference["output_masked"]) <= 2e-6


def test_single_file_config_is_inferred_from_tensor_shapes(tmp_path):
    # head_dim 128 (the released one), all other sizes small and distinct, so a swapped field would show.
    cfg = Krea2Config(in_channels=8, num_layers=3, attention_head_dim=128, num_attention_heads=2, num_key_value_heads=1,
                      intermediate_size=40, timestep_embed_dim=16, text_hidden_dim=24, num_text_layers=5,
                      text_num_attention_heads=3, text_num_key_value_heads=1, text_intermediate_size=36,
                      num_layerwise_text_blocks=1, num_refiner_text_blocks=3)
    model = Krea2Transformer(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    file = tmp_path / "krea2.safetensors"
    save_safetensors(dict(iter_params(model)), file)
    assert Krea2Transformer.from_pretrained(file, dtype=jnp.float32).config == cfg


def test_single_file_with_unknown_rotary_split_asks_for_a_config():
    with pytest.raises(CheckpointError, match="pass config="):
        Krea2Transformer.from_pretrained(FIXTURES / "krea2" / "tiny_original.safetensors")


def test_bfloat16_load_keeps_norm_weights_in_float32():
    model = Krea2Transformer.from_pretrained(TINY, dtype=jnp.bfloat16)
    for key, value in iter_params(model):
        expected = jnp.float32 if ".norm" in key or key.startswith("norm") else jnp.bfloat16
        assert value.dtype == expected, key


def test_bfloat16_forward_stays_close_to_float32(tiny, reference):
    model = Krea2Transformer.from_pretrained(TINY, dtype=jnp.bfloat16)
    out = run(model, reference)
    assert out.dtype == jnp.bfloat16
    assert relative_l2(out.astype(jnp.float32), reference["output_masked"]) < 2e-2


def test_bfloat16_forward_matches_diffusers_in_bfloat16(reference):
    # the timestep as the pipeline passes it in bfloat16 (rounded; that alone moves this tiny model's output by ~20%)
    model = Krea2Transformer.from_pretrained(TINY, dtype=jnp.bfloat16)
    ref = dict(reference, timestep=reference["timestep"].astype(jnp.bfloat16).astype(np.float32))
    assert relative_l2(run(model, ref), reference["output_masked_bf16"]) <= 2e-2


# --------------------------------------------------------------------------------------------------------------------
# Errors name the problem


def _write_variant(tmp_path, edit):
    folder = tmp_path / "transformer"
    folder.mkdir()
    shutil.copy(TINY / "config.json", folder / "config.json")
    tensors = load_file(str(TINY / "diffusion_pytorch_model.safetensors"))
    edit(tensors)
    save_safetensors(tensors, folder / "diffusion_pytorch_model.safetensors")
    return folder


def test_missing_keys_are_listed(tmp_path):
    folder = _write_variant(tmp_path, lambda t: t.pop("transformer_blocks.1.attn.to_gate.weight"))
    with pytest.raises(CheckpointError, match=r"missing keys \(1\): transformer_blocks\.1\.attn\.to_gate\.weight"):
        Krea2Transformer.from_pretrained(folder)


def test_unexpected_keys_are_listed(tmp_path):
    folder = _write_variant(tmp_path, lambda t: t.update({"transformer_blocks.9.extra.weight": np.zeros(3, np.float32)}))
    with pytest.raises(CheckpointError, match=r"unexpected keys \(1\): transformer_blocks\.9\.extra\.weight"):
        Krea2Transformer.from_pretrained(folder)


def test_shape_mismatch_names_key_and_both_shapes(tmp_path):
    folder = _write_variant(tmp_path, lambda t: t.update({"img_in.weight": np.zeros((64, 12), np.float32)}))
    with pytest.raises(CheckpointError, match=r"img_in\.weight: checkpoint has shape \(64, 12\), model expects \(64, 16\)"):
        Krea2Transformer.from_pretrained(folder)


def test_unreadable_file_is_named(tmp_path):
    file = tmp_path / "broken.safetensors"
    file.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    with pytest.raises(CheckpointError, match=f"{file}: not a readable safetensors file"):
        Krea2Transformer.from_pretrained(file)


def test_folder_without_config_is_named(tmp_path):
    folder = tmp_path / "transformer"
    folder.mkdir()
    shutil.copy(TINY / "diffusion_pytorch_model.safetensors", folder)
    with pytest.raises(CheckpointError, match=f"{folder / 'config.json'}: file not found"):
        Krea2Transformer.from_pretrained(folder)


def test_folder_without_weights_is_named(tmp_path):
    shutil.copy(TINY / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="no weights found"):
        Krea2Transformer.from_pretrained(tmp_path)


def test_missing_shard_is_named(tmp_path):
    folder = tmp_path / "sharded"
    shutil.copytree(FIXTURES / "krea2" / "tiny_sharded", folder)
    (folder / "diffusion_pytorch_model-00003-of-00012.safetensors").unlink()
    with pytest.raises(CheckpointError, match="00003-of-00012.safetensors"):
        Krea2Transformer.from_pretrained(folder)


def test_missing_path_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="no such file or folder"):
        Krea2Transformer.from_pretrained(tmp_path / "nowhere")


def test_invalid_config_is_named(tmp_path):
    folder = tmp_path / "transformer"
    shutil.copytree(TINY, folder)
    (folder / "config.json").write_text('{"attention_head_dim": 16, "axes_dims_rope": [4, 4, 4]}')
    with pytest.raises(CheckpointError, match=r"config\.json: invalid Krea2Config: sum\(axes_dims_rope\)=12"):
        Krea2Transformer.from_pretrained(folder)


def test_cudnn_attention_leaves_heads_it_does_not_take_to_xla():
    """cuDNN's fused attention takes head dims that are multiples of 8 (up to 128 here): the default GPU attention
    of a model with narrower heads (the tiny fixture's text blocks, 6 wide) is XLA's, not an error."""
    from mxdit.ops.attention import attention, cudnn_takes_head_dim

    assert cudnn_takes_head_dim(128) and cudnn_takes_head_dim(16)
    assert not cudnn_takes_head_dim(6) and not cudnn_takes_head_dim(12) and not cudnn_takes_head_dim(256)
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 10, h, 6)), jnp.bfloat16) for h in (4, 2, 2))
    lengths = jnp.asarray([7])
    np.testing.assert_array_equal(np.asarray(attention(q, k, v, lengths, "cudnn"), np.float32),
                                  np.asarray(attention(q, k, v, lengths, "xla"), np.float32))
