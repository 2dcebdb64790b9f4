"""The INT8-QK attention kernels' tuning: frozen configs, passed to the kernels as static arguments, and the
defaults chosen from measurement (docs/kernels/int8_attention.md has the figures; docs/decisions.md the variants
that lost)."""

from __future__ import annotations

import dataclasses

MOSAIC_ROWS = 64  # query rows of a Mosaic compute warpgroup (wgmma's M); also that backend's Q quantization block


@dataclasses.dataclass(frozen=True)
class PrologueConfig:
    """The fused prologue's Triton passes (RMSNorm, rotary embedding, K smoothing, INT8 quantization).

    q_warps, k_warps: warps a program of the Q and of the K pass. q_heads, k_heads: heads a program of each, done
    one after the other with the rotary tables loaded once. k_pass_rows: tokens a program of the K pass, which takes
    its blocks' steps from the sums pass and so needs no reduction over a whole block (a power of two dividing
    block_k)."""

    q_warps: int = 16
    k_warps: int = 8
    q_heads: int = 4
    k_heads: int = 1
    k_pass_rows: int = 32


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """One attention kernel's tiling.

    block_q: query rows a block of Q's INT8 scales covers and, Triton, a program takes (Mosaic: `MOSAIC_ROWS`).
    block_k: keys a block of K's INT8 scales covers and a step of the key loop takes.
    num_stages: Triton's software pipelining depth; Mosaic's K/V ring of shared-memory slots.
    num_warps: Triton's warps a program.
    compute_wgs: Mosaic's compute warpgroups a CTA, 2 or 3.
    turns: how Mosaic's compute warpgroups share the tensor cores: "pairs" (two only, FA3's ping-pong) or "ring";
        None: pairs for two, a ring for three.
    pv_accumulation: Mosaic FP8 P.V: "two_level" (a key block's product in a fresh accumulator, added to the float32
        one) or "in_place" (into the running wgmma accumulator; the row sums then come from a second wgmma).
    prologue: the fused prologue's passes (`int8_attention_fused`)."""

    block_q: int = 64
    block_k: int = 64
    num_stages: int = 2
    num_warps: int = 4
    compute_wgs: int = 2
    turns: str | None = None
    pv_accumulation: str = "two_level"
    prologue: PrologueConfig = PrologueConfig()

    def memory_registers(self) -> int:
        """Registers a thread of the Mosaic memory warpgroup keeps (`setmaxnreg`); the compute ones get the rest."""
        return {2: 40, 3: 24}[self.compute_wgs]


def mosaic_compute_wgs(pv: str, head_dim: int, q_len: int, interpret: bool, float32_q_tiles: bool = False) -> int:
    """Three compute warpgroups for FP8 P.V at head_dim <= 128 (the accumulator and the logits fit 160 registers a
    thread) where 192-row CTAs pad the queries no more than 128-row ones; else two. Shared memory rules out bf16
    P.V (V's tiles) and, at head_dim 128, `float32_q_tiles` (Q made in the kernel from float32 tiles, which use the
    output's). Two in interpret mode: the Mosaic GPU interpreter needs a thread per warpgroup, and two CPU cores do
    not start a fourth."""
    fits = pv == "fp8" and head_dim <= (64 if float32_q_tiles else 128) and not interpret
    return 3 if fits and (-q_len) % (3 * MOSAIC_ROWS) <= (-q_len) % (2 * MOSAIC_ROWS) else 2


def default_config(backend: str, pv: str, head_dim: int, q_len: int, *, interpret: bool = False,
                   float32_q_tiles: bool = False) -> AttentionConfig:
    """The measured best config of `backend` ("triton" or "mosaic") for P.V in `pv` at this head_dim and query
    length. Mosaic: key blocks of 128 in a two-slot ring, FP8 P.V accumulated in place on the GPU (the interpreter
    runs two-level only), the compute warpgroups of `mosaic_compute_wgs`. Triton: 64 x 64 blocks, 4 warps."""
    if backend == "triton":
        return AttentionConfig()
    if backend == "mosaic":
        return AttentionConfig(block_q=MOSAIC_ROWS, block_k=128, num_stages=2,
                               compute_wgs=mosaic_compute_wgs(pv, head_dim, q_len, interpret, float32_q_tiles),
                               pv_accumulation="in_place" if pv == "fp8" and not interpret else "two_level")
    raise ValueError(f"backend must be 'triton' or 'mosaic', got {backend!r}")
