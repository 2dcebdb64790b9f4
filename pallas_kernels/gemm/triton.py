"""The GEMM through Pallas' Triton lowering, the portable path (also the code for ROCm): FP8 and INT8 dots, MX
weights unpacked and scaled inside the kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mxdit.quant.formats import FORMATS

from ..numerics import BLOCK_K, dot_fp8
from .config import TritonConfig
from .reference import _epilogue
from .weights import MX_BLOCK, GemmWeight, _pad_to_tiles, _pow2_at_least


def _mx_codes_to_e4m3(codes, fmt):
    """Element codes (uint8 in the low bits) -> float8_e4m3fn of the same values (exact: every E2M1, E2M3 and E3M2
    value is an E4M3 value). Integer arithmetic builds the float32 value; no table, no ldexp (Triton has neither)."""
    e = FORMATS[fmt].element
    c = codes.astype(jnp.int32)
    sign = (c >> (e.ebits + e.mbits)) & 1
    exp_field = (c >> e.mbits) & ((1 << e.ebits) - 1)
    mant = c & ((1 << e.mbits) - 1)
    # value = (exp_field ? 2^mbits + mant : 2 * mant) * 2^(max(exp_field, 1) - bias - mbits)
    significand = jnp.where(exp_field > 0, mant + (1 << e.mbits), mant).astype(jnp.float32)
    pow2_bits = (jnp.maximum(exp_field, 1) - e.bias - e.mbits + 127) << 23
    value = significand * jax.lax.bitcast_convert_type(pow2_bits, jnp.float32)
    value = jnp.where(sign == 1, -value, value)
    return value.astype(jnp.float8_e4m3fn)


def _triton_gemm(x, x_scale, w: GemmWeight, bias, residual, gate, *, activation, out_dtype, config: TritonConfig,
                 interpret=False):
    import jax.experimental.pallas as pl
    from jax.experimental.pallas import triton as pltriton

    m, k = x.shape
    n = w.n
    bm, bn = min(config.block_m, _pow2_at_least(m)), min(config.block_n, _pow2_at_least(n))
    # The Triton lowering masks no load or store: a tile reaching past the arrays would read and write past them, so
    # every operand is padded to whole tiles (DiT shapes need none) and the result cut back.
    x, x_scale, w, bias, residual, gate = _pad_to_tiles(x, x_scale, w, bias, residual, gate, (-m) % bm, (-n) % bn)
    k_iters = k // BLOCK_K
    x_blocks = x_scale.ndim == 2
    int8 = jnp.dtype(x.dtype) == jnp.int8
    mx = w.layout == "mx"
    bits = FORMATS[w.fmt].element.bits if mx else 8
    has_bias, has_res, has_gate = bias is not None, residual is not None, gate is not None
    w_block = w.layout == "block"

    def kernel(x_ref, xs_ref, w_ref, ws_ref, hb_ref, bias_ref, res_ref, gate_ref, o_ref):
        acc_type = jnp.int32 if int8 else jnp.float32

        def x_scale_block(kb):
            return xs_ref[kb, :] if x_blocks else None

        def step(kb, acc):
            if not (mx or w_block or x_blocks):
                xt = x_ref[:, pl.ds(kb * BLOCK_K, BLOCK_K)]
                wt = w_ref[:, pl.ds(kb * BLOCK_K, BLOCK_K)]
                return acc + (jnp.dot(xt, wt.T, preferred_element_type=acc_type) if int8 else dot_fp8(xt, wt.T))
            if not mx:
                xt = x_ref[:, pl.ds(kb * BLOCK_K, BLOCK_K)]
                wt = w_ref[:, pl.ds(kb * BLOCK_K, BLOCK_K)]
                part = jnp.dot(xt, wt.T, preferred_element_type=jnp.float32) if int8 else dot_fp8(xt, wt.T)
                if x_blocks:
                    part = part * x_scale_block(kb)[:, None]
                if w_block:
                    part = part * ws_ref[kb, :][None, :]
                return acc + part
            # MX weights: four 32-blocks per K step, each promoted with its own E8M0 scale.
            part_sum = jnp.zeros_like(acc)
            for q in range(BLOCK_K // MX_BLOCK):
                k0 = kb * BLOCK_K + q * MX_BLOCK
                xt = x_ref[:, pl.ds(k0, MX_BLOCK)]
                if bits == 8:
                    wt = w_ref[:, pl.ds(k0, MX_BLOCK)]
                else:
                    byte_col = kb * (BLOCK_K // 2) + (q // 2) * MX_BLOCK
                    packed = w_ref[:, pl.ds(byte_col, MX_BLOCK)].astype(jnp.int32)
                    codes = (packed >> 4) if q % 2 else (packed & 0xF)
                    if bits == 6:
                        high = hb_ref[:, pl.ds(kb * MX_BLOCK, MX_BLOCK)].astype(jnp.int32)
                        codes = codes | (((high >> (2 * q)) & 3) << 4)
                    wt = _mx_codes_to_e4m3(codes, w.fmt)
                exps = ws_ref[:, kb * (BLOCK_K // MX_BLOCK) + q].astype(jnp.int32)
                sw = jax.lax.bitcast_convert_type(jnp.clip(exps, 1, 254) << 23, jnp.float32)
                sw = jnp.where(exps == 255, jnp.nan, jnp.where(exps == 0, 0.0, sw))
                part_sum = part_sum + dot_fp8(xt, wt.T) * sw[None, :]
            if x_blocks:
                part_sum = part_sum * x_scale_block(kb)[:, None]
            return acc + part_sum

        acc = jax.lax.fori_loop(0, k_iters, step, jnp.zeros((bm, bn), acc_type))
        y = acc.astype(jnp.float32)
        if not x_blocks:
            y = y * xs_ref[...][:, None]
        if w.layout == "channel":
            y = y * ws_ref[...][None, :]
        y = _epilogue(y, bias_ref[...] if has_bias else None, activation,
                      res_ref[...] if has_res else None, gate_ref[...] if has_gate else None)
        o_ref[...] = y.astype(o_ref.dtype)

    grid = (x.shape[0] // bm, w.n // bn)
    row_k = pl.BlockSpec((bm, k), lambda i, j: (i, 0))
    dummy = jnp.zeros((1,), jnp.float32)
    any_spec = pl.BlockSpec((1,), lambda i, j: (0,))
    xs_spec = pl.BlockSpec((k_iters, bm), lambda i, j: (0, i)) if x_blocks else pl.BlockSpec((bm,), lambda i, j: (i,))
    w_cols = w.data.shape[1]
    w_spec = pl.BlockSpec((bn, w_cols), lambda i, j: (j, 0))
    if w.layout == "channel":
        ws_spec = pl.BlockSpec((bn,), lambda i, j: (j,))
    elif w.layout == "block":
        ws_spec = pl.BlockSpec((k_iters, bn), lambda i, j: (0, j))
    else:
        ws_spec = pl.BlockSpec((bn, w.scale.shape[1]), lambda i, j: (j, 0))
    hb = w.high_bits if w.high_bits is not None else dummy
    hb_spec = pl.BlockSpec((bn, hb.shape[1]), lambda i, j: (j, 0)) if w.high_bits is not None else any_spec
    vec_n = pl.BlockSpec((bn,), lambda i, j: (j,))
    tile = pl.BlockSpec((bm, bn), lambda i, j: (i, j))
    y = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((x.shape[0], w.n), out_dtype),
        grid=grid,
        in_specs=[row_k, xs_spec, w_spec, ws_spec, hb_spec, vec_n if has_bias else any_spec,
                  tile if has_res else any_spec, vec_n if has_gate else any_spec],
        out_specs=tile,
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
    )(x, x_scale, w.data, w.scale, hb, bias if has_bias else dummy, residual if has_res else dummy,
      gate if has_gate else dummy)
    return y[:m, :n]
