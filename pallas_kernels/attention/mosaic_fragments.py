"""Register- and shared-memory-level pieces of the Mosaic GPU attention kernel: the layouts wgmma's operands need,
regrouped without moving data between threads (Mosaic GPU has no ops for these; they are built on its
FragmentedArray internals, which jax 0.11.2, the pinned version, has), and the Q prologue a compute warpgroup runs
on its own rows."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

def _mosaic_transforms(itemsize: int, minor: int):
    """Shared-memory tiling and swizzle for a tile whose minor dimension has `minor` elements: wgmma and TMA need
    tiles of 8 rows times one swizzle span."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    swizzle = plgpu.find_swizzle(minor * itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


_MAGIC = 0x4B400000  # the bits of 1.5 * 2^23: a float32 whose last mantissa bits count integers
_MAGIC_FLOAT = 12582912.0  # 1.5 * 2^23


def _int32_to_biased_float32(x: jax.Array) -> jax.Array:
    """x + 1.5 * 2^23 as float32, exactly, for |x| < 2^22, with one integer add: the conversion instruction runs at
    the rate of exp2 on Hopper (16 a clock per SM), and the softmax is what bounds the kernel; the bias is removed
    by the caller's own arithmetic. An INT8 product over head_dim <= 256 stays below 256 * 127^2 < 2^22."""
    return jax.lax.bitcast_convert_type(x + _MAGIC, jnp.float32)


def _pv_key_order(keys: int) -> np.ndarray:
    """The key order in which FP8 P's registers, read as wgmma's 8-bit A operand, multiply V (`_p_as_8bit_operand`).
    In the float32 accumulator's layout (WGMMA) the thread of lane c (mod 4) holds columns 2c, 2c + 1, 8 + 2c and
    9 + 2c of every 16; the 8-bit operand layout (WGMMA_8BIT) places a thread's four bytes at columns 4c .. 4c + 3.
    Regrouping the registers without moving data therefore permutes P's keys within each 16, and V^T's keys are
    permuted the same way (`v_fp8_operand`; the sum over keys does not depend on their order)."""
    c = np.arange(4)
    group = np.stack([2 * c, 2 * c + 1, 8 + 2 * c, 9 + 2 * c], axis=1).reshape(16)  # position 4c + i <- key
    return (np.arange(0, keys, 16)[:, None] + group[None]).reshape(keys)


