"""The MiniMax H3 video VAE against diffusers' `AutoencoderKLMiniMaxH3` on the tiny fixture
(scripts/fixtures/minimax_h3_vae.py): 4x spatial and 2x temporal compression, 5-frame clips with one dropped latent,
a 12 x 20 frame, a two-block ViT decoder; untiled and in 8-pixel tiles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import FIXTURES, relative_l2
from mxdit.model.loading import iter_params
from mxdit.model.vae_minimax_h3 import MiniMaxH3VAEConfig, MiniMaxH3VideoVAE, SpatialTiling

TINY = FIXTURES / "minimax_h3" / "vae" / "tiny"
TILES = SpatialTiling(tile_size=8, min_overlap=4)  # the fixture's enable_tiling(8, 8, 4, 4)


@pytest.fixture(scope="module")
def reference():
    return dict(np.load(FIXTURES / "minimax_h3" / "vae" / "reference.npz"))


@pytest.fixture(scope="module")
def tiny():
    return MiniMaxH3VideoVAE.from_pretrained(TINY, dtype=jnp.float32)


def channels_last(array: np.ndarray) -> np.ndarray:
    """diffusers' (batch, channels, frames, h, w) -> ours (batch, frames, h, w, channels)."""
    return np.transpose(array, (0, 2, 3, 4, 1))


def video_in_range(pixels: np.ndarray) -> jax.Array:
    """The fixture's videos are in the VAE's ImageNet-normalised space; our API takes [-1, 1]."""
    return MiniMaxH3VideoVAE.from_vae_pixels(jnp.asarray(channels_last(pixels)))


def test_config_reads_the_tiny_checkpoint_and_derives_the_clip_geometry(tiny):
    cfg = tiny.config
    assert (cfg.spatial_compression, cfg.temporal_compression, cfg.tokens_chunk_size) == (4, 2, 3)
    assert (cfg.frame_pre_padding, cfg.token_overlap, cfg.frame_overlap) == (1, 2, 3)
    release = MiniMaxH3VAEConfig()  # 17 frames -> 5 latents; 3 dropped; decoded clips overlap by 5 frames
    assert (release.spatial_compression, release.temporal_compression, release.tokens_chunk_size) == (16, 4, 5)
    assert (release.frame_pre_padding, release.token_overlap, release.frame_overlap) == (3, 2, 5)


@pytest.mark.parametrize("tiled", [False, True], ids=["untiled", "tiled"])
def test_encoded_video_and_image_match_diffusers(tiny, reference, tiled):
    prefix, tiling = ("tiled_", TILES) if tiled else ("", None)
    mean, logvar = tiny.encode_moments(video_in_range(reference["video"]), tiling=tiling)
    assert mean.shape == (1, 5, 3, 5, 4)  # 8 frames padded to two 5-frame clips: 3 + 3 latents, 1 dropped
    assert relative_l2(mean, channels_last(reference[f"{prefix}mean"])) <= 1e-6  # measured 4.4e-7, tiled 4.2e-7
    assert relative_l2(logvar, channels_last(reference[f"{prefix}logvar"])) <= 1e-6  # measured 4.1e-7, tiled 3.9e-7
    image = tiny.encode(video_in_range(reference["image"]), tiling=tiling)
    assert image.shape == (1, 1, 3, 5, 4)
    assert relative_l2(image, channels_last(reference[f"{prefix}image_mean"])) <= 1e-6  # measured 2.4e-7, tiled 2.8e-7


@pytest.mark.parametrize("tiled", [False, True], ids=["untiled", "tiled"])
def test_decoded_video_matches_diffusers(tiny, reference, tiled):
    prefix, tiling = ("tiled_", TILES) if tiled else ("", None)
    for name, frames in (("sample", 13), ("sample_padded", 10)):  # 8 latents: two clips; 6: padded to 8, then cut
        key = name.replace("sample", "latents")
        video = tiny.decode(jnp.asarray(channels_last(reference[key])), tiling=tiling, clamp=False)
        expected = np.asarray(video_in_range(reference[f"{prefix}{name}"]))
        assert video.shape == (1, frames, 12, 20, 3)
        assert relative_l2(video, expected) <= 1e-6  # measured 1.8e-7 (padded 1.8e-7), tiled 1.7e-7 (1.7e-7)


def test_decoded_video_follows_the_pipeline_pixel_convention(tiny, reference):
    # MiniMax H3's decode step: `(sample * imagenet_std + imagenet_mean).clamp(0, 1)`; ours is the same in [-1, 1].
    video = tiny.decode(jnp.asarray(channels_last(reference["latents"])), tiling=None)
    std, mean = np.array([0.229, 0.224, 0.225]), np.array([0.485, 0.456, 0.406])
    expected = np.clip(channels_last(reference["sample"]) * std + mean, 0.0, 1.0) * 2.0 - 1.0
    assert relative_l2(video, expected) <= 1e-6


def test_bfloat16_decoder_keeps_the_release_mixed_precision_and_matches_diffusers(reference):
    model = MiniMaxH3VideoVAE.from_pretrained(TINY, dtype=jnp.bfloat16)
    for key, value in iter_params(model):
        parts = key.split(".")
        pinned = parts[0] in ("encoder", "quant_conv") or bool({"norm1", "norm2", "norm_out", "scale1", "scale2"}
                                                                 & set(parts))
        assert value.dtype == (jnp.float32 if pinned else jnp.bfloat16), key
    video = model.decode(jnp.asarray(channels_last(reference["latents"])), tiling=None, clamp=False)
    assert video.dtype == jnp.float32
    expected_bf16 = video_in_range(reference["sample_bf16"])
    expected = video_in_range(reference["sample"])
    # measured: ours 2.5e-3 from diffusers' bf16 and 2.8e-3 from its float32, where its own bf16 is 2.5e-3
    assert relative_l2(video, expected_bf16) <= 4e-3
    assert relative_l2(video, expected) <= 1.25 * relative_l2(expected_bf16, expected)


def test_jitted_decode_equals_eager(tiny, reference):
    latents = jnp.asarray(channels_last(reference["latents"]))
    jitted = tiny.decode(latents, tiling=None, clamp=False)
    with jax.disable_jit():
        eager = tiny.decode(latents, tiling=None, clamp=False)
    assert relative_l2(jitted, eager) <= 1e-6  # measured 1.5e-7


def test_latent_normalization_round_trips_with_the_config_statistics(tiny):
    z = jax.random.normal(jax.random.key(0), (1, 2, 3, 5, 4))
    normalized = tiny.normalize_latents(z)
    mean, std = np.asarray(tiny.config.latents_mean), np.asarray(tiny.config.latents_std)
    np.testing.assert_allclose(normalized, (np.asarray(z) - mean) / std, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(tiny.denormalize_latents(normalized), z, rtol=1e-5, atol=1e-6)


def test_wrong_shapes_and_frame_counts_name_the_argument(tiny):
    with pytest.raises(ValueError, match="video must have shape"):
        tiny.encode(jnp.zeros((1, 3, 8, 12, 20)))  # channels first
    with pytest.raises(ValueError, match="multiples of 4"):
        tiny.encode(jnp.zeros((1, 8, 10, 20, 3)))
    with pytest.raises(ValueError, match="latents must have shape"):
        tiny.decode(jnp.zeros((1, 8, 3, 5)))
    with pytest.raises(ValueError, match="latents has 1 latent frames; decoding needs at least 3"):
        tiny.decode(jnp.zeros((1, 1, 3, 5, 4)))
