"""The GEMM on Hopper in Pallas Mosaic GPU: wgmma with FP8 operands straight from shared memory, TMA loads in a
warp-specialized pipeline (one memory warpgroup, two or three compute warpgroups), a persistent grid over output
tiles, the scales and the epilogue applied in registers."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from ..numerics import BLOCK_K
from .config import MosaicConfig


def _gelu_tanh_by_sigmoid(x: jax.Array, sigmoid) -> jax.Array:
    """GELU's tanh form, 0.5 x (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2 / pi) (x + 0.044715 x^3)."""
    return x * sigmoid((2 * math.sqrt(2 / math.pi)) * (x + 0.044715 * (x * x * x)))


def _fast_sigmoid(x: jax.Array, layout) -> jax.Array:
    """1 / (1 + 2^(-x log2 e)) with `ex2.approx.ftz` and `rcp.approx.ftz` (inside a Mosaic GPU kernel; float32 in
    `layout`). Large negative x gives 0 (the exact sigmoid: a subnormal or 0)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax.experimental.mosaic.gpu import fragmented_array as fa

    fast = fa.FragmentedArray._lift_fast_instr  # the PTX instruction a register (jax 0.11.2, pinned)

    @plgpu.inline_mgpu(arg_types=(layout,),
                       return_type=plgpu.ShapeDtypeStruct(x.shape, jnp.float32, layout=layout))
    def sigmoid(_, y):
        e = (y * -math.log2(math.e))._pointwise(fast("ex2.approx.ftz.f32"))
        return (e + 1.0)._pointwise(fast("rcp.approx.ftz.f32"))

    return sigmoid(x)




@dataclasses.dataclass(frozen=True)
class _Plan:
    """What the kernel's pieces decide from the shapes, the config and the epilogue, checked once."""

    m: int
    n: int
    k: int
    config: MosaicConfig
    x_blocks: bool  # x's scales per token and 128-block (they travel with the operand tiles)
    w_blocks: bool  # w's scales per channel and 128-block
    w_uniform: bool  # one weight scale for a whole tile (runs of equal scales a multiple of tile_n)
    activation: str
    swiglu_width: int
    has_bias: bool
    has_res: bool
    has_gate: bool
    out_dtype: jnp.dtype
    interpret: bool

    @property
    def cta_m(self) -> int:
        return self.config.compute_wgs * self.config.tile_m

    @property
    def swiglu(self) -> bool:
        return self.activation == "swiglu"

    @property
    def block_scaled(self) -> bool:
        return self.x_blocks or self.w_blocks

    @property
    def out_tn(self) -> int:  # the output columns of one tile
        return self.config.tile_n // 2 if self.swiglu else self.config.tile_n

    @property
    def epi_n(self) -> int:  # output columns a store (SwiGLU: each pair's output leaves on its own)
        return self.swiglu_width if self.swiglu else min(self.config.epi_tile_n, self.config.tile_n)

    @property
    def n_parts(self) -> int:
        return self.out_tn // self.epi_n

    @property
    def col_vectors(self) -> list[str]:
        """The epilogue's n-indexed vectors, each fetched by TMA on its own barrier."""
        return ([] if self.w_blocks else ["w_scale"]) + (["bias"] if self.has_bias else []) + (
            ["gate"] if self.has_gate else [])

    @property
    def n_barriers(self) -> int:  # a warpgroup's: the row scales, two residual slices, the column vectors
        return len(self.col_vectors) + 3

    @property
    def prefetched(self) -> int:
        """Residual slices fetched during the main loop into the output's two staging slots (the rest one by one
        before their output leaves from the same slot)."""
        return min(2, self.n_parts) if (self.has_res and self.config.prefetch_residual) else 0


