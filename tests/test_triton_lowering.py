"""Every Triton-lowered kernel lowers for an H100/H200-class GPU (compute capability 9.0) on the CPU: Pallas'
lowering to Triton IR runs in Python, so unsupported operations, block shapes and indexing show up here rather than
in scarce GPU time (as `test_mosaic_kernel_lowers_for_the_gpu` does for the Mosaic kernels). Not checked: Triton's
own compilation to PTX, and speed."""

import jax
import jax.numpy as jnp
import pytest

from mxdit.pallas_kernels import activations as A
from mxdit.pallas_kernels import attention, gemm


pytestmark = pytest.mark.usefixtures("hopper")  # conftest.py: the compute capability the lowering asks for


def lowered_text(fn, *shapes) -> str:
    """fn's StableHLO lowered for the GPU on (shape, dtype) pairs; Triton kernels' IR and inline PTX are in it."""
    return jax.jit(fn).trace(*(jax.ShapeDtypeStruct(s, d) for s, d in shapes)).lower(
        lowering_platforms=("cuda",)).as_text()


def lowers(fn, *shapes):
    return "xla.gpu.triton" in lowered_text(fn, *shapes)


BF16, F32 = jnp.bfloat16, jnp.float32
ROWS = (1, 64, 256)


@pytest.mark.parametrize("name", ["modulated_rms_norm_fp8", "modulated_rms_norm_fp8 (1 row a program)",
                                  "modulated_layer_norm_fp8", "swiglu_fp8", "tokens_fp8", "sigmoid_gated_fp8",
                                  "swiglu_fp8 (4 rows)", "tokens_fp8 (4 rows)", "sigmoid_gated_fp8 (4 rows)"])
def test_fused_fp8_producers_lower(name):
    """Each row kernel, with its default rows a program (`default_rows_per_program`) and with another."""
    calls = {
        "modulated_rms_norm_fp8": (lambda x, w, a, s: A.modulated_rms_norm_fp8(x, w, a, s, 1e-6),
                                   (ROWS, BF16), ((256,), F32), ((1, 1, 256), BF16), ((1, 1, 256), BF16)),
        "modulated_rms_norm_fp8 (1 row a program)": (
            lambda x, w, a, s: A.modulated_rms_norm_fp8(x, w, a, s, 1e-6, rows_per_program=1),
            (ROWS, BF16), ((256,), F32), ((1, 1, 256), BF16), ((1, 1, 256), BF16)),
        "swiglu_fp8 (4 rows)": (lambda x: A.swiglu_fp8(x, rows_per_program=4), ((1, 64, 512), BF16)),
        "tokens_fp8 (4 rows)": (lambda x: A.tokens_fp8(x, rows_per_program=4), (ROWS, BF16)),
        "sigmoid_gated_fp8 (4 rows)": (lambda o, s: A.sigmoid_gated_fp8(o, s, gate_offset=512, rows_per_program=4),
                                       (ROWS, BF16), ((1, 64, 1024), BF16)),
        "modulated_layer_norm_fp8": (lambda x, a, s: A.modulated_layer_norm_fp8(x, a, s, 1e-6),
                                     (ROWS, BF16), ((1, 1, 256), BF16), ((1, 1, 256), BF16)),
        "swiglu_fp8": (A.swiglu_fp8, ((1, 64, 512), BF16)),
        "tokens_fp8": (A.tokens_fp8, (ROWS, BF16)),
        "sigmoid_gated_fp8": (lambda o, s: A.sigmoid_gated_fp8(o, s, gate_offset=512), (ROWS, BF16),
                              ((1, 64, 1024), BF16)),
    }
    fn, *shapes = calls[name]
    assert lowers(fn, *shapes)


@pytest.mark.parametrize("name", ["sigmoid_gated_fp8", "swiglu_fp8"])
def test_row_kernels_take_the_sigmoid_from_ex2_and_rcp(name):
    """`activations._SIGMOID_PTX` (the GEMM epilogue's fast sigmoid) instead of libdevice's expf and a division; its
    constants are float32(-log2 e) and 1."""
    import math
    import struct

    calls = {"sigmoid_gated_fp8": (lambda o, s: A.sigmoid_gated_fp8(o, s, gate_offset=256),
                                   ((1, 64, 256), BF16), ((1, 64, 512), BF16)),
             "swiglu_fp8": (A.swiglu_fp8, ((1, 64, 512), BF16))}
    fn, *shapes = calls[name]
    text = lowered_text(fn, *shapes)
    assert "ex2.approx.ftz.f32" in text and "rcp.approx.ftz.f32" in text
    assert "__nv_expf" not in text and "divf" not in text
    hex_float = lambda v: "0f%08X" % struct.unpack("<I", struct.pack("<f", v))[0]
    assert hex_float(-math.log2(math.e)) in A._SIGMOID_PTX and hex_float(1.0) in A._SIGMOID_PTX


