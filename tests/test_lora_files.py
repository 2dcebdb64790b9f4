"""training/lora_files.py against diffusers on the tiny Krea 2 pipeline's transformer (float32): a PEFT LoRA made and
saved by diffusers, the same weights in the kohya and ComfyUI layouts, LoRAs exported by mxdit and loaded by diffusers
(fixtures: scripts/make_fixtures.py --only lora / lora_export, scripts/export_lora_fixture.py); several LoRAs at once,
fused into dense and quantized weights; other spellings of the layouts; unknown keys; FLUX.1's fused layers."""

import importlib.util
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from conftest import FIXTURES, relative_l2
from mxdit.model.flux import FluxTransformer
from mxdit.model.krea2 import Krea2Transformer
from mxdit.quant.model import krea2_rules
from mxdit.training.lora import adapters, quantize_base, remove_lora
from mxdit.training.lora_files import (LoraFileError, apply_loras, export_lora, parse_lora_arg, read_lora)

LORA = FIXTURES / "krea2" / "lora"
TRANSFORMER = FIXTURES / "krea2" / "tiny_pipeline" / "transformer"
INPUTS = ("hidden_states", "encoder_hidden_states", "timestep", "position_ids", "encoder_attention_mask")


@pytest.fixture(scope="module")
def reference():
    return dict(np.load(LORA / "reference.npz"))


@pytest.fixture(scope="module")
def model():
    return Krea2Transformer.from_pretrained(TRANSFORMER, dtype=jnp.float32)


@pytest.fixture
def clean(model):
    yield model
    remove_lora(model)


def forward(model, ref):
    return np.asarray(nnx.jit(lambda m, *a: m(*a))(model, *(ref[k] for k in INPUTS)))


def updates_equal(a, b):
    assert a.updates.keys() == b.updates.keys()
    for name in a.updates:
        np.testing.assert_allclose(a.updates[name].delta(), b.updates[name].delta(), rtol=1e-6, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("layout", ["diffusers", "kohya", "comfyui"])
@pytest.mark.parametrize("weight", [1.0, 0.5])
def test_each_layout_matches_diffusers_at_run_time(clean, reference, layout, weight):
    changed = apply_loras(clean, [(LORA / f"{layout}.safetensors", weight)])
    assert len(changed) == 53  # 2 joint + 4 text-fusion blocks x 8, and the 5 projections
    assert relative_l2(forward(clean, reference), reference[f"output_lora_{weight}"]) <= 1e-4


def test_fused_matches_diffusers_and_several_loras_add_up(reference):
    fused = Krea2Transformer.from_pretrained(TRANSFORMER, dtype=jnp.float32)
    apply_loras(fused, [(LORA / "kohya.safetensors", 0.25), (LORA / "comfyui.safetensors", 0.25)], fuse=True)
    assert not list(adapters(fused))
    assert relative_l2(forward(fused, reference), reference["output_lora_0.5"]) <= 1e-4
    # the same two at run time: one adapter per layer, the ranks stacked
    runtime = Krea2Transformer.from_pretrained(TRANSFORMER, dtype=jnp.float32)
    apply_loras(runtime, [(LORA / "diffusers.safetensors", 0.25), (LORA / "kohya.safetensors", 0.75)])
    assert runtime.transformer_blocks[0].attn.to_q.lora.A.shape == (8, 64)  # rank 4 + 4
    assert relative_l2(forward(runtime, reference), reference["output_lora_1.0"]) <= 1e-4
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        apply_loras(runtime, [(LORA / "diffusers.safetensors", 1.0)])


def test_fused_into_quantized_weights_stays_quantized(reference):
    model = Krea2Transformer.from_pretrained(TRANSFORMER, dtype=jnp.float32)
    quantized = quantize_base(model, krea2_rules("mxfp8_e4m3"))
    assert "transformer_blocks.0.attn.to_q.weight" in quantized
    before = model.transformer_blocks[0].attn.to_q.weight.get_value()
    apply_loras(model, [(LORA / "diffusers.safetensors", 1.0)], fuse=True)
    after = model.transformer_blocks[0].attn.to_q.weight.get_value()
    assert after.fmt == before.fmt == "mxfp8_e4m3" and after.shape == before.shape
    # the update is in the quantized weight, up to MXFP8's rounding of the sum (the text-fusion blocks stay dense)
    lora = read_lora(LORA / "diffusers.safetensors", model).updates["transformer_blocks.0.attn.to_q"]
    expected = before.dequantize(jnp.float32) + lora.delta()
    assert relative_l2(after.dequantize(jnp.float32), expected) < 0.05
    assert relative_l2(forward(model, reference), reference["output_lora_1.0"]) < 0.05


def test_other_spellings_of_the_layouts_read_the_same(model, tmp_path):
    diffusers = load_file(LORA / "diffusers.safetensors")
    expected = read_lora(LORA / "diffusers.safetensors", model)
    # PEFT's save_pretrained: a folder with adapter_model.safetensors (no prefix here) and the alpha in adapter_config
    peft = tmp_path / "peft"
    peft.mkdir()
    save_file({k.removeprefix("transformer."): v for k, v in diffusers.items()}, str(peft / "adapter_model.safetensors"))
    (peft / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8.0, "peft_type": "LORA"}))
    updates_equal(read_lora(peft, model), expected)
    # PEFT's adapter name inside the key, alpha as .alpha tensors
    named = {k.replace(".weight", ".default.weight"): v for k, v in diffusers.items()}
    named.update({k.removesuffix(".lora_A.weight") + ".alpha": np.array(8.0, np.float32) for k in diffusers if ".lora_A." in k})
    save_file(named, str(tmp_path / "named.safetensors"))
    updates_equal(read_lora(tmp_path / "named.safetensors", model), expected)
    # kohya with diffusers' module names (underscores resolved against the real paths: to_out_0, linear_1, ...)
    flat = {}
    for key, value in diffusers.items():
        module, part = key.removeprefix("transformer.").rsplit(".lora_", 1)
        name = "lora_unet_" + module.replace(".", "_")
        flat[f"{name}.lora_{'down' if part.startswith('A') else 'up'}.weight"] = value
        flat[f"{name}.alpha"] = np.array(8.0, np.float32)
    save_file(flat, str(tmp_path / "kohya_diffusers_names.safetensors"))
    updates_equal(read_lora(tmp_path / "kohya_diffusers_names.safetensors", model), expected)
    # the original names with lora_down / lora_up and .alpha under ComfyUI's prefix (alpha not folded into B)
    comfy = {}
    for key, value in load_file(LORA / "comfyui.safetensors").items():
        module, part = key.rsplit(".lora_", 1)
        comfy[f"{module}.lora_{'down' if part.startswith('A') else 'up'}.weight"] = value if part.startswith("A") else value / 2
        comfy[f"{module}.alpha"] = np.array(8.0, np.float32)
    save_file(comfy, str(tmp_path / "comfy_alpha.safetensors"))
    updates_equal(read_lora(tmp_path / "comfy_alpha.safetensors", model), expected)
    # without any alpha: alpha = rank, scale 1
    plain = tmp_path / "plain.safetensors"
    save_file(diffusers, str(plain))
    for name, update in read_lora(plain, model).updates.items():
        assert update.scale == 1.0 and expected.updates[name].scale == 2.0


