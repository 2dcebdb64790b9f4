"""Benchmarks on the GPU (not tests): ours beside diffusers in the same run, each framework in its own process.

    python scripts/benchmark.py krea2-step                      # full size, 1024x1024, JAX variants + diffusers
    python scripts/benchmark.py krea2-step --num-layers 2 --no-diffusers   # a quick smoke run
    python scripts/benchmark.py krea2-energy                    # energy a kernel of the fp8 step at the power cap
    python scripts/benchmark.py vae-decode                      # Qwen-Image and FLUX VAE decode, 1024 and 2048
    python scripts/benchmark.py krea2-pipeline                  # Turbo 8 steps end to end, warm and cold
    python scripts/benchmark.py flux-step                       # FLUX.1-dev, one step at 1024x1024
    python scripts/benchmark.py gemm                            # block-scaled GEMM kernels vs XLA and torch
    python scripts/benchmark.py krea2-sharded-step --meshes seq=8 cfg=2,seq=4 --guidance   # all GPUs, per mesh
    python scripts/benchmark.py krea2-lora-step --remat none block   # LoRA training step, rank 32, 1024x1024
    python scripts/benchmark.py krea2-lora-step --tiny          # the same on a tiny model (runs on a CPU)

Weights are random (bf16); the shapes are the released model's: 4096 image tokens (1024x1024), 512 text tokens of
which 120 are real (the padding mask). JAX is timed with many steps inside one jitted program (`lax.fori_loop`),
diffusers with CUDA events after warm-up; both report the median over repeats. Diffusers runs in a subprocess so that
the two frameworks never hold GPU memory at the same time. Results print as a table and, with --json, to a file.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def _krea2_inputs(cfg, height: int, width: int, text_len: int, valid_text: int, batch: int = 1, seed: int = 0):
    """Random inputs of the pipeline's shapes, as numpy (float32 / bool)."""
    rng = np.random.default_rng(seed)
    grid_h, grid_w = height // 16, width // 16
    hidden = rng.standard_normal((batch, grid_h * grid_w, cfg.in_channels), np.float32)
    text = rng.standard_normal((batch, text_len, cfg.num_text_layers, cfg.text_hidden_dim), np.float32)
    timestep = np.full((batch,), 0.7, np.float32)
    image_ids = np.zeros((grid_h, grid_w, 3), np.float32)
    image_ids[..., 1] = np.arange(grid_h)[:, None]
    image_ids[..., 2] = np.arange(grid_w)[None, :]
    position_ids = np.concatenate([np.zeros((text_len, 3), np.float32), image_ids.reshape(-1, 3)])
    mask = np.zeros((batch, text_len), bool)
    mask[:, :valid_text] = True
    return hidden, text, timestep, position_ids, mask


def _config(args):
    from mxdit.model.krea2 import Krea2Config

    cfg = Krea2Config()
    return dataclasses.replace(cfg, num_layers=args.num_layers) if args.num_layers else cfg


def _step_flops(cfg, image_len: int, text_len: int) -> float:
    """Matrix-product FLOPs of one forward (linear layers + attention), for TFLOP/s figures."""
    d, seq = cfg.hidden_size, image_len + text_len
    kv = cfg.num_key_value_heads * cfg.attention_head_dim
    per_token = 2 * (d * d * 3 + 2 * d * kv + 3 * d * cfg.intermediate_size)  # q, gate, out; k, v; SwiGLU
    attention = 4 * seq * seq * d
    return cfg.num_layers * (seq * per_token + attention)


def _gpu_energy_mj() -> int | None:
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


# nvidia-smi's clock event reasons (a bit mask): what holds the SM clock below its maximum.
_CLOCK_LIMITS = {"sw_power_cap": 0x4, "hw_slowdown": 0x8, "sw_thermal": 0x20, "hw_thermal": 0x40,
                 "hw_power_brake": 0x80}


class _GpuClocks:
    """nvidia-smi's SM clock, power draw, GPU temperature and clock event reasons, sampled every 100 ms while the
    `with` block runs; `.summary()` gives the clock's median and minimum, the largest power and temperature, the
    share of samples in which each limit (`_CLOCK_LIMITS`) held the clock, and the energy the GPU used meanwhile
    (NVML's counter; empty without them). Why: the H200 holds its 700 W cap in a quantized Krea 2 step by lowering
    its clock (median 1635 of 1980 MHz, NOTES.md session 8), so a figure means little without the clock it ran at,
    and energy a step is what bounds it; the reasons say which limit acted. A driver whose nvidia-smi does not know
    the last two fields gets the first two only."""

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
        self.energy_mj = _gpu_energy_mj()  # after the query: its time is not the timed work's
        return self

    def __exit__(self, *exc):
        end_mj = _gpu_energy_mj()
        self.energy_j = None if end_mj is None or self.energy_mj is None else (end_mj - self.energy_mj) / 1000
        self.samples = []
        if self.proc is not None:
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
                                   for name, bit in _CLOCK_LIMITS.items()}
        return row


def _timed(run, iters: int, repeats: int, settle_s: float = 0.0, *, warmup: int = 1, seconds=None) -> dict:
    """`run(n)` runs n steps and waits for them: the first `warmup` steps (compilation included) as compile_s, then
    the median seconds a step over `repeats` runs of `iters` steps, and their spread; with the GPU's clock and power
    over the timed runs (`_GpuClocks`). `settle_s`: seconds of untimed runs first. The H200's power cap acts with a
    lag: runs that start from an idle GPU (after a compilation) draw over 700 W for a while and come out up to ~6%
    faster than the same steps sustained (NOTES.md, session 14). `seconds(n)`: runs n steps and returns how long
    they took by another clock (CUDA events); by default the host's, around `run(n)`."""
    def host_seconds(n):
        t0 = time.perf_counter()
        run(n)
        return time.perf_counter() - t0

    compile_s = host_seconds(warmup) if warmup else 0.0  # (0: the caller ran them)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < settle_s:
        run(iters)
    times = []
    with _GpuClocks() as clocks:
        for _ in range(repeats):
            times.append((seconds or host_seconds)(iters) / iters)
    median = statistics.median(times)
    return {"compile_s": compile_s, "s_per_step": median, "spread": (max(times) - min(times)) / median,
            "repeats_s": times, **_per_step(clocks.summary(), iters * repeats, sum(times) * iters)}


def _per_step(gpu: dict, steps: int, seconds: float) -> dict:
    """`_GpuClocks.summary()` with its energy as joules a step and the mean power over the timed steps (the cap is
    700 W on the H200)."""
    if "energy_j" in gpu:
        energy = gpu.pop("energy_j")
        gpu.update(joules_per_step=energy / steps, power_w_mean=energy / seconds)
    return gpu


def jax_krea2_step(args) -> list[dict]:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mxdit.model.krea2 import Krea2Transformer
    from mxdit.model.pipelines import prepare_transformer

    cfg = _config(args)
    device = jax.devices()[0]
    t0 = time.perf_counter()
    model = Krea2Transformer(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    jax.block_until_ready(nnx.state(model))
    init_s = time.perf_counter() - t0
    hidden, text, timestep, position_ids, mask = _krea2_inputs(cfg, args.height, args.width, args.text_len, args.valid_text)
    hidden, text = jnp.asarray(hidden, jnp.bfloat16), jnp.asarray(text, jnp.bfloat16)
    timestep, position_ids, mask = jnp.asarray(timestep), jnp.asarray(position_ids), jnp.asarray(mask)
    flops = _step_flops(cfg, hidden.shape[1], text.shape[1])

    results = []
    base, made = model, None
    for precision, stacked, attention in ((p, s, a) for p in args.precisions for s in args.stacked
                                          for a in args.jax_attention):
        if made != (precision, stacked):
            model = prepare_transformer(nnx.clone(base), precision, stack=stacked)
            made = (precision, stacked)
        weights_gb = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model))) / 1e9
        for masked in (True, False) if args.unmasked_too else (True,):
            model.attention = attention
            graphdef, state = nnx.split(model)
            step_mask = mask if masked else None
            # --fused-text: the text stage once, outside the timed steps, as the pipeline runs it (diffusers runs it
            # in every call)
            step_text = jax.jit(model.fuse_text)(text, step_mask) if args.fused_text else text

            def step(state, x, text, timestep):
                return (x + 1e-3 * nnx.merge(graphdef, state)(x, text, timestep, position_ids, step_mask)).astype(x.dtype)

            @jax.jit
            def fused(state, x, text, timestep, n):
                # Each iteration's text and time depend on the loop, so XLA cannot hoist the text fusion or the time
                # embedding out of the loop: every iteration is a whole step, as in the pipeline.
                def body(i, x):
                    text_i = text + (1e-6 * jnp.mean(x)).astype(text.dtype)
                    return step(state, x, text_i, timestep + 1e-4 * i.astype(jnp.float32))

                return jax.lax.fori_loop(0, n, body, x)

            one_step = jax.jit(step)
            variants = {"one jitted loop": lambda n: fused(state, hidden, step_text, timestep, n),
                        "a dispatch per step": lambda n: _dispatch_loop(one_step, state, hidden, step_text, timestep, n)}
            for mode, call in variants.items():
                if mode not in args.modes:
                    continue
                row = {"name": f"jax {precision}{' stacked' if stacked else ''}, {attention} attention, "
                               f"{'masked' if masked else 'no mask'}, {mode}{', text fused once' if args.fused_text else ''}",
                       "weights_gb": weights_gb}
                try:
                    row.update(_timed(lambda n, call=call: jax.block_until_ready(call(n)), args.iters, args.repeats,
                                      args.settle_s))
                    row["tflops"] = flops / row["s_per_step"] / 1e12
                    if mode == "one jitted loop":  # the step's own memory beside the weights (the process peak
                        # also holds the bf16 weights the quantized ones were made from)
                        memory = fused.lower(state, hidden, step_text, timestep, 1).compile().memory_analysis()
                        row["temp_gb"] = getattr(memory, "temp_size_in_bytes", 0) / 1e9
                except Exception as e:  # record and go on with the other variants
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                stats = device.memory_stats() or {}
                row["peak_gb"] = stats.get("peak_bytes_in_use", 0) / 1e9
                results.append(row)
                print(json.dumps(row), flush=True)
    print(json.dumps({"jax_init_s": init_s, "device": str(device), "backend": jax.default_backend()}), flush=True)
    return results


