"""FLUX.1: transformer, T5 and CLIP text encoders and pipeline (dev and schnell); parity with diffusers/transformers on
tiny random fixtures (float32, and bfloat16 as users run them)."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import FIXTURES, relative_l2
from mxdit.model.clip_text import CLIPTextEncoder
from mxdit.model.flow_match import flow_match_schedule
from mxdit.model.flux import FluxTransformer
from mxdit.model.loading import CheckpointError, iter_params, save_safetensors
from mxdit.model.pipeline_flux import FluxPipeline
from mxdit.model.pipelines import load_pipeline
from mxdit.model.t5_encoder import T5Encoder, relative_position_buckets
from mxdit.model.tokenizer import TextTokenizer

FLUX = FIXTURES / "flux"
PIPELINE = FLUX / "tiny_pipeline"
SCHNELL = FLUX / "tiny_schnell"  # only what differs from PIPELINE (scripts/fixtures/flux.py, FLUX_SCHNELL_PARTS)
PROMPTS = ["a red fox in the snow, photo", "an old house near the river at night"]
# The transformer's float32 parity with diffusers (measured 7.8e-6, see below), and the pipelines' through it
FLUX_FLOAT32 = 3e-5


@pytest.fixture(scope="module")
def reference():
    return dict(np.load(FLUX / "reference.npz"))


@pytest.fixture(scope="module")
def pipeline_reference():
    return dict(np.load(FLUX / "pipeline_reference.npz"))


@pytest.fixture(scope="module")
def tiny():
    return FluxTransformer.from_pretrained(FLUX / "tiny", jnp.float32)


def run(model, r):
    return model(r["hidden_states"], r["encoder_hidden_states"], r["pooled_projections"], r["timestep"],
                 r["img_ids"], r["txt_ids"], r["guidance"])


def test_transformer_matches_diffusers(tiny, reference):
    out = run(tiny, reference)
    assert out.shape == (2, 15, 16)  # batch 2, non-square 3x5 grid
    # measured: 7.8e-6, ~20x Krea 2's: the float32 sinusoids of 1000 * t and 1000 * guidance differ from torch's by
    # an ulp of their frequencies times an argument of up to 3500
    assert relative_l2(out, reference["output"]) <= FLUX_FLOAT32


def test_bfloat16_transformer_matches_diffusers_in_bfloat16(reference):
    """In bfloat16 the model rounds 1000 * t and the guidance scale to bfloat16 as diffusers does (inside jit too);
    with this tiny model's random time embedding that alone moves the output by ~50%."""
    model = FluxTransformer.from_pretrained(FLUX / "tiny", jnp.bfloat16)
    out = jax.jit(lambda r: run(model, r))(reference)
    assert out.dtype == jnp.bfloat16
    assert relative_l2(out, reference["output_bf16"]) <= 3e-2


def test_original_single_file_layout_matches_diffusers(tiny, reference):
    # flux1-dev.safetensors layout: fused qkv / linear1 tensors, shift-first final modulation, ComfyUI prefix
    model = FluxTransformer.from_pretrained(FLUX / "tiny_original.safetensors", jnp.float32,
                                            config=FLUX / "tiny" / "config.json")
    a, b = dict(iter_params(tiny)), dict(iter_params(model))
    for key in a:
        np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=key)
    assert relative_l2(run(model, reference), reference["output"]) <= FLUX_FLOAT32


def test_original_layout_with_an_unknown_tensor_reports_it(tmp_path):
    from safetensors.numpy import load_file

    tensors = load_file(str(FLUX / "tiny_original.safetensors"))
    tensors["model.diffusion_model.double_blocks.0.extra.weight"] = np.zeros(2, np.float32)
    file = tmp_path / "flux.safetensors"
    save_safetensors(tensors, file)
    with pytest.raises(CheckpointError, match=r"unexpected keys \(1\): model\.diffusion_model\.double_blocks\.0\.extra"):
        FluxTransformer.from_pretrained(file, config=FLUX / "tiny" / "config.json")


def test_single_file_without_config_needs_the_released_head_dim():
    with pytest.raises(CheckpointError, match="pass config="):
        FluxTransformer.from_pretrained(FLUX / "tiny_original.safetensors")


def test_dev_transformer_requires_guidance(tiny, reference):
    with pytest.raises(ValueError, match="pass guidance="):
        tiny(reference["hidden_states"], reference["encoder_hidden_states"], reference["pooled_projections"],
             reference["timestep"], reference["img_ids"], reference["txt_ids"])


def test_t5_encoder_and_tokenizer_match_transformers(pipeline_reference):
    tokenizer = TextTokenizer.from_folder(PIPELINE / "tokenizer_2")
    ids, _ = tokenizer(PROMPTS, max_length=16)
    np.testing.assert_array_equal(ids, pipeline_reference["t5_ids"])  # end token kept, padded with <pad>
    encoder = T5Encoder.from_pretrained(PIPELINE / "text_encoder_2", jnp.float32)
    assert relative_l2(encoder(jnp.asarray(ids)), pipeline_reference["prompt_embeds"]) <= 3e-6


