"""Ahead-of-time builds of the Triton-lowered kernels for AMD Instinct GPUs, on any machine: no GPU, no ROCm.

Pallas lowers a kernel to Triton IR in Python, for the GPU an abstract device names (`jax.sharding.AbstractDevice`
with a gfx architecture as its kind, on the "rocm" platform); Triton's AMD backend, which the `triton` wheel carries
(the `amd` extra), compiles that IR to AMDGCN. `triton_kernels` does the first step for any function that calls the
kernels, `build_for_amd` the second, and `AmdBuild` holds what the ISA says of the result: registers, LDS, scratch and
spills, and the matrix (MFMA) instructions it uses. docs/kernels/amd.md has the table for every kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import tempfile
from collections.abc import Callable
from pathlib import Path

import jax


@dataclasses.dataclass(frozen=True)
class AmdTarget:
    """An AMD Instinct architecture and the per-wave and per-workgroup limits a kernel must fit."""

    arch: str
    gpus: str
    lds_bytes: int  # LDS a workgroup may allocate
    vgprs: int = 512  # architectural + accumulation VGPRs a lane of a wave64 may hold (CDNA3/4: one file of 512)


AMD_TARGETS = {
    "gfx942": AmdTarget("gfx942", "MI300X, MI300A, MI325X", 64 * 1024),
    "gfx950": AmdTarget("gfx950", "MI350X, MI355X", 160 * 1024),
}


@dataclasses.dataclass(frozen=True)
class TritonKernel:
    """One Pallas call's Triton IR (text) as the lowering emitted it, with its launch settings."""

    name: str
    ir: str
    num_warps: int
    num_stages: int


def triton_kernels(fn: Callable, *args, arch: str) -> list[TritonKernel]:
    """The Triton kernels `fn(*args)` calls, lowered for `arch` (a key of `AMD_TARGETS`); args may be
    `jax.ShapeDtypeStruct`s. Raises whatever the Pallas lowering raises for an operation the target lacks."""
    from jax._src.lib.mlir import ir
    from jax._src.pallas.triton.lowering import _new_ir_context
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

    target = AMD_TARGETS[arch]
    # One device, its axis Auto: the kernels' callers see no sharding (an Explicit axis would type their arrays).
    mesh = AbstractMesh((1,), ("x",), axis_types=(AxisType.Auto,),
                        abstract_device=AbstractDevice(device_kind=target.arch, num_cores=None, platform="rocm"))
    with use_abstract_mesh(mesh):
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("rocm",))
    kernels = []
    with _new_ir_context() as context:
        for op in _custom_calls(lowered.compiler_ir("stablehlo").operation):
            if ir.StringAttr(op.attributes["call_target_name"]).value != "__gpu$xla.gpu.triton":
                continue
            config = ir.DictAttr(op.attributes["mhlo.backend_config"])
            module = ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes, context=context)
            kernels.append(TritonKernel(name=ir.StringAttr(config["name"]).value, ir=str(module),
                                        num_warps=ir.IntegerAttr(config["num_warps"]).value,
                                        num_stages=ir.IntegerAttr(config["num_stages"]).value))
    return kernels


def _custom_calls(op):
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                if inner.name == "stablehlo.custom_call":
                    yield inner
                yield from _custom_calls(inner)


@dataclasses.dataclass(frozen=True)
class AmdBuild:
    """What the AMDGCN of one kernel says: registers a lane (VGPRs, of them AGPRs; SGPRs), LDS and scratch bytes a
    workgroup, spilled registers (VGPRs to scratch memory; SGPRs into VGPR lanes), and the MFMA instructions it
    uses."""

    kernel: str
    arch: str
    vgprs: int
    agprs: int
    sgprs: int
    lds_bytes: int
    scratch_bytes: int
    vgpr_spills: int
    sgpr_spills: int
    mfma: tuple[str, ...]

    def problems(self) -> list[str]:
        """What does not fit its target: spills, scratch, registers or LDS over the limits."""
        target = AMD_TARGETS[self.arch]
        found = []
        if self.vgpr_spills:  # to scratch memory (SGPRs spill into VGPR lanes: no memory, not counted here)
            found.append(f"{self.vgpr_spills} VGPR spills")
        if self.scratch_bytes:
            found.append(f"{self.scratch_bytes} bytes of scratch a lane")
        if self.vgprs > target.vgprs:
            found.append(f"{self.vgprs} VGPRs > {target.vgprs}")
        if self.lds_bytes > target.lds_bytes:
            found.append(f"{self.lds_bytes} bytes of LDS > {target.lds_bytes}")
        return found


