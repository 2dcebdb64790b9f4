"""The MiniMax H3 audio VAE against diffusers' `AutoencoderKLMiniMaxH3Audio` on the tiny fixture
(scripts/fixtures/minimax_h3_audio_vae.py): encode of a stereo pair of random waveforms whose length is not a multiple
of the hop, decode of random latents. diffusers' tensors are (batch, channels, length), ours channels-last."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from conftest import FIXTURES, relative_l2
from mxdit.model.loading import CheckpointError
from mxdit.model.vae_minimax_h3_audio import MiniMaxH3AudioVAE, kaiser_sinc_filter

TINY = FIXTURES / "minimax_h3" / "audio_vae" / "tiny"


@pytest.fixture(scope="module")
def reference():
    return dict(np.load(FIXTURES / "minimax_h3" / "audio_vae" / "reference.npz"))


@pytest.fixture(scope="module")
def tiny():
    return MiniMaxH3AudioVAE.from_pretrained(TINY)


def test_decoded_waveform_matches_diffusers(tiny, reference):
    latents = reference["latents"].transpose(0, 2, 1)
    waveform = tiny.decode(latents)
    expected = reference["decoded"][:, 0]
    assert waveform.shape == expected.shape == (2, 7 * tiny.config.hop_length)
    # measured 2.7e-6: the tiny random decoder amplifies float32 rounding (diffusers' own float32 decode is 1.8e-6 from
    # its float64 one; ours computed in float64 is 5e-15 from diffusers' float64)
    assert relative_l2(waveform, expected) <= 5e-6
    assert np.array_equal(np.abs(waveform) == 1, np.abs(expected) == 1)  # the same samples clamped


def test_encoded_posterior_matches_diffusers(tiny, reference):
    mean, log_std = tiny.encode_posterior(reference["waveform"][:, 0])
    assert mean.shape == log_std.shape == (2, 10, tiny.config.latent_channels)  # 58 samples padded to 10 hops of 6
    assert relative_l2(mean, reference["mean"].transpose(0, 2, 1)) <= 1e-6  # measured 3.6e-7
    assert relative_l2(log_std, reference["logs"].transpose(0, 2, 1)) <= 1e-6  # measured 2.5e-7
    assert np.array_equal(tiny.encode(reference["waveform"][:, 0]), mean)


def test_jitted_decode_equals_eager(tiny, reference):
    latents = jnp.asarray(reference["latents"].transpose(0, 2, 1))
    eager = tiny.decoder(tiny.dec_in_proj(latents))[..., 0]
    # measured 8.0e-7: XLA orders the jitted program's float32 sums its own way, and the decoder amplifies rounding
    assert relative_l2(tiny.decode(latents), eager) <= 2e-6


def test_computed_resampling_filters_equal_the_stored_buffers():
    # The checkpoint stores diffusers' float32 computation of the filter in every resampler; ours is float64 rounded
    # to float32, at most one float32 step (3e-8) away.
    stored = {k: v for k, v in load_file(TINY / "diffusion_pytorch_model.safetensors").items() if k.endswith(".filter")}
    assert len(stored) == 2 * (2 * 2 * 4 + 1)  # upsample and downsample, of 2 stages x 2 AMP blocks x 4 + the last
    ours = np.asarray(kaiser_sinc_filter(0.25, 0.3, 12), np.float32)
    for key, taps in stored.items():
        assert np.abs(taps.reshape(-1) - ours).max() <= 3e-8, key


def test_parametrizations_weight_norm_spelling_loads_the_same(tiny, reference, tmp_path):
    renamed = {k.replace(".weight_g", ".parametrizations.weight.original0")
                .replace(".weight_v", ".parametrizations.weight.original1"): v
               for k, v in load_file(TINY / "diffusion_pytorch_model.safetensors").items()}
    save_file(renamed, str(tmp_path / "vae.safetensors"))
    model = MiniMaxH3AudioVAE.from_pretrained(tmp_path / "vae.safetensors", config=TINY / "config.json")
    latents = reference["latents"].transpose(0, 2, 1)
    assert np.array_equal(model.decode(latents), tiny.decode(latents))


def test_latent_normalization_uses_the_config_statistics_and_inverts(tiny, reference):
    latents = reference["latents"].transpose(0, 2, 1)
    mean, std = np.asarray(tiny.config.latents_mean), np.asarray(tiny.config.latents_std)
    normalized = tiny.normalize_latents(latents)
    np.testing.assert_allclose(normalized, (latents - mean) / std, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(tiny.denormalize_latents(normalized), latents, rtol=1e-6, atol=1e-6)


def test_mismatches_name_the_key_or_argument(tiny):
    config = dataclasses.replace(tiny.config, latent_channels=12, latents_mean=None, latents_std=None)
    with pytest.raises(CheckpointError, match=r"mean_proj\.weight: checkpoint has shape \(8, 8, 1\)"):
        MiniMaxH3AudioVAE.from_pretrained(TINY, config=config)
    with pytest.raises(ValueError, match="decoder_rates"):
        dataclasses.replace(tiny.config, decoder_rates=(3, 3))
    with pytest.raises(ValueError, match="latents_mean has 3 entries"):
        dataclasses.replace(tiny.config, latents_mean=(0.0, 0.0, 0.0))
    with pytest.raises(ValueError, match="latent_channels=8"):
        tiny.decode(jnp.zeros((1, 4, 6)))
    with pytest.raises(ValueError, match=r"\(batch, samples\)"):
        tiny.encode(jnp.zeros((1, 1, 60)))
    with pytest.raises(ValueError, match="no latents_mean"):
        config = dataclasses.replace(tiny.config, latents_mean=None, latents_std=None)
        nnx.eval_shape(lambda: MiniMaxH3AudioVAE(config, rngs=nnx.Rngs(0))).normalize_latents(jnp.zeros((1, 8)))
