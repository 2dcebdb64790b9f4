"""The GPU tier, kernels: every Pallas kernel compiled for the GPU (not interpret mode) against its reference, with
the defaults the models run and each remaining variant. `pytest -m gpu`; skipped where JAX sees no GPU, and never
part of the default (CPU) run.

Each test records its measured error (`record_property`), and the session's summary prints them. The bounds are a
small margin over what these tests measured on an H100/H200 (the closing comment of each bound says so)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import relative_l2
from mxdit.pallas_kernels import activations as A
from mxdit.pallas_kernels import attention as attn
from mxdit.pallas_kernels import gemm

pytestmark = pytest.mark.gpu


def _require_hopper(backend: str) -> None:
    """The Mosaic kernels use Hopper's wgmma and TMA: on another GPU their tests are skipped, saying so."""
    capability = getattr(jax.devices()[0], "compute_capability", "")
    if backend == "mosaic" and not capability.startswith("9."):
        pytest.skip(f"the Mosaic kernels need a Hopper GPU (compute capability 9.x), this is {capability!r}")


def relative_l1(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).sum() / np.abs(b).sum())


# -- block-scaled GEMM ------------------------------------------------------------------------------------------------

MOSAIC_FORMATS = ("fp8_e4m3", "mxfp8_e4m3", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp4_e2m1")
EPILOGUES = {
    "plain": {},
    "bias+gelu": {"bias": True, "activation": "gelu_tanh"},
    "bias+silu": {"bias": True, "activation": "silu"},
    "gate+residual": {"gate": True, "residual": True},
    "bias+gelu+gate+residual": {"bias": True, "activation": "gelu_tanh", "gate": True, "residual": True},
}

# (m, k, n): a DiT row count that three warpgroups divide (4224 = 22 x 192, Krea 2 at 1024^2 with trimmed text), one
# above 2048 that selects the 64 x 256 tiles for channel scales, and an irregular one that every kernel pads.
GEMM_SHAPES = {"m4224": (4224, 1024, 768), "m130": (130, 200, 72)}


def _gemm_operands(m, k, n, seed=0):
    kx, kw, kb, kg, kr = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(kx, (m, k), jnp.float32)
    w = jax.random.normal(kw, (n, k), jnp.float32) * k**-0.5
    extras = {"bias": jax.random.normal(kb, (n,)) * 0.5, "gate": jax.random.normal(kg, (n,)),
              "residual": jax.random.normal(kr, (m, n))}
    return x, w, extras


def _mosaic_bound(fmt: str, scaling: str) -> float:
    """The Hopper kernel's distance from the float32 definition: wgmma's FP8 products accumulate with less than
    float32's precision (measured on an H100: ~7e-5 relative L2 a 128-wide K step, growing with K). Block and MX
    scales promote each 128-wide step to float32 in the kernel (measured 3.0e-5 to 1.3e-4); FP8 weights with
    channel scales under token-scaled activations keep all of K in one accumulator (1.1e-4 at K 256, 3.1e-4 to
    5.5e-4 at K 1024). Either is far below FP8's own rounding (~3e-2)."""
    return 1e-3 if (fmt, scaling) == ("fp8_e4m3", "token") else 3e-4


def _gemm_check(record_property, backend, fmt, scaling, shape, epilogue, config=None, out_dtype=jnp.float32):
    _require_hopper(backend)
    m, k, n = GEMM_SHAPES[shape]
    x, w, extras = _gemm_operands(m, k, n)
    spec = EPILOGUES[epilogue]
    kwargs = {name: extras[name] for name in ("bias", "gate", "residual") if spec.get(name)}
    activation = spec.get("activation", "none")
    wq = gemm.prepare_weight(w, fmt, backend=backend)
    int8 = fmt.startswith("int8")
    xq, xs = gemm.quantize_activations(x, "token" if int8 else scaling, fmt if int8 else "fp8_e4m3")
    run = jax.jit(functools.partial(gemm.scaled_matmul, backend=backend, config=config, activation=activation,
                                    out_dtype=out_dtype))
    y = np.asarray(run(xq, wq, xs, **kwargs), np.float32)
    ref = np.asarray(gemm.scaled_matmul_reference(xq, xs, wq, activation=activation, out_dtype=jnp.float32,
                                                  **kwargs))
    assert np.isfinite(y).all()
    error = relative_l2(y, ref)
    record_property("relative_l2", error)
    return error


@pytest.mark.parametrize("shape", list(GEMM_SHAPES))
@pytest.mark.parametrize("scaling", ["token", "block"])
@pytest.mark.parametrize("fmt", MOSAIC_FORMATS)
def test_mosaic_gemm_matches_the_definition(record_property, fmt, scaling, shape):
    """The Hopper kernel with the models' default tiles (`default_mosaic_config`) for every FP8/MX weight format
    and activation scaling, the whole epilogue, float32 output: the reference's function of the same quantized
    operands, up to wgmma's FP8 accumulation (`_mosaic_bound`)."""
    error = _gemm_check(record_property, "mosaic", fmt, scaling, shape, "bias+gelu+gate+residual")
    assert error <= _mosaic_bound(fmt, scaling)


@pytest.mark.parametrize("epilogue", list(EPILOGUES))
@pytest.mark.parametrize("scaling", ["token", "block"])
def test_mosaic_gemm_epilogues(record_property, scaling, epilogue):
    """Each epilogue alone (the fast sigmoid of GELU and SiLU among them), channel and block scales."""
    assert _gemm_check(record_property, "mosaic", "fp8_e4m3", scaling, "m4224", epilogue) <= _mosaic_bound(
        "fp8_e4m3", scaling)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "mxfp6_e2m3"])
