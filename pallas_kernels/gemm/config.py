"""The GEMM kernels' tuning: frozen configs passed as static arguments, and the defaults chosen from measurement
(docs/kernels/gemm.md has the figures)."""

from __future__ import annotations

import dataclasses

from mxdit.quant.formats import FORMATS

from ..numerics import BLOCK_K


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """Tiles of the Mosaic GPU kernel. Each of the `compute_wgs` compute warpgroups owns `tile_m` x `tile_n` of the
    output (the CTA covers compute_wgs * tile_m rows); the K step is 128. `max_concurrent_steps`: shared-memory
    pipeline depth. `grid_tile_width`: how many tiles along the minor grid dimension the persistent loop sweeps before
    turning (output tiles that share operands run close together in time, so they hit L2). `prefetch_residual`: the
    residual epilogue's first two column slices are fetched when the tile starts, not after its main loop.
    `cluster_n`: CTAs a cluster, side by side along N; they share their rows of x, which one TMA multicast brings to
    all of them (less L2-to-SM traffic a FLOP)."""

    tile_m: int = 128
    tile_n: int = 128
    max_concurrent_steps: int = 4
    epi_tile_n: int = 64
    grid_minor_n: bool = True
    grid_tile_width: int = 8
    compute_wgs: int = 2
    prefetch_residual: bool = False
    cluster_n: int = 1


def default_mosaic_config(m: int, n: int, k: int, block_scaled: bool, residual: bool = False) -> MosaicConfig:
    """The tiles `benchmark.py gemm` measured best for this kind of shape (docs/kernels/gemm.md). No clusters: at
    Krea 2's shapes they save nothing measurable in the step."""
    if block_scaled:
        # Promotion keeps a partial and a total accumulator in registers: 64 x 128 per warpgroup leaves room for both.
        # Three compute warpgroups keep the tensor cores busy while the others promote; they need M to be a multiple
        # of 192, or padding rows would cost more than they gain.
        return MosaicConfig(tile_m=64, tile_n=128, max_concurrent_steps=4, compute_wgs=3 if m % 192 == 0 else 2)
    if m <= 2048:  # more, smaller tiles fill the 132 SMs better
        return MosaicConfig(tile_m=64, tile_n=128, max_concurrent_steps=4)
    if m % 256:
        # 256-row CTAs would pad M (Krea 2 with trimmed text: 4096 + 128 = 4224 rows) and copy x, the residual and
        # the output around the kernel. 128-row CTAs of two 64 x 256 tiles divide it, and the wide tile halves the
        # per-tile overhead; the residual epilogue is fetched during the main loop. Grid tile width 4: at the power
        # cap the order that fetches fewer bytes from HBM runs faster.
        if residual:
            return MosaicConfig(tile_m=64, tile_n=256, max_concurrent_steps=3, compute_wgs=2, prefetch_residual=True,
                                grid_tile_width=4)
        return MosaicConfig(tile_m=64, tile_n=256, max_concurrent_steps=3, compute_wgs=2, epi_tile_n=128,
                            grid_tile_width=4)
    return MosaicConfig(tile_m=128, tile_n=128, max_concurrent_steps=3)




# The most shared memory a CTA may have on Hopper (H100/H200: 227 KB).
SHARED_MEMORY_BYTES = 232448


def mosaic_shared_memory_bytes(config: MosaicConfig, out_itemsize: int, *, block_scaled: bool = False,
                               swiglu_width: int = 0, col_vectors: int = 1) -> int:
    """The shared memory `_mosaic_gemm` takes with `config`: the FP8 operand ring (and the scales travelling with
    it when block-scaled), the output's two staging slots a warpgroup, the epilogue's row vector and `col_vectors`
    column vectors (weight scales, bias, gate); the barriers left out (Mosaic's own count is within 1 KB of it)."""
    cta_m = config.compute_wgs * config.tile_m
    ring = config.max_concurrent_steps * (cta_m + config.tile_n) * (BLOCK_K + (4 if block_scaled else 0))
    epi_n = swiglu_width or min(config.epi_tile_n, config.tile_n)
    staging = config.compute_wgs * 2 * config.tile_m * epi_n * out_itemsize
    vectors = config.compute_wgs * (config.tile_m + col_vectors * config.tile_n) * 4
    return ring + staging + vectors


def _fit_shared_memory(config: MosaicConfig, out_itemsize: int, **kwargs) -> MosaicConfig:
    """`config` with narrower output slices, then a shallower ring, until it fits in shared memory (the defaults
    are tuned for bf16 outputs; float32 ones need twice the staging)."""
    def fits(c):
        return mosaic_shared_memory_bytes(c, out_itemsize, **kwargs) <= SHARED_MEMORY_BYTES - 2048  # barriers

    while not fits(config) and config.epi_tile_n > 32:
        config = dataclasses.replace(config, epi_tile_n=config.epi_tile_n // 2)
    while not fits(config) and config.max_concurrent_steps > 2:
        config = dataclasses.replace(config, max_concurrent_steps=config.max_concurrent_steps - 1)
    return config




@dataclasses.dataclass(frozen=True)
class TritonConfig:
    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3


def default_triton_config(m: int, n: int, k: int, fmt: str) -> TritonConfig:
    """Tiles by operand kind: MX unpacking needs registers, so its tiles are narrower."""
    if FORMATS[fmt].kind == "mx":
        return TritonConfig(block_m=64, block_n=128, num_warps=4, num_stages=2)
    return TritonConfig()
