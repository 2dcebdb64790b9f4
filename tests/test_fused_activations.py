"""FP8 activations fused with their producer (pallas_kernels/activations.py): the Triton kernels in interpret mode
against the jnp reference, and the reference against the models' own arithmetic."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from mxdit.pallas_kernels import activations as A
from mxdit.pallas_kernels.gemm import quantize_activations


def _inputs(d, dtype=jnp.bfloat16, batch=2, seq=5):
    k = jax.random.split(jax.random.key(d), 4)
    x = jax.random.normal(k[0], (batch, seq, d)) * 3
    x = x.at[0, 1].set(0.0).at[1, 2, 7].set(300.0)  # a zero row; an outlier
    return (x.astype(dtype), jax.random.normal(k[1], (d,)) * 0.1,
            (jax.random.normal(k[2], (batch, 1, d)) * 0.3).astype(dtype),
            (jax.random.normal(k[3], (batch, 1, d)) * 0.3).astype(dtype))


def _same(a, b, exact=True):
    """Equal FP8 values and scales; not `exact` (float32 models): scales within an ulp or two (a fused multiply-add
    may round once where the other rounds twice), values equal but for a rare rounding tie."""
    va, vb = np.asarray(a[0].astype(jnp.float32)), np.asarray(b[0].astype(jnp.float32))
    if exact:
        np.testing.assert_array_equal(va, vb)
        np.testing.assert_array_equal(np.asarray(a[1]), np.asarray(b[1]))
    else:
        assert np.mean(va == vb) >= 0.99
        np.testing.assert_allclose(np.asarray(a[1]), np.asarray(b[1]), rtol=1e-6)


@pytest.mark.parametrize("d, dtype", [(96, jnp.bfloat16), (256, jnp.bfloat16), (96, jnp.float32)])
def test_modulated_norm_kernel_equals_reference(d, dtype):
    """Rows whose length is not a power of two (96 = 3 chunks of 32) and per-image modulation: bit-equal values and
    scales; the zero row gets scale 1 and zeros."""
    args = _inputs(d, dtype)
    kernel = A.modulated_rms_norm_fp8(*args, 1e-5, interpret=True)
    reference = A.modulated_rms_norm_fp8(*args, 1e-5, backend="reference")
    _same(kernel, reference, exact=dtype == jnp.bfloat16)
    assert kernel[0].dtype == jnp.float8_e4m3fn and kernel[0].shape == (2, 5, -(-d // 128) * 128) and kernel[1].shape == (2, 5)


@pytest.mark.parametrize("rows", [2, 8])
def test_modulated_norms_several_rows_a_program_equal_one_row_a_program(rows):
    """`rows_per_program`: a program loops over its rows with the norm's vectors loaded once (and the next row loaded
    before a row's work); the same values and scales as a program a row, zero and outlier rows included (both
    norms); a count that does not divide the sequence is named."""
    x, w, scale, shift = _inputs(96, seq=8)
    x = x.at[1, 5].set(jnp.nan)  # a non-finite row: its scale NaN, as one row a program gives it
    for fn in (lambda **kw: A.modulated_rms_norm_fp8(x, w, scale, shift, 1e-5, interpret=True, **kw),
               lambda **kw: A.modulated_layer_norm_fp8(x, scale, shift, 1e-6, interpret=True, **kw)):
        one, several = fn(rows_per_program=1), fn(rows_per_program=rows)
        np.testing.assert_array_equal(np.asarray(several[0].astype(jnp.float32)), np.asarray(one[0].astype(jnp.float32)))
        np.testing.assert_array_equal(np.asarray(several[1]), np.asarray(one[1]))
        assert np.isnan(np.asarray(one[1][1, 5])) and np.isfinite(np.asarray(one[1][0])).all()
    with pytest.raises(ValueError, match="rows_per_program 3 must be a power of two dividing the sequence length 8"):
        A.modulated_rms_norm_fp8(x, w, scale, shift, 1e-5, interpret=True, rows_per_program=3)


@pytest.mark.parametrize("rows", [2, 4])
def test_row_kernels_several_rows_a_program_equal_one_row_a_program(rows):
    """SwiGLU, `tokens_fp8` and the sigmoid gate with `rows_per_program` > 1: the same values and scales as a program
    a row (zero, outlier and NaN rows included)."""
    x = _inputs(96, seq=8)[0].at[1, 5].set(jnp.nan)
    gate_up = jnp.concatenate([x, 0.5 * x[..., ::-1]], axis=-1)
    stacked = jnp.concatenate([x[..., :32], -x, x[..., :16]], axis=-1)
    for fn in (lambda **kw: A.swiglu_fp8(gate_up, interpret=True, **kw),
               lambda **kw: A.tokens_fp8(x, interpret=True, **kw),
               lambda **kw: A.sigmoid_gated_fp8(x, stacked, 32, interpret=True, **kw)):
        one, several = fn(rows_per_program=1), fn(rows_per_program=rows)
        np.testing.assert_array_equal(np.asarray(several[0], np.float32), np.asarray(one[0], np.float32))
        np.testing.assert_array_equal(np.asarray(several[1]), np.asarray(one[1]))
        assert np.isnan(np.asarray(one[1][1, 5])) and np.isfinite(np.asarray(one[1][0])).all()


def test_rows_per_program_default_divides_the_sequence():
    """None: the largest power of two dividing the sequence up to the kernel's most, 8 for the norms (4224 = 2^7 x 33
    tokens take 8; an odd length takes 1), 1 for the others."""
    name = "modulated_rms_norm_fp8"
    assert [A._rows_per_program(name, s, None) for s in (4224, 4608, 12, 6, 5)] == [8, 8, 4, 2, 1]
    assert A._rows_per_program("tokens_fp8", 4224, None) == 1
    assert A._rows_per_program("tokens_fp8", 12, 2) == 2
    with pytest.raises(ValueError, match="tokens_fp8: rows_per_program 8 must be a power of two dividing"):
        A._rows_per_program("tokens_fp8", 12, 8)


def test_modulated_norm_reference_is_the_models_arithmetic():
    """The reference is Krea 2's adaptive norm (RMSNorm module, then `(1 + scale) * norm + shift`) quantized by
    `quantize_activations`, bit for bit."""
    from mxdit.model.krea2 import RMSNorm

    x, w, scale, shift = _inputs(128)
    norm = RMSNorm(128, 1e-5)
    norm.weight.set_value(w)
    model = (1.0 + scale) * norm(x) + shift
    values, scales = quantize_activations(model.reshape(-1, 128))
    _same(A.modulated_rms_norm_fp8(x, w, scale, shift, 1e-5, backend="reference"),
          (values.reshape(2, 5, 128), scales.reshape(2, 5)))


@pytest.mark.parametrize("d, dtype", [(96, jnp.bfloat16), (256, jnp.bfloat16), (96, jnp.float32)])
def test_modulated_layer_norm_kernel_equals_reference(d, dtype):
    """FLUX.1's adaptive norm (LayerNorm, no weight): the kernel's values and scales against the reference, which is
    FLUX.1's own composition quantized by `quantize_activations`, bit for bit."""
    from mxdit.model.flux import layer_norm

    x, _, scale, shift = _inputs(d, dtype)
    x = x + 2.0  # a row mean for the centring to matter
    kernel = A.modulated_layer_norm_fp8(x, scale, shift, 1e-6, interpret=True)
    reference = A.modulated_layer_norm_fp8(x, scale, shift, 1e-6, backend="reference")
    _same(kernel, reference, exact=dtype == jnp.bfloat16)
    model = layer_norm(x) * (1 + scale) + shift
    values, scales = quantize_activations(model.reshape(-1, d))
    _same(reference, (values.reshape(2, 5, -1), scales.reshape(2, 5)))


