"""INT8-QK attention for Hopper in Pallas Mosaic GPU: FA3's structure (TMA, wgmma, warp specialization) with an
INT8 Q.K^T. Laid out as jax's `attention_mgpu.py` is: the plan (shapes, options and their checks), the compute
warpgroups (Q.K^T, online softmax, P.V), the memory warpgroup (the K/V ring), the epilogue, and the entry point
that allocates shared memory and launches the kernel."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from .config import MOSAIC_ROWS, AttentionConfig, default_config
from .mosaic_fragments import (_MAGIC_FLOAT, MosaicQPrologue, _int32_to_biased_float32, _mosaic_q_prologue,
                               _mosaic_transforms, _p_as_8bit_operand, compute_registers)
from .reference import _check_pv_accumulation, _key_lengths, _masked_values, _v_fp8_scale_and_mean_of_range
from .triton import v_fp8_operand

SUM_COLS = 8  # wgmma's narrowest N: the row sums' (keys, 8) ones operand


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything the kernel's pieces decide from the shapes, the config and the options, checked once."""

    b: int
    sq: int
    h: int
    d: int
    hk: int
    block_k: int
    wgs: int  # compute warpgroups a CTA
    turns: str  # "pairs" (two warpgroups) or "ring"
    stages: int  # K/V ring slots
    n_q: int  # CTAs along the queries
    pad_q: int
    pad_k: int
    pv: str
    p_in_smem: bool  # P through shared memory (the interpreter's wgmma reads A from there only)
    fresh: bool  # a key block's P.V in a fresh accumulator (two-level, or P from shared memory)
    row_sums_by_wgmma: bool  # FP8 P.V in place: the softmax's row sums by a second wgmma
    smooth_v: bool  # FP8 P.V: V's channel means out before the rounding, back in the epilogue
    tail_masked: bool  # some key of the last block is masked
    q_in_kernel: bool  # Q made from the raw projection in the kernel (`MosaicQPrologue`)
    out_dtype: jnp.dtype
    interpret: bool
    config: AttentionConfig

    @property
    def p_dtype(self):
        return jnp.float8_e4m3fn if self.pv == "fp8" else jnp.bfloat16

    @property
    def v_block(self) -> tuple[int, int]:
        """A ring slot's V tile: V^T (dim, keys) for FP8 P.V (8-bit B must be K-major), else (keys, dim)."""
        return (self.d, self.block_k) if self.pv == "fp8" else (self.block_k, self.d)