def _plan(x, w_data, bias, residual, gate, *, x_blocks, w_blocks, activation, out_dtype, config, w_scale_rows,
          swiglu_width, interpret) -> _Plan:
    m, k = x.shape
    n = w_data.shape[0]
    tn, cluster_n = config.tile_n, config.cluster_n
    cta_m = config.compute_wgs * config.tile_m
    if m % cta_m or n % (tn * cluster_n) or k % BLOCK_K:
        raise ValueError(f"mosaic gemm: ({m}, {k}) x ({n}, {k}) must be multiples of ({cta_m}, {BLOCK_K}) x "
                         f"({tn} * cluster_n {cluster_n}, {BLOCK_K})")
    if interpret and cluster_n > 1:  # it would hand each CTA only its share of x's tile
        raise ValueError("mosaic gemm: interpret mode does not model TMA multicast; use cluster_n=1")
    if activation == "swiglu" and tn % (2 * swiglu_width):
        raise ValueError(f"mosaic gemm: tile_n {tn} must hold whole SwiGLU pairs of 2 x {swiglu_width} columns")
    return _Plan(m=m, n=n, k=k, config=config, x_blocks=x_blocks, w_blocks=w_blocks,
                 w_uniform=w_blocks and w_scale_rows % tn == 0, activation=activation, swiglu_width=swiglu_width,
                 has_bias=bias is not None, has_res=residual is not None, has_gate=gate is not None,
                 out_dtype=jnp.dtype(out_dtype), interpret=interpret)


def _k_step(plan: _Plan, wg_rows, _, x_smem, w_smem, *rest):
    """One 128-wide K block of a compute warpgroup's tile. Block-scaled: the block's product in a fresh accumulator,
    promoted into the float32 total with the scales that vary along K (one FMA an element when only one side's
    do); else straight into the running wgmma accumulator."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax import lax

    tm, tn, wgmma = plan.config.tile_m, plan.config.tile_n, plgpu.Layout.WGMMA
    if not plan.block_scaled:
        (acc_ref,) = rest
        plgpu.wgmma(acc_ref, x_smem.at[wg_rows], w_smem.transpose((1, 0)))
        plgpu.wgmma_wait(0)
        return acc_ref
    *scale_smems, acc = rest

    def block_product(ref):
        plgpu.wgmma(ref, x_smem.at[wg_rows], w_smem.transpose((1, 0)))
        plgpu.wgmma_wait(0)
        return ref[...]

    partial = pl.run_scoped(block_product, plgpu.ACC((tm, tn), jnp.float32))
    if plan.x_blocks:
        sx = plgpu.load(scale_smems[0].at[0, wg_rows], layout=wgmma.reduce(1))
        partial = partial * lax.broadcast_in_dim(sx, (tm, tn), [0])
    if plan.w_blocks and plan.w_uniform:  # one weight scale for the whole tile: a scalar from shared memory
        partial = partial * scale_smems[-1][0, 0]
    elif plan.w_blocks:
        sw = plgpu.load(scale_smems[-1].at[0], layout=wgmma.reduce(0))
        partial = partial * lax.broadcast_in_dim(sw, (tm, tn), [1])
    return acc + partial


def _epilogue(plan: _Plan, refs: dict, acc, wg, rows, wg_rows, ni, barrier):
    """The tile's scales (those not applied along K), bias, activation and gate in float32, then the output in
    `epi_n`-wide parts through two staging slots, the residual added from the same slot."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax import lax

    tm, tn, wgmma, out_dtype = plan.config.tile_m, plan.config.tile_n, plgpu.Layout.WGMMA, plan.out_dtype
    epi_n, out_smem = plan.epi_n, refs["out_smem"]
    # the interpreter runs no PTX: the exact sigmoid there
    sigmoid = jax.nn.sigmoid if plan.interpret else functools.partial(_fast_sigmoid, layout=wgmma)
    if not plan.x_blocks:
        plgpu.barrier_wait(barrier(0))
        sx = plgpu.load(refs["row_smem"].at[wg], layout=wgmma.reduce(1))
        acc = acc * lax.broadcast_in_dim(sx, (tm, tn), [0])

    def column(name):
        i = plan.col_vectors.index(name)
        plgpu.barrier_wait(barrier(3 + i))
        return lax.broadcast_in_dim(plgpu.load(refs["col_smem"].at[wg, i], layout=wgmma.reduce(0)), (tm, tn), [1])

    if not plan.w_blocks:
        acc = acc * column("w_scale")
    if plan.has_bias:
        acc = acc + column("bias")
    if plan.activation == "gelu_tanh":  # by the sigmoid, libdevice's tanhf avoided too
        acc = jax.nn.gelu(acc, approximate=True) if plan.interpret else _gelu_tanh_by_sigmoid(acc, sigmoid)
    elif plan.activation == "silu":
        acc = acc * sigmoid(acc)
    if plan.has_gate:
        acc = acc * column("gate")
    if not plan.has_res and not plan.swiglu:
        acc = acc.astype(out_dtype)

    def rounded(v):  # to the output's precision and back, as the unfused model's arithmetic rounds
        return v.astype(out_dtype).astype(jnp.float32)

    def out_part(e):
        if not plan.swiglu:
            return acc[:, e * epi_n:(e + 1) * epi_n]
        g = rounded(acc[:, 2 * e * epi_n:(2 * e + 1) * epi_n])
        u = rounded(acc[:, (2 * e + 1) * epi_n:(2 * e + 2) * epi_n])
        return (rounded(g * sigmoid(g)) * u).astype(out_dtype)  # as `swiglu_pairs`

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    for e in range(plan.n_parts):
        slot = e % 2
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
        out_cols = pl.ds(ni * plan.out_tn + e * epi_n, epi_n)
        part = out_part(e)
        if plan.has_res:
            if e >= plan.prefetched:
                plgpu.copy_gmem_to_smem(refs["res_gmem"].at[rows].at[wg_rows].at[:, out_cols], out_smem.at[wg, slot],
                                        barrier(1 + slot))
            plgpu.barrier_wait(barrier(1 + slot))
            res = plgpu.load(out_smem.at[wg, slot], layout=wgmma).astype(jnp.float32)
            part = (part + res).astype(out_dtype)
        out_smem[wg, slot] = part
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem.at[wg, slot], refs["out_gmem"].at[rows].at[wg_rows].at[:, out_cols])


