"""quant/formats.py: every format against an independent numpy + ml_dtypes rendering of its definition, bit for bit;
packing layouts; the pytree."""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from mxdit.quant.formats import (FORMATS, QuantizedArray, decode, encode, formats, hadamard, pack_fp4, pack_fp6,
                                 quantize, round_to_element, unpack_fp4, unpack_fp6)

ML = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2, "e2m3": ml_dtypes.float6_e2m3fn,
      "e3m2": ml_dtypes.float6_e3m2fn, "e2m1": ml_dtypes.float4_e2m1fn}
MX = [f for f in formats() if FORMATS[f].kind == "mx"]


def ml_round(v: np.ndarray, element) -> np.ndarray:
    """ml_dtypes' round-to-nearest-even cast, with saturation (clip first: E4M3FN would give NaN)."""
    dtype = ML[element.name]
    top = float(ml_dtypes.finfo(dtype).max)
    return np.clip(v.astype(np.float64), -top, top).astype(dtype).astype(np.float64)


TINY = 2.0**-126  # float32's smallest normal: XLA flushes float32 subnormals to zero (inputs and results)


def flush(v):
    return np.where(np.abs(v) < TINY, 0.0, v)


def reference_mx(x: np.ndarray, fmt: str) -> np.ndarray:
    """OCP MX v1.0 quantize-dequantize of rows of x (n a multiple of 32), in float64 with exact exponents, with
    float32 subnormals flushed to zero on the way in and out as XLA does."""
    element = FORMATS[fmt].element
    emax = math.floor(math.log2(float(ml_dtypes.finfo(ML[element.name]).max)))
    blocks = flush(x.astype(np.float64)).reshape(-1, 32)
    out = np.empty_like(blocks)
    for i, block in enumerate(blocks):
        if not np.isfinite(block).all():
            out[i] = np.nan
            continue
        amax = np.abs(block).max()
        exp = -127 if amax == 0 else math.frexp(amax)[1] - 1 - emax
        exp = min(max(exp, -127), 127)
        out[i] = ml_round(block / 2.0**exp, element) * 2.0**exp
    return flush(out).reshape(x.shape).astype(np.float32)


def assert_same(actual, expected):
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    assert actual.shape == expected.shape
    np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected))
    np.testing.assert_array_equal(np.nan_to_num(actual), np.nan_to_num(expected))


floats32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
magnitudes = st.sampled_from([1e-40, 1e-30, 1e-6, 1.0, 1e6, 3e38])


