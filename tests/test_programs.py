"""model/programs.py: compiled programs stored on disk are loaded by a later store (a later process) instead of traced,
under keys that change with anything that changes the program; generate.py's second start loads them all."""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import FIXTURES
from flax import nnx

from mxdit.model.programs import ProgramStore, stored_jit, use_program_store

TRACES = []


@stored_jit(static_argnames=("power",))
def _power_plus(x, y, power):
    TRACES.append(power)  # runs only while tracing
    return x**power + y


def test_a_second_store_on_the_folder_loads_the_program_instead_of_tracing_it(tmp_path):
    TRACES.clear()
    x = jnp.arange(4.0)
    with use_program_store(tmp_path) as first:
        a = _power_plus(x, 1.0, power=2)
        b = _power_plus(x, 2.0, 2)  # the same shapes: the same program (static given by position)
    assert (first.stats.compiled, len(TRACES)) == (1, 1) and len(list(tmp_path.glob("*.xla"))) == 1
    np.testing.assert_array_equal(b, a + 1)
    with use_program_store(tmp_path) as second:
        c = _power_plus(x, 1.0, power=2)
    assert (second.stats.loaded, second.stats.compiled, len(TRACES)) == (1, 0, 1)
    np.testing.assert_array_equal(c, a)
    # Inside another function's trace it is traced as jax.jit would be; outside a store it is jax.jit. Neither
    # touches the folder.
    with use_program_store(tmp_path):
        np.testing.assert_array_equal(jax.jit(lambda v: _power_plus(v, 1.0, power=2))(x), a)
    np.testing.assert_array_equal(_power_plus(x, 1.0, power=2), a)
    assert len(list(tmp_path.glob("*.xla"))) == 1


def test_what_changes_the_program_gets_its_own_key(tmp_path, monkeypatch):
    x = jnp.arange(4.0)
    with use_program_store(tmp_path):
        _power_plus(x, 1.0, power=2)
    with use_program_store(tmp_path) as store:
        _power_plus(x, 1.0, power=3)  # a static argument
        _power_plus(x[:3], 1.0, power=2)  # a shape
        _power_plus(x.astype(jnp.bfloat16), 1.0, power=2)  # a dtype
    assert (store.stats.loaded, store.stats.compiled) == (0, 3)
    # Another jax, device or source (the environment part of the key): compiled anew, not loaded.
    monkeypatch.setattr(ProgramStore, "environment", lambda self: "another jax version")
    with use_program_store(tmp_path) as store:
        _power_plus(x, 1.0, power=2)
    assert (store.stats.loaded, store.stats.compiled) == (0, 1)


def test_a_damaged_file_is_compiled_again_and_replaced(tmp_path):
    x = jnp.arange(4.0)
    with use_program_store(tmp_path):
        expected = _power_plus(x, 1.0, power=2)
    (path,) = tmp_path.glob("*.xla")
    path.write_bytes(b"not an executable")
    with use_program_store(tmp_path) as store:
        np.testing.assert_array_equal(_power_plus(x, 1.0, power=2), expected)
    assert store.stats.compiled == 1 and len(store.stats.failed_loads) == 1 and path.name in store.stats.failed_loads[0]
    with use_program_store(tmp_path) as store:
        np.testing.assert_array_equal(_power_plus(x, 1.0, power=2), expected)
    assert (store.stats.loaded, store.stats.compiled) == (1, 0)