def test_mosaic_gemm_in_bf16_as_the_models_call_it(record_property, fmt):
    """bf16 output (the models' dtype) with the fused gate and residual: the reference's bf16 rounding of the same
    float32 result, so at most one bf16 rounding step apart."""
    error = _gemm_check(record_property, "mosaic", fmt, "token", "m4224", "bias+gelu+gate+residual",
                        out_dtype=jnp.bfloat16)
    assert error <= 4e-3


@pytest.mark.parametrize("config", [
    gemm.MosaicConfig(tile_m=64, tile_n=128, max_concurrent_steps=4, cluster_n=2),
    gemm.MosaicConfig(tile_m=64, tile_n=128, max_concurrent_steps=4, compute_wgs=3),
    gemm.MosaicConfig(tile_m=128, tile_n=128, max_concurrent_steps=3),
    gemm.MosaicConfig(tile_m=64, tile_n=256, max_concurrent_steps=3, compute_wgs=2, prefetch_residual=True,
                      grid_tile_width=4),
], ids=["cluster_n2", "3wg", "128x128", "64x256-prefetch-residual"])
@pytest.mark.parametrize("fmt,scaling", [("fp8_e4m3", "token"), ("fp8_e4m3", "block"), ("mxfp6_e2m3", "token")])
def test_mosaic_gemm_tile_variants(record_property, config, fmt, scaling):
    """The tilings the defaults pick for other shapes, and clusters of two CTAs sharing x by TMA multicast
    (`cluster_n=2`, never run in interpret mode)."""
    error = _gemm_check(record_property, "mosaic", fmt, scaling, "m4224", "bias+gelu+gate+residual", config)
    assert error <= _mosaic_bound(fmt, scaling)


@pytest.mark.parametrize("epilogue", ["bias+gelu+gate+residual", "bias+silu"])
@pytest.mark.parametrize("shape", list(GEMM_SHAPES))
@pytest.mark.parametrize("fmt,scaling", [("fp8_e4m3", "token"), ("fp8_e4m3", "block"), ("mxfp8_e4m3", "token"),
                                         ("mxfp6_e2m3", "block"), ("mxfp6_e3m2", "token"), ("mxfp4_e2m1", "token"),
                                         ("int8", "token"), ("int8_rot", "token")])
def test_triton_gemm_matches_the_definition(record_property, fmt, scaling, shape, epilogue):
    """The portable kernel (the models' path for INT8 and packed MX weights) for every weight format."""
    assert _gemm_check(record_property, "triton", fmt, scaling, shape, epilogue) <= 2e-6


