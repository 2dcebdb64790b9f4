"""Video files out of the video pipelines: uint8 frames and a float waveform into one MP4 (H.264 video, AAC audio),
through PyAV (FFmpeg's libraries), written atomically. An optional dependency: `pip install mxdit[video]`."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np

from .loading import write_atomically


def write_mp4(path: str | Path, frames: np.ndarray, fps: int, audio: np.ndarray | None = None,
              sample_rate: int | None = None, *, crf: int = 18) -> None:
    """Write `frames` (frames, height, width, 3) uint8 at `fps`, with `audio` (channels, samples) float in [-1, 1]
    at `sample_rate` if given, to `path` as an MP4. The file appears whole or not at all. `crf`: H.264's constant
    rate factor (18: visually lossless)."""
    try:
        import av
    except ImportError:
        raise ImportError("writing MP4 files needs PyAV: pip install 'mxdit[video]'") from None
    frames = np.asarray(frames)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames: expected uint8 (frames, height, width, 3), got {frames.dtype} {frames.shape}")
    if frames.shape[1] % 2 or frames.shape[2] % 2:
        raise ValueError(f"frames: H.264 in 4:2:0 needs an even height and width, got "
                         f"{frames.shape[2]}x{frames.shape[1]}")
    if audio is not None:
        audio = np.asarray(audio, np.float32)
        if audio.ndim != 2 or audio.shape[0] not in (1, 2) or not sample_rate:
            raise ValueError(f"audio: expected (1 or 2 channels, samples) with a sample_rate, got {audio.shape}, "
                             f"sample_rate {sample_rate}")

    def write(tmp: Path) -> None:
        with av.open(str(tmp), "w", format="mp4") as container:
            video = container.add_stream("libx264", rate=Fraction(fps))
            video.width, video.height, video.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
            video.options = {"crf": str(crf)}
            sound = None
            if audio is not None:
                sound = container.add_stream("aac", rate=sample_rate)
                sound.layout = "stereo" if audio.shape[0] == 2 else "mono"
            for frame in frames:
                container.mux(video.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
            container.mux(video.encode())
            if sound is not None:
                # planar float samples, one frame of 1024 (AAC's frame size) at a time
                samples = np.clip(audio, -1.0, 1.0)
                for start in range(0, samples.shape[1], 1024):
                    chunk = np.ascontiguousarray(samples[:, start : start + 1024])
                    frame = av.AudioFrame.from_ndarray(chunk, format="fltp", layout=sound.layout.name)
                    frame.sample_rate, frame.pts = sample_rate, start
                    container.mux(sound.encode(frame))
                container.mux(sound.encode())

    write_atomically(path, write)
