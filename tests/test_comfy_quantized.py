"""ComfyUI's pre-quantized files load as the weights they stand for: scaled FP8 (`*_fp8_scaled.safetensors`, per-tensor
scales, older `scale_weight` + `scaled_fp8` marker and newer `weight_scale` + `comfy_quant` naming) and MXFP8 (E8M0
block scales in cuBLAS's swizzled layout, as comfy-kitchen writes them), tested on tiny files in those layouts."""

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import FIXTURES, relative_l2
from mxdit.model.krea2 import Krea2Transformer, original_key_to_diffusers
from mxdit.model.loading import CheckpointError, iter_params, save_safetensors

TINY = FIXTURES / "krea2"
MATRICES = (".attn.wq.", ".attn.wk.", ".attn.wv.", ".attn.wo.", ".attn.gate.", ".mlp.gate.", ".mlp.up.", ".mlp.down.")


def krea2_matrix(key: str, w: np.ndarray) -> bool:
    return (key.startswith("model.diffusion_model.blocks.") and key.endswith(".weight")
            and any(m in key for m in MATRICES))


def comfy_fp8_file(path, style: str, source=TINY / "tiny_original.safetensors", select=krea2_matrix,
                   rename=original_key_to_diffusers):
    """The tiny original-layout checkpoint with its block matrices in FP8 E4M3, one float32 scale each."""
    tensors = load_file(str(source))
    expected = {}
    for key in list(tensors):
        if select(key, tensors[key]):
            w = tensors[key]
            scale = np.float32(np.abs(w).max() / 448)
            fp8 = (w / scale).astype(ml_dtypes.float8_e4m3fn)
            tensors[key] = fp8
            layer = key[: -len(".weight")]
            if style == "old":
                tensors[layer + ".scale_weight"] = np.array(scale, np.float32)
                tensors[layer + ".scale_input"] = np.array(1.0, np.float32)
            else:
                tensors[layer + ".weight_scale"] = np.array(scale, np.float32)
                tensors[layer + ".comfy_quant"] = np.frombuffer(json.dumps({"format": "float8_e4m3fn"}).encode(), np.uint8)
            expected[rename(key)] = fp8.astype(np.float32) * scale
    if style == "old":
        tensors["scaled_fp8"] = np.zeros(0, ml_dtypes.float8_e4m3fn)
    save_safetensors(tensors, path)
    return expected


@pytest.mark.parametrize("style", ["old", "new"])
def test_scaled_fp8_file_loads_as_dequantized_weights(tmp_path, style):
    file = tmp_path / "krea2_fp8_scaled.safetensors"
    expected = comfy_fp8_file(file, style)
    model = Krea2Transformer.from_pretrained(file, jnp.float32, config=TINY / "tiny" / "config.json")
    params = dict(iter_params(model))
    assert len(expected) == 16
    for key, value in expected.items():
        np.testing.assert_array_equal(np.asarray(params[key]), value, err_msg=key)
    # and the model still computes what diffusers computes, up to the FP8 rounding of 16 of its weights (measured
    # 0.022: the same FP8 values in both styles, so the same output)
    r = dict(np.load(TINY / "reference.npz"))
    out = model(r["hidden_states"], r["encoder_hidden_states"], r["timestep"], r["position_ids"],
                r["encoder_attention_mask"])
    assert relative_l2(out, r["output_masked"]) < 0.03