@pytest.mark.parametrize("backend", ["mosaic", "triton"])
def test_swiglu_epilogue_matches_the_definition(record_property, backend):
    """SwiGLU's gate and up as one paired weight (`swiglu_weight`), SiLU(gate) * up in the epilogue."""
    _require_hopper(backend)
    m, k, n = 4224, 512, 1024
    x, w, extras = _gemm_operands(m, k, 2 * n, seed=5)
    gate, up = (gemm.prepare_weight(part, "fp8_e4m3", backend=backend) for part in (w[:n], w[n:]))
    paired = gemm.swiglu_weight(gate, up)
    xq, xs = gemm.quantize_activations(x, "token")
    y = jax.jit(functools.partial(gemm.scaled_matmul, backend=backend, activation="swiglu",
                                  out_dtype=jnp.float32))(xq, paired, xs)
    ref = gemm.scaled_matmul_reference(xq, xs, paired, activation="swiglu", out_dtype=jnp.float32)
    error = relative_l2(np.asarray(y), np.asarray(ref))
    record_property("relative_l2", error)
    assert y.shape == (m, n) and error <= (_mosaic_bound("fp8_e4m3", "token") if backend == "mosaic" else 2e-6)


# -- the FP8 row kernels ----------------------------------------------------------------------------------------------


def _on_cpu(fn, *args):
    """`fn(*args)` by XLA on the CPU: the composition the kernels must reproduce code for code."""
    cpu = jax.devices("cpu")[0]
    return jax.jit(fn)(*(jax.device_put(a, cpu) for a in args))  # committed to the CPU, so it runs there


def _row_inputs(b, s, d, seed=0, dtype=jnp.bfloat16):
    k = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(k[0], (b, s, d)) * 3
    x = x.at[0, 1].set(0.0).at[-1, 2, 7].set(300.0)  # a zero row; an outlier
    return (x.astype(dtype), jax.random.normal(k[1], (d,)) * 0.1,
            (jax.random.normal(k[2], (b, 1, d)) * 0.3).astype(dtype),
            (jax.random.normal(k[3], (b, 1, d)) * 0.3).astype(dtype))


def _codes_check(record_property, kernel, reference):
    """Values and scales of the kernel (on the GPU) against the XLA composition on the CPU and on the GPU."""
    got = [np.asarray(a.astype(jnp.float32)) for a in kernel]
    for where, ref in reference.items():
        want = [np.asarray(a.astype(jnp.float32)) for a in ref]
        record_property(f"codes_differing_vs_{where}", float(np.mean(got[0] != want[0])))
        record_property(f"scales_differing_vs_{where}", float(np.mean(got[1] != want[1])))
    return got, [np.asarray(a.astype(jnp.float32)) for a in reference["cpu"]]


ROW_SHAPES = {"krea2": (1, 4224, 6144), "odd": (2, 40, 96)}


@pytest.mark.parametrize("shape", list(ROW_SHAPES))
@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_modulated_norm_kernels_give_the_codes_of_the_composition(record_property, norm, shape):
    """The adaptive RMSNorm (Krea 2) and LayerNorm (FLUX.1) with FP8 outputs: the E4M3 codes and per-token scales of
    XLA's composition of the models' arithmetic on the same GPU (measured: equal scales, 4e-8 to 2e-7 of the codes
    a step apart at Krea 2's width). On the CPU XLA sums a row's 6144 squares in another order, so every scale
    there is an ulp or so away and 5.8% of the codes a step (recorded, not asserted; equal at the small width)."""
    x, w, scale, shift = _row_inputs(*ROW_SHAPES[shape])
    if norm == "rms":
        fn = lambda backend: lambda x, w, a, b: A.modulated_rms_norm_fp8(x, w, a, b, 1e-6, backend=backend)
        args = (x, w, scale, shift)
    else:
        fn = lambda backend: lambda x, a, b: A.modulated_layer_norm_fp8(x, a, b, 1e-6, backend=backend)
        args = (x, scale, shift)
    kernel = jax.jit(fn("triton"))(*args)
    on_gpu = [np.asarray(a.astype(jnp.float32)) for a in jax.jit(fn("reference"))(*args)]
    got, _ = _codes_check(record_property, kernel, {"cpu": _on_cpu(fn("reference"), *args), "gpu": on_gpu})
    differ = got[0] != on_gpu[0]
    assert differ.mean() <= 1e-6
    assert (np.abs(got[0] - on_gpu[0])[differ] <= 2.0**-2 * np.maximum(np.abs(on_gpu[0][differ]), 2.0**-9)).all()
    np.testing.assert_array_equal(got[1], on_gpu[1])


