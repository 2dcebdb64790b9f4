"""The test summary says how many tests its markers left out, with or without pytest-xdist (not_run_summary.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SUITE = '''
import pytest

@pytest.mark.slow
def test_a(): pass

@pytest.mark.slow
def test_b(): pass

@pytest.mark.gpu
def test_c(): pass

def test_d(): pass
'''


def test_summary_counts_the_slow_and_gpu_tests_left_out(tmp_path):
    (tmp_path / "test_marked.py").write_text(SUITE)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: slow\n    gpu: gpu\n")
    # only the plugins used (no other installed plugin loads: a faster start)
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}

    def summary(*options: str) -> str:
        done = subprocess.run([sys.executable, "-m", "pytest", "-p", "not_run_summary", "-p", "xdist.plugin", "-p",
                               "no:cacheprovider", "--strict-markers", "-q", *options],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    out = summary("-n", "2", "-m", "not slow and not gpu")  # counted in the workers, printed by the controller
    assert "2 slow tests not run (pytest -m slow runs them)" in out and "1 passed" in out
    assert "1 gpu test not run (pytest -m gpu runs them on a CUDA GPU)" in out
    out = summary("-n", "0", "-m", "slow")
    assert "slow test" not in out and "1 gpu test not run" in out and "2 passed" in out
