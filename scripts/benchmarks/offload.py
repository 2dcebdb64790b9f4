"""The Krea 2 step with weight streaming (`model/offload.py`): blocks in pinned host memory, copied to the device
ahead of their turn, against every block resident."""

from __future__ import annotations

import time

from .inputs import krea2_config, krea2_flops, krea2_inputs, random_model
from .rows import emit, error_text, flags, subprocess_rows, write_json
from .timing import median_seconds, memory_fraction, timed


def krea2_offload(args) -> None:
    """One process per --resident, its device memory capped to --device-memory-gb (the BFC allocator's pool), and
    one uncapped with every block resident: the exposed transfer wait is a run's time minus that one's."""
    forwarded = flags(args, "height", "width", "text_len", "valid_text", "iters", "repeats", "prefetch", "precision",
                      "settle_s", "num_layers")
    rows = subprocess_rows(args, "krea2-offload-jax", forwarded + ["--resident", "all"])
    fraction = memory_fraction(args.device_memory_gb)
    for resident in args.resident:
        rows += subprocess_rows(args, "krea2-offload-jax", forwarded + ["--resident", resident],
                                env={"XLA_PYTHON_CLIENT_MEM_FRACTION": fraction})
    base = rows[0].get("s_per_step")  # every block resident, uncapped
    print(f"\nKrea 2 step with weight streaming, {args.height}x{args.width}; capped runs: {args.device_memory_gb} GB")
    # the slowest repeat beside the median: a capped run's first repeat may wait far longer than the others
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
    write_json(args, rows)


def jax_krea2_offload(args) -> list[dict]:
    """The Krea 2 step (random weights; bf16, or the blocks' matrices in --precision for the GEMM kernels) with
    the first `--resident` blocks on the device, the others in pinned host memory, copied `--prefetch` blocks
    ahead. The weights are made tensor by tensor (quantized as made), streamed blocks straight into host memory, so
    the device never holds more than the run keeps (the parent caps its memory). Timed over `iters` steps
    dispatched back to back."""
    import jax
    import jax.numpy as jnp

    cfg = krea2_config(args)
    device = jax.devices()[0]
    resident = cfg.num_layers if args.resident == "all" else int(args.resident)
    t0 = time.perf_counter()
    streamed = _streamed_model(cfg, args.precision, resident, args.prefetch)
    init_s = time.perf_counter() - t0
    hidden, text, timestep, position_ids, mask = (jnp.asarray(a) for a in krea2_inputs(
        cfg, args.height, args.width, args.text_len, args.valid_text))
    hidden, text = hidden.astype(jnp.bfloat16), text.astype(jnp.bfloat16)
    row = {"name": f"jax {args.precision}, {resident} of {cfg.num_layers} blocks resident, prefetch {args.prefetch}",
           "init_s": init_s}
    try:
        def steps(n):
            x = hidden
            for _ in range(n):
                x = (x + 1e-3 * streamed(x, text, timestep, position_ids, mask)).astype(x.dtype)
            return jax.block_until_ready(x)

        row.update(timed(steps, args.iters, args.repeats, args.settle_s))
        row["tflops"] = krea2_flops(cfg, hidden.shape[1], text.shape[1]) / row["s_per_step"] / 1e12
        if resident < cfg.num_layers:
            row.update(_streamed_block_times(streamed, hidden, text, timestep, position_ids, mask))
    except Exception as e:
        row["error"] = error_text(e)
    stats = device.memory_stats() or {}
    row["peak_gb"] = stats.get("peak_bytes_in_use", 0) / 1e9
    row["limit_gb"] = stats.get("bytes_limit", 0) / 1e9
    return [emit(row)]


def _streamed_model(cfg, precision: str, resident: int, prefetch: int):
    """A `StreamedKrea2` of random weights, made tensor by tensor (`random_model`): blocks from `resident` on go
    straight to pinned host memory."""
    import jax.numpy as jnp
    from flax import nnx

    from mxdit.model.krea2 import Krea2Transformer, stack_projections
    from mxdit.model.offload import StreamedKrea2, streamed_block_placement
    from mxdit.ops.names import Precision
    from mxdit.quant.model import krea2_rules, quantize_on_load

    weight_format = Precision(precision).weight_format
    places = [quantize_on_load(krea2_rules(weight_format))] if weight_format else []
    places.append(streamed_block_placement(resident))  # after quantizing: the host holds what the device will run
    model = random_model(lambda: Krea2Transformer(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), *places)
    if precision != "bf16":
        stack_projections(model)  # as generate.py runs a quantized model (host-memory blocks stay in host memory)
    return StreamedKrea2(model, resident=resident, prefetch=prefetch)


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

    def median_ms(fn):
        return median_seconds(fn, repeats) * 1e3

    copy_ms = median_ms(lambda: jax.device_put(host, on_device))
    gb = sum(leaf.nbytes for leaf in jax.tree.leaves(host)) / 1e9
    return {"block_gb": gb, "copy_ms": copy_ms, "copy_gb_s": gb / copy_ms * 1e3,
            "block_ms": median_ms(lambda: streamed._block(streamed.rest_state, state, block_args)),
            "block_and_copy_ms": median_ms(lambda: (jax.device_put(host, on_device),
                                                    streamed._block(streamed.rest_state, state, block_args)))}