@pytest.mark.parametrize("shape", list(ROW_SHAPES))
def test_tokens_kernel_gives_the_codes_of_the_composition(record_property, shape):
    x = _row_inputs(*ROW_SHAPES[shape])[0]
    got, want = _codes_check(record_property, jax.jit(A.tokens_fp8)(x),
                             {"cpu": _on_cpu(lambda y: A.tokens_fp8(y, backend="reference"), x),
                              "gpu": jax.jit(lambda y: A.tokens_fp8(y, backend="reference"))(x)})
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


# The sigmoid kernels take their sigmoid from ex2.approx and rcp.approx (relative error ~2^-21 against the float32
# expression), so a value near a bf16 rounding boundary may round the other way: a code then differs by one step.
@pytest.mark.parametrize("shape", list(ROW_SHAPES))
@pytest.mark.parametrize("kernel", ["swiglu", "sigmoid_gated"])
def test_sigmoid_kernels_give_the_codes_of_the_composition_up_to_rare_ties(record_property, kernel, shape):
    b, s, d = ROW_SHAPES[shape]
    x = _row_inputs(b, s, d, seed=1)[0]
    if kernel == "swiglu":
        args = (jnp.concatenate([x, 0.5 * x[..., ::-1]], axis=-1),)
        fn = lambda backend: lambda gu: A.swiglu_fp8(gu, backend=backend)
    else:
        args = (x, jnp.concatenate([x[..., :32], -x, x[..., :16]], axis=-1))
        fn = lambda backend: lambda o, st: A.sigmoid_gated_fp8(o, st, 32, backend=backend)
    got, want = _codes_check(record_property, jax.jit(fn("triton"))(*args),
                             {"cpu": _on_cpu(fn("reference"), *args), "gpu": jax.jit(fn("reference"))(*args)})
    differ = got[0] != want[0]
    assert differ.mean() <= 1e-4
    steps = np.abs(got[0] - want[0])[differ] / np.maximum(np.abs(want[0][differ]), 2.0**-9)
    assert (steps <= 2.0**-2).all()  # one E4M3 step (3 mantissa bits) at most
    np.testing.assert_allclose(got[1], want[1], rtol=2.0**-7)  # a row maximum may move by one bf16 step


# -- INT8-QK attention ------------------------------------------------------------------------------------------------


def _attention_inputs(seed, b=2, s=1152, h=8, hk=4, d=128, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, s, h, d)) * 3
    k = rng.standard_normal((b, s, hk, d)) * 3 + 5.0 * (np.arange(d) == 6)  # a channel with a large mean
    v = rng.standard_normal((b, s, hk, d)) + np.arange(d) / d  # channels with means, for V's smoothing
    norms = [jnp.asarray(rng.standard_normal(d) * 0.1, jnp.float32) for _ in range(2)]
    angles = np.arange(s)[:, None] * (1.0 / 100 ** (np.arange(0, d, 2) / d))
    cos, sin = (jnp.asarray(np.repeat(f(angles), 2, -1), jnp.float32) for f in (np.cos, np.sin))
    lengths = jnp.asarray([s, s - 131])  # a padded batch element; its length no block size divides
    return tuple(jnp.asarray(a, dtype) for a in (q, k, v)), norms, cos, sin, lengths


def _exact(q, k, v, lengths):
    return jax.nn.dot_product_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                                        key_value_seq_lengths=lengths, implementation="xla")