def test_t5_position_buckets_follow_the_log_rule():
    buckets = relative_position_buckets(1, 200, num_buckets=32, max_distance=128)[0]
    assert buckets[0] == 0 and list(buckets[1:8]) == [17, 18, 19, 20, 21, 22, 23]  # keys after the query: upper half
    assert buckets[199] == 31  # beyond max_distance: the last bucket
    assert relative_position_buckets(5, 1, 32, 128)[4, 0] == 4  # keys before the query: lower half, exact up to 7


def test_clip_encoder_and_pooled_output_match_transformers(pipeline_reference):
    tokenizer = TextTokenizer.from_folder(PIPELINE / "tokenizer")
    assert tokenizer.model_max_length == 16
    ids, _ = tokenizer(PROMPTS, max_length=tokenizer.model_max_length)
    np.testing.assert_array_equal(ids, pipeline_reference["clip_ids"])  # start/end tokens kept through truncation
    encoder = CLIPTextEncoder.from_pretrained(PIPELINE / "text_encoder", jnp.float32)
    hidden, pooled = encoder(jnp.asarray(ids))
    assert relative_l2(hidden, pipeline_reference["clip_last_hidden"]) <= 2e-6
    assert relative_l2(pooled, pipeline_reference["pooled_prompt_embeds"]) <= 2e-6


@pytest.fixture(scope="module")
def pipe():
    return FluxPipeline.from_pretrained(PIPELINE, jnp.float32)


def test_pipeline_prompt_embeddings_match_diffusers(pipe, pipeline_reference):
    embeds, pooled = pipe.encode_prompt(PROMPTS, max_sequence_length=16)
    assert relative_l2(embeds, pipeline_reference["prompt_embeds"]) <= 3e-6
    assert relative_l2(pooled, pipeline_reference["pooled_prompt_embeds"]) <= 2e-6


def test_dev_pipeline_matches_diffusers_after_all_steps(pipe, pipeline_reference):
    out = pipe(PROMPTS, height=64, width=48, num_inference_steps=4, guidance_scale=3.5, output_type="np",
               latents=pipeline_reference["latents_in"], max_sequence_length=16)
    assert relative_l2(out.latents, pipeline_reference["dev_latents_out"]) <= FLUX_FLOAT32
    assert out.images.shape == (2, 64, 48, 3)
    assert relative_l2(out.images, pipeline_reference["dev_images"]) <= FLUX_FLOAT32


def test_true_cfg_with_a_negative_prompt_matches_diffusers(pipe, pipeline_reference):
    out = pipe(PROMPTS, "blurry", true_cfg_scale=2.0, height=64, width=48, num_inference_steps=3, guidance_scale=3.5,
               latents=pipeline_reference["latents_in"], max_sequence_length=16, output_type="latent")
    assert relative_l2(out.latents, pipeline_reference["true_cfg_latents_out"]) <= FLUX_FLOAT32


