"""scripts/generate.py: the built-in demo writes a PNG of the asked size; bad arguments exit non-zero with one line."""

import importlib.util
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import FIXTURES

spec = importlib.util.spec_from_file_location("generate", Path(__file__).parent.parent / "scripts" / "generate.py")
generate = importlib.util.module_from_spec(spec)
spec.loader.exec_module(generate)


def run(argv, capsys):
    try:
        code = generate.main(argv)
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr()


def stage_table(out: str) -> dict[str, float]:
    """generate.py's stage table: stage -> seconds."""
    lines = out[out.index("stage "):].splitlines()[1:]
    return {line[:14].strip(): float(line[14:]) for line in lines if line[:1].strip() and line[14:].strip()
            and not line.startswith(("compilation", "executables"))}


def test_demo_writes_a_png_of_the_asked_size(tmp_path, capsys, monkeypatch):
    out, temporary = tmp_path / "demo.png", tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))  # where the demo's tokenizer folder goes
    code, captured = run(["--demo", "--prompt", "a red fox", "--height", "64", "--width", "96", "--steps", "2",
                          "--output", str(out)], capsys)
    assert code == 0, captured.err
    with Image.open(out) as image:
        assert image.format == "PNG" and image.size == (96, 64) and image.mode == "RGB"
    assert "RANDOM weights" in captured.out
    assert not any(temporary.iterdir())  # the demo tokenizer's folder is removed once read
    # every stage from the start to the PNG written, and the total is their sum: the wall time of the run
    stages = stage_table(captured.out)
    # the demo's weights are made, not read: its programs are compiled ahead after they are
    assert list(stages) == ["start-up", "load", "compile ahead", "text encode", "denoise", "decode", "other", "write",
                            "total"]
    assert min(stages.values()) >= 0 and stages["total"] >= stages["load"]
    assert abs(sum(stages.values()) - 2 * stages["total"]) < 0.01  # 3 decimals each: the rounding
    assert captured.out.strip().splitlines()[-1].startswith("compilation: ")
    # --progress: a bar per step (the steps stepped from the host), the same image
    code, captured = run(["--demo", "--prompt", "a red fox", "--height", "64", "--width", "96", "--steps", "2",
                          "--progress", "--output", str(tmp_path / "p.png")], capsys)
    assert code == 0, captured.err
    assert "2/2" in captured.err
    np.testing.assert_allclose(np.asarray(Image.open(tmp_path / "p.png"), np.int16),
                               np.asarray(Image.open(out), np.int16), rtol=0, atol=1)


def test_model_folder_generates_several_images(tmp_path, capsys):
    out = tmp_path / "x.png"
    code, captured = run(["--model", str(FIXTURES / "krea2" / "tiny_pipeline"), "--prompt", "a cat", "--num-images", "2",
                          "--height", "32", "--width", "32", "--steps", "1", "--dtype", "fp32",
                          "--max-sequence-length", "16", "--output", str(out)], capsys)
    assert code == 2 and "--height 32: must be a multiple of 16 between 64 and 4096" in captured.err
    code, captured = run(["--model", str(FIXTURES / "krea2" / "tiny_pipeline"), "--prompt", "a cat", "--num-images", "2",
                          "--height", "64", "--width", "64", "--steps", "1", "--dtype", "fp32",
                          "--max-sequence-length", "16", "--output", str(out)], capsys)
    assert code == 0, captured.err
    assert (tmp_path / "x_0.png").is_file() and (tmp_path / "x_1.png").is_file()


def test_flux_folder_is_recognised_from_its_model_index(tmp_path, capsys):
    out = tmp_path / "flux.png"
    code, captured = run(["--model", str(FIXTURES / "flux" / "tiny_pipeline"), "--prompt", "a red fox", "--height", "64",
                          "--width", "80", "--steps", "2", "--dtype", "fp32", "--max-sequence-length", "16",
                          "--output", str(out)], capsys)
    assert code == 0, captured.err
    with Image.open(out) as image:
        assert image.size == (80, 64)