@pytest.mark.parametrize("h", [64, 96])
def test_swiglu_kernel_equals_reference(h):
    gate_up = (jax.random.normal(jax.random.key(h), (2, 5, 2 * h)) * 3).astype(jnp.bfloat16)
    gate_up = gate_up.at[1, 3].set(0.0)
    kernel = A.swiglu_fp8(gate_up, interpret=True)
    _same(kernel, A.swiglu_fp8(gate_up, backend="reference"))
    assert kernel[0].shape == (2, 5, 128)
    np.testing.assert_array_equal(np.asarray(kernel[1][1, 3]), 1.0)


@pytest.mark.parametrize("d", [96, 256])
def test_tokens_kernel_equals_quantize_activations(d):
    """`tokens_fp8` (SwiGLU's output from the GEMM epilogue, quantized in one pass): `quantize_activations`' values
    and scales, a zero row and an outlier among them."""
    y = _inputs(d)[0]
    kernel = A.tokens_fp8(y, interpret=True)
    values, scales = quantize_activations(y.reshape(-1, d))
    _same(kernel, (values.reshape(2, 5, -1), scales.reshape(2, 5)))
    _same(kernel, A.tokens_fp8(y, backend="reference"))
    assert kernel[0].shape == (2, 5, -(-d // 128) * 128)


def test_swiglu_reference_agrees_with_the_model_within_bf16_rounding():
    """PyTorch's rounding (silu in float32, rounded; the product rounded) against XLA's bf16 `jax.nn.silu(g) * u`:
    both within bf16 rounding of the float32 value."""
    gate_up = (jax.random.normal(jax.random.key(0), (1, 64, 512)) * 3).astype(jnp.bfloat16)
    ours = A.swiglu(gate_up).astype(jnp.float32)
    gate, up = jnp.split(gate_up, 2, axis=-1)
    xla = (jax.nn.silu(gate) * up).astype(jnp.float32)
    g32, u32 = gate.astype(jnp.float32), up.astype(jnp.float32)
    exact = jax.nn.silu(g32) * u32
    for y in (ours, xla):
        assert float(jnp.max(jnp.abs(y - exact) / (jnp.abs(exact) + 1e-3))) < 2 ** -6
    assert float(jnp.mean(jnp.abs(ours - exact))) <= float(jnp.mean(jnp.abs(xla - exact)))


def test_non_finite_rows_get_a_nan_scale():
    """A row holding Inf gets a NaN scale (what `quantize_activations` gives it: the GEMM output row is NaN, which
    the quality gates count), the other rows are untouched."""
    x, w, scale, shift = _inputs(64)
    x = x.at[1, 4, 3].set(jnp.inf)
    for backend in ("reference", "triton"):
        _, scales = A.modulated_rms_norm_fp8(x, w, scale, shift, 1e-5, backend=backend, interpret=True)
        assert np.isnan(float(scales[1, 4])) and np.isfinite(np.asarray(scales[0])).all()


def test_bad_arguments_are_named():
    x, w, scale, shift = _inputs(64)
    with pytest.raises(ValueError, match="backend must be"):
        A.modulated_rms_norm_fp8(x, w, scale, shift, 1e-5, backend="mosaic")
    with pytest.raises(ValueError, match="row length 72 needs a power-of-two divisor"):
        A.swiglu_fp8(jnp.ones((1, 2, 144), jnp.bfloat16), interpret=True)


def test_sigmoid_gated_kernel_reads_the_gate_in_place():
    """The gate as a slice of the stacked Q/K/V/gate product, read at its offset: bit-equal to the reference; the
    reference is `out * sigmoid(gate)` within bf16 rounding."""
    k = jax.random.split(jax.random.key(5), 2)
    out = (jax.random.normal(k[0], (1, 6, 96)) * 2).astype(jnp.bfloat16)
    stacked = (jax.random.normal(k[1], (1, 6, 96 + 64 + 96)) * 3).astype(jnp.bfloat16)  # [q | k, v | gate]
    kernel = A.sigmoid_gated_fp8(out, stacked, 160, interpret=True)
    _same(kernel, A.sigmoid_gated_fp8(out, stacked, 160, backend="reference"))
    gate = stacked[..., 160:]
    exact = out.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))
    ours = A.sigmoid_gated(out, gate).astype(jnp.float32)
    assert float(jnp.max(jnp.abs(ours - exact) / (jnp.abs(exact) + 1e-3))) < 2 ** -6
    with pytest.raises(ValueError, match="does not fit in the stacked product"):
        A.sigmoid_gated_fp8(out, stacked, 200, interpret=True)


