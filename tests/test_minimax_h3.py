"""The MiniMax H3 transformer against diffusers' `MiniMaxH3Transformer3DModel` on the tiny fixture
(scripts/fixtures/minimax_h3.py): a packed sequence of text, conditioning and target video, and audio rows scattered
in random order, at three noise levels."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import FIXTURES, relative_l2
from mxdit.model.loading import CheckpointError, iter_params
from mxdit.model.minimax_h3 import (MiniMaxH3Config, MiniMaxH3Transformer, apply_rotary_half,
                                    rotary_tables)

TINY = FIXTURES / "minimax_h3" / "tiny"
ARGUMENTS = ("hidden_states", "audio_hidden_states", "encoder_hidden_states", "timestep", "timestep_indices",
             "token_tags", "position_ids", "video_indices", "audio_indices", "text_indices")


@pytest.fixture(scope="module")
def reference():
    return dict(np.load(FIXTURES / "minimax_h3" / "reference.npz"))


@pytest.fixture(scope="module")
def tiny():
    return MiniMaxH3Transformer.from_pretrained(TINY, dtype=jnp.float32)


def run(model, ref, jit=False, **changed):
    args = [jnp.asarray(changed.get(name, ref[name])) for name in ARGUMENTS]
    if jit:
        return nnx.jit(lambda m, *a: m(*a))(model, *args)
    return model(*args)


def test_video_and_audio_velocities_match_diffusers(tiny, reference):
    video, audio = run(tiny, reference)
    assert video.shape == reference["sample"].shape and audio.shape == reference["audio_sample"].shape
    assert relative_l2(video, reference["sample"]) <= 1e-6  # measured 2.2e-7
    assert relative_l2(audio, reference["audio_sample"]) <= 1e-6  # measured 1.4e-7


def test_jitted_forward_matches_eager(tiny, reference):
    eager, jitted = run(tiny, reference), run(tiny, reference, jit=True)
    for a, b in zip(eager, jitted):
        assert relative_l2(a, b) <= 1e-6


def test_bfloat16_keeps_the_release_mixed_precision_and_matches_diffusers(reference):
    model = MiniMaxH3Transformer.from_pretrained(TINY, dtype=jnp.bfloat16)
    float32 = ("proj_in.", "audio_proj_in.", "time_embedder.", "proj_out.", "audio_proj_out.")
    for key, value in iter_params(model):
        assert value.dtype == (jnp.float32 if key.startswith(float32) else jnp.bfloat16), key
    video, audio = run(model, reference)
    assert video.dtype == audio.dtype == jnp.float32  # the float32 heads
    # diffusers' own bf16 is 4.3e-3 / 2.8e-3 from its float32; ours 4.1e-3 / 3.1e-3, and 3.2e-3 / 2.8e-3 from its
    assert relative_l2(video, reference["sample_bf16"]) <= 5e-3
    assert relative_l2(audio, reference["audio_sample_bf16"]) <= 5e-3
    assert relative_l2(video, reference["sample"]) <= 1.25 * relative_l2(reference["sample_bf16"], reference["sample"])


def test_rows_may_be_packed_in_any_order(tiny, reference):
    # Moving every row to another place in the sequence (indices, tags, timesteps and positions along) changes nothing:
    # attention has no notion of order beyond the rotary positions.
    seq = reference["position_ids"].shape[0]
    where = np.random.default_rng(0).permutation(seq)  # old row i now sits at where[i]
    moved = {name: reference[name].copy() for name in ("timestep_indices", "token_tags", "position_ids")}
    for name in moved:
        moved[name][where] = reference[name]
    for name in ("video_indices", "audio_indices", "text_indices"):
        moved[name] = where[reference[name]]
    for a, b in zip(run(tiny, reference), run(tiny, reference, **moved)):
        assert relative_l2(a, b) <= 1e-6


@pytest.mark.parametrize("padding", [1, 5])
def test_padding_rows_leave_the_velocities_unchanged(tiny, reference, padding):
    """Rows appended after the packed sequence (as a mesh's `seq` split needs) are attended by no row."""
    padded = {"timestep_indices": np.pad(reference["timestep_indices"], (0, padding)),
              "token_tags": np.pad(reference["token_tags"], (0, padding)),
              "position_ids": np.pad(reference["position_ids"], ((0, padding), (0, 0)))}
    args = [jnp.asarray(padded.get(name, reference[name])) for name in ARGUMENTS]
    for a, b in zip(run(tiny, reference), tiny(*args, padding=padding)):
        assert relative_l2(a, b) <= 1e-6
    with pytest.raises(ValueError, match=f"indices name .* rows and padding {padding + 1} more"):
        tiny(*args, padding=padding + 1)


def test_rotate_half_leaves_the_unrotated_channels_and_rotates_pairs_half_apart():
    cos, sin = rotary_tables(jnp.asarray([[0.0, 1.0, 2.0]]), freq_dim=2, theta=10000.0)
    assert cos.shape == (1, 12)
    x = jnp.arange(16, dtype=jnp.float32).reshape(1, 1, 1, 16)
    y = np.asarray(apply_rotary_half(x, cos, sin))[0, 0, 0]
    np.testing.assert_array_equal(y[12:], np.arange(12, 16))
    c, s, xs = np.asarray(cos)[0], np.asarray(sin)[0], np.arange(12.0)
    np.testing.assert_allclose(y[:6], xs[:6] * c[:6] - xs[6:] * s[:6], rtol=1e-6)
    np.testing.assert_allclose(y[6:12], xs[6:] * c[6:] + xs[:6] * s[6:], rtol=1e-6)


def test_layout_errors_name_the_argument(tiny, reference):
    with pytest.raises(ValueError, match="position_ids"):
        run(tiny, reference, position_ids=reference["position_ids"][:, :2])
    with pytest.raises(ValueError, match="token_tags"):
        run(tiny, reference, token_tags=reference["token_tags"][:-1])
    with pytest.raises(ValueError, match="indices name"):
        run(tiny, reference, audio_indices=reference["audio_indices"][:-1])


def test_a_single_file_needs_its_config(tmp_path):
    file = TINY / "diffusion_pytorch_model.safetensors"
    with pytest.raises(CheckpointError, match="config"):
        MiniMaxH3Transformer.from_pretrained(file)
    model = MiniMaxH3Transformer.from_pretrained(file, jnp.float32, config=TINY / "config.json")
    assert model.config == MiniMaxH3Config.from_json(TINY / "config.json")


def test_too_many_rotated_channels_is_refused():
    with pytest.raises(ValueError, match="rope_freq_dim"):
        MiniMaxH3Config(attention_head_dim=64, rope_freq_dim=16)


@pytest.mark.parametrize("component", ["transformer", "vae", "audio_vae"])
def test_the_released_checkpoints_map_every_key_onto_the_modules(component, tmp_path):
    """Full size, by key names and shapes alone (scripts/make_fixtures.py --only minimax_h3_released_keys): every
    stored tensor is read into a parameter of its shape, or, for the audio VAE's resampling filters (functions of the
    config, computed rather than read), named as unused; no parameter is left unset."""
    import json

    from mxdit.model.loading import KeyMap, ShapeCheckpoint, plan_load
    from mxdit.model.vae_minimax_h3 import MiniMaxH3VAEConfig, MiniMaxH3VideoVAE
    from mxdit.model.vae_minimax_h3_audio import MiniMaxH3AudioVAE, MiniMaxH3AudioVAEConfig

    released = json.loads((FIXTURES / "minimax_h3" / "released_keys.json").read_text())[component]
    module_cls, config_cls = {"transformer": (MiniMaxH3Transformer, MiniMaxH3Config),
                              "vae": (MiniMaxH3VideoVAE, MiniMaxH3VAEConfig),
                              "audio_vae": (MiniMaxH3AudioVAE, MiniMaxH3AudioVAEConfig)}[component]
    (tmp_path / "config.json").write_text(json.dumps(released["config"]))
    config = config_cls.from_json(tmp_path / "config.json")
    checkpoint = ShapeCheckpoint(released["keys"], component)
    keys = MiniMaxH3AudioVAE.key_map(checkpoint) if component == "audio_vae" else KeyMap(checkpoint)
    plan = plan_load(nnx.eval_shape(lambda: module_cls(config, rngs=nnx.Rngs(0))), keys)
    assert plan.problems == []
    if component == "audio_vae":
        assert plan.ignored and all(k.endswith((".filter", ".zero_k_bias")) for k in plan.ignored)
    else:
        assert plan.ignored == [] and len(plan.sources) == len(released["keys"])