def to_blocked(scales: np.ndarray) -> np.ndarray:
    """comfy-kitchen's `to_blocked` (forward swizzle), written out for the test file."""
    rows, cols = scales.shape
    pr, pc = -(-rows // 128) * 128, -(-cols // 4) * 4
    padded = np.zeros((pr, pc), scales.dtype)
    padded[:rows, :cols] = scales
    blocks = padded.reshape(pr // 128, 128, pc // 4, 4).transpose(0, 2, 1, 3)
    return blocks.reshape(-1, 4, 32, 4).transpose(0, 2, 1, 3).reshape(-1, 32, 16).reshape(pr, pc)


def test_scale_unswizzle_inverts_the_swizzle_and_matches_the_offset_rule():
    from mxdit.model.loading import unswizzle_e8m0

    scales = np.random.default_rng(0).integers(1, 255, (200, 9)).astype(np.uint8)
    blocked = to_blocked(scales)
    assert blocked.shape == (256, 12)
    np.testing.assert_array_equal(unswizzle_e8m0(blocked, 200, 9), scales)
    # the flat offset rule of comfy-kitchen's Triton kernel
    flat, col_blocks = blocked.reshape(-1), 12 // 4
    for r, c in [(0, 0), (5, 3), (37, 2), (127, 8), (130, 6), (199, 8)]:
        offset = ((r // 128) * col_blocks + c // 4) * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4
        assert flat[offset] == scales[r, c]


def comfy_mxfp8_file(path, source=TINY / "tiny_original.safetensors", select=None, rename=original_key_to_diffusers):
    """The tiny original-layout checkpoint with its block matrices (those 32 divides) in comfy-kitchen's MXFP8; the
    file, "mxfp8_e4m3" and the weights it stands for."""
    tensors = load_file(str(source))
    expected = {}
    for key in list(tensors):
        w = tensors[key]
        if not ((select or (lambda k, _: k.startswith("model.diffusion_model.blocks.")))(key, w)
                and key.endswith(".weight") and w.ndim == 2 and w.shape[0] % 32 == 0 and w.shape[1] % 32 == 0):
            continue
        blocks = w.reshape(w.shape[0], -1, 32)
        amax = np.abs(blocks).max(-1)
        exp = np.clip(np.ceil(np.log2(amax / 448)).astype(np.int32) + 127, 0, 254)  # comfy-kitchen rounds amax up
        scale = np.ldexp(1.0, exp - 127).astype(np.float32)
        data = (blocks / scale[..., None]).reshape(w.shape).astype(ml_dtypes.float8_e4m3fn)
        layer = key[: -len(".weight")]
        tensors[key] = data
        tensors[layer + ".weight_scale"] = to_blocked(exp.astype(np.uint8))
        tensors[layer + ".comfy_quant"] = np.frombuffer(json.dumps({"format": "mxfp8"}).encode(), np.uint8)
        expected[rename(key)] = (data.astype(np.float32).reshape(blocks.shape) * scale[..., None]).reshape(w.shape)
    save_safetensors(tensors, path)
    return path, "mxfp8_e4m3", expected


def test_mxfp8_file_loads_as_dequantized_weights(tmp_path):
    file, _, expected = comfy_mxfp8_file(tmp_path / "krea2_mxfp8.safetensors")
    model = Krea2Transformer.from_pretrained(file, jnp.float32, config=TINY / "tiny" / "config.json")
    params = dict(iter_params(model))
    assert len(expected) == 10  # q, k, v, gate, out of 2 blocks (the 48-wide SwiGLU is not a multiple of 32)
    for key, value in expected.items():
        np.testing.assert_array_equal(np.asarray(params[key]), value, err_msg=key)


E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def in_blocks(key: str, w: np.ndarray) -> bool:
    return key.startswith("model.diffusion_model.blocks.") and key.endswith(".weight") and w.ndim == 2


def comfy_nvfp4_file(path, source=TINY / "tiny_original.safetensors", select=in_blocks,
                     rename=original_key_to_diffusers):
    """comfy-kitchen's NVFP4, its rules written out: a float32 tensor scale amax / (448 * 6), E4M3 block scales of
    16 (block amax / 6 over the tensor scale, rounded to E4M3) in the swizzled layout, E2M1 codes of the values over
    both scales packed two a byte with the even element in the high nibble. The weights it stands for, and the
    originals."""
    tensors = load_file(str(source))
    expected, before = {}, {}
    for key in list(tensors):
        w = tensors[key]
        if not (select(key, w) and w.shape[0] % 16 == 0 and w.shape[1] % 16 == 0):
            continue
        tensor_scale = np.float32(np.abs(w).max() / (448 * 6))
        blocks = w.reshape(w.shape[0], -1, 16)
        block_scale = (np.abs(blocks).max(-1) / 6 / tensor_scale).astype(ml_dtypes.float8_e4m3fn)
        total = block_scale.astype(np.float32) * tensor_scale
        scaled = blocks / total[..., None]
        codes = np.abs(np.abs(scaled)[..., None] - E2M1).argmin(-1) | np.where(scaled < 0, 8, 0)  # nearest E2M1
        flat = codes.reshape(w.shape).astype(np.uint8)
        layer = key[: -len(".weight")]
        tensors[key] = (flat[:, 0::2] << 4) | flat[:, 1::2]
        tensors[layer + ".weight_scale"] = to_blocked(block_scale.view(np.uint8)).view(ml_dtypes.float8_e4m3fn)
        tensors[layer + ".weight_scale_2"] = np.array(tensor_scale, np.float32)
        tensors[layer + ".comfy_quant"] = np.frombuffer(json.dumps({"format": "nvfp4"}).encode(), np.uint8)
        values = np.where(codes >= 8, -E2M1[codes & 7], E2M1[codes & 7])
        expected[rename(key)] = (values * total[..., None]).reshape(w.shape)
        before[rename(key)] = w
    save_safetensors(tensors, path)
    return expected, before


def test_nvfp4_file_loads_as_dequantized_weights(tmp_path):
    file = tmp_path / "krea2_nvfp4.safetensors"
    expected, before = comfy_nvfp4_file(file)
    model = Krea2Transformer.from_pretrained(file, jnp.float32, config=TINY / "tiny" / "config.json")
    params = dict(iter_params(model))
    assert len(expected) == 16  # q, k, v, gate, out and the SwiGLU of 2 blocks
    for key, value in expected.items():
        np.testing.assert_array_equal(np.asarray(params[key]), value, err_msg=key)
        assert relative_l2(value, before[key]) < 0.12, key  # what they stand for, to 4 bits (measured 0.094-0.099)


def comfy_int8_file(path, convrot: bool, source=TINY / "tiny_original.safetensors", select=in_blocks,
                    rename=original_key_to_diffusers):
    """ComfyUI's INT8 (`int8_tensorwise`, comfy-kitchen's rules written out): with ConvRot each row rotated in groups
    of 16 along K by the regular Hadamard (Kronecker powers of the 4x4 one whose rows all sum to 2, normalized), then
    INT8 with a float32 scale per row (absmax / 127); without it, one scale for the tensor. The weights it stands
    for, the originals, and the file's tensors with the last layer's record."""
    h4 = np.array([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]], np.float64)
    hadamard = np.kron(h4, h4) / 4  # 16 x 16, orthonormal and symmetric
    tensors = load_file(str(source))
    expected, before = {}, {}
    for key in list(tensors):
        w = tensors[key]
        if not (select(key, w) and w.shape[1] % 16 == 0):
            continue
        rows, cols = w.shape
        rotated = (w.reshape(rows, -1, 16) @ hadamard).reshape(rows, cols) if convrot else w.astype(np.float64)
        amax = np.abs(rotated).max(axis=1, keepdims=True) if convrot else np.abs(rotated).max()
        scale = (amax / 127).astype(np.float32)
        codes = np.clip(np.round(rotated / scale), -127, 127).astype(np.int8)
        layer = key[: -len(".weight")]
        tensors[key] = codes
        tensors[layer + ".weight_scale"] = np.asarray(scale, np.float32)
        record = {"format": "int8_tensorwise", **({"convrot": True, "convrot_groupsize": 16} if convrot else {})}
        tensors[layer + ".comfy_quant"] = np.frombuffer(json.dumps(record).encode(), np.uint8)
        values = codes.astype(np.float64) * scale
        if convrot:
            values = (values.reshape(rows, -1, 16) @ hadamard).reshape(rows, cols)
        expected[rename(key)] = values
        before[rename(key)] = w
    save_safetensors(tensors, path)
    return expected, before, (tensors, layer, record)


@pytest.mark.parametrize("convrot", [True, False])
def test_convrot_int8_file_loads_as_dequantized_weights(tmp_path, convrot):
    """ComfyUI's INT8, with and without ConvRot (`comfy_int8_file`). Loaded, the rotation is undone: the weights they
    stand for to float32 rounding, and to INT8's precision the originals."""
    file = tmp_path / "krea2_int8.safetensors"
    expected, before, (tensors, layer, record) = comfy_int8_file(file, convrot)
    model = Krea2Transformer.from_pretrained(file, jnp.float32, config=TINY / "tiny" / "config.json")
    params = dict(iter_params(model))
    assert len(expected) == 16
    for key, value in expected.items():
        np.testing.assert_allclose(np.asarray(params[key]), value, rtol=0, atol=4e-7 * np.abs(value).max(),
                                   err_msg=key)  # float32 sums of the rotation: measured 1.8e-7 of the largest
        assert relative_l2(params[key], before[key]) < 0.02, key  # INT8 of the (rotated) rows: measured 0.006-0.010
    tensors[layer + ".comfy_quant"] = np.frombuffer(json.dumps({**record, "convrot_groupsize": 32}).encode(), np.uint8)
    if convrot:
        save_safetensors(tensors, file)
        with pytest.raises(CheckpointError, match="ConvRot group size 32: must be a power of 4"):
            Krea2Transformer.from_pretrained(file, jnp.float32, config=TINY / "tiny" / "config.json")


def test_unknown_comfy_format_is_named(tmp_path):
    tensors = load_file(str(TINY / "tiny_original.safetensors"))
    key = "model.diffusion_model.blocks.0.attn.wq"
    tensors[key + ".weight_scale"] = np.ones(1, np.float32)
    tensors[key + ".comfy_quant"] = np.frombuffer(json.dumps({"format": "int8_blockwise"}).encode(), np.uint8)
    file = tmp_path / "x.safetensors"
    save_safetensors(tensors, file)
    with pytest.raises(CheckpointError, match="quantized as 'int8_blockwise', which mxdit cannot read yet"):
        Krea2Transformer.from_pretrained(file, config=TINY / "tiny" / "config.json")


def test_e4m3_and_mxfp8_layers_keep_their_codes_for_the_matching_precision(tmp_path):
    """With --precision fp8 (mxfp8), a per-tensor E4M3 (MXFP8) layer is read in our fp8_e4m3 (mxfp8_e4m3) format as
    stored (`keep_file_blocks`): the file's values to the bit, made a kernel weight without quantizing again (the
    Mosaic layout then folds MX exponents per tile, as for any MXFP8 weight), where re-quantizing the read values
    with our own rule (per channel; another exponent rule) moves them."""
    from mxdit.model.krea2 import diffusers_key_to_original
    from mxdit.model.loading import SafetensorsCheckpoint, dequantize_comfy, keep_file_blocks, place_parameters
    from mxdit.pallas_kernels.gemm import GemmWeight, prepare_weight
    from mxdit.pallas_kernels.gemm.reference import dequantize_weight
    from mxdit.quant.model import format_for, krea2_rules, quantize_on_load, weight_layout

    fp8_file = tmp_path / "fp8_scaled.safetensors"
    expected = comfy_fp8_file(fp8_file, "new")
    config = TINY / "tiny" / "config.json"

    def values(weight, like):  # a kernel weight's values, without the tiles' padding
        return np.asarray(dequantize_weight(weight))[:like.shape[0], :like.shape[1]]

    for file, fmt, want in ((fp8_file, "fp8_e4m3", expected), comfy_mxfp8_file(tmp_path / "mxfp8.safetensors")):
        rules = krea2_rules(fmt)
        wanted = lambda key: (format_for(key, (1, 1), rules),)  # noqa: E731
        with place_parameters(quantize_on_load(rules)), keep_file_blocks(wanted):
            kept = dict(iter_params(Krea2Transformer.from_pretrained(file, jnp.float32, config=config)))
        with place_parameters(quantize_on_load(rules)):
            requantized = dict(iter_params(Krea2Transformer.from_pretrained(file, jnp.float32, config=config)))
        view = dequantize_comfy(SafetensorsCheckpoint([file]))
        moved = 0
        for key, value in want.items():
            stored = view.quantized("model.diffusion_model." + diffusers_key_to_original(key))
            assert stored.fmt == fmt and isinstance(kept[key], GemmWeight), key
            np.testing.assert_array_equal(np.asarray(stored.dequantize()), value, err_msg=key)
            np.testing.assert_array_equal(values(kept[key], value),
                                          values(prepare_weight(stored, backend=weight_layout()), value), err_msg=key)
            moved += not np.array_equal(values(requantized[key], value), values(kept[key], value))
        assert moved > 0, fmt


def flux_matrix(key: str, w: np.ndarray) -> bool:
    blocks = ("model.diffusion_model.double_blocks.", "model.diffusion_model.single_blocks.")
    return (key.startswith(blocks) and key.endswith(".weight") and w.ndim == 2
            and not key.endswith(("_mod.lin.weight", "modulation.lin.weight")))


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "mxfp8_e4m3", "nvfp4", "convrot_int8"])
def test_flux_comfy_files_load_as_their_values_and_keep_their_codes(tmp_path, fmt):
    """FLUX.1's original layout in ComfyUI's per-tensor E4M3, MXFP8, NVFP4 and ConvRot INT8: the weights of a
    float32 file of the values they stand for (its fused q/k/v and linear1 split as any original file's; ConvRot's
    rotation undone, to float32 rounding); with --precision fp8 the E4M3 codes kept through the split (row ranges of
    the stored layer) give those values to the bit, and NVFP4 stays nvfp4 at the default precision."""
    from safetensors.numpy import load_file as load

    from mxdit.model.flux import FluxTransformer
    from mxdit.model.loading import keep_file_blocks, place_parameters
    from mxdit.pallas_kernels.gemm import GemmWeight
    from mxdit.pallas_kernels.gemm.reference import dequantize_weight
    from mxdit.quant.model import flux_rules, format_for, quantize_on_load

    source, same = FIXTURES / "flux" / "tiny_original.safetensors", (lambda key: key)
    file = tmp_path / "flux.safetensors"
    if fmt == "fp8_e4m3":
        values = comfy_fp8_file(file, "new", source, flux_matrix, same)
    elif fmt == "mxfp8_e4m3":
        _, _, values = comfy_mxfp8_file(file, source, flux_matrix, same)
    elif fmt == "nvfp4":
        values, _ = comfy_nvfp4_file(file, source, flux_matrix, same)
    else:
        values, _, _ = comfy_int8_file(file, True, source, flux_matrix, same)
        values = {k: v.astype(np.float32) for k, v in values.items()}
    plain = tmp_path / "plain.safetensors"
    save_safetensors({**load(str(source)), **values}, plain)
    config = FIXTURES / "flux" / "tiny" / "config.json"
    want = dict(iter_params(FluxTransformer.from_pretrained(plain, jnp.float32, config=config)))
    got = dict(iter_params(FluxTransformer.from_pretrained(file, jnp.float32, config=config)))
    assert values and want.keys() == got.keys()
    for key in want:  # ConvRot: the float32 sums of the rotation, bounded as in the Krea 2 test
        atol = 4e-7 * float(np.abs(want[key]).max()) if fmt == "convrot_int8" else 0
        np.testing.assert_allclose(np.asarray(got[key]), np.asarray(want[key]), rtol=0, atol=atol, err_msg=key)
    if fmt == "nvfp4":
        from mxdit.quant.formats import QuantizedArray

        with keep_file_blocks(lambda key: ("int8_b32", "nvfp4")):
            kept = dict(iter_params(FluxTransformer.from_pretrained(file, jnp.float32, config=config)))
        blocks = {k: v for k, v in kept.items() if isinstance(v, QuantizedArray)}
        assert blocks and all(q.fmt == "nvfp4" for q in blocks.values())
        for key, q in blocks.items():
            np.testing.assert_array_equal(np.asarray(q.dequantize()), np.asarray(want[key]), err_msg=key)
    if fmt not in ("fp8_e4m3", "mxfp8_e4m3"):
        return
    rules = flux_rules(fmt)
    wanted = lambda key: (format_for(key, (1, 1), rules),)  # noqa: E731
    with place_parameters(quantize_on_load(rules)), keep_file_blocks(wanted):
        kept = dict(iter_params(FluxTransformer.from_pretrained(file, jnp.float32, config=config)))
    weights = {k: v for k, v in kept.items() if isinstance(v, GemmWeight)}
    assert weights and all(w.fmt == fmt for w in weights.values())
    if fmt == "fp8_e4m3":  # (MXFP8's Mosaic layout folds exponents per tile: the Krea 2 test checks it)
        for key, weight in weights.items():
            rows, cols = want[key].shape
            np.testing.assert_array_equal(np.asarray(dequantize_weight(weight))[:rows, :cols], np.asarray(want[key]),
                                          err_msg=key)


def test_nvfp4_layers_stay_nvfp4_at_the_default_precision(tmp_path):
    """build_pipeline's default precision keeps a ComfyUI NVFP4 layer as our nvfp4 (its codes, unswizzled E4M3
    scales and tensor scale: no kernel takes it, so it is dequantized for each product): the file's values to the
    bit, and the output of the weights dequantized on read."""
    from mxdit.model.loading import keep_file_blocks
    from mxdit.quant.formats import QuantizedArray

    file = tmp_path / "krea2_nvfp4.safetensors"
    expected, _ = comfy_nvfp4_file(file)
    config = TINY / "tiny" / "config.json"
    with keep_file_blocks(lambda key: ("int8_b32", "nvfp4")):
        model = Krea2Transformer.from_pretrained(file, jnp.float32, config=config)
    params = dict(iter_params(model))
    for key, value in expected.items():
        assert isinstance(params[key], QuantizedArray) and params[key].fmt == "nvfp4", key
        np.testing.assert_array_equal(np.asarray(params[key].dequantize()), value, err_msg=key)
    r = dict(np.load(TINY / "reference.npz"))
    args = (r["hidden_states"], r["encoder_hidden_states"], r["timestep"], r["position_ids"],
            r["encoder_attention_mask"])
    whole = Krea2Transformer.from_pretrained(file, jnp.float32, config=config)
    np.testing.assert_array_equal(np.asarray(model(*args)), np.asarray(whole(*args)))