def _rows_at_e4m3_ties(rng, rows=64, d=512):
    """Rows whose values times the scale's reciprocal land on E4M3 rounding ties or an ulp beside them (normal and
    subnormal codes), where dividing instead would round some of them the other way."""
    grid = np.arange(0, 448, 2.0 ** -9, dtype=np.float64)
    e4m3 = np.unique(grid.astype(ml_dtypes.float8_e4m3fn).astype(np.float64))
    ties = (e4m3[:-1] + e4m3[1:]) / 2
    x = np.empty((rows, d), np.float32)
    for r in range(rows):
        step = np.float32(rng.uniform(0.5, 2.0) * 2.0 ** rng.integers(-20, 20))
        x[r, 0] = np.float32(448) * step
        y = (rng.choice(ties, d - 1) * np.float64(step)).astype(np.float32)
        y = np.nextafter(y, y * rng.choice([-1.0, 0.0, 1.0, 2.0], d - 1).astype(np.float32))  # ulp below, on, above
        x[r, 1:] = y * rng.choice([-1, 1], d - 1).astype(np.float32)
    return x


def test_fp8_rows_are_values_times_the_reciprocal_on_every_path():
    """The FP8 rule (scale amax * float32(1/448), values times its reciprocal rounded once, RNE to E4M3), computed
    in numpy, gives the codes of XLA's `quantize_activations`, of `quant.formats.quantize` and of the row kernel in
    interpret mode, bit for bit, at E4M3 ties; IEEE division would give other codes there (which is why the kernels
    multiply by the reciprocal too, `activations.reciprocal_products`)."""
    from mxdit.quant.formats import quantize

    x = _rows_at_e4m3_ties(np.random.default_rng(0))
    amax = np.abs(x).max(axis=1, keepdims=True)
    step = (amax * np.float32(1 / 448)).astype(np.float32)
    want = np.clip(x * (np.float32(1) / step), -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    divided = np.clip(x / step, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert np.mean(divided != want) > 1e-3  # the rows are hard: division rounds some the other way
    values, scales = quantize_activations(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(values.astype(jnp.float32)), want)
    np.testing.assert_array_equal(np.asarray(scales), step[:, 0])
    q = quantize(jnp.asarray(x), "fp8_e4m3", axis=-1)
    np.testing.assert_array_equal(np.asarray(q.data.astype(jnp.float32)), want)
    kernel_values, _ = A.tokens_fp8(jnp.asarray(x)[None], interpret=True)
    np.testing.assert_array_equal(np.asarray(kernel_values[0].astype(jnp.float32)), want)


def test_models_take_the_composition_for_rows_the_kernels_do_not_take():
    """A row width 16 does not divide (the tiny Krea 2 fixture's 24-wide text blocks) has no kernel: the models'
    producer gives the composition's values instead of the kernel's error."""
    from mxdit.ops.linear import fused_fp8_producer

    assert A.kernel_takes_row(6144) and A.kernel_takes_row(16) and not A.kernel_takes_row(24)
    out, _, _, _ = _inputs(24)
    stacked = jnp.concatenate([out, -out, out], axis=-1)
    got = fused_fp8_producer("sigmoid_gated_fp8", "triton")(out, stacked, gate_offset=24)
    _same(got, A.sigmoid_gated_fp8(out, stacked, 24, backend="reference"))
    gate_up = jnp.concatenate([out, out], axis=-1)
    _same(fused_fp8_producer("swiglu_fp8", "triton")(gate_up), A.swiglu_fp8(gate_up, backend="reference"))