def test_generate_second_start_loads_every_program_and_writes_the_same_image(tmp_path):
    """Two processes, as a user runs generate.py twice: the second loads the four programs the first stored. The first
    compiles them ahead on the weights' shapes (FP8 blocks, quantized as they are read) while the weights are read (a
    dry run's zeros would show in its image); the second, whose run the first recorded, only loads them, without a
    dry run (a key holding an object's address would not be met again)."""
    common = [sys.executable, str(Path(__file__).parent.parent / "scripts" / "generate.py"), "--model",
              str(FIXTURES / "krea2" / "tiny_pipeline"), "--prompt", "a cat", "--height", "64", "--width", "64",
              "--steps", "2", "--dtype", "fp32", "--max-sequence-length", "16", "--precision", "fp8",
              "--compile-cache", str(tmp_path / "cache")]
    outputs = []
    for start in ("first", "second"):
        outputs.append(tmp_path / f"{start}.png")
        proc = subprocess.run(common + ["--output", str(outputs[-1])], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert ("load and compile ahead" in proc.stdout) == (start == "first"), proc.stdout
        summary = next(line for line in proc.stdout.splitlines() if line.startswith("executables:"))
        # text encoder, the transformer's text stage, the denoising loop, the VAE decoder
        expected = "0 loaded (0.0 s), 4 compiled and stored" if start == "first" else "4 loaded"
        assert expected in summary and (start == "first" or ", 0 compiled" in summary), summary
    assert outputs[0].read_bytes() == outputs[1].read_bytes()


ON_TWO_DEVICES = """
import sys
import jax, jax.numpy as jnp
from mxdit.model.programs import stored_jit, use_program_store
f = stored_jit(lambda x: jnp.sin(x) * 2)
with use_program_store(sys.argv[1]) as store:
    y = f(jnp.arange(8.0))
    print(store.stats.loaded, store.stats.compiled, float(y.sum()))
"""


def test_a_recorded_run_is_stored_while_all_its_programs_are(tmp_path):
    x = jnp.arange(4.0)
    with use_program_store(tmp_path) as first:
        assert not first.stored_run("1024x1024")
        _power_plus(x, 1.0, power=2)
        first.note_run("1024x1024")
        assert first.stored_run("1024x1024") and not first.stored_run("768x1344")
    with use_program_store(tmp_path) as second:  # a later process
        assert second.stored_run("1024x1024")
        second.note_run("nothing served")  # records nothing
        assert not second.stored_run("nothing served")
    next(tmp_path.glob("*.xla")).unlink()
    assert not ProgramStore(tmp_path).stored_run("1024x1024")


def test_a_program_loads_onto_its_one_device_on_a_host_of_several(tmp_path):
    """A stored one-device program, loaded in a process that sees two devices, runs on its own device (loaded onto
    all of them it would expect an argument per device)."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    runs = [subprocess.run([sys.executable, "-c", ON_TWO_DEVICES, str(tmp_path)], capture_output=True, text=True,
                           env=env, timeout=300) for _ in range(2)]
    assert all(run.returncode == 0 for run in runs), runs[-1].stderr[-2000:]
    (first_loaded, first_compiled, first_sum), (loaded, compiled, total) = (run.stdout.split() for run in runs)
    assert (first_loaded, first_compiled, loaded, compiled) == ("0", "1", "1", "0") and total == first_sum


def test_programs_unused_for_a_month_are_pruned_when_the_store_next_writes(tmp_path):
    x = jnp.arange(4.0)
    with use_program_store(tmp_path):
        _power_plus(x, 1.0, power=2)
    (old,) = tmp_path.glob("*.xla")
    os.utime(old, (0, 0))  # last used in 1970
    with use_program_store(tmp_path) as store:
        _power_plus(x, 1.0, power=2)  # a load marks it used
    assert old.is_file() and old.stat().st_mtime > 1e9 and store.stats.loaded == 1
    os.utime(old, (0, 0))
    with use_program_store(tmp_path):
        _power_plus(x, 1.0, power=5)  # a new program is written: the old one goes first
    assert not old.is_file() and len(list(tmp_path.glob("*.xla"))) == 1


def test_a_store_that_cannot_be_written_still_runs_the_program_once_compiled(tmp_path, monkeypatch):
    import mxdit.model.programs as programs

    def full_disk(path, write):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(programs, "write_atomically", full_disk)
    # a program no other test compiles: XLA:CPU would have the program call kernels another test's program compiled
    # in this process, and the store would not write it for that reason, before trying the disk
    x = jnp.arange(7.0)
    with use_program_store(tmp_path) as store:
        a, b = _power_plus(x, 1.0, power=4), _power_plus(x, 2.0, power=4)
    np.testing.assert_array_equal(b, a + 1)
    assert store.stats.compiled == 1 and "not stored: [Errno 28]" in store.stats.failed_loads[0]


@stored_jit
def _scaled(x, scale):
    TRACES.append("scaled")
    return x * scale


def test_ahead_a_dry_run_lowers_each_program_once_and_the_real_run_uses_them(tmp_path):
    """In `ahead` mode the calls return zeros of their outputs' shapes while the programs compile on the store's
    threads; the real calls after it trace nothing and compute what jax.jit computes."""
    TRACES.clear()
    x = jnp.arange(4.0)
    with use_program_store(tmp_path) as store:
        with store.ahead():
            y = _power_plus(x, 1.0, power=6)
            z = _scaled(y, 3.0)  # reached with zeros of y's shape: the dry run goes on to the next program
        assert (y.shape, y.dtype, z.shape, z.dtype) == ((4,), jnp.float32, (4,), jnp.float32)
        np.testing.assert_array_equal(z, np.zeros(4, np.float32))
        traced = list(TRACES)
        real = _scaled(_power_plus(x, 1.0, power=6), 3.0)
    assert traced == [6, "scaled"] and TRACES == traced, "the real run traced again"
    np.testing.assert_array_equal(real, (np.arange(4.0) ** 6 + 1) * 3)
    assert store.stats.compiled == 2 and len(list(tmp_path.glob("*.xla"))) == 2


@stored_jit
def _halved(s):
    return s * 0.5  # of a Python float: a weakly typed result


def test_ahead_zeros_keep_the_outputs_weak_types_and_closed_compiles_run_in_the_real_call(tmp_path):
    TRACES.clear()
    x = jnp.arange(4.0)
    with use_program_store(tmp_path) as store:
        with store.ahead():
            h = _halved(3.0)
            _scaled(x + 1, h)
        assert h.weak_type and len(store._programs) == 2
        traced = list(TRACES)
        store.close()  # the compiles not started are dropped: the real calls compile them
        np.testing.assert_array_equal(_scaled(x + 1, _halved(3.0)), (np.arange(4.0) + 1) * 1.5)
        assert len(store._programs) == 2 and TRACES == traced  # the real calls met the dry run's signatures


def test_a_program_that_fails_to_compile_ahead_raises_in_the_real_call_and_is_tried_again(tmp_path, monkeypatch):
    import mxdit.model.programs as programs

    compile_once = programs.ProgramStore._compile

    def failing(self, *args):
        monkeypatch.setattr(programs.ProgramStore, "_compile", compile_once)
        raise RuntimeError("out of memory while compiling")

    monkeypatch.setattr(programs.ProgramStore, "_compile", failing)
    x = jnp.arange(4.0)
    with use_program_store(tmp_path) as store:
        with store.ahead():
            _power_plus(x, 1.0, power=3)
        with pytest.raises(RuntimeError, match="out of memory while compiling"):
            _power_plus(x, 1.0, power=3)
        np.testing.assert_array_equal(_power_plus(x, 1.0, power=3), np.arange(4.0) ** 3 + 1)


@pytest.mark.slow
def test_a_pipeline_compiled_ahead_gives_the_same_images_and_compiles_nothing_more(tmp_path):
    """The tiny Krea 2 pipeline: `compile_ahead` of a dry run reaches all four programs (text encoder, text stage,
    denoising loop, VAE decoder); the real call then traces none and its images equal those of a plain run."""
    from mxdit.model.inference import InferenceOptions, build_pipeline
    from mxdit.model.programs import compile_ahead

    pipe = build_pipeline(FIXTURES / "krea2" / "tiny_pipeline", InferenceOptions(dtype="float32"))
    call = functools.partial(pipe, ["a cat", "a red fox"], height=64, width=64, num_inference_steps=2, seed=[1, 2],
                             max_sequence_length=16, output_type="np")
    plain = call()
    with use_program_store(tmp_path) as store:
        seconds = compile_ahead(call)
        programs = dict(store._programs)
        ahead = call()
    assert seconds > 0 and len(programs) == 4 and store._programs.keys() == programs.keys()
    assert store.stats.compiled == 4
    np.testing.assert_array_equal(ahead.images, plain.images)
    assert compile_ahead(call) == 0.0  # no store: nothing is called


# ~40 s on 2 cores; by default test_generate_second_start_loads_every_program_and_writes_the_same_image compiles an
# FP8 folder's programs ahead on its shapes and loads them in a new process
@pytest.mark.slow
@pytest.mark.parametrize("model", ["krea2", "flux"])
def test_programs_compiled_ahead_on_the_shapes_are_those_the_loaded_pipeline_runs(tmp_path, model):
    """`build_pipeline_ahead`: the dry run on `pipeline_shapes` (weights quantized to fp8 as they load) while the
    weights are read reaches the four programs; the loaded pipeline then compiles none, and its images equal those
    of a pipeline built and run without a store. No program's key holds an object's address (a new process would
    never meet it again)."""
    from mxdit.model.inference import InferenceOptions, build_pipeline, build_pipeline_ahead

    folder = FIXTURES / model / "tiny_pipeline"
    options = InferenceOptions(dtype="float32", precision="fp8")

    def call(pipe):
        return pipe(["a cat", "a red fox"], height=64, width=64, num_inference_steps=2, seed=[1, 2],
                    max_sequence_length=16, output_type="np")

    plain = call(build_pipeline(folder, options))
    with use_program_store(tmp_path) as store:
        pipe, stages = build_pipeline_ahead(folder, options, call)
        programs = dict(store._programs)
        ahead = call(pipe)
    assert list(stages) == ["load and compile ahead"]
    assert len(programs) == 4 and store._programs.keys() == programs.keys() and store.stats.compiled == 4
    assert not [memo[0] for memo in programs if " at 0x" in str(memo[1])]
    np.testing.assert_array_equal(ahead.images, plain.images)


def test_pipeline_shapes_read_no_weights_and_fail_as_the_load_does(tmp_path):
    """The shapes of a folder's pipeline are its parameters' after loading (quantized on load where `precision`
    says); a folder that does not load raises the load's own error; LoRAs or streaming are not known from shapes."""
    import shutil

    from mxdit.model.inference import InferenceOptions, build_pipeline, pipeline_shapes, shapes_known_first
    from mxdit.model.loading import CheckpointError, holds_shapes

    folder = FIXTURES / "krea2" / "tiny_pipeline"
    shapes = pipeline_shapes(folder, InferenceOptions(dtype="float32", precision="fp8"))
    assert holds_shapes(shapes.transformer) and holds_shapes(shapes.text_encoder) and holds_shapes(shapes.vae)
    leaves = jax.tree.leaves(nnx.state(shapes.transformer))
    assert {leaf.sharding for leaf in leaves} == {jax.sharding.SingleDeviceSharding(jax.devices()[0])}
    assert jnp.dtype(jnp.float8_e4m3fn) in {leaf.dtype for leaf in leaves}  # the blocks' matrices as fp8 kernel weights
    assert not shapes_known_first(folder, InferenceOptions(offload=2))
    assert not shapes_known_first(None, InferenceOptions())
    with pytest.raises(ValueError, match="pipeline_shapes"):
        pipeline_shapes(folder, InferenceOptions(loras=[(tmp_path / "style.safetensors", 1.0)]))
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    config = json.loads((folder / "transformer" / "config.json").read_text())
    (broken / "transformer" / "config.json").write_text(json.dumps({**config, "num_layers": config["num_layers"] + 1}))
    with pytest.raises(CheckpointError) as shapes_error:
        pipeline_shapes(broken, InferenceOptions(dtype="float32"))
    with pytest.raises(CheckpointError) as load_error:
        build_pipeline(broken, InferenceOptions(dtype="float32"))
    assert str(shapes_error.value) == str(load_error.value)
