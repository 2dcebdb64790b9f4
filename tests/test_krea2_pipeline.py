"""Krea 2 end to end: Qwen3-VL text path, prompt template, pipeline; parity with diffusers' Krea2Pipeline on the tiny
random fixture pipeline (float32, and bfloat16 as users run it)."""

import dataclasses
import logging
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import FIXTURES, relative_l2
from mxdit.model.loading import CheckpointError, iter_params, save_safetensors
from mxdit.model.pipeline_common import pack_latents, unpack_latents
from mxdit.model.pipeline_krea2 import PROMPT_PREFIX, PROMPT_SUFFIX, PREFIX_TOKENS, SUFFIX_TOKENS, Krea2Pipeline
from mxdit.model.qwen3vl_text import Qwen3VLTextConfig, Qwen3VLTextEncoder
from mxdit.model.tokenizer import TextTokenizer

PIPELINE = FIXTURES / "krea2" / "tiny_pipeline"
PROMPTS = ["a red fox in the snow, photo", "an old house near the river at night"]
MAX_LEN, HEIGHT, WIDTH = 24, 64, 48


@pytest.fixture(scope="module")
def reference():
    return dict(np.load(FIXTURES / "krea2" / "pipeline_reference.npz"))


@pytest.fixture(scope="module")
def pipe():
    return Krea2Pipeline.from_pretrained(PIPELINE, dtype=jnp.float32)


def test_prompt_embeddings_and_mask_match_diffusers(pipe, reference):
    embeds, mask = pipe.encode_prompt(PROMPTS, MAX_LEN)
    assert embeds.shape == reference["prompt_embeds"].shape == (2, MAX_LEN, 3, 32)
    np.testing.assert_array_equal(np.asarray(mask), reference["prompt_mask"])
    assert relative_l2(embeds, reference["prompt_embeds"]) <= 3e-6
    neg, neg_mask = pipe.encode_prompt(["blurry"], MAX_LEN)
    np.testing.assert_array_equal(np.asarray(neg_mask), reference["negative_mask"])
    assert relative_l2(neg, reference["negative_embeds"]) <= 3e-6


def test_template_pads_in_the_middle_and_positions_count_real_tokens(pipe):
    # The demo tokenizer splits the template like Qwen's: 34 prefix tokens, 5 suffix tokens.
    ids, _ = pipe.tokenizer([PROMPT_PREFIX])
    assert ids.shape[1] == PREFIX_TOKENS
    ids, _ = pipe.tokenizer([PROMPT_SUFFIX])
    assert ids.shape[1] == SUFFIX_TOKENS
    _, mask = pipe.encode_prompt(["a cat"], MAX_LEN)
    mask = np.asarray(mask)[0]
    # [prompt (2 tokens) | padding | suffix (5 tokens)], after the system prefix is dropped
    assert mask[:2].all() and not mask[2 : MAX_LEN - SUFFIX_TOKENS].any() and mask[-SUFFIX_TOKENS:].all()


def test_base_with_guidance_matches_diffusers_after_all_steps(pipe, reference):
    out = pipe(PROMPTS, "blurry", height=HEIGHT, width=WIDTH, num_inference_steps=4, guidance_scale=4.5,
               latents=reference["base_latents_in"], max_sequence_length=MAX_LEN, output_type="np")
    assert relative_l2(out.latents, reference["base_latents_out"]) <= 4e-6
    assert out.images.shape == (2, HEIGHT, WIDTH, 3)
    assert relative_l2(out.images, reference["base_images"]) <= 1e-5
    assert set(out.timings) == {"text encode", "denoise", "decode", "total"}


def test_bfloat16_base_matches_diffusers_in_bfloat16(reference):
    """The default precision against diffusers' bfloat16 run (which rounds each step's time t / 1000 to bfloat16)."""
    pipe_bf16 = Krea2Pipeline.from_pretrained(PIPELINE, dtype=jnp.bfloat16)
    embeds, _ = pipe_bf16.encode_prompt(PROMPTS, MAX_LEN)
    assert embeds.dtype == jnp.bfloat16
    assert relative_l2(embeds, reference["prompt_embeds_bf16"]) <= 3e-2
    # diffusers casts the given latents to the pipeline's dtype first: ours start from the same bfloat16 values
    latents = reference["base_latents_in"].astype(jnp.bfloat16).astype(np.float32)
    out = pipe_bf16(PROMPTS, "blurry", height=HEIGHT, width=WIDTH, num_inference_steps=4, guidance_scale=4.5,
                    latents=latents, max_sequence_length=MAX_LEN, output_type="np")
    assert relative_l2(out.latents, reference["base_latents_out_bf16"]) <= 5e-2
    # measured: 6.3e-2, bfloat16 noise: diffusers' own bfloat16 images are 6.6e-2 from its float32 ones
    assert relative_l2(out.images, reference["base_images_bf16"]) <= 0.13


