"""The FLUX.1-dev transformer step, ours against diffusers' (in a subprocess)."""

from __future__ import annotations

import itertools

from .inputs import flux_flops, flux_inputs
from .rows import emit, error_text, flags, step_table, subprocess_rows, write_json
from .timing import jax_peak_gb, timed


def flux_step(args) -> None:
    forwarded = flags(args, "height", "width", "text_len", "iters", "repeats", "settle_s")
    rows = subprocess_rows(args, "flux-step-diffusers", forwarded) if args.diffusers else []
    rows += subprocess_rows(args, "flux-step-jax", forwarded + flags(args, "precisions") + [
        "--stacked", "yes" if args.stacked else "no", *flags(args, "jax_attention")])
    step_table(rows, f"FLUX.1-dev step, {args.height}x{args.width}, text {args.text_len}")
    write_json(args, rows)


def jax_flux_step(args) -> list[dict]:
    """Our FLUX.1-dev step (random full-size weights) for each --precisions x --jax-attention, a jitted call per
    step dispatched back to back."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mxdit.model.flux import FluxConfig, FluxTransformer
    from mxdit.model.pipelines import prepare_transformer

    cfg = FluxConfig()
    base = FluxTransformer(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    hidden, text, pooled, img_ids, txt_ids = flux_inputs(cfg, args.height, args.width, args.text_len)
    flops = flux_flops(cfg, hidden.shape[1], text.shape[1])
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

        def steps(n, step=step, state=state):  # bound now: `state` is deleted below
            x = hidden
            for i in range(n):
                x = step(state, x, 0.9 - 0.01 * i)
            return jax.block_until_ready(x)

        row = {"name": f"jax FLUX.1-dev {precision}{' stacked' if args.stacked else ''}, {model.attention} "
                       f"attention, a dispatch per step"}
        try:
            row.update(timed(steps, args.iters, args.repeats, args.settle_s))
            row["tflops"] = flops / row["s_per_step"] / 1e12
        except Exception as e:
            row["error"] = error_text(e)
        row["peak_gb"] = jax_peak_gb()
        rows.append(emit(row))
        del model, state
    return rows
