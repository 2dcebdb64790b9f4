"""MiniMax H3's text-to-video layout, schedules and denoising loop against diffusers' modular pipeline's own parts
(scripts/fixtures/minimax_h3.py, `write_minimax_h3_denoising`) on the tiny transformer."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import FIXTURES, relative_l2
from mxdit.model import pipeline_minimax_h3 as h3
from mxdit.model.minimax_h3 import MiniMaxH3Transformer

PATCH = (1, 2, 2)
_spec = importlib.util.spec_from_file_location("generate_video",
                                               Path(__file__).parent.parent / "scripts" / "generate_video.py")
generate_video = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(generate_video)


@pytest.fixture(scope="module")
def reference():
    return dict(np.load(FIXTURES / "minimax_h3" / "denoising_reference.npz"))


@pytest.fixture(scope="module")
def layout(reference):
    return h3.packed_layout(reference["prompt_embeds"].shape[1], int(reference["num_latent_frames"]),
                            int(reference["latent_height"]), int(reference["latent_width"]),
                            int(reference["num_audio_latents"]), PATCH)


def test_frame_counts_snap_to_what_the_video_vae_decodes(reference):
    aligned = h3.align_num_frames(int(reference["num_frames"]))
    assert aligned == reference["aligned_frames"] == 39
    assert h3.video_latent_frames(aligned) == reference["num_latent_frames"]
    assert h3.audio_latent_frames(aligned) == reference["num_audio_latents"]
    assert h3.align_num_frames(124) == 124 and h3.video_latent_frames(124) == 37  # the 5-second default
    with pytest.raises(ValueError, match="17 \\* n \\+ 5"):
        h3.video_latent_frames(40)


def test_canvas_sizes_match_diffusers(reference):
    ratios = ((16, 9), (9, 16), (1, 1), (4, 3), (21, 9))
    assert [list(h3.resolve_canvas_size(w, h)) for w, h in ratios] == reference["canvases"].tolist()
    with pytest.raises(ValueError, match="1:4 to 4:1"):
        h3.resolve_canvas_size(5, 1)


def test_packed_layout_equals_diffusers_to_the_bit(layout, reference):
    for name in ("position_ids", "token_tags", "video_indices", "audio_indices", "text_indices"):
        np.testing.assert_array_equal(getattr(layout, name), reference[name], err_msg=name)


def test_both_schedules_equal_diffusers_to_the_bit(reference):
    steps = int(reference["steps"])
    np.testing.assert_array_equal(h3.flow_schedule(steps, h3.VIDEO_SHIFT), reference["sigmas"])
    np.testing.assert_array_equal(h3.flow_schedule(steps, h3.AUDIO_SHIFT), reference["audio_sigmas"])
    for steps in (2, 3, 30, 51):  # torch.linspace's float32 grid, not numpy's
        sigmas = h3.flow_schedule(steps, h3.VIDEO_SHIFT)
        assert sigmas[0] == 1.0 and sigmas[-1] == 0.0 and (np.diff(sigmas) < 0).all()


def test_patchify_round_trips_and_orders_rows_frame_major():
    latents = jnp.arange(2 * 3 * 2 * 4 * 6, dtype=jnp.float32).reshape(2, 3, 2, 4, 6)
    rows = h3.patchify(latents, PATCH)
    assert rows.shape == (2, 2 * 2 * 3, 12)
    np.testing.assert_array_equal(rows[0, 0, :4], np.asarray(latents[0, 0, 0, :2, :2]).reshape(-1))
    np.testing.assert_array_equal(h3.unpatchify(rows, 2, 4, 6, PATCH), latents)


def test_denoised_video_and_audio_latents_match_diffusers(layout, reference):
    model = MiniMaxH3Transformer.from_pretrained(FIXTURES / "minimax_h3" / "tiny", dtype=jnp.float32)
    video = h3.patchify(jnp.asarray(reference["initial_latents"]), PATCH)
    audio = jnp.asarray(reference["initial_audio_rows"])[None]
    seen = []
    video, audio = h3.denoise(model, layout, jnp.asarray(reference["prompt_embeds"]), video, audio,
                              int(reference["steps"]), callback=lambda i, v, a: seen.append(i))
    assert seen == list(range(int(reference["steps"]) - 1))  # the final sigma 0 is not a model evaluation
    latents = h3.unpatchify(video, layout.num_latent_frames, layout.latent_height, layout.latent_width, PATCH)
    audio_latents = h3.audio_rows_to_latents(audio, layout.num_audio_latents).transpose(0, 2, 1)  # diffusers' axes
    assert latents.shape == reference["latents"].shape and audio_latents.shape == reference["audio_latents"].shape
    assert relative_l2(latents, reference["latents"]) <= 5e-7  # measured 8.3e-8
    assert relative_l2(audio_latents, reference["audio_latents"]) <= 5e-7  # measured 7.2e-8


# -- the whole path: demo model, the pipeline, the MP4 -----------------------------------------------------------------


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return h3.demo_pipeline(tmp_path_factory.mktemp("tokenizer"))


def test_mp4_holds_every_frame_and_both_sound_channels(tmp_path):
    av = pytest.importorskip("av")
    from mxdit.model.video_file import write_mp4

    frames = np.random.default_rng(0).integers(0, 256, (30, 32, 48, 3), dtype=np.uint8)
    t = np.arange(32000 * 30 // 24) / 32000
    write_mp4(tmp_path / "x.mp4", frames, 24, 0.5 * np.stack([np.sin(2200 * t), np.sin(3300 * t)]), 32000)
    with av.open(str(tmp_path / "x.mp4")) as container:
        assert (container.streams.audio[0].rate, container.streams.audio[0].channels) == (32000, 2)
        decoded = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(decoded) == 30 and decoded[0].shape == (32, 48, 3)
    with pytest.raises(ValueError, match="even height and width"):
        write_mp4(tmp_path / "y.mp4", frames[:, :31], 24)
    assert not (tmp_path / "y.mp4").exists()


@pytest.mark.slow  # about 25 s: the demo pipeline built and run by the script
def test_generate_video_writes_an_mp4_with_stereo_sound(tmp_path):
    av = pytest.importorskip("av")
    output = tmp_path / "fox.mp4"
    assert generate_video.main(["--demo", "--prompt", "a red fox", "--height", "64", "--width", "96",
                                "--output", str(output)]) == 0
    with av.open(str(output)) as container:
        video, audio = container.streams.video[0], container.streams.audio[0]
        assert (video.codec_context.name, video.width, video.height, video.average_rate) == ("h264", 96, 64, 24)
        assert (audio.codec_context.name, audio.rate, audio.channels) == ("aac", 32000, 2)
        assert sum(1 for _ in container.decode(video=0)) == 124  # 5.17 s: 17 * 7 + 5 frames
    with pytest.raises(SystemExit):  # the file exists now
        generate_video.parse_args(["--demo", "--prompt", "a red fox", "--output", str(output)])


@pytest.mark.parametrize("flags, message", [
    (["--num-frames", "60"], "--num-frames 60: .* 5 to 15 s"),
    (["--height", "100", "--width", "96"], "--height 100: must be a positive multiple of 32"),
    (["--height", "64"], "give both or neither"),
    (["--output", "x.mov"], "must end in .mp4"),
    (["--steps", "1"], "--steps 1"),
    (["--offload", "-1"], "--offload -1: the number of resident blocks must be >= 0"),
    (["--offload", "4", "--prefetch", "0"], "--prefetch 0: must be >= 1"),
    (["--mesh", "seq"], "--mesh: .*entry 'seq' is not axis=size"),
    (["--mesh", "seq=2", "--offload", "3"], "--mesh with --offload: not supported together"),
    (["--sharded-weights"], "--sharded-weights: only with --mesh"),
    (["--mesh", "seq=2", "--precision", "fp8"], "--precision fp8 with --mesh: sharded runs take bf16 weights"),
])
def test_generate_video_refuses_bad_flags_in_one_line(flags, message, capsys):
    with pytest.raises(SystemExit):
        generate_video.parse_args(["--demo", "--prompt", "a fox", *flags])
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err), err


def test_the_same_seed_gives_the_same_video_and_the_callback_sees_each_step(demo):
    steps = []
    first = demo("a red fox", height=32, width=64, num_steps=3, seed=5, callback=lambda i, n: steps.append((i, n)))
    second = demo("a red fox", height=32, width=64, num_steps=3, seed=5)
    other = demo("a red fox", height=32, width=64, num_steps=3, seed=6)
    assert steps == [(0, 2), (1, 2)]
    assert first.frames.shape == (124, 32, 64, 3) and first.audio.shape == (2, 207 * 800)
    np.testing.assert_array_equal(first.frames, second.frames)
    np.testing.assert_array_equal(first.audio, second.audio)
    assert not np.array_equal(first.latents, other.latents)


def test_components_that_do_not_fit_are_named(demo):
    from mxdit.model.vae_minimax_h3 import MiniMaxH3VideoVAE

    tiny_vae = MiniMaxH3VideoVAE.from_pretrained(FIXTURES / "minimax_h3" / "vae" / "tiny")
    with pytest.raises(ValueError, match="video VAE spatial compression 4"):
        h3.MiniMaxH3Pipeline(demo.transformer, tiny_vae, demo.audio_vae, demo.text_encoder, demo.tokenizer,
                             demo.text_encoder_layer)
    with pytest.raises(ValueError, match="more than 3 layers"):
        h3.MiniMaxH3Pipeline(demo.transformer, demo.vae, demo.audio_vae, demo.text_encoder, demo.tokenizer, 3)
    with pytest.raises(ValueError, match="num_frames 60"):
        demo("a fox", num_frames=60, height=32, width=64)
    with pytest.raises(ValueError, match="prompt"):
        demo("  ", height=32, width=64)


# -- quantized weights: the admission gates per denoiser evaluation and along the trajectory ---------------------------


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "int8_rot"])
def test_quantized_transformers_pass_their_gates_at_every_step_and_at_the_end(fmt, layout, reference):
    from mxdit.model.loading import place_parameters
    from mxdit.quant.model import minimax_h3_rules, quantize_on_load

    tiny = FIXTURES / "minimax_h3" / "tiny"
    base = MiniMaxH3Transformer.from_pretrained(tiny, jnp.bfloat16)
    with place_parameters(quantize_on_load(minimax_h3_rules(fmt))):  # as from_pretrained(precision=...) reads it
        candidate = MiniMaxH3Transformer.from_pretrained(tiny, jnp.bfloat16)
    assert type(candidate.transformer_blocks[0].attn.to_q.weight.get_value()).__name__ == "GemmWeight"
    video = h3.patchify(jnp.asarray(reference["initial_latents"]), PATCH)
    check = h3.trajectory_check(base, candidate, fmt, layout, jnp.asarray(reference["prompt_embeds"]), video,
                                jnp.asarray(reference["initial_audio_rows"])[None], int(reference["steps"]))
    assert len(check.steps) == int(reference["steps"]) - 1 and check.passed
    # on this tiny model: fp8 cosine >= 0.999998 and relative L2 <= 0.0018 a step; int8_rot 1.0 and 0.0009
    assert min(r.cosine for pair in check.steps for r in pair) > 0.99999


def test_a_candidate_with_a_wrong_video_head_fails_the_video_gates_only(layout, reference):
    tiny = FIXTURES / "minimax_h3" / "tiny"
    base = MiniMaxH3Transformer.from_pretrained(tiny, jnp.bfloat16)
    broken = MiniMaxH3Transformer.from_pretrained(tiny, jnp.bfloat16)
    broken.proj_out.weight.set_value(-broken.proj_out.weight.get_value())
    video = h3.patchify(jnp.asarray(reference["initial_latents"]), PATCH)
    check = h3.trajectory_check(base, broken, "fp8_e4m3", layout, jnp.asarray(reference["prompt_embeds"]), video,
                                jnp.asarray(reference["initial_audio_rows"])[None], int(reference["steps"]))
    assert not check.passed
    assert all(not v.passed and "cosine" in v.failures[0] for v, _ in check.steps) and not check.final[0].passed
    assert all(a.passed for _, a in check.steps)


def test_generate_video_offers_every_precision_the_pipeline_takes():
    action = next(a for a in generate_video.build_parser()._actions if a.dest == "precision")
    assert set(action.choices) == set(h3.PRECISIONS)
    with pytest.raises(ValueError, match="precision 'fp4'"):
        h3.demo_pipeline("unused", precision="fp4")


def test_the_conditioning_is_diffusers_hidden_state_at_the_tapped_layer():
    from mxdit.model.qwen3vl_text import Qwen3VLTextEncoder

    ref = dict(np.load(FIXTURES / "minimax_h3" / "conditioner_reference.npz"))
    # a Qwen3VLForConditionalGeneration folder: vision tower and LM head skipped
    encoder = Qwen3VLTextEncoder.from_pretrained(FIXTURES / "minimax_h3" / "text_encoder", jnp.float32)
    states = h3.conditioning(encoder, ref["token_ids"][None], int(ref["layer"]))
    assert states.shape == ref["prompt_embeds"].shape
    assert relative_l2(states, ref["prompt_embeds"]) <= 1e-6  # measured 5.1e-7
