"""model/programs.py: compiled programs stored on disk are loaded by a later store (a later process) instead of traced,
under keys that change with anything that changes the program; generate.py's second start loads them all."""

import importlib.util
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from conftest import FIXTURES
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
    # Outside a store it is jax.jit, and the folder is not touched.
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


def test_generate_second_start_loads_every_program_and_writes_the_same_image(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("generate", Path(__file__).parent.parent / "scripts" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    common = ["--model", str(FIXTURES / "krea2" / "tiny_pipeline"), "--prompt", "a cat", "--height", "64", "--width",
              "64", "--steps", "2", "--dtype", "fp32", "--max-sequence-length", "16", "--compile-cache",
              str(tmp_path / "cache")]
    outputs = []
    for start in ("first", "second"):
        outputs.append(tmp_path / f"{start}.png")
        assert generate.main(common + ["--output", str(outputs[-1])]) == 0
        printed = capsys.readouterr().out
        summary = next(line for line in printed.splitlines() if line.startswith("executables:"))
        # text encoder, the transformer's text stage, the denoising loop, the VAE decoder
        expected = "0 loaded (0.0 s), 4 compiled and stored" if start == "first" else "4 loaded"
        assert expected in summary and (start == "first" or ", 0 compiled" in summary), summary
    assert outputs[0].read_bytes() == outputs[1].read_bytes()