def jax_krea2_offload(args) -> list[dict]:
    """The full-size Krea 2 step (random weights; bf16, or the blocks' matrices in --precision for the GEMM kernels)
    with weight streaming (`model/offload.py`): the first `--resident` blocks on the device, the others in pinned
    host memory, copied `--prefetch` blocks ahead. The weights are made tensor by tensor (quantized as made), streamed
    blocks straight into host memory, so the device never holds more than the run keeps (the parent caps its
    memory). Timed over `iters` steps dispatched back to back."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mxdit.model.krea2 import Krea2Transformer, stack_projections
    from mxdit.model.layers import PRECISIONS, quantize_on_load
    from mxdit.model.loading import module_key
    from mxdit.model.offload import StreamedKrea2
    from mxdit.quant.model import krea2_rules

    cfg = _config(args)
    device = jax.devices()[0]
    resident = cfg.num_layers if args.resident == "all" else int(args.resident)
    t0 = time.perf_counter()
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Krea2Transformer(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))))
    host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    quantize = quantize_on_load(krea2_rules(PRECISIONS[args.precision])) if args.precision != "bf16" else None
    flat = nnx.to_flat_state(state)
    for i, (path, variable) in enumerate(flat):
        value = variable.get_value()
        array = (jax.random.normal(jax.random.key(i), value.shape, jnp.float32) * 0.02).astype(value.dtype)
        if quantize is not None:
            array = quantize(module_key(path), array)
        if path[0] == "transformer_blocks" and int(path[1]) >= resident:
            array = jax.device_put(array, host)
        variable.set_value(array)
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    if args.precision != "bf16":
        stack_projections(model)  # as generate.py runs a quantized model (host-memory blocks stay in host memory)
    streamed = StreamedKrea2(model, resident=resident, prefetch=args.prefetch)
    del model, flat, state
    init_s = time.perf_counter() - t0
    hidden, text, timestep, position_ids, mask = (jnp.asarray(a) for a in _krea2_inputs(
        cfg, args.height, args.width, args.text_len, args.valid_text))
    hidden, text = hidden.astype(jnp.bfloat16), text.astype(jnp.bfloat16)
    flops = _step_flops(cfg, hidden.shape[1], text.shape[1])
    row = {"name": f"jax {args.precision}, {resident} of {cfg.num_layers} blocks resident, prefetch {args.prefetch}",
           "init_s": init_s}
    try:
        def steps(n):
            x = hidden
            for _ in range(n):
                x = (x + 1e-3 * streamed(x, text, timestep, position_ids, mask)).astype(x.dtype)
            return jax.block_until_ready(x)

        row.update(_timed(steps, args.iters, args.repeats, args.settle_s))
        row["tflops"] = flops / row["s_per_step"] / 1e12
        if resident < cfg.num_layers:
            row.update(_streamed_block_times(streamed, hidden, text, timestep, position_ids, mask))
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    stats = device.memory_stats() or {}
    row["peak_gb"] = stats.get("peak_bytes_in_use", 0) / 1e9
    row["limit_gb"] = stats.get("bytes_limit", 0) / 1e9
    print(json.dumps(row), flush=True)
    return [row]


def _streamed_block_times(streamed, *inputs, repeats: int = 5) -> dict:
    """What a streamed block costs, in parts: its weights' copy from host memory alone (and the bytes), one block's
    program alone, and the program dispatched after the copy of a streamed block's weights (as streaming runs it).
    If the copy overlapped the compute perfectly, the last would take max(copy, block)."""
    import jax

    x, _, temb_mod, rotary, kv_lengths = streamed._embed(streamed.rest_state, *inputs)
    block_args = (x, temb_mod, rotary, kv_lengths)
    host = streamed.block_states[-1]
    on_device = streamed.stream.on_device
    state = streamed.block_states[0] if streamed.stream.resident else jax.device_put(host, on_device)

    def median_ms(fn):  # one call after a warm-up call, median of `repeats`
        return _timed(lambda n: jax.block_until_ready([fn() for _ in range(n)]), 1, repeats)["s_per_step"] * 1e3

    copy_ms = median_ms(lambda: jax.device_put(host, on_device))
    gb = sum(leaf.nbytes for leaf in jax.tree.leaves(host)) / 1e9
    return {"block_gb": gb, "copy_ms": copy_ms, "copy_gb_s": gb / copy_ms * 1e3,
            "block_ms": median_ms(lambda: streamed._block(streamed.rest_state, state, block_args)),
            "block_and_copy_ms": median_ms(lambda: (jax.device_put(host, on_device),
                                                    streamed._block(streamed.rest_state, state, block_args)))}


def krea2_offload(args) -> None:
    """One process per --resident, its device memory capped to --device-memory-gb (the BFC allocator's pool), and
    one uncapped with every block resident: the exposed transfer wait is a run's time minus that one's."""
    import subprocess as sp

    total = float(sp.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout.split()[0]) / 1024  # GiB
    forwarded = ["--height", str(args.height), "--width", str(args.width), "--text-len", str(args.text_len),
                 "--valid-text", str(args.valid_text), "--iters", str(args.iters), "--repeats", str(args.repeats),
                 "--prefetch", str(args.prefetch), "--precision", args.precision, "--settle-s", str(args.settle_s)]
    forwarded += ["--num-layers", str(args.num_layers)] if args.num_layers else []
    rows = _subprocess_rows(args, "krea2-offload-jax", forwarded + ["--resident", "all"])
    fraction = f"{args.device_memory_gb * 1e9 / 2**30 / total:.3f}"
    for resident in args.resident:
        rows += _subprocess_rows(args, "krea2-offload-jax", forwarded + ["--resident", resident],
                                 env={"XLA_PYTHON_CLIENT_MEM_FRACTION": fraction})
    base = rows[0].get("s_per_step")  # every block resident, uncapped
    print(f"\nKrea 2 step with weight streaming, {args.height}x{args.width}; capped runs: {args.device_memory_gb} GB")
    # the slowest repeat beside the median: session 6's capped runs had a first repeat 60x slower than the others
    print(f"{'implementation':<58} {'s/step':>8} {'slowest':>8} {'exposed wait':>13} {'peak GB':>8} {'limit GB':>9}")
    for r in rows:
        if "error" in r or "s_per_step" not in r:
            print(f"{r.get('name', '?'):<58} error: {r.get('error')}")
            continue
        wait = f"{(r['s_per_step'] - base) / r['s_per_step']:12.1%}" if base else f"{'':>12}"
        print(f"{r['name']:<58} {r['s_per_step']:8.4f} {max(r['repeats_s']):8.4f} {wait:>13} {r['peak_gb']:8.1f} "
              f"{r['limit_gb']:9.1f}")
    for r in rows:
        if "copy_ms" in r:
            print(f"  {r['name']}: a streamed block's {r['block_gb']:.2f} GB copy alone {r['copy_ms']:.1f} ms "
                  f"({r['copy_gb_s']:.0f} GB/s), a block alone {r['block_ms']:.1f} ms, a block beside the copy "
                  f"{r['block_and_copy_ms']:.1f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def krea2_profile(args) -> None:
    """Where a Krea 2 step's GPU time goes: the step (--precision, --attention, stacked, text fused once) under
    jax.profiler for --iters steps; the perfetto trace's GPU kernels summed by name, per step, largest first. The
    trace stays in --trace-dir (open it in ui.perfetto.dev)."""
    import collections
    import gzip

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mxdit.model.krea2 import Krea2Transformer
    from mxdit.model.pipelines import prepare_transformer

    cfg = _config(args)
    model = prepare_transformer(Krea2Transformer(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), args.precision)
    model.attention = args.attention
    hidden, text, timestep, position_ids, mask = (jnp.asarray(a) for a in _krea2_inputs(
        cfg, args.height, args.width, args.text_len, args.valid_text))
    text = jax.jit(model.fuse_text)(text.astype(jnp.bfloat16), mask)
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda state, *inputs: nnx.merge(graphdef, state)(*inputs))
    inputs = (hidden.astype(jnp.bfloat16), text, timestep, position_ids, mask)
    jax.block_until_ready(step(state, *inputs))  # compile outside the trace
    jax.profiler.start_trace(args.trace_dir, create_perfetto_trace=True)
    for _ in range(args.iters):
        out = step(state, *inputs)
    jax.block_until_ready(out)
    jax.profiler.stop_trace()
    traces = sorted(Path(args.trace_dir).rglob("perfetto_trace.json.gz"), key=lambda f: f.stat().st_mtime)
    if not traces:
        raise SystemExit(f"no perfetto trace under {args.trace_dir}")
    events = json.load(gzip.open(traces[-1]))
    events = events["traceEvents"] if isinstance(events, dict) else events
    gpu = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
           and "GPU" in e.get("args", {}).get("name", "")}
    total, count = collections.defaultdict(float), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu:
            total[e["name"]] += e["dur"] / 1e3 / args.iters  # ms a step
            count[e["name"]] += 1
    print(f"\nKrea 2 step profile ({args.precision}, {args.attention} attention, {args.height}x{args.width}, text "
          f"{args.text_len}): {sum(total.values()):.1f} ms of GPU kernels a step; trace {traces[-1]}")
    print(f"{'ms/step':>8} {'calls/step':>10}  kernel")
    for name, ms in sorted(total.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"{ms:8.2f} {count[name] / args.iters:10.0f}  {name[:100]}")
    # Idle time between kernels: the span the kernels cover minus the time some kernel ran, and which kernels the
    # idle gaps come before (a launch the GPU waited for).
    spans = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("ph") == "X"
                   and e.get("pid") in gpu)
    if not spans:
        return
    busy, gaps, end = 0.0, collections.defaultdict(float), spans[0][0]
    for start, stop, name in spans:
        if start > end:
            gaps[name] += (start - end) / 1e3 / args.iters
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    span = (end - spans[0][0]) / 1e3 / args.iters
    print(f"\nGPU timeline: {span:.1f} ms a step, a kernel running {busy / 1e3 / args.iters:.1f} ms, idle "
          f"{sum(gaps.values()):.1f} ms (between steps included); idle before:")
    for name, ms in sorted(gaps.items(), key=lambda kv: -kv[1])[:10]:
        print(f"{ms:8.2f}  {name[:100]}")


def _dispatch_loop(step, state, x, text, timestep, n):
    """n steps, one jitted call each, without waiting in between (as the pipeline's loop runs)."""
    for i in range(n):
        x = step(state, x, text, timestep + 1e-4 * i)
    return x


def _torch_time(fn, inputs: dict, args, name: str, flops: float, warmup: int = 3) -> dict:
    """Median seconds per call of fn(**inputs) over args.repeats runs of args.iters calls, timed with CUDA events."""
    import torch

    def run(n):
        for _ in range(n):
            fn(**inputs)
        torch.cuda.synchronize()

    def seconds(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn(**inputs)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3

    row = {"name": name}
    try:
        with torch.inference_mode():
            row.update(_timed(run, args.iters, args.repeats, getattr(args, "settle_s", 0.0), warmup=warmup,
                              seconds=seconds))
        row["tflops"] = flops / row["s_per_step"] / 1e12
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    row["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
    print(json.dumps(row), flush=True)
    return row


def diffusers_krea2_step(args) -> list[dict]:
    """diffusers' Krea2Transformer2DModel eager (and torch.compile with --torch-compile), CUDA events."""
    import torch
    from diffusers import Krea2Transformer2DModel
    from diffusers.models.transformers.transformer_krea2 import Krea2RMSNorm

    cfg = _config(args)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = Krea2Transformer2DModel(**dataclasses.asdict(cfg)).eval()
    torch.set_default_dtype(torch.float32)
    for module in model.modules():  # as `_keep_in_fp32_modules` leaves them after from_pretrained
        if isinstance(module, Krea2RMSNorm):
            module.float()
    hidden, text, timestep, position_ids, mask = _krea2_inputs(cfg, args.height, args.width, args.text_len, args.valid_text)
    inputs = dict(
        hidden_states=torch.from_numpy(hidden).cuda().bfloat16(),
        encoder_hidden_states=torch.from_numpy(text).cuda().bfloat16(),
        timestep=torch.from_numpy(timestep).cuda().bfloat16(),
        position_ids=torch.from_numpy(position_ids).cuda(),
        encoder_attention_mask=torch.from_numpy(mask).cuda(),
        return_dict=False,
    )
    flops = _step_flops(cfg, hidden.shape[1], text.shape[1])

    results = [_torch_time(model, inputs, args, "diffusers eager bf16, masked", flops)]
    if args.torch_compile:
        results.append(_torch_time(torch.compile(model), inputs, args, "diffusers torch.compile bf16, masked", flops))
    return results


def jax_vae_decode(args) -> list[dict]:
    """Our VAE decodes with full-size random weights: tiled at the largest size first, so that the device's peak
    memory after it is the tiled decode's own; then untiled at each size, whose footprint is read from the compiled
    program. Run once per VAE, in its own process (`vae_decode` does)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mxdit.model.vae_flux import FluxVAE, FluxVAEConfig
    from mxdit.model.vae_qwenimage import QwenImageVAE, QwenImageVAEConfig

    classes = {"qwen": (QwenImageVAE, QwenImageVAEConfig), "flux": (FluxVAE, FluxVAEConfig)}
    rows = []
    for name in args.vaes:
        cls, config_cls = classes[name]
        vae = cls(config_cls(), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        variants = [(max(args.sizes), True)] + [(size, False) for size in args.sizes]
        for size, tiled in variants:
            row = {"name": f"jax {name} VAE decode bf16, {size}x{size}{', tiled' if tiled else ''}"}
            try:
                latents = jax.random.normal(jax.random.key(0), (1, size // 8, size // 8, 16), jnp.bfloat16)
                t0 = time.perf_counter()
                jax.block_until_ready(vae.decode(latents, tiled=tiled))
                row["compile_s"] = time.perf_counter() - t0
                times = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    jax.block_until_ready(vae.decode(latents, tiled=tiled))
                    times.append(time.perf_counter() - t0)
                row["s"] = statistics.median(times)
                if tiled:
                    row["peak_gb"] = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0) / 1e9
                else:  # the compiled program's own footprint: weights, temporaries, output
                    from mxdit.model import vae_flux, vae_qwenimage

                    fn = (vae_qwenimage._decode_fn if name == "qwen" else vae_flux._decode_fn)
                    mem = fn.lower(vae, latents).compile().memory_analysis()
                    row["peak_gb"] = (mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes) / 1e9
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            print(json.dumps(row), flush=True)
            rows.append(row)
        del vae
    return rows


def diffusers_vae_decode(args) -> list[dict]:
    import torch
    from diffusers import AutoencoderKL, AutoencoderKLQwenImage

    rows = []
    for name in args.vaes:
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("cuda"):
            if name == "qwen":
                vae = AutoencoderKLQwenImage().eval()
            else:
                vae = AutoencoderKL(
                    block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
                    up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=2, latent_channels=16,
                    use_quant_conv=False, use_post_quant_conv=False, sample_size=1024).eval()
        torch.set_default_dtype(torch.float32)
        for size in args.sizes:
            row = {"name": f"diffusers {name} VAE decode bf16, {size}x{size}"}
            try:
                shape = (1, 16, 1, size // 8, size // 8) if name == "qwen" else (1, 16, size // 8, size // 8)
                latents = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
                torch.cuda.reset_peak_memory_stats()
                with torch.inference_mode():
                    t0 = time.perf_counter()
                    vae.decode(latents)
                    torch.cuda.synchronize()
                    row["compile_s"] = time.perf_counter() - t0
                    times = []
                    for _ in range(args.repeats):
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record()
                        vae.decode(latents)
                        end.record()
                        torch.cuda.synchronize()
                        times.append(start.elapsed_time(end) / 1e3)
                row["s"] = statistics.median(times)
                row["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            print(json.dumps(row), flush=True)
            rows.append(row)
        del vae
        torch.cuda.empty_cache()
    return rows


def vae_decode(args) -> None:
    common = ["--sizes", *map(str, args.sizes), "--repeats", str(args.repeats)]
    rows = _subprocess_rows(args, "vae-decode-diffusers", ["--vaes", *args.vaes, *common]) if args.diffusers else []
    for name in args.vaes:
        rows += _subprocess_rows(args, "vae-decode-jax", ["--vaes", name, *common])
    print("\nVAE decode (random full-size weights, bf16). Peak GB: diffusers, max allocated; JAX tiled, device peak;"
          " JAX untiled, the compiled program's weights + temporaries + output")
    print(f"{'implementation':<52} {'seconds':>8} {'peak GB':>8} {'warm-up s':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:<52} error: {r['error']}")
        else:
            peak = f"{r['peak_gb']:8.2f}" if "peak_gb" in r else f"{'-':>8}"
            print(f"{r['name']:<52} {r['s']:8.4f} {peak} {r['compile_s']:9.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def _subprocess_rows(args, command: str, forwarded: list[str], env: dict | None = None) -> list[dict]:
    """Run part of a benchmark in a subprocess (so frameworks and models never share GPU memory); its result rows.
    `env`: variables added to the subprocess's environment."""
    proc = subprocess.run([sys.executable, __file__, command, *forwarded], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if args.json:
        with Path(args.json).with_suffix(f".{command}.log").open("a") as log:
            log.write(f"$ {command} {' '.join(forwarded)}\n{proc.stderr}\n")
    if proc.returncode:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])[-600:] if proc.stderr else "failed"
        rows.append({"name": command, "error": f"exit {proc.returncode}: {tail}"})
    return rows


QWEN3VL_4B_TEXT = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6)


def jax_krea2_pipeline(args) -> list[dict]:
    """Our Krea 2 pipeline, full-size random bf16 weights (the demo tokenizer: the text is padded to 512 anyway), for
    each --precisions x --jax-attention: its transformer's block matrices quantized for the GEMM kernels (not bf16),
    projections stacked, as generate.py runs it; a cold run (compiles, or reads JAX_COMPILATION_CACHE_DIR) and
    --repeats warm ones."""
    import tempfile

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mxdit.model.krea2 import Krea2Transformer
    from mxdit.model.pipeline_krea2 import Krea2Pipeline, Krea2PipelineConfig
    from mxdit.model.pipelines import prepare_transformer
    from mxdit.model.qwen3vl_text import Qwen3VLTextConfig, Qwen3VLTextEncoder
    from mxdit.model.tokenizer import TextTokenizer, save_demo_tokenizer
    from mxdit.model.vae_qwenimage import QwenImageVAE, QwenImageVAEConfig

    cache_dir = os.environ.get("JAX_COMPILATION_CACHE_DIR")  # looked at before anything here compiles
    cache = "from the compile cache" if cache_dir and any(Path(cache_dir).iterdir()) else "compiles"
    t0 = time.perf_counter()
    rngs = nnx.Rngs(0)
    with tempfile.TemporaryDirectory(prefix="mxdit-bench-tokenizer-") as folder:  # read whole, then removed
        tokenizer = TextTokenizer.from_folder(save_demo_tokenizer(folder))
    pipe = Krea2Pipeline(
        Krea2Transformer(_config(args), dtype=jnp.bfloat16, rngs=rngs),
        QwenImageVAE(QwenImageVAEConfig(), dtype=jnp.bfloat16, rngs=rngs),
        Qwen3VLTextEncoder(Qwen3VLTextConfig(**QWEN3VL_4B_TEXT), dtype=jnp.bfloat16, rngs=rngs),
        tokenizer,
        Krea2PipelineConfig(is_distilled=True),
    )
    jax.block_until_ready(nnx.state(pipe.transformer))
    print(json.dumps({"jax_pipeline_init_s": time.perf_counter() - t0}), flush=True)
    base = pipe.transformer
    embeds, mask = pipe.encode_prompt([args.prompt], 512)
    text_tokens = pipe.trimmed_text(embeds, mask, args.height, args.width)[0].shape[1] if args.trim_text \
        else embeds.shape[1]
    print(json.dumps({"text_tokens": text_tokens, "real_text_tokens": int(np.asarray(mask).sum())}), flush=True)
    rows = []
    for precision in args.precisions:
        # a copy each: the quantization rules name the unstacked projections, so every precision starts from the
        # unstacked bf16 model (stacking it in place first left a later fp8 run's stacked matrices in bf16)
        transformer = prepare_transformer(nnx.clone(base), precision)
        pipe.transformer = transformer
        for attention in args.jax_attention:
            transformer.attention = attention
            for run in range(1 + args.repeats):
                out = pipe(args.prompt, height=args.height, width=args.width,
                           num_inference_steps=args.steps, trim_text=args.trim_text)
                label = f"cold ({cache})" if run == 0 else f"warm run {run}"
                row = {"name": f"jax {precision}, {attention} {label}", "text_tokens": text_tokens, **out.timings}
                print(json.dumps(row), flush=True)
                rows.append(row)
    rows.append({"name": "jax peak", "peak_gb": (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0) / 1e9})
    print(json.dumps(rows[-1]), flush=True)  # the parent reads the rows from this process's output
    return rows


def diffusers_krea2_pipeline(args) -> list[dict]:
    import tempfile

    import torch
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, Krea2Pipeline, Krea2Transformer2DModel
    from diffusers.models.transformers.transformer_krea2 import Krea2RMSNorm
    from transformers import PreTrainedTokenizerFast, Qwen3VLConfig, Qwen3VLModel

    from mxdit.model.tokenizer import save_demo_tokenizer

    t0 = time.perf_counter()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        transformer = Krea2Transformer2DModel(**dataclasses.asdict(_config(args))).eval()
        vae = AutoencoderKLQwenImage().eval()
        config = Qwen3VLConfig(text_config=dict(QWEN3VL_4B_TEXT, rope_parameters={
            "rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [24, 20, 20], "mrope_interleaved": True}),
            vision_config=dict(out_hidden_size=2560))
        text_encoder = Qwen3VLModel(config).eval()
    torch.set_default_dtype(torch.float32)
    for module in transformer.modules():
        if isinstance(module, Krea2RMSNorm):
            module.float()
    with tempfile.TemporaryDirectory(prefix="mxdit-bench-tokenizer-") as folder:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(save_demo_tokenizer(folder))
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=6400)
    pipe = Krea2Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                         transformer=transformer, is_distilled=True)
    pipe.set_progress_bar_config(disable=True)
    print(json.dumps({"diffusers_pipeline_init_s": time.perf_counter() - t0}), flush=True)
    prompt = args.prompt

    def timed(fn):
        torch.cuda.synchronize()
        t = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t, result

    rows = []
    with torch.inference_mode():
        for run in range(1 + args.repeats):
            text_s, _ = timed(lambda: pipe.encode_prompt(prompt, device="cuda"))
            latent_s, latents = timed(lambda: pipe(prompt, height=args.height, width=args.width,
                                                   num_inference_steps=args.steps, guidance_scale=0.0,
                                                   output_type="latent").images)
            total_s, _ = timed(lambda: pipe(prompt, height=args.height, width=args.width,
                                            num_inference_steps=args.steps, guidance_scale=0.0))
            row = {"name": f"diffusers pipeline {'cold' if run == 0 else f'warm run {run}'}", "text encode": text_s,
                   "denoise": latent_s - text_s, "decode": total_s - latent_s, "total": total_s}
            print(json.dumps(row), flush=True)
            rows.append(row)
    rows.append({"name": "diffusers peak", "peak_gb": torch.cuda.max_memory_allocated() / 1e9})
    print(json.dumps(rows[-1]), flush=True)
    return rows


def krea2_pipeline(args) -> None:
    """diffusers, then ours in two processes sharing a fresh compilation cache: the first compiles (cold), the
    second starts from the cache on disk (cold, as a second run of generate.py starts)."""
    import tempfile

    forwarded = ["--height", str(args.height), "--width", str(args.width), "--steps", str(args.steps),
                 "--repeats", str(args.repeats), "--prompt", args.prompt] + (
                     ["--num-layers", str(args.num_layers)] if args.num_layers else [])
    rows = _subprocess_rows(args, "krea2-pipeline-diffusers", forwarded) if args.diffusers else []
    ours = forwarded + ["--precisions", *args.precisions, "--jax-attention", *args.jax_attention]
    ours += [] if args.trim_text else ["--no-trim-text"]
    with tempfile.TemporaryDirectory(prefix="mxdit-bench-cache-") as cache_dir:
        cache = {"JAX_COMPILATION_CACHE_DIR": cache_dir, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5"}
        for _ in range(2 if args.cached_too else 1):  # the second process finds what the first compiled
            rows += _subprocess_rows(args, "krea2-pipeline-jax", ours, env=cache)
    print(f"\nKrea 2 Turbo pipeline, {args.height}x{args.width}, {args.steps} steps, random full-size bf16 weights")
    print(f"{'run':<34}{'text encode':>12}{'denoise':>9}{'decode':>8}{'total':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:<34} error: {r['error']}")
        elif "total" in r:
            print(f"{r['name']:<34}{r['text encode']:12.3f}{r['denoise']:9.3f}{r.get('decode', 0):8.3f}{r['total']:8.3f}")
        elif "peak_gb" in r:
            print(f"{r['name']:<34} peak device memory {r['peak_gb']:.1f} GB")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def _flux_inputs(cfg, height: int, width: int, text_len: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    grid_h, grid_w = height // 16, width // 16
    hidden = rng.standard_normal((1, grid_h * grid_w, cfg.in_channels), np.float32)
    text = rng.standard_normal((1, text_len, cfg.joint_attention_dim), np.float32)
    pooled = rng.standard_normal((1, cfg.pooled_projection_dim), np.float32)
    img_ids = np.zeros((grid_h, grid_w, 3), np.float32)
    img_ids[..., 1], img_ids[..., 2] = np.arange(grid_h)[:, None], np.arange(grid_w)[None, :]
    return hidden, text, pooled, img_ids.reshape(-1, 3), np.zeros((text_len, 3), np.float32)


def _flux_flops(cfg, image_len: int, text_len: int) -> float:
    d, seq = cfg.inner_dim, image_len + text_len
    double = 2 * seq * (4 * d * d + 8 * d * d) + 4 * seq * seq * d  # qkv+out and MLP, both streams; attention
    single = 2 * seq * (3 * d * d + 4 * d * d + 5 * d * d) + 4 * seq * seq * d
    return cfg.num_layers * double + cfg.num_single_layers * single


def jax_flux_step(args) -> list[dict]:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mxdit.model.flux import FluxConfig, FluxTransformer
    from mxdit.model.pipelines import prepare_transformer

    cfg = FluxConfig()
    base = FluxTransformer(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    hidden, text, pooled, img_ids, txt_ids = _flux_inputs(cfg, args.height, args.width, args.text_len)
    hidden, text, pooled = (jnp.asarray(a, jnp.bfloat16) for a in (hidden, text, pooled))
    img_ids, txt_ids = jnp.asarray(img_ids), jnp.asarray(txt_ids)
    rows = []
    for precision, attention in itertools.product(args.precisions, args.jax_attention):
        # as generate.py prepares it: the blocks' matrices quantized (not bf16), then stacked (--stacked yes)
        model = prepare_transformer(nnx.clone(base), precision, stack=args.stacked)
        model.attention = attention
        graphdef, state = nnx.split(model)

        @jax.jit
        def step(state, x, t, graphdef=graphdef):
            m = nnx.merge(graphdef, state)
            v = m(x, text, pooled, jnp.full((1,), t), img_ids, txt_ids, jnp.full((1,), 3.5))
            return (x + 1e-3 * v).astype(x.dtype)

        row = {"name": f"jax FLUX.1-dev {precision}{' stacked' if args.stacked else ''}, {model.attention} "
                       f"attention, a dispatch per step"}

        def steps(n, step=step, state=state):  # bound now: `state` is deleted below
            x = hidden
            for i in range(n):
                x = step(state, x, 0.9 - 0.01 * i)
            return jax.block_until_ready(x)

        try:
            row.update(_timed(steps, args.iters, args.repeats, args.settle_s))
            row["tflops"] = _flux_flops(cfg, hidden.shape[1], text.shape[1]) / row["s_per_step"] / 1e12
        except Exception as e:  # record and go on with the other precisions
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        row["peak_gb"] = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0) / 1e9
        print(json.dumps(row), flush=True)
        rows.append(row)
        del model, state
    return rows


def diffusers_flux_step(args) -> list[dict]:
    import torch
    from diffusers import FluxTransformer2DModel

    from mxdit.model.flux import FluxConfig

    cfg = FluxConfig()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = FluxTransformer2DModel(**{k: v for k, v in dataclasses.asdict(cfg).items()}).eval()
    torch.set_default_dtype(torch.float32)
    hidden, text, pooled, img_ids, txt_ids = _flux_inputs(cfg, args.height, args.width, args.text_len)
    to = lambda a, dtype=torch.bfloat16: torch.from_numpy(a).cuda().to(dtype)
    inputs = dict(hidden_states=to(hidden), encoder_hidden_states=to(text), pooled_projections=to(pooled),
                  timestep=torch.full((1,), 0.5, device="cuda", dtype=torch.bfloat16), img_ids=to(img_ids, torch.float32),
                  txt_ids=to(txt_ids, torch.float32), guidance=torch.full((1,), 3.5, device="cuda"), return_dict=False)
    flops = _flux_flops(cfg, hidden.shape[1], text.shape[1])
    return [_torch_time(model, inputs, args, "diffusers FLUX.1-dev eager bf16", flops, warmup=2)]


# --------------------------------------------------------------------------------------------------------------------
# GEMM kernels (issue #7)

PRECISION_CHOICES = ["bf16", "fp8", "mxfp8", "mxfp6", "mxfp4", "int8"]  # model.layers.PRECISIONS (imported late)
ATTENTION_CHOICES = ["cudnn", "xla", "int8", "int8_fp8", "int8_mosaic", "int8_mosaic_fp8"]  # layers.ATTENTION_KERNELS
GEMM_SHAPES = ["4608x6144x6144", "4608x6144x18432", "4608x6144x32768", "4608x16384x6144", "1024x6144x6144",
               "16384x6144x6144"]


def _cupti_seconds(fn, *inputs, iterations: int, by_kernel: bool = False):
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


def _energy_per_call(fn, *args, seconds: float = 2.5, kernels_per_call: int = 1) -> dict:
    """Energy and time a kernel at the power cap: `fn(*args)` dispatched back to back for ~`seconds` after a quarter
    of that untimed (`_timed`, the calls as its steps). `kernels_per_call`: the kernels one call runs (short kernels
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
    timed = _timed(run, calls, 1, settle_s=seconds / 4, warmup=0)  # compiled and warm already
    row = {"kernels": calls * kernels_per_call, "us_per_kernel": timed["s_per_step"] / kernels_per_call * 1e6,
           "sm_mhz_median": timed.get("sm_mhz_median")}
    if "joules_per_step" in timed:
        row.update(mj_per_kernel=timed["joules_per_step"] / kernels_per_call * 1e3,
                   power_w_mean=timed["power_w_mean"])
    return row


def krea2_gemm_shapes(cfg) -> dict[str, tuple[int, int, str]]:
    """A Krea 2 block's products as the fp8 stacked step runs them: name -> (k, n, epilogue)."""
    d, kv, f = cfg.hidden_size, cfg.num_key_value_heads * cfg.attention_head_dim, cfg.intermediate_size
    return {"QKVG GEMM": (d, 2 * d + 2 * kv, "none"), "SwiGLU GEMM": (d, 2 * f, "swiglu"),
            "out GEMM + gated residual": (d, d, "residual"), "down GEMM + gated residual": (f, d, "residual")}


def krea2_energy(args) -> None:
    """Energy a kernel of the fp8 Krea 2 step at the H200's power cap (NOTES.md, session 14: the step is bound by its
    energy, ~75 J a step at 700 W): each kernel on its own in a ~2.5 s loop, random inputs of the step's shapes, and
    the joules a step its calls take (28 blocks). The GPU clocks each kernel alone as the cap allows, which is not
    quite the step's clock: compare kernels and variants, and the sum with `krea2-step`'s J a step."""
    import jax
    import jax.numpy as jnp

    from mxdit.model import layers
    from mxdit.pallas_kernels import activations, gemm

    print(json.dumps({"device": str(jax.devices()[0]), "backend": jax.default_backend()}), flush=True)
    cfg = _config(args)
    m = (args.height // 16) * (args.width // 16) + args.text_len
    blocks = cfg.num_layers
    keys = iter(jax.random.split(jax.random.key(0), 64))
    rows = []

    def record(name, per_step, fn, *inputs, kernels_per_call=1):
        row = {"name": name, "calls_per_step": per_step}
        try:
            row.update(_energy_per_call(fn, *inputs, seconds=args.seconds, kernels_per_call=kernels_per_call))
            if "mj_per_kernel" in row:
                row["j_per_step"] = row["mj_per_kernel"] * per_step / 1e3
        except Exception as e:  # record and go on with the other kernels
            row["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
        print(json.dumps(row), flush=True)
        rows.append(row)

    for name, (k, n, epilogue) in krea2_gemm_shapes(cfg).items():
        w = jax.random.normal(next(keys), (n, k), jnp.float32) * k**-0.5
        if epilogue == "swiglu":
            weight = gemm.swiglu_weight(*(gemm.prepare_weight(half, "fp8_e4m3") for half in (w[: n // 2], w[n // 2:])))
        else:
            weight = gemm.prepare_weight(w, "fp8_e4m3")
        del w
        xq, xs = gemm.quantize_activations(jax.random.normal(next(keys), (m, k), jnp.float32))
        extra = {} if epilogue != "residual" else {
            "residual": jax.random.normal(next(keys), (m, n), jnp.bfloat16),
            "gate": jax.random.normal(next(keys), (n,), jnp.float32)}
        config = gemm.default_mosaic_config(m, n, k, False, residual=epilogue == "residual")
        if args.cluster_n > 1 and n % (config.tile_n * args.cluster_n) == 0:
            config = dataclasses.replace(config, cluster_n=args.cluster_n)
        product = jax.jit(lambda xq, xs, weight, extra, config=config, epilogue=epilogue: gemm.scaled_matmul(
            xq, weight, xs, activation="swiglu" if epilogue == "swiglu" else "none", config=config, **extra))
        record(name + (f" (cluster {config.cluster_n})" if config.cluster_n > 1 else ""), blocks, product, xq, xs,
               weight, extra)
        if epilogue == "swiglu":  # the reference: cuBLAS's FP8 GEMM, no scales, bf16 out
            xla_dot = jax.jit(lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                                                                 preferred_element_type=jnp.bfloat16))
            record("  (XLA's FP8 dot at the SwiGLU GEMM's shape, for reference)", 0, xla_dot, xq, weight.data)
        del weight, extra

    h, hk, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.attention_head_dim
    stacked = jax.random.normal(next(keys), (1, m, (2 * h + 2 * hk) * dh), jnp.bfloat16)
    norm_q, norm_k = (0.1 * jax.random.normal(next(keys), (dh,), jnp.float32) for _ in range(2))
    positions = _krea2_inputs(cfg, args.height, args.width, args.text_len, args.valid_text)[3]  # text, then image
    rotary = layers.rotary_tables(jnp.asarray(np.roll(positions, -args.text_len, axis=0)), cfg.axes_dims_rope,
                                  cfg.rope_theta)  # the model's order: image, then text (its padding last)
    lengths = jnp.array([m - (args.text_len - args.valid_text)], jnp.int32)
    attend = jax.jit(lambda qkv: layers.int8_attention_from_stacked(qkv, h, hk, norm_q, norm_k, cfg.norm_eps, rotary,
                                                                    lengths, implementation=args.attention))
    record(f"attention ({args.attention}, with its prologue passes)", blocks, attend, stacked)
    del stacked

    r = 16  # distinct inputs a dispatch: the row kernels take ~40-60 us each
    d, f = cfg.hidden_size, cfg.intermediate_size
    xs_rows = [jax.random.normal(k_, (1, m, d), jnp.bfloat16) for k_ in jax.random.split(next(keys), r)]
    weight = 0.1 * jax.random.normal(next(keys), (d,), jnp.float32)
    scale, shift = (0.1 * jax.random.normal(next(keys), (1, 1, d), jnp.bfloat16) for _ in range(2))
    norm_rows = args.norm_rows or [None]  # None: the model's (`activations.ROWS_PER_PROGRAM`)
    for rows_per_program in norm_rows:  # the first one's energy enters the sum
        record("modulated_rms_norm_fp8" + (f" ({rows_per_program} rows a program)" if rows_per_program else ""),
               2 * blocks if rows_per_program == norm_rows[0] else 0, jax.jit(lambda xs, rows=rows_per_program: [
                   activations.modulated_rms_norm_fp8(x, weight, scale, shift, cfg.norm_eps, rows_per_program=rows)
                   for x in xs]), xs_rows, kernels_per_call=r)
    hs = [jax.random.normal(k_, (1, m, f), jnp.bfloat16) for k_ in jax.random.split(next(keys), r)]
    record("tokens_fp8", blocks, jax.jit(lambda hs: [activations.tokens_fp8(x) for x in hs]), hs, kernels_per_call=r)
    del hs
    qkvg = [jax.random.normal(k_, (1, m, 2 * d + 2 * hk * dh), jnp.bfloat16) for k_ in jax.random.split(next(keys), r)]
    record("sigmoid_gated_fp8", blocks, jax.jit(lambda xs, st: [
        activations.sigmoid_gated_fp8(x, g, d + 2 * hk * dh) for x, g in zip(xs, st)]), xs_rows, qkvg,
        kernels_per_call=r)

    total = sum(r_.get("j_per_step", 0.0) for r_ in rows)
    print(f"\nKrea 2 fp8 step's kernels alone at the power cap, {m} tokens ({blocks} blocks)")
    print(f"{'kernel':<62} {'calls':>5} {'us':>8} {'mJ':>7} {'W':>5} {'MHz':>5} {'J/step':>7}")
    for r_ in rows:
        if "error" in r_:
            print(f"{r_['name']:<62} error: {r_['error']}")
            continue
        print(f"{r_['name']:<62} {r_['calls_per_step']:5d} {r_['us_per_kernel']:8.1f} "
              f"{r_.get('mj_per_kernel', float('nan')):7.1f} {r_.get('power_w_mean', float('nan')):5.0f} "
              f"{r_['sm_mhz_median'] or 0:5.0f} {r_.get('j_per_step', float('nan')):7.2f}")
    print(f"{'sum':<62} {'':>5} {'':>8} {'':>7} {'':>5} {'':>5} {total:7.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def qk_prologue(args) -> None:
    """The INT8 attention's fused Q/K prologue (RMSNorm, rotary, K smoothing, INT8 per block: Krea 2's Q and K read
    in place from the stacked QKVG product) for each --heads-per-program x --warps x --split-pairs: CUPTI time of each
    kernel, and how far its codes and scales are from the first configuration's."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from mxdit.pallas_kernels import attention

    b, s, h, hk, d = 1, args.seq, args.heads, args.kv_heads, 128
    x = (jax.random.normal(jax.random.key(0), (b, s, 2 * h + 2 * hk, d), jnp.float32) * 3).astype(jnp.bfloat16)
    norms = jax.random.normal(jax.random.key(1), (2, d), jnp.float32) * 0.1
    angles = np.arange(s)[:, None] * (1.0 / 1000 ** (np.arange(0, d, 2) / d))
    cos, sin = (jnp.asarray(np.repeat(f(angles), 2, -1), jnp.float32) for f in (np.cos, np.sin))
    lengths = jnp.asarray([s - 8])
    print(f"\nQ/K prologue, {s} tokens, {h}/{hk} heads of {d}, stacked source; us per kernel (CUPTI)")
    first = None
    for group, warps, split in itertools.product(args.heads_per_program, args.warps, args.split_pairs):
        run = jax.jit(lambda x, norms, group=group, warps=warps, split=split: attention.int8_qk_prologue_stacked(
            x, h, hk, norms[0], norms[1], 1e-6, cos, sin, lengths, scale=d**-0.5, block_q=64, block_k=128,
            heads_per_program=group, num_warps=warps, split_pairs=split, interpret=jax.default_backend() != "gpu"))
        label = f"{group} heads a program, {warps} warps" + (", pairs split" if split else "")
        try:
            out = jax.block_until_ready(run(x, norms))
            total, kernels = _cupti_seconds(run, x, norms, iterations=args.iters, by_kernel=True)
        except Exception as e:  # a configuration that does not compile here
            print(f"{label:<40} error: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            continue
        first = first or out
        # Against the first configuration: a different reduction order (warps, heads a program) may round a block's
        # RMS or maximum differently, moving a few codes by one; anything more is a bug.
        codes = [(np.asarray(a, np.int32), np.asarray(b_, np.int32)) for a, b_ in zip(out[0::2], first[0::2])]
        differ = sum(int(np.sum(a != b_)) for a, b_ in codes) / sum(a.size for a, _ in codes)
        furthest = max(int(np.max(np.abs(a - b_))) for a, b_ in codes)
        scales = max(float(np.max(np.abs(np.asarray(a) / np.asarray(b_) - 1))) for a, b_ in zip(out[1::2], first[1::2]))
        parts = ", ".join(f"{name[:24]} {t * 1e6:.1f}"
                          for name, t in sorted(kernels.items(), key=lambda kv: -kv[1]))
        print(f"{label:<40} total {total * 1e6:7.1f}  codes differing {differ:.1e} (at most {furthest}), scales "
              f"{scales:.1e}  {parts}")


def jax_gemm(args) -> list[dict]:
    """XLA's bf16 and FP8 dots and our kernels on each shape; errors against the float32 product of the dequantized
    operands."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from mxdit.pallas_kernels import gemm

    rows = []

    def record(name, shape, flops, fn, inputs, check=None):
        row = {"name": name, "shape": shape}
        try:
            t0 = time.perf_counter()
            out = jax.block_until_ready(fn(*inputs))
            row["compile_s"] = time.perf_counter() - t0
            seconds, kernels = _cupti_seconds(fn, *inputs, iterations=args.iters, by_kernel=True)
            row.update(s=seconds, tflops=flops / seconds / 1e12, kernels=kernels)
            if check is not None:
                row["rel_err"] = float(jnp.linalg.norm(out.astype(jnp.float32) - check)
                                       / jnp.linalg.norm(check))
        except Exception as e:  # one failing variant must not hide the others' figures
            row["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"
        print(json.dumps(row), flush=True)
        rows.append(row)

    for shape in args.shapes:
        m, k, n = map(int, shape.split("x"))
        flops = 2.0 * m * k * n
        kx, kw = jax.random.split(jax.random.key(0))
        x = jax.random.normal(kx, (m, k), jnp.bfloat16)
        w = (jax.random.normal(kw, (n, k), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
        x8, sx = gemm.quantize_activations(x, "token")
        xb8, sxb = gemm.quantize_activations(x, "block")
        xi8, sxi = gemm.quantize_activations(x, "token", "int8")
        w_fp8 = gemm.prepare_weight(w, "fp8_e4m3")

        def reference(xq, xs, wq):
            return gemm.scaled_matmul_reference(xq, xs, wq, out_dtype=jnp.float32)

        ref_token = jax.jit(reference)(x8, sx, w_fp8)
        record("XLA bf16 dot", shape, flops, jax.jit(lambda a, b: a @ b.T), (x, w))
        record("XLA fp8 dot, bf16 out (no scales)", shape, flops,
               jax.jit(lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                                                        preferred_element_type=jnp.bfloat16)), (x8, w_fp8.data))

        @jax.jit
        def xla_fp8_scaled(a, sa, b, sb):
            y = jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16)
            return (y.astype(jnp.float32) * sa[:, None] * sb[None, :]).astype(jnp.bfloat16)

        record("XLA fp8 dot + separate per-token/channel scaling", shape, flops, xla_fp8_scaled,
               (x8, sx, w_fp8.data, w_fp8.scale), ref_token)
        record("quantize x per token (bf16 -> fp8), one pass", shape, flops,
               jax.jit(lambda a: gemm.quantize_activations(a, "token")), (x,))
        record("quantize x per 1x128 block, one pass", shape, flops,
               jax.jit(lambda a: gemm.quantize_activations(a, "block")), (x,))
        record("XLA int8 dot, int32 out", shape, flops,
               jax.jit(lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                                                        preferred_element_type=jnp.int32)), (xi8, w_fp8.data.astype(jnp.int8)))

        def ours(name, xq, xs, wq, backend, config=None, check=None):
            fn = jax.jit(lambda a, s, ww: gemm.scaled_matmul(a, ww, s, backend=backend, config=config))
            if check is None:
                check = jax.jit(reference)(xq, xs, wq)
            record(f"{backend} {name}" + (f" {config}" if config is not None and args.sweep else ""), shape, flops,
                   fn, (xq, xs, wq), check)

        sweep = args.sweep and (shape == args.shapes[0] or m <= 2048)
        # Earlier sweeps (pallas_kernels/NOTES.md) chose the defaults; these are the alternatives still worth a look.
        mosaic_token = [None, gemm.MosaicConfig(64, 128, 4, compute_wgs=3),
                        gemm.MosaicConfig(64, 256, 3, compute_wgs=2, epi_tile_n=128),
                        gemm.MosaicConfig(64, 256, 3, compute_wgs=2, epi_tile_n=128, cluster_n=2)] if sweep else [None]
        mosaic_block = [None, gemm.MosaicConfig(64, 128, 4, compute_wgs=2),
                        gemm.MosaicConfig(64, 64, 4, compute_wgs=3)] if sweep else [None]
        if "mosaic" in args.backends:
            for cfg in mosaic_token:
                ours("fp8 x per token, w per channel", x8, sx, w_fp8, "mosaic", cfg, ref_token)
            for cfg in mosaic_block:
                if cfg is None or m % (cfg.compute_wgs * cfg.tile_m) == 0:  # no padding
                    ours("fp8 x per 1x128 block, w per channel", xb8, sxb, w_fp8, "mosaic", cfg)
            for fmt in ("mxfp8_e4m3", "mxfp6_e2m3", "mxfp4_e2m1"):
                # MX weights folded to E4M3 with one power-of-two scale per 128x128 tile (exact for ordinary weights:
                # the fold_err rows), so the promotion is one scalar a K step.
                wq = gemm.prepare_weight(w, fmt, backend="mosaic", mx_fold_rows=128)
                configs = [None] + ([gemm.MosaicConfig(64, 128, 4, compute_wgs=2)]
                                    if sweep and fmt == "mxfp4_e2m1" else [])
                for cfg in configs:
                    ours(f"fp8 x per token, w {fmt} folded to fp8 x 128x128", x8, sx, wq, "mosaic", cfg)
                if fmt == "mxfp4_e2m1":
                    ours(f"fp8 x per 1x128 block, w {fmt} folded to fp8 x 128x128", xb8, sxb, wq, "mosaic")
            if shape == args.shapes[0]:
                # The fused epilogue: residual + gate * gelu(x @ w^T + bias), against the reference.
                kb, kg, kr = jax.random.split(jax.random.key(1), 3)
                bias, gate = jax.random.normal(kb, (n,)), jax.random.normal(kg, (n,))
                residual = jax.random.normal(kr, (m, n), jnp.bfloat16)
                for xq, xs, label in ((x8, sx, "per token"), (xb8, sxb, "per 1x128 block")):
                    check = gemm.scaled_matmul_reference(xq, xs, w_fp8, bias=bias, activation="gelu_tanh",
                                                         residual=residual, gate=gate, out_dtype=jnp.float32)
                    record(f"mosaic fp8 x {label} + epilogue residual + gate * gelu(. + bias)", shape, flops,
                           jax.jit(lambda a, s, ww, b, g, r: gemm.scaled_matmul(
                               a, ww, s, bias=b, activation="gelu_tanh", gate=g, residual=r, backend="mosaic")),
                           (xq, xs, w_fp8, bias, gate, residual), check)
                # The gated residual (Krea 2's out and down projections), its residual fetched after or during the
                # main loop (session 6: 64x128 in 3 warpgroups 270 / 261 us, 64x256 in 2 with prefetch 259 at M = 4224)
                check = gemm.scaled_matmul_reference(x8, sx, w_fp8, residual=residual, gate=gate, out_dtype=jnp.float32)
                for cfg in ([None, gemm.MosaicConfig(64, 128, 4, compute_wgs=3),
                             gemm.MosaicConfig(64, 128, 4, compute_wgs=3, prefetch_residual=True)] if sweep else [None]):
                    record("mosaic fp8 x per token + epilogue residual + gate * ." + (f" {cfg}" if cfg else ""),
                           shape, flops, jax.jit(lambda a, s, ww, g, r, cfg=cfg: gemm.scaled_matmul(
                               a, ww, s, gate=g, residual=r, backend="mosaic", config=cfg)),
                           (x8, sx, w_fp8, gate, residual), check)
                # SwiGLU (Krea 2's gate/up, N = 2 x hidden): the stacked product, then SwiGLU + FP8 in one pass,
                # against SwiGLU in the epilogue, then FP8 per token (session 7: 1409 vs 1355 us at 4224x6144x32768)
                if n % (2 * gemm.SWIGLU_WIDTH) == 0:
                    from mxdit.pallas_kernels import activations

                    halves = (gemm.prepare_weight(w[: n // 2], "fp8_e4m3"), gemm.prepare_weight(w[n // 2:], "fp8_e4m3"))
                    stacked, paired = gemm.concat_weights(list(halves)), gemm.swiglu_weight(*halves)
                    unfused = jax.jit(lambda a, s, ww: activations.swiglu_fp8(gemm.scaled_matmul(
                        a, ww, s, backend="mosaic")[None]))
                    fused = jax.jit(lambda a, s, ww: activations.tokens_fp8(gemm.scaled_matmul(
                        a, ww, s, activation="swiglu", backend="mosaic")[None]))
                    record("mosaic fp8 gate/up product, then swiglu_fp8", shape, flops, unfused, (x8, sx, stacked))
                    record("mosaic fp8 gate/up with SwiGLU in the epilogue, then tokens_fp8", shape, flops, fused,
                           (x8, sx, paired))
                    if "error" not in rows[-1] and "error" not in rows[-2]:
                        codes = [np.asarray(f(x8, sx, ww)[0].astype(jnp.float32))
                                 for f, ww in ((unfused, stacked), (fused, paired))]
                        rows[-1]["codes_equal"] = float(np.mean(codes[0] == codes[1]))
                # The fast activation quantizer must give quant.formats' bits on the GPU too.
                fast, _ = jax.jit(lambda a: gemm.quantize_activations(a, "token"))(x)
                exact = jax.jit(lambda a: gemm.quantize(a.astype(jnp.float32), "fp8_e4m3").data)(x)
                row = {"name": "fast activation quantizer: bytes differing from quant.formats", "shape": shape,
                       "mismatches": int(jnp.sum(jax.lax.bitcast_convert_type(fast, jnp.uint8)
                                                 != jax.lax.bitcast_convert_type(exact, jnp.uint8)))}
                print(json.dumps(row), flush=True)
                rows.append(row)
        if "triton" in args.backends:
            triton_fp8 = [gemm.TritonConfig(128, 128, 8, 3), gemm.TritonConfig(128, 256, 8, 3),
                          gemm.TritonConfig(64, 128, 4, 4)] if sweep else [None]
            for cfg in triton_fp8:
                ours("fp8 x per token, w per channel", x8, sx, w_fp8, "triton", cfg, ref_token)
            ours("fp8 x per 1x128 block, w per channel", xb8, sxb, w_fp8, "triton")
            w_int8 = gemm.prepare_weight(w, "int8", backend="triton")
            ours("int8 x per token, w int8 per channel", xi8, sxi, w_int8, "triton")
            triton_mx = [gemm.TritonConfig(128, 64, 4, 3), gemm.TritonConfig(64, 64, 4, 3),
                         gemm.TritonConfig(64, 128, 4, 2)] if sweep else [None]
            for fmt in ("mxfp8_e4m3", "mxfp6_e2m3", "mxfp4_e2m1"):
                wq = gemm.prepare_weight(w, fmt, backend="triton")
                for cfg in (triton_mx if fmt == "mxfp4_e2m1" else [None]):
                    ours(f"fp8 x per token, w {fmt} unpacked in kernel", x8, sx, wq, "triton", cfg)
        # MX folding: how far the folded weight is from the MX weight it stands for.
        for fmt in ("mxfp8_e4m3", "mxfp6_e2m3", "mxfp4_e2m1"):
            q = jax.jit(lambda a: gemm.quantize(a, fmt))(w.astype(jnp.float32))
            for fold_rows in (1, 128):
                row = {"name": f"fold {fmt} -> fp8 x {fold_rows}x128: rel L2 vs the MX weight", "shape": shape,
                       "fold_err": gemm.fold_mx_error(q, rows=fold_rows)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def torch_gemm(args) -> list[dict]:
    """torch's bf16 matmul and `_scaled_mm` (FP8, row-wise and tensor-wise scales), CUDA events."""
    import torch

    rows = []
    for shape in args.shapes:
        m, k, n = map(int, shape.split("x"))
        flops = 2.0 * m * k * n
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
        sx = x.abs().amax(dim=1, keepdim=True).float() / 448
        sw = w.abs().amax(dim=1, keepdim=True).float() / 448
        x8 = (x / sx).to(torch.float8_e4m3fn)
        w8 = (w / sw).to(torch.float8_e4m3fn)
        one = torch.ones((), device="cuda")
        variants = {
            "torch bf16 matmul": (lambda: x @ w.t()),
            "torch _scaled_mm fp8 rowwise": (lambda: torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw.t(),
                                                                      out_dtype=torch.bfloat16)),
            "torch _scaled_mm fp8 tensorwise": (lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one,
                                                                         out_dtype=torch.bfloat16)),
        }
        for name, fn in variants.items():
            row = _torch_time(lambda: fn(), {}, args, name, flops, warmup=3)
            row.update(shape=shape, s=row.pop("s_per_step", None))
            rows.append(row)
    return rows


def gemm_benchmark(args) -> None:
    forwarded = ["--shapes", *args.shapes, "--iters", str(args.iters), "--repeats", str(args.repeats)]
    rows = _subprocess_rows(args, "gemm-torch", forwarded) if args.torch else []
    rows += _subprocess_rows(args, "gemm-jax", forwarded + ["--backends", *args.backends]
                             + (["--sweep"] if args.sweep else []))
    print(f"\n{'shape':<16} {'implementation':<84} {'TFLOP/s':>8} {'rel err':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r.get('shape', ''):<16} {r['name']:<84} error: {r['error']}")
        elif "fold_err" in r:
            print(f"{r['shape']:<16} {r['name']:<84} {'':>8} {r['fold_err']:8.1e}")
        elif r.get("s"):
            err = f"{r['rel_err']:8.1e}" if "rel_err" in r else f"{'':>8}"
            print(f"{r['shape']:<16} {r['name']:<84} {r['tflops']:8.0f} {err}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


# --------------------------------------------------------------------------------------------------------------------
# Attention kernels (issue #8)


def _with_module_setting(module, name: str, value, fn):
    """fn with `module.name` set to `value` while it runs (is traced, under jit), then restored."""
    def run(*args):
        before = getattr(module, name)
        setattr(module, name, value)
        try:
            return fn(*args)
        finally:
            setattr(module, name, before)

    return run


def jax_attention(args) -> list[dict]:
    """jax's cuDNN and XLA attention (bf16) and our INT8-QK kernel (Triton lowering), B=1, S=4608, 48 heads, D=128,
    GQA 48/12 and 48/48, with and without the key padding mask; cosine and relative L1 against float32 attention."""
    import jax
    import jax.numpy as jnp

    from mxdit.pallas_kernels import attention

    rows = []
    s, h, d = args.seq, 48, 128
    flops = 4.0 * s * s * d * h
    for kv_heads in args.kv_heads:
        kq, kk, kv = jax.random.split(jax.random.key(0), 3)
        # Drawn in float32, then rounded: normals drawn in bf16 take only 128 distinct values, and on those V's FP8
        # rounding errors repeat instead of averaging out (FP8 P.V measured 0.13 relative L1 on them, 0.04 on these).
        q = jax.random.normal(kq, (1, s, h, d), jnp.float32).astype(jnp.bfloat16)
        # K with a channel of large mean, as real DiTs have (what K smoothing is for)
        k = (jax.random.normal(kk, (1, s, kv_heads, d), jnp.float32) + 4.0 * (jnp.arange(d) == 7)).astype(jnp.bfloat16)
        v = jax.random.normal(kv, (1, s, kv_heads, d), jnp.float32)
        # V with channel means (--v-channel-means: their size against V's spread): what V smoothing is for
        v = (v + args.v_channel_means * jnp.sin(0.37 * jnp.arange(kv_heads * d)).reshape(kv_heads, d)).astype(
            jnp.bfloat16)
        for masked in (False, True):
            lengths = jnp.array([s - 512 + 120], jnp.int32) if masked else None  # 392 padded text tokens last
            exact = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
                q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), key_value_seq_lengths=lengths,
                implementation="xla"))(q, k, v)
            tag = f"GQA {h}/{kv_heads}" + (", masked" if masked else "")
            variants = {
                f"jax cuDNN bf16, {tag}": lambda q, k, v: jax.nn.dot_product_attention(
                    q, k, v, key_value_seq_lengths=lengths, implementation="cudnn"),
                f"jax XLA bf16, {tag}": lambda q, k, v: jax.nn.dot_product_attention(
                    q, k, v, key_value_seq_lengths=lengths, implementation="xla"),
            }
            for pv in ("bf16", "fp8"):
                for bq, bk, warps, stages in args.int8_configs:
                    variants[f"int8-QK {pv}-PV triton q{bq} k{bk} w{warps} s{stages}, {tag}"] = (
                        lambda q, k, v, bq=bq, bk=bk, warps=warps, stages=stages, pv=pv: attention.int8_attention(
                            q, k, v, kv_lengths=lengths, pv=pv, block_q=bq, block_k=bk, num_warps=warps,
                            num_stages=stages))
                for bk, stages in args.mosaic_attention_configs:
                    for accumulation in ("two_level", "in_place") if pv == "fp8" else ("two_level",):
                        in_place = " in-place" if accumulation == "in_place" else ""
                        variants[f"int8-QK {pv}-PV{in_place} mosaic k{bk} s{stages}, {tag}"] = (
                            lambda q, k, v, bk=bk, stages=stages, pv=pv, acc=accumulation: attention.int8_attention(
                                q, k, v, kv_lengths=lengths, pv=pv, block_q=64, block_k=bk, num_stages=stages,
                                backend="mosaic", out_dtype=jnp.bfloat16,  # bf16 out, as cuDNN's and the models'
                                pv_accumulation=acc))
            # From raw projections: XLA's RMSNorm + rotary then cuDNN, against the INT8 kernel with its fused prologue.
            norm = jnp.zeros((d,), jnp.float32)
            angles = jnp.arange(s)[:, None] * (1.0 / 10000 ** (jnp.arange(0, d, 2) / d))
            cos, sin = jnp.repeat(jnp.cos(angles), 2, -1), jnp.repeat(jnp.sin(angles), 2, -1)
            variants[f"XLA RMSNorm+rotary, then jax cuDNN bf16, {tag}"] = lambda q, k, v: jax.nn.dot_product_attention(
                attention.rms_rope_reference(q, norm, 1e-6, cos, sin).astype(jnp.bfloat16),
                attention.rms_rope_reference(k, norm, 1e-6, cos, sin).astype(jnp.bfloat16), v,
                key_value_seq_lengths=lengths, implementation="cudnn")
            for pv in ("bf16", "fp8"):
                variants[f"int8-QK {pv}-PV triton with fused RMSNorm+rotary+quantize prologue, {tag}"] = (
                    lambda q, k, v, pv=pv: attention.int8_attention_fused(q, k, v, norm, norm, 1e-6, cos, sin,
                                                                          kv_lengths=lengths, pv=pv))
                bk, stages = args.mosaic_attention_configs[0]
                # as the models call it (FP8 P.V in place); Q made in the kernel (the default) or by its own pass
                accumulation = "in_place" if pv == "fp8" else "two_level"
                # and, for FP8 P.V, the softmax's row sums by float32 adds instead of wgmma (MOSAIC_ROW_SUMS), V not
                # smoothed (MOSAIC_SMOOTH_V)
                options = [(True, "wgmma", True), (False, "wgmma", True)]
                options += [(True, "adds", True), (True, "wgmma", False)] if pv == "fp8" else []
                for q_in_kernel, row_sums, smooth_v in options:
                    where = "Q in the kernel" if q_in_kernel else "Q by its pass"
                    where += ", row sums by adds" if row_sums == "adds" else ""
                    where += ", V not smoothed" if not smooth_v else ""
                    name = (f"int8-QK {pv}-PV mosaic k{bk} s{stages} with fused RMSNorm+rotary+quantize prologue "
                            f"({where}), {tag}")
                    variants[name] = _with_module_setting(attention, "MOSAIC_ROW_SUMS", row_sums,
                                                          _with_module_setting(attention, "MOSAIC_SMOOTH_V", smooth_v,
                                                          _with_module_setting(
                        attention, "MOSAIC_Q_IN_KERNEL", q_in_kernel,
                        lambda q, k, v, pv=pv, bk=bk, stages=stages, acc=accumulation: attention.int8_attention_fused(
                            q, k, v, norm, norm, 1e-6, cos, sin, kv_lengths=lengths, pv=pv, block_q=64, block_k=bk,
                            num_stages=stages, backend="mosaic", out_dtype=jnp.bfloat16, pv_accumulation=acc))))
            exact_normed = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
                attention.rms_rope_reference(q, norm, 1e-6, cos, sin),
                attention.rms_rope_reference(k, norm, 1e-6, cos, sin),
                v.astype(jnp.float32), key_value_seq_lengths=lengths, implementation="xla"))(q, k, v)
            for name, fn in variants.items():
                if args.only and not any(s in name for s in args.only):
                    continue
                truth = exact_normed if "RMSNorm" in name else exact
                row = {"name": name}
                # A kernel that hangs on the device prints nothing; this names it and ends the process.
                print(f"running: {name}", file=sys.stderr, flush=True)
                faulthandler.dump_traceback_later(args.variant_timeout, exit=True)
                try:
                    f = jax.jit(fn)
                    out = jax.block_until_ready(f(q, k, v)).astype(jnp.float32)
                    seconds, kernels = _cupti_seconds(f, q, k, v, iterations=args.iters, by_kernel=True)
                    diff = (out - truth).ravel()
                    row.update(s=seconds, tflops=flops / seconds / 1e12, kernels=kernels,
                               cosine=float(jnp.dot(out.ravel(), truth.ravel())
                                            / (jnp.linalg.norm(out) * jnp.linalg.norm(truth))),
                               rel_l1=float(jnp.sum(jnp.abs(diff)) / jnp.sum(jnp.abs(truth))))
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"
                faulthandler.cancel_dump_traceback_later()
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def torch_attention(args) -> list[dict]:
    """torch's SDPA (bf16, the cuDNN and flash backends) at the shapes of `jax_attention`, CUDA events. GQA through
    `enable_gqa`; the mask as a boolean key mask (torch's cuDNN backend takes it, flash does not)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    s, h, d = args.seq, 48, 128
    flops = 4.0 * s * s * d * h
    for kv_heads in args.kv_heads:
        q = torch.randn(1, h, s, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, kv_heads, s, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, kv_heads, s, d, device="cuda", dtype=torch.bfloat16)
        for masked in (False, True):
            mask = (torch.arange(s, device="cuda") < s - 512 + 120)[None, None, None, :] if masked else None
            for backend, label in ((SDPBackend.CUDNN_ATTENTION, "cuDNN"), (SDPBackend.FLASH_ATTENTION, "flash")):
                if masked and label == "flash":  # flash takes no mask
                    continue
                name = f"torch SDPA {label} bf16, GQA {h}/{kv_heads}" + (", masked" if masked else "")

                def fn(backend=backend, mask=mask):
                    with sdpa_kernel(backend):
                        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                                enable_gqa=kv_heads != h)

                rows.append(_torch_time(fn, {}, args, name, flops))
    return rows


def attention_benchmark(args) -> None:
    """torch (a subprocess) and jax in one run: the issue's comparison."""
    forwarded = ["--seq", str(args.seq), "--kv-heads", *map(str, args.kv_heads), "--iters", str(args.iters)]
    rows = _subprocess_rows(args, "attention-torch", forwarded + ["--repeats", "3"])
    jax_args = forwarded + ["--variant-timeout", str(args.variant_timeout), "--v-channel-means",
                            str(args.v_channel_means)]
    jax_args += ["--only", *args.only] if args.only else []
    jax_args += ["--int8-configs", *(",".join(map(str, c)) for c in args.int8_configs)]
    jax_args += ["--mosaic-attention-configs", *(",".join(map(str, c)) for c in args.mosaic_attention_configs)]
    rows += _subprocess_rows(args, "attention-jax", jax_args)
    # TOPS: the whole call (with the XLA quantization prologue for the INT8 kernels); kernel: its longest kernel alone
    print(f"\n{'implementation':<100} {'TOPS':>6} {'kernel':>6} {'cosine':>9} {'rel L1':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:<100} error: {r['error']}")
        else:
            tops = r.get("tflops", 0)
            kernel = tops * r["s"] / max(r["kernels"].values()) if r.get("kernels") and r.get("s") else tops
            cos = f"{r['cosine']:9.6f}" if "cosine" in r else f"{'':>9}"
            rel = f"{r['rel_l1']:7.4f}" if "rel_l1" in r else f"{'':>7}"
            print(f"{r['name']:<100} {tops:6.0f} {kernel:6.0f} {cos} {rel}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def flux_step(args) -> None:
    forwarded = ["--height", str(args.height), "--width", str(args.width), "--text-len", str(args.text_len),
                 "--iters", str(args.iters), "--repeats", str(args.repeats), "--settle-s", str(args.settle_s)]
    rows = _subprocess_rows(args, "flux-step-diffusers", forwarded) if args.diffusers else []
    rows += _subprocess_rows(args, "flux-step-jax", forwarded + ["--precisions", *args.precisions,
                                                                  "--stacked", "yes" if args.stacked else "no",
                                                                  "--jax-attention", *args.jax_attention])
    _table(rows, f"FLUX.1-dev step, {args.height}x{args.width}, text {args.text_len}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


TINY_KREA2 = dict(in_channels=64, num_layers=2, attention_head_dim=32, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=256, timestep_embed_dim=64, text_hidden_dim=64, num_text_layers=3,
                  text_num_attention_heads=4, text_num_key_value_heads=4, text_intermediate_size=128,
                  num_layerwise_text_blocks=1, num_refiner_text_blocks=1, axes_dims_rope=(8, 12, 12))


TINY_FLUX = dict(num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
                 joint_attention_dim=24, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6))


def jax_lora_step(args) -> list[dict]:
    """One LoRA training step (forward, backward to the adapters, clipping, AdamW) of full-size Krea 2 or FLUX.1-dev
    (`args.family`) with random bf16 weights, batch 1, as `training.train.train_step` runs it; one remat policy per
    process, so that the device's peak memory is this variant's own. Timed by syncing after `iters` dispatched
    steps."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mxdit.training.lora import LoraConfig, add_lora, quantize_base
    from mxdit.training.train import REMAT_POLICIES, TrainConfig, jit_train_step, make_optimizer

    device = jax.devices()[0]
    if args.family == "flux":
        from mxdit.model.flux import FluxConfig, FluxTransformer
        from mxdit.quant.model import flux_rules as rules

        layers = {} if args.num_layers is None else dict(num_layers=args.num_layers,
                                                         num_single_layers=2 * args.num_layers)
        cfg = FluxConfig(**TINY_FLUX) if args.tiny else FluxConfig(**layers)
        model = FluxTransformer(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        hidden, text, pooled, img_ids, txt_ids = _flux_inputs(cfg, args.height, args.width, args.text_len)
        batch = {"latents": jnp.asarray(hidden)[None], "embeds": jnp.asarray(text, jnp.bfloat16)[None],
                 "mask": jnp.ones((1, 1, args.text_len), bool), "pooled": jnp.asarray(pooled, jnp.bfloat16)[None],
                 "position_ids": jnp.asarray(np.concatenate([txt_ids, img_ids]))}
    else:
        from mxdit.model.krea2 import Krea2Config, Krea2Transformer
        from mxdit.quant.model import krea2_rules as rules

        cfg = Krea2Config(**TINY_KREA2) if args.tiny else _config(args)
        model = Krea2Transformer(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        hidden, text, _, position_ids, mask = _krea2_inputs(cfg, args.height, args.width, args.text_len,
                                                            args.valid_text)
        batch = {"latents": jnp.asarray(hidden)[None], "embeds": jnp.asarray(text, jnp.bfloat16)[None],
                 "mask": jnp.asarray(mask)[None], "position_ids": jnp.asarray(position_ids)}
    if args.quantize_base:
        quantize_base(model, rules(args.quantize_base))
    names = add_lora(model, LoraConfig(rank=args.rank, alpha=float(args.rank)))
    model.remat_policy = REMAT_POLICIES[args.remat]
    config = TrainConfig(steps=10_000, remat=args.remat)
    graphdef, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)
    lora = jax.tree.map(jnp.copy, lora)
    opt_state = make_optimizer(config).init(lora)
    lora, opt_state = jax.device_put((lora, opt_state), device)
    lora_params = sum(int(x.size) for x in jax.tree.leaves(lora))
    key = jax.random.key(0)
    row = {"name": f"jax {args.family} LoRA step bf16, rank {args.rank}, {len(names)} adapters, remat {args.remat}"
                   + (f", base {args.quantize_base}" if args.quantize_base else ""), "lora_params": lora_params}
    try:
        t0 = time.perf_counter()
        compiled = jit_train_step.lower(graphdef, config, frozen, lora, opt_state, batch, key).compile()
        row["compile_s"] = time.perf_counter() - t0
        mem = compiled.memory_analysis()
        if mem is not None:  # the program's own footprint: arguments (weights, state, batch), temporaries, outputs
            row["temp_gb"] = mem.temp_size_in_bytes / 1e9
            row["program_gb"] = (mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes) / 1e9
        lora, opt_state, metrics = compiled(frozen, lora, opt_state, batch, key)
        jax.block_until_ready(metrics)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            for i in range(args.iters):
                lora, opt_state, metrics = compiled(frozen, lora, opt_state, batch, jax.random.fold_in(key, i))
            jax.block_until_ready((lora, metrics))
            times.append((time.perf_counter() - t0) / args.iters)
        row["s_per_step"] = statistics.median(times)
        row["spread"] = (max(times) - min(times)) / row["s_per_step"]
        row["loss"] = float(metrics["loss"])
    except Exception as e:  # an out-of-memory variant is a result too
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    stats = device.memory_stats() or {}
    row["peak_gb"] = stats.get("peak_bytes_in_use", 0) / 1e9
    print(json.dumps(row), flush=True)
    return [row]


def lora_step(args) -> None:
    forwarded = ["--height", str(args.height), "--width", str(args.width), "--text-len", str(args.text_len),
                 "--valid-text", str(args.valid_text), "--rank", str(args.rank), "--iters", str(args.iters),
                 "--repeats", str(args.repeats)]
    forwarded += ["--num-layers", str(args.num_layers)] if args.num_layers else []
    forwarded += ["--tiny"] if args.tiny else []
    forwarded += ["--quantize-base", args.quantize_base] if args.quantize_base else []
    rows = []
    for remat in args.remat:
        rows += _subprocess_rows(args, f"{args.family}-lora-step-jax", forwarded + ["--remat", remat])
    size = "tiny model" if args.tiny else "full size"
    model = {"krea2": "Krea 2", "flux": "FLUX.1-dev"}[args.family]
    real = f" ({args.valid_text} real)" if args.family == "krea2" else ""  # FLUX.1 attends to every text token
    print(f"\n{model} LoRA training step ({size}), {args.height}x{args.width}, batch 1, text {args.text_len}{real}. "
          "Peak GB: device peak (0 where the device reports none); temp GB: the "
          "compiled step's temporaries (what remat trades); program GB: its arguments + temporaries + outputs")
    print(f"{'variant':<66} {'s/step':>8} {'peak GB':>8} {'temp GB':>8} {'program GB':>10} {'warm-up s':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:<66} error: {r['error']}")
        else:
            print(f"{r['name']:<66} {r['s_per_step']:8.4f} {r['peak_gb']:8.2f} {r.get('temp_gb', 0):8.2f} "
                  f"{r.get('program_gb', 0):10.2f} {r['compile_s']:9.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def krea2_sharded_step(args) -> None:
    """The Krea 2 denoising step of the pipeline on each mesh (sharding/krea2.py), a dispatch per step."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mxdit.model.krea2 import Krea2Config, Krea2Transformer
    from mxdit.sharding.krea2 import krea2_denoise_step
    from mxdit.sharding.mesh import make_mesh

    if args.tiny:  # the demo pipeline's transformer, float32: a CPU smoke run of this command
        cfg = Krea2Config(in_channels=64, num_layers=4, attention_head_dim=32, num_attention_heads=8,
                          num_key_value_heads=2, intermediate_size=512, timestep_embed_dim=64, text_hidden_dim=64,
                          num_text_layers=4, text_num_attention_heads=4, text_num_key_value_heads=4,
                          text_intermediate_size=128, axes_dims_rope=(8, 12, 12))
    else:
        cfg = _config(args)
    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    model = Krea2Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(0))
    latents, text, _, ids, mask = _krea2_inputs(cfg, args.height, args.width, args.text_len, args.valid_text,
                                                batch=args.batch)
    if args.guidance:  # Base: [conditional; unconditional] in one batch
        text, mask = np.concatenate([text, text]), np.concatenate([mask, mask])
    text, latents = jnp.asarray(text, dtype), jnp.asarray(latents)
    mask, ids = jnp.asarray(mask), jnp.asarray(ids)
    flops = _step_flops(cfg, latents.shape[1], text.shape[1]) * text.shape[0]
    rows = []
    for mesh_text in args.meshes:
        row = {"name": f"jax {jnp.dtype(dtype).name}, mesh {mesh_text or '1 device'}, {args.method or 'auto'}"}
        try:
            step = krea2_denoise_step(model, make_mesh(mesh_text), method=args.method)

            def run(n, x=latents):
                for i in range(n):  # sigma 1 -> 0.999: the latents stay in range over many steps
                    x = step(x, text, mask, ids, jnp.float32(0.7 - 1e-4 * i), jnp.float32(1.0),
                             jnp.float32(0.999), jnp.float32(4.5), args.guidance)
                return jax.block_until_ready(x)

            row.update(_timed(run, args.iters, args.repeats))
            row["tflops"] = flops / row["s_per_step"] / 1e12
            row["peak_gb"] = max((d.memory_stats() or {}).get("peak_bytes_in_use", 0) for d in jax.devices()) / 1e9
        except Exception as e:  # record and go on with the other meshes
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    _table(rows, f"Krea 2 step on {jax.device_count()} {jax.devices()[0].platform} devices, {args.height}x{args.width}, "
                 f"batch {args.batch}{' with CFG' if args.guidance else ''}, text {args.text_len} ({args.valid_text} "
                 "real); TFLOP/s summed over devices, peak GB of the fullest device")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def krea2_step(args) -> None:
    rows = _subprocess_rows(args, "krea2-step-diffusers", _forwarded(args)) if args.diffusers else []
    rows += jax_krea2_step(args)
    _table(rows, f"Krea 2 step, {args.height}x{args.width}, text {args.text_len} ({args.valid_text} real)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def _forwarded(args) -> list[str]:
    out = ["--height", str(args.height), "--width", str(args.width), "--text-len", str(args.text_len),
           "--valid-text", str(args.valid_text), "--iters", str(args.iters), "--repeats", str(args.repeats),
           "--settle-s", str(args.settle_s)]
    if args.num_layers:
        out += ["--num-layers", str(args.num_layers)]
    if args.torch_compile:
        out.append("--torch-compile")
    return out


def _table(rows: list[dict], title: str) -> None:
    print(f"\n{title}")
    print(f"{'implementation':<62} {'s/step':>8} {'TFLOP/s':>8} {'peak GB':>8} {'warm-up s':>9} {'weights GB':>10} "
          f"{'temp GB':>8} {'SM MHz':>7} {'max W':>6} {'mean W':>6} {'J/step':>6}")
    for r in rows:
        if "name" not in r:
            continue
        if "error" in r:
            print(f"{r['name']:<62} error: {r['error']}")
            continue
        extra = "".join(f" {r[k]:{w}.{d}f}" if k in r else f" {'':>{w}}"
                        for k, w, d in (("weights_gb", 10, 1), ("temp_gb", 8, 1), ("sm_mhz_median", 7, 0),
                                        ("power_w_max", 6, 0), ("power_w_mean", 6, 0), ("joules_per_step", 6, 1)))
        print(f"{r['name']:<62} {r['s_per_step']:8.4f} {r['tflops']:8.0f} {r['peak_gb']:8.1f} {r['compile_s']:9.1f}"
              + extra)


def _krea2_shape_arguments(p: argparse.ArgumentParser) -> None:
    """The image size, the text length (and how much of it is real) and a block count for quick runs."""
    p.add_argument("--height", type=int, default=1024)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--text-len", type=int, default=512)
    p.add_argument("--valid-text", type=int, default=120)
    p.add_argument("--num-layers", type=int, default=None, help="fewer blocks, for a quick smoke run")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("krea2-profile")
    _krea2_shape_arguments(p)
    p.add_argument("--precision", default="fp8", choices=PRECISION_CHOICES)
    p.add_argument("--attention", default="int8_mosaic", choices=ATTENTION_CHOICES)
    p.add_argument("--iters", type=int, default=2, help="steps traced")
    p.add_argument("--top", type=int, default=40, help="kernels listed")
    p.add_argument("--trace-dir", default="/tmp/mxdit-profile")
    p = sub.add_parser("krea2-energy")
    _krea2_shape_arguments(p)
    p.set_defaults(text_len=128)
    p.add_argument("--attention", default="int8_mosaic_fp8", choices=ATTENTION_CHOICES)
    p.add_argument("--cluster-n", type=int, default=1, help="the GEMMs' CTAs a cluster (MosaicConfig.cluster_n)")
    p.add_argument("--seconds", type=float, default=2.5, help="each kernel's timed loop")
    p.add_argument("--norm-rows", type=int, nargs="+", default=None,
                   help="the adaptive norm's rows a program (`rows_per_program`), each timed; the first enters the "
                        "sum (default: the model's)")
    p.add_argument("--json", default=None)
    for name in ("krea2-step", "krea2-step-diffusers"):
        p = sub.add_parser(name)
        _krea2_shape_arguments(p)
        p.add_argument("--iters", type=int, default=10, help="steps per timed repeat")
        p.add_argument("--repeats", type=int, default=3)
        p.add_argument("--settle-s", type=float, default=3.0,
                       help="seconds of untimed steps before timing: the H200 settles at its power cap (0: the burst "
                            "after an idle GPU, up to ~6%% faster)")
        p.add_argument("--torch-compile", action="store_true", help="also time diffusers under torch.compile")
        p.add_argument("--no-diffusers", dest="diffusers", action="store_false")
        p.add_argument("--jax-attention", nargs="+", default=["cudnn"], choices=ATTENTION_CHOICES)
        p.add_argument("--precisions", nargs="+", default=["bf16"], choices=PRECISION_CHOICES,
                       help="the blocks' matrices in this format through the GEMM kernels (bf16: XLA's dots)")
        p.add_argument("--stacked", nargs="+", type=lambda s: s == "yes", default=[False], metavar="{no,yes}",
                       help="also (yes) or only with Q/K/V/gate and gate/up stacked into single products")
        p.add_argument("--unmasked-too", action="store_true", help="also time the step without a text mask")
        p.add_argument("--fused-text", action="store_true",
                       help="the text stage once before the timed steps, as the pipeline runs it (not in each step)")
        p.add_argument("--modes", nargs="+", default=["one jitted loop", "a dispatch per step"],
                       choices=["one jitted loop", "a dispatch per step"])
        p.add_argument("--json", default=None, help="write the result rows to this file")
    for name in ("vae-decode", "vae-decode-diffusers", "vae-decode-jax"):
        p = sub.add_parser(name)
        p.add_argument("--vaes", nargs="+", default=["qwen", "flux"], choices=["qwen", "flux"])
        p.add_argument("--sizes", nargs="+", type=int, default=[1024, 2048], help="image sides in pixels")
        p.add_argument("--repeats", type=int, default=5)
        p.add_argument("--no-diffusers", dest="diffusers", action="store_false")
        p.add_argument("--json", default=None)
    for name in ("krea2-pipeline", "krea2-pipeline-diffusers", "krea2-pipeline-jax"):
        p = sub.add_parser(name)
        p.add_argument("--height", type=int, default=1024)
        p.add_argument("--width", type=int, default=1024)
        p.add_argument("--steps", type=int, default=8)
        p.add_argument("--num-layers", type=int, default=None, help="fewer transformer blocks, for a quick smoke run")
        p.add_argument("--repeats", type=int, default=2, help="warm runs after the cold one")
        p.add_argument("--no-diffusers", dest="diffusers", action="store_false")
        p.add_argument("--precisions", nargs="+", default=["bf16"], choices=PRECISION_CHOICES,
                       help="the blocks' matrices in this format through the GEMM kernels (bf16: XLA's dots)")
        p.add_argument("--jax-attention", nargs="+", default=["cudnn"], choices=ATTENTION_CHOICES)
        p.add_argument("--no-trim-text", dest="trim_text", action="store_false",
                       help="denoise all 512 text tokens, as diffusers does (default: the padding dropped)")
        p.add_argument("--cached-too", action="store_true",
                       help="a second process of ours that starts from the first one's compilation cache")
        p.add_argument("--prompt", default="a red fox in the snow, photo",
                       help="its length sets the trimmed text (the demo tokenizer: about a token a word)")
        p.add_argument("--json", default=None)
    for name in ("flux-step", "flux-step-diffusers", "flux-step-jax"):
        p = sub.add_parser(name)
        p.add_argument("--height", type=int, default=1024)
        p.add_argument("--width", type=int, default=1024)
        p.add_argument("--text-len", type=int, default=512)
        p.add_argument("--iters", type=int, default=10)
        p.add_argument("--repeats", type=int, default=3)
        p.add_argument("--settle-s", type=float, default=3.0, help="as krea2-step's: untimed steps at the power cap")
        p.add_argument("--no-diffusers", dest="diffusers", action="store_false")
        p.add_argument("--precisions", nargs="+", default=["bf16"], choices=PRECISION_CHOICES,
                       help="the blocks' matrices in this format through the GEMM kernels (bf16: XLA's dots)")
        p.add_argument("--stacked", type=lambda s: s == "yes", default=False, metavar="{no,yes}",
                       help="Q/K/V (and the single blocks' MLP projection) as one product each, as generate.py runs")
        p.add_argument("--jax-attention", nargs="+", default=["cudnn"], choices=ATTENTION_CHOICES)
        p.add_argument("--json", default=None)
    for name in ("gemm", "gemm-jax", "gemm-torch"):
        p = sub.add_parser(name)
        p.add_argument("--shapes", nargs="+", default=GEMM_SHAPES, help="MxKxN")
        p.add_argument("--backends", nargs="+", default=["mosaic", "triton"], choices=["mosaic", "triton"])
        p.add_argument("--sweep", action="store_true", help="try several tile configurations on the first shape")
        p.add_argument("--iters", type=int, default=20)
        p.add_argument("--repeats", type=int, default=3, help="torch: repeats of --iters calls")
        p.add_argument("--no-torch", dest="torch", action="store_false")
        p.add_argument("--json", default=None)
    for name in ("attention", "attention-jax", "attention-torch"):
        p = sub.add_parser(name)
        p.add_argument("--seq", type=int, default=4608)
        p.add_argument("--kv-heads", nargs="+", type=int, default=[12, 48])
        p.add_argument("--iters", type=int, default=10)
        p.add_argument("--repeats", type=int, default=3, help="torch: repeats of --iters calls")
        p.add_argument("--only", nargs="+", default=None, metavar="TEXT",
                       help="jax: only the variants whose names contain one")
        p.add_argument("--v-channel-means", type=float, default=0.0,
                       help="jax: add channel means of about this size (times V's spread) to V")
        p.add_argument("--variant-timeout", type=float, default=180.0,
                       help="jax: seconds a variant may take (compile + timing) before the process is ended as hung")
        p.add_argument("--int8-configs", nargs="+", type=lambda c: tuple(map(int, c.split(","))),
                       default=[(64, 64, 4, 2), (128, 64, 8, 2), (128, 128, 8, 2)], help="block_q,block_k,warps,stages")
        p.add_argument("--mosaic-attention-configs", nargs="+", type=lambda c: tuple(map(int, c.split(","))),
                       default=[(128, 2), (128, 3), (64, 3), (64, 4)],
                       help="block_k,stages of the Mosaic GPU INT8 attention (its K/V ring; the first also runs fused)")
        p.add_argument("--json", default=None)
    p = sub.add_parser("qk-prologue")
    p.add_argument("--seq", type=int, default=4224)
    p.add_argument("--heads", type=int, default=48)
    p.add_argument("--kv-heads", type=int, default=12)
    p.add_argument("--heads-per-program", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--warps", nargs="+", type=int, default=[8, 16])
    p.add_argument("--split-pairs", nargs="+", type=lambda s: s == "yes", default=[False, True], metavar="{no,yes}",
                   help="load contiguously and split the rotary pairs in registers, or two stride-2 loads")
    p.add_argument("--iters", type=int, default=20)
    p = sub.add_parser("krea2-sharded-step")
    p.add_argument("--meshes", nargs="+", default=["", "seq=2", "seq=4", "seq=8"],
                   help='mesh texts as for generate.py --mesh ("" is one device)')
    p.add_argument("--method", choices=["ulysses", "ring"], default=None, help="sequence-parallel attention")
    p.add_argument("--guidance", action="store_true", help="CFG (Base): conditional and unconditional in one batch")
    p.add_argument("--batch", type=int, default=1, help="images per step")
    _krea2_shape_arguments(p)
    p.add_argument("--tiny", action="store_true", help="the tiny demo transformer in float32 (CPU smoke run)")
    p.add_argument("--iters", type=int, default=10, help="steps per timed repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="write the result rows to this file")
    for name in ("krea2-lora-step", "krea2-lora-step-jax", "flux-lora-step", "flux-lora-step-jax"):
        p = sub.add_parser(name)
        p.set_defaults(family=name.split("-")[0])
        _krea2_shape_arguments(p)
        p.add_argument("--rank", type=int, default=32)
        p.add_argument("--tiny", action="store_true", help="a tiny model of the family (checks the path on a CPU)")
        p.add_argument("--quantize-base", default=None, metavar="FORMAT", help="frozen block matrices in this format")
        p.add_argument("--iters", type=int, default=5, help="steps per timed repeat")
        p.add_argument("--repeats", type=int, default=3)
        p.add_argument("--json", default=None)
        if not name.endswith("-jax"):
            p.add_argument("--remat", nargs="+", default=["none", "block"],
                           choices=["none", "block", "dots", "dots_all"], help="one process per policy")
        else:
            p.add_argument("--remat", default="none", choices=["none", "block", "dots", "dots_all"])
    for name in ("krea2-offload", "krea2-offload-jax"):
        p = sub.add_parser(name)
        _krea2_shape_arguments(p)
        p.add_argument("--prefetch", type=int, default=2)
        p.add_argument("--precision", default="bf16", choices=PRECISION_CHOICES,
                       help="the blocks' matrices in this format, streamed as such (bf16: as they are)")
        p.add_argument("--iters", type=int, default=5)
        p.add_argument("--repeats", type=int, default=3)
        p.add_argument("--settle-s", type=float, default=3.0, help="as krea2-step's: untimed steps at the power cap")
        p.add_argument("--json", default=None)
        if name == "krea2-offload":
            p.add_argument("--resident", nargs="+", default=["16", "20"], help="blocks kept on the device, per run")
            p.add_argument("--device-memory-gb", type=float, default=24.0)
        else:
            p.add_argument("--resident", default="all")
    args = parser.parse_args(argv)
    commands = {
        "krea2-offload": krea2_offload, "krea2-offload-jax": jax_krea2_offload,
        "krea2-step": krea2_step, "krea2-step-diffusers": diffusers_krea2_step, "krea2-profile": krea2_profile,
        "krea2-energy": krea2_energy,
        "krea2-pipeline": krea2_pipeline, "krea2-pipeline-diffusers": diffusers_krea2_pipeline,
        "krea2-pipeline-jax": jax_krea2_pipeline,
        "vae-decode": vae_decode, "vae-decode-diffusers": diffusers_vae_decode, "vae-decode-jax": jax_vae_decode,
        "flux-step": flux_step, "flux-step-diffusers": diffusers_flux_step, "flux-step-jax": jax_flux_step,
        "gemm": gemm_benchmark, "gemm-jax": jax_gemm, "gemm-torch": torch_gemm, "attention": attention_benchmark,
        "attention-jax": jax_attention, "attention-torch": torch_attention, "qk-prologue": qk_prologue,
        "krea2-sharded-step": krea2_sharded_step,
        "krea2-lora-step": lora_step, "krea2-lora-step-jax": jax_lora_step,
        "flux-lora-step": lora_step, "flux-lora-step-jax": jax_lora_step,
    }
    commands[args.command](args)


if __name__ == "__main__":
    main()
