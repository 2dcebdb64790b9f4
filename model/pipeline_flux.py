"""FLUX.1 text-to-image: CLIP (pooled) + T5 text encoders -> flow-matching Euler loop over the FLUX transformer ->
VAE decode. Equal in function to diffusers' `FluxPipeline` (0.42.1).

FLUX.1-dev embeds the guidance scale (default 3.5, 28 steps, shift from the image size); FLUX.1-schnell has no
guidance embedding (4 steps, T5 length 256, no dynamic shift). True classifier-free guidance with a negative prompt
runs when `true_cfg_scale > 1`: `neg + s * (pred - neg)`, both branches batched.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from .clip_text import CLIPTextEncoder
from .flow_match import NUM_TRAIN_TIMESTEPS, ShiftConfig, euler_step, flow_match_schedule
from .flux import FluxTransformer
from .images import to_pil
from .loading import read_json
from .pipeline_common import PipelineOutput, check_components, image_position_ids, initial_noise, unpack_latents
from .programs import stored_jit
from .t5_encoder import T5Encoder
from .tokenizer import TextTokenizer
from .vae_flux import FluxVAE

COMPONENTS = ("transformer", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
FLUX_SHIFT = ShiftConfig(base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)


class FluxPipeline:
    """Prompts to images with FLUX.1 (dev or schnell)."""

    def __init__(self, transformer: FluxTransformer, vae: FluxVAE, text_encoder: CLIPTextEncoder,
                 tokenizer: TextTokenizer, text_encoder_2: T5Encoder, tokenizer_2: TextTokenizer,
                 shift: ShiftConfig | None = FLUX_SHIFT, static_shift: float = 1.0):
        self.transformer, self.vae = transformer, vae
        self.text_encoder, self.tokenizer = text_encoder, tokenizer
        self.text_encoder_2, self.tokenizer_2 = text_encoder_2, tokenizer_2
        self.shift, self.static_shift = shift, static_shift  # shift None: no dynamic shifting (schnell)
        self.vae_scale_factor = vae.config.spatial_compression
        # Replaces `denoise_step` (same arguments, without the model) when set: model/offload.py streams the blocks.
        self.denoise_step_fn = None
        self.lora_slots = None  # LoRAs whose weights change between calls (as Krea2Pipeline's)

    @property
    def is_dev(self) -> bool:
        return self.transformer.config.guidance_embeds

    @classmethod
    def from_pretrained(cls, folder: str | Path, dtype: jnp.dtype = jnp.bfloat16, *,
                        transformer: FluxTransformer | None = None) -> "FluxPipeline":
        """Load a diffusers-layout FLUX.1 folder; `transformer`: one loaded otherwise (a quantized checkpoint), in
        place of transformer/'s."""
        folder = check_components(folder, COMPONENTS, "FLUX.1")
        scheduler = folder / "scheduler" / "scheduler_config.json"
        config = read_json(scheduler) if scheduler.is_file() else {"use_dynamic_shifting": True}
        shift = None
        if config.get("use_dynamic_shifting", False):
            shift = ShiftConfig(**{k: config[k] for k in ("base_shift", "max_shift", "base_image_seq_len",
                                                          "max_image_seq_len") if k in config})
        return cls(
            transformer or FluxTransformer.from_pretrained(folder / "transformer", dtype),
            FluxVAE.from_pretrained(folder / "vae", dtype),
            CLIPTextEncoder.from_pretrained(folder / "text_encoder", dtype),
            TextTokenizer.from_folder(folder / "tokenizer"),
            T5Encoder.from_pretrained(folder / "text_encoder_2", dtype),
            TextTokenizer.from_folder(folder / "tokenizer_2"),
            shift=shift,
            static_shift=float(config.get("shift", 1.0)),
        )

    def encode_prompt(self, prompts: Sequence[str], prompts_2: Sequence[str] | None = None,
                      max_sequence_length: int = 512) -> tuple[jax.Array, jax.Array]:
        """(T5 states (batch, max_sequence_length, d_model), CLIP pooled output (batch, hidden)), as diffusers'
        `FluxPipeline.encode_prompt` (no attention masks: padding is attended, as FLUX was trained)."""
        clip_ids, _ = self.tokenizer(list(prompts), max_length=self.tokenizer.model_max_length or 77)
        t5_ids, _ = self.tokenizer_2(list(prompts_2 or prompts), max_length=max_sequence_length)
        pooled = _clip_pooled(self.text_encoder, jnp.asarray(clip_ids))
        return _t5(self.text_encoder_2, jnp.asarray(t5_ids)), pooled

    def __call__(
        self,
        prompt: str | Sequence[str],
        negative_prompt: str | Sequence[str] | None = None,
        *,
        height: int = 1024,
        width: int = 1024,
        num_inference_steps: int | None = None,
        guidance_scale: float = 3.5,
        true_cfg_scale: float = 1.0,
        num_images_per_prompt: int = 1,
        seed: int | Sequence[int] = 0,
        latents: np.ndarray | None = None,
        max_sequence_length: int | None = None,
        callback: Callable[[int, float, jax.Array], None] | None = None,
        output_type: str = "pil",
        tiled_decode: bool = False,
    ) -> PipelineOutput:
        """Generate images. Defaults: dev 28 steps and T5 length 512; schnell 4 steps and 256. `guidance_scale` is
        the distilled guidance dev embeds (ignored by schnell). `seed`: one for the batch, or one per image (each image
        as it would be alone with its seed)."""
        multiple = self.vae_scale_factor * 2
        if height % multiple or width % multiple or height <= 0 or width <= 0:
            raise ValueError(f"height and width must be positive multiples of {multiple}, got {height}x{width}")
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        steps = num_inference_steps or (28 if self.is_dev else 4)
        max_sequence_length = max_sequence_length or (512 if self.is_dev else 256)
        true_cfg = true_cfg_scale > 1 and negative_prompt is not None
        batch = len(prompts) * num_images_per_prompt
        timings = {}

        t0 = time.perf_counter()
        embeds, pooled = self.encode_prompt(prompts, max_sequence_length=max_sequence_length)
        if true_cfg:
            negatives = [negative_prompt] * len(prompts) if isinstance(negative_prompt, str) else list(negative_prompt)
            neg_embeds, neg_pooled = self.encode_prompt(negatives, max_sequence_length=max_sequence_length)
            embeds, pooled = jnp.concatenate([embeds, neg_embeds]), jnp.concatenate([pooled, neg_pooled])
        if num_images_per_prompt > 1:
            embeds = jnp.repeat(embeds, num_images_per_prompt, axis=0)
            pooled = jnp.repeat(pooled, num_images_per_prompt, axis=0)
        jax.block_until_ready(embeds)
        timings["text encode"] = time.perf_counter() - t0

        grid_h, grid_w = height // multiple, width // multiple
        channels = self.transformer.config.in_channels
        if latents is None:
            latents = initial_noise(seed, batch, grid_h, grid_w, channels)
        latents = jnp.asarray(latents, jnp.float32)
        if latents.shape != (batch, grid_h * grid_w, channels):
            raise ValueError(f"latents must have shape {(batch, grid_h * grid_w, channels)}, got {latents.shape}")
        if self.shift is not None:
            sigmas, timesteps = flow_match_schedule(steps, image_seq_len=grid_h * grid_w, shift=self.shift)
        else:
            sigmas, timesteps = flow_match_schedule(steps, static_shift=self.static_shift)
        img_ids = jnp.asarray(image_position_ids(grid_h, grid_w))
        txt_ids = jnp.zeros((embeds.shape[1], 3), jnp.float32)
        guidance = jnp.float32(guidance_scale) if self.is_dev else None

        t0 = time.perf_counter()
        # As diffusers' pipeline: the timestep in the transformer's dtype, divided there by 1000 (rounded on the host)
        dtype = self.transformer.dtype
        times = np.asarray(timesteps, np.float32).astype(dtype) / np.asarray(NUM_TRAIN_TIMESTEPS, dtype)
        times = times.astype(np.float32)
        if callback is None and self.denoise_step_fn is None:
            # nothing to report between steps: the whole loop is one program (as Krea 2's)
            latents = denoise_loop(self.transformer, latents, embeds, pooled, img_ids, txt_ids, jnp.asarray(times),
                                    guidance, jnp.asarray(sigmas, jnp.float32), jnp.float32(true_cfg_scale), true_cfg)
        else:
            step_fn = self.denoise_step_fn or functools.partial(denoise_step, self.transformer)
            for i in range(steps):
                latents = step_fn(latents, embeds, pooled, img_ids, txt_ids, jnp.float32(times[i]), guidance,
                               jnp.float32(sigmas[i]), jnp.float32(sigmas[i + 1]), jnp.float32(true_cfg_scale),
                               true_cfg)
                if callback is not None:
                    callback(i, float(timesteps[i]), latents)
        latents = jax.block_until_ready(latents)
        timings["denoise"] = time.perf_counter() - t0

        images = None
        if output_type != "latent":
            t0 = time.perf_counter()
            z = self.vae.denormalize_latents(unpack_latents(latents, grid_h, grid_w))
            decoded = np.asarray(self.vae.decode(z.astype(self.vae.dtype), tiled=tiled_decode), np.float32)
            images = to_pil(decoded) if output_type == "pil" else np.clip(decoded / 2 + 0.5, 0.0, 1.0)
            timings["decode"] = time.perf_counter() - t0
        timings["total"] = sum(timings.values())
        return PipelineOutput(images=images, latents=np.asarray(latents), timings=timings)