@st.composite
def blocks_of_32(draw, allow_special=False):
    rows = draw(st.integers(1, 3))
    kind = draw(st.sampled_from(["uniform", "heavy", "zero", "subnormal", "mixed"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    shape = (rows, 64)
    if kind == "uniform":
        x = rng.uniform(-1, 1, shape) * draw(magnitudes)
    elif kind == "heavy":
        x = rng.standard_t(1, shape)  # Cauchy: outliers
    elif kind == "zero":
        x = np.zeros(shape)
        x[0, 32:] = rng.standard_normal(32)  # one all-zero block beside a normal one
    elif kind == "subnormal":
        x = rng.standard_normal(shape) * 1e-39  # float32 subnormals
    else:
        x = draw(hnp.arrays(np.float32, shape, elements=floats32))
    x = np.asarray(x, np.float32)
    if allow_special and draw(st.booleans()):
        x[0, draw(st.integers(0, 63))] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    return x


@pytest.mark.parametrize("fmt", MX)
@given(x=blocks_of_32(allow_special=True))
@settings(max_examples=60, deadline=None)
def test_mx_quantize_dequantize_matches_the_ocp_definition(fmt, x):
    assert_same(quantize(x, fmt).dequantize(), reference_mx(x, fmt))


@pytest.mark.parametrize("element", ["e4m3", "e5m2", "e2m3", "e3m2", "e2m1"])
@given(v=hnp.arrays(np.float32, 64, elements=floats32))
@settings(max_examples=60, deadline=None)
def test_element_rounding_and_codes_match_ml_dtypes(element, v):
    fmt = next(f.element for f in FORMATS.values() if f.element is not None and f.element.name == element)
    v = flush(v).astype(np.float32)
    q = np.asarray(round_to_element(jnp.asarray(v), fmt))
    np.testing.assert_array_equal(q, ml_round(v, fmt).astype(np.float32))
    codes = np.asarray(encode(jnp.asarray(q), fmt))
    expected_codes = q.astype(ML[element]).view(np.uint8) & (2**fmt.bits - 1)
    np.testing.assert_array_equal(codes, expected_codes)
    np.testing.assert_array_equal(np.asarray(decode(jnp.asarray(codes), fmt)), q)


def test_every_code_decodes_like_ml_dtypes():
    for fmt in {f.element.name: f.element for f in FORMATS.values() if f.element is not None}.values():
        codes = np.arange(2**fmt.bits, dtype=np.uint8)
        expected = codes.view(ML[fmt.name]).astype(np.float32) if fmt.bits == 8 else \
            codes.astype(np.uint8).view(ML[fmt.name]).astype(np.float32)
        finite = np.isfinite(expected)  # E4M3FN's and E5M2's NaN/Inf codes are never produced
        np.testing.assert_array_equal(np.asarray(decode(jnp.asarray(codes), fmt))[finite], expected[finite])


def test_zero_block_gets_the_smallest_scale_and_inf_makes_the_block_nan():
    x = np.zeros((1, 64), np.float32)
    x[0, 40] = np.inf
    qa = quantize(x, "mxfp4_e2m1")
    bits = np.asarray(qa.scale).view(np.uint8)
    assert bits.tolist() == [[0x00, 0xFF]]
    out = np.asarray(qa.dequantize())
    assert (out[0, :32] == 0).all() and np.isnan(out[0, 32:]).all()


def test_fp4_packing_layout():
    codes = jnp.asarray([0x1, 0xA, 0xF, 0x3], jnp.uint8)
    assert np.asarray(pack_fp4(codes)).tolist() == [0xA1, 0x3F]  # element 2i low nibble, 2i+1 high nibble
    np.testing.assert_array_equal(unpack_fp4(pack_fp4(codes)), codes)


def test_fp6_packing_layout():
    codes = jnp.asarray([0x01, 0x02, 0x03, 0x3F], jnp.uint8)
    word = 0x01 | (0x02 << 6) | (0x03 << 12) | (0x3F << 18)
    assert np.asarray(pack_fp6(codes)).tolist() == [word & 0xFF, (word >> 8) & 0xFF, word >> 16]
    many = jnp.asarray(np.random.default_rng(0).integers(0, 64, (3, 32)), jnp.uint8)
    np.testing.assert_array_equal(unpack_fp6(pack_fp6(many)), many)


@pytest.mark.parametrize("fmt, bytes_per_32", [("mxfp8_e4m3", 32 + 1), ("mxfp6_e2m3", 24 + 1), ("mxfp4_e2m1", 16 + 1),
                                               ("nvfp4", 16 + 2)])
def test_storage_size_per_32_elements(fmt, bytes_per_32):
    qa = quantize(np.ones((4, 256), np.float32), fmt)
    assert qa.nbytes - (4 if qa.tensor_scale is not None else 0) == 4 * 8 * bytes_per_32


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_per_row_and_per_tensor_scales(fmt):
    x = (np.random.default_rng(0).standard_normal((4, 48)) * np.array([[1], [10], [100], [1e-3]])).astype(np.float32)
    element = FORMATS[fmt].element
    for per_tensor in (False, True):
        qa = quantize(x, fmt, per_tensor=per_tensor)
        amax = np.abs(x).max() if per_tensor else np.abs(x).max(axis=1, keepdims=True)
        scale = (amax * np.float32(1 / element.max_normal)).astype(np.float32)  # float32, as defined
        expected = ml_round((x / scale).astype(np.float32), element).astype(np.float32) * scale
        assert_same(qa.dequantize(), expected)
    assert quantize(x, fmt).scale.shape == (4, 1) and quantize(x, fmt, per_tensor=True).scale.shape == ()


def test_nvfp4_matches_its_definition():
    x = np.random.default_rng(1).standard_t(2, (3, 64)).astype(np.float32)
    qa = quantize(x, "nvfp4")
    tensor_scale = np.abs(x).max() * np.float32(1 / (448 * 6))
    blocks = x.reshape(-1, 16)
    block_scale = ml_round(np.abs(blocks).max(1, keepdims=True) * np.float32(1 / 6) / tensor_scale,
                           FORMATS["fp8_e4m3"].element).astype(np.float32)
    effective = block_scale * tensor_scale
    expected = ml_round(blocks / effective, FORMATS["nvfp4"].element).astype(np.float32) * effective
    assert_same(qa.dequantize(), expected.reshape(x.shape))


def test_int8_and_rotated_int8():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((8, 512)).astype(np.float32)
    x[:, 7] *= 60  # an outlier channel, as real activations have
    w = rng.standard_normal((16, 512)).astype(np.float32)
    scale = np.abs(x).max(1, keepdims=True) * np.float32(1 / 127)
    assert_same(quantize(x, "int8").dequantize(), np.clip(np.round(x / scale), -127, 127).astype(np.float32) * scale)
    h = hadamard(256)
    np.testing.assert_allclose(h @ h.T, np.eye(256), atol=1e-5)
    exact = x @ w.T
    err = lambda fmt: np.linalg.norm(np.asarray(quantize(x, fmt).dequantize()) @ np.asarray(
        quantize(w, fmt).dequantize()).T - exact) / np.linalg.norm(exact)
    assert err("int8_rot") < err("int8") / 2  # the rotation spreads the outlier channel


def test_quantized_array_is_a_pytree_that_jit_handles():
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 40)), jnp.float32)  # 40: padded to 64
    qa = jax.jit(quantize, static_argnames=("fmt", "axis"))(x, fmt="mxfp6_e3m2", axis=-1)
    assert isinstance(qa, QuantizedArray) and qa.shape == (2, 40)
    leaves, treedef = jax.tree_util.tree_flatten(qa)
    again = jax.tree_util.tree_unflatten(treedef, leaves)
    np.testing.assert_array_equal(jax.jit(lambda q: q.dequantize())(again), qa.dequantize())
    assert qa.dequantize().shape == (2, 40)


