"""model/lora_files.py against diffusers on the tiny Krea 2 pipeline's transformer (float32): a PEFT LoRA made and
saved by diffusers, the same weights in the kohya and ComfyUI layouts, LoRAs exported by mxdit and loaded by diffusers
(fixtures: scripts/make_fixtures.py --only lora / lora_export, scripts/export_lora_fixture.py); several LoRAs at once,
fused into dense and quantized weights; other spellings of the layouts; unknown keys; FLUX.1's diffusers and
kohya layouts (fused qkv) against diffusers, and a FLUX.1 LoRA exported by mxdit and loaded by diffusers (`--only
flux_lora` / `flux_lora_export`)."""

import dataclasses
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
from mxdit.model.lora import LoraConfig, adapters, remove_lora
from mxdit.model.lora_files import LoraFileError, apply_loras, export_lora, parse_lora_arg, read_lora
from mxdit.quant.model import krea2_rules, quantize_linear_layers

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
    assert relative_l2(forward(clean, reference), reference[f"output_lora_{weight}"]) <= 2e-6


def test_fused_matches_diffusers_and_several_loras_add_up(reference):
    fused = Krea2Transformer.from_pretrained(TRANSFORMER, dtype=jnp.float32)
    apply_loras(fused, [(LORA / "kohya.safetensors", 0.25), (LORA / "comfyui.safetensors", 0.25)], fuse=True)
    assert not list(adapters(fused))
    assert relative_l2(forward(fused, reference), reference["output_lora_0.5"]) <= 2e-6
    # the same two at run time: one adapter per layer, the ranks stacked
    runtime = Krea2Transformer.from_pretrained(TRANSFORMER, dtype=jnp.float32)
    apply_loras(runtime, [(LORA / "diffusers.safetensors", 0.25), (LORA / "kohya.safetensors", 0.75)])
    assert runtime.transformer_blocks[0].attn.to_q.lora.A.shape == (8, 64)  # rank 4 + 4
    assert relative_l2(forward(runtime, reference), reference["output_lora_1.0"]) <= 2e-6
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        apply_loras(runtime, [(LORA / "diffusers.safetensors", 1.0)])


def test_fused_into_quantized_weights_stays_quantized(reference):
    model = Krea2Transformer.from_pretrained(TRANSFORMER, dtype=jnp.float32)
    quantized = quantize_linear_layers(model, krea2_rules("mxfp8_e4m3"), kernels=False)  # simulated quantization
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
    # AI-Toolkit: PEFT's base_model.model. prefix on the original names (alpha folded into B, as in the ComfyUI file)
    toolkit = {k.replace("diffusion_model.", "base_model.model.", 1): v
               for k, v in load_file(LORA / "comfyui.safetensors").items()}
    save_file(toolkit, str(tmp_path / "toolkit.safetensors"))
    updates_equal(read_lora(tmp_path / "toolkit.safetensors", model), expected)
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
    assert relative_l2(ours, diffusers_out) <= 2e-6
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
    assert relative_l2(forward(fresh, reference), ours) <= 1e-6



def test_train_lora_output_is_the_diffusers_export(tmp_path):
    """train_lora.py's lora.safetensors (save_lora) carries diffusers' metadata too, so diffusers reads its alpha."""
    from safetensors import safe_open

    from mxdit.training.lora import save_lora

    model = _export_script().exported_model()
    save_lora(model, tmp_path / "trained.safetensors", LoraConfig(rank=3, alpha=1.5))
    export_lora(model, tmp_path / "exported.safetensors", "diffusers")
    trained, exported = load_file(tmp_path / "trained.safetensors"), load_file(tmp_path / "exported.safetensors")
    assert trained.keys() == exported.keys() and all(np.array_equal(trained[k], exported[k]) for k in trained)
    metadata = [safe_open(str(tmp_path / f), "numpy").metadata()["lora_adapter_metadata"]
                for f in ("trained.safetensors", "exported.safetensors")]
    assert metadata[0] == metadata[1]
    assert json.loads(metadata[0])["transformer.lora_alpha"] == 1.5  # rank 3 on the attention and SwiGLU layers
    scales = {n: u.scale for n, u in read_lora(tmp_path / "trained.safetensors", model).updates.items()}
    assert scales["transformer_blocks.0.attn.to_q"] == 0.5 and scales["img_in"] == 2.0

