"""The fused prologue of INT8-QK attention, Triton passes: the models' per-head RMSNorm, the rotary embedding, K
smoothing and the INT8 quantization of Q and K in one read of the raw projections (`rms_rope_reference` then
`_quantize_int8_blocks` state what it computes)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..numerics import INV_127, reciprocal_products
from .config import PrologueConfig
from .reference import _block_steps_of_range, _key_lengths, _round_half_even, _valid_keys


def int8_qk_prologue(q, k, norm_q, norm_k, eps: float, cos, sin, kv_lengths=None, *, scale: float,
                     block_q: int = 64, block_k: int = 64, smooth_k: bool = True, interpret: bool = False,
                     config: PrologueConfig = PrologueConfig()):
    """Fused RMSNorm + rotary + (K: smoothing, masking) + INT8 block quantization of raw Q and K projections.

    q: (batch, seq, heads, head_dim), k: (batch, seq, kv_heads, head_dim) as the projections give them (before the
    norms); norm_q, norm_k: (head_dim,) RMSNorm weights; cos, sin as `rms_rope_reference`. One kernel pass over Q
    and one over K; K's mean over the valid keys (for smoothing) takes one pass of the same kernel before it, which
    sums each block's normed and rotated keys (`block_sums`). Returns qi, qs, ki, ks as `_prologue` does (int8
    values, float32 scales (batch, seq blocks, heads)), with channels in the order of `_deinterleave`. `config`:
    the passes' warps and heads a program (`PrologueConfig`).
    """
    return _qk_prologue(q, (0, q.shape[2]), k, (0, k.shape[2]), norm_q, norm_k, eps, cos, sin, kv_lengths,
                        scale=scale, block_q=block_q, block_k=block_k, smooth_k=smooth_k, interpret=interpret,
                        config=config)


def int8_qk_prologue_stacked(qkv, num_heads: int, num_kv_heads: int, norm_q, norm_k, eps: float, cos, sin,
                             kv_lengths=None, *, scale: float, block_q: int = 64, block_k: int = 64,
                             smooth_k: bool = True, interpret: bool = False,
                             config: PrologueConfig = PrologueConfig()):
    """`int8_qk_prologue` with Q and K read in place from one stacked projection (batch, seq, H, head_dim), whose
    heads are [Q (num_heads) | K (num_kv_heads) | ...]: no copy of Q or K sliced out of it first."""
    return _qk_prologue(qkv, (0, num_heads), qkv, (num_heads, num_kv_heads), norm_q, norm_k, eps, cos, sin,
                        kv_lengths, scale=scale, block_q=block_q, block_k=block_k, smooth_k=smooth_k,
                        interpret=interpret, config=config)


def _qk_prologue(q_src, q_heads, k_src, k_heads, norm_q, norm_k, eps, cos, sin, kv_lengths, *, scale, block_q,
                 block_k, smooth_k, interpret, config: PrologueConfig = PrologueConfig(), k_only: bool = False,
                 values=None):
    """The prologue on heads [first, first + count) of `q_src` and `k_src` (`q_heads`, `k_heads`). With `smooth_k`,
    a sums pass first gives K's mean over the valid keys and each block's per-channel range, from which the K pass
    takes its steps exactly (`_block_steps_of_range`) and so quantizes `config.k_pass_rows` tokens a program with
    no reduction over a block. `k_only`: no Q pass (qi, qs None), and K in the natural channel order (for the
    Mosaic kernel that makes Q itself). `values` (V's source, (first, count) of its heads; with `smooth_k`): the
    sums pass also takes V's range over the valid keys, returned fifth as (max, min, sum) (batch, kv_heads,
    head_dim) each."""
    b, s, _, d = q_src.shape
    (_, h), (_, hk) = q_heads, k_heads
    cos = jnp.broadcast_to(cos, (b, s, d)).astype(jnp.float32)[..., 0::2]  # pairs share a frequency: half the table
    sin = jnp.broadcast_to(sin, (b, s, d)).astype(jnp.float32)[..., 0::2]
    valid = _valid_keys(kv_lengths, b, s)
    lengths = _key_lengths(kv_lengths, b, s)
    k_pass = dict(heads=k_heads, num_warps=config.k_warps, heads_per_program=config.k_heads)
    k_mean = jnp.zeros((b, hk, d), jnp.float32)  # in `_deinterleave`'s channel order, as the kernel writes K
    if values is not None and (not smooth_k or values[1][1] != hk):
        raise ValueError(f"_qk_prologue: V's range comes with K smoothing's sums, for as many heads as K ({hk})")
    k_steps, v_range = None, None
    if smooth_k:  # the normed, rotated K summed over the valid keys of each block by a pass of the same kernel
        sums, *extra = rms_rope_quantize(k_src, norm_k, eps, cos, sin, None, lengths, 1.0, block_k, interpret,
                                         **k_pass, block_sums=True, key_range=True,
                                         values=None if values is None else (values[0], values[1][0]))
        if values is not None:
            v_range = extra.pop(0)
            v_range = (v_range[:, :, :, 0].max(axis=1), v_range[:, :, :, 1].min(axis=1),
                       v_range[:, :, :, 2].sum(axis=1))
        k_mean = jnp.sum(sums, axis=1) / jnp.maximum(valid.sum(axis=1), 1)[:, None, None]
        k_steps = _block_steps_of_range(extra.pop(0), k_mean)
    qi = qs = None
    if not k_only:
        q_mean = jnp.zeros((b, h, d), jnp.float32)
        qi, qs = rms_rope_quantize(q_src, norm_q, eps, cos, sin, q_mean, None, scale, block_q, interpret, heads=q_heads,
                                   num_warps=config.q_warps, heads_per_program=config.q_heads)
    ki, ks = rms_rope_quantize(k_src, norm_k, eps, cos, sin, k_mean, lengths, 1.0, block_k, interpret, **k_pass,
                               natural_order=k_only, steps=k_steps,
                               rows_per_program=config.k_pass_rows if k_steps is not None else None)
    return (qi, qs, ki, ks) if values is None else (qi, qs, ki, ks, v_range)


def _rotated(x_ref, c, sn, we_ref, wo_ref, head, *, tile, eps):
    """One head's (tile, head_dim / 2) real and imaginary parts of a prologue tile after the norm and the rotation:
    every other channel from 0 and from 1 (two strided loads), RMS-normed over both, times the norm's weight halves,
    rotated by the tables c, sn."""
    from jax.experimental import pallas as pl

    d = x_ref.shape[-1]
    half = d // 2
    one = pl.ds(head, 1)  # (a slice of one, not an integer: interpret mode's strided loads take only slices)
    even, odd = (x_ref[:, one, pl.ds(start, half, stride=2)].reshape(tile, half).astype(jnp.float32)
                 for start in (0, 1))
    inv = jax.lax.rsqrt((jnp.sum(even * even, axis=-1) + jnp.sum(odd * odd, axis=-1)) / d + eps)[:, None]
    even = even * inv * we_ref[...]
    odd = odd * inv * wo_ref[...]
    return even * c - odd * sn, odd * c + even * sn


def _tables_and_mask(lengths_ref, c_ref, s_ref, *, tile):
    """The rotary tables (tile, head_dim / 2), loaded once for a program's heads, and which of its rows are valid
    keys (tile, 1)."""
    from jax.experimental import pallas as pl

    c, sn = c_ref[...], s_ref[...]
    rows = pl.program_id(1) * tile + jax.lax.broadcasted_iota(jnp.int32, (tile, 1), 0)
    return c, sn, rows < lengths_ref[pl.program_id(0)]


def _sums_kernel(lengths_ref, x_ref, c_ref, s_ref, we_ref, wo_ref, *refs, group, tile, eps, with_v, key_range):
    """`rms_rope_quantize(block_sums=True)`'s program: per head, the normed, rotated values summed over the tile's
    valid rows; with `key_range` their per-channel max and min; `with_v`: V's max, min and sum over those rows."""
    from jax.experimental import pallas as pl

    refs = list(refs)
    v_ref = refs.pop(0) if with_v else None
    sum_ref = refs.pop(0)
    range_ref = refs.pop(0) if with_v else None
    key_range_ref = refs.pop(0) if key_range else None
    d = x_ref.shape[-1]
    half = d // 2
    c, sn, keep = _tables_and_mask(lengths_ref, c_ref, s_ref, tile=tile)

    def valid_max_min(v):
        return jnp.max(jnp.where(keep, v, -jnp.inf), axis=0), jnp.min(jnp.where(keep, v, jnp.inf), axis=0)

    for head in range(group):
        one = pl.ds(head, 1)
        real, imag = _rotated(x_ref, c, sn, we_ref, wo_ref, head, tile=tile, eps=eps)
        for start, v in ((0, real), (half, imag)):
            sum_ref[one, pl.ds(start, half)] = jnp.sum(jnp.where(keep, v, 0.0), axis=0)[None]
            if key_range_ref is not None:
                for i, part in enumerate(valid_max_min(v)):
                    key_range_ref[one, pl.ds(i, 1), pl.ds(start, half)] = part.reshape(1, 1, half)
        if v_ref is not None:
            v = v_ref[:, one, :].reshape(tile, d).astype(jnp.float32)
            for i, part in enumerate((*valid_max_min(v), jnp.sum(jnp.where(keep, v, 0.0), axis=0))):
                range_ref[one, pl.ds(i, 1), :] = part.reshape(1, 1, d)


