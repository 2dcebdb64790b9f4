"""A LoRA training step (forward, backward to the adapters, clipping, AdamW) of Krea 2 or FLUX.1-dev, per
rematerialization policy."""

from __future__ import annotations

import statistics
import time

import numpy as np

from mxdit.cli import progress

from .inputs import flux_inputs, krea2_inputs, lora_step_config, random_model
from .rows import emit, error_text, flags, subprocess_rows, write_json
from .timing import jax_peak_gb, memory_fraction


def lora_step(args) -> None:
    """One subprocess per base format, --remat policy and memory cap, so that the device's peak memory is each
    variant's own; then diffusers' own recipe (PEFT adapters, bf16) per policy and cap."""
    forwarded = flags(args, "height", "width", "text_len", "valid_text", "rank", "iters", "repeats", "num_layers",
                      "tiny")
    rows = []
    for cap in args.memory_caps:
        limit = [] if cap == "none" else ["--memory-cap-gb", cap]
        env = None if cap == "none" else {"XLA_PYTHON_CLIENT_MEM_FRACTION": memory_fraction(float(cap))}
        for base in args.bases:
            quantized = [] if base == "bf16" else ["--quantize-base", base]
            for remat in args.remat:
                rows += subprocess_rows(args, f"{args.family}-lora-step-jax",
                                        forwarded + quantized + limit + ["--remat", remat], env=env)
        if args.diffusers:
            for remat in args.remat:
                rows += subprocess_rows(args, f"{args.family}-lora-step-diffusers",
                                        forwarded + limit + ["--remat", remat])
    size = "tiny model" if args.tiny else "full size"
    model = {"krea2": "Krea 2", "flux": "FLUX.1-dev"}[args.family]
    real = f" ({args.valid_text} real)" if args.family == "krea2" else ""  # FLUX.1 attends to every text token
    print(f"\n{model} LoRA training step ({size}), {args.height}x{args.width}, batch 1, text {args.text_len}{real}. "
          "Peak GB: device peak (0 where the device reports none); temp GB: the "
          "compiled step's temporaries (what remat trades); program GB: its arguments + temporaries + outputs")
    print(f"{'variant':<80} {'s/step':>8} {'peak GB':>8} {'temp GB':>8} {'program GB':>10} {'warm-up s':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:<80} error: {r['error']}")
        else:
            print(f"{r['name']:<80} {r['s_per_step']:8.4f} {r['peak_gb']:8.2f} {r.get('temp_gb', 0):8.2f} "
                  f"{r.get('program_gb', 0):10.2f} {r['compile_s']:9.1f}")
    write_json(args, rows)


def _model_and_batch(args):
    """The family's transformer (full size, --num-layers blocks, or --tiny) with random weights made tensor by tensor
    (`random_model`: with --quantize-base, each block matrix quantized as it is made, so that the device never holds
    the bf16 base, as train_lora.py --quantize-base reads a model), and a training batch of one example."""
    import jax.numpy as jnp
    from flax import nnx

    from mxdit.quant.model import quantize_on_load

    cfg = lora_step_config(args)
    if args.family == "flux":
        from mxdit.model.flux import FluxTransformer
        from mxdit.quant.model import flux_rules as rules

        model_cls = FluxTransformer
        hidden, text, pooled, img_ids, txt_ids = flux_inputs(cfg, args.height, args.width, args.text_len)
        batch = {"latents": jnp.asarray(hidden)[None], "embeds": jnp.asarray(text, jnp.bfloat16)[None],
                 "mask": jnp.ones((1, 1, args.text_len), bool), "pooled": jnp.asarray(pooled, jnp.bfloat16)[None],
                 "position_ids": jnp.asarray(np.concatenate([txt_ids, img_ids]))}
    else:
        from mxdit.model.krea2 import Krea2Transformer
        from mxdit.quant.model import krea2_rules as rules

        model_cls = Krea2Transformer
        hidden, text, _, position_ids, mask = krea2_inputs(cfg, args.height, args.width, args.text_len,
                                                           args.valid_text)
        batch = {"latents": jnp.asarray(hidden)[None], "embeds": jnp.asarray(text, jnp.bfloat16)[None],
                 "mask": jnp.asarray(mask)[None], "position_ids": jnp.asarray(position_ids)}
    places = [quantize_on_load(rules(args.quantize_base))] if args.quantize_base else []
    return random_model(lambda: model_cls(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), *places,
                        limit_gb=args.memory_cap_gb), batch


def jax_lora_step(args) -> list[dict]:
    """One LoRA training step of full-size Krea 2 or FLUX.1-dev (`args.family`) with random bf16 weights, batch 1,
    as `training.train.train_step` runs it, under one remat policy. Timed by syncing after `iters` dispatched
    steps."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mxdit.training.lora import LoraConfig, add_lora
    from mxdit.training.train import REMAT_POLICIES, TrainConfig, jit_train_step, make_optimizer

    start = time.perf_counter()
    try:
        model, batch = _model_and_batch(args)
    except MemoryError as e:  # a base that cannot fit the cap is a result too
        return [emit({"name": _row_name(args), "error": error_text(e), "peak_gb": jax_peak_gb()})]
    jax.block_until_ready(nnx.state(model))
    build_s = time.perf_counter() - start
    progress(f"model built in {build_s:.1f} s")
    names = add_lora(model, LoraConfig(rank=args.rank, alpha=float(args.rank)))
    model.remat_policy = REMAT_POLICIES[args.remat]
    config = TrainConfig(steps=10_000, remat=args.remat)
    graphdef, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)
    lora = jax.tree.map(jnp.copy, lora)
    opt_state = make_optimizer(config).init(lora)
    lora, opt_state = jax.device_put((lora, opt_state), jax.devices()[0])
    key = jax.random.key(0)
    row = {"name": _row_name(args, len(names)), "lora_params": sum(int(x.size) for x in jax.tree.leaves(lora)),
           "build_s": build_s}
    try:
        t0 = time.perf_counter()
        compiled = jit_train_step.lower(graphdef, config, frozen, lora, opt_state, batch, key).compile()
        row["compile_s"] = time.perf_counter() - t0
        progress(f"compiled in {row['compile_s']:.1f} s")
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
            progress(f"{times[-1]:.4f} s a step")
        row["s_per_step"] = statistics.median(times)
        row["spread"] = (max(times) - min(times)) / row["s_per_step"]
        row["loss"] = float(metrics["loss"])
    except Exception as e:  # an out-of-memory variant is a result too
        row["error"] = error_text(e)
    row["peak_gb"] = jax_peak_gb()
    return [emit(row)]


def _row_name(args, adapters: int | None = None) -> str:
    return (f"jax {args.family} LoRA step bf16, rank {args.rank}, "
            + (f"{adapters} adapters, " if adapters is not None else "") + f"remat {args.remat}"
            + (f", base {args.quantize_base}" if args.quantize_base else "")
            + (f", capped at {args.memory_cap_gb:g} GB" if args.memory_cap_gb else ""))
