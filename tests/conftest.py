import atexit
import os
import shutil
import tempfile
import types
from pathlib import Path

import numpy as np
import pytest

FIXTURES = Path(__file__).parent / "fixtures"

# generate.py keeps compiled programs in $XDG_CACHE_HOME/mxdit: the tests' go to a folder of their own run (shared by
# its tests and child processes), never to the user's cache, and every run starts as a fresh machine would.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="mxdit-test-cache-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], ignore_errors=True)


def relative_l2(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


@pytest.fixture(scope="session")
def fixtures() -> Path:
    return FIXTURES


@pytest.fixture
def hopper(monkeypatch):
    """Triton-lowered kernels lower for an H100/H200-class GPU on the CPU: the Triton lowering asks the local GPU
    for its compute capability, and this machine has none."""
    from jax._src.pallas.triton import pallas_call_registration

    monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info",
                        lambda: types.SimpleNamespace(compute_capability=90))