@pytest.mark.parametrize("argv, message", [
    (["--demo", "--prompt", "x", "--height", "100"], "--height 100: must be a multiple of 16"),
    (["--demo", "--prompt", "x", "--width", "8192"], "--width 8192: must be a multiple of 16 between 64 and 4096"),
    (["--model", "/nonexistent/krea2", "--prompt", "x"], "--model /nonexistent/krea2: no such folder"),
    (["--demo", "--prompt", "x", "--output", "out.jpg"], "--output out.jpg: must end in .png"),
    (["--demo", "--prompt", "x", "--steps", "0"], "--steps 0: must be between 1 and 1000"),
    (["--demo", "--prompt", "x", "--offload", "1", "--prefetch", "0"], "--prefetch 0: must be >= 1"),
])
def test_bad_arguments_exit_with_one_line(tmp_path, capsys, argv, message):
    code, captured = run(argv, capsys)
    assert code == 2
    assert captured.err.strip().count("\n") == 0 and message in captured.err


def test_folder_missing_a_component_exits_with_its_name(tmp_path, capsys):
    folder = tmp_path / "krea2"
    shutil.copytree(FIXTURES / "krea2" / "tiny_pipeline", folder)
    shutil.rmtree(folder / "text_encoder")
    code, captured = run(["--model", str(folder), "--prompt", "x", "--output", str(tmp_path / "o.png")], capsys)
    assert code == 2 and captured.err.strip().count("\n") == 0
    assert "missing component folder(s) text_encoder/" in captured.err


def test_folder_of_pytorch_pickles_exits_naming_the_file(tmp_path, capsys):
    """A component folder holding only PyTorch pickles: one line saying that pickles are not read, naming the file,
    before any of them is opened."""
    folder, component, weights = tmp_path / "krea2", "transformer", "diffusion_pytorch_model.bin"
    shutil.copytree(FIXTURES / "krea2" / "tiny_pipeline", folder)
    (folder / component / "diffusion_pytorch_model.safetensors").rename(folder / component / weights)
    code, captured = run(["--model", str(folder), "--prompt", "x", "--output", str(tmp_path / "o.png")], capsys)
    assert code == 2 and captured.err.strip().count("\n") == 0, captured.err
    assert f"{folder / component / weights}: a PyTorch pickle; mxdit reads safetensors only" in captured.err


def test_pytorch_pickles_are_refused_by_name_wherever_weights_are_read(tmp_path):
    from mxdit.model.loading import CheckpointError, open_checkpoint
    from mxdit.model.lora_files import LoraFileError, read_lora

    pickle = tmp_path / "model.pt"
    pickle.write_bytes(b"\x80\x02not read")
    with pytest.raises(CheckpointError, match=r"model\.pt: a PyTorch pickle; mxdit reads safetensors only"):
        open_checkpoint(pickle, "diffusion_pytorch_model")  # a single file given directly
    sharded = tmp_path / "text_encoder"  # transformers' sharded pickles
    sharded.mkdir()
    for name in ("pytorch_model.bin.index.json", "pytorch_model-00002-of-00002.bin", "pytorch_model-00001-of-00002.bin"):
        (sharded / name).write_bytes(b"{}")
    with pytest.raises(CheckpointError, match=r"text_encoder/pytorch_model-00001-of-00002\.bin: a PyTorch pickle"):
        open_checkpoint(sharded, "model")
    peft = tmp_path / "peft"
    peft.mkdir()
    (peft / "adapter_model.bin").write_bytes(b"\x80\x02not read")
    with pytest.raises(LoraFileError, match=r"adapter_model\.bin: a PyTorch pickle"):
        read_lora(peft, None)  # the file is refused before the model is looked at
    (peft / "adapter_model.bin").unlink()
    with pytest.raises(LoraFileError, match=r"adapter_model\.safetensors: file not found"):
        read_lora(peft, None)