def rms_rope_quantize(x, weight, eps, cos_half, sin_half, mean, lengths, multiplier, block, interpret,
                      num_warps: int = 8, heads: tuple[int, int] | None = None, heads_per_program: int = 1,
                      block_sums: bool = False, natural_order: bool = False,
                      values: tuple[jax.Array, int] | None = None, key_range: bool = False,
                      steps: jax.Array | None = None, rows_per_program: int | None = None):
    """The kernel: a program per (batch, block of `block` tokens, group of `heads_per_program` heads; fewer when the
    heads or their first one are no multiple of it). A group's heads are done one after the other (an unrolled
    loop) with the rotary tables loaded once (float32, half a head's width). `heads` (first, count): only those
    heads of x, read in place (all of them by default). `block_sums`: instead of quantizing, the normed and rotated
    values summed over each block's valid tokens, (batch, blocks, heads, head_dim) float32 in `_deinterleave`'s
    order (K smoothing's mean; `mean` and `multiplier` are not used). `natural_order`: the INT8 values in the
    input's channel order (the Mosaic kernel's order when it makes Q itself), not `_deinterleave`'s; `mean` stays
    in the latter. `values` (block_sums only): (V's source, its first head), V's heads as many as x's and read in
    place; the same programs also give V's range over each block's valid tokens, (batch, blocks, heads, 3,
    head_dim) float32 max, min and sum, returned after the sums (FP8 P.V's scales and means,
    `_v_fp8_scale_and_mean_of_range`, without another read of V). `key_range` (block_sums only): also each block's
    per-channel max and min of the normed, rotated valid keys, (batch, blocks, heads, 2, head_dim) in the sums'
    order, returned last. `steps` (quantizing only): the blocks' INT8 steps (batch, blocks, heads) given
    (`_block_steps_of_range`), so that a program needs no reduction over its block: it then takes
    `rows_per_program` tokens (a power of two dividing `block`; None: the block) and the steps are returned as the
    scales."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    b, s, _, d = x.shape
    first, h = heads if heads is not None else (0, x.shape[2])
    if (values is not None or key_range) and not block_sums:
        raise ValueError("rms_rope_quantize: V's range (values) and K's (key_range) come with block_sums")
    if steps is not None and block_sums:
        raise ValueError("rms_rope_quantize: steps are given to the quantizing pass, not to block_sums")
    if rows_per_program is not None and steps is None:
        raise ValueError("rms_rope_quantize: rows_per_program takes given steps (no reduction over a block)")
    tile = block if rows_per_program is None else rows_per_program
    if tile != block and (block % tile or tile & (tile - 1)):
        raise ValueError(f"rms_rope_quantize: rows_per_program {tile} must be a power of two dividing {block}")
    v_src, v_first = values if values is not None else (None, 0)
    # a power of two (Triton's block shapes) dividing the heads and their first ones
    group = max(g for g in (1, 2, 4, 8, 16)
                if g <= heads_per_program and h % g == 0 and first % g == 0 and v_first % g == 0)
    half = d // 2
    pad = (-s) % block
    if pad:  # zero rows: they contribute nothing to a block's amax
        rows_pad = ((0, 0), (0, pad), (0, 0), (0, 0))
        v_in_x = v_src is x  # (a stacked projection: V's heads read from the same padded copy)
        x = jnp.pad(x, rows_pad)
        if v_src is not None:
            v_src = x if v_in_x else jnp.pad(v_src, rows_pad)
        cos_half = jnp.pad(cos_half, ((0, 0), (0, pad), (0, 0)))
        sin_half = jnp.pad(sin_half, ((0, 0), (0, pad), (0, 0)))
    n_blocks = (s + pad) // block
    w = (1.0 + weight.astype(jnp.float32))
    w_even, w_odd = w[0::2], w[1::2]
    mean_even, mean_odd = (None, None) if mean is None else (mean[..., :half], mean[..., half:])
    masked = lengths is not None
    lengths = jnp.full((b,), s, jnp.int32) if lengths is None else lengths

    rotated = functools.partial(_rotated, tile=tile, eps=eps)
    tables_and_mask = functools.partial(_tables_and_mask, tile=tile)

    def kernel(lengths_ref, x_ref, c_ref, s_ref, we_ref, wo_ref, me_ref, mo_ref, *refs):
        steps_ref, q_ref, scale_ref = (*refs, None) if steps is not None else (None, *refs)
        c, sn, keep = tables_and_mask(lengths_ref, c_ref, s_ref)
        for head in range(group):  # unrolled: the heads' loads are independent
            one = pl.ds(head, 1)
            real, imag = rotated(x_ref, c, sn, we_ref, wo_ref, head)
            real = (real - me_ref[one, :]) * multiplier
            imag = (imag - mo_ref[one, :]) * multiplier
            if masked:  # masked keys are zeroed: they must not enter the block's scale
                real, imag = jnp.where(keep, real, 0.0), jnp.where(keep, imag, 0.0)
            if steps_ref is None:
                amax = jnp.maximum(jnp.max(jnp.abs(real)), jnp.max(jnp.abs(imag)))
                step = jnp.where(amax > 0, amax * INV_127, 1.0)
            else:
                step = steps_ref[one]
            if interpret:
                rounded = [_round_half_even(v * (1.0 / step)) for v in (real, imag)]
            else:  # the reference's products rounded to integers, ties to even
                rounded = reciprocal_products([real, imag], step, round_to_integer=True)
            parts = [jnp.clip(v, -127, 127).astype(jnp.int8) for v in rounded]
            if natural_order:  # the pairs joined in registers: one contiguous store (not two strided ones)
                q_ref[:, one, :] = jnp.stack(parts, axis=-1).reshape(tile, 1, d)
            else:  # `_deinterleave`'s order: the halves
                for start, q in zip((0, half), parts):
                    q_ref[:, one, pl.ds(start, half)] = q.reshape(tile, 1, half)
            if steps_ref is None:
                scale_ref[one] = step.reshape(1)

    sums_kernel = functools.partial(_sums_kernel, group=group, tile=tile, eps=eps, with_v=v_src is not None,
                                    key_range=key_range)

    in_specs = [
        pl.no_block_spec,
        pl.BlockSpec((None, tile, group, d), lambda bi, si, hi: (bi, si, hi + first // group, 0)),
        pl.BlockSpec((None, tile, half), lambda bi, si, hi: (bi, si, 0)),
        pl.BlockSpec((None, tile, half), lambda bi, si, hi: (bi, si, 0)),
        pl.BlockSpec((half,), lambda bi, si, hi: (0,)),
        pl.BlockSpec((half,), lambda bi, si, hi: (0,)),
    ]
    common = dict(grid=(b, (s + pad) // tile, h // group), interpret=interpret,
                  compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=2))
    if block_sums:
        n_parts = (s + pad) // tile  # (key blocks, or their parts of `tile` tokens)
        out_specs = [pl.BlockSpec((None, None, group, d), lambda bi, si, hi: (bi, si, hi, 0))]
        out_shape = [jax.ShapeDtypeStruct((b, n_parts, h, d), jnp.float32)]
        inputs = [lengths, x, cos_half, sin_half, w_even, w_odd]
        if v_src is not None:
            in_specs.append(pl.BlockSpec((None, tile, group, d), lambda bi, si, hi: (bi, si, hi + v_first // group, 0)))
            inputs.append(v_src)
            out_specs.append(pl.BlockSpec((None, None, group, 3, d), lambda bi, si, hi: (bi, si, hi, 0, 0)))
            out_shape.append(jax.ShapeDtypeStruct((b, n_parts, h, 3, d), jnp.float32))
        if key_range:
            out_specs.append(pl.BlockSpec((None, None, group, 2, d), lambda bi, si, hi: (bi, si, hi, 0, 0)))
            out_shape.append(jax.ShapeDtypeStruct((b, n_parts, h, 2, d), jnp.float32))
        outs = pl.pallas_call(sums_kernel, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                              name="rms_rope_sums" if v_src is None else "rms_rope_sums_v_range", **common)(*inputs)
        return outs[0] if len(outs) == 1 else tuple(outs)
    vector_specs = [pl.BlockSpec((None, group, half), lambda bi, si, hi: (bi, hi, 0)),
                    pl.BlockSpec((None, group, half), lambda bi, si, hi: (bi, hi, 0))]
    q_spec = pl.BlockSpec((None, tile, group, d), lambda bi, si, hi: (bi, si, hi, 0))
    q_shape = jax.ShapeDtypeStruct((b, s + pad, h, d), jnp.int8)
    name = "rms_rope_int8_keys" if masked else "rms_rope_int8"
    if steps is not None:  # given steps: a program quantizes `tile` tokens of a block, no reduction over it
        per_block = block // tile
        qi = pl.pallas_call(
            kernel, in_specs=in_specs + vector_specs + [
                pl.BlockSpec((None, None, group), lambda bi, si, hi: (bi, si // per_block, hi))],
            out_specs=q_spec, out_shape=q_shape, name=name + "_given_steps", **common,
        )(lengths, x, cos_half, sin_half, w_even, w_odd, mean_even, mean_odd, steps)
        return qi[:, :s], steps
    qi, qs = pl.pallas_call(
        kernel,
        in_specs=in_specs + vector_specs,
        out_specs=[q_spec, pl.BlockSpec((None, None, group), lambda bi, si, hi: (bi, si, hi))],
        out_shape=[q_shape, jax.ShapeDtypeStruct((b, n_blocks, h), jnp.float32)],
        name=name,
        **common,
    )(lengths, x, cos_half, sin_half, w_even, w_odd, mean_even, mean_odd)
    return qi[:, :s], qs


