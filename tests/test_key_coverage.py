"""Full-size checkpoints by key names and shapes: every released layout in tests/fixtures/key_coverage.json (recorded by
`scripts/make_fixtures.py --only key_coverage` from diffusers / transformers at the released configs, the original
single files checked there against diffusers' own converters) maps onto our modules through each model's `key_map` and
`loading.plan_load`, the very code `from_pretrained` runs before it reads a tensor. The modules are only traced
(`nnx.eval_shape`): no parameter memory."""

import functools
import json

import pytest
from flax import nnx

from conftest import FIXTURES
from mxdit.model.clip_text import CLIPTextConfig, CLIPTextEncoder
from mxdit.model.flux import FluxConfig, FluxTransformer
from mxdit.model.krea2 import Krea2Config, Krea2Transformer
from mxdit.model.loading import DerivedCheckpoint, ShapeCheckpoint, dequantize_comfy, plan_load
from mxdit.model.qwen3vl_text import Qwen3VLTextConfig, Qwen3VLTextEncoder
from mxdit.model.t5_encoder import T5Config, T5Encoder
from mxdit.model.vae_flux import FluxVAE, FluxVAEConfig
from mxdit.model.vae_qwenimage import QwenImageVAE, QwenImageVAEConfig

COVERAGE = json.loads((FIXTURES / "key_coverage.json").read_text())

# component -> (module, its config class): the config.json of the recorded release is read by `Config.from_json`.
MODELS = {
    "krea2_transformer": (Krea2Transformer, Krea2Config),
    "flux1_dev_transformer": (FluxTransformer, FluxConfig),
    "flux1_schnell_transformer": (FluxTransformer, FluxConfig),
    "flux_vae": (FluxVAE, FluxVAEConfig),
    "qwenimage_vae": (QwenImageVAE, QwenImageVAEConfig),
    "qwen3vl_text_encoder": (Qwen3VLTextEncoder, Qwen3VLTextConfig),
    "t5_xxl_encoder": (T5Encoder, T5Config),
    "clip_l_text": (CLIPTextEncoder, CLIPTextConfig),
}

# The stored tensors each layout holds that our module does not use; every other stored tensor must be read.
UNUSED = {
    ("qwen3vl_text_encoder", "krea2_text_encoder"): lambda key: key.startswith("visual."),  # the vision tower
    ("qwen3vl_text_encoder", "qwen3vl_4b_instruct"): lambda key: key.startswith("model.visual."),
    ("qwenimage_vae", "diffusers"): lambda key: ".time_conv." in key,  # video-only temporal up/downsampling
    ("qwenimage_vae", "original"): lambda key: ".time_conv." in key,
}

CASES = [(component, layout) for component, entry in COVERAGE.items() for layout in entry["layouts"]]


def test_every_component_has_its_layouts_recorded():
    assert set(COVERAGE) == set(MODELS)
    assert {layout for component, layout in CASES if component.endswith(("transformer", "vae"))} == {
        "diffusers", "original"}


@functools.cache
def abstract_module(module_cls, config):
    return nnx.eval_shape(lambda: module_cls(config, rngs=nnx.Rngs(0)))


def released_config(component, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(COVERAGE[component]["config"]))
    return MODELS[component][1].from_json(path)


@pytest.mark.parametrize("with_config", [True, False], ids=["with_config_json", "single_file"])
@pytest.mark.parametrize("component, layout", CASES, ids=[f"{c}-{layout}" for c, layout in CASES])
def test_released_layout_maps_every_stored_key_onto_the_module(component, layout, with_config, tmp_path):
    """Every stored key is read into a parameter of its shape (after the layout's conversions) or named as unused,
    no parameter is left unset; loaded as a single file (no config.json), the sizes read from the weights and the
    defaults give the released config."""
    module_cls, _ = MODELS[component]
    shapes = COVERAGE[component]["layouts"][layout]
    config = released_config(component, tmp_path)
    checkpoint = ShapeCheckpoint(shapes, f"{component}/{layout}")
    if not with_config:  # as `open_checkpoint` opens a single file
        checkpoint = dequantize_comfy(checkpoint)
    found_config, keys = module_cls.key_map(checkpoint, config if with_config else None)
    assert found_config == config
    plan = plan_load(abstract_module(module_cls, found_config), keys)

    assert plan.problems == []
    unused = UNUSED.get((component, layout), lambda key: False)
    assert plan.ignored == sorted(key for key in shapes if unused(key))
    view = keys.checkpoint
    read = {view.stored_key(k) if isinstance(view, DerivedCheckpoint) else k for k in plan.sources.values()}
    assert read | set(plan.ignored) == set(shapes) and not read & set(plan.ignored)


def test_unused_tensors_are_named_and_the_vision_tower_is_among_them():
    shapes = COVERAGE["qwen3vl_text_encoder"]["layouts"]["krea2_text_encoder"]
    config, keys = Qwen3VLTextEncoder.key_map(ShapeCheckpoint(shapes))
    plan = plan_load(abstract_module(Qwen3VLTextEncoder, config), keys)
    assert "visual.patch_embed.proj.weight" in plan.ignored and "visual.merger.linear_fc2.weight" in plan.ignored
    assert not any(key.startswith("lm_head.") for key in shapes)  # Krea 2 ships Qwen3VLModel: no LM head
    assert len(plan.sources) + len(plan.ignored) == len(shapes)


def test_a_wrong_shape_and_a_stray_key_are_problems_of_the_plan():
    """The checks are real: the released Krea 2 layout with one tensor of another shape and one key too many."""
    shapes = dict(COVERAGE["krea2_transformer"]["layouts"]["diffusers"])
    shapes["img_in.weight"] = [6144, 16]
    shapes["final_layer.extra.weight"] = [4]
    _, keys = Krea2Transformer.key_map(ShapeCheckpoint(shapes), Krea2Config())
    plan = plan_load(abstract_module(Krea2Transformer, Krea2Config()), keys)
    assert plan.unexpected == ["final_layer.extra.weight"]
    assert plan.mismatched == ["img_in.weight: checkpoint has shape (6144, 16), model expects (6144, 64)"]
    assert plan.missing == []