def test_outputs_get_the_users_umask_and_replaced_files_keep_their_mode(tmp_path):
    """PNGs, safetensors (LoRA files, quantized checkpoints) and the training run's JSON get the mode a plain open()
    gives under the umask (safetensors itself writes 0o600); a file replaced keeps its own mode."""
    import os
    import stat

    from mxdit.model.loading import save_safetensors
    from mxdit.quant.formats import quantize
    from mxdit.quant.model import load_quantized, save_quantized
    from mxdit.training.train import _write_json

    def mode(path):
        return stat.S_IMODE(path.stat().st_mode)

    writers = {
        "a.png": lambda path: generate.save_png(Image.new("RGB", (4, 4)), path),
        "b.safetensors": lambda path: save_safetensors({"w": np.ones((2, 2), np.float32)}, path),
        "c.safetensors": lambda path: save_quantized({"w": quantize(np.ones((2, 32), np.float32), "mxfp8_e4m3")}, path),
        "d.json": lambda path: _write_json(path, {"step": 1}),
    }
    previous = os.umask(0o027)
    try:
        for name, write in writers.items():
            write(tmp_path / name)
            assert mode(tmp_path / name) == 0o640, name
            (tmp_path / name).chmod(0o604)
            write(tmp_path / name)  # replaced atomically: the file's own mode stays
            assert mode(tmp_path / name) == 0o604, name
    finally:
        os.umask(previous)
    assert set(os.listdir(tmp_path)) == set(writers)  # no temporary files left
    assert load_quantized(tmp_path / "c.safetensors", on_host=True)["w"].fmt == "mxfp8_e4m3"


def test_existing_output_is_not_overwritten(tmp_path, capsys):
    out = tmp_path / "keep.png"
    out.write_bytes(b"precious")
    code, captured = run(["--demo", "--prompt", "x", "--output", str(out)], capsys)
    assert code == 2 and "already exists (pass --overwrite to replace)" in captured.err
    assert out.read_bytes() == b"precious"


def test_loras_apply_at_run_time_and_fused(tmp_path, capsys):
    lora = FIXTURES / "krea2" / "lora"
    common = ["--model", str(FIXTURES / "krea2" / "tiny_pipeline"), "--prompt", "a cat", "--height", "64", "--width",
              "64", "--steps", "1", "--dtype", "fp32", "--max-sequence-length", "16"]
    images = []
    for i, extra in enumerate([[], ["--lora", f"{lora / 'kohya.safetensors'}:0.5", "--lora", str(lora / "comfyui.safetensors")],
                               ["--lora", f"{lora / 'diffusers.safetensors'}:1.5", "--fuse-lora"]]):
        out = tmp_path / f"{i}.png"
        code, captured = run(common + extra + ["--output", str(out)], capsys)
        assert code == 0, captured.err
        with Image.open(out) as image:
            images.append(np.asarray(image, np.float32))
    assert np.abs(images[1] - images[0]).mean() > 1.0  # the LoRAs change the picture...
    assert np.abs(images[1] - images[2]).mean() < 1.0  # ...and 0.5 + 1.0 at run time is 1.5 fused (up to PNG rounding)


@pytest.mark.parametrize("spec, message", [
    ("/nonexistent/x.safetensors:0.8", "--lora /nonexistent/x.safetensors: no such file"),
    (f"{FIXTURES / 'krea2' / 'lora' / 'kohya.safetensors'}:abc", "kohya.safetensors:abc: weight 'abc' is not a finite "
                                                                  "number (FILE[:WEIGHT], e.g. "),
    (str(FIXTURES / "krea2" / "lora" / "kohya.safetensors"), "kohya.safetensors: lora_unet_"),
])
def test_bad_lora_exits_with_one_line_naming_the_file(tmp_path, capsys, spec, message):
    code, captured = run(["--demo", "--prompt", "x", "--height", "64", "--width", "64", "--steps", "1", "--lora", spec,
                          "--output", str(tmp_path / "o.png")], capsys)
    assert code == 2 and captured.err.strip().count("\n") == 0 and message in captured.err, captured.err


