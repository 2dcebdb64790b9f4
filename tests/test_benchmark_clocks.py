"""scripts/benchmark.py records the GPU's clock and power beside its timings (a GPU at its power cap lowers its
clock, so a time means little without it): parsed from nvidia-smi's samples, and nothing without nvidia-smi. The
timers live in `scripts/benchmarks/timing.py`."""

import importlib
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "benchmark.py"


def _benchmarks_module(name: str):
    """A module of scripts/benchmarks/, importable once scripts/benchmark.py has loaded (it puts its folder on the
    path, as when run)."""
    spec = importlib.util.spec_from_file_location("benchmark_script", SCRIPT)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    return importlib.import_module(f"benchmarks.{name}")


@pytest.fixture(scope="module")
def timing():
    return _benchmarks_module("timing")


def _stand_in(tmp_path, samples: list[str], knows_reasons: bool, query_s: float = 0.0):
    """A stand-in for nvidia-smi: fails a query naming fields it does not know; asked once (no -lms), prints one
    sample after `query_s` seconds; sampling, prints `samples` then waits as the real one does."""
    smi = tmp_path / "nvidia-smi"
    lines = "".join(f"echo '{line}'\n" for line in samples)
    smi.write_text("#!/bin/sh\n"
                   + ("" if knows_reasons else 'case "$*" in *clocks_event_reasons*) exit 2;; esac\n')
                   + f'case "$*" in *-lms*) ;; *) sleep {query_s}; echo \'{samples[0]}\'; exit 0;; esac\n'
                   + lines + "exec sleep 30\n")
    smi.chmod(0o755)


def test_timings_carry_the_clock_and_power_nvidia_smi_reports(timing, tmp_path, monkeypatch):
    # a driver that does not know the temperature-and-reasons query: clock and power only (and one unreadable line)
    _stand_in(tmp_path, ["1635, 690.5", "1980, 300.0", "1395, 701.2", "[N/A], [N/A]"], knows_reasons=False)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    row = timing.timed(lambda n: time.sleep(0.05 * n), 2, 2)
    assert row["sm_mhz_median"] == 1635 and row["sm_mhz_min"] == 1395 and row["power_w_max"] == 701.2
    assert "clock_limits" not in row and "temperature_c_max" not in row


def test_timings_carry_what_held_the_clock(timing, tmp_path, monkeypatch):
    """The clock event reasons (a bit mask) as the share of samples each limit was active in, and the hottest
    sample: whether the power cap, a hardware slowdown or heat held the clock."""
    _stand_in(tmp_path, ["1635, 690.5, 61, 0x0000000000000004", "1980, 300.0, 55, 0x0000000000000000",
                         "1395, 701.2, 66, 0x000000000000000C", "1500, 699.0, 64, 0x0000000000000004",
                         "1600, 650.0, 6"], knows_reasons=True)  # (and a partial line)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    row = timing.timed(lambda n: time.sleep(0.05 * n), 2, 2)
    assert row["sm_mhz_median"] == pytest.approx(1567.5) and row["temperature_c_max"] == 66
    assert row["clock_limits"] == {"sw_power_cap": 0.75, "hw_slowdown": 0.25, "sw_thermal": 0.0,
                                   "hw_thermal": 0.0, "hw_power_brake": 0.0}


def test_energy_window_leaves_out_nvidia_smis_first_query(timing, tmp_path, monkeypatch):
    """The one-shot query that checks nvidia-smi's fields runs before the energy counter is read: the idle GPU's
    energy while it answers is not the timed steps'."""
    _stand_in(tmp_path, ["1500, 600.0, 50, 0x4"], knows_reasons=True, query_s=0.5)  # the one-shot query: 0.5 s
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setattr(timing, "gpu_energy_mj", lambda: int(time.monotonic() * 1e5))  # a 100 W counter
    row = timing.timed(lambda n: time.sleep(0.1 * n), 1, 2)
    assert row["joules_per_step"] == pytest.approx(10.0, rel=0.3)  # 0.1 s a step at 100 W; with the query's 0.5 s: 35


