"""Many images from one script: model/requests.py's requests and batches, and generate.py --prompts (bad lines named by
number, the others written, nothing overwritten, an image the same in a batch as alone)."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import FIXTURES
from mxdit.model.requests import GenerationRequest, group_batches, parse_request, read_requests

spec = importlib.util.spec_from_file_location("generate", Path(__file__).parent.parent / "scripts" / "generate.py")
generate = importlib.util.module_from_spec(spec)
spec.loader.exec_module(generate)

TINY = ["--model", str(FIXTURES / "krea2" / "tiny_pipeline"), "--dtype", "fp32", "--max-sequence-length", "16",
        "--steps", "1", "--height", "64", "--width", "64", "--compile-cache", ""]


@pytest.mark.parametrize("fields, message", [
    ({}, "prompt: a non-empty string is required"),
    ({"prompt": "  "}, "prompt: a non-empty string is required"),
    ({"prompt": "a", "size": 3}, "unknown field 'size'"),
    ({"prompt": "a", "height": 100}, "height: 100 is not a multiple of 16"),
    ({"prompt": "a", "width": 8192}, "width: 8192 must be an integer between 64 and 4096"),
    ({"prompt": "a", "seed": -1}, "seed: -1 must be an integer"),
    ({"prompt": "a", "seed": 1.5}, "seed: 1.5 must be an integer"),
    ({"prompt": "a", "seed": 2**32}, "seed: 4294967296 must be an integer between 0 and 4294967295"),
    ({"prompt": "a", "steps": True}, "steps: True must be an integer"),
    ({"prompt": "a", "guidance": -2}, "guidance: -2 must be a number >= 0"),
    ({"prompt": "a", "loras": ["style"]}, "loras: must be an object of LoRA names and weights"),
    ({"prompt": "a", "loras": {"style": "high"}}, "loras: the weight of 'style' must be a number"),
    ({"prompt": "a", "output": "x.jpg"}, "output: 'x.jpg' must be a file name ending in .png"),
    ({"prompt": "a", "output": "../x.png"}, "output: '../x.png' must be a relative name inside the output folder"),
    ({"prompt": "a", "output": "/tmp/x.png"}, "must be a relative name"),
])
def test_bad_request_fields_raise_one_line_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=None) as error:
        parse_request(fields)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_prompts_files_give_requests_by_line_and_batches_by_shape(tmp_path):
    defaults = GenerationRequest(prompt="", seed=7, height=64, width=64)
    text = tmp_path / "prompts.txt"
    text.write_text("a red fox\n\n  a cat  \n")
    requests, errors = read_requests(text, defaults)
    assert errors == [] and [(n, r.prompt, r.seed) for n, r in requests] == [(1, "a red fox", 7), (3, "a cat", 7)]
    lines = tmp_path / "prompts.jsonl"
    lines.write_text("\n".join([json.dumps({"prompt": "a", "height": 128}), "{oops", json.dumps({"prompt": "b"}),
                                json.dumps({"prompt": "c", "height": 128, "loras": {"s": 0.5}}),
                                json.dumps({"prompt": "d", "height": 128})]))
    requests, errors = read_requests(lines, defaults)
    assert [n for n, _ in requests] == [1, 3, 4, 5] and errors[0][0] == 2 and errors[0][1].startswith("not JSON")
    batches = list(group_batches([r for _, r in requests], 4))
    assert [[r.prompt for r in b] for b in batches] == [["a", "d"], ["b"], ["c"]]
    assert [[r.prompt for r in b] for b in group_batches([r for _, r in requests], 1)] == [["a"], ["d"], ["b"], ["c"]]


def test_prompts_file_runs_the_good_lines_in_batches_and_names_the_bad_ones(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join([
        json.dumps({"prompt": "a red fox", "seed": 3}),
        "not json",
        json.dumps({"prompt": "a cat", "seed": 1}),
        json.dumps({"prompt": "a dog", "seed": 3, "output": "dog.png"}),
        json.dumps({"prompt": "a bird", "loras": {"style": 1.0}}),
        json.dumps({"prompt": "kept", "output": "kept.png"}),
        json.dumps({"prompt": "a cat", "seed": 1, "height": 96}),
    ]) + "\n")
    kept = tmp_path / "kept.png"
    kept.write_bytes(b"the user's file")
    code = generate.main(TINY + ["--prompts", str(prompts), "--batch-size", "2", "--output", str(tmp_path / "img.png")])
    captured = capsys.readouterr()
    assert code == 1
    for line, message in [(2, "not JSON"), (5, "loras: 'style' is not a --lora file's name"),
                          (6, f"output {kept} already exists")]:
        assert f"line {line}: {message}" in captured.err
    assert "3 lines failed: 2, 5, 6" in captured.err and "wrote 4 images" in captured.out
    assert kept.read_bytes() == b"the user's file"
    written = {p.name for p in tmp_path.glob("*.png")}
    assert written == {"img_1.png", "img_3.png", "dog.png", "img_7.png", "kept.png"}
    with Image.open(tmp_path / "img_7.png") as image:
        assert image.size == (64, 96)

    # Line 3 ran in a batch of two (with line 1): its image is the one a run of that prompt and seed alone makes.
    alone = tmp_path / "alone.png"
    assert generate.main(TINY + ["--prompt", "a cat", "--seed", "1", "--output", str(alone)]) == 0
    with Image.open(alone) as a, Image.open(tmp_path / "img_3.png") as b:
        assert np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max() <= 1.0  # PNG rounding at most
    with Image.open(tmp_path / "img_1.png") as a, Image.open(tmp_path / "dog.png") as b:  # same seed, other prompt
        assert np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).mean() > 0.5


def test_prompts_arguments_exit_with_one_line(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    for argv, message in [
        (["--prompts", str(tmp_path / "missing.txt")], "no such file"),
        (["--prompts", str(empty)], "no prompts in the file"),
        (["--prompts", str(empty), "--prompt", "a"], "not allowed with argument"),
        (["--prompts", str(empty), "--num-images", "2"], "--num-images with --prompts"),
        (["--prompt", "a", "--batch-size", "0"], "--batch-size 0: must be >= 1"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            generate.parse_args(TINY + argv + ["--output", str(tmp_path / "o.png")])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and message in err and err.count("\n") == 1, err


def test_prompts_with_fused_loras_run_lines_that_name_none(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "a cat"}) + "\n" + json.dumps({"prompt": "a dog", "loras": {"kohya": 1}}))
    lora = FIXTURES / "krea2" / "lora" / "kohya.safetensors"
    code = generate.main(TINY + ["--prompts", str(prompts), "--lora", f"{lora}:0.5", "--fuse-lora",
                                 "--output", str(tmp_path / "img.png")])
    captured = capsys.readouterr()
    assert code == 1 and (tmp_path / "img_1.png").is_file() and not (tmp_path / "img_2.png").exists()
    assert "line 2: loras: the --lora files are fused" in captured.err