def test_unknown_keys_are_reported_not_dropped(model, tmp_path):
    tensors = load_file(LORA / "diffusers.safetensors")
    tensors["lora_te_text_model_encoder_layers_0_mlp_fc1.lora_down.weight"] = np.zeros((4, 8), np.float32)
    tensors["transformer.transformer_blocks.0.attn.to_q.lora_magnitude_vector"] = np.zeros((64,), np.float32)
    tensors["transformer.no_such_layer.lora_A.weight"] = np.zeros((4, 8), np.float32)
    path = tmp_path / "extra.safetensors"
    save_file(tensors, str(path))
    with pytest.raises(LoraFileError) as error:
        read_lora(path, model)
    message = str(error.value)
    assert str(path) in message and "(3)" in message
    for key in ("lora_te_text_model_encoder_layers_0_mlp_fc1.lora_down.weight", "transformer.no_such_layer.lora_A.weight",
                "lora_magnitude_vector"):
        assert key in message
    lenient = read_lora(path, model, strict=False)
    assert len(lenient.unknown) == 3 and len(lenient.updates) == 53


def test_a_lora_for_another_model_names_file_and_key(tmp_path):
    other = Krea2Transformer.from_pretrained(FIXTURES / "krea2" / "tiny", dtype=jnp.float32)  # 16 input channels, not 64
    with pytest.raises(LoraFileError, match=r"kohya\.safetensors: lora_unet_first: lora_A has 64 inputs, img_in has 16"):
        read_lora(LORA / "kohya.safetensors", other)
    with pytest.raises(LoraFileError, match="not a readable safetensors file"):
        (tmp_path / "bad.safetensors").write_bytes(b"junk")
        read_lora(tmp_path / "bad.safetensors", other)


