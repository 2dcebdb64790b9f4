"""Model quantization by rules, storage sizes of the full-size Krea 2, the quantized checkpoint, and the gates."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import FIXTURES
from mxdit.model.krea2 import Krea2Config, Krea2Transformer
from mxdit.model.loading import iter_params
from mxdit.quant.formats import QuantizedArray, formats
from mxdit.quant.gates import GateFailure, admit, evaluate, psnr, ssim
from mxdit.quant.model import (dequantize_model, fake_quantize_model, krea2_rules, load_quantized, quantize_model,
                               save_quantized, weight_bytes)


@pytest.fixture(scope="module")
def tiny_params():
    model = Krea2Transformer.from_pretrained(FIXTURES / "krea2" / "tiny", jnp.float32)
    return dict(iter_params(model))


def test_krea2_rules_quantize_the_block_matrices_and_keep_the_rest(tiny_params):
    q = quantize_model(tiny_params, krea2_rules("mxfp4_e2m1"))
    quantized = {k for k, v in q.items() if isinstance(v, QuantizedArray)}
    assert "transformer_blocks.0.attn.to_q.weight" in quantized and "transformer_blocks.1.ff.down.weight" in quantized
    for kept in ("img_in.weight", "time_embed.linear_1.weight", "txt_in.linear_1.weight", "final_layer.linear.weight",
                 "transformer_blocks.0.scale_shift_table", "transformer_blocks.0.attn.norm_q.weight",
                 "time_mod_proj.weight", "text_fusion.projector.weight"):
        assert kept not in quantized, kept
    assert "text_fusion.refiner_blocks.0.attn.to_q.weight" in quantized
    assert len(quantized) == (2 + 2 + 2) * 8  # joint, layerwise and refiner blocks x (q, k, v, gate, out, 3 ff)


def test_fake_quantized_weights_are_the_quantized_model_dequantized(tiny_params):
    """A tensor at a time (what lets a full-size model be compared in a format on one GPU), the same numbers."""
    rules = krea2_rules("mxfp6_e2m3")
    whole = dequantize_model(quantize_model(tiny_params, rules), jnp.bfloat16)
    one_by_one = fake_quantize_model(tiny_params, rules, jnp.bfloat16)
    assert one_by_one.keys() == whole.keys()
    for key, value in whole.items():
        assert one_by_one[key].dtype == value.dtype, key
        np.testing.assert_array_equal(np.asarray(one_by_one[key], np.float32), np.asarray(value, np.float32))
    with pytest.raises(ValueError, match="unknown format"):
        fake_quantize_model(tiny_params, [(r".*", "fp7")])


# NVFP4's run takes 3x the others' (~16 s on 2 cores): slow-marked; its save and restore of the arrays themselves
# stay in test_quant_formats.py's default tests.
@pytest.mark.parametrize("fmt", [pytest.param(f, marks=pytest.mark.slow) if f == "nvfp4" else f for f in formats()])
def test_quantized_checkpoint_reloads_bit_for_bit(tmp_path, tiny_params, fmt):
    q = quantize_model(tiny_params, krea2_rules(fmt))
    save_quantized(q, tmp_path / "q.safetensors")
    loaded = load_quantized(tmp_path / "q.safetensors")
    assert loaded.keys() == q.keys()
    for key, value in q.items():
        if isinstance(value, QuantizedArray):
            again = loaded[key]
            assert (again.fmt, again.shape, again.axis) == (value.fmt, value.shape, value.axis)
            for a, b in ((value.data, again.data), (value.scale, again.scale)):
                assert a.dtype == b.dtype
                np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
        else:
            np.testing.assert_array_equal(np.asarray(value), np.asarray(loaded[key]))
    np.testing.assert_array_equal(dequantize_model(q, jnp.float32)["transformer_blocks.0.attn.to_q.weight"],
                                  dequantize_model(loaded, jnp.float32)["transformer_blocks.0.attn.to_q.weight"])


def test_full_size_krea2_weight_bytes_from_its_shapes():
    abstract = nnx.eval_shape(lambda: Krea2Transformer(Krea2Config(), dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in iter_params(abstract)}
    bf16 = weight_bytes(shapes, [])
    assert 25.5e9 < bf16 < 25.8e9  # 12.82 B parameters, norms in float32
    mxfp4 = weight_bytes(shapes, krea2_rules("mxfp4_e2m1"))
    mxfp6 = weight_bytes(shapes, krea2_rules("mxfp6_e2m3"))
    fp8 = weight_bytes(shapes, krea2_rules("fp8_e4m3"))
    assert mxfp4 <= 7.5e9 and mxfp4 < mxfp6 < fp8 < bf16


def test_unknown_format_in_rules_is_named(tiny_params):
    with pytest.raises(ValueError, match="unknown format"):
        quantize_model(tiny_params, [(".*", "fp3")])


def test_ssim_and_psnr_match_scikit_image():
    metrics = pytest.importorskip("skimage.metrics")
    data = pytest.importorskip("skimage.data")
    image = data.astronaut()[:96, :128].astype(np.float64)
    noisy = np.clip(image + np.random.default_rng(0).normal(0, 12, image.shape), 0, 255)
    expected = metrics.structural_similarity(image, noisy, data_range=255, channel_axis=-1, gaussian_weights=True,
                                             sigma=1.5, use_sample_covariance=False)
    assert ssim(noisy, image) == pytest.approx(expected, abs=1e-9)
    assert psnr(noisy, image) == pytest.approx(metrics.peak_signal_noise_ratio(image, noisy, data_range=255), abs=1e-9)
    assert ssim(image, image) == pytest.approx(1.0) and psnr(image, image) == float("inf")


def test_ssim_of_a_batch_is_the_mean_of_its_images_ssims():
    """A batch (n, h, w, c) is n images, not one volume: no window spans two of them."""
    metrics = pytest.importorskip("skimage.metrics")
    data = pytest.importorskip("skimage.data")
    rng = np.random.default_rng(0)
    images = np.stack([np.roll(data.astronaut()[:64, :80], 9 * i, axis=1) for i in range(3)])
    noisy = np.clip(images + rng.normal(0, 12, images.shape), 0, 255).astype(np.uint8)
    expected = [metrics.structural_similarity(a.astype(np.float64), b.astype(np.float64), data_range=255,
                                              channel_axis=-1, gaussian_weights=True, sigma=1.5,
                                              use_sample_covariance=False) for a, b in zip(images, noisy)]
    assert ssim(noisy, images) == pytest.approx(np.mean(expected), abs=1e-9)
    with pytest.raises(ValueError, match=r"images of shape \(2, 3, 64, 80, 3\)"):
        ssim(np.stack([images[:3]] * 2), np.stack([images[:3]] * 2))


def test_gate_admits_a_close_output_and_refuses_a_broken_one_with_figures():
    rng = np.random.default_rng(1)
    reference = rng.standard_normal(4096)
    assert evaluate("fp8_e4m3", reference + 0.01 * rng.standard_normal(4096), reference).passed
    broken = reference.copy()
    broken[3] = np.nan
    with pytest.raises(GateFailure, match=r"fp8_e4m3 refused: 1 non-finite values.*cosine"):
        admit("fp8_e4m3", broken, reference)
    with pytest.raises(GateFailure, match="relative L2"):
        admit("mxfp4_e2m1", reference + 0.5 * rng.standard_normal(4096), reference)


def test_quantize_script_writes_a_loadable_checkpoint_and_keeps_existing_files(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("quantize", Path(__file__).parent.parent / "scripts" / "quantize.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "q.safetensors"
    argv = ["--model", str(FIXTURES / "krea2" / "tiny"), "--format", "mxfp6_e2m3", "--output", str(out)]
    assert script.main(argv) == 0
    assert "48 of 92 tensors in mxfp6_e2m3" in capsys.readouterr().out
    loaded = load_quantized(out)
    assert isinstance(loaded["transformer_blocks.0.ff.up.weight"], QuantizedArray)
    before = out.read_bytes()
    with pytest.raises(SystemExit):
        script.main(argv)
    assert "already exists" in capsys.readouterr().err and out.read_bytes() == before


@pytest.mark.slow  # ~1.5 min on 2 cores
def test_quality_table_on_a_one_block_demo_model(tmp_path):
    """eval_quality --activations --kernels --attention: per format the weight-only row, the W+A simulation, the
    inference path (GEMM kernels' numerics) and that path with the INT8 attention (FP8 P.V, Triton in interpret
    mode here) in every block. Random weights: this checks the path (quantize -> dequantize -> generate -> compare
    -> gate) and the order of the losses, not quality. One joint, one layerwise and one refiner block: every row
    compiles its own transformer programs, which take most of the time whatever the depth."""
    import dataclasses

    import jax

    from mxdit.model.pipeline_krea2 import Krea2Pipeline, demo_pipeline
    from mxdit.model.quality import format_table, quality_table

    demo = demo_pipeline(tmp_path / "tokenizer", dtype=jnp.float32)
    config = dataclasses.replace(demo.transformer.config, num_layers=1, num_layerwise_text_blocks=1,
                                 num_refiner_text_blocks=1)
    transformer = Krea2Transformer(config, dtype=jnp.float32, rngs=nnx.Rngs(jax.random.key(0, impl="rbg")))
    pipe = Krea2Pipeline(transformer, demo.vae, demo.text_encoder, demo.tokenizer, demo.config)
    rows = quality_table(pipe, ["fp8_e4m3", "mxfp4_e2m1"], ["a red fox"], [0], height=32, width=32, steps=1,
                         max_sequence_length=16, activations=True, kernels=True, attention="int8_fp8")
    assert [r.fmt for r in rows] == ["reference", "fp8_e4m3", "fp8_e4m3 W+A", "fp8_e4m3 GEMM",
                                     "fp8_e4m3 GEMM+int8_fp8", "mxfp4_e2m1", "mxfp4_e2m1 W+A", "mxfp4_e2m1 GEMM",
                                     "mxfp4_e2m1 GEMM+int8_fp8"]
    fp8, fp8_wa, fp8_gemm, fp8_attention, fp4, fp4_wa, fp4_gemm, fp4_attention = (r.report for r in rows[1:])
    assert 0.99 < fp4.cosine < fp8.cosine < 1.0 and fp8.nonfinite == 0
    assert fp8_wa.cosine < fp8.cosine and fp4_wa.cosine < fp4.cosine  # quantizing inputs too costs more
    # The inference path quantizes inputs to FP8 per token: for FP8 weights the W+A simulation itself, for MXFP4
    # weights less lossy than MXFP4 inputs.
    assert abs(fp8_gemm.cosine - fp8_wa.cosine) < 1e-6 and fp4_wa.cosine < fp4_gemm.cosine < fp4.cosine
    assert 0 < fp4.ssim <= 1 and fp4.psnr > 0
    assert rows[5].weight_bytes < rows[1].weight_bytes < rows[0].weight_bytes
    # The attention kernel really runs (the velocity moves) and stays close, gated like its format.
    for gemm, with_attention in ((fp8_gemm, fp8_attention), (fp4_gemm, fp4_attention)):
        assert with_attention.nonfinite == 0 and with_attention.cosine > 0.99
        assert with_attention.cosine != gemm.cosine
    assert "mxfp4_e2m1 W+A" in format_table(rows) and "fp8_e4m3 GEMM+int8_fp8" in format_table(rows)
