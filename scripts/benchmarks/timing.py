"""Timers and what the GPU did meanwhile: host and CUDA-event clocks, CUPTI kernel times, the SM clock and power
from nvidia-smi, and energy from NVML's counter."""

from __future__ import annotations

import statistics
import subprocess
import time

# nvidia-smi's clock event reasons (a bit mask): what holds the SM clock below its maximum.
CLOCK_LIMITS = {"sw_power_cap": 0x4, "hw_slowdown": 0x8, "sw_thermal": 0x20, "hw_thermal": 0x40,
                "hw_power_brake": 0x80}


def gpu_energy_mj() -> int | None:
    """The GPU's energy counter (NVML, millijoules since the driver loaded), or None without NVML."""
    import ctypes

    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        handle, mj = ctypes.c_void_p(), ctypes.c_ulonglong()
        if (nvml.nvmlInit_v2() or nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(handle))
                or nvml.nvmlDeviceGetTotalEnergyConsumption(handle, ctypes.byref(mj))):
            return None
        return mj.value
    except (OSError, AttributeError):
        return None


class GpuClocks:
    """nvidia-smi's SM clock, power draw, GPU temperature and clock event reasons, sampled every 100 ms while the
    `with` block runs; `.summary()` gives the clock's median and minimum, the largest power and temperature, the
    share of samples in which each limit (`CLOCK_LIMITS`) held the clock, and the energy the GPU used meanwhile
    (NVML's counter; empty without them). A GPU at its power cap lowers its clock, so a time means little without
    the clock it ran at, and energy a step is what bounds it; the reasons say which limit acted. A driver whose
    nvidia-smi does not know the last two fields gives the first two only."""

    FIELDS = ("clocks.sm", "power.draw", "temperature.gpu", "clocks_event_reasons.active")

    def __enter__(self):
        self.proc = None
        for fields in (self.FIELDS, self.FIELDS[:2]):
            self.fields = fields
            command = ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits", "-i", "0"]
            try:  # an unknown field fails the whole query: ask once before sampling
                if subprocess.run(command, capture_output=True, timeout=10).returncode == 0:
                    self.proc = subprocess.Popen(command + ["-lms", "100"], stdout=subprocess.PIPE,
                                                 stderr=subprocess.DEVNULL, text=True)
                    break
            except (OSError, subprocess.TimeoutExpired):  # no NVIDIA driver here
                break
        self.energy_mj = gpu_energy_mj()  # after the query: its time is not the timed work's
        return self

    def __exit__(self, *exc):
        end_mj = gpu_energy_mj()
        self.energy_j = None if end_mj is None or self.energy_mj is None else (end_mj - self.energy_mj) / 1000
        self.samples = []
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            out, _ = self.proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        for line in out.splitlines():
            values = [v.strip() for v in line.split(",")]
            try:  # clock, power (, temperature, the reasons' bit mask)
                if len(values) != len(self.fields):
                    raise ValueError(line)
                self.samples.append(tuple(int(v, 16) if i == 3 else float(v) for i, v in enumerate(values)))
            except ValueError:  # a partial last line, or "[N/A]"
                continue

    def summary(self) -> dict:
        energy = {} if self.energy_j is None else {"energy_j": self.energy_j}
        if not self.samples:
            return energy
        columns = list(zip(*self.samples))
        row = {"sm_mhz_median": statistics.median(columns[0]), "sm_mhz_min": min(columns[0]),
               "power_w_max": max(columns[1]), **energy}
        if len(columns) == 4:
            row["temperature_c_max"] = max(columns[2])
            row["clock_limits"] = {name: sum(bool(r & bit) for r in columns[3]) / len(columns[3])
                                   for name, bit in CLOCK_LIMITS.items()}
        return row


def timed(run, iters: int, repeats: int, settle_s: float = 0.0, *, warmup: int = 1, seconds=None) -> dict:
    """`run(n)` runs n steps and waits for them: the first `warmup` steps (compilation included) as compile_s, then
    the median seconds a step over `repeats` runs of `iters` steps, and their spread; with the GPU's clock and power
    over the timed runs (`GpuClocks`). `settle_s`: seconds of untimed runs first, because a GPU's power cap acts
    with a lag: runs that start from an idle GPU (after a compilation) draw over the cap for a while and come out
    faster than the same steps sustained. `seconds(n)`: runs n steps and returns how long they took by another clock
    (CUDA events); by default the host's, around `run(n)`."""
    def host_seconds(n):
        t0 = time.perf_counter()
        run(n)
        return time.perf_counter() - t0

    compile_s = host_seconds(warmup) if warmup else 0.0  # (0: the caller ran them)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < settle_s:
        run(iters)
    times = []
    with GpuClocks() as clocks:
        for _ in range(repeats):
            times.append((seconds or host_seconds)(iters) / iters)
    median = statistics.median(times)
    return {"compile_s": compile_s, "s_per_step": median, "spread": (max(times) - min(times)) / median,
            "repeats_s": times, **per_step(clocks.summary(), iters * repeats, sum(times) * iters)}


