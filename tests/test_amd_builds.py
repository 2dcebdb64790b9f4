"""Every Triton-lowered kernel compiles for AMD Instinct gfx942 (MI300X) and gfx950 (MI355X) on this CPU machine:
Pallas lowers it for an abstract AMD device and Triton's AMD backend builds the AMDGCN (`pallas_kernels.amd`). The
ISA is checked for what runs well there: no VGPR spills or scratch, registers and LDS within the target's limits,
and the matrix instructions each kernel should use. Not checked: that the code runs, which needs the GPU."""

import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from mxdit.pallas_kernels import amd, numerics

pytest.importorskip("triton", reason="the AMD builds need triton (pip install -e '.[amd]')")

TARGETS = tuple(amd.AMD_TARGETS)
CALLS = amd.example_calls()

# The MFMA instructions a kernel must use, by call and target. FP8 operands are OCP E4M3FN (the models' format):
# gfx950's MFMA takes them; gfx942's FP8 MFMA takes the FNUZ encodings, so the kernels hand it their halves as FNUZ
# (`numerics.dot_fp8`; otherwise Triton would widen them to f16). MX weights are unpacked to E4M3 in the kernel and
# each 32-block's product scaled after the dot: Pallas has no scaled dot, so gfx950's scaled MFMA
# (v_mfma_scale_f32_*_f8f6f4) is not reached (docs/kernels/amd.md).
INT8 = {"gfx942": "v_mfma_i32_32x32x16_i8", "gfx950": "v_mfma_i32_32x32x32_i8"}
FP8 = {"gfx942": "v_mfma_f32_32x32x16_fp8_fp8", "gfx950": "v_mfma_f32_32x32x64_f8f6f4"}
MX = {"gfx942": "v_mfma_f32_32x32x16_fp8_fp8", "gfx950": "v_mfma_f32_32x32x16_fp8_fp8"}
BF16 = {"gfx942": "v_mfma_f32_32x32x8_bf16", "gfx950": "v_mfma_f32_32x32x16_bf16"}
EXPECTED_MFMA = {
    "gemm fp8_e4m3": FP8, "gemm fp8_e4m3, 1x128 activation blocks": FP8, "gemm fp8_e4m3, SwiGLU epilogue": FP8,
    "gemm int8": INT8, "gemm int8_rot": INT8,
    **{f"gemm {fmt}": MX for fmt in ("mxfp8_e4m3", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp4_e2m1")},
    "int8 attention, bf16 P.V": {arch: (INT8[arch], BF16[arch]) for arch in TARGETS},
    "int8 attention, fp8 P.V": {arch: (INT8[arch], FP8[arch]) for arch in TARGETS},
}


@pytest.mark.parametrize("arch", TARGETS)
@pytest.mark.parametrize("call", list(CALLS))
def test_kernel_builds_for_amd_within_limits_with_its_matrix_instructions(call, arch):
    fn, args = CALLS[call]()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
        kernels = amd.triton_kernels(fn, *args, arch=arch)
    assert kernels, "no Triton kernel lowered"
    builds = [amd.build_for_amd(kernel, arch) for kernel in kernels]
    for build in builds:
        assert not build.problems(), f"{build.kernel}: {build.problems()}"
    used = {m for build in builds for m in build.mfma}
    expected = EXPECTED_MFMA.get(call, {}).get(arch, ())
    expected = {expected} if isinstance(expected, str) else set(expected)
    if expected:
        assert expected <= used, f"{sorted(used)} lacks {sorted(expected - used)}"
    else:  # the row kernels and the prologue multiply no matrices
        assert not used


def test_inline_ptx_is_named_not_assembled(monkeypatch):
    """A kernel lowered with its NVIDIA arithmetic (inline PTX) for an AMD target: the build names the assembly."""
    monkeypatch.setattr(numerics, "lowering_for_amd", lambda: False)
    fn, args = CALLS["tokens_fp8"]()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
        # a new function: jax's cache would give the lowering an earlier test made with the AMD arithmetic
        (kernel,) = amd.triton_kernels(lambda *a: fn(*a), *args, arch="gfx942")
    with pytest.raises(ValueError, match=r"tokens_fp8: inline assembly for another GPU \('rcp.rn.f32"):
        amd.build_for_amd(kernel, "gfx942")


def test_the_amd_path_of_reciprocal_products_computes_the_composition(monkeypatch):
    """The plain expressions the kernels take on AMD GPUs: y * (1 / step) rounded once, then to the nearest integer
    with ties to even, as jnp.round (which the Triton lowering lacks)."""
    monkeypatch.setattr(numerics, "lowering_for_amd", lambda: True)
    rng = np.random.default_rng(0)
    y = jnp.asarray(np.concatenate([rng.standard_normal(4000) * 300, np.arange(-40, 40) / 2,
                                    [8388607.5, -4194303.5, 1e30, np.inf, -np.inf, np.nan]]).astype(np.float32))[None]
    step = jnp.float32(0.75)
    (products,) = numerics.reciprocal_products([y], step)
    (rounded,) = numerics.reciprocal_products([y], step, round_to_integer=True)
    expected = np.asarray(y) * (np.float32(1) / np.float32(0.75))
    np.testing.assert_array_equal(products, expected)
    np.testing.assert_array_equal(rounded, np.round(expected))
    np.testing.assert_array_equal(np.signbit(rounded), np.signbit(np.round(expected)))  # -0.0 where jnp.round gives it


def test_fnuz_halves_are_every_e4m3fn_code_halved():
    """All 256 E4M3FN codes: as E4M3FNUZ the same bits are half the value; -0 becomes +0 and the NaNs stay NaN."""
    codes = np.arange(256, dtype=np.uint8)
    fn = codes.view(jnp.float8_e4m3fn).astype(np.float32)
    fnuz = np.asarray(numerics.as_fnuz_halves(jnp.asarray(codes).view(jnp.float8_e4m3fn))).astype(np.float32)
    finite = ~np.isnan(fn)
    np.testing.assert_array_equal(fnuz[finite], fn[finite] / 2)
    assert np.isnan(fnuz[~finite]).all() and not np.signbit(fnuz[codes == 0x80]).any()


@pytest.mark.parametrize("kernel", ["gemm fp8_e4m3", "gemm mxfp6_e2m3", "attention fp8 P.V"])
def test_the_fnuz_dots_of_gfx942_give_the_e4m3fn_results_bit_for_bit(monkeypatch, kernel):
    """The kernels in interpret mode with the gfx942 dot (`numerics.dot_fp8` on FNUZ halves, times 4) and without:
    the same bits."""
    import jax

    from mxdit.pallas_kernels import attention, gemm
    from mxdit.pallas_kernels.gemm.config import TritonConfig
    as_fnuz_halves = numerics.as_fnuz_halves
    kx, kw = jax.random.split(jax.random.key(0))
    if kernel.startswith("gemm"):
        x = jax.random.normal(kx, (64, 256), jnp.float32)
        w = gemm.prepare_weight(jax.random.normal(kw, (128, 256), jnp.float32) / 16, kernel.split()[1],
                                backend="triton")
        xq, xs = gemm.quantize_activations(x, "token", "fp8_e4m3")
        xq = xq.at[0, :4].set(-0.0)  # FNUZ has no -0: its code is FNUZ's NaN

        def run():
            return gemm.scaled_matmul(xq, w, xs, backend="triton", interpret=True, out_dtype=jnp.float32,
                                      config=TritonConfig(block_m=32, block_n=64, num_warps=4, num_stages=2))
    else:
        q, k, v = (jax.random.normal(key, (1, 4, 128, 64), jnp.float32) for key in jax.random.split(kx, 3))

        def run():
            return attention.int8_attention(q, k, v, pv="fp8", backend="triton", interpret=True)

    plain = np.asarray(run())
    halved = []
    monkeypatch.setattr(numerics, "fp8_mfma_takes_fnuz", lambda: True)
    monkeypatch.setattr(numerics, "as_fnuz_halves", lambda x: halved.append(x.shape) or as_fnuz_halves(x))
    jax.clear_caches()  # traced again, with the gfx942 dot
    np.testing.assert_array_equal(np.asarray(run()), plain)
    assert halved  # the dots took the FNUZ operands
