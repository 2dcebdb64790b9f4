"""Numerical gates that admit a quantized configuration: tensor agreement (cosine, relative L2, max abs error,
non-finite count) and decoded-image agreement (SSIM, PSNR), with thresholds per format.

The thresholds are starting points, set so that each format's expected quality (relative SSIM 99.2% fp8, 98.3% mxfp6,
89.2% mxfp4) passes and a broken configuration does not; calibrate them on trained weights.
"""

from __future__ import annotations

import dataclasses

import numpy as np


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def relative_l2(actual, reference) -> float:
    actual, reference = np.asarray(actual, np.float64), np.asarray(reference, np.float64)
    return float(np.linalg.norm(actual - reference) / np.linalg.norm(reference))


def max_abs_error(actual, reference) -> float:
    return float(np.max(np.abs(np.asarray(actual, np.float64) - np.asarray(reference, np.float64))))


def nonfinite_count(x) -> int:
    return int(np.size(x) - np.count_nonzero(np.isfinite(np.asarray(x, np.float64))))


def psnr(image, reference, data_range: float = 255.0) -> float:
    """Peak signal-to-noise ratio in dB of two images, or batches of them, of one shape: of the mean squared error
    over all their pixels (inf when equal)."""
    mse = np.mean((np.asarray(image, np.float64) - np.asarray(reference, np.float64)) ** 2)
    return float("inf") if mse == 0 else float(10 * np.log10(data_range**2 / mse))


def _gaussian_filter(x: np.ndarray, sigma: float = 1.5, radius: int = 5) -> np.ndarray:
    """Separable Gaussian blur of the last two axes (h, w) of `x` over their valid region (window 2 * radius + 1)."""
    t = np.arange(-radius, radius + 1)
    k = np.exp(-(t**2) / (2 * sigma**2))
    k /= k.sum()
    windows = np.lib.stride_tricks.sliding_window_view
    x = windows(x, k.size, axis=-1) @ k  # (the kernel is symmetric: correlation is convolution)
    return windows(x, k.size, axis=-2) @ k


def ssim(image, reference, data_range: float = 255.0) -> float:
    """Structural similarity (Wang et al. 2004): 11x11 Gaussian window, sigma 1.5, K1 0.01, K2 0.03, averaged over
    the valid region and the channels of (h, w) or (h, w, c) images; of a batch (n, h, w, c), the mean of its
    images' SSIMs (a window never spans two images)."""
    a, b = np.asarray(image), np.asarray(reference)
    if a.shape != b.shape:
        raise ValueError(f"images differ in shape: {a.shape} vs {b.shape}")
    if a.ndim == 4:
        return float(np.mean([ssim(x, y, data_range) for x, y in zip(a, b)]))  # an image at a time: float64 copies
    if a.ndim not in (2, 3):
        raise ValueError(f"images of shape {a.shape}: expected (h, w), (h, w, c) or a batch (n, h, w, c)")
    a, b = a.astype(np.float64), b.astype(np.float64)
    if a.ndim == 2:
        a, b = a[..., None], b[..., None]
    x, y = np.moveaxis(a, -1, 0), np.moveaxis(b, -1, 0)  # (c, h, w): the channels filtered together
    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    mx, my = _gaussian_filter(x), _gaussian_filter(y)
    vx = _gaussian_filter(x * x) - mx * mx
    vy = _gaussian_filter(y * y) - my * my
    cxy = _gaussian_filter(x * y) - mx * my
    s = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx * mx + my * my + c1) * (vx + vy + c2))
    return float(s.mean())  # each channel's valid region has the same size: the mean of the channels' means


@dataclasses.dataclass(frozen=True)
class Gate:
    """Bounds a configuration must meet against the bf16 reference."""

    min_cosine: float
    max_relative_l2: float
    max_nonfinite: int = 0
    min_relative_ssim: float | None = None  # SSIM(candidate image, bf16 image): applies when images are given


GATES = {
    "bf16": Gate(0.9999, 0.01, min_relative_ssim=0.99),
    "fp8_e4m3": Gate(0.999, 0.05, min_relative_ssim=0.97),
    "fp8_e5m2": Gate(0.995, 0.1, min_relative_ssim=0.95),
    "mxfp8_e4m3": Gate(0.999, 0.05, min_relative_ssim=0.97),
    "mxfp8_e5m2": Gate(0.995, 0.1, min_relative_ssim=0.95),
    "mxfp6_e2m3": Gate(0.995, 0.1, min_relative_ssim=0.95),
    "mxfp6_e3m2": Gate(0.99, 0.15, min_relative_ssim=0.93),
    "mxfp4_e2m1": Gate(0.97, 0.25, min_relative_ssim=0.85),
    "nvfp4": Gate(0.97, 0.25, min_relative_ssim=0.85),
    "int8": Gate(0.999, 0.05, min_relative_ssim=0.97),
    "int8_rot": Gate(0.999, 0.05, min_relative_ssim=0.97),
    "int8_b32": Gate(0.999, 0.05, min_relative_ssim=0.97),  # 32-blocks: no coarser than int8's rows
}


class GateFailure(ValueError):
    """A configuration failed its gate; the message holds the figures."""


@dataclasses.dataclass(frozen=True)
class GateReport:
    fmt: str
    cosine: float
    relative_l2: float
    max_abs_error: float
    nonfinite: int
    ssim: float | None
    psnr: float | None
    failures: tuple[str, ...]

    @property
    def passed(self) -> bool:
        return not self.failures


def evaluate(fmt: str, output, reference, image=None, reference_image=None) -> GateReport:
    """Measure `output` (e.g. the DiT's velocity) and optionally a decoded uint8 image against the bf16 references."""
    gate = GATES[fmt]
    report = dict(cosine=cosine(output, reference), relative_l2=relative_l2(output, reference),
                  max_abs_error=max_abs_error(output, reference), nonfinite=nonfinite_count(output),
                  ssim=None, psnr=None)
    if image is not None:
        report["ssim"], report["psnr"] = ssim(image, reference_image), psnr(image, reference_image)
    failures = []
    if report["nonfinite"] > gate.max_nonfinite:
        failures.append(f"{report['nonfinite']} non-finite values (allowed {gate.max_nonfinite})")
    if not report["cosine"] >= gate.min_cosine:
        failures.append(f"cosine {report['cosine']:.6f} < {gate.min_cosine}")
    if not report["relative_l2"] <= gate.max_relative_l2:
        failures.append(f"relative L2 {report['relative_l2']:.4g} > {gate.max_relative_l2}")
    if report["ssim"] is not None and gate.min_relative_ssim is not None and not report["ssim"] >= gate.min_relative_ssim:
        failures.append(f"SSIM vs bf16 {report['ssim']:.4f} < {gate.min_relative_ssim}")
    return GateReport(fmt=fmt, failures=tuple(failures), **report)


def admit(fmt: str, output, reference, image=None, reference_image=None) -> GateReport:
    """`evaluate`, raising GateFailure with every figure when the configuration fails its gate."""
    report = evaluate(fmt, output, reference, image, reference_image)
    if not report.passed:
        figures = (f"cosine {report.cosine:.6f}, relative L2 {report.relative_l2:.4g}, max abs {report.max_abs_error:.4g}"
                   f", non-finite {report.nonfinite}" + (f", SSIM {report.ssim:.4f}, PSNR {report.psnr:.2f} dB"
                                                         if report.ssim is not None else ""))
        raise GateFailure(f"{fmt} refused: {'; '.join(report.failures)} ({figures})")
    return report
