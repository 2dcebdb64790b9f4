"""sharding/: mesh text, device counts and parameter rules in this process (one device); the multi-device checks in a
child process with 8 simulated CPU devices (tests/sharding_multidevice.py), since the device count is fixed when jax
loads and the rest of the suite runs on one."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from mxdit.sharding.krea2 import pad_text
from mxdit.sharding.mesh import AXES, make_mesh, param_spec, parse_mesh

TESTS = Path(__file__).parent


def test_parse_mesh_reads_named_axes():
    assert parse_mesh("data=2,seq=4,cfg=2") == {"data": 2, "seq": 4, "cfg": 2}
    assert parse_mesh(" fsdp = 8 ") == {"fsdp": 8}
    assert parse_mesh("") == {}


@pytest.mark.parametrize("text, message", [
    ("data=2,foo=3", "mesh 'data=2,foo=3': unknown axis 'foo'; the axes are data, cfg, fsdp, seq, tensor"),
    ("seq=2,seq=4", "axis 'seq' given twice"),
    ("seq=0", "size of 'seq' must be a positive integer, got '0'"),
    ("seq=two", "size of 'seq' must be a positive integer, got 'two'"),
    ("seq", "entry 'seq' is not axis=size"),
])
def test_parse_mesh_names_the_bad_entry(text, message):
    with pytest.raises(ValueError, match=message):
        parse_mesh(text)


def test_make_mesh_has_every_axis_and_checks_the_device_count():
    mesh = make_mesh("")
    assert mesh.axis_names == AXES and mesh.size == 1
    with pytest.raises(ValueError, match="mesh seq=3: needs 3 devices, which does not divide the 1 devices"):
        make_mesh({"seq": 3})


def test_param_spec_splits_the_largest_divisible_axis_and_replicates_the_rest():
    assert param_spec((256, 64), 4, ("fsdp",)) == P(("fsdp",), None)
    assert param_spec((64, 512), 4, ("fsdp",)) == P(None, ("fsdp",))
    assert param_spec((6, 256), 8, AXES) == P(None, AXES)  # 6 does not divide by 8
    assert param_spec((3, 5), 2, ("fsdp",)) == P()  # nothing divides
    assert param_spec((256,), 4, ("fsdp",)) == P()  # vectors stay whole
    assert param_spec((256, 64), 1, ("fsdp",)) == P()


def test_pad_text_adds_masked_tokens_between_text_and_image_positions():
    embeds, mask = jnp.ones((2, 5, 3, 4)), jnp.ones((2, 5), bool)
    ids = jnp.arange(11 * 3, dtype=jnp.float32).reshape(11, 3)  # 5 text + 6 image rows
    e, m, i = pad_text(embeds, mask, ids, image_len=6, multiple=4)  # 11 -> 12
    assert e.shape == (2, 6, 3, 4) and not e[:, 5].any() and m.shape == (2, 6) and not m[:, 5].any()
    assert (i[:5] == ids[:5]).all() and not i[5].any() and (i[6:] == ids[5:]).all()
    assert pad_text(embeds, mask, ids, image_len=6, multiple=11)[0] is embeds


def test_generate_refuses_a_bad_mesh_in_one_line(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("generate", TESTS.parent / "scripts" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    with pytest.raises(SystemExit) as exit_info:
        generate.parse_args(["--demo", "--prompt", "a", "--mesh", "data=2,sequence=4", "--output",
                             str(tmp_path / "a.png")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "--mesh: mesh 'data=2,sequence=4': unknown axis 'sequence'" in err


@pytest.mark.slow  # ~2 min on 2 cores
def test_multi_device_checks_on_8_simulated_devices():
    """Runs tests/sharding_multidevice.py in a child process: sharded steps equal unsharded ones (seq 2/4/8, ring,
    cfg 2, data 2, FSDP weights), the Ulysses HLO all-to-all count, ring/Ulysses attention, the sharded pipeline and
    generate.py --mesh, FSDP x data training steps."""
    if jax.device_count() >= 8:  # this process already has the devices (XLA_FLAGS set by hand): run here instead
        pytest.skip("this process already has 8+ devices, so the child process adds nothing: collect "
                    "tests/sharding_multidevice.py directly in this run instead")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    result = subprocess.run(
        # one process (-n 0 over pyproject's -n auto): xdist workers in the child would each build the module's
        # fixtures again (164 vs 147 CPU seconds) on cores the parent's workers are using
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
         str(TESTS / "sharding_multidevice.py")],
        cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout.splitlines()[-1], result.stdout[-2000:]