def _p_as_8bit_operand(p: jax.Array) -> jax.Array:
    """FP8 P (64, keys) in the accumulator's layout as wgmma's register A operand, WGMMA_8BIT, with no data moved:
    each 8-bit register vector is the two 2-byte vectors of neighbouring 8-column tiles; the columns' new order is
    `_pv_key_order`'s (FA3 shuffles bytes between threads instead; permuting V costs nothing here). Built on Mosaic
    GPU's FragmentedArray internals (`_registers`, jax 0.11.2, which the project pins)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,),
                       return_type=plgpu.ShapeDtypeStruct(p.shape, p.dtype, layout=plgpu.Layout.WGMMA_8BIT))
    def regroup(_, x):
        registers = np.empty(fa.WGMMA_LAYOUT_8BIT.registers_shape(x.shape), dtype=object)
        for index in np.ndindex(registers.shape):
            pair = [x.registers[(index[0], 2 * index[1] + k, *index[2:])] for k in range(2)]
            registers[index] = mgpu_utils.vector_concat(pair)
        return fa.FragmentedArray(_registers=registers, _layout=fa.WGMMA_LAYOUT_8BIT, _is_signed=None)

    return regroup(p)


@dataclasses.dataclass(frozen=True)
class MosaicQPrologue:
    """What the Mosaic kernel needs to make INT8 Q itself from the raw projection (`_int8_attention_mosaic`'s
    `q_prologue`): the RMSNorm weight (head_dim,) (zero-centred: `1 + weight` scales), its eps, the rotary tables
    cos, sin ((seq, head_dim) or (batch, seq, head_dim), each frequency repeated for its pair, as
    `rms_rope_reference` takes them), the softmax scale and the number of query heads (the first heads of Q's
    source)."""

    norm_weight: jax.Array
    eps: float
    cos: jax.Array
    sin: jax.Array
    scale: float
    num_heads: int

    def tables(self, b: int, s: int) -> tuple[jax.Array, jax.Array]:
        """cos and sin, one value a pair, float32 (1 or batch, seq, head_dim / 2), in `_pair_table_order` (what a
        thread of the WGMMA layout needs of them, `_pairs_from_table`)."""
        d = self.cos.shape[-1]
        cos, sin = (jnp.asarray(t, jnp.float32).reshape(-1, s, d) for t in (self.cos, self.sin))
        if cos.shape[0] not in (1, b):
            raise ValueError(f"rotary tables {self.cos.shape}: not (seq, {d}) or ({b}, {s}, {d})")
        return tuple(_pair_table_order(t[..., 0::2]) for t in (cos, sin))

    def weight(self) -> jax.Array:
        return 1.0 + self.norm_weight.astype(jnp.float32)


def _pair_table_order(half: jax.Array, inverse: bool = False) -> jax.Array:
    """A table of one value a channel pair (..., pairs) reordered so that, read as a (rows, pairs) array in the
    WGMMA layout, each thread's register vector at column tile t holds the values of its pairs in the tiles 2t and
    2t + 1 of the full (rows, 2 * pairs) array: position 8t + 2c + e <- pair 4 (2t + e) + c (lane c of 4). Half the
    bytes of a full table, and no data moved between threads to widen it (`_pairs_from_table`). `inverse`: back."""
    *lead, n = half.shape
    groups = half.reshape(*lead, n // 8, *((4, 2) if inverse else (2, 4)))
    return jnp.swapaxes(groups, -1, -2).reshape(half.shape)


def _pairs_from_table(table: jax.Array, interpret: bool) -> jax.Array:
    """(rows, pairs) in `_pair_table_order`, WGMMA layout -> (rows, 2 * pairs) with each pair's value at both its
    channels: register vector (t, e) of the table, split in its two values, is the full array's tiles 2t + e."""
    if interpret:
        return jnp.repeat(_pair_table_order(table, inverse=True), 2, axis=1)
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    rows, pairs = table.shape

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,),
                       return_type=plgpu.ShapeDtypeStruct((rows, 2 * pairs), table.dtype, layout=plgpu.Layout.WGMMA))
    def widen(_, x):
        shape = fa.WGMMA_LAYOUT.registers_shape((rows, 2 * pairs))
        registers = np.empty(shape, dtype=object)
        for index in np.ndindex(shape):  # index[1]: the column tile of 8
            value = mgpu_utils.vector_slice(x.registers[(index[0], index[1] // 2, *index[2:])],
                                            slice(index[1] % 2, index[1] % 2 + 1))
            registers[index] = mgpu_utils.vector_concat([value, value])
        return fa.FragmentedArray(_registers=registers, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

    return widen(table)


def _rotate_pairs(x: jax.Array, interpret: bool) -> jax.Array:
    """x (rows, dim) float32 in the WGMMA layout with each channel pair (a, b) made (-b, a), the rotary
    embedding's quarter turn (`rms_rope_reference`'s `rotated`): the layout's register vectors are pairs of
    neighbouring columns, so no data moves between threads (Mosaic GPU has no op for this; built on
    FragmentedArray's internals as `_p_as_8bit_operand`). The interpreter, which has no registers, uses a reshape."""
    if interpret:
        r, d = x.shape
        pairs = x.reshape(r, d // 2, 2)
        return jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(r, d)
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax._src.lib.mlir.dialects import arith
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,),
                       return_type=plgpu.ShapeDtypeStruct(x.shape, x.dtype, layout=plgpu.Layout.WGMMA))
    def rotate(_, y):
        registers = np.empty(y.registers.shape, dtype=object)
        for index in np.ndindex(registers.shape):
            pair = y.registers[index]
            registers[index] = mgpu_utils.vector_concat([arith.negf(mgpu_utils.vector_slice(pair, slice(1, 2))),
                                                         mgpu_utils.vector_slice(pair, slice(0, 1))])
        return fa.FragmentedArray(_registers=registers, _layout=y.layout, _is_signed=None)

    return rotate(x)


def _mosaic_q_prologue(raw_ref, q_ref, cos_ref, sin_ref, w_ref, prologue: MosaicQPrologue,
                       interpret: bool, before_store=None) -> jax.Array:
    """One compute warpgroup's Q tile in the Mosaic kernel: the raw rows (`raw_ref`), normed (weight `w_ref`),
    rotated (tables `cos_ref`, `sin_ref` in `_pair_table_order`) and quantized to INT8 per row into `q_ref` (for
    wgmma); all in shared memory, arrived by TMA. Returns the rows' scales (rows,), the softmax scale in them, in the
    layout of the logits' row reductions. The arithmetic is `rms_rope_reference`'s, then `_quantize_int8_blocks`'
    with one row a block (up to rounding). The tables arrive by TMA with the tile: read from global memory by each
    thread they would cost as much as the Q prologue's pass this replaces.
    `before_store()`: runs before the INT8 values are stored (q_ref may share memory with what was read)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax import lax

    layout = plgpu.Layout.WGMMA
    x = plgpu.load(raw_ref, layout=layout).astype(jnp.float32)
    d = x.shape[1]
    inv = lax.rsqrt((x * x).sum(axis=1) / d + prologue.eps)
    w = plgpu.load(w_ref, layout=layout.reduce(0), optimized=False)
    y = x * lax.broadcast_in_dim(inv, x.shape, [0]) * lax.broadcast_in_dim(w, x.shape, [1])
    cos = _pairs_from_table(plgpu.load(cos_ref, layout=layout), interpret)
    sin = _pairs_from_table(plgpu.load(sin_ref, layout=layout), interpret)
    y = y * cos + _rotate_pairs(y, interpret) * sin
    # The softmax scale goes into the row's scale, not into each value; and a multiply by the reciprocal, not a
    # division (a division a value is a visible share of the kernel's time): the codes may differ from the
    # reference's y * scale / step where a value lies within an ulp of a rounding tie.
    amax = jnp.abs(y).max(axis=1)
    positive = amax > 0
    inverse = jnp.where(positive, 127.0 / amax, 1.0)
    q = jnp.clip(jnp.round(y * lax.broadcast_in_dim(inverse, y.shape, [0])), -127.0, 127.0).astype(jnp.int8)
    if before_store is not None:
        before_store()
    q_ref[...] = q
    plgpu.commit_smem()  # visible to wgmma's (async proxy) reads
    return jnp.where(positive, amax * (prologue.scale / 127.0), 1.0)


def compute_registers(compute_wgs: int, memory_registers: int = 40) -> int:
    """The registers a thread of each compute warpgroup can take with `setmaxnreg` when the memory warpgroup keeps
    `memory_registers`: the SM has 65536, and the count must be a multiple of 8. Asking for more does not fail; the
    warpgroup waits forever for registers that never free up (240 for two warpgroups hangs: 2 x 128 x 240 +
    128 x 40 = 66560)."""
    per_thread = (65536 - 128 * memory_registers) // (128 * compute_wgs)
    return min(per_thread - per_thread % 8, 256)


