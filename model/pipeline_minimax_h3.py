"""MiniMax H3 text-to-video+audio, as diffusers' `minimax_h3` modular pipeline runs a text-only request (t2va): the
canvas and frame count, the packed sequence [text | target audio | target video] with its rotary grid, the two
rectified-flow schedules (video and audio), the denoising loop and the unpacking of the rows into latents.

The checkpoint is guidance-distilled: one transformer forward a step, no unconditional branch. Everything about the
layout is computed on the host in float64 as diffusers does, so positions agree to the last bit; the loop runs on the
device.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .minimax_h3 import AUDIO, TEXT, VIDEO, MiniMaxH3Transformer

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
    """Channel-major audio rows (batch, AUDIO_CHANNELS * latents, channels) -> (batch * AUDIO_CHANNELS, channels,
    latents), the stereo channels as the mono audio VAE's batch items."""
    b, _, c = rows.shape
    return rows.reshape(b * AUDIO_CHANNELS, num_audio_latents, c).transpose(0, 2, 1)


def denoise(transformer: MiniMaxH3Transformer, layout: PackedLayout, prompt_embeds: jax.Array, video_rows: jax.Array,
            audio_rows: jax.Array, num_steps: int, *, callback=None) -> tuple[jax.Array, jax.Array]:
    """The text-to-video loop: each step one transformer forward over the packed sequence, then the video rows
    step down their schedule (shift 12) and the audio rows down theirs (shift 3). The text rows share the video's
    timestep. `video_rows` (batch, video rows, patch channels) and `audio_rows` (batch, audio rows, channels) are
    the noise, packed; returns them denoised. `callback(step, video_rows, audio_rows)` after each step."""
    sigmas, audio_sigmas = flow_schedule(num_steps, VIDEO_SHIFT), flow_schedule(num_steps, AUDIO_SHIFT)
    # Two slots, [video, audio]: one compiled step serves every step (a table of distinct values, as diffusers
    # builds, would change shape whenever the two timesteps meet; a repeated value embeds the same).
    timestep_indices = np.zeros(layout.length, np.int32)
    timestep_indices[layout.audio_indices] = 1
    structure = tuple(jnp.asarray(a) for a in (timestep_indices, layout.token_tags, layout.position_ids.astype(np.float32),
                                               layout.video_indices, layout.audio_indices, layout.text_indices))
    step = _denoising_step()
    for i in range(min(len(sigmas), len(audio_sigmas)) - 1):
        video_rows, audio_rows = step(transformer, prompt_embeds, video_rows, audio_rows, structure,
                                      jnp.asarray(sigmas[i : i + 2]), jnp.asarray(audio_sigmas[i : i + 2]))
        if callback is not None:
            callback(i, video_rows, audio_rows)
    return video_rows, audio_rows


def _denoising_step():
    @nnx.jit
    def step(transformer, prompt_embeds, video_rows, audio_rows, structure, sigma, audio_sigma):
        timestep_indices, tags, positions, video_idx, audio_idx, text_idx = structure
        timestep = jnp.stack([1.0 - sigma[0], 1.0 - audio_sigma[0]])
        velocity, audio_velocity = transformer(video_rows, audio_rows, prompt_embeds, timestep, timestep_indices, tags,
                                               positions, video_idx, audio_idx, text_idx)
        return (flow_step(video_rows, velocity, timestep[0], sigma[0], sigma[1]),
                flow_step(audio_rows, audio_velocity, timestep[1], audio_sigma[0], audio_sigma[1]))

    return step
