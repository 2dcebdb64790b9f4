"""The Krea 2 transformer step: timed (against diffusers' in a subprocess), profiled by kernel, and its kernels'
energy alone at the power cap."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np

from .inputs import krea2_config, krea2_flops, krea2_inputs
from .rows import emit, error_text, flags, step_table, subprocess_rows, write_json
from .timing import energy_per_call, jax_peak_gb, timed

STEP_MODES = ("one jitted loop", "a dispatch per step")


def krea2_step(args) -> None:
    """diffusers' step in a subprocess (--no-diffusers: none), then ours in this process; one table."""
    forwarded = flags(args, "height", "width", "text_len", "valid_text", "iters", "repeats", "settle_s", "num_layers",
                      "torch_compile")
    rows = subprocess_rows(args, "krea2-step-diffusers", forwarded) if args.diffusers else []
    rows += jax_krea2_step(args)
    step_table(rows, f"Krea 2 step, {args.height}x{args.width}, text {args.text_len} ({args.valid_text} real)")
    write_json(args, rows)


def jax_krea2_step(args) -> list[dict]:
    """Our step for each --precisions x --stacked x --jax-attention (x masked and not, with --unmasked-too), in each
    of --modes: many steps inside one jitted program (`lax.fori_loop`), or a jitted call per step dispatched back to
    back as the pipeline's loop runs."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mxdit.model.krea2 import Krea2Transformer
    from mxdit.model.pipelines import prepare_transformer

    cfg = krea2_config(args)
    t0 = time.perf_counter()
    base = Krea2Transformer(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    jax.block_until_ready(nnx.state(base))
    init_s = time.perf_counter() - t0
    hidden, text, timestep, position_ids, mask = krea2_inputs(cfg, args.height, args.width, args.text_len,
                                                              args.valid_text)
    inputs = (jnp.asarray(hidden, jnp.bfloat16), jnp.asarray(text, jnp.bfloat16), jnp.asarray(timestep),
              jnp.asarray(position_ids), jnp.asarray(mask))
    flops = krea2_flops(cfg, hidden.shape[1], text.shape[1])
    rows = []
    for precision in args.precisions:
        for stacked in args.stacked:
            model = prepare_transformer(nnx.clone(base), precision, stack=stacked)
            weights_gb = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model))) / 1e9
            for attention in args.jax_attention:
                for masked in (True, False) if args.unmasked_too else (True,):
                    model.attention = attention
                    name = (f"jax {precision}{' stacked' if stacked else ''}, {attention} attention, "
                            f"{'masked' if masked else 'no mask'}")
                    rows += _time_step(args, model, inputs, masked, name, flops, weights_gb)
            del model
    emit({"jax_init_s": init_s, "device": str(jax.devices()[0]), "backend": jax.default_backend()})
    return rows


def _time_step(args, model, inputs, masked: bool, name: str, flops: float, weights_gb: float) -> list[dict]:
    """One variant's rows, a row per --modes."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    hidden, text, timestep, position_ids, mask = inputs
    graphdef, state = nnx.split(model)
    step_mask = mask if masked else None
    # --fused-text: the text stage once, outside the timed steps, as the pipeline runs it (diffusers runs it in
    # every call)
    step_text = jax.jit(model.fuse_text)(text, step_mask) if args.fused_text else text

    def step(state, x, text, timestep):
        v = nnx.merge(graphdef, state)(x, text, timestep, position_ids, step_mask)
        return (x + 1e-3 * v).astype(x.dtype)

    @jax.jit
    def fused(state, x, text, timestep, n):
        # Each iteration's text and time depend on the loop, so XLA cannot hoist the text fusion or the time
        # embedding out of the loop: every iteration is a whole step, as in the pipeline.
        def body(i, x):
            text_i = text + (1e-6 * jnp.mean(x)).astype(text.dtype)
            return step(state, x, text_i, timestep + 1e-4 * i.astype(jnp.float32))

        return jax.lax.fori_loop(0, n, body, x)

    one_step = jax.jit(step)

    def dispatched(n):
        x = hidden
        for i in range(n):  # without waiting in between, as the pipeline's loop runs
            x = one_step(state, x, step_text, timestep + 1e-4 * i)
        return x

    calls = {STEP_MODES[0]: lambda n: fused(state, hidden, step_text, timestep, n), STEP_MODES[1]: dispatched}
    rows = []
    for mode in (m for m in STEP_MODES if m in args.modes):
        row = {"name": f"{name}, {mode}{', text fused once' if args.fused_text else ''}", "weights_gb": weights_gb}
        try:
            row.update(timed(lambda n, call=calls[mode]: jax.block_until_ready(call(n)), args.iters, args.repeats,
                             args.settle_s))
            row["tflops"] = flops / row["s_per_step"] / 1e12
            if mode == STEP_MODES[0]:  # the step's own memory beside the weights (the process peak also holds
                # the bf16 weights the quantized ones were made from)
                memory = fused.lower(state, hidden, step_text, timestep, 1).compile().memory_analysis()
                row["temp_gb"] = getattr(memory, "temp_size_in_bytes", 0) / 1e9
        except Exception as e:
            row["error"] = error_text(e)
        row["peak_gb"] = jax_peak_gb()
        rows.append(emit(row))
    return rows


