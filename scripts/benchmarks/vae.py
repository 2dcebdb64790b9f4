"""VAE decoding (Qwen-Image's and FLUX.1's), ours tiled and untiled against diffusers'."""

from __future__ import annotations

import statistics
import time

from .rows import emit, error_text, subprocess_rows, write_json
from .timing import jax_peak_gb


def vae_decode(args) -> None:
    """diffusers' decodes in one subprocess (--no-diffusers: none), ours in a subprocess per VAE."""
    common = ["--sizes", *map(str, args.sizes), "--repeats", str(args.repeats)]
    rows = subprocess_rows(args, "vae-decode-diffusers", ["--vaes", *args.vaes, *common]) if args.diffusers else []
    for name in args.vaes:
        rows += subprocess_rows(args, "vae-decode-jax", ["--vaes", name, *common])
    print("\nVAE decode (random full-size weights, bf16). Peak GB: diffusers, max allocated; JAX tiled, device peak;"
          " JAX untiled, the compiled program's weights + temporaries + output")
    print(f"{'implementation':<52} {'seconds':>8} {'peak GB':>8} {'warm-up s':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:<52} error: {r['error']}")
        else:
            peak = f"{r['peak_gb']:8.2f}" if "peak_gb" in r else f"{'-':>8}"
            print(f"{r['name']:<52} {r['s']:8.4f} {peak} {r['compile_s']:9.1f}")
    write_json(args, rows)


def jax_vae_decode(args) -> list[dict]:
    """Our VAE decodes with full-size random weights: tiled at the largest size first, so that the device's peak
    memory after it is the tiled decode's own; then untiled at each size, whose footprint is read from the compiled
    program. Run once per VAE, in its own process (`vae_decode` does)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mxdit.model import vae_flux, vae_qwenimage

    classes = {"qwen": (vae_qwenimage.QwenImageVAE, vae_qwenimage.QwenImageVAEConfig, vae_qwenimage._decode_fn),
               "flux": (vae_flux.FluxVAE, vae_flux.FluxVAEConfig, vae_flux._decode_fn)}
    rows = []
    for name in args.vaes:
        cls, config_cls, decode_fn = classes[name]
        vae = cls(config_cls(), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        for size, tiled in [(max(args.sizes), True)] + [(size, False) for size in args.sizes]:
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
                    row["peak_gb"] = jax_peak_gb()
                else:  # the compiled program's own footprint: weights, temporaries, output
                    mem = decode_fn.lower(vae, latents).compile().memory_analysis()
                    row["peak_gb"] = (mem.temp_size_in_bytes + mem.argument_size_in_bytes
                                      + mem.output_size_in_bytes) / 1e9
            except Exception as e:
                row["error"] = error_text(e)
            rows.append(emit(row))
        del vae
    return rows
