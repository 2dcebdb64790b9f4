"""Krea 2 text-to-image: prompts -> Qwen3-VL tapped hidden states -> flow-matching Euler loop over the Krea 2
transformer -> Qwen-Image VAE decode. Equal in function to diffusers' `Krea2Pipeline` (0.42.1).

Turbo (the distilled checkpoint, `is_distilled` in model_index.json): fixed shift mu = 1.15, no classifier-free
guidance, 8 steps. Base: resolution-aware shift, CFG with a negative prompt, 28 steps at guidance 4.5 (diffusers'
convention: `pred + g * (pred - neg)`, so g = 0 turns CFG off).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .pipeline_common import PipelineOutput, check_components, image_position_ids, initial_noise, unpack_latents
from .flow_match import KREA2_TURBO_MU, NUM_TRAIN_TIMESTEPS, ShiftConfig, euler_step, flow_match_schedule
from .images import to_pil
from .krea2 import JOINT_TOKENS_MULTIPLE, Krea2Config, Krea2Transformer, trim_padded_text
from .loading import read_json
from .programs import stored_jit
from .qwen3vl_text import Qwen3VLTextConfig, Qwen3VLTextEncoder
from .tokenizer import TextTokenizer, save_demo_tokenizer
from .vae_qwenimage import QwenImageVAE, QwenImageVAEConfig

# The Qwen-Image chat template. The prompt is padded to a fixed length *inside* the template, before the assistant
# suffix, as the model was trained; the 34 tokens of the system prefix are dropped from the encoder outputs.
PROMPT_PREFIX = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n"
)
PROMPT_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
PREFIX_TOKENS = 34
SUFFIX_TOKENS = 5
KREA2_TEXT_LAYERS = (2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35)  # Qwen3-VL-4B hidden states Krea 2 taps
COMPONENTS = ("transformer", "vae", "text_encoder", "tokenizer")


def template_tokens(tokenizer: TextTokenizer, prompts: Sequence[str],
                    max_sequence_length: int = 512) -> tuple[np.ndarray, np.ndarray]:
    """Ids and mask of the templated prompts, (batch, PREFIX_TOKENS + max_sequence_length) int32 / bool, as
    diffusers' `Krea2Pipeline.get_text_hidden_states` makes them: system prefix + prompt truncated and padded to
    max_sequence_length + PREFIX_TOKENS - SUFFIX_TOKENS, then the assistant suffix."""
    ids, mask = tokenizer([PROMPT_PREFIX + p for p in prompts],
                          max_length=max_sequence_length + PREFIX_TOKENS - SUFFIX_TOKENS)
    suffix_ids, suffix_mask = tokenizer([PROMPT_SUFFIX] * len(prompts))
    return np.concatenate([ids, suffix_ids], 1), np.concatenate([mask, suffix_mask], 1)


@dataclasses.dataclass(frozen=True)
class Krea2PipelineConfig:
    """What model_index.json and scheduler/scheduler_config.json say about sampling."""

    text_encoder_select_layers: tuple[int, ...] = KREA2_TEXT_LAYERS
    is_distilled: bool = False
    patch_size: int = 2
    shift: ShiftConfig = ShiftConfig()

    @property
    def default_steps(self) -> int:
        return 8 if self.is_distilled else 28

    @property
    def default_guidance(self) -> float:
        return 0.0 if self.is_distilled else 4.5


class Krea2Pipeline:
    """Prompts to images with the Krea 2 transformer, Qwen3-VL text encoder and Qwen-Image VAE."""

    def __init__(self, transformer: Krea2Transformer, vae: QwenImageVAE, text_encoder: Qwen3VLTextEncoder,
                 tokenizer: TextTokenizer, config: Krea2PipelineConfig = Krea2PipelineConfig()):
        if len(config.text_encoder_select_layers) != transformer.config.num_text_layers:
            raise ValueError(
                f"text_encoder_select_layers has {len(config.text_encoder_select_layers)} entries, the transformer "
                f"expects num_text_layers={transformer.config.num_text_layers}"
            )
        self.transformer, self.vae, self.text_encoder, self.tokenizer = transformer, vae, text_encoder, tokenizer
        self.config = config
        self.vae_scale_factor = vae.config.spatial_compression
        # `denoise_step` without its model argument, run on several devices (mxdit.sharding.shard_krea2_pipeline sets
        # it); None: `denoise_step` on the transformer, on its device.
        self.denoise_step_fn: Callable | None = None
        # LoRAs whose weights change between calls (`lora_files.LoraSlots`, set by `inference.build_pipeline`).
        self.lora_slots = None

    # -- loading -------------------------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, folder: str | Path, dtype: jnp.dtype = jnp.bfloat16, *,
                        transformer: Krea2Transformer | None = None) -> "Krea2Pipeline":
        """Load a diffusers-layout Krea 2 folder (model_index.json, transformer/, vae/, text_encoder/, tokenizer/,
        scheduler/); `transformer`: one loaded otherwise (a quantized checkpoint), in place of transformer/'s."""
        folder = check_components(folder, COMPONENTS, "Krea 2")
        index = read_json(folder / "model_index.json") if (folder / "model_index.json").is_file() else {}
        scheduler = folder / "scheduler" / "scheduler_config.json"
        shift = read_json(scheduler) if scheduler.is_file() else {}
        config = Krea2PipelineConfig(
            text_encoder_select_layers=tuple(index.get("text_encoder_select_layers") or KREA2_TEXT_LAYERS),
            is_distilled=bool(index.get("is_distilled", False)),
            patch_size=int(index.get("patch_size", 2)),
            shift=ShiftConfig(**{k: shift[k] for k in ("base_shift", "max_shift", "base_image_seq_len",
                                                       "max_image_seq_len") if k in shift}),
        )
        return cls(
            transformer or Krea2Transformer.from_pretrained(folder / "transformer", dtype),
            QwenImageVAE.from_pretrained(folder / "vae", dtype),
            Qwen3VLTextEncoder.from_pretrained(folder / "text_encoder", dtype),
            TextTokenizer.from_folder(folder / "tokenizer"),
            config,
        )

    # -- text ----------------------------------------------------------------------------------------------------------

    def encode_prompt(self, prompts: Sequence[str], max_sequence_length: int = 512) -> tuple[jax.Array, jax.Array]:
        """Tapped text-encoder states and mask for `prompts`: ((batch, L, num_text_layers, text_dim), (batch, L) bool)
        with L = max_sequence_length, exactly as diffusers' `Krea2Pipeline.get_text_hidden_states`."""
        ids, mask = template_tokens(self.tokenizer, prompts, max_sequence_length)
        # Positions count only real tokens, so the suffix after the padding sits right after the prompt.
        positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
        states = _encode_text(self.text_encoder, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(positions),
                              self.config.text_encoder_select_layers)
        return states[:, PREFIX_TOKENS:], jnp.asarray(mask[:, PREFIX_TOKENS:])

    # -- generation ----------------------------------------------------------------------------------------------------

    def trimmed_text(self, embeds, mask, height: int, width: int):
        """`trim_padded_text` as the pipeline applies it to (embeds, mask) for a height x width image: the kept text
        rounded so that image + text tokens is a multiple of `JOINT_TOKENS_MULTIPLE` where that fits."""
        multiple = self.vae_scale_factor * self.config.patch_size
        return trim_padded_text(embeds, mask, image_len=(height // multiple) * (width // multiple),
                                joint_multiple=JOINT_TOKENS_MULTIPLE)

    def __call__(
        self,
        prompt: str | Sequence[str],
        negative_prompt: str | Sequence[str] | None = None,
        *,
        height: int = 1024,
        width: int = 1024,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        num_images_per_prompt: int = 1,
        seed: int | Sequence[int] = 0,
        latents: np.ndarray | None = None,
        max_sequence_length: int = 512,
        callback: Callable[[int, float, jax.Array], None] | None = None,
        output_type: str = "pil",
        tiled_decode: bool = False,
        trim_text: bool = True,
    ) -> PipelineOutput:
        """Generate images.

        Args:
            prompt, negative_prompt: one string or one per batch element; the negative prompt (default "") is used
                only with classifier-free guidance (guidance_scale > 0).
            height, width: pixels, multiples of 16.
            num_inference_steps, guidance_scale: default 8 / 0 for Turbo, 28 / 4.5 for Base.
            seed: the noise is `jax.random.normal(key(seed))`, so the same seed gives the same images; a seed per
                image: each image as it would be alone with its seed (`pipeline_common.initial_noise`).
            latents: packed initial noise (batch * num_images_per_prompt, h/16 * w/16, 64) instead of the seeded one.
            callback: called after each step as callback(step_index, timestep, latents).
            output_type: "pil", "np" (float (batch, h, w, 3) in [0, 1]) or "latent" (no decode).
            trim_text: drop the padded text tokens before the denoising loop (`krea2.trim_padded_text`: the same
                result, a shorter sequence); False runs all max_sequence_length tokens, as diffusers does.
        """
        multiple = self.vae_scale_factor * self.config.patch_size
        if height % multiple or width % multiple or height <= 0 or width <= 0:
            raise ValueError(f"height and width must be positive multiples of {multiple}, got {height}x{width}")
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        steps = num_inference_steps or self.config.default_steps
        guidance = self.config.default_guidance if guidance_scale is None else guidance_scale
        cfg = guidance > 0
        batch = len(prompts) * num_images_per_prompt
        timings = {}

        t0 = time.perf_counter()
        embeds, mask = self.encode_prompt(prompts, max_sequence_length)
        if cfg:
            negatives = [""] * len(prompts) if negative_prompt is None else (
                [negative_prompt] * len(prompts) if isinstance(negative_prompt, str) else list(negative_prompt))
            if len(negatives) != len(prompts):
                raise ValueError(f"{len(negatives)} negative prompts for {len(prompts)} prompts")
            neg_embeds, neg_mask = self.encode_prompt(negatives, max_sequence_length)
            # Conditional and unconditional branches run as one batch through the transformer.
            embeds, mask = jnp.concatenate([embeds, neg_embeds]), jnp.concatenate([mask, neg_mask])
        embeds = jnp.repeat(embeds, num_images_per_prompt, axis=0) if num_images_per_prompt > 1 else embeds
        mask = jnp.repeat(mask, num_images_per_prompt, axis=0) if num_images_per_prompt > 1 else mask
        # The transformer's text stage depends on the prompt only: once here, not in every step.
        embeds = _fuse_text(self.transformer, embeds, mask)
        if trim_text:
            embeds, mask = self.trimmed_text(embeds, mask, height, width)
        embeds = jax.block_until_ready(embeds)
        timings["text encode"] = time.perf_counter() - t0

        grid_h, grid_w = height // multiple, width // multiple
        channels = self.transformer.config.in_channels
        if latents is None:
            latents = initial_noise(seed, batch, grid_h, grid_w, channels, self.config.patch_size)
        latents = jnp.asarray(latents, jnp.float32)
        if latents.shape != (batch, grid_h * grid_w, channels):
            raise ValueError(f"latents must have shape {(batch, grid_h * grid_w, channels)}, got {latents.shape}")
        if self.config.is_distilled:
            sigmas, timesteps = flow_match_schedule(steps, mu=KREA2_TURBO_MU, shift=self.config.shift)
        else:
            sigmas, timesteps = flow_match_schedule(steps, image_seq_len=grid_h * grid_w, shift=self.config.shift)
        ids = jnp.asarray(np.concatenate([np.zeros((embeds.shape[1], 3), np.float32), image_position_ids(grid_h, grid_w)]))

        t0 = time.perf_counter()
        # As diffusers' pipeline: t / 1000 rounded to the transformer's dtype (on the host, where XLA cannot skip it)
        times = (np.asarray(timesteps, np.float32) / np.float32(NUM_TRAIN_TIMESTEPS)).astype(self.transformer.dtype)
        times = times.astype(np.float32)
        if callback is None and self.denoise_step_fn is None:
            # Nothing to report between steps: the whole loop is one program (no dispatch or host work per step).
            latents = denoise_loop(self.transformer, latents, embeds, mask, ids, jnp.asarray(times),
                                   jnp.asarray(sigmas, jnp.float32), jnp.float32(guidance), cfg)
        else:
            step = self.denoise_step_fn or functools.partial(denoise_step, self.transformer)
            for i in range(steps):
                latents = step(latents, embeds, mask, ids, jnp.float32(times[i]), jnp.float32(sigmas[i]),
                               jnp.float32(sigmas[i + 1]), jnp.float32(guidance), cfg)
                if callback is not None:
                    callback(i, float(timesteps[i]), latents)
        latents = jax.block_until_ready(latents)
        timings["denoise"] = time.perf_counter() - t0

        images = None
        if output_type != "latent":
            t0 = time.perf_counter()
            z = self.vae.denormalize_latents(unpack_latents(latents, grid_h, grid_w, self.config.patch_size))
            decoded = np.asarray(self.vae.decode(z.astype(self.vae.dtype), tiled=tiled_decode), np.float32)
            images = to_pil(decoded) if output_type == "pil" else np.clip(decoded / 2 + 0.5, 0.0, 1.0)
            timings["decode"] = time.perf_counter() - t0
        timings["total"] = sum(timings.values())
        return PipelineOutput(images=images, latents=np.asarray(latents), timings=timings)


# The inference programs take the modules as pytrees (`jax.jit`, by way of `stored_jit`): flattening one costs ~2 ms a call on a slow host
# CPU, where `nnx.jit`'s graph traversal costs ~30 ms for Krea 2's transformer or text encoder.
@stored_jit(static_argnames=("layers",))
def _encode_text(encoder: Qwen3VLTextEncoder, ids, mask, positions, layers):
    return encoder(ids, mask, positions, layers)


@stored_jit
def _fuse_text(model: Krea2Transformer, embeds, mask):
    return model.fuse_text(embeds, mask)


def _denoise_step(model: Krea2Transformer, latents, embeds, mask, ids, t, sigma, sigma_next, guidance, cfg: bool):
    """One Euler step; with CFG the batch of embeds holds [conditional; unconditional]. Compiled once per shape: the
    step's time and sigmas are traced values.

    latents: (batch, image_len, in_channels) float32; embeds: ((2 if cfg else 1) * batch, text_len, num_text_layers,
    text_dim) tapped text states, or what `Krea2Transformer.fuse_text` made of them (the pipeline's: computed once per
    prompt); mask: (same batch, text_len) bool; ids: (text_len + image_len, 3); t, sigma, sigma_next, guidance:
    float32 scalars. Returns the next latents, (batch, image_len, in_channels) float32."""
    x = jnp.concatenate([latents, latents]) if cfg else latents
    velocity = model(x.astype(model.dtype), embeds, jnp.full((x.shape[0],), t, jnp.float32), ids, mask)
    return guided_euler_step(latents, velocity, sigma, sigma_next, guidance, cfg)


denoise_step = stored_jit(_denoise_step, static_argnames=("cfg",))


@stored_jit(static_argnames=("cfg",))
def denoise_loop(model: Krea2Transformer, latents, embeds, mask, ids, times, sigmas, guidance, cfg: bool):
    """All of `denoise_step`'s steps in one program: times (steps,) flow times, sigmas (steps + 1,). The pipeline
    runs this when no callback wants the latents between steps. Compiled once per shape and step count."""

    def body(i, latents):
        return _denoise_step(model, latents, embeds, mask, ids, times[i], sigmas[i], sigmas[i + 1], guidance, cfg)

    return jax.lax.fori_loop(0, times.shape[0], body, latents)


def guided_euler_step(latents, velocity, sigma, sigma_next, guidance, cfg: bool):
    """The Euler step from the transformer's velocity; with CFG the velocity holds [conditional; unconditional]
    and is combined first."""
    if cfg:
        batch = latents.shape[0]
        cond, uncond = velocity[:batch], velocity[batch:]
        velocity = cond + guidance.astype(cond.dtype) * (cond - uncond)
    return euler_step(latents, velocity, sigma, sigma_next)


# --------------------------------------------------------------------------------------------------------------------
# The built-in demo


DEMO_TEXT_LAYERS = (1, 2, 3, 4)


def demo_pipeline(tokenizer_folder: str | Path, seed: int = 0, dtype=jnp.float32, distilled: bool = True) -> Krea2Pipeline:
    """A tiny Krea 2-shaped pipeline with RANDOM weights (and the demo word-level tokenizer, written to
    `tokenizer_folder`): the whole path runs on a CPU in seconds; the pictures are noise-like, not meaningful."""
    tokenizer = TextTokenizer.from_folder(save_demo_tokenizer(tokenizer_folder))
    text_cfg = Qwen3VLTextConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    transformer_cfg = Krea2Config(
        in_channels=64, num_layers=4, attention_head_dim=32, num_attention_heads=8, num_key_value_heads=2,
        intermediate_size=512, timestep_embed_dim=64, text_hidden_dim=64, num_text_layers=len(DEMO_TEXT_LAYERS),
        text_num_attention_heads=4, text_num_key_value_heads=4, text_intermediate_size=128, axes_dims_rope=(8, 12, 12),
    )
    vae_cfg = QwenImageVAEConfig(base_dim=16)
    # The "rbg" generator compiles far faster on the CPU than the default threefry, and weights are drawn eagerly.
    rngs = nnx.Rngs(jax.random.key(seed, impl="rbg"))
    return Krea2Pipeline(
        Krea2Transformer(transformer_cfg, dtype=dtype, rngs=rngs),
        QwenImageVAE(vae_cfg, dtype=dtype, rngs=rngs),
        Qwen3VLTextEncoder(text_cfg, dtype=dtype, rngs=rngs),
        tokenizer,
        Krea2PipelineConfig(text_encoder_select_layers=DEMO_TEXT_LAYERS, is_distilled=distilled),
    )