def test_no_nvidia_smi_gives_no_clock_figures(timing, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no nvidia-smi
    row = timing.timed(lambda n: None, 1, 1)
    assert "s_per_step" in row and not any(k.startswith(("sm_", "power_")) for k in row)


def test_energy_counter_gives_joules_and_mean_power_a_step(timing, tmp_path, monkeypatch):
    """NVML's energy counter read before and after the timed runs: joules a step over all timed steps, and the mean
    power they imply (the figure that says whether the step sits at the 700 W cap)."""
    monkeypatch.setenv("PATH", str(tmp_path))
    readings = iter([1_000_000, 1_000_000 + 4 * 70_000])  # millijoules: 70 J a step over 2 x 2 steps
    monkeypatch.setattr(timing, "gpu_energy_mj", lambda: next(readings))
    row = timing.timed(lambda n: time.sleep(0.05 * n), 2, 2)
    assert row["joules_per_step"] == pytest.approx(70.0)
    assert row["power_w_mean"] == pytest.approx(70.0 / 0.05, rel=0.3)  # sleeps overshoot a little
    assert "energy_j" not in row


def test_no_energy_counter_gives_no_energy_figures(timing, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(timing, "gpu_energy_mj", lambda: None)
    row = timing.timed(lambda n: None, 1, 1)
    assert not any(k in row for k in ("joules_per_step", "power_w_mean", "energy_j"))


def test_timings_by_another_clock_and_warmup(timing, tmp_path, monkeypatch):
    """`seconds(n)`: the caller's clock (the diffusers side's CUDA events) gives the times, not the host's; the
    first `warmup` steps are compile_s's."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(timing, "gpu_energy_mj", lambda: None)
    steps = []
    clock = iter([0.30, 0.20, 0.40])  # seconds for each timed run of 10 steps

    def seconds(n):
        steps.append(n)
        return next(clock)

    row = timing.timed(steps.append, 10, 3, warmup=3, seconds=seconds)
    assert steps == [3, 10, 10, 10]  # the warmup through run, the timed runs through seconds
    assert row["s_per_step"] == pytest.approx(0.03) and row["repeats_s"] == pytest.approx([0.03, 0.02, 0.04])
    assert row["spread"] == pytest.approx(0.02 / 0.03)


def test_energy_per_call_divides_the_counter_by_the_kernels_run(timing, tmp_path, monkeypatch):
    """`krea2-energy`'s loop: energy and time a kernel over all the calls timed, `kernels_per_call` a call."""
    import jax
    import jax.numpy as jnp

    monkeypatch.setenv("PATH", str(tmp_path))
    readings = iter([5_000, 5_000 + 4_000])  # millijoules around the timed loop
    monkeypatch.setattr(timing, "gpu_energy_mj", lambda: next(readings))
    fn = jax.jit(lambda x: [x + 1.0, x * 2.0])
    row = timing.energy_per_call(fn, jnp.ones(8), seconds=0.05, kernels_per_call=2)
    assert row["kernels"] >= 20 and row["kernels"] % 2 == 0
    assert row["mj_per_kernel"] == pytest.approx(4_000 / row["kernels"])
    assert row["power_w_mean"] > 0 and row["us_per_kernel"] > 0


def test_krea2_energy_covers_the_step_linear_work():
    """The four products `krea2-energy` measures are the step's linear FLOPs (`krea2_flops` less attention)."""
    from mxdit.model.krea2 import Krea2Config

    krea2, inputs = _benchmarks_module("krea2"), _benchmarks_module("inputs")
    cfg = Krea2Config()
    shapes = krea2.krea2_gemm_shapes(cfg)
    tokens = 4224
    linear = sum(2 * tokens * k * n for k, n, _ in shapes.values())
    attention = 4 * tokens * tokens * cfg.hidden_size
    assert linear * cfg.num_layers == pytest.approx(inputs.krea2_flops(cfg, 4096, 128) - attention * cfg.num_layers)
    assert shapes["SwiGLU GEMM"] == (6144, 32768, "swiglu") and shapes["QKVG GEMM"] == (6144, 15360, "none")


def test_remat_choices_are_trainings():
    """benchmark.py lists LoRA training's remat policies itself (their module imports jax, which the command line
    does without): the list must stay training's own."""
    from mxdit.training.train import REMAT_POLICIES

    spec = importlib.util.spec_from_file_location("benchmark_script", SCRIPT)
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    assert benchmark.REMAT_CHOICES == tuple(REMAT_POLICIES)


def test_the_command_line_parses_without_jax_or_torch(tmp_path):
    """benchmark.py builds its parser and reads a command without importing jax or torch: each half of a benchmark
    runs in a process of its own, which imports only its framework."""
    parse = ("import sys, importlib.util; "
             f"spec = importlib.util.spec_from_file_location('benchmark', {str(SCRIPT)!r}); "
             "b = importlib.util.module_from_spec(spec); spec.loader.exec_module(b); "
             "b.build_parser().parse_args(['krea2-step', '--precisions', 'fp8', '--jax-attention', 'int8_mosaic']); "
             "assert not {'jax', 'torch'} & set(sys.modules), 'parsing imported jax or torch'")
    subprocess.run([sys.executable, "-c", parse], check=True, cwd=tmp_path)
