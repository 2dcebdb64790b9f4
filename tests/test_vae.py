"""The Qwen-Image (Krea 2) and FLUX VAEs: parity with diffusers on tiny random fixtures (float32, and bfloat16 as the
pipelines run them), tiling, images."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import FIXTURES, relative_l2
from mxdit.model.images import from_pil, to_pil, uint8_to_unit_range, unit_range_to_uint8
from mxdit.model.loading import CheckpointError
from mxdit.model.vae_flux import FluxVAE
from mxdit.model.vae_qwenimage import QwenImageVAE

VAE = FIXTURES / "vae"
FLUX_CONFIG = VAE / "flux_vae" / "config.json"  # its 4-channel blocks need 2 groups, which weights cannot show
# (name, class, diffusers folder, original single file, tiling arguments diffusers' fixture used)
MODELS = {
    "qwen": (QwenImageVAE, VAE / "qwenimage_vae", VAE / "qwenimage_vae_original.safetensors",
             dict(tile_size=64, tile_stride=48)),
    "flux": (FluxVAE, VAE / "flux_vae", VAE / "flux_vae_original.safetensors", dict(tile_size=64)),
}


def nhwc(a):
    return np.transpose(a, (0, 2, 3, 1))


@pytest.fixture(scope="module")
def reference():
    return dict(np.load(VAE / "vae_reference.npz"))


@pytest.fixture(scope="module", params=list(MODELS))
def case(request):
    cls, folder, original, tiling = MODELS[request.param]
    return request.param, cls.from_pretrained(folder, dtype=jnp.float32), tiling


def test_encode_matches_diffusers_on_an_odd_latent_grid(case, reference):
    name, vae, _ = case
    mean = vae.encode(nhwc(reference["image"]))  # 40x56 pixels: a 5x7 latent grid, batch 2
    assert mean.shape == (2, 5, 7, 16)
    assert relative_l2(mean, nhwc(reference[f"{name}_encode_mean"])) <= 5e-6


def test_decode_matches_diffusers_on_an_odd_latent_grid(case, reference):
    name, vae, _ = case
    images = vae.decode(nhwc(reference["latent"]))
    assert images.shape == (2, 40, 56, 3)
    assert relative_l2(images, nhwc(reference[f"{name}_decode"])) <= 5e-6


def test_qwen_fixture_decodes_mostly_inside_the_clamp(reference):
    # The Qwen decode clamps to [-1, 1] (diffusers' too): a fixture whose pixels sat at +-1 would hide errors there.
    assert np.mean(np.abs(reference["qwen_decode"]) >= 1) < 0.1


# (encode, decode) relative L2 bounds in bfloat16, ~2x the measured (Qwen 6.1e-2 and 1.9e-2, FLUX 1.1e-2 and 1.2e-2):
# bfloat16 rounding noise, each about as far from the float32 reference as diffusers' bfloat16 is.
BFLOAT16_BOUNDS = {"qwen": (0.12, 4e-2), "flux": (3e-2, 3e-2)}


@pytest.mark.parametrize("name", list(MODELS))
def test_bfloat16_encode_and_decode_match_diffusers_in_bfloat16(reference, name):
    """Both VAEs loaded in bfloat16 (the pipelines' default) against diffusers' in bfloat16 on the same inputs."""
    cls, folder, _, _ = MODELS[name]
    vae = cls.from_pretrained(folder, dtype=jnp.bfloat16)
    mean = vae.encode(nhwc(reference["image"]))
    images = vae.decode(nhwc(reference["latent"]))
    assert mean.dtype == images.dtype == jnp.bfloat16
    encode_bound, decode_bound = BFLOAT16_BOUNDS[name]
    assert relative_l2(mean, nhwc(reference[f"{name}_encode_mean_bf16"])) <= encode_bound
    assert relative_l2(images, nhwc(reference[f"{name}_decode_bf16"])) <= decode_bound


def test_tiled_decode_and_encode_match_diffusers_tiling(case, reference):
    name, vae, tiling = case
    decoded = vae.decode(nhwc(reference["big_latent"]), tiled=True, **tiling)  # 96x112 pixels: 2x3 tiles of 64
    expected = nhwc(reference[f"{name}_decode_big_tiled"])
    if name == "qwen":  # diffusers clamps the untiled decode but not the tiled one; we clamp both
        expected = np.clip(expected, -1, 1)
    assert relative_l2(decoded, expected) <= 4e-6
    encoded = vae.encode(nhwc(reference["big_image"]), tiled=True, **tiling)
    assert relative_l2(encoded, nhwc(reference[f"{name}_encode_big_tiled"])) <= 1e-5


def _spatially_local(vae):
    """The same VAE with every 3x3 kernel cut to its centre tap and the attention outputs zeroed: each output pixel
    then depends only on the latent pixel under it, so tiling must not change the result at all."""
    graphdef, state = nnx.split(nnx.clone(vae))
    flat = nnx.to_flat_state(state)
    for path, variable in flat:
        key, value = ".".join(map(str, path)), variable.get_value()
        if key.endswith("weight") and value.ndim == 4 and value.shape[-1] == 3:
            variable.set_value(jnp.zeros_like(value).at[:, :, 1, 1].set(value[:, :, 1, 1]))
        elif ".attentions." in key and (".proj." in key or ".to_out." in key):
            variable.set_value(jnp.zeros_like(value))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def test_tiled_decode_equals_untiled_on_a_spatially_local_vae(reference):
    # With random full kernels the two legitimately differ (every tile sees a different context; the relative L2
    # is ~0.24 on the tiny Qwen model with the tiling above), so the bookkeeping of tiles, crops and blend weights is
    # checked where the exact answer is known: a VAE with no spatial context. Only the Qwen VAE can be made so: its
    # norms are per pixel, while the FLUX VAE's GroupNorm takes statistics over each tile. Both share `tiled_apply`,
    # and the FLUX tile sizes are checked against diffusers' tiling above.
    cls, folder, _, tiling = MODELS["qwen"]
    local = _spatially_local(cls.from_pretrained(folder, dtype=jnp.float32))
    latents = nhwc(reference["big_latent"])
    tiled = local.decode(latents, tiled=True, **tiling)
    untiled = local.decode(latents)
    assert tiled.shape == untiled.shape == (1, 96, 112, 3)
    np.testing.assert_allclose(tiled, untiled, atol=1e-5, rtol=1e-5)


def test_original_single_file_layout_loads_the_same_weights(case):
    name, vae, _ = case
    cls, _, original, _ = MODELS[name]
    loaded = cls.from_pretrained(original, dtype=jnp.float32, config=FLUX_CONFIG if name == "flux" else None)
    a, b = nnx.to_flat_state(nnx.state(vae)), nnx.to_flat_state(nnx.state(loaded))
    for (path, x), (_, y) in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(x.get_value()), np.asarray(y.get_value()), err_msg=str(path))


def test_qwen_single_file_config_is_read_from_weights():
    vae = QwenImageVAE.from_pretrained(VAE / "qwenimage_vae_original.safetensors", dtype=jnp.float32)
    assert (vae.config.base_dim, vae.config.z_dim) == (2, 16)


def test_flux_single_file_with_unreadable_group_count_asks_for_a_config():
    with pytest.raises(CheckpointError, match="norm_num_groups=32.*pass config="):
        FluxVAE.from_pretrained(VAE / "flux_vae_original.safetensors")


def test_round_trip_of_a_photograph_keeps_shapes_dtypes_and_range(case):
    # Random weights cannot reconstruct the photo; this checks the plumbing from uint8 pixels to uint8 pixels.
    skimage_data = pytest.importorskip("skimage.data")
    name, vae, _ = case
    photo = skimage_data.astronaut()[100:196, 150:278]  # a real 96x128 RGB crop, uint8
    pixels = uint8_to_unit_range(photo)[None]
    assert pixels.dtype == np.float32 and pixels.min() >= -1 and pixels.max() <= 1
    latents = vae.encode(pixels)
    assert latents.shape == (1, 12, 16, 16) and latents.dtype == jnp.float32
    assert np.isfinite(np.asarray(latents)).all()
    decoded = vae.decode(latents)
    assert decoded.shape == (1, 96, 128, 3)
    out = unit_range_to_uint8(decoded)
    assert out.dtype == np.uint8 and out.shape == (1, 96, 128, 3)
    (image,) = to_pil(decoded)
    assert image.size == (128, 96) and image.mode == "RGB"


def test_latent_normalization_inverts_and_uses_the_config(case):
    name, vae, _ = case
    z = jax.random.normal(jax.random.key(0), (1, 3, 4, 16))
    np.testing.assert_allclose(vae.denormalize_latents(vae.normalize_latents(z)), z, rtol=1e-5, atol=1e-5)
    if name == "qwen":
        expected = (z - jnp.asarray(vae.config.latents_mean)) / jnp.asarray(vae.config.latents_std)
    else:
        expected = (z - vae.config.shift_factor) * vae.config.scaling_factor
    np.testing.assert_allclose(vae.normalize_latents(z), expected, rtol=1e-6)


def test_wrong_latent_channels_say_what_was_expected(case):
    _, vae, _ = case
    with pytest.raises(ValueError, match=r"expected latents of shape \(batch, height, width, 16\).*got \(1, 5, 7, 4\)"):
        vae.decode(np.zeros((1, 5, 7, 4), np.float32))
    with pytest.raises(ValueError, match=r"channels last.*got \(1, 16, 5, 7\)"):
        vae.decode(np.zeros((1, 16, 5, 7), np.float32))  # channels-first by mistake


def test_image_size_not_divisible_by_8_says_what_was_expected(case):
    _, vae, _ = case
    with pytest.raises(ValueError, match="multiples of 8, got 33x40"):
        vae.encode(np.zeros((1, 33, 40, 3), np.float32))


def test_missing_vae_config_is_named(tmp_path):
    shutil.copy(VAE / "qwenimage_vae" / "diffusion_pytorch_model.safetensors", tmp_path)
    with pytest.raises(CheckpointError, match="config.json: file not found"):
        QwenImageVAE.from_pretrained(tmp_path)


# -- image conversion -------------------------------------------------------------------------------------------------


def test_uint8_conversion_maps_the_ends_and_rounds_like_diffusers():
    pixels = np.array([[[0, 128, 255]]], np.uint8)
    unit = uint8_to_unit_range(pixels)
    np.testing.assert_allclose(unit, [[[-1.0, 128 / 127.5 - 1, 1.0]]], atol=1e-6)
    np.testing.assert_array_equal(unit_range_to_uint8(unit), pixels)
    np.testing.assert_array_equal(unit_range_to_uint8(np.array([-3.0, 3.0, 0.0])), [0, 255, 128])


def test_pil_round_trip_is_exact():
    photo = np.random.default_rng(0).integers(0, 256, (2, 8, 12, 3), dtype=np.uint8)
    pils = to_pil(uint8_to_unit_range(photo))
    np.testing.assert_array_equal(unit_range_to_uint8(from_pil(pils)), photo)


def test_non_uint8_images_are_refused():
    with pytest.raises(ValueError, match="expected uint8"):
        uint8_to_unit_range(np.zeros((4, 4, 3), np.float32))
