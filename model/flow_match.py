"""Flow-matching Euler sampling, equal to diffusers' `FlowMatchEulerDiscreteScheduler` as the Krea 2 and FLUX
pipelines configure it (dynamic exponential time shift, 1000 training timesteps).

The schedule is computed on the host in the same float32 arithmetic as diffusers, so sigmas and timesteps agree to the
last bit; the update itself is a pure function that runs inside the jitted denoising loop.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

NUM_TRAIN_TIMESTEPS = 1000


@dataclasses.dataclass(frozen=True)
class ShiftConfig:
    """Resolution-aware shift: mu grows linearly in the image token count from `base_shift` at `base_image_seq_len`
    to `max_shift` at `max_image_seq_len`. Defaults are Krea 2's scheduler config."""

    base_shift: float = 0.5
    max_shift: float = 1.15
    base_image_seq_len: int = 256
    max_image_seq_len: int = 6400


KREA2_SHIFT = ShiftConfig()
KREA2_TURBO_MU = 1.15  # the distilled Turbo checkpoint always uses this shift, whatever the resolution


def calculate_shift(image_seq_len: int, shift: ShiftConfig = KREA2_SHIFT) -> float:
    """mu for an image of `image_seq_len` tokens (diffusers' `calculate_shift`)."""
    m = (shift.max_shift - shift.base_shift) / (shift.max_image_seq_len - shift.base_image_seq_len)
    b = shift.base_shift - m * shift.base_image_seq_len
    return image_seq_len * m + b


def flow_match_schedule(
    num_inference_steps: int,
    *,
    image_seq_len: int | None = None,
    mu: float | None = None,
    shift: ShiftConfig = KREA2_SHIFT,
    static_shift: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Sigmas and timesteps of the Euler schedule.

    Pass `mu` for a fixed exponential shift (Krea 2 Turbo: `KREA2_TURBO_MU`), `image_seq_len` to compute mu from the
    resolution (Krea 2 Base, FLUX.1-dev), or `static_shift` for a scheduler without dynamic shifting (FLUX.1-schnell:
    1.0). Returns `(sigmas, timesteps)`: float32 arrays of `num_inference_steps + 1` sigmas (ending in 0) and
    `num_inference_steps` timesteps (`1000 * sigma`); the model is fed `timesteps / 1000`.
    """
    if num_inference_steps < 1:
        raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
    if sum(x is not None for x in (mu, image_seq_len, static_shift)) != 1:
        raise ValueError("pass exactly one of mu (a fixed shift), image_seq_len (a resolution-aware shift) or "
                         "static_shift")
    sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps).astype(np.float32)
    if static_shift is not None:
        sigmas = static_shift * sigmas / (1 + (static_shift - 1) * sigmas)
    else:
        mu = calculate_shift(image_seq_len, shift) if mu is None else mu
        sigmas = math.exp(mu) / (math.exp(mu) + (1 / sigmas - 1))  # exponential time shift, in float32 as diffusers
    timesteps = sigmas * np.float32(NUM_TRAIN_TIMESTEPS)
    return np.append(sigmas, np.float32(0.0)).astype(np.float32), timesteps.astype(np.float32)


def euler_step(sample: jax.Array, velocity: jax.Array, sigma: jax.Array, sigma_next: jax.Array) -> jax.Array:
    """x_next = x + (sigma_next - sigma) * v, accumulated in float32.

    As in diffusers, the sample is upcast to float32 while the product `dt * v` is formed in the velocity's dtype
    (torch promotes a 0-d float32 tensor times a bfloat16 tensor to bfloat16).
    """
    dt = jnp.asarray(sigma_next - sigma, jnp.float32).astype(velocity.dtype)
    return sample.astype(jnp.float32) + (dt * velocity).astype(jnp.float32)