def test_fp8_row_quantization_multiplies_by_a_correctly_rounded_reciprocal():
    """Triton's float32 `/` is PTX's approximate `div.full.f32`: the row kernels take the scale's reciprocal from
    `rcp.rn.f32` and multiply by it (`activations.reciprocal_products`), as XLA's composition computes, so
    `tokens_fp8`, which divides nowhere else, lowers with no `arith.divf` at all."""
    text = lowered_text(A.tokens_fp8, ((1, 64, 256), BF16))
    for asm in ("rcp.rn.f32", "mul.rn.f32"):
        assert asm in text
    assert "divf" not in text


@pytest.mark.parametrize("permute_keys", [False, True])
def test_v_fp8_operand_lowers_with_reciprocal_products(permute_keys):
    """V's FP8 operand pass (read in place from Krea 2's stacked product, a scale and a mean a channel given):
    lowers, multiplying by the channel scales' reciprocals (`activations.reciprocal_products`), not Triton's `/`."""
    def operand(x, scale, mean, lengths):
        return attention.v_fp8_operand(x, 128, permute_keys=permute_keys, kv_lengths=lengths,
                                       scale_and_mean=(scale, mean), heads=(60, 12))[0]

    shapes = (((1, 256, 120, 128), BF16), ((1, 12, 128), F32), ((1, 12, 128), F32), ((1,), jnp.int32))
    text = lowered_text(operand, *shapes)
    assert "xla.gpu.triton" in text
    assert "rcp.rn.f32" in text and "mul.rn.f32" in text and "divf" not in text


@pytest.mark.parametrize("heads_per_program", [1, 2, 4])
def test_qk_prologue_lowers_with_heads_grouped(heads_per_program):
    """Krea 2's layout (48 query and 12 KV heads in one stacked product), the masked keys read after the queries."""
    config = attention.PrologueConfig(q_heads=heads_per_program, k_heads=heads_per_program)

    def prologue(x, norms, cos, sin, lengths):
        return attention.int8_qk_prologue_stacked(x, 48, 12, norms[0], norms[1], 1e-6, cos, sin, lengths,
                                                  scale=128**-0.5, block_q=64, block_k=128, config=config)

    assert lowers(prologue, ((1, 256, 120, 128), BF16), ((2, 128), F32), ((256, 128), F32), ((256, 128), F32),
                  ((1,), jnp.int32))


@pytest.mark.parametrize("v_range", [False, True])
def test_k_prologue_in_natural_channel_order_lowers(v_range):
    """The K pass alone, its pairs joined in registers (the Mosaic kernel makes Q itself): the sums pass writes K's
    ranges (and with `v_range` reads V's range in place, FP8 P.V), and the K pass quantizes 32 tokens a program with
    the steps given."""
    def prologue(x, norms, cos, sin, lengths):
        return attention._qk_prologue(x, (0, 48), x, (48, 12), norms[0], norms[1], 1e-6, cos, sin, lengths,
                                      scale=128**-0.5, block_q=64, block_k=128, smooth_k=True, interpret=False,
                                      k_only=True, values=(x, (60, 12)) if v_range else None)[2:]

    text = lowered_text(prologue, ((1, 256, 120, 128), BF16), ((2, 128), F32), ((256, 128), F32), ((256, 128), F32),
                        ((1,), jnp.int32))
    assert "xla.gpu.triton" in text
    # K's codes: products with the step's reciprocal, rounded to even in PTX (`reciprocal_products`)
    assert "cvt.rni.f32.f32" in text and "rcp.rn.f32" in text and "mul.rn.f32" in text


@pytest.mark.parametrize("pv", ["bf16", "fp8"])
def test_int8_attention_triton_kernel_lowers(pv):
    q, kv = ((1, 256, 4, 64), BF16), ((1, 256, 2, 64), BF16)
    assert lowers(lambda q, k, v, n: attention.int8_attention(q, k, v, kv_lengths=n, pv=pv, backend="triton"), q, kv,
                  kv, ((1,), jnp.int32))


