"""The block-scaled GEMM kernels (Mosaic GPU and Triton lowering, in Pallas interpret mode on the CPU) against the
plain-jnp definition, on shapes that are not multiples of the tiles."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mxdit.pallas_kernels import gemm
from mxdit.quant import quantize

from conftest import relative_l2

M, K, N = 130, 200, 72  # K pads to 256; M and N are not multiples of any tile
SMALL_MOSAIC = gemm.MosaicConfig(tile_m=64, tile_n=64, max_concurrent_steps=2)
SMALL_TRITON = gemm.TritonConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)


def _operands(seed=0, m=M, k=K, n=N):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k), jnp.float32)
    w = jax.random.normal(kw, (n, k), jnp.float32) * k**-0.5
    return x, w


def _run(backend, x, w_prepared, scaling, **epilogue):
    config = SMALL_MOSAIC if backend == "mosaic" else SMALL_TRITON
    fmt = w_prepared.fmt if w_prepared.fmt.startswith("int8") else "fp8_e4m3"
    xq, xs = gemm.quantize_activations(x, scaling, fmt)
    y = gemm.scaled_matmul(xq, w_prepared, xs, backend=backend, config=config, interpret=True, out_dtype=jnp.float32,
                           **epilogue)
    ref = gemm.scaled_matmul_reference(xq, xs, w_prepared, out_dtype=jnp.float32, **epilogue)
    return np.asarray(y), np.asarray(ref)


@pytest.mark.parametrize("scaling", ["token", "block"])
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "mxfp6_e2m3", "mxfp4_e2m1"])
def test_mosaic_kernel_matches_the_definition(fmt, scaling):
    x, w = _operands()
    # MX folded per channel (a vector promotion); the per-tile default is the next test
    y, ref = _run("mosaic", x, gemm.prepare_weight(w, fmt, backend="mosaic", mx_fold_rows=1), scaling)
    assert y.shape == (M, N)
    assert relative_l2(y, ref) < 1e-6


@pytest.mark.parametrize("scaling", ["token", "block"])
def test_mosaic_kernel_with_mx_folded_per_128x128_tile(scaling):
    """One weight scale per 128x128 tile (the default): the kernel promotes with a scalar."""
    x, w = _operands(9)
    wq = gemm.prepare_weight(w, "mxfp6_e2m3", backend="mosaic")
    assert wq.scale_rows == 128 and np.all(np.asarray(wq.scale)[:, :N] == np.asarray(wq.scale)[:, :1])
    y, ref = _run("mosaic", x, wq, scaling)
    assert relative_l2(y, ref) < 1e-6
    assert gemm.fold_mx_error(quantize(w, "mxfp6_e2m3"), rows=128) == 0.0  # ordinary weights: still exact


@pytest.mark.parametrize("scaling", ["token", "block"])
def test_mosaic_kernel_with_three_compute_warpgroups(scaling):
    """CTA rows split over three warpgroups (the default for block-scaled products when M allows)."""
    x, w = _operands(3)
    wq = gemm.prepare_weight(w, "fp8_e4m3", backend="mosaic")
    xq, xs = gemm.quantize_activations(x, scaling)
    config = gemm.MosaicConfig(64, 64, 2, compute_wgs=3)
    y = gemm.scaled_matmul(xq, wq, xs, backend="mosaic", config=config, interpret=True, out_dtype=jnp.float32)
    ref = gemm.scaled_matmul_reference(xq, xs, wq, out_dtype=jnp.float32)
    assert relative_l2(np.asarray(y), np.asarray(ref)) < 1e-6


@pytest.mark.parametrize("fmt,scaling", [("fp8_e4m3", "token"), ("fp8_e4m3", "block"), ("mxfp8_e4m3", "token"),
                                         ("mxfp6_e2m3", "block"), ("mxfp6_e3m2", "token"), ("mxfp4_e2m1", "token"),
                                         ("int8", "token"), ("int8_rot", "token")])
def test_triton_kernel_matches_the_definition_for_every_weight_format(fmt, scaling):
    x, w = _operands(1)
    y, ref = _run("triton", x, gemm.prepare_weight(w, fmt, backend="triton"), scaling)
    assert relative_l2(y, ref) < 1e-6
    # ...and the definition is the product of the operands up to their quantization error (2 or 1 mantissa bits
    # for E3M2 and E2M1 weights, 3 or more for the rest).
    assert relative_l2(y, x @ w.T) < {"mxfp6_e3m2": 0.08, "mxfp4_e2m1": 0.15}.get(fmt, 0.04)


@pytest.mark.parametrize("backend", ["mosaic", "triton"])
def test_fused_epilogue_is_residual_plus_gate_times_activation(backend):
    x, w = _operands(2)
    kb, kg, kr = jax.random.split(jax.random.key(3), 3)
    epilogue = dict(bias=jax.random.normal(kb, (N,)), gate=jax.random.normal(kg, (N,)), activation="gelu_tanh",
                    residual=jax.random.normal(kr, (M, N)))
    y, ref = _run(backend, x, gemm.prepare_weight(w, "fp8_e4m3", backend=backend), "block", **epilogue)
    assert relative_l2(y, ref) < 1e-6
    plain, _ = _run(backend, x, gemm.prepare_weight(w, "fp8_e4m3", backend=backend), "block")
    expected = epilogue["residual"] + epilogue["gate"] * jax.nn.gelu(plain + epilogue["bias"], approximate=True)
    assert relative_l2(y, expected) < 1e-6


def test_default_mosaic_tiles_fit_shared_memory_for_float32_outputs():
    """The default tiles are tuned for bf16 outputs; float32 ones double the output's staging, which overflowed
    shared memory at 4224 x 16384 -> 2048 (281712 bytes > 232448). `scaled_matmul` narrows
    the output slices (then the ring) until they fit, and leaves the bf16 defaults as they are."""
    assert abs(gemm.mosaic_shared_memory_bytes(gemm.default_mosaic_config(4224, 2048, 16384, False), 4)
               - 281712) < 0.01 * 281712  # the estimate against Mosaic's count for the failing case
    for m in (1024, 4224, 4608):
        for n, k in ((2048, 16384), (6144, 6144), (32768, 6144)):
            for block_scaled in (False, True):
                for residual in (False, True):
                    config = gemm.default_mosaic_config(m, n, k, block_scaled, residual)
                    options = dict(block_scaled=block_scaled, col_vectors=3)  # scales, bias and gate
                    assert gemm.config._fit_shared_memory(config, 2, **options) == config  # bf16: unchanged
                    fitted = gemm.config._fit_shared_memory(config, 4, **options)
                    assert gemm.mosaic_shared_memory_bytes(fitted, 4, **options) <= gemm.SHARED_MEMORY_BYTES - 2048
                    assert (fitted.tile_m, fitted.tile_n, fitted.compute_wgs) == (
                        config.tile_m, config.tile_n, config.compute_wgs)


@pytest.mark.parametrize("config", [
    gemm.MosaicConfig(64, 128, 2, epi_tile_n=64, prefetch_residual=True),
    gemm.MosaicConfig(64, 192, 2, epi_tile_n=64, prefetch_residual=True),  # the third slice waits for its slot
    gemm.default_mosaic_config(4224, 6144, 6144, False, residual=True),
    gemm.default_mosaic_config(4224, 6144, 6144, False, residual=False),
], ids=["128", "192", "default-M4224-residual", "default-M4224"])
def test_mosaic_residual_epilogue_with_large_tiles_and_prefetch(config):
    """The residual's first two column slices fetched when a tile starts (into the output's staging slots); the
    defaults for M = 4224 (64 x 256 tiles). Several tiles run one after another in each slot."""
    n = 2 * config.tile_n
    x, w = _operands(8, m=128, k=384, n=n)
    residual = jax.random.normal(jax.random.key(4), (128, n))
    wq = gemm.prepare_weight(w, "fp8_e4m3", backend="mosaic")
    xq, xs = gemm.quantize_activations(x, "token")
    y = gemm.scaled_matmul(xq, wq, xs, residual=residual, backend="mosaic", config=config, interpret=True,
                           out_dtype=jnp.float32)
    ref = gemm.scaled_matmul_reference(xq, xs, wq, residual=residual, out_dtype=jnp.float32)
    assert relative_l2(np.asarray(y), np.asarray(ref)) < 1e-6


@pytest.mark.parametrize("backend,config,scaling", [
    ("mosaic", gemm.MosaicConfig(64, 128, 2), "token"),
    ("mosaic", gemm.MosaicConfig(64, 128, 2), "block"),  # the promoting main loop
    ("mosaic", gemm.default_mosaic_config(4224, 6144, 32768, False), "token"),  # 64 x 256 tiles: two pairs a tile
    ("triton", SMALL_TRITON, "token"),
    ("reference", None, "token"),
], ids=["mosaic-128", "mosaic-128-x-blocks", "mosaic-default-M4224", "triton", "reference"])
def test_swiglu_epilogue_is_swiglu_of_the_stacked_product(backend, config, scaling):
    """`activation="swiglu"` on a `swiglu_weight` gives what the model computes from gate and up stacked plainly
    (`activations.swiglu` of the bf16 product): the kernel against the definition exactly (float32 output), the
    definition against the unfused product in bf16."""
    from mxdit.pallas_kernels import activations

    h = 192 if backend == "mosaic" and config.tile_n == 256 else 320  # 384 / 640 stacked: a padded last tile
    x, w = _operands(11, m=130, k=200, n=2 * h)
    gate, up = (gemm.prepare_weight(part, "fp8_e4m3", backend="mosaic") for part in (w[:h], w[h:]))
    paired = gemm.swiglu_weight(gate, up)
    bias = jax.random.normal(jax.random.key(12), (2 * h,))
    paired_bias = bias.reshape(2, h // gemm.SWIGLU_WIDTH, -1).swapaxes(0, 1).reshape(-1)
    xq, xs = gemm.quantize_activations(x, scaling)
    kw = dict(backend=backend, interpret=True) | ({"config": config} if config else {})
    y32 = gemm.scaled_matmul(xq, paired, xs, bias=paired_bias, activation="swiglu", out_dtype=jnp.float32, **kw)
    ref32 = gemm.scaled_matmul_reference(xq, xs, paired, bias=paired_bias, activation="swiglu", out_dtype=jnp.float32)
    assert y32.shape == (130, h)
    assert relative_l2(np.asarray(y32), np.asarray(ref32)) < 1e-6
    y = gemm.scaled_matmul(xq, paired, xs, bias=paired_bias, activation="swiglu", **kw)
    stacked = gemm.scaled_matmul_reference(xq, xs, gemm.concat_weights([gate, up]), bias=bias)  # bf16, [gate | up]
    unfused = np.asarray(activations.swiglu(stacked), np.float32)
    y = np.asarray(y, np.float32)
    assert y.dtype == np.float32 and y.shape == unfused.shape
    # the same roundings; the two products differ only in float32 summation order, so bf16 codes agree but for
    # an occasional neighbouring code
    assert np.mean(y == unfused) > 0.97
    np.testing.assert_allclose(y, unfused, rtol=2 ** -6, atol=1e-6)  # a flipped input code: <= 2 steps


def test_swiglu_weight_is_only_taken_by_the_swiglu_epilogue():
    x, w = _operands(5, n=128)
    gate, up = (gemm.prepare_weight(part, "fp8_e4m3") for part in (w[:64], w[64:]))
    paired = gemm.swiglu_weight(gate, up)
    with pytest.raises(ValueError, match="swiglu"):
        gemm.scaled_matmul(x, paired, backend="reference")
    with pytest.raises(ValueError, match="swiglu"):
        gemm.scaled_matmul(x, gemm.concat_weights([gate, up]), activation="swiglu", backend="reference")
    with pytest.raises(ValueError, match="residual or gate"):
        gemm.scaled_matmul(x, paired, activation="swiglu", residual=jnp.zeros((M, 64)), backend="reference")
    with pytest.raises(ValueError, match="multiple of 64"):
        gemm.swiglu_weight(gemm.prepare_weight(w[:40], "fp8_e4m3"), gemm.prepare_weight(w[40:80], "fp8_e4m3"))
    with pytest.raises(ValueError, match="folded per 128 rows"):
        mx = [gemm.prepare_weight(part, "mxfp4_e2m1") for part in (w[:64], w[64:])]
        gemm.swiglu_weight(*mx)


def _lowering_weight(n: int, k: int, fmt: str, swiglu: bool):
    """A random (n, k) weight prepared for the kernel: as SwiGLU's interleaved gate and up halves where `swiglu`."""
    w = jax.random.normal(jax.random.key(0), (n, k), jnp.float32) * k**-0.5
    if swiglu:
        return gemm.swiglu_weight(*(gemm.prepare_weight(half, fmt) for half in (w[: n // 2], w[n // 2:])))
    return gemm.prepare_weight(w, fmt)


@pytest.mark.parametrize("fmt, scaling, epilogue, m, cluster_n", [
    ("fp8_e4m3", "token", "none", 4224, 1),  # 64 x 256 tiles, 128-wide output slices
    ("fp8_e4m3", "token", "residual", 4224, 1),  # the residual prefetched
    ("fp8_e4m3", "token", "swiglu", 4224, 1),
    ("fp8_e4m3", "block", "swiglu", 4224, 1),  # three warpgroups promoting, then SwiGLU
    ("mxfp4_e2m1", "token", "none", 4224, 1),
    ("fp8_e4m3", "token", "gelu", 4608, 1),  # 128 x 128 tiles
    # two CTAs a cluster along N sharing x's tile by TMA multicast, which the interpreter does not model (the GPU
    # compared the outputs with cluster_n=1's)
    ("fp8_e4m3", "token", "none", 4224, 2),
    ("fp8_e4m3", "token", "swiglu", 4224, 2),
    ("fp8_e4m3", "token", "residual", 4224, 2),
    ("fp8_e4m3", "block", "none", 4224, 2),
])
def test_mosaic_kernel_lowers_for_the_gpu(monkeypatch, fmt, scaling, epilogue, m, cluster_n):
    """Mosaic GPU's own lowering (layouts, wgmma operands, TMA slices) runs in Python, so the CPU can check that the
    default configurations and epilogues lower, beyond what the interpreter runs. Not checked: ptxas, and speed."""
    monkeypatch.setattr(gemm.mosaic, "_num_sms", lambda: 132)  # an H200's
    k, n = 256, 512
    weight = _lowering_weight(n, k, fmt, swiglu=epilogue == "swiglu")
    extra = {"residual": jnp.zeros((m, n), jnp.bfloat16), "gate": jnp.ones((n,))} if epilogue == "residual" else {}
    activation = {"swiglu": "swiglu", "gelu": "gelu_tanh"}.get(epilogue, "none")
    config = None
    if cluster_n > 1:
        config = dataclasses.replace(gemm.default_mosaic_config(m, n, k, scaling == "block", epilogue == "residual"),
                                     cluster_n=cluster_n)
        assert n % (config.tile_n * cluster_n) == 0  # two column tiles a cluster, not padded

    def product(x):
        return gemm.scaled_matmul(x, weight, x_scaling=scaling, activation=activation, backend="mosaic",
                                  config=config, **extra)

    lowered = jax.jit(product).trace(jax.ShapeDtypeStruct((m, k), jnp.bfloat16)).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "mosaic_gpu" in text
    assert ("cluster_block_id" in text) == (cluster_n > 1)  # the kernel indexes its CTA within the cluster


@pytest.mark.parametrize("activation", ["swiglu", "silu", "gelu_tanh"])
def test_mosaic_epilogue_sigmoid_is_one_approximate_exp2_and_reciprocal(monkeypatch, activation):
    """The compiled epilogue takes the sigmoid from `ex2.approx` and `rcp.approx` (GELU's tanh as x sigmoid(2u)), not
    libdevice's exp / tanh and an IEEE division. (PTX does not run on the CPU: the GPU tier compares the outputs; the
    interpreter runs the exact sigmoid.)"""
    monkeypatch.setattr(gemm.mosaic, "_num_sms", lambda: 132)
    m, k, n = 4224, 256, 512
    weight = _lowering_weight(n, k, "fp8_e4m3", swiglu=activation == "swiglu")
    text = jax.jit(lambda x: gemm.scaled_matmul(x, weight, activation=activation, backend="mosaic")).trace(
        jax.ShapeDtypeStruct((m, k), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
    for instruction in ("ex2.approx.ftz.f32", "rcp.approx.ftz.f32"):
        assert instruction in text
    assert ("math.tanh" if activation == "gelu_tanh" else "arith.divf") not in text


def test_gelu_tanh_by_sigmoid_is_gelu_tanh():
    """The same function in float32; absolutely within 1e-6 where 1 + tanh(u) cancels (x < ~-3: GELU near 0)."""
    x = jnp.concatenate([jnp.linspace(-12.0, 12.0, 4001), jax.random.normal(jax.random.key(1), (4096,)) * 3])
    np.testing.assert_allclose(gemm.mosaic._gelu_tanh_by_sigmoid(x, jax.nn.sigmoid), jax.nn.gelu(x, approximate=True),
                               rtol=2e-6, atol=1e-6)


def test_mosaic_clusters_need_whole_cluster_tiles_and_no_interpreter():
    config = gemm.MosaicConfig(64, 256, 3, compute_wgs=2, cluster_n=2)
    w = gemm.prepare_weight(jax.random.normal(jax.random.key(0), (768, 256), jnp.float32) * 256**-0.5, "fp8_e4m3")
    xq, xs = gemm.quantize_activations(jnp.ones((128, 256)))
    kw = dict(x_blocks=False, w_blocks=False, activation="none", out_dtype=jnp.bfloat16, config=config)
    with pytest.raises(ValueError, match="cluster_n"):  # 768 columns: three 256-wide tiles, no whole pair
        gemm.mosaic._mosaic_gemm(xq, xs, w.data, w.scale, None, None, None, **kw)
    with pytest.raises(ValueError, match="multicast"):
        gemm.mosaic._mosaic_gemm(xq, xs, w.data[:512], w.scale[:512], None, None, None, interpret=True, **kw)


def test_fast_activation_quantizer_gives_the_bits_of_quant_formats():
    x, _ = _operands(4, k=384)
    x = x * jnp.exp(3 * jax.random.normal(jax.random.key(5), x.shape))  # a wide dynamic range
    x = x.at[3].set(0.0).at[5, 7].set(1e-30)
    values, scales = gemm.quantize_activations(x, "token")
    q = quantize(x, "fp8_e4m3")
    np.testing.assert_array_equal(np.asarray(values).view(np.uint8), np.asarray(q.data).view(np.uint8))
    np.testing.assert_array_equal(scales, q.scale[:, 0])
    values, scales = gemm.quantize_activations(x, "block")
    q = quantize(x.reshape(M, 3, 128), "fp8_e4m3")
    np.testing.assert_array_equal(np.asarray(values).view(np.uint8), np.asarray(q.data).reshape(M, 384).view(np.uint8))
    np.testing.assert_array_equal(scales, q.scale[..., 0].T)


@pytest.mark.parametrize("fmt", ["mxfp6_e2m3", "mxfp6_e3m2", "mxfp4_e2m1"])
def test_folding_mx_weights_to_fp8_is_exact_for_ordinary_weights(fmt):
    _, w = _operands(6)
    assert gemm.fold_mx_error(quantize(w, fmt)) == 0.0


def test_folding_reports_the_error_when_block_scales_spread_too_far():
    _, w = _operands(7, k=128)
    w = w.at[:, 32:64].multiply(2.0**-20)  # one 32-block 2^20 below its neighbours: its small values fall off E4M3
    error = gemm.fold_mx_error(quantize(w, "mxfp4_e2m1"))
    assert 0.0 < error < 1e-6  # lost values are 2^-20 of the block's largest


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp4_e2m1"])
def test_kernel_packing_of_mx_codes_keeps_every_value(fmt):
    _, w = _operands(8)
    q = quantize(w, fmt)
    packed = gemm.prepare_weight(q, backend="triton")
    np.testing.assert_array_equal(gemm.dequantize_weight(packed)[:, :K], q.dequantize(jnp.float32))


def test_bad_operands_are_named_in_the_error():
    x, w = _operands()
    with pytest.raises(ValueError, match="nvfp4"):
        gemm.prepare_weight(w, "nvfp4")
    with pytest.raises(ValueError, match="columns"):
        gemm.scaled_matmul(x[:, :100], gemm.prepare_weight(w, "fp8_e4m3"), backend="reference")
    with pytest.raises(ValueError, match="backend='triton'"):
        gemm.scaled_matmul(x, gemm.prepare_weight(w, "int8"), backend="mosaic")
    with pytest.raises(ValueError, match="activation"):
        gemm.scaled_matmul(x, gemm.prepare_weight(w, "fp8_e4m3"), activation="relu6", backend="reference")


@pytest.mark.parametrize("config", [gemm.MosaicConfig(tile_m=64, tile_n=128, max_concurrent_steps=4, compute_wgs=3),
                                    gemm.MosaicConfig(tile_m=128, tile_n=128, max_concurrent_steps=3)],
                         ids=["3wg", "128x128"])
@pytest.mark.parametrize("scaling", ["token", "block"])
def test_given_mosaic_tiles_fit_shared_memory_with_float32_outputs(monkeypatch, config, scaling):
    """Tiles tuned for bf16 outputs stage twice the bytes for float32 ones (the GPU refused these two at 268-286 KB
    of its 227 KB): a given config is narrowed to fit, as the defaults are, and lowers."""
    monkeypatch.setattr(gemm.mosaic, "_num_sms", lambda: 132)
    m, k, n = 4224, 1024, 768
    weight = _lowering_weight(n, k, "fp8_e4m3", swiglu=False)

    def product(x, r, v):
        return gemm.scaled_matmul(x, weight, x_scaling=scaling, bias=v, residual=r, gate=v, activation="gelu_tanh",
                                  backend="mosaic", config=config, out_dtype=jnp.float32)

    shapes = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((m, k), (m, n), (n,))]
    assert "mosaic_gpu" in jax.jit(product).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("k", [40, 300])
def test_rotated_int8_weights_pad_to_the_rotation_block_like_their_activations(k):
    # The rotation acts on 256-wide runs, wider than the 128 other weights pad to: a width that 128 pads short of a
    # multiple of 256 must still meet its activations.
    x, w = _operands(2, m=16, k=k, n=24)
    wq = gemm.prepare_weight(w, "int8_rot", backend="triton")
    xq, xs = gemm.quantize_activations(x, "token", "int8_rot")
    assert wq.k == xq.shape[1] == -(-k // 256) * 256
    y = gemm.scaled_matmul_reference(xq, xs, wq, out_dtype=jnp.float32)
    assert relative_l2(np.asarray(y), x @ w.T) < 0.02