def test_precision_runs_the_gemm_path_and_the_compile_cache_fills(tmp_path, capsys):
    """--precision int8 quantizes the blocks' matrices for the GEMM kernels (their jnp reference on the CPU) and still
    writes the image (fp8 on the demo: test_inference.py's run of generate.py); --compile-cache leaves compiled
    programs for the next run; --mesh refuses a quantized run."""
    cache, out = tmp_path / "cache", tmp_path / "q.png"
    code, captured = run(["--model", str(FIXTURES / "krea2" / "tiny_pipeline"), "--prompt", "a cat", "--height", "64",
                          "--width", "64", "--steps", "1", "--dtype", "fp32", "--max-sequence-length", "16",
                          "--precision", "int8", "--compile-cache", str(cache), "--output", str(out)], capsys)
    assert code == 0, captured.err  # a model folder: quantized as the checkpoint is read
    assert out.is_file() and any(cache.iterdir())
    code, captured = run(["--demo", "--prompt", "a red fox", "--precision", "mxfp4", "--mesh", "data=1",
                          "--output", str(tmp_path / "m.png")], capsys)
    assert code == 2 and "--precision mxfp4 with --mesh" in captured.err


@pytest.mark.slow
def test_quantized_checkpoint_from_quantize_py_generates_as_precision_does(tmp_path, capsys):
    """scripts/quantize.py's file read with --quantized: the same image as --precision fp8 quantizing the folder's
    bf16 transformer as it loads (the same quantization of the same weights); misuse exits with one line."""
    qspec = importlib.util.spec_from_file_location("quantize", Path(__file__).parent.parent / "scripts" / "quantize.py")
    quantize = importlib.util.module_from_spec(qspec)
    qspec.loader.exec_module(quantize)
    folder, qfile = FIXTURES / "krea2" / "tiny_pipeline", tmp_path / "transformer_fp8.safetensors"
    assert quantize.main(["--model", str(folder / "transformer"), "--format", "fp8_e4m3", "--output", str(qfile)]) == 0
    common = ["--model", str(folder), "--prompt", "a cat", "--height", "64", "--width", "64", "--steps", "2",
              "--max-sequence-length", "16"]
    code, captured = run(common + ["--quantized", str(qfile), "--output", str(tmp_path / "q.png")], capsys)
    assert code == 0, captured.err
    code, captured = run(common + ["--precision", "fp8", "--output", str(tmp_path / "p.png")], capsys)
    assert code == 0, captured.err
    np.testing.assert_array_equal(np.asarray(Image.open(tmp_path / "q.png")), np.asarray(Image.open(tmp_path / "p.png")))
    # with weight streaming: the file's kernel weights of the blocks after the first go to host memory as they are
    # read; the same image (float32, as in the offload test below)
    for extra, name in (([], "qf.png"), (["--offload", "1"], "qo.png")):
        code, captured = run(common + ["--quantized", str(qfile), "--dtype", "fp32", *extra, "--output",
                                       str(tmp_path / name)], capsys)
        assert code == 0, captured.err
    np.testing.assert_array_equal(np.asarray(Image.open(tmp_path / "qo.png")), np.asarray(Image.open(tmp_path / "qf.png")))
    for extra, message in ((["--precision", "mxfp4"], "--quantized with --precision"),
                           (["--mesh", "data=1"], "--quantized with --mesh")):
        code, captured = run(common + ["--quantized", str(qfile), *extra, "--output", str(tmp_path / "x.png")], capsys)
        assert code == 2 and message in captured.err
    code, captured = run(common + ["--quantized", str(tmp_path / "none.safetensors"), "--output",
                                   str(tmp_path / "y.png")], capsys)
    assert code == 2 and "none.safetensors: no such file" in captured.err