def test_parse_lora_arg():
    assert parse_lora_arg("a.safetensors:0.8") == (Path("a.safetensors"), 0.8)
    assert parse_lora_arg("a.safetensors") == (Path("a.safetensors"), 1.0)
    assert parse_lora_arg("C:/x/a.safetensors") == (Path("C:/x/a.safetensors"), 1.0)
    assert parse_lora_arg("a.safetensors:-1") == (Path("a.safetensors"), -1.0)


def test_parse_lora_arg_names_a_bad_weight_and_keeps_files_with_colons(tmp_path):
    file = tmp_path / "style.safetensors"
    file.write_bytes(b"")
    with pytest.raises(ValueError, match=r"^weight 'abc' is not a finite number \(FILE\[:WEIGHT\], e\.g\. .*style"
                                         r"\.safetensors:0\.8\)$"):
        parse_lora_arg(f"{file}:abc")
    with pytest.raises(ValueError, match="weight 'nan' is not a finite number"):
        parse_lora_arg(f"{file}:nan")
    with pytest.raises(ValueError, match=r"weight 'abc' .*; and missing\.safetensors: no such file"):
        parse_lora_arg("missing.safetensors:abc")
    colons = tmp_path / "v1:final.safetensors"  # an existing file is taken whole, weight 1
    colons.write_bytes(b"")
    assert parse_lora_arg(str(colons)) == (colons, 1.0)
    assert parse_lora_arg(f"{colons}:0.5") == (colons, 0.5)
    weighted = tmp_path / "a:2"  # even where its name ends like a weight
    weighted.write_bytes(b"")
    assert parse_lora_arg(str(weighted)) == (weighted, 1.0)


# --------------------------------------------------------------------------------------------------------------------
# FLUX.1: the original layout fuses q, k, v (and the single blocks' MLP input) into one layer


FLUX_LORA = FIXTURES / "flux" / "lora"
FLUX_INPUTS = ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "img_ids", "txt_ids", "guidance")


@pytest.fixture(scope="module")
def flux():
    return FluxTransformer.from_pretrained(FIXTURES / "flux" / "tiny_pipeline" / "transformer", dtype=jnp.float32)


@pytest.fixture(scope="module")
def flux_reference():
    return dict(np.load(FLUX_LORA / "reference.npz"))


def flux_forward(model, ref):
    return np.asarray(nnx.jit(lambda m, *a: m(*a))(model, *(ref[k] for k in FLUX_INPUTS)))


@pytest.mark.parametrize("fuse", [False, True])
def test_flux_diffusers_layout_matches_diffusers(flux_reference, fuse):
    model = FluxTransformer.from_pretrained(FIXTURES / "flux" / "tiny_pipeline" / "transformer", dtype=jnp.float32)
    assert len(apply_loras(model, [(FLUX_LORA / "diffusers.safetensors", 1.0)], fuse=fuse)) == 37
    assert relative_l2(flux_forward(model, flux_reference), flux_reference["output_diffusers"]) <= 3e-5


def test_flux_kohya_fused_qkv_matches_diffusers(flux, flux_reference):
    file = read_lora(FLUX_LORA / "kohya.safetensors", flux)
    # img/txt qkv split into 3 modules each, per double block; the final modulation's halves swapped as diffusers does
    assert len(file.updates) == 33 and file.updates["transformer_blocks.0.attn.add_v_proj"].scale == 2.0
    norm_out = file.updates["norm_out.linear"]
    np.testing.assert_allclose(norm_out.delta(), flux_reference["kohya_norm_out_B"] @ flux_reference["kohya_norm_out_A"],
                               rtol=1e-5, atol=1e-6)
    # diffusers 0.42.1's loader drops that one update (its converter leaves off the `transformer.` prefix)
    without = dataclasses.replace(file, updates={k: v for k, v in file.updates.items() if k != "norm_out.linear"})
    apply_loras(flux, [(without, 1.0)])
    try:
        assert relative_l2(flux_forward(flux, flux_reference), flux_reference["output_kohya"]) <= 3e-5
    finally:
        remove_lora(flux)


