"""The quality protocol's machinery (model/quality.py, scripts/eval_quality.py): the built-in prompt set, prompt
files, the contact sheet's layout, and the demo run writing the table as text and JSON and the sheet. Random
weights: the figures mean nothing here, the machinery is what is checked."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import FIXTURES
from mxdit.model.quality import contact_sheet, read_prompts


def test_the_built_in_prompts_are_a_hundred_distinct_scenes(tmp_path):
    prompts = read_prompts("coco100")
    assert len(prompts) == 100 == len(set(prompts)) and all(len(p.split()) >= 5 for p in prompts)
    file = tmp_path / "prompts.txt"
    file.write_text("a red fox\n\n  a blue bird  \n")
    assert read_prompts(str(file)) == ["a red fox", "a blue bird"]
    with pytest.raises(ValueError, match=f"--prompts {tmp_path / 'missing.txt'}"):
        read_prompts(str(tmp_path / "missing.txt"))
    (tmp_path / "empty.txt").write_text("\n \n")
    with pytest.raises(ValueError, match="no prompts in the file"):
        read_prompts(str(tmp_path / "empty.txt"))


def test_contact_sheet_puts_each_image_under_its_column_with_its_caption():
    rng = np.random.default_rng(0)
    images = [[rng.integers(0, 256, (24, 40, 3), dtype=np.uint8) for _ in range(3)] for _ in range(2)]
    captions = [[f"SSIM 0.9{r}{c} | PSNR 3{c}.0" for c in range(3)] for r in range(2)]
    sheet = contact_sheet(images, ["a red fox in the snow", "a cat"], ["bf16", "fp8_e4m3", "mxfp4_e2m1"], captions,
                          label_width=100)
    header, caption = 28, 30  # the labels' two lines; the caption's two
    assert sheet.size == (100 + 3 * 40, header + 2 * (24 + caption))
    pixels = np.asarray(sheet)
    for r in range(2):
        top = header + r * (24 + caption)
        for c in range(3):
            np.testing.assert_array_equal(pixels[top:top + 24, 100 + c * 40:100 + (c + 1) * 40], images[r][c])
            assert (pixels[top + 24:top + 24 + caption, 100 + c * 40:100 + (c + 1) * 40] < 128).any()  # caption
        assert (pixels[top:top + 24, :100] < 128).any()  # the prompt in the margin
    assert (pixels[:header, 100:] < 128).any()  # the column labels
    with pytest.raises(ValueError, match=r"image \(1, 2\) is \(8, 40\)"):
        contact_sheet([images[0], images[1][:2] + [images[1][2][:8]]], ["a", "b"], ["x", "y", "z"])


def test_each_image_takes_the_seeds_apart_prompt_by_prompt():
    from mxdit.model.quality import each_image

    images = np.arange(2 * 3 * 4 * 5 * 3, dtype=np.uint8).reshape(2 * 3, 4, 5, 3)  # prompt-major, 3 seeds
    side_by_side = images.reshape(2, 3, 4, 5, 3).swapaxes(1, 2).reshape(2, 4, 3 * 5, 3)
    np.testing.assert_array_equal(side_by_side[1, :, 5:10], images[4])  # the second prompt's second seed
    np.testing.assert_array_equal(each_image(side_by_side, 5), images)


@pytest.mark.slow  # a demo run per format
def test_demo_run_writes_the_table_the_json_and_the_sheet(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("eval_quality",
                                                  Path(__file__).parent.parent / "scripts" / "eval_quality.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red fox in the snow\na lighthouse at night\n")
    sheet, table = tmp_path / "sheet.png", tmp_path / "table.json"
    code = script.main(["--demo", "--formats", "fp8_e4m3", "mxfp4_e2m1", "--prompts", str(prompts), "--size", "32",
                        "--steps", "1", "--clip", str(FIXTURES / "clip" / "tiny"), "--sheet", str(sheet),
                        "--json", str(table)])
    out = capsys.readouterr().out
    assert code == 0 and "RANDOM weights" in out and "mxfp4_e2m1" in out and "CLIP" in out
    rows = json.loads(table.read_text())
    assert [r["format"] for r in rows] == ["reference", "fp8_e4m3", "mxfp4_e2m1"]
    assert all(0 < r["ssim"] <= 1 and isinstance(r["passed"], bool) for r in rows[1:])
    assert all(0 <= r["clip_score"] <= 100 for r in rows)
    with Image.open(sheet) as image:  # a title line, the labels, two rows of images with three caption lines
        assert image.size == (220 + 3 * 32, 16 + 28 + 2 * (32 + 3 * 12 + 6))
    with pytest.raises(SystemExit):
        script.main(["--demo", "--prompts", str(tmp_path / "missing.txt")])
    assert "missing.txt" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        script.main(["--demo", "--lora", f"{tmp_path / 'style.safetensors'}:0.8"])
    assert f"--lora {tmp_path / 'style.safetensors'}: no such file" in capsys.readouterr().err


def test_each_formats_row_finds_the_transformers_weights_on_the_device_once(monkeypatch):
    """While the formats' rows run, the unquantized weights wait on the host (a full-size model's weights fit the
    device once, not twice): each row's variant is made when the row starts, the inference path's a weight at a time
    (measured as its first weight is quantized), and the pipeline has the weights back at the end, the same values."""
    import gc

    import jax

    from mxdit.model.inference import InferenceOptions, build_pipeline
    from mxdit.model.loading import iter_params
    from mxdit.model.quality import quality_table
    from mxdit.quant import model as quant_model

    pipe = build_pipeline(None, InferenceOptions(dtype="float32", stack=False))
    before = {key: np.array(value) for key, value in iter_params(pipe.transformer)}
    live = {}  # row name -> the most bytes that jax arrays held at its progress reports

    def measure(line):
        gc.collect()
        row = line.split(":")[0]
        live[row] = max(live.get(row, 0), sum(a.nbytes for a in jax.live_arrays()))

    quantized_weight = quant_model._quantized_weight

    def measured_quantized_weight(weight, fmt, kernels):
        if "GEMM build" not in live:  # the first weight's: all of them would wait on a collection each
            measure("GEMM build:")
        return quantized_weight(weight, fmt, kernels)

    monkeypatch.setattr(quant_model, "_quantized_weight", measured_quantized_weight)
    quality_table(pipe, ["fp8_e4m3"], ["a red fox"], [0], height=32, width=32, steps=1, max_sequence_length=16,
                  kernels=True, progress=measure)
    assert live.keys() == {"reference", "fp8_e4m3", "GEMM build", "fp8_e4m3 GEMM"}
    transformer = sum(v.nbytes for v in before.values())
    assert all(live[row] - live["reference"] < transformer / 2 for row in live), (live, transformer)
    after = dict(iter_params(pipe.transformer))
    assert after.keys() == before.keys()
    for key, value in after.items():
        assert isinstance(value, jax.Array), key
        np.testing.assert_array_equal(np.asarray(value), before[key])


def test_a_reference_file_is_written_then_read_and_refused_for_other_settings_or_weights(tmp_path):
    """--reference: the first table writes the unquantized images there before the formats' rows (and hands each
    row over as it is finished, as --json is written); a later one reads them and makes none, with the same
    figures; a file made with other settings or weights, or not one at all, is refused, naming the file and what
    differs, and left as it was."""
    from mxdit.model.inference import InferenceOptions, build_pipeline
    from mxdit.model.loading import iter_params
    from mxdit.model.quality import ReferenceFileError, quality_table
    from mxdit.quant.model import set_params

    pipe = build_pipeline(None, InferenceOptions(dtype="float32", stack=False))
    file = tmp_path / "reference.npz"
    lines, finished = [], []

    def table(**overrides):
        lines.clear()
        settings = dict(height=32, width=32, steps=1, max_sequence_length=16, reference_file=file,
                        progress=lines.append, row_done=lambda rows: finished.append([r.fmt for r in rows]))
        return quality_table(pipe, ["fp8_e4m3"], ["a red fox"], [0], **{**settings, **overrides})

    made = table()
    assert file.exists() and f"reference: written to {file}" in lines
    assert finished == [["reference"], ["reference", "fp8_e4m3"]]  # told of each row as it is finished
    read = table()
    assert not any(line.startswith("reference: seed") for line in lines)  # no reference image made
    assert f"reference: read from {file} (made in {made[0].seconds:.1f} s)" in lines[0]
    np.testing.assert_array_equal(read[0].images, made[0].images)
    np.testing.assert_array_equal(read[1].images, made[1].images)
    np.testing.assert_array_equal(read[1].step_cosines, made[1].step_cosines)
    assert read[1].report == made[1].report
    written = file.read_bytes()
    with pytest.raises(ReferenceFileError, match=rf"--reference {file}: made with steps 1 \(this run: 2\)"):
        table(steps=2)
    with pytest.raises(ReferenceFileError, match="made with other prompts"):
        quality_table(pipe, ["fp8_e4m3"], ["a blue bird"], [0], height=32, width=32, steps=1, max_sequence_length=16,
                      reference_file=file)
    key, value = max(iter_params(pipe.transformer), key=lambda item: item[1].size)  # one row of one tensor
    set_params(pipe.transformer, {key: value.at[value.shape[0] // 2].add(1e-3)})
    with pytest.raises(ReferenceFileError, match="made with other weights"):
        table()
    assert file.read_bytes() == written
    (tmp_path / "other.npz").write_text("not an npz")
    with pytest.raises(ReferenceFileError, match=f"--reference {tmp_path / 'other.npz'}: not one that eval_quality"):
        table(reference_file=tmp_path / "other.npz")


@pytest.mark.slow  # the tiny FLUX.1 pipeline per row
def test_the_table_takes_flux_pipelines(tmp_path):
    """FLUX.1's table as Krea 2's: its own quantization rules, its transformer's call for the output check, its
    stacked projections in the inference-path row, its embedded guidance."""
    import jax.numpy as jnp

    from mxdit.model.inference import InferenceOptions, build_pipeline
    from mxdit.model.quality import format_table, quality_table

    pipe = build_pipeline(FIXTURES / "flux" / "tiny_pipeline", InferenceOptions(dtype="float32", stack=False))
    rows = quality_table(pipe, ["fp8_e4m3", "mxfp4_e2m1"], ["a red fox"], [0], height=32, width=48, steps=2,
                         max_sequence_length=16, guidance=3.5, kernels=True)
    assert [r.fmt for r in rows] == ["reference", "fp8_e4m3", "fp8_e4m3 GEMM", "mxfp4_e2m1", "mxfp4_e2m1 GEMM"]
    fp8, fp8_gemm, fp4, fp4_gemm = (r.report for r in rows[1:])
    assert 0.9 < fp4.cosine < fp8.cosine < 1.0 and fp8.nonfinite == fp4_gemm.nonfinite == 0
    assert rows[0].images.shape == (1, 32, 48, 3) and rows[3].weight_bytes < rows[1].weight_bytes < rows[0].weight_bytes
    assert "mxfp4_e2m1 GEMM" in format_table(rows) and jnp.isfinite(fp8_gemm.cosine)


@pytest.mark.slow  # the tiny Krea 2 pipeline at three batch sizes
def test_the_table_steps_through_the_denoising_and_takes_fused_loras():
    """Per step, the cosine of the transformer's output with the reference's: the first step starts from the same
    noise, so its cosine is the transformer's own on that input. The images do not depend on the prompts per call
    (but for the float rounding of another batch shape: a level of 255). A LoRA fused into the reference is in
    every format's weights, as generate.py --fuse-lora runs it."""
    import jax.numpy as jnp

    from mxdit.model.inference import InferenceOptions, build_pipeline
    from mxdit.model.pipeline_common import initial_noise
    from mxdit.model.quality import format_table, quality_table, table_json

    folder, prompts = FIXTURES / "krea2" / "tiny_pipeline", ["a red fox", "a blue bird", "a green frog"]
    pipe = build_pipeline(folder, InferenceOptions(dtype="float32", stack=False))
    settings = dict(height=32, width=32, steps=3, max_sequence_length=16)
    rows = quality_table(pipe, ["mxfp4_e2m1"], prompts, [0, 5], batch_size=2, **settings)
    again = quality_table(pipe, ["mxfp4_e2m1"], prompts, [0, 5], batch_size=3, **settings)
    for row, same in zip(rows, again):
        assert np.abs(row.images.astype(int) - same.images).max() <= 1
    # SSIM: the mean of each image's against the reference's (no window spans two seeds' images); PSNR: of all the
    # pixels together
    metrics = pytest.importorskip("skimage.metrics")
    tiles = [[row.images[p, :, s * 32:(s + 1) * 32].astype(np.float64) for row in rows] for p in range(3)
             for s in range(2)]
    expected = [metrics.structural_similarity(*pair, data_range=255, channel_axis=-1, gaussian_weights=True,
                                              sigma=1.5, use_sample_covariance=False) for pair in tiles]
    assert rows[1].report.ssim == pytest.approx(np.mean(expected), abs=1e-9)
    assert rows[1].report.psnr == pytest.approx(
        metrics.peak_signal_noise_ratio(rows[0].images, rows[1].images, data_range=255), abs=1e-9)
    cosines = rows[1].step_cosines
    assert cosines.shape == (3,) and np.all((0.5 < cosines) & (cosines < 1.0))
    assert table_json(rows)[1]["step_cosines"] == list(cosines) and f"{cosines.min():10.6f}" in format_table(rows)

    # the first step by hand: one transformer call of each on the first prompt's noise
    quantized = quality_table(pipe, ["mxfp4_e2m1"], prompts[:1], [0], **settings)[1]
    noise = initial_noise([0], 1, 2, 2, pipe.transformer.config.in_channels)
    changes = []
    for transformer in (pipe.transformer, _quantized_transformer(pipe, "mxfp4_e2m1")):
        p = __import__("copy").copy(pipe)
        p.transformer = transformer
        trail = [np.asarray(noise)]
        p(prompts[:1], latents=noise, output_type="latent", callback=lambda i, t, x: trail.append(np.asarray(x)),
          **{k: v for k, v in settings.items() if k != "steps"}, num_inference_steps=3)
        changes.append((trail[1] - trail[0]).ravel().astype(np.float64))
    a, b = changes
    np.testing.assert_allclose(quantized.step_cosines[0], a @ b / np.linalg.norm(a) / np.linalg.norm(b), rtol=1e-12)

    fused = build_pipeline(folder, InferenceOptions(dtype="float32", stack=False, fuse_loras=True,
                                                    loras=((FIXTURES / "krea2" / "lora" / "kohya.safetensors", 1.0),)))
    with_lora = quality_table(fused, ["mxfp4_e2m1"], prompts[:1], [0], **settings)
    assert np.abs(with_lora[0].images.astype(float) - rows[0].images[:1, :, :32]).mean() > 1.0  # the LoRA is in
    assert jnp.isfinite(with_lora[1].step_cosines).all()


def _quantized_transformer(pipe, fmt):
    from mxdit.model.loading import iter_params
    from mxdit.quant.model import fake_quantize_model, krea2_rules, with_params

    params = dict(iter_params(pipe.transformer))
    weights = fake_quantize_model(params, krea2_rules(fmt), pipe.transformer.dtype)
    return with_params(pipe.transformer, weights)