def _tile(plan: _Plan, refs: dict, info):
    """One output tile of the persistent grid: the K loop in a warp-specialized pipeline (a memory warpgroup streams
    x's and w's K blocks by TMA), the epilogue's vectors fetched while it runs, then the epilogue."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax import lax

    config, tm, tn = plan.config, plan.config.tile_m, plan.config.tile_n
    cluster_n, cta_m = config.cluster_n, plan.cta_m
    m_iters, n_iters = plan.m // cta_m, plan.n // tn
    wg = lax.axis_index("wg")
    n_barriers = plan.n_barriers

    def barrier(i):
        return refs["barriers"].at[wg * n_barriers + i]

    (lin,) = info.index
    mi, ni = plgpu.planar_snake(lin, (m_iters, n_iters // cluster_n), 1 if config.grid_minor_n else 0,
                                config.grid_tile_width)
    if cluster_n > 1:  # the cluster's CTAs take neighbouring column tiles of the same rows
        ni = ni * cluster_n + lax.axis_index("cluster")
    rows, cols, wg_rows = pl.ds(mi * cta_m, cta_m), pl.ds(ni * tn, tn), pl.ds(wg * tm, tm)
    col_gmem = {"w_scale": refs["ws_gmem"], "bias": refs["bias_gmem"], "gate": refs["gate_gmem"]}

    def compute_context(run):
        if not plan.x_blocks:
            plgpu.copy_gmem_to_smem(refs["xs_gmem"].at[rows].at[wg_rows], refs["row_smem"].at[wg], barrier(0))
        for i, name in enumerate(plan.col_vectors):
            plgpu.copy_gmem_to_smem(col_gmem[name].at[cols], refs["col_smem"].at[wg, i], barrier(3 + i))
        if plan.prefetched:  # each slot's previous store must have been read
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        for e in range(plan.prefetched):
            plgpu.copy_gmem_to_smem(refs["res_gmem"].at[rows].at[wg_rows].at[:, pl.ds(ni * tn + e * plan.epi_n,
                                                                                         plan.epi_n)],
                                    refs["out_smem"].at[wg, e], barrier(1 + e))
        if plan.block_scaled:
            acc = run(plgpu.layout_cast(jnp.zeros((tm, tn), jnp.float32), plgpu.Layout.WGMMA))
        else:
            def scoped(acc_ref):
                run(acc_ref)
                return acc_ref[...]

            acc = pl.run_scoped(scoped, plgpu.ACC((tm, tn), jnp.float32))
        _epilogue(plan, refs, acc, wg, rows, wg_rows, ni, barrier)

    fp8_transforms = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))
    specs = [plgpu.BlockSpec((cta_m, BLOCK_K), lambda kk: (0, kk), transforms=fp8_transforms,
                             collective_axes=("cluster",) if cluster_n > 1 else ()),
             plgpu.BlockSpec((tn, BLOCK_K), lambda kk: (0, kk), transforms=fp8_transforms)]
    args = [refs["x_gmem"].at[rows], refs["w_gmem"].at[cols]]
    if plan.x_blocks:
        specs.append(plgpu.BlockSpec((1, cta_m), lambda kk: (kk, 0)))
        args.append(refs["xs_gmem"].at[:, rows])
    if plan.w_blocks:
        specs.append(plgpu.BlockSpec((1, tn), lambda kk: (kk, 0)))
        args.append(refs["ws_gmem"].at[:, cols])
    k_iters = plan.k // BLOCK_K
    plgpu.emit_pipeline_warp_specialized(
        functools.partial(_k_step, plan, wg_rows), grid=(k_iters,), memory_registers=40, in_specs=specs,
        wg_axis="wg", num_compute_wgs=config.compute_wgs,
        max_concurrent_steps=min(config.max_concurrent_steps, k_iters), compute_context=compute_context)(*args)


def _mosaic_gemm(x, x_scale, w_data, w_scale, bias, residual, gate, *, x_blocks, w_blocks, activation, out_dtype,
                 config: MosaicConfig, w_scale_rows: int = 1, swiglu_width: int = 0, interpret=False):
    """The Mosaic GPU kernel on quantized operands: x (m, k) with `x_scale` (m,) or per 128-block (`x_blocks`),
    w_data (n, k) with `w_scale` per channel or per 128-block (`w_blocks`, runs of `w_scale_rows` equal rows);
    the epilogue `residual + gate * activation(y + bias)`. Shapes must be whole tiles (`scaled_matmul` pads)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    plan = _plan(x, w_data, bias, residual, gate, x_blocks=x_blocks, w_blocks=w_blocks, activation=activation,
                 out_dtype=out_dtype, config=config, w_scale_rows=w_scale_rows, swiglu_width=swiglu_width,
                 interpret=interpret)
    wgs, tm, tn, cluster_n = config.compute_wgs, config.tile_m, config.tile_n, config.cluster_n
    tiles = (plan.m // plan.cta_m) * (plan.n // tn)
    out_dtype, epi_n = plan.out_dtype, plan.epi_n
    out_swizzle = plgpu.find_swizzle(epi_n * out_dtype.itemsize * 8)
    out_transforms = (plgpu.TilingTransform((8, out_swizzle // out_dtype.itemsize)),
                      plgpu.SwizzleTransform(out_swizzle))
    names = ("x_gmem", "xs_gmem", "w_gmem", "ws_gmem", "bias_gmem", "res_gmem", "gate_gmem", "out_gmem")

    def kernel(*refs, **scratch):  # the operands and the output, then the scratch (`scratch_types`) by name
        plgpu.nd_loop((tiles // cluster_n,), collective_axes="sm")(
            functools.partial(_tile, plan, {**dict(zip(names, refs)), **scratch}))
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    num_sms = 1 if interpret else _num_sms()
    dummy = jnp.zeros((16,), jnp.float32)
    # profiles list the kernel under its body's name: say which product it is
    kernel.__name__ = "scaled_matmul" + "".join(f"_{part}" for part, used in (
        ("blocks", plan.block_scaled), (activation, activation != "none"), ("gate", plan.has_gate),
        ("residual", plan.has_res)) if used)
    call = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((plan.m, plan.n // 2 if plan.swiglu else plan.n), out_dtype),
        grid=(min(num_sms // cluster_n, tiles // cluster_n),),
        grid_names=("sm",),
        **(dict(cluster=(cluster_n,), cluster_names=("cluster",)) if cluster_n > 1 else {}),
        num_threads=wgs + 1,
        thread_name="wg",
        scratch_types=dict(
            out_smem=plgpu.SMEM((wgs, 2, tm, epi_n), out_dtype, transforms=out_transforms),
            row_smem=plgpu.SMEM((wgs, tm), jnp.float32),
            col_smem=plgpu.SMEM((wgs, max(len(plan.col_vectors), 1), tn), jnp.float32),
            barriers=plgpu.Barrier(num_barriers=wgs * plan.n_barriers),
        ),
        interpret=_mosaic_interpret() if interpret else None,
    )
    return call(x, x_scale, w_data, w_scale, bias.astype(jnp.float32) if plan.has_bias else dummy,
                residual.astype(out_dtype) if plan.has_res else dummy,
                gate.astype(jnp.float32) if plan.has_gate else dummy)


def _num_sms() -> int:
    """The GPU's streaming multiprocessors: the persistent grid's size (a seam for lowering tests on the CPU)."""
    return jax.devices()[0].core_count


def _mosaic_interpret():
    import jax.experimental.pallas.mosaic_gpu as plgpu

    return plgpu.InterpretGPUParams()