# (backend, pv, pv_accumulation): the Triton kernel and the Hopper one, bf16 and FP8 P.V; in-place accumulation is
# what the models run on the GPU for "int8_mosaic_fp8".
ATTENTION_KERNELS = [("triton", "bf16", "two_level"), ("triton", "fp8", "two_level"),
                     ("mosaic", "bf16", "two_level"), ("mosaic", "fp8", "two_level"), ("mosaic", "fp8", "in_place")]


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("backend,pv,accumulation", ATTENTION_KERNELS)
def test_int8_attention_kernel_matches_the_reference(record_property, backend, pv, accumulation, d):
    """The kernels on already normed Q and K: the reference's function (the same INT8 blocks, the same P.V
    precision), up to the online softmax's rounding; and as close to exact attention as the reference is. With FP8
    P.V the two round different P to E4M3 (the reference the normalised softmax, the kernels each block's
    exponentials under the running maximum), so they agree only to about half of FP8's own error (measured on an
    H100: 0.016-0.019 apart, each 0.033-0.040 from exact attention, the kernels the closer)."""
    _require_hopper(backend)
    (q, k, v), _, _, _, lengths = _attention_inputs(0, d=d, dtype=jnp.float32)
    block_k = 128 if backend == "mosaic" else 64
    config = attn.AttentionConfig(block_k=block_k, pv_accumulation=accumulation)
    run = jax.jit(functools.partial(attn.int8_attention, pv=pv, backend=backend, config=config))
    out = run(q, k, v, kv_lengths=lengths)
    ref = attn.int8_attention_reference(q, k, v, kv_lengths=lengths, pv=pv, block_q=64, block_k=block_k,
                                        smooth_v=backend == "mosaic" and pv == "fp8")
    truth = _exact(q, k, v, lengths)
    error, of_ref, of_kernel = relative_l1(out, ref), relative_l1(ref, truth), relative_l1(out, truth)
    record_property("relative_l1_vs_reference", error)
    record_property("relative_l1_vs_exact", of_kernel)
    record_property("reference_vs_exact", of_ref)
    assert np.isfinite(np.asarray(out)).all()
    assert error <= {"bf16": 3e-3, "fp8": 2.5e-2}[pv]  # measured 1.2e-3 and 0.019 at most
    assert of_kernel <= 1.05 * of_ref


def _fused_reference(q, k, v, nq, nk, cos, sin, lengths, pv, smooth_v):
    qn, kn = (attn.rms_rope_reference(x, n, 1e-6, cos, sin) for x, n in ((q, nq), (k, nk)))
    ref = attn.int8_attention_reference(qn, kn, v.astype(jnp.float32), kv_lengths=lengths, pv=pv, block_q=64,
                                        block_k=128, smooth_v=smooth_v)
    return ref, _exact(qn, kn, v, lengths)


# The Mosaic path's supported configs besides the default (`default_config`: three compute warpgroups for FP8 P.V
# at 4224 tokens, accumulated in place).
MOSAIC_VARIANTS = {
    "default": None,
    "two_warpgroups": dict(compute_wgs=2),
    "two_level": dict(pv_accumulation="two_level"),
}


# bf16 P.V has one config to check: two warpgroups and two-level accumulation are already its default
@pytest.mark.parametrize("pv, variant", [("fp8", v) for v in MOSAIC_VARIANTS] + [("bf16", "default")])
def test_fused_mosaic_attention_as_the_models_call_it(record_property, pv, variant):
    """`int8_attention_fused_stacked` from a stacked bf16 QKV projection, bf16 out, Krea 2's 128-wide heads (the
    "int8_mosaic" / "int8_mosaic_fp8" model paths), with the default config and the others it supports: the
    reference of the normed, rotated inputs up to the online softmax's rounding."""
    _require_hopper("mosaic")
    (q, k, v), (nq, nk), cos, sin, lengths = _attention_inputs(1)
    b, s, h, d = q.shape
    qkv = jnp.concatenate([x.reshape(b, s, -1) for x in (q, k, v)], axis=-1)
    config = None
    if MOSAIC_VARIANTS[variant] is not None:
        config = attn.AttentionConfig(block_k=128, compute_wgs=3, pv_accumulation="in_place")
        config = dataclasses.replace(config, **MOSAIC_VARIANTS[variant])
    run = jax.jit(functools.partial(
        attn.int8_attention_fused_stacked, num_heads=h, num_kv_heads=k.shape[2], eps=1e-6, pv=pv, backend="mosaic",
        out_dtype=jnp.bfloat16, config=config))
    out = run(qkv, norm_q=nq, norm_k=nk, cos=cos, sin=sin, kv_lengths=lengths)
    ref, truth = _fused_reference(q, k, v, nq, nk, cos, sin, lengths, pv, pv == "fp8")
    error, of_ref, of_kernel = relative_l1(out, ref), relative_l1(ref, truth), relative_l1(out, truth)
    record_property("relative_l1_vs_reference", error)
    record_property("relative_l1_vs_exact", of_kernel)
    record_property("reference_vs_exact", of_ref)
    assert out.shape == (b, s, h, d) and np.isfinite(np.asarray(out, np.float32)).all()
    assert error <= {"bf16": 6e-3, "fp8": 1e-2}[pv]
    assert of_kernel <= 1.05 * of_ref + 2e-3  # + the bf16 rounding of the output


