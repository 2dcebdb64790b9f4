"""The fused prologue of INT8-QK attention (per-head RMSNorm, rotary embedding, K smoothing and INT8 quantization
in Triton passes) against the separate steps, and the fused attention calls the models make, in interpret mode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mxdit.pallas_kernels.attention import AttentionConfig
from test_int8_attention_reference import BOUNDS, _raw_projections, cosine, exact, relative_l1


def test_k_prologue_in_natural_order_gives_the_codes_of_the_deinterleaved_one():
    from mxdit.pallas_kernels import attention as A

    q, k, v, (nq, nk), cos, sin = _raw_projections(3)
    lengths = jnp.asarray([100, 61])
    options = dict(scale=64**-0.5, block_q=64, block_k=64, smooth_k=True, interpret=True)
    _, _, ki, ks = A._qk_prologue(q, (0, 4), k, (0, 2), nq, nk, 1e-6, cos, sin, lengths, **options)
    qi, qs, ki_natural, ks_natural = A._qk_prologue(q, (0, 4), k, (0, 2), nq, nk, 1e-6, cos, sin, lengths,
                                                    k_only=True, **options)
    assert qi is None and qs is None
    np.testing.assert_array_equal(np.asarray(A.reference._deinterleave(ki_natural)), np.asarray(ki))
    np.testing.assert_array_equal(np.asarray(ks_natural), np.asarray(ks))


@pytest.mark.parametrize("batched_tables", [False, True])
def test_fused_prologue_gives_the_codes_of_the_separate_steps(batched_tables):
    from mxdit.pallas_kernels import attention as A

    q, k, v, (nq, nk), cos, sin = _raw_projections(7, batched_tables=batched_tables)
    lengths = jnp.asarray([100, 61])
    qn, kn = A.rms_rope_reference(q, nq, 1e-6, cos, sin), A.rms_rope_reference(k, nk, 1e-6, cos, sin)
    qi, qs, ki, ks = A.int8_qk_prologue(q, k, nq, nk, 1e-6, cos, sin, lengths, scale=64**-0.5, interpret=True)
    qi2, qs2, ki2, ks2, _, _ = A._prologue(A.reference._deinterleave(qn), A.reference._deinterleave(kn), v, lengths, 64, 64, 64**-0.5)
    # Same INT8 codes (measured: all equal) and block scales up to float32 rounding of the block maxima.
    assert np.mean(np.asarray(qi) != np.asarray(qi2)) < 1e-3 and np.mean(np.asarray(ki) != np.asarray(ki2)) < 1e-3
    np.testing.assert_allclose(qs, qs2, rtol=1e-6)
    np.testing.assert_allclose(ks, ks2, rtol=1e-6)


@pytest.mark.parametrize("heads_per_program", [2, 4])
def test_prologue_kernel_over_groups_of_heads_gives_the_codes_of_one_head_a_program(heads_per_program):
    """The Q/K prologue kernel with several heads a program (the rotary tables loaded once for them): the codes of
    one head a program, and the scales up to float32 rounding; Q's heads and, read in place after them, the masked
    keys' (a stacked source), over a sequence the blocks do not divide."""
    from mxdit.pallas_kernels import attention as A

    rng = np.random.default_rng(3)
    b, s, h, hk, d = 2, 100, 4, 4, 64
    x = jnp.asarray(rng.standard_normal((b, s, h + hk + 2, d)) * 3, jnp.bfloat16)
    weight = jnp.asarray(rng.standard_normal(d) * 0.1, jnp.float32)
    angles = np.arange(s)[:, None] * (1.0 / 100 ** (np.arange(0, d, 2) / d))
    cos, sin = (jnp.broadcast_to(jnp.asarray(f(angles), jnp.float32), (b, s, d // 2)) for f in (np.cos, np.sin))
    for first, count, lengths, mult in ((0, h, None, 0.125), (h, hk, jnp.asarray([100, 61]), 1.0)):
        mean = jnp.asarray(rng.standard_normal((b, count, d)) * 0.3, jnp.float32)
        one, group = (A.prologue.rms_rope_quantize(x, weight, 1e-6, cos, sin, mean, lengths, mult, 64, True,
                                                   heads=(first, count), heads_per_program=g)
                      for g in (1, heads_per_program))
        np.testing.assert_array_equal(np.asarray(group[0]), np.asarray(one[0]))
        np.testing.assert_allclose(np.asarray(group[1]), np.asarray(one[1]), rtol=1e-6)


@pytest.mark.parametrize("heads_per_program", [1, 2])
def test_prologue_block_sums_are_the_normed_rotated_keys_summed_over_valid_keys(heads_per_program):
    """The pass that gives K smoothing its mean: per block of keys and head, the sum of the normed and rotated keys
    (channels in `_deinterleave`'s order) over the valid ones; masked and padding keys add nothing."""
    from mxdit.pallas_kernels import attention as A

    _, k, _, (_, nk), cos, sin = _raw_projections(11, hk=4)
    lengths = jnp.asarray([100, 61])
    sums = A.prologue.rms_rope_quantize(k, nk, 1e-6, cos[..., 0::2][None].repeat(2, 0), sin[..., 0::2][None].repeat(2, 0),
                                None, lengths, 1.0, 64, True, heads_per_program=heads_per_program, block_sums=True)
    kn = A.reference._deinterleave(A.rms_rope_reference(k, nk, 1e-6, cos, sin))
    kn = jnp.where((jnp.arange(100)[None, :] < lengths[:, None])[..., None, None], kn, 0.0)
    expected = jnp.pad(kn, ((0, 0), (0, 28), (0, 0), (0, 0))).reshape(2, 2, 64, 4, 64).sum(axis=2)
    assert sums.shape == (2, 2, 4, 64)
    np.testing.assert_allclose(np.asarray(sums), np.asarray(expected), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("heads_per_program", [1, 2])
def test_prologue_block_sums_read_v_range_in_place(heads_per_program):
    """The sums pass with `values`: V's heads read in place from a stacked source (after 2 other heads), each
    block's max, min and sum of V over the valid keys (masked keys hold large values that must not count); the K
    sums as without V. Combined over blocks, V's FP8 scales and means are the XLA reduction's."""
    from mxdit.pallas_kernels import attention as A

    _, k, v, (_, nk), cos, sin = _raw_projections(12, hk=4)
    lengths = jnp.asarray([100, 61])
    v = jnp.where((jnp.arange(100)[None, :] < lengths[:, None])[..., None, None], v, 1e4)
    stacked = jnp.concatenate([jnp.zeros_like(k[:, :, :2]), k, v], axis=2)  # heads: 2 others, K (4), V (4)
    tables = cos[..., 0::2][None].repeat(2, 0), sin[..., 0::2][None].repeat(2, 0)
    options = dict(heads_per_program=heads_per_program, block_sums=True, heads=(2, 4))
    plain = A.prologue.rms_rope_quantize(stacked, nk, 1e-6, *tables, None, lengths, 1.0, 64, True, **options)
    sums, v_range = A.prologue.rms_rope_quantize(stacked, nk, 1e-6, *tables, None, lengths, 1.0, 64, True, **options,
                                         values=(stacked, 6))
    np.testing.assert_array_equal(np.asarray(sums), np.asarray(plain))
    valid = (jnp.arange(128)[None, :] < lengths[:, None])[:, :, None, None]
    blocks = jnp.pad(v, ((0, 0), (0, 28), (0, 0), (0, 0)))
    expected = [jnp.where(valid, blocks, fill).reshape(2, 2, 64, 4, 64) for fill in (-jnp.inf, jnp.inf, 0.0)]
    assert v_range.shape == (2, 2, 4, 3, 64)
    np.testing.assert_array_equal(np.asarray(v_range[:, :, :, 0]), np.asarray(expected[0].max(axis=2)))
    np.testing.assert_array_equal(np.asarray(v_range[:, :, :, 1]), np.asarray(expected[1].min(axis=2)))
    np.testing.assert_allclose(np.asarray(v_range[:, :, :, 2]), np.asarray(expected[2].sum(axis=2)), rtol=1e-5,
                               atol=1e-5)
    combined = (v_range[:, :, :, 0].max(axis=1), v_range[:, :, :, 1].min(axis=1), v_range[:, :, :, 2].sum(axis=1))
    for smooth in (False, True):
        got = A.reference._v_fp8_scale_and_mean_of_range(*combined, lengths, smooth)
        want = A.reference._v_fp8_scale_and_mean(v, lengths, smooth)
        for a, b in zip(got, want):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="come with block_sums"):
        A.prologue.rms_rope_quantize(stacked, nk, 1e-6, *tables, jnp.zeros((2, 4, 64)), lengths, 1.0, 64, True, heads=(2, 4),
                             values=(stacked, 6))


def test_fused_mosaic_fp8_attention_takes_v_range_from_the_k_sums_pass():
    """FP8 P.V's V scales and means from K's sums pass (the fused call) or from an XLA reduction over V (the kernel
    given no range): the same attention."""
    from mxdit.pallas_kernels import attention as A

    q, k, v, (nq, nk), cos, sin = _raw_projections(13, s=128)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    v = v + jnp.arange(64, dtype=jnp.bfloat16) / 16  # channel means for the smoothing to take out
    lengths = jnp.asarray([128, 61])
    qkv = jnp.concatenate([x.reshape(2, 128, -1) for x in (q, k, v)], axis=-1)
    config = AttentionConfig(block_k=128)
    options = dict(kv_lengths=lengths, pv="fp8", config=config, interpret=True, out_dtype=jnp.bfloat16)
    fused = A.int8_attention_fused_stacked(qkv, 4, 2, nq, nk, 1e-6, cos, sin, backend="mosaic", **options)
    _, _, ki, ks = A._qk_prologue(q, (0, 4), k, (0, 2), nq, nk, 1e-6, cos, sin, lengths, scale=64**-0.5, block_q=64,
                                  block_k=128, smooth_k=True, interpret=True, k_only=True)
    by_xla = A.mosaic.mosaic_attention(q, None, ki, ks, v, lengths, pv="fp8", config=config, interpret=True,
                                       out_dtype=jnp.bfloat16,
                                       q_prologue=A.MosaicQPrologue(nq, 1e-6, cos, sin, 64**-0.5, 4))
    np.testing.assert_array_equal(fused.astype(jnp.float32), by_xla.astype(jnp.float32))
    truth = exact(A.rms_rope_reference(q, nq, 1e-6, cos, sin), A.rms_rope_reference(k, nk, 1e-6, cos, sin),
                  v.astype(jnp.float32), lengths)
    assert cosine(fused.astype(jnp.float32), truth) >= 0.999
    assert relative_l1(fused.astype(jnp.float32), truth) <= BOUNDS["fp8"]


@pytest.mark.parametrize("pv", ["bf16", "fp8"])
def test_fused_attention_matches_attention_of_normed_rotated_inputs(pv):
    from mxdit.pallas_kernels import attention as A

    q, k, v, (nq, nk), cos, sin = _raw_projections(8)
    lengths = jnp.asarray([100, 61])
    out = A.int8_attention_fused(q, k, v, nq, nk, 1e-6, cos, sin, kv_lengths=lengths, pv=pv, interpret=True)
    qn, kn = A.rms_rope_reference(q, nq, 1e-6, cos, sin), A.rms_rope_reference(k, nk, 1e-6, cos, sin)
    unfused = A.int8_attention(qn, kn, v, kv_lengths=lengths, pv=pv, interpret=True)
    truth = exact(qn, kn, v, lengths)
    # the same codes, so the same attention up to summation order: measured 2.9e-6 (bf16 P.V), 1.8e-7 (FP8)
    assert relative_l1(out, unfused) <= 1e-5
    assert cosine(out, truth) >= 0.999 and relative_l1(out, truth) <= BOUNDS[pv]


@pytest.mark.parametrize("k_only", [True, False])
def test_k_steps_from_the_sums_pass_equal_the_k_pass_own(k_only):
    """The sums pass's per-channel max and min give the K blocks' INT8 steps exactly: the K pass, 32 tokens a
    program with the steps given, writes the codes the pass writes reducing over its whole block itself (masked
    keys, a fully masked block, both channel orders); V's range still comes with the sums."""
    from mxdit.pallas_kernels import attention as A

    q, k, v, (nq, nk), cos, sin = _raw_projections(7, s=256, d=64)
    cos_half = jnp.broadcast_to(cos, (2, 256, 64))[..., 0::2]
    sin_half = jnp.broadcast_to(sin, (2, 256, 64))[..., 0::2]
    for lengths in (jnp.asarray([256, 100]), None):
        _, _, ki, ks, _ = A._qk_prologue(q, (0, 4), k, (0, 2), nq, nk, 1e-6, cos, sin, lengths, scale=64**-0.5,
                                         block_q=64, block_k=128, smooth_k=True, interpret=True, k_only=k_only,
                                         values=(v, (0, 2)))
        key_lengths = jnp.full((2,), 256, jnp.int32) if lengths is None else lengths
        sums = A.prologue.rms_rope_quantize(k, nk, 1e-6, cos_half, sin_half, None, key_lengths, 1.0, 128, True,
                                            heads=(0, 2), block_sums=True)
        mean = jnp.sum(sums, axis=1) / jnp.maximum(key_lengths, 1)[:, None, None].astype(jnp.float32)
        own = A.prologue.rms_rope_quantize(k, nk, 1e-6, cos_half, sin_half, mean, key_lengths, 1.0, 128, True,
                                           heads=(0, 2), natural_order=k_only)
        np.testing.assert_array_equal(np.asarray(ki), np.asarray(own[0]))
        np.testing.assert_array_equal(np.asarray(ks), np.asarray(own[1]))
        if lengths is not None:  # keys 128-255 of the second image: none valid, step 1
            np.testing.assert_array_equal(np.asarray(ks[1, 1]), 1.0)
    with pytest.raises(ValueError, match="rows_per_program 48 must be a power of two dividing 128"):
        A.prologue.rms_rope_quantize(k, nk, 1e-6, cos[..., 0::2], sin[..., 0::2], jnp.zeros((2, 2, 64)), None, 1.0,
                                     128, True, steps=jnp.ones((2, 2, 2)), rows_per_program=48)


def test_round_half_even_without_a_round_primitive():
    """The fused prologue's rounding (the Triton lowering has no `round`) is jnp.round, ties to even included."""
    from mxdit.pallas_kernels.attention.reference import _round_half_even

    x = jnp.concatenate([jnp.arange(-130.0, 130.0, 0.5), jax.random.normal(jax.random.key(0), (4096,)) * 60])
    np.testing.assert_array_equal(np.asarray(jax.jit(_round_half_even)(x)), np.asarray(jnp.round(x)))


@pytest.mark.parametrize("backend, block_k, s", [("triton", 64, 128), ("mosaic", 128, 128), ("triton", 64, 100)])
def test_fused_attention_reads_q_k_v_in_place_from_a_stacked_projection(backend, block_k, s):
    """`int8_attention_fused_stacked`: Q, K, V (and a gate after them) in one (batch, seq, heads * dim) product, as
    Krea 2's stacked QKVG Linear gives them; the prologue reads Q and K in place (or, when the sequence is no
    multiple of the blocks, from slices): the same output as from copies."""
    from mxdit.pallas_kernels import attention as A

    q, k, v, (nq, nk), cos, sin = _raw_projections(9, s=s)
    gate = jnp.ones_like(q)
    b, _, h, d = q.shape
    qkvg = jnp.concatenate([x.reshape(b, s, -1) for x in (q, k, v, gate)], axis=-1)
    lengths = jnp.asarray([s, 61])
    options = dict(kv_lengths=lengths, pv="bf16", config=AttentionConfig(block_k=block_k), backend=backend,
                   interpret=True)
    stacked = A.int8_attention_fused_stacked(qkvg, h, k.shape[2], nq, nk, 1e-6, cos, sin, **options)
    separate = A.int8_attention_fused(q, k, v, nq, nk, 1e-6, cos, sin, **options)
    np.testing.assert_array_equal(np.asarray(stacked), np.asarray(separate))
    with pytest.raises(ValueError, match="not 4 \\+ 2 x 2 heads of 64"):
        A.int8_attention_fused_stacked(qkvg[..., :7 * d], h, 2, nq, nk, 1e-6, cos, sin, **options)