# The modules as pytrees (`jax.jit`): far less host time a call than `nnx.jit`'s graph traversal (pipeline_krea2).
@stored_jit
def _clip_pooled(encoder: CLIPTextEncoder, ids):
    return encoder(ids)[1]


@stored_jit
def _t5(encoder: T5Encoder, ids):
    return encoder(ids)


def _denoise_step(model: FluxTransformer, latents, embeds, pooled, img_ids, txt_ids, t, guidance, sigma, sigma_next,
                  true_cfg_scale, true_cfg: bool):
    """One Euler step; with true CFG the batch of embeds holds [conditional; negative]. `model`: the transformer
    or anything called as it (model/offload.py's streamed one calls this outside jit)."""
    x = jnp.concatenate([latents, latents]) if true_cfg else latents
    n = x.shape[0]
    g = None if guidance is None else jnp.full((n,), guidance, jnp.float32)
    velocity = model(x.astype(model.dtype), embeds, pooled, jnp.full((n,), t, jnp.float32), img_ids, txt_ids, g)
    if true_cfg:
        batch = latents.shape[0]
        cond, neg = velocity[:batch], velocity[batch:]
        velocity = neg + true_cfg_scale.astype(cond.dtype) * (cond - neg)
    return euler_step(latents, velocity, sigma, sigma_next)


denoise_step = stored_jit(_denoise_step, static_argnames=("true_cfg",))


@stored_jit(static_argnames=("true_cfg",))
def denoise_loop(model: FluxTransformer, latents, embeds, pooled, img_ids, txt_ids, times, guidance, sigmas,
                  true_cfg_scale, true_cfg: bool):
    """All of `denoise_step`'s steps in one program: times (steps,) flow times, sigmas (steps + 1,)."""
    def body(i, latents):
        return _denoise_step(model, latents, embeds, pooled, img_ids, txt_ids, times[i], guidance, sigmas[i], sigmas[i + 1],
                     true_cfg_scale, true_cfg)

    return jax.lax.fori_loop(0, times.shape[0], body, latents)
