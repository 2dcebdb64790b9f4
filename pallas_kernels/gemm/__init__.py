"""Block-scaled low-precision GEMM: `y = epilogue((x * sx) @ (w * sw)^T)` with x in FP8 or INT8 and w in FP8, MXFP8,
MXFP6, MXFP4 or INT8; float32 accumulation; bf16 output.

Three implementations of one definition, which `reference.scaled_matmul_reference` states in plain jnp (the modules:
`weights` the operands' layouts, `reference`, `mosaic`, `triton`, `config` their tuning; docs/kernels/gemm.md):

- `backend="mosaic"`: Mosaic GPU for Hopper (wgmma with FP8 operands straight from shared memory, TMA loads in a
  warp-specialized pipeline: one memory warpgroup, two compute warpgroups; a persistent grid over output tiles).
- `backend="triton"`: Pallas' Triton lowering, the portable path (also the code for ROCm): FP8 and INT8 dots, MX
  weights unpacked and scaled inside the kernel.
- `backend="reference"`: dequantize both operands to float32 and multiply (what the tests compare against).

Scaling (docs/formats.md; DeepGEMM's recipe):
- Activations: FP8 E4M3 with one float32 scale per token (`x_scaling="token"`) or per token and 128-wide K block
  (`"block"`, 1x128), quantized by `quantize_activations` (one XLA fusion over x); INT8 per token for INT8 weights.
- Weights: one scale per output channel (fp8, int8), or per output channel and 128-wide K block. With block scales
  anywhere, the kernel promotes: each 128-wide K block's product is accumulated on its own and added into the float32
  accumulator as `acc += s * partial`, which also keeps FP8 wgmma's short accumulator (~14 significant bits) from
  seeing a long sum. `s` holds only the scales that vary along K (sx[m] for 1x128 activations, sw[n] for 128-blocked
  weights): the promotion's arithmetic was the kernel's limit, and the constant side costs nothing in the epilogue.
  Per-token x per-channel scales are applied once, in the epilogue, with no promotion at all.
- MX weights on the Mosaic path are re-expressed per 128-block by `fold_mx_weight`: the four 32-block exponents of
  a 128-block are folded into E4M3 values under one float32 scale. E2M3 / E2M1 / E3M2 values shifted by the exponent
  differences stay exact in E4M3 while the spread is small (see `fold_mx_weight`); the weight then takes 8 bits a
  value on the device (not 6 or 4). The Triton path keeps the packed codes in memory and unpacks them in the kernel.

Epilogue: `activation(y + bias)`, then `residual + gate * that` (the DiT's gated residual), all in float32.
`activation="swiglu"` takes a weight made by `swiglu_weight` (the gate's and up's rows interleaved in runs of
`SWIGLU_WIDTH`, so that every output tile holds both halves of its columns) and returns `silu(gate) * up`: (m, n / 2),
rounded as the unfused model rounds it. The product of SwiGLU's gate and up (Krea 2: 4224 x 32768 a block) is then
never written out and read back.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..numerics import BLOCK_K, quantize_activations
from .config import (SHARED_MEMORY_BYTES, MosaicConfig, TritonConfig, _fit_shared_memory, default_mosaic_config,
                     default_triton_config, mosaic_shared_memory_bytes)
from .mosaic import _mosaic_gemm
from .reference import dequantize_weight, scaled_matmul_reference
from .triton import _triton_gemm
from .weights import (ACTIVATIONS, MX_BLOCK, SWIGLU_WIDTH, WEIGHT_FORMATS, GemmWeight, _pad_to_tiles, concat_weights,
                      fold_mx_error, fold_mx_weight, pack_mx_for_kernel, prepare_weight, swiglu_pairs, swiglu_weight)
from mxdit.quant.formats import FORMATS

__all__ = ["ACTIVATIONS", "BLOCK_K", "FORMATS", "MX_BLOCK", "SHARED_MEMORY_BYTES", "SWIGLU_WIDTH", "WEIGHT_FORMATS",
           "GemmWeight", "MosaicConfig", "TritonConfig", "concat_weights", "default_mosaic_config",
           "default_triton_config", "dequantize_weight", "fold_mx_error", "fold_mx_weight",
           "mosaic_shared_memory_bytes", "pack_mx_for_kernel", "prepare_weight", "quantize_activations",
           "scaled_matmul", "scaled_matmul_reference", "swiglu_pairs", "swiglu_weight"]


def scaled_matmul(x: jax.Array, w: GemmWeight, x_scale: jax.Array | None = None, *, x_scaling: str = "token",
                  bias: jax.Array | None = None, activation: str = "none", residual: jax.Array | None = None,
                  gate: jax.Array | None = None, out_dtype=jnp.bfloat16, backend: str = "mosaic",
                  config: MosaicConfig | TritonConfig | None = None, interpret: bool = False) -> jax.Array:
    """`epilogue(x @ w^T)` with low-precision operands.

    Args:
        x: (m, k) float (quantized here, `x_scaling` "token" or "block") or already-quantized values with `x_scale`
            from `quantize_activations`.
        w: `prepare_weight(...)` for this backend.
        bias, gate: (n,); residual: (m, n). The output is `residual + gate * activation(x @ w^T + bias)`; with
            activation "swiglu" (a `swiglu_weight`, no residual or gate) `swiglu_pairs(x @ w^T + bias)`, (m, n / 2).
        backend: "mosaic" (Hopper), "triton" (portable) or "reference".
        interpret: run the Pallas kernel in interpret mode (CPU tests).
    Returns:
        (m, n) `out_dtype` ((m, n / 2) for "swiglu").
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if (activation == "swiglu") != bool(w.swiglu_width):
        raise ValueError("scaled_matmul: activation='swiglu' takes a `swiglu_weight` and such a weight only that "
                         f"activation (got activation {activation!r}, swiglu_width {w.swiglu_width})")
    if activation == "swiglu" and (residual is not None or gate is not None):
        raise ValueError("scaled_matmul: the swiglu epilogue takes no residual or gate")
    int8 = FORMATS[w.fmt].kind == "int8"
    if x_scale is None:
        x, x_scale = quantize_activations(x, "token" if int8 else x_scaling, w.fmt if int8 else "fp8_e4m3")
    m = x.shape[0]
    if x.shape[1] != w.k:
        raise ValueError(f"scaled_matmul: x has {x.shape[1]} columns (padded), the weight {w.k}")
    if int8 != (jnp.dtype(x.dtype) == jnp.int8):
        raise ValueError(f"scaled_matmul: {w.fmt} weights need {'INT8' if int8 else 'FP8'} activations, got {x.dtype}")
    if backend == "reference":
        return scaled_matmul_reference(x, x_scale, w, bias=bias, activation=activation, residual=residual, gate=gate,
                                       out_dtype=out_dtype)
    if backend == "triton":
        config = config or default_triton_config(m, w.n, w.k, w.fmt)
        if activation == "swiglu":  # SwiGLU after the kernel (its tiles do not follow the weight's pairs)
            y = _triton_gemm(x, x_scale, w, bias, None, None, activation="none", out_dtype=out_dtype, config=config,
                             interpret=interpret)
            return swiglu_pairs(y, w.swiglu_width, out_dtype).astype(out_dtype)
        return _triton_gemm(x, x_scale, w, bias, residual, gate, activation=activation, out_dtype=out_dtype,
                            config=config, interpret=interpret)
    if backend != "mosaic":
        raise ValueError(f"backend must be 'mosaic', 'triton' or 'reference', got {backend!r}")
    if int8 or w.layout == "mx":
        raise ValueError(f"the Mosaic GPU kernel takes FP8 operands (wgmma has no INT8 here); {w.fmt} in layout "
                         f"{w.layout!r} runs on backend='triton'")
    x_blocks, w_blocks = x_scale.ndim == 2, w.layout == "block"
    # A given config is fitted too: tiles tuned for bf16 outputs stage twice the bytes for float32 ones.
    config = config or default_mosaic_config(m, w.n, w.k, x_blocks or w_blocks, residual is not None)
    config = _fit_shared_memory(config, jnp.dtype(out_dtype).itemsize, block_scaled=x_blocks or w_blocks,
                                swiglu_width=w.swiglu_width,
                                col_vectors=max((not w_blocks) + (bias is not None) + (gate is not None), 1))
    # The kernel takes whole tiles: pad rows and columns (cheap next to the product for DiT shapes, which need none).
    cta_m, tn = config.compute_wgs * config.tile_m, config.tile_n * config.cluster_n
    n = w.n
    x, x_scale, w, bias, residual, gate = _pad_to_tiles(x, x_scale, w, bias, residual, gate, (-m) % cta_m,
                                                        (-n) % tn)
    y = _mosaic_gemm(x, x_scale.astype(jnp.float32), w.data, w.scale.astype(jnp.float32), bias, residual, gate,
                     x_blocks=x_blocks, w_blocks=w_blocks, activation=activation, out_dtype=out_dtype, config=config,
                     w_scale_rows=w.scale_rows, swiglu_width=w.swiglu_width, interpret=interpret)
    return y[:m, : n // 2 if w.swiglu_width else n]