def test_turbo_matches_diffusers_with_several_images_per_prompt(pipe, reference):
    turbo = Krea2Pipeline(pipe.transformer, pipe.vae, pipe.text_encoder, pipe.tokenizer,
                          dataclasses.replace(pipe.config, is_distilled=True))
    out = turbo(PROMPTS[0], height=HEIGHT, width=WIDTH, num_inference_steps=3, num_images_per_prompt=2,
                latents=reference["turbo_latents_in"], max_sequence_length=MAX_LEN, output_type="latent")
    assert out.images is None
    assert relative_l2(out.latents, reference["turbo_latents_out"]) <= 1e-6


def test_trimmed_text_padding_gives_the_same_latents(pipe):
    """The pipeline drops padded text tokens before denoising (`trim_text`, on by default): with CFG (two prompts of
    different lengths) the latents equal those of the run over all max_sequence_length tokens, as diffusers runs."""
    from mxdit.model.pipeline_krea2 import denoise_step

    seen = []

    def recording_step(latents, embeds, *args):
        seen.append(embeds.shape[1])
        return denoise_step(pipe.transformer, latents, embeds, *args)

    kwargs = dict(height=HEIGHT, width=WIDTH, num_inference_steps=2, guidance_scale=4.5, seed=1,
                  max_sequence_length=100, output_type="latent")
    pipe.denoise_step_fn = recording_step
    try:
        trimmed = pipe(PROMPTS, negative_prompt=["blurry", "dark"], **kwargs).latents
        full = pipe(PROMPTS, negative_prompt=["blurry", "dark"], trim_text=False, **kwargs).latents
    finally:
        pipe.denoise_step_fn = None
    assert seen == [64, 64, 100, 100]
    np.testing.assert_allclose(trimmed, full, rtol=0, atol=2e-5)


def test_seeded_noise_is_reproducible(pipe):
    kwargs = dict(height=HEIGHT, width=WIDTH, num_inference_steps=2, max_sequence_length=MAX_LEN, output_type="latent")
    a = pipe("a cat", seed=7, **kwargs).latents
    b = pipe("a cat", seed=7, **kwargs).latents
    c = pipe("a cat", seed=8, **kwargs).latents
    np.testing.assert_array_equal(a, b)
    assert np.abs(a - c).max() > 1e-2


def test_denoising_loop_compiles_once_and_calls_back_every_step(pipe, caplog):
    seen = []
    kwargs = dict(height=HEIGHT, width=WIDTH, max_sequence_length=MAX_LEN, output_type="latent")
    pipe("a dog", num_inference_steps=1, callback=lambda *a: None, **kwargs)  # compile the step for this shape
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        pipe("a dog", num_inference_steps=5, callback=lambda i, t, x: seen.append((i, t, x.shape)), **kwargs)
    assert [s[0] for s in seen] == [0, 1, 2, 3, 4]
    assert seen[0][1] > seen[-1][1]  # timesteps go down
    compiles = [r.getMessage() for r in caplog.records if "denoise_step" in r.getMessage()]
    assert compiles == [], compiles


def test_pack_matches_diffusers_layout_and_unpack_inverts():
    x = np.random.default_rng(0).standard_normal((2, 6, 4, 16)).astype(np.float32)  # (b, h, w, c)
    # diffusers: NCHW -> view (b, c, h/2, 2, w/2, 2) -> permute (0, 2, 4, 1, 3, 5) -> (b, h/2 * w/2, c * 4)
    nchw = x.transpose(0, 3, 1, 2)
    expected = nchw.reshape(2, 16, 3, 2, 2, 2).transpose(0, 2, 4, 1, 3, 5).reshape(2, 6, 64)
    packed = pack_latents(jnp.asarray(x))
    np.testing.assert_array_equal(packed, expected)
    np.testing.assert_array_equal(unpack_latents(packed, 3, 2), x)


def test_size_not_a_multiple_of_16_is_refused(pipe):
    with pytest.raises(ValueError, match="multiples of 16, got 72x48"):
        pipe("a cat", height=72, width=48)


def test_folder_missing_a_component_is_named(tmp_path):
    folder = tmp_path / "krea2"
    shutil.copytree(PIPELINE, folder)
    shutil.rmtree(folder / "vae")
    with pytest.raises(CheckpointError, match=r"missing component folder\(s\) vae/"):
        Krea2Pipeline.from_pretrained(folder)


