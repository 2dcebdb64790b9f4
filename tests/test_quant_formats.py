"""quant/formats.py: every format against an independent numpy + ml_dtypes rendering of its definition, bit for bit;
packing layouts; the pytree."""

import functools
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
    assert_same(round_trip(jnp.asarray(x), fmt)[1], reference_mx(x, fmt))


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
    quantize_once = jax.jit(quantize, static_argnames="fmt")  # a program a format (op by op, each op compiles)
    formats = ("mxfp4_e2m1", "mxfp6_e2m3", "mxfp8_e4m3", "fp8_e4m3", "nvfp4", "int8")
    tree = {fmt: quantize_once(x, fmt) for fmt in formats}
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "q", tree)
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(tmp_path / "q", jax.tree.map(ocp.utils.to_shape_dtype_struct, tree))
    for fmt, qa in tree.items():
        assert isinstance(restored[fmt], QuantizedArray) and restored[fmt].fmt == fmt
        for got, saved in zip(jax.tree.leaves(restored[fmt]), jax.tree.leaves(qa), strict=True):  # codes and scales
            np.testing.assert_array_equal(np.asarray(got), np.asarray(saved))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    placed = jax.device_put(tree["mxfp4_e2m1"], jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    assert isinstance(placed, QuantizedArray) and placed.data.sharding.mesh == mesh


# --------------------------------------------------------------------------------------------------------------------
# FP8 (per row or per tensor), NVFP4 and INT8: the same checks as the MX formats', adapted to their float32 scales

E2M1, E4M3 = FORMATS["nvfp4"].element, FORMATS["fp8_e4m3"].element
SCALED = ["fp8_e4m3", "fp8_e5m2", "nvfp4", "int8", "int8_rot"]
WIDTHS = (7, 33, 64)  # with 3 rows, the few shapes the tests below share: each shape and format compiles once


@functools.partial(jax.jit, static_argnames=("fmt", "axis", "per_tensor"))
def round_trip(x, fmt: str, axis: int = -1, per_tensor: bool = False) -> tuple[QuantizedArray, jax.Array]:
    """quantize and dequantize as one compiled program (as the models run them): op by op, every new shape
    compiles each of the formats' dozens of operations."""
    qa = quantize(x, fmt, axis, per_tensor=per_tensor)
    return qa, qa.dequantize()


def f32(v) -> np.ndarray:
    """One float32 operation as XLA does it: IEEE rounding, then subnormal results flushed to zero."""
    return flush(np.asarray(v, np.float32)).astype(np.float32)


def reference_fp8(x: np.ndarray, fmt: str, per_tensor: bool) -> np.ndarray:
    """FP8 quantize-dequantize of the rows of x (or of x whole): scale = amax * float32(1 / max) (1 for zeros, NaN
    with a NaN/Inf), elements x / scale rounded by ml_dtypes, float32 products, subnormals flushed. A scale that is
    itself a float32 subnormal (amax below max * 2^-126) is flushed like any other: its row dequantizes to zero."""
    element = FORMATS[fmt].element
    x = f32(x)
    groups = x.reshape(1, -1) if per_tensor else x.reshape(-1, x.shape[-1])
    out = np.empty_like(groups)
    for i, g in enumerate(groups):
        amax = np.abs(g).max()
        if not np.isfinite(g).all():
            out[i] = np.nan
            continue
        scale = f32(amax * np.float32(1 / element.max_normal)) if amax > 0 else np.float32(1)
        out[i] = 0.0 if scale == 0 else f32(ml_round(f32(g / scale), element).astype(np.float32) * scale)
    return out.reshape(x.shape)


def reference_int8(x: np.ndarray) -> np.ndarray:
    """INT8 of the rows of x: scale amax * float32(1 / 127), round half to even, clip to +-127 (never -128)."""
    x = f32(x)
    rows = x.reshape(-1, x.shape[-1])
    out = np.empty_like(rows)
    for i, row in enumerate(rows):
        amax = np.abs(row).max()
        if not np.isfinite(row).all():
            out[i] = np.nan
            continue
        scale = f32(amax * np.float32(1 / 127)) if amax > 0 else np.float32(1)
        out[i] = 0.0 if scale == 0 else f32(np.clip(np.round(f32(row / scale)), -127, 127) * scale)
    return out.reshape(x.shape)


def reference_nvfp4(x: np.ndarray) -> np.ndarray:
    """NVFP4 of the rows of x (padded to 16s): tensor scale amax * float32(1 / (448 * 6)) over the finite values,
    block scales amax / 6 / tensor scale rounded to E4M3, E2M1 elements of x / (block scale * tensor scale); a block
    with NaN/Inf is NaN. A tensor scale below 2^-126 is flushed: every block is zero."""
    x = f32(x)
    n = x.shape[-1]
    padded = np.pad(x.reshape(-1, n), [(0, 0), (0, -n % 16)])
    amax = np.abs(np.where(np.isfinite(padded), padded, 0)).max()
    tensor_scale = f32(amax * np.float32(1 / 2688)) if amax > 0 else np.float32(1)
    blocks = padded.reshape(-1, 16)
    out = np.zeros_like(blocks)
    for i, block in enumerate(blocks):
        if not np.isfinite(block).all():
            out[i] = np.nan
            continue
        if tensor_scale == 0:
            continue
        block_scale = ml_round(f32(f32(np.abs(block).max() * np.float32(1 / 6)) / tensor_scale), E4M3)
        effective = f32(np.float32(block_scale) * tensor_scale)
        if effective > 0:
            out[i] = f32(ml_round(f32(block / effective), E2M1).astype(np.float32) * effective)
    return out.reshape(padded.shape)[:, :n].reshape(x.shape)


magnitudes_down_to_flushed_scales = st.sampled_from([1e-40, 1e-37, 1e-35, 1e-33, 1e-6, 1.0, 1e6, 3e38])


@st.composite
def rows_of(draw, widths=WIDTHS, allow_special=False, magnitudes=magnitudes_down_to_flushed_scales):
    """(3, width) float32 rows: uniform at a magnitude (down to rows whose scales are float32 subnormals), heavy
    tailed, one all-zero row (and block) beside others, float32 subnormals, or any float32 values."""
    shape = (3, draw(st.sampled_from(widths)))
    kind = draw(st.sampled_from(["uniform", "heavy", "zero", "subnormal", "mixed"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if kind == "uniform":
        x = rng.uniform(-1, 1, shape) * draw(magnitudes)
    elif kind == "heavy":
        x = rng.standard_t(1, shape)
    elif kind == "zero":
        x = rng.standard_normal(shape)
        x[0] = 0.0
    elif kind == "subnormal":
        x = rng.standard_normal(shape) * 1e-39
    else:
        x = draw(hnp.arrays(np.float32, shape, elements=floats32))
    x = np.asarray(x, np.float32)
    if allow_special and draw(st.booleans()):
        x[draw(st.integers(0, shape[0] - 1)), draw(st.integers(0, shape[1] - 1))] = draw(
            st.sampled_from([np.nan, np.inf, -np.inf]))
    return x


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@given(x=rows_of(allow_special=True), per_tensor=st.booleans())
@settings(max_examples=60, deadline=None)
def test_fp8_quantize_dequantize_matches_its_definition(fmt, x, per_tensor):
    assert_same(round_trip(x, fmt, per_tensor=per_tensor)[1], reference_fp8(x, fmt, per_tensor))


@given(x=rows_of(allow_special=True))
@settings(max_examples=60, deadline=None)
def test_int8_quantize_dequantize_matches_its_definition(x):
    qa, out = round_trip(x, "int8")
    assert_same(out, reference_int8(x))
    assert np.asarray(qa.data).min() >= -127  # symmetric: -128 is never used


@given(x=rows_of(allow_special=True))
@settings(max_examples=60, deadline=None)
def test_nvfp4_quantize_dequantize_matches_its_definition(x):
    assert_same(round_trip(x, "nvfp4")[1], reference_nvfp4(x))


def saturated_step(v: np.ndarray, element) -> np.ndarray:
    """The most that rounding |v| to `element` may lose: half the spacing of its values around |v| (the subnormal
    spacing below the smallest normal), or what saturating at its largest value loses beyond it."""
    a = np.abs(v.astype(np.float64))
    exponent = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    return np.maximum(0.5 * 2.0 ** (np.maximum(exponent, element.emin) - element.mbits), a - element.max_normal)


@pytest.mark.parametrize("fmt", SCALED)
@given(x=rows_of(widths=(33, 256)))
@settings(max_examples=40, deadline=None)
def test_error_is_at_most_half_a_step_of_the_scaled_format(fmt, x):
    """|dequantized - x| <= half the spacing of the format's values at x in x's units (the scale times the element
    spacing; INT8's spacing is its scale), or what saturation loses (NVFP4 blocks with subnormal E4M3 scales clip),
    plus float32 rounding of the scaling and dequantized values below 2^-126 flushed. int8_rot: the same in the
    rotated basis, so over a row in the L2 norm, sqrt(n) / 2 scales. Where a scale is flushed (a row far below
    float32's normal range, or an NVFP4 block below the range of its E4M3 block scales), the whole row or block is
    zero, and the test bounds what is lost."""
    f = FORMATS[fmt]
    if f.rotated:
        x = np.clip(x, -1e36, 1e36)  # the float32 rotation overflows beyond (a sum of 256 products)
    qa, out = round_trip(x, fmt)
    out = np.asarray(out, np.float64)
    x64 = flush(x.astype(np.float64))
    rounding = 2.0**-22 * np.abs(x64) + TINY
    if f.kind == "nvfp4":
        n = x.shape[-1]
        pad = lambda a: np.pad(a, [(0, 0), (0, -n % 16)]).reshape(a.shape[0], -1, 16)  # noqa: E731
        tensor_scale = float(qa.tensor_scale)
        scale_codes = np.asarray(qa.scale).view(np.uint8)
        effective = np.asarray(decode(jnp.asarray(scale_codes), E4M3), np.float64)[..., None] * tensor_scale
        effective = np.where(effective < TINY, 0.0, effective)
        v = pad(x64) / np.where(effective > 0, effective, 1.0)
        # lost whole: a block whose E4M3 scale rounds to 0 or whose effective scale is flushed (every block, where
        # the tensor scale itself is)
        lost = (max(6 * tensor_scale * 2.0**-10, 7 * TINY) if tensor_scale > 0 else 2688 * TINY) * (1 + 2.0**-20)
        bound = np.where(effective > 0, saturated_step(v, E2M1) * effective, lost) + pad(rounding)
        assert (np.abs(pad(out) - pad(x64)) <= bound).all()
        return
    scale = np.asarray(qa.scale, np.float64)
    if f.rotated:
        n = qa.data.shape[-1]
        error, norm = np.linalg.norm(out - x64, axis=-1), np.linalg.norm(x64, axis=-1)
        bound = np.where(scale[:, 0] > 0, 0.5 * scale[:, 0] * np.sqrt(n), np.sqrt(n) * 127 * TINY) * (1 + 1e-5)
        assert (error <= bound + 5e-5 * norm + TINY).all()  # two 256-term float32 rotations: ~n * 2^-24 each
        return
    top = f.element.max_normal if f.element else 127.0
    v = x64 / np.where(scale > 0, scale, 1.0)
    step = saturated_step(v, f.element) if f.element else np.maximum(0.5, np.abs(v) - 127)
    bound = np.where(scale > 0, step * scale, top * TINY * (1 + 2.0**-20)) + rounding
    assert (np.abs(out - x64) <= bound).all()


def grid_values(element, shape, rng) -> np.ndarray:
    """Values of `element` (INT8: -127..127) at random, each row's (NVFP4: each block's) first place holding the
    largest magnitude, so that the scale is the one they were drawn with."""
    if element is None:
        values = rng.integers(-127, 128, shape).astype(np.float32)
        values[..., 0] = rng.choice([-127.0, 127.0], shape[:-1])
        return values
    codes = np.arange(2**element.bits, dtype=np.uint8)
    grid = codes.view(ML[element.name]).astype(np.float32)
    grid = grid[np.isfinite(grid)]
    values = rng.choice(grid, shape).astype(np.float32)
    values[..., 0] = rng.choice([-element.max_normal, element.max_normal], shape[:-1])
    return values


@pytest.mark.parametrize("fmt", [f for f in formats() if not FORMATS[f].rotated])
@given(data=st.data())
@settings(max_examples=30, deadline=None)
def test_values_on_the_format_grid_round_trip_exactly(fmt, data):
    """x made of the format's own values times a power-of-two scale (the largest value in every row or block, so
    the scale is the one drawn) quantizes to those values: dequantizing gives x back bit for bit."""
    f = FORMATS[fmt]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    rows, width = 3, 64
    if f.kind == "nvfp4":
        blocks = grid_values(E2M1, (rows, width // 16, 16), rng)
        block_scales = grid_values(E4M3, (rows * width // 16,), rng)
        block_scales = np.abs(block_scales).reshape(rows, width // 16, 1)  # one block at 448: the tensor's amax
        blocks = np.where(block_scales > 0, blocks, 0.0)  # a zero block scale is a zero block
        tensor_scale = np.float32(2.0 ** data.draw(st.integers(-30, 30)))
        x = f32(blocks * f32(block_scales * tensor_scale)).reshape(rows, width)
    else:
        blocks = grid_values(f.element, (rows, width // (f.block or width), f.block or width), rng)
        low, high = (-14, 16) if fmt == "int8_b32" else (-30, 31)  # int8_b32: float16 scales, normal ones
        scales = 2.0 ** rng.integers(low, high, (rows, width // (f.block or width), 1))
        x = f32(blocks * scales).reshape(rows, width)
    np.testing.assert_array_equal(np.asarray(round_trip(x, fmt)[1]), x)


@pytest.mark.parametrize("fmt", formats())
@given(x=rows_of(widths=(64,), allow_special=True))
@settings(max_examples=30, deadline=None)
def test_negating_the_input_negates_the_output(fmt, x):
    """Round to nearest (ties to even) and amax scales are symmetric: the same scales, the opposite values."""
    (qa, out), (qn, negated) = round_trip(x, fmt), round_trip(-x, fmt)
    assert_same(negated, -np.asarray(out))
    np.testing.assert_array_equal(np.asarray(qn.scale).view(np.uint8), np.asarray(qa.scale).view(np.uint8))


@pytest.mark.parametrize("fmt", formats())
@given(data=st.data())
@settings(max_examples=30, deadline=None)
def test_scaling_the_input_by_a_power_of_two_scales_the_output(fmt, data):
    """Scales follow amax exactly: x * 2^k quantizes to the same elements, its dequantized values are those of x
    times 2^k (within float32's normal range, where nothing is flushed or overflows)."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    if fmt == "int8_b32":  # float16 scales: amax / 127 within float16's normal range, 6.1e-5 to 65504
        x = (rng.standard_t(2, (3, 64)) * 10.0 ** data.draw(st.integers(0, 2))).astype(np.float32)
        k = data.draw(st.integers(-4, 4))
    else:
        x = (rng.standard_t(2, (3, 64)) * 10.0 ** data.draw(st.integers(-8, 8))).astype(np.float32)
        k = data.draw(st.integers(-20, 20))
    (qa, out), (qk, scaled) = round_trip(x, fmt), round_trip(x * np.float32(2.0**k), fmt)
    np.testing.assert_array_equal(np.asarray(qk.data).view(np.uint8), np.asarray(qa.data).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(scaled), np.asarray(out) * np.float32(2.0**k))


def test_zero_and_non_finite_rows_and_blocks_of_the_scaled_formats():
    """A zero row gets scale 1 and zero elements, a row with NaN or Inf dequantizes to NaN and leaves the others
    alone; NVFP4: a zero block gets block scale 0, a block with Inf the NaN scale (E4M3 0x7F) without moving the
    tensor scale, an all-zero tensor the tensor scale 1; per tensor, one Inf makes the whole tensor NaN."""
    x = np.random.default_rng(6).standard_normal((3, 64)).astype(np.float32)
    x[0] = 0.0
    x[2, 5] = np.inf
    for fmt in ("fp8_e4m3", "fp8_e5m2", "int8", "int8_rot"):
        qa, out = round_trip(x, fmt)
        out = np.asarray(out)
        assert float(qa.scale[0, 0]) == 1.0 and (np.asarray(qa.data[0]).astype(np.float32) == 0).all()
        assert (out[0] == 0).all() and np.isfinite(out[1]).all() and np.isnan(out[2]).all()
    assert np.isnan(np.asarray(round_trip(x, "fp8_e4m3", per_tensor=True)[1])).all()

    qa, out = round_trip(x, "nvfp4")
    codes = np.asarray(qa.scale).view(np.uint8)
    assert codes[0].tolist() == [0, 0, 0, 0] and codes[2, 0] == 0x7F and (codes[2, 1:] != 0x7F).all()
    finite = np.where(np.isfinite(x), x, 0)
    assert float(qa.tensor_scale) == np.float32(np.abs(finite).max() * np.float32(1 / 2688))
    out = np.asarray(out)
    assert (out[0] == 0).all() and np.isnan(out[2, :16]).all() and np.isfinite(out[2, 16:]).all()
    zeros, out = round_trip(np.zeros((3, 64), np.float32), "nvfp4")
    assert float(zeros.tensor_scale) == 1.0 and (np.asarray(out) == 0).all()


@pytest.mark.parametrize("fmt", SCALED)
@pytest.mark.parametrize("shape, axis", [((17,), 0), ((3, 7), 0), ((2, 3, 33), 1)])
def test_storage_shapes_and_any_axis(fmt, shape, axis):
    """The quantized axis moves last and pads to whole blocks (16 for NVFP4, 256 for the rotation); one scale per
    row (per 16-block for NVFP4); quantizing along any axis is quantizing that axis moved last."""
    x = np.random.default_rng(len(shape)).standard_normal(shape).astype(np.float32)
    qa, out = round_trip(x, fmt, axis=axis)
    lead = tuple(np.delete(np.array(shape), axis))
    n = shape[axis]
    f = FORMATS[fmt]
    assert qa.shape == shape and qa.axis == axis
    if f.kind == "nvfp4":
        blocks = -(-n // 16)
        assert qa.data.shape == (*lead, 8 * blocks) and qa.data.dtype == jnp.uint8
        assert qa.scale.shape == (*lead, blocks) and qa.scale.dtype == jnp.float8_e4m3fn and qa.tensor_scale.shape == ()
    else:
        padded = n + (-n % f.block if f.block else 0)
        dtype = jnp.int8 if f.kind == "int8" else {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}[f.element.name]
        assert qa.data.shape == (*lead, padded) and qa.data.dtype == dtype
        assert qa.scale.shape == (*lead, 1) and qa.scale.dtype == jnp.float32 and qa.tensor_scale is None
    assert out.shape == x.shape
    moved = np.moveaxis(x, axis, -1)
    if f.rotated:
        expected = np.asarray(round_trip(moved, fmt)[1])
    else:
        expected = {"fp8": lambda m: reference_fp8(m, fmt, False), "int8": reference_int8,
                    "nvfp4": reference_nvfp4}[f.kind](moved)
    assert_same(out, np.moveaxis(expected, -1, axis))


def test_every_format_has_an_admission_gate():
    from mxdit.quant.gates import GATES

    assert set(formats()) <= set(GATES)