@pytest.mark.parametrize("negative", [None, "blurry"])
def test_steps_as_one_program_equal_the_steps_one_by_one(pipe, pipeline_reference, negative):
    """Without a callback all steps run as one program; with one, a step at a time: the same latents."""
    seen = []
    kwargs = dict(true_cfg_scale=2.0, height=64, width=48, num_inference_steps=3, guidance_scale=3.5,
                  latents=pipeline_reference["latents_in"], max_sequence_length=16, output_type="latent")
    loop = pipe(PROMPTS, negative, **kwargs).latents
    stepped = pipe(PROMPTS, negative, callback=lambda i, t, latents: seen.append(i), **kwargs).latents
    assert seen == [0, 1, 2]
    np.testing.assert_allclose(loop, stepped, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def pipe_bf16():
    return FluxPipeline.from_pretrained(PIPELINE, jnp.bfloat16)


def test_bfloat16_text_encoders_match_transformers_in_bfloat16(pipe_bf16, pipeline_reference):
    embeds, pooled = pipe_bf16.encode_prompt(PROMPTS, max_sequence_length=16)
    assert embeds.dtype == pooled.dtype == jnp.bfloat16
    assert relative_l2(embeds, pipeline_reference["prompt_embeds_bf16"]) <= 3e-2
    assert relative_l2(pooled, pipeline_reference["pooled_prompt_embeds_bf16"]) <= 2e-2


def test_bfloat16_dev_pipeline_matches_diffusers_in_bfloat16(pipe_bf16, pipeline_reference):
    # diffusers casts the given latents to the pipeline's dtype first: ours start from the same bfloat16 values
    latents = pipeline_reference["latents_in"].astype(jnp.bfloat16).astype(np.float32)
    out = pipe_bf16(PROMPTS, height=64, width=48, num_inference_steps=4, guidance_scale=3.5, output_type="np",
                    latents=latents, max_sequence_length=16)
    assert relative_l2(out.latents, pipeline_reference["dev_latents_out_bf16"]) <= 3e-2
    assert relative_l2(out.images, pipeline_reference["dev_images_bf16"]) <= 3e-2


@pytest.fixture(scope="module")
def schnell_folder(tmp_path_factory):
    """A FLUX.1-schnell folder: the tiny dev pipeline's text encoders, tokenizers and VAE with schnell's parts."""
    folder = tmp_path_factory.mktemp("flux") / "schnell"
    shutil.copytree(PIPELINE, folder)
    for part in SCHNELL.iterdir():
        if part.is_dir():
            shutil.rmtree(folder / part.name)
            shutil.copytree(part, folder / part.name)
        else:
            shutil.copy(part, folder / part.name)
    return folder


def test_schnell_pipeline_matches_diffusers_with_its_defaults(schnell_folder):
    """No guidance embedding, schnell's scheduler (no dynamic shift), and its defaults, which diffusers' run was given:
    4 steps and T5 length 256 (the text attends its padding, so another length gives other latents)."""
    reference = np.load(FLUX / "schnell_reference.npz")
    pipe = FluxPipeline.from_pretrained(schnell_folder, jnp.float32)
    assert not pipe.is_dev and pipe.shift is None and pipe.static_shift == 1.0
    out = pipe(PROMPTS, height=64, width=48, latents=reference["latents_in"], output_type="np")
    assert relative_l2(out.latents, reference["latents_out"]) <= 5e-6
    assert relative_l2(out.images, reference["images"]) <= 5e-6


def test_schnell_schedule_has_no_dynamic_shift():
    sigmas, timesteps = flow_match_schedule(4, static_shift=1.0)
    np.testing.assert_allclose(sigmas, [1.0, 0.75, 0.5, 0.25, 0.0], atol=1e-7)
    np.testing.assert_allclose(timesteps, [1000, 750, 500, 250], atol=1e-4)


def test_load_pipeline_picks_the_family_from_model_index(tmp_path):
    assert isinstance(load_pipeline(PIPELINE, jnp.float32), FluxPipeline)
    folder = tmp_path / "other"
    shutil.copytree(PIPELINE, folder)
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    with pytest.raises(CheckpointError, match="pipeline 'StableDiffusionPipeline' is not supported"):
        load_pipeline(folder)
    (folder / "model_index.json").unlink()
    with pytest.raises(CheckpointError, match="model_index.json: file not found"):
        load_pipeline(folder)


@pytest.mark.parametrize("precision", [None, "fp8_e4m3"])
def test_stacked_projections_give_the_same_output(tiny, reference, precision):
    """Q/K/V of each stream (double blocks) and Q/K/V with the MLP projection (single blocks) as one product each,
    biases stacked alongside: the unstacked output, for float weights and for the GEMM kernels' FP8 weights."""
    from flax import nnx

    from mxdit.model.flux import stack_projections
    from mxdit.quant.model import flux_rules, quantize_linear_layers

    separate = nnx.clone(tiny)
    if precision:
        quantize_linear_layers(separate, flux_rules(precision), kernels=True)
    stacked = nnx.clone(separate)
    cfg = tiny.config
    assert stack_projections(stacked) == cfg.num_layers + cfg.num_single_layers  # modules stacked
    double = stacked.transformer_blocks[0].attn
    assert double.to_qkv is not None and double.add_qkv is not None and double.to_q is None and double.add_q_proj is None
    assert stacked.single_transformer_blocks[0].qkv_mlp is not None and stacked.single_transformer_blocks[0].proj_mlp is None
    out, expected = np.asarray(run(stacked, reference)), np.asarray(run(separate, reference))
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-5 * np.abs(expected).max())
    if precision is None:
        assert relative_l2(out, reference["output"]) <= FLUX_FLOAT32
    else:  # stacking first, then quantizing: the same weights (the rules name the unstacked projections)
        after = nnx.clone(tiny)
        stack_projections(after)
        quantize_linear_layers(after, flux_rules(precision), kernels=True)
        for a, b in zip(jax.tree.leaves(nnx.state(stacked)), jax.tree.leaves(nnx.state(after)), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("stack", [False, True])
def test_fp8_kernel_weights_compute_the_simulated_quantization(tiny, reference, stack):
    """FP8 weights through the GEMM path (GELU and the gated residuals in the epilogues, projections stacked or not)
    equal the simulation of the same quantization in float32 (weights quantized and dequantized, inputs quantized per
    token): only the summation order differs. And it stays close to the unquantized output."""
    from flax import nnx

    from mxdit.model.flux import stack_projections
    from mxdit.quant.model import (fake_quantize_model, flux_rules, quantize_activations, quantize_linear_layers,
                                   with_params)

    rules = flux_rules("fp8_e4m3")
    kernels = nnx.clone(tiny)
    assert quantize_linear_layers(kernels, rules, kernels=True)
    if stack:
        stack_projections(kernels)
    weights = fake_quantize_model(dict(iter_params(tiny)), rules, jnp.float32)
    simulated = quantize_activations(with_params(tiny, weights), rules)
    out, sim = (np.asarray(jax.jit(lambda r, m=m: run(m, r))(reference)) for m in (kernels, simulated))
    assert relative_l2(out, sim) <= 1e-5
    assert relative_l2(out, reference["output"]) <= 0.05