@pytest.mark.slow  # ~35 s on 2 cores; tests/test_offload.py checks the streaming itself by default
def test_offload_streams_blocks(tmp_path, capsys):
    out = tmp_path / "o.png"
    code, captured = run(["--model", str(FIXTURES / "krea2" / "tiny_pipeline"), "--prompt", "a cat", "--height", "64",
                          "--width", "64", "--steps", "1", "--dtype", "fp32", "--max-sequence-length", "16",
                          "--offload", "1", "--output", str(out)], capsys)
    assert code == 0, captured.err
    assert out.is_file()
    # quantized as read, then the streamed blocks' kernel weights to host memory: the image of --precision alone
    # (float32: in bf16 the per-block programs round x where one whole program may keep float32, and the tiny random
    # model amplifies such differences)
    common = ["--model", str(FIXTURES / "krea2" / "tiny_pipeline"), "--prompt", "a cat", "--height", "64", "--width",
              "64", "--steps", "2", "--max-sequence-length", "16", "--precision", "fp8", "--dtype", "fp32"]
    code, captured = run(common + ["--offload", "1", "--prefetch", "1", "--output", str(tmp_path / "so.png")], capsys)
    assert code == 0, captured.err
    code, captured = run(common + ["--output", str(tmp_path / "s.png")], capsys)
    assert code == 0, captured.err
    assert_same_image_up_to_rounding(tmp_path / "so.png", tmp_path / "s.png")
    # FLUX.1: the last single block streamed (the 2 double and the first single resident), the same image
    flux = ["--model", str(FIXTURES / "flux" / "tiny_pipeline"), "--prompt", "a red fox", "--height", "64", "--width",
            "80", "--steps", "2", "--dtype", "fp32", "--max-sequence-length", "16"]
    for extra, name in ((["--offload", "3"], "fo.png"), ([], "f.png"), (["--offload", "2", "--precision", "fp8"],
                                                                         "fo8.png"), (["--precision", "fp8"], "f8.png")):
        code, captured = run(flux + extra + ["--output", str(tmp_path / name)], capsys)
        assert code == 0, captured.err
    for pair in (("fo.png", "f.png"), ("fo8.png", "f8.png")):  # FP8: GELU and the gated residuals in the epilogues
        assert_same_image_up_to_rounding(*(tmp_path / f for f in pair))


def assert_same_image_up_to_rounding(streamed_png, resident_png):
    """Streamed blocks run as per-block programs, the resident model as one: XLA rounds them differently in the last
    float32 bits (FLUX.1's tiny transformer, streamed vs whole, on an AMD EPYC: relative L2 2.1e-7 in
    float32, 4.4e-7 with FP8 weights), and the 8-bit image (or a per-token FP8 code) flips where a value sits on a
    rounding boundary: there 1 pixel of 15360, one level apart (on the earlier machines, none). A streaming bug (a
    block skipped, run twice, or with another block's weights) changes most pixels."""
    streamed, resident = (np.asarray(Image.open(f), np.int16) for f in (streamed_png, resident_png))
    differ = streamed != resident
    assert np.abs(streamed - resident).max() <= 1 and differ.mean() <= 1e-3, (differ.sum(), differ.size)


def test_device_out_of_memory_is_one_line_with_what_would_fit(tmp_path, capsys, monkeypatch):
    """The device running out of memory (here simulated: the demo is far too small to) exits with one line naming
    the options that lower the memory; other runtime errors still raise."""
    import jax

    from mxdit.model.pipeline_krea2 import Krea2Pipeline

    def exhausted(self, *args, **kwargs):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 41.50GiB.")

    monkeypatch.setattr(Krea2Pipeline, "__call__", exhausted)
    code, captured = run(["--demo", "--prompt", "a fox", "--height", "64", "--width", "64", "--steps", "1",
                          "--output", str(tmp_path / "x.png")], capsys)
    assert code == 2
    line = captured.err.strip().splitlines()[-1]
    assert "ran out of memory while generating (RESOURCE_EXHAUSTED: Out of memory while trying to allocate 41.50GiB.)" \
        in line and "--precision fp8" in line and "--offload N" in line
    assert not (tmp_path / "x.png").exists()

    def broken(self, *args, **kwargs):
        raise jax.errors.JaxRuntimeError("INTERNAL: something else")

    monkeypatch.setattr(Krea2Pipeline, "__call__", broken)
    with pytest.raises(jax.errors.JaxRuntimeError, match="something else"):
        generate.main(["--demo", "--prompt", "a fox", "--height", "64", "--width", "64", "--steps", "1",
                       "--output", str(tmp_path / "y.png")])