def test_quantizing_along_another_axis():
    x = np.random.default_rng(4).standard_normal((64, 3)).astype(np.float32)
    assert_same(quantize(x, "mxfp8_e4m3", axis=0).dequantize(), reference_mx(x.T, "mxfp8_e4m3").T)


def test_unknown_format_is_named():
    with pytest.raises(ValueError, match="unknown format 'mxfp5'"):
        quantize(np.ones(4), "mxfp5")


def test_quantized_arrays_save_and_restore_through_orbax_and_take_a_sharding(tmp_path):
    import orbax.checkpoint as ocp

    x = jnp.asarray(np.random.default_rng(5).standard_normal((64, 96)), jnp.float32)
    tree = {fmt: quantize(x, fmt) for fmt in ("mxfp4_e2m1", "mxfp6_e2m3", "mxfp8_e4m3", "fp8_e4m3", "nvfp4", "int8")}
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "q", tree)
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(tmp_path / "q", jax.tree.map(ocp.utils.to_shape_dtype_struct, tree))
    for fmt, qa in tree.items():
        assert isinstance(restored[fmt], QuantizedArray) and restored[fmt].fmt == fmt
        np.testing.assert_array_equal(restored[fmt].dequantize(), qa.dequantize())
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    placed = jax.device_put(tree["mxfp4_e2m1"], jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    assert isinstance(placed, QuantizedArray) and placed.data.sharding.mesh == mesh