@pytest.mark.parametrize("fmt, activation", [("fp8_e4m3", "none"), ("fp8_e4m3", "swiglu"), ("mxfp4_e2m1", "none"),
                                             ("mxfp6_e2m3", "none"), ("int8", "none")])
def test_triton_gemm_lowers(fmt, activation):
    w = jax.random.normal(jax.random.key(0), (256, 256), F32) * 0.05
    if activation == "swiglu":
        weight = gemm.swiglu_weight(*(gemm.prepare_weight(half, fmt, backend="triton") for half in (w[:128], w[128:])))
    else:
        weight = gemm.prepare_weight(w, fmt, backend="triton")
    assert lowers(lambda x: gemm.scaled_matmul(x, weight, activation=activation, backend="triton"), ((128, 256), BF16))


def triton_blocks(fn, *args):
    """(kernel name, block shape, array shape) of each operand and result of every Pallas call fn makes."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                for mapping in eqn.params["grid_mapping"].block_mappings:
                    block = tuple(1 if b is None else getattr(b, "block_size", 1) for b in mapping.block_shape)
                    found.append((eqn.params.get("name_and_src_info"), block, mapping.array_aval.shape))
            for param in eqn.params.values():
                inner = getattr(param, "jaxpr", param)
                if hasattr(inner, "eqns"):
                    walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    assert found, "no Pallas call traced"
    return found


def assert_whole_tiles(fn, *args):
    """The Triton lowering masks no load or store: a block reaching past its array reads and writes past it on the
    GPU (interpret mode pads, so the CPU tests cannot see it). Every array is a whole number of its blocks."""
    for name, block, shape in triton_blocks(fn, *args):
        assert all(s % b == 0 for b, s in zip(block, shape)), f"{name}: block {block} does not tile {shape}"


@pytest.mark.parametrize("m, k, n", [(130, 200, 72), (1, 128, 3), (4224, 1024, 768)])
@pytest.mark.parametrize("fmt, scaling", [("fp8_e4m3", "token"), ("fp8_e4m3", "block"), ("mxfp4_e2m1", "token"),
                                          ("mxfp6_e3m2", "block"), ("mxfp8_e4m3", "token"), ("int8", "token")])
def test_triton_gemm_tiles_every_shape_whole(m, k, n, fmt, scaling):
    w = jax.random.normal(jax.random.key(0), (n, k), F32) * 0.05
    weight = gemm.prepare_weight(w, fmt, backend="triton")
    x, xs = gemm.quantize_activations(jnp.ones((m, k), F32), "token" if fmt == "int8" else scaling,
                                      fmt if fmt == "int8" else "fp8_e4m3")
    assert_whole_tiles(lambda x, xs, b, r, g: gemm.scaled_matmul(
        x, weight, xs, bias=b, residual=r, gate=g, activation="gelu_tanh", backend="triton"),
        x, xs, jnp.ones((n,)), jnp.ones((m, n)), jnp.ones((n,)))


@pytest.mark.parametrize("b, s, d", [(2, 40, 96), (1, 37, 6144), (1, 4224, 6144)])
def test_row_kernels_tile_every_shape_whole(b, s, d):
    x, vec, mod = jnp.ones((b, s, d), BF16), jnp.ones((d,), F32), jnp.ones((b, 1, d), BF16)
    assert_whole_tiles(lambda x: A.modulated_rms_norm_fp8(x, vec, mod, mod, 1e-6), x)
    assert_whole_tiles(lambda x: A.modulated_layer_norm_fp8(x, mod, mod, 1e-6), x)
    assert_whole_tiles(A.tokens_fp8, x)
    assert_whole_tiles(A.swiglu_fp8, jnp.concatenate([x, x], -1))
    assert_whole_tiles(lambda x: A.sigmoid_gated_fp8(x, jnp.concatenate([x, x], -1), d), x)


@pytest.mark.parametrize("s", [256, 1000, 4224])
@pytest.mark.parametrize("pv", ["bf16", "fp8"])
def test_int8_attention_tiles_every_shape_whole(s, pv):
    q, kv = jnp.ones((1, s, 4, 64), BF16), jnp.ones((1, s, 2, 64), BF16)
    n, cos = jnp.ones((64,), F32), jnp.ones((s, 64), F32)
    assert_whole_tiles(lambda q, k, v: attention.int8_attention_fused(
        q, k, v, n, n, 1e-6, cos, cos, kv_lengths=jnp.asarray([s - 3]), pv=pv, backend="triton"), q, kv, kv)
