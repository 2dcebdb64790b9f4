"""ComfyUI's pre-quantized files (`*_fp8_scaled.safetensors`: FP8 weights with per-tensor scales) load as the
weights they stand for, in both the older (`scale_weight`, `scaled_fp8` marker) and newer (`weight_scale`,
`comfy_quant`) naming, tested on tiny files written in those layouts."""

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import FIXTURES, relative_l2
from mxdit.model.krea2 import Krea2Transformer, original_key_to_diffusers
from mxdit.model.loading import iter_params, save_safetensors

TINY = FIXTURES / "krea2"
MATRICES = (".attn.wq.", ".attn.wk.", ".attn.wv.", ".attn.wo.", ".attn.gate.", ".mlp.gate.", ".mlp.up.", ".mlp.down.")


def comfy_fp8_file(path, style: str):
    """The tiny original-layout checkpoint with its block matrices in FP8 E4M3, one float32 scale each."""
    tensors = load_file(str(TINY / "tiny_original.safetensors"))
    expected = {}
    for key in list(tensors):
        if key.startswith("model.diffusion_model.blocks.") and key.endswith(".weight") and any(m in key for m in MATRICES):
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
            expected[original_key_to_diffusers(key)] = fp8.astype(np.float32) * scale
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
    # and the model still computes what diffusers computes, up to FP8 weight rounding
    r = dict(np.load(TINY / "reference.npz"))
    out = model(r["hidden_states"], r["encoder_hidden_states"], r["timestep"], r["position_ids"],
                r["encoder_attention_mask"])
    assert relative_l2(out, r["output_masked"]) < 0.1