def test_compile_log_tells_compiled_programs_from_those_the_persistent_cache_served(tmp_path):
    """generate.py's last line says what was compiled and what the persistent compilation cache served: the same
    program jitted twice (two functions, so that the in-memory caches do not serve the second) is compiled once,
    then read from the cache; with the cache off it is compiled each time."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.compilation_cache import compilation_cache

    from mxdit.cli import CompileLog

    def program():
        return jax.jit(lambda x: jnp.sin(x) * 3.0 + jnp.arange(7.0))

    x = np.ones(7, np.float32)  # a host array: nothing compiled to make it
    before = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
    try:
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "cache"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        compilation_cache.reset_cache()
        with CompileLog() as first:
            program()(x)
        with CompileLog() as second:
            program()(x)
    finally:
        jax.config.update("jax_compilation_cache_dir", before[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])
        compilation_cache.reset_cache()
    assert (first.compiled, first.cached, second.compiled, second.cached) == (1, 0, 0, 1)
    assert first.summary(cache_on=True).startswith("compilation: 1 program compiled (")
    assert first.summary(cache_on=True).endswith("), none read from the compile cache")
    assert second.summary(cache_on=True).startswith("compilation: none compiled, 1 program read from the compile cache")
    with CompileLog() as none:
        program()  # nothing run, nothing compiled
    assert none.summary(cache_on=False) == "compilation: none (every program was already compiled in this process)"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parent.parent / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_option_of_the_scripts_has_help():
    for name in ("generate", "quantize", "train_lora", "serve"):
        parser = load_script(name).build_parser()
        bare = [a.option_strings[0] for a in parser._actions if a.option_strings and not a.help]
        assert not bare, f"{name}.py: options without help: {bare}"


@pytest.mark.parametrize("argv, message", [
    ([], "--model and --format and --output are required (or --sizes)"),
    (["--format", "fp8_e4m3", "--output", "q.safetensors"], "--model is required (or --sizes)"),
    (["--model", "/nonexistent/transformer", "--format", "fp8_e4m3", "--output", "q.safetensors"],
     "--model /nonexistent/transformer: no such file or folder"),
    (["--model", ".", "--format", "fp9", "--output", "q.safetensors"], "argument --format: invalid choice: 'fp9'"),
    (["--model", ".", "--format", "int8", "--output", "/nonexistent/q.safetensors"],
     "--output /nonexistent/q.safetensors: folder /nonexistent does not exist"),
])
def test_quantize_bad_arguments_exit_with_one_line(capsys, argv, message):
    quantize = load_script("quantize")
    with pytest.raises(SystemExit) as exit:
        quantize.main(argv)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.startswith("quantize.py: error: ") and err.count("\n") == 1, err
    assert message in err


def test_quantize_format_choices_are_quant_formats():
    from mxdit.quant.formats import formats

    assert list(load_script("quantize").FORMAT_CHOICES) == formats()


def test_attention_and_precision_choices_are_the_models(tmp_path):
    """generate.py and benchmark.py offer the names of `ops.names` (plain Python: parsing imports no jax), each one
    the models and the quantization take: every attention kernel is one `attention_implementation` accepts, every
    precision's weight format one the GEMM kernels multiply."""
    from mxdit.ops.attention import attention_implementation
    from mxdit.ops.names import AttentionKernel, Precision
    from mxdit.pallas_kernels.gemm import WEIGHT_FORMATS

    benchmark = load_script("benchmark")
    assert sorted(benchmark.ATTENTION_CHOICES) == sorted(AttentionKernel)
    assert sorted(benchmark.PRECISION_CHOICES) == sorted(Precision)
    for option, names in (("--attention", AttentionKernel), ("--precision", Precision)):
        for name in names:
            args = generate.parse_args(["--demo", "--prompt", "a fox", option, name])
            assert getattr(args, option[2:]) == name
        with pytest.raises(SystemExit):
            generate.parse_args(["--demo", "--prompt", "a fox", option, "not-a-" + option[2:]])
    for kernel in AttentionKernel:
        assert attention_implementation(kernel.value, np.float32) == kernel
    assert Precision.BF16.weight_format is None
    assert all(p.weight_format in WEIGHT_FORMATS for p in Precision if p is not Precision.BF16)
    script = Path(generate.__file__)
    parse = (f"import sys, importlib.util; spec = importlib.util.spec_from_file_location('generate', {str(script)!r}); "
             "g = importlib.util.module_from_spec(spec); spec.loader.exec_module(g); "
             "g.parse_args(['--demo', '--prompt', 'a fox', '--precision', 'fp8', '--attention', 'int8']); "
             "assert 'jax' not in sys.modules, 'parsing imported jax'")
    subprocess.run([sys.executable, "-c", parse], check=True, cwd=tmp_path)