def _export_script():
    spec = importlib.util.spec_from_file_location("export_lora_fixture",
                                                  Path(__file__).parent.parent / "scripts" / "export_lora_fixture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("layout", ["diffusers", "comfyui"])
def test_exported_lora_gives_diffusers_the_same_output(reference, layout, tmp_path):
    exported = _export_script().exported_model()
    ours = forward(exported, reference)
    diffusers_out = np.load(LORA / "export_reference.npz")[f"output_{layout}"]
    assert relative_l2(diffusers_out, reference["output_base"]) > 0.1  # the LoRA matters
    assert relative_l2(ours, diffusers_out) <= 1e-4
    # the committed file is what the exporter writes today
    path = tmp_path / f"{layout}.safetensors"
    export_lora(exported, path, layout)
    committed, written = load_file(LORA / f"mxdit_{layout}.safetensors"), load_file(path)
    assert committed.keys() == written.keys()
    for key in committed:
        np.testing.assert_array_equal(committed[key], written[key], err_msg=key)
    # and it reads back into mxdit as the same function
    fresh = Krea2Transformer.from_pretrained(TRANSFORMER, dtype=jnp.float32)
    apply_loras(fresh, [(path, 1.0)])
    assert relative_l2(forward(fresh, reference), ours) <= 1e-5


def test_parse_lora_arg():
    assert parse_lora_arg("a.safetensors:0.8") == (Path("a.safetensors"), 0.8)
    assert parse_lora_arg("a.safetensors") == (Path("a.safetensors"), 1.0)
    assert parse_lora_arg("C:/x/a.safetensors") == (Path("C:/x/a.safetensors"), 1.0)
    assert parse_lora_arg("a.safetensors:-1") == (Path("a.safetensors"), -1.0)


# --------------------------------------------------------------------------------------------------------------------
# FLUX.1: the original layout fuses q, k, v (and the single blocks' MLP input) into one layer


@pytest.fixture(scope="module")
def flux():
    return FluxTransformer.from_pretrained(FIXTURES / "flux" / "tiny", dtype=jnp.float32)


def test_flux_kohya_fused_layers_split_into_our_modules(flux, tmp_path):
    dim, rank = flux.config.inner_dim, 2
    rng = np.random.default_rng(0)
    A = {n: rng.standard_normal((rank, dim)).astype(np.float32) for n in ("qkv", "linear1", "mod")}
    B = {"qkv": rng.standard_normal((3 * dim, rank)).astype(np.float32),
         "linear1": rng.standard_normal((7 * dim, rank)).astype(np.float32),
         "mod": rng.standard_normal((2 * dim, rank)).astype(np.float32)}
    kohya = {}
    for name, part in (("double_blocks_1_img_attn_qkv", "qkv"), ("single_blocks_0_linear1", "linear1"),
                       ("final_layer_adaLN_modulation_1", "mod")):
        kohya[f"lora_unet_{name}.lora_down.weight"] = A[part]
        kohya[f"lora_unet_{name}.lora_up.weight"] = B[part]
        kohya[f"lora_unet_{name}.alpha"] = np.array(1.0, np.float32)  # scale 1/2
    save_file(kohya, str(tmp_path / "flux_kohya.safetensors"))
    # The same update in our module names, diffusers' layout: each fused row block to its own module, the final
    # modulation's (shift, scale) halves as diffusers' (scale, shift).
    ours = {}
    rows = {"transformer_blocks.1.attn.to_q": ("qkv", slice(0, dim)), "transformer_blocks.1.attn.to_k": ("qkv", slice(dim, 2 * dim)),
            "transformer_blocks.1.attn.to_v": ("qkv", slice(2 * dim, 3 * dim)),
            "single_transformer_blocks.0.attn.to_q": ("linear1", slice(0, dim)),
            "single_transformer_blocks.0.attn.to_k": ("linear1", slice(dim, 2 * dim)),
            "single_transformer_blocks.0.attn.to_v": ("linear1", slice(2 * dim, 3 * dim)),
            "single_transformer_blocks.0.proj_mlp": ("linear1", slice(3 * dim, 7 * dim))}
    for module, (part, r) in rows.items():
        ours[f"transformer.{module}.lora_A.weight"] = A[part]
        ours[f"transformer.{module}.lora_B.weight"] = np.ascontiguousarray(B[part][r])
    ours["transformer.norm_out.linear.lora_A.weight"] = A["mod"]
    ours["transformer.norm_out.linear.lora_B.weight"] = np.concatenate([B["mod"][dim:], B["mod"][:dim]])
    save_file(ours, str(tmp_path / "flux_ours.safetensors"), metadata={
        "lora_adapter_metadata": json.dumps({"transformer.r": rank, "transformer.lora_alpha": 1.0})})
    a, b = read_lora(tmp_path / "flux_kohya.safetensors", flux), read_lora(tmp_path / "flux_ours.safetensors", flux)
    assert len(a.updates) == 8
    updates_equal(a, b)
    assert a.updates["transformer_blocks.1.attn.to_q"].scale == 0.5

    ref = dict(np.load(FIXTURES / "flux" / "reference.npz"))
    args = [ref[k] for k in ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "img_ids",
                             "txt_ids", "guidance")]
    base = np.asarray(flux(*args))
    outs = []
    for path in ("flux_kohya", "flux_ours"):
        apply_loras(flux, [(tmp_path / f"{path}.safetensors", 0.7)])
        outs.append(np.asarray(flux(*args)))
        remove_lora(flux)
    assert relative_l2(outs[0], base) > 1e-3 and relative_l2(outs[0], outs[1]) <= 1e-6