def test_flux_single_block_linear1_splits_into_qkv_and_mlp(flux, tmp_path):
    """linear1 (q, k, v and the MLP input stacked) is beyond diffusers' converter at this width (it hard-codes
    FLUX.1's); checked against the same update written per module in diffusers' layout."""
    dim, rank = flux.config.inner_dim, 2
    rng = np.random.default_rng(0)
    A = rng.standard_normal((rank, dim)).astype(np.float32)
    B = rng.standard_normal((7 * dim, rank)).astype(np.float32)
    save_file({"lora_unet_single_blocks_1_linear1.lora_down.weight": A,
               "lora_unet_single_blocks_1_linear1.lora_up.weight": B,
               "lora_unet_single_blocks_1_linear1.alpha": np.array(1.0, np.float32)},
              str(tmp_path / "kohya.safetensors"))
    ours, bounds = {}, [0, dim, 2 * dim, 3 * dim, 7 * dim]
    for j, module in enumerate(("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")):
        ours[f"transformer.single_transformer_blocks.1.{module}.lora_A.weight"] = A
        ours[f"transformer.single_transformer_blocks.1.{module}.lora_B.weight"] = np.ascontiguousarray(B[bounds[j]:bounds[j + 1]])
    save_file(ours, str(tmp_path / "ours.safetensors"),
              metadata={"lora_adapter_metadata": json.dumps({"transformer.r": rank, "transformer.lora_alpha": 1.0})})
    a, b = read_lora(tmp_path / "kohya.safetensors", flux), read_lora(tmp_path / "ours.safetensors", flux)
    assert len(a.updates) == 4 and a.updates["single_transformer_blocks.1.proj_mlp"].scale == 0.5
    updates_equal(a, b)


def test_exported_flux_lora_gives_diffusers_the_same_output(flux_reference, tmp_path):
    """Two ranks and alphas, the output projection `proj_out` in one group and the single blocks' `proj_out` in the
    other: diffusers must give each layer its own rank and alpha from the metadata."""
    from safetensors import safe_open

    exported = _export_script().exported_flux_model()
    ours = flux_forward(exported, flux_reference)
    diffusers_out = np.load(FLUX_LORA / "export_reference.npz")["output_diffusers"]
    assert relative_l2(diffusers_out, flux_reference["output_base"]) > 0.1  # the LoRA matters
    assert relative_l2(ours, diffusers_out) <= 3e-5  # FLUX's float32 parity (tests/test_flux.py)
    # the committed file is what the exporter writes today, metadata included
    path = tmp_path / "diffusers.safetensors"
    export_lora(exported, path, "diffusers")
    committed, written = load_file(FLUX_LORA / "mxdit_diffusers.safetensors"), load_file(path)
    assert committed.keys() == written.keys()
    for key in committed:
        np.testing.assert_array_equal(committed[key], written[key], err_msg=key)
    metadata = [safe_open(str(f), "numpy").metadata() for f in (FLUX_LORA / "mxdit_diffusers.safetensors", path)]
    assert metadata[0] == metadata[1]
    # and it reads back into mxdit as the same function, each layer with its own scale
    fresh = FluxTransformer.from_pretrained(FIXTURES / "flux" / "tiny_pipeline" / "transformer", dtype=jnp.float32)
    scales = {n: u.scale for n, u in read_lora(path, fresh).updates.items()}
    assert scales["proj_out"] == 2.0 and scales["single_transformer_blocks.0.proj_out"] == 0.5
    apply_loras(fresh, [(path, 1.0)])
    assert relative_l2(flux_forward(fresh, flux_reference), ours) <= 1e-6