# -- the text encoder on its own ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["model.language_model.", "model."])
def test_text_encoder_single_file_layouts_load_the_same_weights(tmp_path, pipe, layout):
    # ComfyUI's single file keeps the vision tower under model.visual.* and the language model under
    # model.language_model.* (or model.*); a saved Qwen3VLModel uses language_model.* and visual.*.
    tensors = load_file(str(PIPELINE / "text_encoder" / "model.safetensors"))
    renamed = {(layout + k[len("language_model."):]) if k.startswith("language_model.") else "model." + k: v
               for k, v in tensors.items()}
    file = tmp_path / "qwen3vl.safetensors"
    save_safetensors(renamed, file)
    config = Qwen3VLTextConfig.from_json(PIPELINE / "text_encoder" / "config.json")
    encoder = Qwen3VLTextEncoder.from_pretrained(file, jnp.float32, config=config)
    ids = jnp.asarray([[1, 5, 9, 12]])
    args = (ids, jnp.ones_like(ids, bool), jnp.arange(4)[None], (1, 4))
    np.testing.assert_array_equal(encoder(*args), pipe.text_encoder(*args))
    inferred = Qwen3VLTextEncoder.from_pretrained(file, jnp.float32).config  # sizes from the weights
    assert dataclasses.replace(inferred, rope_theta=config.rope_theta) == config


def test_text_encoder_rejects_layers_out_of_range(pipe):
    ids = jnp.asarray([[1, 2]])
    with pytest.raises(ValueError, match=r"hidden-state indices in \[0, 4\]"):
        pipe.text_encoder(ids, jnp.ones_like(ids, bool), jnp.arange(2)[None], (5,))


def test_tokenizer_truncates_and_pads_to_max_length():
    tokenizer = TextTokenizer.from_folder(PIPELINE / "tokenizer")
    ids, mask = tokenizer(["a red fox", "a"], max_length=2)
    assert ids.shape == (2, 2) and mask.tolist() == [[True, True], [True, False]]
    assert ids[1, 1] == tokenizer.pad_token_id


def test_loop_in_one_program_gives_the_stepwise_latents(pipe):
    """Without a callback the steps run as one program (`denoise_loop`): the latents of the loop stepped from the
    host (what a callback sees), with CFG too."""
    for guidance in (0.0, 4.5):
        kwargs = dict(height=HEIGHT, width=WIDTH, num_inference_steps=3, guidance_scale=guidance, seed=2,
                      max_sequence_length=MAX_LEN, output_type="latent")
        seen = []
        stepwise = pipe("a dog", callback=lambda i, t, x: seen.append(i), **kwargs).latents
        looped = pipe("a dog", **kwargs).latents
        assert seen == [0, 1, 2]
        np.testing.assert_allclose(looped, stepwise, rtol=0, atol=1e-5)


@pytest.mark.parametrize("vision", [True, False])
def test_text_encoder_from_a_comfyui_fp8_file_with_or_without_its_vision_tower(tmp_path, pipe, vision):
    """ComfyUI's `*_fp8_scaled` text encoders: the language model's matrices in FP8 E4M3 with a float32 scale each
    (`.scale_weight` and the `scaled_fp8` marker), the vision tower kept or stripped; loaded as the weights they
    stand for, and the output within FP8's rounding of the float32 encoder's."""
    import ml_dtypes

    tensors = load_file(str(PIPELINE / "text_encoder" / "model.safetensors"))
    stored, expected = {}, {}
    for key, value in tensors.items():
        if not key.startswith("language_model."):
            if vision:
                stored["model." + key] = value
            continue
        name = "model." + key[len("language_model."):]
        if value.ndim == 2 and "embed_tokens" not in key:
            scale = np.float32(np.abs(value).max() / 448)
            stored[name] = (value / scale).astype(ml_dtypes.float8_e4m3fn)
            stored[name[: -len(".weight")] + ".scale_weight"] = np.array(scale, np.float32)
            expected[key[len("language_model."):]] = stored[name].astype(np.float32) * scale
        else:
            stored[name] = value
    stored["scaled_fp8"] = np.zeros(0, ml_dtypes.float8_e4m3fn)
    assert any(k.startswith("model.visual.") for k in stored) == vision
    file = tmp_path / "qwen3vl_fp8_scaled.safetensors"
    save_safetensors(stored, file)
    encoder = Qwen3VLTextEncoder.from_pretrained(file, jnp.float32,
                                                 config=PIPELINE / "text_encoder" / "config.json")
    params = dict(iter_params(encoder))
    for key, value in expected.items():
        np.testing.assert_array_equal(np.asarray(params[key]), value, err_msg=key)
    ids = jnp.asarray([[1, 5, 9, 12]])
    args = (ids, jnp.ones_like(ids, bool), jnp.arange(4)[None], (1, 4))
    assert relative_l2(encoder(*args), pipe.text_encoder(*args)) < 0.08  # FP8 rounding of every matrix: 0.058
