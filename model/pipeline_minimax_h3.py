"""MiniMax H3 text-to-video+audio, as diffusers' `minimax_h3` modular pipeline runs a text-only request (t2va): the
canvas and frame count, the packed sequence [text | target audio | target video] with its rotary grid, the two
rectified-flow schedules (video and audio), the denoising loop and the unpacking of the rows into latents.

The checkpoint is guidance-distilled: one transformer forward a step, no unconditional branch. Everything about the
layout is computed on the host in float64 as diffusers does, so positions agree to the last bit; the loop runs on the
device.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mxdit.ops.names import Precision
from mxdit.quant.gates import GateReport, evaluate
from mxdit.quant.model import minimax_h3_rules, quantize_linear_layers, quantize_on_load

from .images import unit_range_to_uint8
from .loading import place_parameters
from .minimax_h3 import AUDIO, TEXT, VIDEO, MiniMaxH3Config, MiniMaxH3Transformer
from .pipeline_common import check_components
from .qwen3vl_text import Qwen3VLTextConfig, Qwen3VLTextEncoder
from .tokenizer import TextTokenizer, save_demo_tokenizer
from .vae_minimax_h3 import MiniMaxH3VAEConfig, MiniMaxH3VideoVAE
from .vae_minimax_h3_audio import MiniMaxH3AudioVAE, MiniMaxH3AudioVAEConfig

FPS = 24  # the model's own frame rate: what it generates and conditions on
MIN_SECONDS, MAX_SECONDS = 5.0, 15.0
FRAMES_PER_CHUNK, LATENTS_PER_CHUNK = 17, 5  # the video VAE: 17 * n + 5 frames -> 5 * n + 2 latent frames
SPATIAL_COMPRESSION = 16
AUDIO_LATENTS_PER_SECOND = 40
AUDIO_CHANNELS = 2  # stereo, packed channel-major; the audio VAE is mono and decodes each channel as a batch item
CANVAS_SHORT_EDGE, CANVAS_MAX_PIXELS = 768, 768 * 1344
MIN_ASPECT, MAX_ASPECT = 1 / 4, 4.0
VIDEO_SHIFT, AUDIO_SHIFT = 12.0, 3.0  # the exponential sigma shift of each modality's schedule
# The rotary clock: latent frames advance by 5/3 * (1, 4, 4, 4, 4) (the first latent frame holds one video frame,
# the others four), and each spatial axis spans [0, 32) over the canvas's aspect-normalized extent.
ROPE_FRAME_RESCALE = 5.0 / 3.0
ROPE_FRAMES_PER_LATENT = (1, 4, 4, 4, 4)
ROPE_SPATIAL_SCALE = 32


def resolve_canvas_size(aspect_width: float, aspect_height: float, multiple: int = SPATIAL_COMPRESSION * 2,
                        short_edge: int = CANVAS_SHORT_EDGE, max_pixels: int = CANVAS_MAX_PIXELS) -> tuple[int, int]:
    """(height, width) of the canvas for an aspect ratio: the short edge at `short_edge`, the area capped at
    `max_pixels`, both rounded to `multiple` (so the area may end slightly above the cap)."""
    if aspect_width <= 0 or aspect_height <= 0:
        raise ValueError(f"aspect ratio {aspect_width}:{aspect_height}: must be positive")
    ratio = aspect_width / aspect_height
    if not MIN_ASPECT <= ratio <= MAX_ASPECT:
        raise ValueError(f"aspect ratio {aspect_width}:{aspect_height} ({ratio:g}): MiniMax H3 takes 1:4 to 4:1")
    width, height = (short_edge * ratio, float(short_edge)) if ratio >= 1.0 else (float(short_edge), short_edge / ratio)
    if width * height > max_pixels:
        scale = (max_pixels / (width * height)) ** 0.5
        width, height = width * scale, height * scale
    return max(multiple, round(height / multiple) * multiple), max(multiple, round(width / multiple) * multiple)


def align_num_frames(num_frames: int) -> int:
    """The next frame count of the form 17 * n + 5 (what the video VAE decodes) at or above `num_frames`."""
    if num_frames < 1:
        raise ValueError(f"num_frames {num_frames}: must be positive")
    return num_frames + (LATENTS_PER_CHUNK - num_frames) % FRAMES_PER_CHUNK


def video_latent_frames(num_frames: int) -> int:
    """Latent frames of an aligned frame count: 17 * n + 5 frames -> 5 * n + 2."""
    if num_frames % FRAMES_PER_CHUNK != LATENTS_PER_CHUNK:
        raise ValueError(f"num_frames {num_frames}: must be of the form 17 * n + 5")
    return (num_frames - LATENTS_PER_CHUNK) // FRAMES_PER_CHUNK * LATENTS_PER_CHUNK + 2


def audio_latent_frames(num_frames: int) -> int:
    """Audio latents (per channel) covering `num_frames` video frames."""
    return int(round(num_frames / FPS * AUDIO_LATENTS_PER_SECOND))


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """Where every row of the packed sequence sits and what it is (host arrays, the transformer's structural
    arguments), and the latent shapes it was built for."""

    position_ids: np.ndarray  # (seq, 3) float64: (t, h, w) rotary coordinates
    token_tags: np.ndarray  # (seq,) VIDEO / TEXT / AUDIO
    video_indices: np.ndarray
    audio_indices: np.ndarray
    text_indices: np.ndarray
    num_latent_frames: int
    latent_height: int
    latent_width: int
    num_audio_latents: int

    @property
    def length(self) -> int:
        return self.position_ids.shape[0]


def _spatial_grid(size: int, patch: int, sqrt_area: float) -> np.ndarray:
    """One aspect-normalized spatial axis: `size // patch` coordinates centred on the unit interval (right end
    excluded), times 32."""
    ratio = size / sqrt_area
    left = (1.0 - ratio) / 2.0
    return np.linspace(left, left + ratio, size // patch, endpoint=False) * ROPE_SPATIAL_SCALE


def _temporal_grid(num_latent_frames: int, origin: float) -> np.ndarray:
    spans = np.array([ROPE_FRAME_RESCALE * ROPE_FRAMES_PER_LATENT[i % len(ROPE_FRAMES_PER_LATENT)]
                      for i in range(num_latent_frames)], np.float64)
    return origin + np.concatenate([[0.0], np.cumsum(spans[:-1])])


def packed_layout(text_len: int, num_latent_frames: int, latent_height: int, latent_width: int,
                  num_audio_latents: int, patch_size: tuple[int, int, int] = (1, 2, 2)) -> PackedLayout:
    """The text-to-video layout [text | target audio | target video]: text rows at rotary times 0, 1, ...; audio
    rows channel-major, from time `text_len` on, each channel pinned to one end of the width axis; video rows frame
    by frame, row-major within a frame."""
    _, patch_h, patch_w = patch_size
    rows_per_frame = (latent_height // patch_h) * (latent_width // patch_w)
    audio_rows = num_audio_latents * AUDIO_CHANNELS
    audio_start = text_len
    video_start = audio_start + audio_rows
    seq = video_start + num_latent_frames * rows_per_frame
    positions = np.zeros((seq, 3), np.float64)
    positions[:text_len, 0] = np.arange(text_len)
    sqrt_area = np.sqrt(latent_height * latent_width)
    height_grid = _spatial_grid(latent_height, patch_h, sqrt_area)
    width_grid = _spatial_grid(latent_width, patch_w, sqrt_area)
    positions[audio_start:video_start, 0] = np.tile(text_len + np.arange(num_audio_latents, dtype=np.float64),
                                                    AUDIO_CHANNELS)
    positions[audio_start:video_start, 2] = np.repeat([width_grid[0], width_grid[-1]], num_audio_latents)
    hh, ww = np.meshgrid(height_grid, width_grid, indexing="ij")
    video = np.empty((num_latent_frames, rows_per_frame, 3), np.float64)
    video[:, :, 0] = _temporal_grid(num_latent_frames, float(text_len))[:, None]
    video[:, :, 1], video[:, :, 2] = hh.reshape(-1), ww.reshape(-1)
    positions[video_start:] = video.reshape(-1, 3)
    tags = np.full(seq, VIDEO, np.int32)
    tags[:text_len], tags[audio_start:video_start] = TEXT, AUDIO
    return PackedLayout(positions, tags, np.arange(video_start, seq), np.arange(audio_start, video_start),
                        np.arange(text_len), num_latent_frames, latent_height, latent_width, num_audio_latents)


def flow_schedule(num_steps: int, shift: float) -> np.ndarray:
    """The sigmas of diffusers' `MiniMaxH3Scheduler`: linspace(1, 0, num_steps) through the exponential shift
    s * sigma / (1 + (s - 1) * sigma), repeats collapsed; float32, ending in 0. num_steps sigmas drive
    num_steps - 1 model evaluations, each at t = 1 - sigma (t = 1 is clean)."""
    if num_steps < 2:
        raise ValueError(f"num_steps {num_steps}: must be at least 2 (the sigmas include the final 0)")
    base = _torch_linspace(1.0, 0.0, num_steps)
    sigmas = (np.float32(shift) * base / (1 + (np.float32(shift) - 1) * base)).astype(np.float32)
    return sigmas[np.concatenate([[True], sigmas[1:] != sigmas[:-1]])]


def _torch_linspace(start: float, end: float, steps: int) -> np.ndarray:
    """`torch.linspace` in float32, to the bit: the first half counted up from `start`, the rest down from `end`
    (numpy's float64 grid rounds differently in the last place)."""
    step = np.float32((end - start) / (steps - 1))
    i = np.arange(steps)
    up = np.float32(start) + step * i.astype(np.float32)
    down = np.float32(end) - step * (steps - 1 - i).astype(np.float32)
    return np.where(i < steps // 2, up, down).astype(np.float32)


def flow_step(sample: jax.Array, velocity: jax.Array, t: jax.Array, sigma: jax.Array,
              sigma_next: jax.Array) -> jax.Array:
    """One Euler step of the data-ward velocity at t = 1 - sigma: x0 = x + (1 - t) * v, then
    x_next = r * x + (1 - r) * x0 with r = sigma_next / sigma, in float32 (diffusers' `MiniMaxH3Scheduler.step`,
    which takes 1 - t, not sigma, for the first part)."""
    sample32 = sample.astype(jnp.float32)
    denoised = sample32 + (1.0 - t) * velocity.astype(jnp.float32)
    ratio = sigma_next / sigma
    return (ratio * sample32 + (1.0 - ratio) * denoised).astype(sample.dtype)


def patchify(latents: jax.Array, patch_size: tuple[int, int, int]) -> jax.Array:
    """(batch, channels, frames, height, width) -> (batch, rows, channels * prod(patch)), rows frame-major then
    row-major, each row's channels ordered (channel, pt, ph, pw)."""
    b, c, f, h, w = latents.shape
    pt, ph, pw = patch_size
    x = latents.reshape(b, c, f // pt, pt, h // ph, ph, w // pw, pw)
    return x.transpose(0, 2, 4, 6, 1, 3, 5, 7).reshape(b, -1, c * pt * ph * pw)


def unpatchify(rows: jax.Array, frames: int, height: int, width: int, patch_size: tuple[int, int, int]) -> jax.Array:
    """The inverse of `patchify`: (batch, rows, channels * prod(patch)) -> (batch, channels, frames, height, width)."""
    pt, ph, pw = patch_size
    b = rows.shape[0]
    c = rows.shape[-1] // (pt * ph * pw)
    x = rows.reshape(b, frames // pt, height // ph, width // pw, c, pt, ph, pw)
    return x.transpose(0, 4, 1, 5, 2, 6, 3, 7).reshape(b, c, frames, height, width)


def audio_rows_to_latents(rows: jax.Array, num_audio_latents: int) -> jax.Array:
    """Channel-major audio rows (batch, AUDIO_CHANNELS * latents, channels) -> (batch * AUDIO_CHANNELS, latents,
    channels), the stereo channels as the mono audio VAE's batch items (diffusers' layout is this with the last two
    axes swapped)."""
    b, _, c = rows.shape
    return rows.reshape(b * AUDIO_CHANNELS, num_audio_latents, c)


def denoise(transformer: MiniMaxH3Transformer, layout: PackedLayout, prompt_embeds: jax.Array, video_rows: jax.Array,
            audio_rows: jax.Array, num_steps: int, *, callback=None, step=None) -> tuple[jax.Array, jax.Array]:
    """The text-to-video loop: each step one transformer forward over the packed sequence, then the video rows
    step down their schedule (shift 12) and the audio rows down theirs (shift 3). The text rows share the video's
    timestep. `video_rows` (batch, video rows, patch channels) and `audio_rows` (batch, audio rows, channels) are
    the noise, packed; returns them denoised. `callback(step, video_rows, audio_rows)` after each step. `step`:
    `denoise_step` without its transformer (a streamed or sharded one's); default the jitted step of `transformer`."""
    structure = layout_arrays(layout)
    step = step or functools.partial(_step, transformer)
    for i, (sigma, audio_sigma) in enumerate(_schedules(num_steps)):
        video_rows, audio_rows = step(prompt_embeds, video_rows, audio_rows, structure, sigma, audio_sigma)
        if callback is not None:
            callback(i, video_rows, audio_rows)
    return video_rows, audio_rows


@dataclasses.dataclass(frozen=True)
class TrajectoryCheck:
    """A quantized transformer against its reference along the reference's denoising (`trajectory_check`)."""

    fmt: str
    steps: list[tuple[GateReport, GateReport]]  # (video, audio) velocity at each denoiser evaluation
    final: tuple[GateReport, GateReport]  # (video, audio) rows at the end of the candidate's own trajectory

    @property
    def passed(self) -> bool:
        return all(r.passed for pair in (*self.steps, self.final) for r in pair)


def trajectory_check(reference: MiniMaxH3Transformer, candidate: MiniMaxH3Transformer, fmt: str,
                     layout: PackedLayout, prompt_embeds: jax.Array, video_rows: jax.Array, audio_rows: jax.Array,
                     num_steps: int) -> TrajectoryCheck:
    """The admission gates of `quant.gates` for `fmt`, per denoiser evaluation and for the trajectory: at each step
    both transformers see the reference's state, and each velocity (video rows, audio rows) is gated against the
    reference's (cosine, relative L2, non-finite values); then the candidate denoises on its own from the same noise,
    and its final rows are gated against the reference's (an unchanged trajectory)."""
    structure, steps = layout_arrays(layout), []
    reference_video, reference_audio = video_rows, audio_rows
    for sigma, audio_sigma in _schedules(num_steps):
        timestep = _timesteps(sigma, audio_sigma)
        want = _velocity(reference, prompt_embeds, reference_video, reference_audio, structure, timestep)
        got = _velocity(candidate, prompt_embeds, reference_video, reference_audio, structure, timestep)
        steps.append(tuple(evaluate(fmt, np.asarray(g), np.asarray(w)) for g, w in zip(got, want)))
        reference_video, reference_audio = _step(reference, prompt_embeds, reference_video, reference_audio,
                                                 structure, sigma, audio_sigma)
    video, audio = denoise(candidate, layout, prompt_embeds, video_rows, audio_rows, num_steps)
    final = (evaluate(fmt, np.asarray(video), np.asarray(reference_video)),
             evaluate(fmt, np.asarray(audio), np.asarray(reference_audio)))
    return TrajectoryCheck(fmt, steps, final)


def _schedules(num_steps: int) -> list[tuple[jax.Array, jax.Array]]:
    """Each step's (sigma, next sigma) of the video and the audio schedule."""
    sigmas, audio_sigmas = flow_schedule(num_steps, VIDEO_SHIFT), flow_schedule(num_steps, AUDIO_SHIFT)
    return [(jnp.asarray(sigmas[i : i + 2]), jnp.asarray(audio_sigmas[i : i + 2]))
            for i in range(min(len(sigmas), len(audio_sigmas)) - 1)]


def timestep_slots(layout: PackedLayout) -> np.ndarray:
    """Each row's index into the timestep table [video, audio] (seq,) int32: the text rows share the video's. Two
    slots always, so that one compiled step serves every step: a table of the distinct values, as diffusers builds
    it, would change shape whenever the two timesteps meet, and a repeated value embeds the same."""
    slots = np.zeros(layout.length, np.int32)
    slots[layout.audio_indices] = 1
    return slots


def layout_arrays(layout: PackedLayout) -> tuple[jax.Array, ...]:
    """The transformer's structural arguments after `timestep`, for `layout`, on the device: timestep slots, token
    tags, positions (float32) and the video, audio and text indices."""
    return tuple(jnp.asarray(a) for a in (timestep_slots(layout), layout.token_tags,
                                          layout.position_ids.astype(np.float32), layout.video_indices,
                                          layout.audio_indices, layout.text_indices))


def pad_structure(structure: tuple[jax.Array, ...], padding: int) -> tuple[jax.Array, ...]:
    """`layout_arrays`' structure with `padding` rows after the packed ones (slot 0, tag 0, position 0), which no
    index names: the transformer's `padding` rows."""
    slots, tags, positions, *indices = structure
    return (jnp.pad(slots, (0, padding)), jnp.pad(tags, (0, padding)), jnp.pad(positions, ((0, padding), (0, 0))),
            *indices)


def _timesteps(sigma: jax.Array, audio_sigma: jax.Array) -> jax.Array:
    return jnp.stack([1.0 - sigma[0], 1.0 - audio_sigma[0]])


def velocity(transformer, prompt_embeds, video_rows, audio_rows, structure, timestep, padding: int = 0):
    """The transformer's (video, audio) velocity on the layout's structural arrays (`layout_arrays`). `padding`:
    the rows the structure holds after the packed ones (the transformer's argument)."""
    timestep_indices, tags, positions, video_idx, audio_idx, text_idx = structure
    extra = {"padding": padding} if padding else {}  # a streamed transformer takes no padding
    return transformer(video_rows, audio_rows, prompt_embeds, timestep, timestep_indices, tags, positions, video_idx,
                       audio_idx, text_idx, **extra)


def flow_steps(video_rows, audio_rows, video_velocity, audio_velocity, timestep, sigma, audio_sigma):
    """Each modality's rows one step down its schedule."""
    return (flow_step(video_rows, video_velocity, timestep[0], sigma[0], sigma[1]),
            flow_step(audio_rows, audio_velocity, timestep[1], audio_sigma[0], audio_sigma[1]))


def denoise_step(transformer, prompt_embeds, video_rows, audio_rows, structure, sigma, audio_sigma, *,
                 flow=flow_steps, padding: int = 0):
    """One denoising step: the velocity at (sigma[0], audio_sigma[0]), then each modality's flow step (`flow`).
    Jitted whole for a module (`_step`); a streamed transformer runs it as it stands, its programs and `flow`
    jitted apart. `padding`: as `velocity`'s."""
    timestep = _timesteps(sigma, audio_sigma)
    video_velocity, audio_velocity = velocity(transformer, prompt_embeds, video_rows, audio_rows, structure, timestep,
                                              padding)
    return flow(video_rows, audio_rows, video_velocity, audio_velocity, timestep, sigma, audio_sigma)


_velocity = nnx.jit(velocity)
_step = nnx.jit(denoise_step)


# --------------------------------------------------------------------------------------------------------------------
# The pipeline

COMPONENTS = ("transformer", "vae", "audio_vae", "text_encoder", "tokenizer")
# --precision: the weight format of the blocks' attention and SwiGLU matrices (`quant.model.minimax_h3_rules`),
# multiplied by the GEMM kernels; int8_rot is the rotated INT8 of the seed compiler's ConvRot cache
PRECISIONS = {p.value: p.weight_format for p in Precision} | {"int8_rot": "int8_rot"}
TEXT_ENCODER_LAYER = 50  # the Qwen3-VL hidden state H3 conditions on: after decoder layer 50, before the final norm
DEFAULT_FRAMES = 124  # 17 * 7 + 5: the shortest video (5 s at 24 fps) the VAE decodes
DEFAULT_STEPS = 50


@dataclasses.dataclass
class VideoOutput:
    frames: np.ndarray  # (frames, height, width, 3) uint8
    audio: np.ndarray  # (AUDIO_CHANNELS, samples) float32 in [-1, 1]
    fps: int
    sample_rate: int
    latents: np.ndarray  # (latent_frames, height / 16, width / 16, channels), normalised as the transformer sees them
    audio_latents: np.ndarray  # (AUDIO_CHANNELS, audio latents, channels), normalised
    timings: dict[str, float]  # seconds per stage


class MiniMaxH3Pipeline:
    """A prompt to a video with sound: the Qwen3-VL conditioner, the MiniMax H3 transformer, the video and audio
    VAEs. One request is one packed sequence (no batch of prompts); the checkpoint is guidance-distilled."""

    def __init__(self, transformer: MiniMaxH3Transformer, vae: MiniMaxH3VideoVAE, audio_vae: MiniMaxH3AudioVAE,
                 text_encoder: Qwen3VLTextEncoder, tokenizer: TextTokenizer,
                 text_encoder_layer: int = TEXT_ENCODER_LAYER):
        vae_cfg, audio_cfg, cfg = vae.config, audio_vae.config, transformer.config
        geometry = {"video VAE spatial compression": (vae_cfg.spatial_compression, SPATIAL_COMPRESSION),
                    "video VAE clip_length": (vae_cfg.clip_length, FRAMES_PER_CHUNK),
                    "video VAE latent frames a clip": (vae_cfg.tokens_chunk_size, LATENTS_PER_CHUNK),
                    "audio VAE latents a second": (audio_cfg.sampling_rate / audio_cfg.hop_length,
                                                   AUDIO_LATENTS_PER_SECOND),
                    "video latent channels": (vae_cfg.latent_channels, cfg.in_channels),
                    "audio latent channels": (audio_cfg.latent_channels, cfg.audio_in_channels),
                    "text width": (text_encoder.config.hidden_size, cfg.text_dim)}
        wrong = [f"{name} {got} (the transformer or the layout expects {want})"
                 for name, (got, want) in geometry.items() if got != want]
        if wrong:
            raise ValueError("the components do not fit together: " + "; ".join(wrong))
        if not 0 < text_encoder_layer < text_encoder.config.num_hidden_layers:
            raise ValueError(f"text_encoder_layer {text_encoder_layer}: H3 reads a hidden state before the final "
                             f"norm, so the text encoder needs more than {text_encoder_layer} layers "
                             f"(it has {text_encoder.config.num_hidden_layers})")
        self.transformer, self.vae, self.audio_vae = transformer, vae, audio_vae
        self.text_encoder, self.tokenizer, self.text_encoder_layer = text_encoder, tokenizer, text_encoder_layer
        # `denoise_step` without its transformer, where another one runs the loop (model/offload.py, sharding/)
        self.denoise_step_fn: Callable | None = None

    @classmethod
    def from_pretrained(cls, folder: str | Path, dtype: jnp.dtype = jnp.bfloat16, precision: str = "bf16", *,
                        offload: int | None = None, prefetch: int = 2) -> "MiniMaxH3Pipeline":
        """Load a diffusers-layout MiniMax H3 folder (transformer/, vae/, audio_vae/, text_encoder/, tokenizer/).
        The VAEs stay float32, as the release keeps them. `precision` (a key of PRECISIONS): the transformer's block
        matrices quantized as they are read, so that the device never holds them in bf16. `offload`: keep the first
        `offload` transformer blocks on the device and stream the others from host memory, where they are read to
        (`model.offload`; `prefetch` blocks ahead); None: all on the device."""
        folder = check_components(folder, COMPONENTS, "MiniMax H3")
        fmt = _weight_format(precision)
        places = [quantize_on_load(minimax_h3_rules(fmt))] if fmt else []
        if offload is not None:
            from .offload import streamed_block_placement

            places.append(streamed_block_placement(_check_offload(offload, prefetch)))
        with place_parameters(*places):
            transformer = MiniMaxH3Transformer.from_pretrained(folder / "transformer", dtype)
        pipe = cls(transformer,
                   MiniMaxH3VideoVAE.from_pretrained(folder / "vae"),
                   MiniMaxH3AudioVAE.from_pretrained(folder / "audio_vae"),
                   Qwen3VLTextEncoder.from_pretrained(folder / "text_encoder", dtype),
                   TextTokenizer.from_folder(folder / "tokenizer"))
        return pipe if offload is None else pipe.offloaded(offload, prefetch)

    def offloaded(self, resident: int, prefetch: int = 2) -> "MiniMaxH3Pipeline":
        """A copy whose denoising streams the transformer blocks after the first `resident` from host memory,
        `prefetch` blocks ahead (`model.offload.offload_pipeline`); this pipeline's transformer is taken apart."""
        from .offload import offload_pipeline

        return offload_pipeline(self, resident=_check_offload(resident, prefetch), prefetch=prefetch)

    def encode_prompt(self, prompt: str) -> jax.Array:
        """The prompt verbatim (no chat template, no special tokens) through the conditioner: (1, tokens, text_dim),
        the hidden state after layer `text_encoder_layer`."""
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"prompt: a non-empty string, got {prompt!r}")
        ids, _ = self.tokenizer([prompt])
        return conditioning(self.text_encoder, ids, self.text_encoder_layer)

    def __call__(self, prompt: str, *, num_frames: int = DEFAULT_FRAMES, height: int | None = None,
                 width: int | None = None, num_steps: int = DEFAULT_STEPS, seed: int = 0,
                 callback: Callable[[int, int], None] | None = None) -> VideoOutput:
        """Generate `num_frames` frames (rounded up to 17 * n + 5, 5 to 15 seconds at 24 fps) of `height` x `width`
        pixels (multiples of 32; default the 16:9 canvas) with their stereo soundtrack. `callback(step, evaluations)`
        after each denoising step (num_steps - 1 evaluations: the last sigma is 0)."""
        timings, start = {}, time.perf_counter()
        multiple = SPATIAL_COMPRESSION * self.transformer.config.patch_size[2]
        if (height is None) != (width is None):
            raise ValueError("height and width: give both or neither")
        if height is None:
            height, width = resolve_canvas_size(16, 9, multiple)
        if height % multiple or width % multiple or height <= 0 or width <= 0:
            raise ValueError(f"height and width {height}x{width}: must be positive multiples of {multiple}")
        frames = align_num_frames(num_frames)
        if not MIN_SECONDS <= frames / FPS <= MAX_SECONDS:
            raise ValueError(f"num_frames {num_frames} (as 17 * n + 5: {frames}): MiniMax H3 makes "
                             f"{MIN_SECONDS:g} to {MAX_SECONDS:g} s at {FPS} fps, {int(MIN_SECONDS * FPS)} to "
                             f"{int(MAX_SECONDS * FPS)} frames")
        embeds = self.encode_prompt(prompt)
        timings["text"] = _since(start, embeds)

        cfg = self.transformer.config
        layout = packed_layout(embeds.shape[1], video_latent_frames(frames), height // SPATIAL_COMPRESSION,
                               width // SPATIAL_COMPRESSION, audio_latent_frames(frames), cfg.patch_size)
        video_key, audio_key = jax.random.split(jax.random.key(seed))
        noise = jax.random.normal(video_key, (1, cfg.in_channels, layout.num_latent_frames, layout.latent_height,
                                              layout.latent_width), jnp.float32)
        audio_noise = jax.random.normal(audio_key, (1, AUDIO_CHANNELS * layout.num_audio_latents,
                                                    cfg.audio_in_channels), jnp.float32)
        stage = time.perf_counter()
        evaluations = len(_schedules(num_steps))  # num_steps - 1, fewer where the shift repeats a sigma
        report = None if callback is None else (lambda i, v, a: callback(i, evaluations))
        video_rows, audio_rows = denoise(self.transformer, layout, embeds, patchify(noise, cfg.patch_size),
                                         audio_noise, num_steps, callback=report, step=self.denoise_step_fn)
        timings["denoise"] = _since(stage, video_rows)

        stage = time.perf_counter()
        latents = unpatchify(video_rows, layout.num_latent_frames, layout.latent_height, layout.latent_width,
                             cfg.patch_size).transpose(0, 2, 3, 4, 1)  # channels last
        video = self.vae.decode(self.vae.denormalize_latents(latents))
        audio_latents = audio_rows_to_latents(audio_rows, layout.num_audio_latents)
        audio = self.audio_vae.decode(self.audio_vae.denormalize_latents(audio_latents))
        timings["decode"] = _since(stage, (video, audio))
        timings["total"] = time.perf_counter() - start
        return VideoOutput(unit_range_to_uint8(np.asarray(video[0])), np.asarray(audio, np.float32), FPS,
                           self.audio_vae.config.sampling_rate, np.asarray(latents[0]), np.asarray(audio_latents),
                           timings)


def conditioning(text_encoder: Qwen3VLTextEncoder, ids: np.ndarray, layer: int) -> jax.Array:
    """The conditioner's hidden state after decoder layer `layer` for token ids (1, tokens): (1, tokens, hidden), as
    diffusers' `get_qwen3vl_prompt_embeds` reads it for a text-only presentation (every token real; the three rotary
    axes of a text token agree, so its positions are 0, 1, ...)."""
    positions = np.arange(ids.shape[1], dtype=np.int32)[None]
    states = text_encoder(jnp.asarray(ids), jnp.ones(ids.shape, bool), jnp.asarray(positions), (layer,))
    return states[:, :, 0]


def _check_offload(resident: int, prefetch: int) -> int:
    if resident < 0:
        raise ValueError(f"offload {resident}: the number of resident blocks must be >= 0")
    if prefetch < 1:
        raise ValueError(f"prefetch {prefetch}: must be >= 1")
    return resident


def _weight_format(precision: str) -> str | None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: one of {', '.join(PRECISIONS)}")
    return PRECISIONS[precision]


def _since(start: float, result) -> float:
    jax.block_until_ready(result)
    return time.perf_counter() - start


def demo_pipeline(tokenizer_folder: str | Path, seed: int = 0, precision: str = "bf16") -> MiniMaxH3Pipeline:
    """A tiny MiniMax H3-shaped pipeline with RANDOM weights, float32 (and the demo word-level tokenizer, written to
    `tokenizer_folder`): the release's geometry (16x spatial, 17-frame clips, 40 audio latents a second) at a few
    channels, so that the whole path runs on a CPU; the video and sound are noise, not meaningful. `precision`: as
    `MiniMaxH3Pipeline.from_pretrained`'s."""
    fmt = _weight_format(precision)
    tokenizer = TextTokenizer.from_folder(save_demo_tokenizer(tokenizer_folder))
    text_cfg = Qwen3VLTextConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    transformer_cfg = MiniMaxH3Config(
        num_attention_heads=2, attention_head_dim=16, hidden_size=32, num_layers=2, num_refiner_layers=1,
        ffn_dim=64, in_channels=8, audio_in_channels=8, text_dim=32, freq_dim=32, time_embed_hidden_dim=32,
        time_embed_dim=16, rope_freq_dim=2)
    vae_cfg = MiniMaxH3VAEConfig(latent_channels=8, block_out_channels=(8,) * 6, layers_per_block=1,
                                 norm_num_groups=4, decoder_num_layers=1, decoder_num_attention_heads=2,
                                 decoder_attention_head_dim=16, decoder_num_register_tokens=1, decoder_ffn_mult=2,
                                 latents_mean=(0.0,) * 8, latents_std=(1.0,) * 8)
    audio_cfg = MiniMaxH3AudioVAEConfig(encoder_dim=4, latent_dim=16, latent_channels=8, num_attention_heads=2,
                                        decoder_dim=128, resblock_kernel_sizes=(3,),
                                        resblock_dilation_sizes=((1,),), latents_mean=(0.0,) * 8,
                                        latents_std=(1.0,) * 8)
    rngs = nnx.Rngs(jax.random.key(seed, impl="rbg"))  # compiles far faster on a CPU than threefry
    transformer = MiniMaxH3Transformer(transformer_cfg, dtype=jnp.float32, rngs=rngs)
    if fmt:
        quantize_linear_layers(transformer, minimax_h3_rules(fmt), kernels=True)
    return MiniMaxH3Pipeline(transformer,
                             MiniMaxH3VideoVAE(vae_cfg, rngs=rngs), MiniMaxH3AudioVAE(audio_cfg, rngs=rngs),
                             Qwen3VLTextEncoder(text_cfg, dtype=jnp.float32, rngs=rngs), tokenizer,
                             text_encoder_layer=2)
