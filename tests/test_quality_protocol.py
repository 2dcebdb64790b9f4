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
