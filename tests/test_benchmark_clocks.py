"""scripts/benchmark.py records the GPU's clock and power beside its timings (the H200 lowers its clock at its
power cap, so a time means little without it): parsed from nvidia-smi's samples, and nothing without nvidia-smi."""

import importlib.util
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "benchmark.py"


@pytest.fixture(scope="module")
def benchmark():
    spec = importlib.util.spec_from_file_location("benchmark_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_timings_carry_the_clock_and_power_nvidia_smi_reports(benchmark, tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"  # a stand-in printing three samples and one it cannot read, then waiting
    smi.write_text("#!/bin/sh\necho '1635, 690.5'\necho '1980, 300.0'\necho '1395, 701.2'\necho '[N/A], [N/A]'\n"
                   "exec sleep 30\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    row = benchmark._timed(lambda n: time.sleep(0.05 * n), 2, 2)
    assert row["sm_mhz_median"] == 1635 and row["sm_mhz_min"] == 1395 and row["power_w_max"] == 701.2


def test_no_nvidia_smi_gives_no_clock_figures(benchmark, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no nvidia-smi
    row = benchmark._timed(lambda n: None, 1, 1)
    assert "s_per_step" in row and not any(k.startswith(("sm_", "power_")) for k in row)