def krea2_profile(args) -> None:
    """Where a Krea 2 step's GPU time goes: the step (--precision, --attention, stacked, text fused once) under
    jax.profiler for --iters steps; the perfetto trace's GPU kernels summed by name, per step, largest first, and
    the GPU's idle time between them. The trace stays in --trace-dir (open it in ui.perfetto.dev)."""
    import gzip

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mxdit.model.krea2 import Krea2Transformer
    from mxdit.model.pipelines import prepare_transformer

    cfg = krea2_config(args)
    model = prepare_transformer(Krea2Transformer(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), args.precision)
    model.attention = args.attention
    hidden, text, timestep, position_ids, mask = (jnp.asarray(a) for a in krea2_inputs(
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
    spans = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                   if e.get("ph") == "X" and e.get("pid") in gpu)
    print(f"\nKrea 2 step profile ({args.precision}, {args.attention} attention, {args.height}x{args.width}, text "
          f"{args.text_len}); trace {traces[-1]}")
    _print_profile(spans, args.iters, args.top)


def _print_profile(spans: list[tuple[float, float, str]], iters: int, top: int) -> None:
    """GPU kernels (start and end in us, name) over `iters` steps: ms a step by kernel name, largest first; then
    the idle time between kernels (the span they cover less the time some kernel ran) and the kernels the idle gaps
    come before (a launch the GPU waited for)."""
    import collections

    total, count = collections.defaultdict(float), collections.Counter()
    for start, stop, name in spans:
        total[name] += (stop - start) / 1e3 / iters
        count[name] += 1
    print(f"{sum(total.values()):.1f} ms of GPU kernels a step")
    print(f"{'ms/step':>8} {'calls/step':>10}  kernel")
    for name, ms in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
        print(f"{ms:8.2f} {count[name] / iters:10.0f}  {name[:100]}")
    if not spans:
        return
    busy, gaps, end = 0.0, collections.defaultdict(float), spans[0][0]
    for start, stop, name in spans:
        if start > end:
            gaps[name] += (start - end) / 1e3 / iters
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    span = (end - spans[0][0]) / 1e3 / iters
    print(f"\nGPU timeline: {span:.1f} ms a step, a kernel running {busy / 1e3 / iters:.1f} ms, idle "
          f"{sum(gaps.values()):.1f} ms (between steps included); idle before:")
    for name, ms in sorted(gaps.items(), key=lambda kv: -kv[1])[:10]:
        print(f"{ms:8.2f}  {name[:100]}")


def krea2_gemm_shapes(cfg) -> dict[str, tuple[int, int, str]]:
    """A Krea 2 block's products as the fp8 stacked step runs them: name -> (k, n, epilogue)."""
    d, kv, f = cfg.hidden_size, cfg.num_key_value_heads * cfg.attention_head_dim, cfg.intermediate_size
    return {"QKVG GEMM": (d, 2 * d + 2 * kv, "none"), "SwiGLU GEMM": (d, 2 * f, "swiglu"),
            "out GEMM + gated residual": (d, d, "residual"), "down GEMM + gated residual": (f, d, "residual")}


def krea2_energy(args) -> None:
    """Energy a kernel of the fp8 Krea 2 step at the power cap (a step at the cap is bound by its energy): each
    kernel on its own in a ~--seconds loop, random inputs of the step's shapes, and the joules a step its calls
    take. The GPU clocks each kernel alone as the cap allows, which is not quite the step's clock: compare kernels
    and variants, and the sum with `krea2-step`'s J a step."""
    import jax

    emit({"device": str(jax.devices()[0]), "backend": jax.default_backend()})
    cfg = krea2_config(args)
    m = (args.height // 16) * (args.width // 16) + args.text_len
    keys = iter(jax.random.split(jax.random.key(0), 64))
    rows = []

    def record(name, per_step, fn, *inputs, kernels_per_call=1):
        row = {"name": name, "calls_per_step": per_step}
        try:
            row.update(energy_per_call(fn, *inputs, seconds=args.seconds, kernels_per_call=kernels_per_call))
            if "mj_per_kernel" in row:
                row["j_per_step"] = row["mj_per_kernel"] * per_step / 1e3
        except Exception as e:
            row["error"] = error_text(e)
        rows.append(emit(row))

    _gemm_energy(record, cfg, m, args.cluster_n, keys)
    _attention_energy(record, cfg, m, args, keys)
    _row_kernel_energy(record, cfg, m, args.norm_rows, keys)
    _energy_table(rows, m, cfg.num_layers)
    write_json(args, rows)


def _gemm_energy(record, cfg, m: int, cluster_n: int, keys) -> None:
    """The block's four FP8 GEMMs (with their epilogues), and XLA's FP8 dot at the SwiGLU GEMM's shape."""
    import jax
    import jax.numpy as jnp

    from mxdit.pallas_kernels import gemm

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
        if cluster_n > 1 and n % (config.tile_n * cluster_n) == 0:
            config = dataclasses.replace(config, cluster_n=cluster_n)
        product = jax.jit(lambda xq, xs, weight, extra, config=config, epilogue=epilogue: gemm.scaled_matmul(
            xq, weight, xs, activation="swiglu" if epilogue == "swiglu" else "none", config=config, **extra))
        record(name + (f" (cluster {config.cluster_n})" if config.cluster_n > 1 else ""), cfg.num_layers, product,
               xq, xs, weight, extra)
        if epilogue == "swiglu":  # the reference: cuBLAS's FP8 GEMM, no scales, bf16 out
            xla_dot = jax.jit(lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                                                                 preferred_element_type=jnp.bfloat16))
            record("  (XLA's FP8 dot at the SwiGLU GEMM's shape, for reference)", 0, xla_dot, xq, weight.data)
        del weight, extra


def _attention_energy(record, cfg, m: int, args, keys) -> None:
    """The model's attention from the stacked QKVG product (--attention, its prologue passes included), as a
    Krea 2 block calls it."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mxdit.model.krea2 import RMSNorm
    from mxdit.model.layers import rotary_tables
    from mxdit.ops.attention import attend

    h, hk, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.attention_head_dim
    stacked = jax.random.normal(next(keys), (1, m, (2 * h + 2 * hk) * dh), jnp.bfloat16)
    norms = (RMSNorm(dh, cfg.norm_eps), RMSNorm(dh, cfg.norm_eps))
    for norm in norms:
        norm.weight = nnx.Param(0.1 * jax.random.normal(next(keys), (dh,), jnp.float32))
    positions = krea2_inputs(cfg, args.height, args.width, args.text_len, args.valid_text)[3]  # text, then image
    rotary = rotary_tables(jnp.asarray(np.roll(positions, -args.text_len, axis=0)), cfg.axes_dims_rope,
                           cfg.rope_theta)  # the model's order: image, then text (its padding last)
    lengths = jnp.array([m - (args.text_len - args.valid_text)], jnp.int32)

    def attention(qkvg):
        q, k, v, _ = jnp.split(qkvg, [h * dh, (h + hk) * dh, (h + 2 * hk) * dh], axis=-1)
        q = q.reshape(1, m, h, dh)
        k, v = (t.reshape(1, m, hk, dh) for t in (k, v))
        return attend(q, k, v, lengths, args.attention, norms=norms, rotary=rotary, stacked=qkvg)

    record(f"attention ({args.attention}, with its prologue passes)", cfg.num_layers, jax.jit(attention), stacked)


def _row_kernel_energy(record, cfg, m: int, norm_rows: list[int] | None, keys) -> None:
    """The row kernels that quantize the GEMMs' inputs, 16 calls a dispatch on distinct inputs (a call is short);
    the adaptive norm with each of `norm_rows` rows a program (None: the kernel's default), the first one's in the
    sum."""
    import jax
    import jax.numpy as jnp

    from mxdit.pallas_kernels import activations

    r, blocks = 16, cfg.num_layers
    d, f, hk, dh = cfg.hidden_size, cfg.intermediate_size, cfg.num_key_value_heads, cfg.attention_head_dim
    xs_rows = [jax.random.normal(k_, (1, m, d), jnp.bfloat16) for k_ in jax.random.split(next(keys), r)]
    weight = 0.1 * jax.random.normal(next(keys), (d,), jnp.float32)
    scale, shift = (0.1 * jax.random.normal(next(keys), (1, 1, d), jnp.bfloat16) for _ in range(2))
    norm_rows = norm_rows or [None]
    for rows_per_program in norm_rows:
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


def _energy_table(rows: list[dict], m: int, blocks: int) -> None:
    total = sum(r.get("j_per_step", 0.0) for r in rows)
    print(f"\nKrea 2 fp8 step's kernels alone at the power cap, {m} tokens ({blocks} blocks)")
    print(f"{'kernel':<62} {'calls':>5} {'us':>8} {'mJ':>7} {'W':>5} {'MHz':>5} {'J/step':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:<62} error: {r['error']}")
            continue
        print(f"{r['name']:<62} {r['calls_per_step']:5d} {r['us_per_kernel']:8.1f} "
              f"{r.get('mj_per_kernel', float('nan')):7.1f} {r.get('power_w_mean', float('nan')):5.0f} "
              f"{r['sm_mhz_median'] or 0:5.0f} {r.get('j_per_step', float('nan')):7.2f}")
    print(f"{'sum':<62} {'':>5} {'':>8} {'':>7} {'':>5} {'':>5} {total:7.2f}")