def per_step(gpu: dict, steps: int, seconds: float) -> dict:
    """`GpuClocks.summary()` with its energy as joules a step and the mean power over the timed steps (the figure
    that says whether the steps sit at the power cap)."""
    if "energy_j" in gpu:
        energy = gpu.pop("energy_j")
        gpu.update(joules_per_step=energy / steps, power_w_mean=energy / seconds)
    return gpu


def median_seconds(fn, repeats: int) -> float:
    """Median seconds of one call of `fn()` (a JAX computation, waited for) over `repeats`, after a warm-up call."""
    import jax

    return timed(lambda n: jax.block_until_ready([fn() for _ in range(n)]), 1, repeats)["s_per_step"]


def cupti_seconds(fn, *inputs, iterations: int, by_kernel: bool = False):
    """Median GPU time of fn(*inputs) over `iterations` calls, summed over its kernels (CUPTI, through jax's Mosaic
    GPU profiler): launch gaps do not count, and the first call (compilation) is excluded. With `by_kernel`, also
    the median time per kernel name."""
    import jax
    from jax.experimental.mosaic.gpu import profiler

    jax.block_until_ready(fn(*inputs))  # compile and warm up
    try:
        _, runs = profiler.measure(fn, aggregate=False, iterations=iterations)(*inputs)
    except RuntimeError:  # no CUPTI: host clock over back-to-back dispatches (launch gaps then count)
        t0 = time.perf_counter()
        for _ in range(iterations):
            out = fn(*inputs)
        jax.block_until_ready(out)
        seconds = (time.perf_counter() - t0) / iterations
        return (seconds, {"host clock": seconds}) if by_kernel else seconds
    totals = [sum(t for _, t in run) / 1e3 for run in runs]
    if not by_kernel:
        return statistics.median(totals)
    names = {}
    for run in runs:
        for name, t in run:
            names.setdefault(name, []).append(t / 1e3)
    return statistics.median(totals), {k: statistics.median(v) for k, v in names.items()}


def energy_per_call(fn, *args, seconds: float = 2.5, kernels_per_call: int = 1) -> dict:
    """Energy and time a kernel at the power cap: `fn(*args)` dispatched back to back for ~`seconds` after a quarter
    of that untimed (`timed`, the calls as its steps). `kernels_per_call`: the kernels one call runs (short kernels
    go several a dispatch, on distinct inputs, so the host keeps up)."""
    import jax

    def run(n):
        for _ in range(n):
            out = fn(*args)
        jax.block_until_ready(out)

    run(1)  # compiled
    t0 = time.perf_counter()
    run(5)
    calls = max(int(seconds / ((time.perf_counter() - t0) / 5)), 10)
    result = timed(run, calls, 1, settle_s=seconds / 4, warmup=0)  # compiled and warm already
    row = {"kernels": calls * kernels_per_call, "us_per_kernel": result["s_per_step"] / kernels_per_call * 1e6,
           "sm_mhz_median": result.get("sm_mhz_median")}
    if "joules_per_step" in result:
        row.update(mj_per_kernel=result["joules_per_step"] / kernels_per_call * 1e3,
                   power_w_mean=result["power_w_mean"])
    return row


def torch_timed(fn, iters: int, repeats: int, settle_s: float = 0.0, warmup: int = 3, training: bool = False) -> dict:
    """`timed` of `fn()` (a torch computation) under inference mode (`training`: with autograd, as a training step
    runs), the timed runs by CUDA events on a GPU (by the host's clock elsewhere: a smoke run)."""
    import contextlib

    import torch

    cuda = torch.cuda.is_available()

    def run(n):
        for _ in range(n):
            fn()
        if cuda:
            torch.cuda.synchronize()

    def seconds(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3

    with contextlib.nullcontext() if training else torch.inference_mode():
        return timed(run, iters, repeats, settle_s, warmup=warmup, seconds=seconds if cuda else None)


def memory_fraction(cap_gb: float) -> str:
    """XLA_PYTHON_CLIENT_MEM_FRACTION for a device memory pool of `cap_gb` GB on this machine's first GPU."""
    import subprocess

    total_mib = float(subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, check=True).stdout.split()[0])
    return f"{cap_gb * 1e9 / (total_mib * 2**20):.3f}"


def jax_peak_gb(all_devices: bool = False) -> float:
    """The peak device memory JAX's allocator had in use, GB: the first device's, or the fullest one's (0 where the
    device reports none)."""
    import jax

    devices = jax.devices() if all_devices else jax.devices()[:1]
    return max((d.memory_stats() or {}).get("peak_bytes_in_use", 0) for d in devices) / 1e9
