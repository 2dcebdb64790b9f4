import atexit
import os
import shutil
import tempfile
import types
from pathlib import Path

import jax
import numpy as np
import pytest
from not_run_summary import pytest_deselected, pytest_sessionfinish, pytest_testnodedown  # noqa: F401 (hooks)
from not_run_summary import pytest_terminal_summary as write_not_run_note

FIXTURES = Path(__file__).parent / "fixtures"

# generate.py keeps compiled programs in $XDG_CACHE_HOME/mxdit/jax: the tests' go to a folder of their own run, never
# to the user's cache, and every run starts as a fresh machine would. The tests share that cache (what XLA compiles
# on the CPU is most of the suite's time, and many tests run the same tiny models' programs): programs that compile in
# over 0.5 s are kept, and generate.py's runs inside the tests keep every program, in the same folder. pytest-xdist's
# workers inherit the folder that the controlling process made (one cache for the run, not one a worker), and that
# process removes it.
if "PYTEST_XDIST_WORKER" not in os.environ:
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="mxdit-test-cache-")
    atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", os.path.join(os.environ["XDG_CACHE_HOME"], "mxdit", "jax"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


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


def pytest_collection_modifyitems(config, items):
    """The GPU tier (`-m gpu`) is skipped, with the reason, where JAX sees no GPU."""
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU (JAX's backend here is {jax.default_backend()!r})")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The tests left out by marker, and what the GPU tier measured: each test's recorded errors
    (`record_property`), one line a test."""
    write_not_run_note(terminalreporter, exitstatus, config)
    reports = [r for key in ("passed", "failed") for r in terminalreporter.stats.get(key, [])
               if r.when == "call" and "gpu" in r.keywords and r.user_properties]
    if not reports:
        return
    terminalreporter.section("measured on the GPU")
    for report in sorted(reports, key=lambda r: r.nodeid):
        values = ", ".join(f"{name} {value:.3g}" if isinstance(value, float) else f"{name} {value}"
                           for name, value in report.user_properties)
        terminalreporter.write_line(f"{report.outcome:6} {report.nodeid.split('::', 1)[1]}: {values}")
