"""The built-in demo: a tiny Krea 2-shaped transformer with RANDOM weights runs the 8-step Turbo Euler loop on the CPU.

It exercises the real code path (config, model, rotary positions, text padding mask, the flow-matching schedule and
the jitted denoising loop) in a few seconds. Random weights produce no meaningful image; this shows the machinery
runs and how the time splits between compilation and steps.

    python scripts/demo.py [--steps 8] [--size 256] [--seed 0]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mxdit.model.flow_match import KREA2_TURBO_MU, euler_sample, flow_match_schedule
from mxdit.model.krea2 import Krea2Config, Krea2Transformer

# Krea 2's structure (GQA 4:1, 3-axis rotary split 1/4, 3/8, 3/8, text fusion) at a width that runs on a laptop CPU.
DEMO_CONFIG = Krea2Config(
    in_channels=64, num_layers=4, attention_head_dim=32, num_attention_heads=8, num_key_value_heads=2,
    intermediate_size=512, timestep_embed_dim=64, text_hidden_dim=128, num_text_layers=4,
    text_num_attention_heads=4, text_num_key_value_heads=4, text_intermediate_size=256,
    axes_dims_rope=(8, 12, 12),
)


def run_demo(steps: int = 8, size: int = 256, seed: int = 0, text_len: int = 64, real_text: int = 20) -> dict:
    """Denoise one random latent with the demo model; returns the final latents and the time per stage."""
    if size % 16:
        raise ValueError(f"--size must be a multiple of 16, got {size}")
    times = {}
    t0 = time.perf_counter()
    model = Krea2Transformer(DEMO_CONFIG, dtype=jnp.float32, rngs=nnx.Rngs(seed))
    times["build model (random weights)"] = time.perf_counter() - t0

    rng = np.random.default_rng(seed)
    grid = size // 16  # 8x VAE downsampling, then 2x2 patches
    latents = jnp.asarray(rng.standard_normal((1, grid * grid, DEMO_CONFIG.in_channels), np.float32))
    text = jnp.asarray(rng.standard_normal((1, text_len, DEMO_CONFIG.num_text_layers, DEMO_CONFIG.text_hidden_dim),
                                           np.float32))
    mask = jnp.arange(text_len)[None] < real_text
    image_ids = np.stack(np.meshgrid(np.zeros(1), np.arange(grid), np.arange(grid), indexing="ij"), -1).reshape(-1, 3)
    position_ids = jnp.asarray(np.concatenate([np.zeros((text_len, 3)), image_ids]), jnp.float32)
    sigmas, timesteps = flow_match_schedule(steps, mu=KREA2_TURBO_MU)

    @nnx.jit
    def denoise(model, latents):
        return euler_sample(lambda x, t: model(x, text, t, position_ids, mask), latents, sigmas, timesteps)

    t0 = time.perf_counter()
    denoise.lower(model, latents).compile()
    times["compile denoising loop"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = jax.block_until_ready(denoise(model, latents))
    times[f"denoise ({steps} steps)"] = time.perf_counter() - t0
    return {"latents": np.asarray(out), "times": times, "tokens": grid * grid + text_len}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--size", type=int, default=256, help="image side in pixels (multiple of 16)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    try:
        result = run_demo(args.steps, args.size, args.seed)
    except ValueError as e:
        parser.exit(2, f"demo.py: error: {e}\n")
    print("mxdit demo: Krea 2-shaped transformer with RANDOM weights (no trained model), Turbo schedule")
    print(f"device {jax.devices()[0]}, {result['tokens']} tokens a step")
    for stage, seconds in result["times"].items():
        print(f"  {stage:<32} {seconds:8.3f} s")
    latents = result["latents"]
    print(f"final latents {latents.shape}: mean {latents.mean():+.3f}, std {latents.std():.3f}, "
          f"finite {bool(np.isfinite(latents).all())}")


if __name__ == "__main__":
    main()