def _plan(qi, qs, ki, kv_lengths, *, pv, config, p_in_smem, interpret, out_dtype, q_prologue) -> _Plan:
    b, sq, h, d = qi.shape
    if q_prologue is not None:
        h = q_prologue.num_heads
    sk, hk = ki.shape[1], ki.shape[2]
    rows, block_k, wgs = MOSAIC_ROWS, config.block_k, config.compute_wgs
    if wgs not in (2, 3):
        raise ValueError(f"mosaic attention: compute_wgs must be 2 or 3, got {wgs}")
    turns = config.turns or ("pairs" if wgs == 2 else "ring")
    if turns not in ("pairs", "ring") or (turns == "pairs" and wgs != 2):
        raise ValueError(f"mosaic attention: turns={turns!r} with {wgs} compute warpgroups ('pairs' takes two)")
    if d % 64 or d > 256 or block_k % 64 or block_k > 256:
        raise ValueError(f"mosaic attention: head_dim {d} and block_k {block_k} must be multiples of 64, at most 256")
    if config.block_q != rows:
        raise ValueError(f"the mosaic backend quantizes Q per {rows} rows (one warpgroup): block_q must be {rows}, "
                         f"got {config.block_q}")
    if q_prologue is None and qs.shape[1] != -(-sq // rows):
        raise ValueError(f"mosaic attention: Q must be quantized per {rows} rows")
    if q_prologue is not None and jnp.dtype(qi.dtype) != jnp.dtype(out_dtype):
        raise ValueError(f"mosaic attention making Q itself: raw Q ({jnp.dtype(qi.dtype).name}) must have the "
                         f"output's dtype ({jnp.dtype(out_dtype).name}): its tiles use the output tiles' memory")
    p_in_smem = interpret if p_in_smem is None else p_in_smem
    if interpret and not p_in_smem:
        raise ValueError("the Mosaic GPU interpreter's wgmma reads A from shared memory only: p_in_smem=True")
    accumulation = config.pv_accumulation
    _check_pv_accumulation(pv, accumulation)
    if accumulation == "in_place" and p_in_smem:
        raise ValueError("pv_accumulation='in_place' takes P from registers (the interpreter, which needs P in shared "
                         "memory, cannot run wgmma into a carried accumulator)")
    in_place_fp8 = pv == "fp8" and accumulation == "in_place"
    pad_q, pad_k = (-sq) % (wgs * rows), (-sk) % block_k
    return _Plan(b=b, sq=sq, h=h, d=d, hk=hk, block_k=block_k, wgs=wgs, turns=turns,
                 stages=max(1, min(config.num_stages, (sk + pad_k) // block_k)), n_q=(sq + pad_q) // (wgs * rows),
                 pad_q=pad_q, pad_k=pad_k, pv=pv, p_in_smem=p_in_smem,
                 fresh=p_in_smem or (pv == "fp8" and accumulation == "two_level"),
                 # in place, the FP8 wgmma's accumulator (~14 bits, truncating) would sum a long positive series low
                 row_sums_by_wgmma=in_place_fp8, smooth_v=pv == "fp8",
                 tail_masked=kv_lengths is not None or pad_k > 0, q_in_kernel=q_prologue is not None,
                 out_dtype=jnp.dtype(out_dtype), interpret=interpret, config=config)


@dataclasses.dataclass(frozen=True)
class _Refs:
    """A CTA's view of the kernel's memory: global inputs and output, shared-memory tiles, barriers."""

    q_gmem: object
    qs_gmem: object
    k_gmem: object
    ks_gmem: object
    v_gmem: object
    vs_gmem: object
    len_gmem: object
    tables: tuple  # the Q prologue's (cos, sin, norm weight) in global memory, or ()
    ones_gmem: object  # the row sums' ones operand, or None
    o_gmem: object
    q_smem: object
    table_smem: tuple | None
    k_smem: object
    v_smem: object
    p_smem: object
    o_smem: object
    q_full: object
    k_full: object
    v_full: object
    k_free: object
    v_free: object
    turn: object
    table_full: tuple | None
    tables_read: object
    ones_smem: object
    ones_full: object


class _Turns:
    """How the compute warpgroups share the tensor cores. "pairs" (two; FA3's ping-pong): a two-party barrier after
    each Q.K^T issue and before each P.V makes one warpgroup's softmax run while the other's matrix products do.
    "ring": a warpgroup issues its block's P.V and the next block's Q.K^T only after the one before it in the ring
    issued its own, then passes the turn on."""

    def __init__(self, plan: _Plan, turn, wg):
        self.plan, self.turn, self.wg = plan, turn, wg

    def wait(self):
        import jax.experimental.pallas.mosaic_gpu as plgpu

        plgpu.barrier_wait(self.turn.at[self.wg] if self.plan.turns == "ring" else self.turn)

    def pass_on(self):
        import jax.experimental.pallas.mosaic_gpu as plgpu

        if self.plan.turns == "ring":
            plgpu.barrier_arrive(self.turn.at[jax.lax.rem(self.wg + 1, self.plan.wgs)])
        else:
            plgpu.barrier_arrive(self.turn)

    def schedule_barrier(self):  # "pairs"
        self.pass_on()
        self.wait()


def _load_q(plan: _Plan, refs: _Refs, q_prologue, batch, head, wg, row0):
    """The warpgroup's Q tile into shared memory (INT8, or raw and then made INT8 by `_mosaic_q_prologue`).
    Returns Q's scale, times log2(e) (the softmax runs in base 2): a scalar, or (rows,) per row."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    rows, log2e = MOSAIC_ROWS, math.log2(math.e)
    if not plan.q_in_kernel:
        plgpu.copy_gmem_to_smem(refs.q_gmem.at[batch, pl.ds(row0, rows), head], refs.q_smem.at[wg], refs.q_full.at[wg])
        q_scale = refs.qs_gmem[batch, head, jax.lax.axis_index("q_seq") * plan.wgs + wg] * log2e
        plgpu.barrier_wait(refs.q_full.at[wg])
        return q_scale
    # raw Q's tiles arrive in the output tiles' buffer (Q is read before the key loop, the output written after it):
    # a buffer of their own would leave bf16 P.V with the tables too little shared memory
    q_raw_smem = refs.o_smem
    plgpu.copy_gmem_to_smem(refs.q_gmem.at[batch, pl.ds(row0, rows), head], q_raw_smem.at[wg], refs.q_full.at[wg])
    cos_gmem, sin_gmem, w_gmem = refs.tables
    tb = batch if cos_gmem.shape[0] > 1 else 0  # the tables' batch
    sources = (cos_gmem.at[tb, pl.ds(row0, rows)], sin_gmem.at[tb, pl.ds(row0, rows)], w_gmem.at[wg])
    for src, dst, full in zip(sources, refs.table_smem, refs.table_full):
        plgpu.copy_gmem_to_smem(src, dst.at[wg], full.at[wg])
    for full in (refs.q_full, *refs.table_full):
        plgpu.barrier_wait(full.at[wg])

    def all_tables_read():  # by every compute warpgroup: INT8 Q is written over them
        plgpu.commit_smem()  # (a warpgroup barrier: its threads' loads are done)
        plgpu.barrier_arrive(refs.tables_read)
        plgpu.barrier_wait(refs.tables_read)

    return _mosaic_q_prologue(q_raw_smem.at[wg], refs.q_smem.at[wg], *(ref.at[wg] for ref in refs.table_smem),
                              q_prologue, plan.interpret, before_store=all_tables_read) * log2e


def _softmax(plan: _Plan, s, j, q_scale, k_scale, m, l, length, masked):
    """Key block j's int32 logits -> (P in the P.V dtype, running max, running sum, rescale factor)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax import lax

    rows, layout = MOSAIC_ROWS, plgpu.Layout.WGMMA
    log2_p_max = math.log2(448.0) if plan.pv == "fp8" else 0.0  # P's fixed FP8 scale, applied in the exponent
    # The bias leaves through the exponent's multiply-add below: no subtraction a logit.
    s = _int32_to_biased_float32(s)
    if masked:
        cols = plgpu.broadcasted_iota(jnp.int32, (rows, plan.block_k), 1, layout=layout)
        s = jnp.where(cols < length - j * plan.block_k, s, -jnp.inf)
    # The block's dequantization scale (> 0) folds into the exponent's multiply-add.
    c = q_scale * k_scale  # a scalar, or (rows,) with Q's scales per row
    m_new = jnp.maximum(m, (s.max(axis=1) - _MAGIC_FLOAT) * c)
    alpha = jnp.exp2(m - m_new)
    # exp2(logit - m_new) * p_max as exp2(s * c - (m_new + bias * c - log2(p_max))): FP8's fixed scale 448 is in the
    # exponent too, so no multiply either; l sums P so scaled, and acc / l cancels it. Rounding the per-row term
    # moves a block's exponent by at most one integer logit unit (c).
    shift = lax.broadcast_in_dim(m_new + (_MAGIC_FLOAT * c - log2_p_max), s.shape, [0])
    p = jnp.exp2(s * (lax.broadcast_in_dim(c, s.shape, [0]) if plan.q_in_kernel else c) - shift)
    if plan.row_sums_by_wgmma:  # rescaled here; the block's sums come from the P.V wgmma
        l = l * lax.broadcast_in_dim(alpha, l.shape, [0])
    else:
        l = l * alpha + p.sum(axis=1)
    return p.astype(plan.p_dtype), m_new, l, alpha


def _key_step(plan: _Plan, refs: _Refs, turns: _Turns, ids, q_scale, j, carry, masked):
    """One key block of a compute warpgroup: Q.K^T, the softmax, P.V, with the turns and the ring's barriers."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax import lax

    rows, d, layout = MOSAIC_ROWS, plan.d, plgpu.Layout.WGMMA
    batch, kv_head, wg, length, steps = ids
    acc, m, l = carry
    slot = lax.rem(j, plan.stages)
    # loaded before the Q.K^T is issued, so that the load's latency passes while the wgmma runs
    k_scale = refs.ks_gmem[batch, kv_head, j]

    def qk(acc_ref):
        plgpu.wgmma(acc_ref, refs.q_smem.at[wg], refs.k_smem.at[slot].transpose((1, 0)))
        if plan.turns == "pairs":  # and wait until the other warpgroup's softmax is done
            turns.schedule_barrier()
        else:
            turns.pass_on()
        return acc_ref[...]

    s = pl.run_scoped(qk, plgpu.ACC((rows, plan.block_k), jnp.int32))
    plgpu.barrier_arrive(refs.k_free.at[slot])
    p, m, l, alpha = _softmax(plan, s, j, q_scale, k_scale, m, l, length, masked)
    if plan.pv == "fp8" and not plan.p_in_smem:
        p = _p_as_8bit_operand(p)
    if not plan.fresh:  # rescaled while the other warpgroup's matrix products run, then accumulated into
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    if plan.p_in_smem:
        refs.p_smem.at[wg][...] = p
        plgpu.commit_smem()  # visible to wgmma's (async proxy) reads
        acc, l, m, alpha = lax.optimization_barrier((acc, l, m, alpha))
    else:  # the softmax completes before the barriers below (FA3's ordering)
        acc, l, m, alpha, p = lax.optimization_barrier((acc, l, m, alpha, p))
    if plan.turns == "pairs":
        turns.pass_on()  # softmax done
    plgpu.barrier_wait(refs.v_full.at[slot])
    turns.wait()  # the warpgroup before this one issued its matrix products

    def wait_next_k():
        @pl.when(j + 1 < steps)
        def _():
            plgpu.barrier_wait(refs.k_full.at[lax.rem(j + 1, plan.stages)])

    v_op = refs.v_smem.at[slot].transpose((1, 0)) if plan.pv == "fp8" else refs.v_smem.at[slot]
    p_op = refs.p_smem.at[wg] if plan.p_in_smem else p
    if plan.fresh:  # the block's product in a fresh accumulator; the rescale and the add are one FMA
        def pv_fresh(acc_ref):
            plgpu.wgmma(acc_ref, p_op, v_op)
            wait_next_k()
            return acc_ref[...]

        block = pl.run_scoped(pv_fresh, plgpu.ACC((rows, d), jnp.float32))
        acc = block + acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    elif plan.row_sums_by_wgmma:
        def pv_and_sums(refs_):
            acc_ref, l_ref = refs_
            plgpu.wgmma(acc_ref, p_op, v_op)
            plgpu.wgmma(l_ref, p_op, refs.ones_smem.at[wg].transpose((1, 0)))
            wait_next_k()

        # the block's sums in a fresh accumulator (in place they come out low), then float32 adds
        fresh_l = plgpu.layout_cast(jnp.zeros((rows, SUM_COLS), jnp.float32), layout)
        acc, l_block = pl.run_state(pv_and_sums)((plgpu.ACC.init(acc), plgpu.ACC.init(fresh_l)))
        l = l + l_block
    else:
        def pv_in_place(acc_ref):
            plgpu.wgmma(acc_ref, p_op, v_op)
            wait_next_k()

        acc = pl.run_state(pv_in_place)(plgpu.ACC.init(acc))
    plgpu.barrier_arrive(refs.v_free.at[slot])
    return acc, m, l


def _epilogue(plan: _Plan, refs: _Refs, acc, l, batch, kv_head, head, wg, row0):
    """acc / l, V's channel scales and means (FP8 P.V; P's 448 cancels in acc / l), out through shared memory."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax import lax

    layout = plgpu.Layout.WGMMA
    if plan.row_sums_by_wgmma:
        l = l.sum(axis=1)  # the ones column's; the other seven are zero
    out = acc * lax.broadcast_in_dim(1.0 / l, acc.shape, [0])
    if plan.pv == "fp8":  # once a tile: a plain load is enough
        v_scale = plgpu.load(refs.vs_gmem.at[batch, kv_head, 0], layout=layout.reduce(0), optimized=False)
        out = out * lax.broadcast_in_dim(v_scale, acc.shape, [1])
        if plan.smooth_v:
            v_mean = plgpu.load(refs.vs_gmem.at[batch, kv_head, 1], layout=layout.reduce(0), optimized=False)
            out = out + lax.broadcast_in_dim(v_mean, acc.shape, [1])
    refs.o_smem.at[wg][...] = out.astype(plan.out_dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(refs.o_smem.at[wg], refs.o_gmem.at[batch, pl.ds(row0, MOSAIC_ROWS), head])
    plgpu.wait_smem_to_gmem(0)


def _compute_warpgroup(plan: _Plan, refs: _Refs, q_prologue, ids, head, wg):
    """One compute warpgroup: its 64 query rows against every key block that holds valid keys."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax import lax

    rows, layout = MOSAIC_ROWS, plgpu.Layout.WGMMA
    batch, kv_head, _, length, steps = ids
    plgpu.set_max_registers(compute_registers(plan.wgs, plan.config.memory_registers()), action="increase")
    row0 = lax.axis_index("q_seq") * (plan.wgs * rows) + wg * rows
    turns = _Turns(plan, refs.turn, wg)
    q_scale = _load_q(plan, refs, q_prologue, batch, head, wg, row0)
    m = plgpu.layout_cast(jnp.full((rows,), -jnp.inf, jnp.float32), layout.reduce(1))
    if plan.row_sums_by_wgmma:  # the ones operand, a copy a warpgroup; l is a (rows, 8) accumulator
        plgpu.copy_gmem_to_smem(refs.ones_gmem, refs.ones_smem.at[wg], refs.ones_full.at[wg])
        plgpu.barrier_wait(refs.ones_full.at[wg])
        l = plgpu.layout_cast(jnp.zeros((rows, SUM_COLS), jnp.float32), layout)
    else:
        l = plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), layout.reduce(1))
    acc = plgpu.layout_cast(jnp.zeros((rows, plan.d), jnp.float32), layout)

    @pl.when(steps > 0)
    def _():
        plgpu.barrier_wait(refs.k_full.at[0])

    if plan.turns == "pairs":
        pl.when(wg == 1)(turns.schedule_barrier)
    else:
        pl.when(wg > 0)(turns.wait)  # the first Q.K^T: warpgroup 0 starts with the turn

    step = functools.partial(_key_step, plan, refs, turns, ids, q_scale)
    carry = (acc, m, l)
    if plan.tail_masked:  # the mask is needed on the last block only
        last = jnp.maximum(steps - 1, 0)
        carry = lax.fori_loop(0, last, functools.partial(step, masked=False), carry)
        carry = lax.fori_loop(last, steps, functools.partial(step, masked=True), carry)
    else:
        carry = lax.fori_loop(0, steps, functools.partial(step, masked=False), carry)
    acc, _, l = carry
    if plan.turns == "pairs":
        pl.when(wg == 0)(turns.schedule_barrier)
    else:  # after the last P.V; warpgroup 0 takes the turn that comes back (every pass waited)
        turns.pass_on()
        pl.when(wg == 0)(turns.wait)
    _epilogue(plan, refs, acc, l, batch, kv_head, head, wg, row0)


def _memory_warpgroup(plan: _Plan, refs: _Refs, batch, kv_head, steps):
    """Streams K and V blocks by TMA into the ring: a "full" barrier per slot for the copies, a "free" one per slot
    that every compute warpgroup arrives at."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax import lax

    block_k, stages = plan.block_k, plan.stages
    plgpu.set_max_registers(plan.config.memory_registers(), action="decrease")

    def k_slice(j):
        return refs.k_gmem.at[batch, pl.ds(j * block_k, block_k), kv_head]

    def v_slice(j):
        if plan.pv == "fp8":
            return refs.v_gmem.at[batch, kv_head, :, pl.ds(j * block_k, block_k)]
        return refs.v_gmem.at[batch, pl.ds(j * block_k, block_k), kv_head]

    def load(j, slot):
        plgpu.copy_gmem_to_smem(k_slice(j), refs.k_smem.at[slot], refs.k_full.at[slot])
        plgpu.copy_gmem_to_smem(v_slice(j), refs.v_smem.at[slot], refs.v_full.at[slot])

    for i in range(stages):
        pl.when(i < steps)(functools.partial(load, i, i))

    @pl.loop(0, steps - stages)
    def _(j):
        slot = lax.rem(j, stages)
        plgpu.barrier_wait(refs.k_free.at[slot])
        plgpu.copy_gmem_to_smem(k_slice(j + stages), refs.k_smem.at[slot], refs.k_full.at[slot])
        plgpu.barrier_wait(refs.v_free.at[slot])
        plgpu.copy_gmem_to_smem(v_slice(j + stages), refs.v_smem.at[slot], refs.v_full.at[slot])

    # The last use of each slot is released too before the barriers go (the interpreter checks that every waiter saw
    # every phase; on the GPU this only waits for the compute warpgroups' last steps).
    for i in range(stages):
        @pl.when(i < steps)
        def _():
            plgpu.barrier_wait(refs.k_free.at[i])
            plgpu.barrier_wait(refs.v_free.at[i])


def _shared_memory(plan: _Plan):
    """The kernel's scoped allocations: tiles, then barriers (what `_kernel` unpacks)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    rows, d, wgs, block_k, stages = MOSAIC_ROWS, plan.d, plan.wgs, plan.block_k, plan.stages
    int8_transforms = _mosaic_transforms(1, d)
    q_alloc = plgpu.SMEM((wgs, rows, d), jnp.int8, transforms=int8_transforms)
    if not plan.q_in_kernel:
        tables_scoped = (None, None, None)
    else:
        # cos, sin (one value a pair, `_pair_table_order`) and the norm's weight, a slot each warpgroup. INT8 Q takes
        # the tables' memory once every warpgroup has read its own (`tables_read`): with three compute warpgroups
        # their own memory would not fit (244944 > 232448 bytes at head_dim 128).
        half_transforms = _mosaic_transforms(4, d // 2)
        q_alloc = plgpu.RefUnion((plgpu.SMEM((wgs, rows, d // 2), jnp.float32, transforms=half_transforms),
                                  plgpu.SMEM((wgs, rows, d // 2), jnp.float32, transforms=half_transforms)), q_alloc)
        tables_scoped = (plgpu.SMEM((wgs, d), jnp.float32), (plgpu.Barrier(num_barriers=wgs),) * 3,
                         plgpu.Barrier(num_arrivals=wgs))
    p_dtype, out_dtype = plan.p_dtype, plan.out_dtype
    tiles = [
        q_alloc,
        plgpu.SMEM((stages, block_k, d), jnp.int8, transforms=int8_transforms),
        plgpu.SMEM((stages, *plan.v_block), p_dtype,
                   transforms=_mosaic_transforms(1, block_k) if plan.pv == "fp8" else _mosaic_transforms(2, d)),
        plgpu.SMEM((wgs, rows, block_k), p_dtype,
                   transforms=_mosaic_transforms(jnp.dtype(p_dtype).itemsize, block_k)) if plan.p_in_smem else None,
        plgpu.SMEM((wgs, rows, d), out_dtype, transforms=_mosaic_transforms(out_dtype.itemsize, d)),
    ]
    return (
        tiles,
        (plgpu.Barrier(num_barriers=wgs), plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages)),
        (plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),) * 2,
        plgpu.Barrier(num_arrivals=2) if plan.turns == "pairs" else plgpu.Barrier(num_barriers=wgs),  # the turns
        *tables_scoped,
        plgpu.SMEM((wgs, SUM_COLS, block_k), jnp.float8_e4m3fn, transforms=_mosaic_transforms(1, block_k))
        if plan.row_sums_by_wgmma else None,
        plgpu.Barrier(num_barriers=wgs) if plan.row_sums_by_wgmma else None,
    )


def _kernel(plan: _Plan, q_prologue, gmem, scoped):
    """A CTA: (heads, blocks of 64 x wgs query rows, batch); `wgs` compute warpgroups and one memory warpgroup."""
    import jax.experimental.pallas as pl
    from jax import lax

    (q_alloc, k_smem, v_smem, p_smem, o_smem), (q_full, k_full, v_full), (k_free, v_free), turn, \
        w_smem, table_full, tables_read, ones_smem, ones_full = scoped
    if plan.q_in_kernel:  # INT8 Q shares the tables' memory (see `_shared_memory`)
        (cos_smem, sin_smem), q_smem = q_alloc
        table_smem = (cos_smem, sin_smem, w_smem)
    else:
        q_smem, table_smem = q_alloc, None
    refs = _Refs(*gmem, q_smem=q_smem, table_smem=table_smem, k_smem=k_smem, v_smem=v_smem, p_smem=p_smem,
                 o_smem=o_smem, q_full=q_full, k_full=k_full, v_full=v_full, k_free=k_free, v_free=v_free, turn=turn,
                 table_full=table_full, tables_read=tables_read, ones_smem=ones_smem, ones_full=ones_full)
    head, batch, wg = lax.axis_index("heads"), lax.axis_index("batch"), lax.axis_index("wg")
    kv_head = head // (plan.h // plan.hk)
    length = refs.len_gmem[batch]
    steps = (length + plan.block_k - 1) // plan.block_k  # only the key blocks holding valid keys
    ids = (batch, kv_head, wg, length, steps)
    pl.when(wg < plan.wgs)(lambda: _compute_warpgroup(plan, refs, q_prologue, ids, head, wg))
    pl.when(wg == plan.wgs)(lambda: _memory_warpgroup(plan, refs, batch, kv_head, steps))


def _v_operand(plan: _Plan, v, kv_lengths, lengths, v_range, v_heads):
    """V as the kernel reads it, and its channel scales and means (batch, kv_heads, 2, dim). FP8: V^T (batch,
    kv_heads, dim, keys) in E4M3, keys in `pv_key_order` where P comes from registers (`_p_as_8bit_operand`).
    bf16: V masked and padded (batch, keys, kv_heads, dim); its scales are not read."""
    if plan.pv == "fp8":
        scale_and_mean = None if v_range is None else _v_fp8_scale_and_mean_of_range(*v_range, lengths, plan.smooth_v)
        vt, scale, mean = v_fp8_operand(v, plan.block_k, permute_keys=not plan.p_in_smem, kv_lengths=kv_lengths,
                                        interpret=plan.interpret, smooth=plan.smooth_v, scale_and_mean=scale_and_mean,
                                        heads=v_heads)
        return vt, jnp.stack([scale, mean], axis=2)
    if v_heads is not None:
        v = v[:, :, v_heads[0]:v_heads[0] + v_heads[1]]
    return (jnp.pad(_masked_values(v, kv_lengths, jnp.bfloat16), ((0, 0), (0, plan.pad_k), (0, 0), (0, 0))),
            jnp.ones((plan.b, plan.hk, 2, plan.d), jnp.float32))


def mosaic_attention(qi, qs, ki, ks, v, kv_lengths, *, pv: str, config: AttentionConfig | None = None,
                     interpret: bool = False, out_dtype=jnp.float32, q_prologue: MosaicQPrologue | None = None,
                     v_range: tuple | None = None, v_heads: tuple[int, int] | None = None,
                     p_in_smem: bool | None = None, lower_only: bool = False):
    """The Mosaic GPU kernel on quantized Q (per 64 rows) and K (per `block_k` keys), (batch, seq, heads, dim) int8
    with scales (batch, seq blocks, heads), and V (batch, kv_len, kv_heads, dim) in a float dtype (the keys past
    `kv_lengths` are zeroed here). Returns `out_dtype` (batch, q_len, heads, dim).

    Each compute warpgroup: S = wgmma(Q int8 from shared memory, K block^T) with int32 accumulation (8-bit wgmma
    wants both operands K-major: Q (rows, dim) and K (keys, dim) already are), times q_scale * k_scale in float32,
    the key mask on the last block only, online softmax in base 2, then P.V. P.V "bf16": P from registers, V (keys,
    dim) from shared memory, into the running accumulator. "fp8": V's channel means subtracted and V^T (dim, keys)
    made E4M3 by a Triton pass (`v_fp8_operand`), P * 448 in E4M3 from registers regrouped into the 8-bit operand
    layout with no data moved (`_p_as_8bit_operand`); the scales and means are applied in the epilogue.

    `config`: `AttentionConfig` (None: `default_config("mosaic", ...)`). `q_prologue` (`MosaicQPrologue`): `qi` is
    the raw Q projection instead (batch, seq, heads >= its num_heads, dim; the first num_heads heads are Q, read in
    place) and `qs` is not used: each compute warpgroup norms, rotates, scales and quantizes its 64 rows itself
    (`_mosaic_q_prologue`); K must then be in the natural channel order. `v_range` (FP8 P.V): V's (max, min, sum)
    over the valid keys (batch, kv_heads, dim) each, from K's sums pass; None: from V here. `v_heads` (first,
    count): V is those heads of `v` (a stacked projection), read in place. `p_in_smem` (default: in interpret mode
    only, whose wgmma reads A from shared memory only) sends P through shared memory, a fresh accumulator a block.
    `lower_only`: return the lowered (cuda) computation instead of running it (CPU tests check the real lowering).
    """
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    if config is None:
        float32_q_tiles = q_prologue is not None and jnp.dtype(out_dtype).itemsize > 2
        config = default_config("mosaic", pv, qi.shape[3], qi.shape[1], interpret=interpret,
                                float32_q_tiles=float32_q_tiles)
    plan = _plan(qi, qs, ki, kv_lengths, pv=pv, config=config, p_in_smem=p_in_smem, interpret=interpret,
                 out_dtype=out_dtype, q_prologue=q_prologue)
    b, sq, wgs, d = plan.b, plan.sq, plan.wgs, plan.d
    lengths = _key_lengths(kv_lengths, b, ki.shape[1])
    qi = jnp.pad(qi, ((0, 0), (0, plan.pad_q), (0, 0), (0, 0)))  # (a copy only where the rows fill no whole CTA)
    ki = jnp.pad(ki, ((0, 0), (0, plan.pad_k), (0, 0), (0, 0)))
    if q_prologue is None:  # scales read as scalars from global memory: (batch, heads, blocks); padding's are 1
        qs = jnp.pad(qs, ((0, 0), (0, wgs * plan.n_q - qs.shape[1]), (0, 0)), constant_values=1.0).transpose(0, 2, 1)
        q_tables = ()
    else:  # the rotary tables and the norm's weight, copied in with the raw Q tile
        qs = jnp.zeros((1,), jnp.float32)
        q_tables = tuple(jnp.pad(t, ((0, 0), (0, plan.pad_q), (0, 0))) for t in q_prologue.tables(b, sq)) + (
            jnp.broadcast_to(q_prologue.weight(), (wgs, d)),)  # a copy for each compute warpgroup's slot
    ks = ks.transpose(0, 2, 1)
    # the row sums' B operand (K-major like V^T): a row of ones, seven of zeros
    ones = ((jnp.zeros((SUM_COLS, plan.block_k), jnp.float8_e4m3fn).at[0].set(1.0),) if plan.row_sums_by_wgmma
            else ())

    def entry(q_gmem, qs_gmem, k_gmem, ks_gmem, v_gmem, vs_gmem, len_gmem, *rest):
        *inputs, o_gmem = rest
        tables = tuple(inputs[:len(q_tables)])
        ones_gmem = inputs[len(q_tables)] if plan.row_sums_by_wgmma else None
        gmem = (q_gmem, qs_gmem, k_gmem, ks_gmem, v_gmem, vs_gmem, len_gmem, tables, ones_gmem, o_gmem)
        pl.run_scoped(lambda *scoped: _kernel(plan, q_prologue, gmem, scoped), *_shared_memory(plan),
                      collective_axes="wg")

    entry.__name__ = "int8_attention"  # what profiles list
    call = plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct((b, wgs * plan.n_q * MOSAIC_ROWS, plan.h, d), plan.out_dtype),
        grid=(plan.h, plan.n_q, b),
        grid_names=("heads", "q_seq", "batch"),
        num_threads=wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )

    def run(qi, qs, ki, ks, v, lengths, q_tables):
        return call(qi, qs, ki, ks, *_v_operand(plan, v, kv_lengths, lengths, v_range, v_heads), lengths, *q_tables,
                    *ones)[:, :sq]

    if lower_only:
        return jax.jit(run).trace(qi, qs, ki, ks, v, lengths, q_tables).lower(lowering_platforms=("cuda",))
    return run(qi, qs, ki, ks, v, lengths, q_tables)