@pytest.mark.parametrize("pv", ["bf16", "fp8"])
def test_fused_triton_attention_as_the_models_call_it(record_property, pv):
    """The portable path ("int8", "int8_fp8"): the Triton prologue and kernel from separate bf16 projections."""
    (q, k, v), (nq, nk), cos, sin, lengths = _attention_inputs(2, d=64)
    run = jax.jit(functools.partial(attn.int8_attention_fused, eps=1e-6, pv=pv, backend="triton",
                                    config=attn.AttentionConfig(), out_dtype=jnp.bfloat16))
    out = run(q, k, v, norm_q=nq, norm_k=nk, cos=cos, sin=sin, kv_lengths=lengths)
    qn, kn = (attn.rms_rope_reference(x, n, 1e-6, cos, sin) for x, n in ((q, nq), (k, nk)))
    ref = attn.int8_attention_reference(qn, kn, v.astype(jnp.float32), kv_lengths=lengths, pv=pv, block_q=64,
                                        block_k=64)
    truth = _exact(qn, kn, v, lengths)
    error, of_ref, of_kernel = relative_l1(out, ref), relative_l1(ref, truth), relative_l1(out, truth)
    record_property("relative_l1_vs_reference", error)
    record_property("relative_l1_vs_exact", of_kernel)
    assert error <= {"bf16": 6e-3, "fp8": 1e-2}[pv]
    assert of_kernel <= 1.05 * of_ref + 2e-3


def test_qk_prologue_gives_the_codes_of_the_separate_steps(record_property):
    """The fused RMSNorm + rotary + smoothing + INT8 pass (Triton, IEEE quotients rounded to even in PTX): the INT8
    codes of the float32 steps, but for rare ties, and the block scales up to float32 rounding."""
    (q, k, v), (nq, nk), cos, sin, lengths = _attention_inputs(3, dtype=jnp.float32)
    scale = q.shape[-1] ** -0.5
    qi, qs, ki, ks = jax.jit(functools.partial(attn.int8_qk_prologue, eps=1e-6, scale=scale))(
        q, k, nq, nk, cos=cos, sin=sin, kv_lengths=lengths)
    qn, kn = (attn.rms_rope_reference(x, n, 1e-6, cos, sin) for x, n in ((q, nq), (k, nk)))
    qi2, qs2, ki2, ks2, _, _ = attn._prologue(attn.reference._deinterleave(qn), attn.reference._deinterleave(kn), v, lengths, 64, 64,
                                              scale)
    q_differ, k_differ = (float(np.mean(np.asarray(a) != np.asarray(b))) for a, b in ((qi, qi2), (ki, ki2)))
    record_property("q_codes_differing", q_differ)
    record_property("k_codes_differing", k_differ)
    assert q_differ <= 1e-3 and k_differ <= 1e-3
    assert np.abs(np.asarray(qi, np.int32) - np.asarray(qi2, np.int32)).max() <= 1
    assert np.abs(np.asarray(ki, np.int32) - np.asarray(ki2, np.int32)).max() <= 1
    np.testing.assert_allclose(np.asarray(qs), np.asarray(qs2), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(ks), np.asarray(ks2), rtol=1e-5)
