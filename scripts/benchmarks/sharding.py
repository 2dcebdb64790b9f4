"""The Krea 2 denoising step on device meshes (`sharding/krea2.py`): sequence-parallel, CFG-parallel."""

from __future__ import annotations

import numpy as np

from .inputs import krea2_config, krea2_flops, krea2_inputs
from .rows import emit, error_text, step_table, write_json
from .timing import jax_peak_gb, timed

# The demo pipeline's transformer: a CPU smoke run of `krea2-sharded-step --tiny` (heads enough for 8-way sequence
# parallelism).
TINY_SHARDED_KREA2 = dict(in_channels=64, num_layers=4, attention_head_dim=32, num_attention_heads=8,
                          num_key_value_heads=2, intermediate_size=512, timestep_embed_dim=64, text_hidden_dim=64,
                          num_text_layers=4, text_num_attention_heads=4, text_num_key_value_heads=4,
                          text_intermediate_size=128, axes_dims_rope=(8, 12, 12))


def krea2_sharded_step(args) -> None:
    """The Krea 2 denoising step of the pipeline on each of --meshes, a dispatch per step."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mxdit.model.krea2 import Krea2Config, Krea2Transformer
    from mxdit.sharding.krea2 import krea2_denoise_step
    from mxdit.sharding.mesh import make_mesh

    cfg = Krea2Config(**TINY_SHARDED_KREA2) if args.tiny else krea2_config(args)
    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    model = Krea2Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(0))
    latents, text, _, ids, mask = krea2_inputs(cfg, args.height, args.width, args.text_len, args.valid_text,
                                               batch=args.batch)
    if args.guidance:  # Base: [conditional; unconditional] in one batch
        text, mask = np.concatenate([text, text]), np.concatenate([mask, mask])
    text, latents = jnp.asarray(text, dtype), jnp.asarray(latents)
    mask, ids = jnp.asarray(mask), jnp.asarray(ids)
    flops = krea2_flops(cfg, latents.shape[1], text.shape[1]) * text.shape[0]
    rows = []
    for mesh_text in args.meshes:
        row = {"name": f"jax {jnp.dtype(dtype).name}, mesh {mesh_text or '1 device'}, {args.method or 'auto'}"}
        try:
            step = krea2_denoise_step(model, make_mesh(mesh_text), method=args.method)

            def run(n, x=latents, step=step):
                for i in range(n):  # sigma 1 -> 0.999: the latents stay in range over many steps
                    x = step(x, text, mask, ids, jnp.float32(0.7 - 1e-4 * i), jnp.float32(1.0),
                             jnp.float32(0.999), jnp.float32(4.5), args.guidance)
                return jax.block_until_ready(x)

            row.update(timed(run, args.iters, args.repeats))
            row["tflops"] = flops / row["s_per_step"] / 1e12
            row["peak_gb"] = jax_peak_gb(all_devices=True)
        except Exception as e:
            row["error"] = error_text(e)
        rows.append(emit(row))
    step_table(rows, f"Krea 2 step on {jax.device_count()} {jax.devices()[0].platform} devices, {args.height}x"
                     f"{args.width}, batch {args.batch}{' with CFG' if args.guidance else ''}, text {args.text_len} "
                     f"({args.valid_text} real); TFLOP/s summed over devices, peak GB of the fullest device")
    write_json(args, rows)