def build_for_amd(kernel: TritonKernel, arch: str) -> AmdBuild:
    """Compile `kernel` to AMDGCN for `arch` with Triton's AMD backend. Raises ImportError naming the extra when the
    `triton` package is missing, and Triton's own error when the IR does not compile for that target."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget
    except ImportError as e:
        raise ImportError("AMD builds need the triton package: pip install -e '.[amd]'") from e

    inline = re.findall(r'tt\.elementwise_inline_asm\s+(?:\{asm_string = )?"([^"]*)"', kernel.ir)
    if inline:  # the assembler would only say that it rejected the code
        raise ValueError(f"{kernel.name}: inline assembly for another GPU ({inline[0]!r}); AMD GPUs do not run it")
    with tempfile.TemporaryDirectory(prefix="mxdit-amd-") as folder:
        source = Path(folder) / f"{kernel.name}.ttir"  # Triton picks the parser by the suffix
        source.write_text(kernel.ir)
        compiled = triton.compile(str(source), target=GPUTarget("hip", arch, 64),
                                  options={"num_warps": kernel.num_warps, "num_stages": kernel.num_stages,
                                           "enable_fp_fusion": True})  # Triton's default, said (it warns otherwise)
    asm = compiled.asm["amdgcn"]
    return AmdBuild(kernel=kernel.name, arch=arch, vgprs=_field(asm, "vgpr_count"),
                    agprs=_field(asm, "agpr_count", absent=0),
                    sgprs=_field(asm, "sgpr_count"),
                    # Triton allocates LDS at launch (dynamic), so the code object's fixed size leaves it out
                    lds_bytes=_field(asm, "group_segment_fixed_size") + compiled.metadata.shared,
                    scratch_bytes=_field(asm, "private_segment_fixed_size"),
                    vgpr_spills=_field(asm, "vgpr_spill_count"), sgpr_spills=_field(asm, "sgpr_spill_count"),
                    mfma=tuple(sorted(set(re.findall(r"\bv_mfma\w*", asm)))))


def _field(asm: str, name: str, absent: int | None = None) -> int:
    """An integer of the code object's metadata (`.name: value` in the AMDGCN's amdhsa.kernels YAML); `absent`
    where the field may be left out (the assembler omits a zero AGPR count)."""
    match = re.search(rf"^\s*\.{name}:\s+(\d+)", asm, re.MULTILINE)
    if match is None:
        if absent is not None:
            return absent
        raise ValueError(f"the AMDGCN has no .{name} field")
    return int(match.group(1))


def example_calls() -> dict[str, Callable[[], tuple[Callable, tuple]]]:
    """Every Triton-lowered kernel in a call of small, tile-whole shapes: name -> a function that makes (the call,
    its abstract arguments). What `tests/test_amd_builds.py` checks and `scripts/amd_builds.py` tabulates."""
    import jax.numpy as jnp

    from . import activations, attention, gemm

    bf16, f32, i32 = jnp.bfloat16, jnp.float32, jnp.int32
    shape = jax.ShapeDtypeStruct

    def gemm_call(fmt: str, scaling: str = "token", activation: str = "none"):
        w = jax.random.normal(jax.random.key(0), (256, 256), f32) * 0.05
        if activation == "swiglu":
            halves = (w[:128], w[128:])
            weight = gemm.swiglu_weight(*(gemm.prepare_weight(half, fmt, backend="triton") for half in halves))
        else:
            weight = gemm.prepare_weight(w, fmt, backend="triton")
        return (lambda x: gemm.scaled_matmul(x, weight, x_scaling=scaling, activation=activation, backend="triton"),
                (shape((128, 256), bf16),))

    def attention_call(pv: str):
        q, kv = shape((1, 256, 4, 64), bf16), shape((1, 256, 2, 64), bf16)
        return (lambda q, k, v, n: attention.int8_attention(q, k, v, kv_lengths=n, pv=pv, backend="triton"),
                (q, kv, kv, shape((1,), i32)))

    def prologue(x, norms, cos, sin, lengths):  # Krea 2's layout: 48 query and 12 KV heads in one stacked product
        return attention.int8_qk_prologue_stacked(x, 48, 12, norms[0], norms[1], 1e-6, cos, sin, lengths,
                                                  scale=128**-0.5, block_q=64, block_k=128)

    rows, vec, mod = shape((1, 64, 256), bf16), shape((256,), f32), shape((1, 1, 256), bf16)
    calls = {f"gemm {fmt}": functools.partial(gemm_call, fmt) for fmt in gemm.WEIGHT_FORMATS}
    calls.update({
        "gemm fp8_e4m3, 1x128 activation blocks": lambda: gemm_call("fp8_e4m3", scaling="block"),
        "gemm fp8_e4m3, SwiGLU epilogue": lambda: gemm_call("fp8_e4m3", activation="swiglu"),
        "int8 attention, bf16 P.V": lambda: attention_call("bf16"),
        "int8 attention, fp8 P.V": lambda: attention_call("fp8"),
        "int8 QK prologue": lambda: (prologue, (shape((1, 256, 120, 128), bf16), shape((2, 128), f32),
                                                shape((256, 128), f32), shape((256, 128), f32), shape((1,), i32))),
        "modulated_rms_norm_fp8": lambda: (
            lambda x, w, a, s: activations.modulated_rms_norm_fp8(x, w, a, s, 1e-6), (rows, vec, mod, mod)),
        "modulated_layer_norm_fp8": lambda: (
            lambda x, a, s: activations.modulated_layer_norm_fp8(x, a, s, 1e-6), (rows, mod, mod)),
        "swiglu_fp8": lambda: (activations.swiglu_fp8, (shape((1, 64, 512), bf16),)),
        "tokens_fp8": lambda: (activations.tokens_fp8, (rows,)),
        "sigmoid_gated_fp8": lambda: (lambda o, s: activations.sigmoid_gated_fp8(o, s, gate_offset=256),
                                      (rows, shape((1, 64, 512), bf16))),
    })
    return calls


def build_table(targets: tuple[str, ...] = tuple(AMD_TARGETS)) -> list[dict]:
    """A row per example call, kernel and target: the `AmdBuild`'s fields and its problems, or the error that stopped
    the lowering or the build (one line)."""
    rows = []
    for call, make in example_calls().items():
        fn, args = make()
        for arch in targets:
            try:
                kernels = triton_kernels(fn, *args, arch=arch)
            except Exception as e:
                rows.append({"call": call, "arch": arch, "error": _one_line(e)})
                continue
            for kernel in kernels:
                try:
                    build = build_for_amd(kernel, arch)
                except ImportError:
                    raise
                except Exception as e:
                    rows.append({"call": call, "arch": arch, "kernel": kernel.name, "error": _one_line(e)})
                    continue
                rows.append({"call": call, **dataclasses.asdict(build), "problems": build.problems()})
    return rows


def _one_line(e: Exception) -> str:
    """An exception as one line: the assembler's first complaint where there is one (its last line only says that
    it rejected the code)."""
    text = str(e)
    complaint = re.search(r"error: (.*)\n\s*(\S.*)", text)
    if complaint:
        return f"{type(e).__name__}: {complaint.group(1)}: {complaint.group(2).strip()}"
    return f"{type(e).__name__}: {' '.join(text.split())[:300]}"
