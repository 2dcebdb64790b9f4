"""INT8-QK attention (pallas_kernels/attention/): the reference against exact attention (the accuracy the kernels
must reach, on random and on outlier-heavy Q/K, with GQA, padding masks and any sequence length), and the kernels
against the reference: Triton and Mosaic GPU in interpret mode, the real Mosaic lowering on the CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mxdit.pallas_kernels.attention import AttentionConfig, int8_attention_reference


def inputs(seed, b=2, sq=200, sk=232, h=8, hk=2, d=64, k_outlier=0.0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, sq, h, d)).astype(np.float32)
    k = rng.standard_normal((b, sk, hk, d)).astype(np.float32)
    k[..., 5] += k_outlier  # a channel with a large mean, as real DiTs have in K
    v = rng.standard_normal((b, sk, hk, d)).astype(np.float32)
    return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)


def exact(q, k, v, kv_lengths=None):
    return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=kv_lengths, implementation="xla")


def cosine(a, b):
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return a @ b / np.linalg.norm(a) / np.linalg.norm(b)


def relative_l1(a, b):
    return float(np.abs(np.asarray(a) - np.asarray(b)).sum() / np.abs(np.asarray(b)).sum())


# Stated relative-L1 bounds. Measured on these inputs (diffuse attention over ~200 random keys, the hard case for a
# fixed-scale FP8 P): 0.012-0.013 with bf16 P.V, 0.038-0.039 with FP8 P.V, cosine 0.99991 / 0.99922.
BOUNDS = {"bf16": 0.02, "fp8": 0.05}


@pytest.mark.parametrize("pv", ["bf16", "fp8"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("k_outlier", [0.0, 30.0])
def test_accuracy_against_exact_attention(pv, d, k_outlier):
    q, k, v = inputs(0, d=d, k_outlier=k_outlier)
    lengths = jnp.asarray([232, 150])
    out = int8_attention_reference(q, k, v, kv_lengths=lengths, pv=pv)
    ref = exact(q, k, v, lengths)
    assert cosine(out, ref) >= 0.999
    assert relative_l1(out, ref) <= BOUNDS[pv]


def test_k_smoothing_is_what_rescues_outlier_channels():
    q, k, v = inputs(1, k_outlier=30.0)
    ref = exact(q, k, v)
    smooth = relative_l1(int8_attention_reference(q, k, v, smooth_k=True), ref)
    raw = relative_l1(int8_attention_reference(q, k, v, smooth_k=False), ref)
    assert smooth < raw / 3


def test_masked_keys_do_not_matter():
    q, k, v = inputs(2)
    lengths = jnp.asarray([100, 7])
    garbage_k = k.at[:, 120:].set(1e3)
    garbage_v = v.at[:, 120:].set(-1e3)
    np.testing.assert_allclose(int8_attention_reference(q, garbage_k, garbage_v, kv_lengths=jnp.asarray([100, 7])),
                               int8_attention_reference(q, k, v, kv_lengths=lengths), rtol=1e-5, atol=1e-5)


def test_gqa_reads_kv_head_n_over_group():
    q, k, v = inputs(3, h=4, hk=2)
    repeated = int8_attention_reference(q, jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2))
    np.testing.assert_allclose(int8_attention_reference(q, k, v), repeated, rtol=1e-5, atol=1e-5)


def test_bad_arguments_are_named():
    q, k, v = inputs(4, h=6, hk=4)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        int8_attention_reference(q, k, v)
    with pytest.raises(ValueError, match="pv must be"):
        int8_attention_reference(*inputs(4), pv="int4")


# -- the Pallas kernel (Triton lowering) in interpret mode ---------------------------------------------------------


@pytest.mark.parametrize("d, h, hk, sq, sk, lengths, pv", [
    (64, 4, 2, 100, 130, [130, 70], "bf16"),  # GQA 2:1, lengths not multiples of the blocks, a padded batch element
    (128, 2, 2, 64, 64, None, "bf16"),         # head_dim 128, no mask
    (64, 4, 2, 100, 130, [130, 70], "fp8"),
    (128, 2, 2, 64, 64, None, "fp8"),
])
def test_pallas_kernel_matches_the_reference_in_interpret_mode(d, h, hk, sq, sk, lengths, pv):
    from mxdit.pallas_kernels.attention import int8_attention

    q, k, v = inputs(5, sq=sq, sk=sk, h=h, hk=hk, d=d, k_outlier=20.0)
    kv = None if lengths is None else jnp.asarray(lengths)
    out = int8_attention(q, k, v, kv_lengths=kv, pv=pv, interpret=True)
    ref = int8_attention_reference(q, k, v, kv_lengths=kv, pv=pv, block_q=64, block_k=64)
    assert out.shape == q.shape
    truth = exact(q, k, v, kv)
    # The kernel rounds P of the running (unnormalised) exponentials, the reference the normalised P. In bf16 the
    # two agree closely; in FP8 each carries its own P rounding (measured 0.033-0.034 apart, each ~0.035-0.038 from
    # exact), so there the kernel must be at least as accurate as the reference (it is: 0.035 vs 0.038).
    if pv == "bf16":
        assert relative_l1(out, ref) <= 5e-3
    else:
        assert relative_l1(out, truth) <= 1.02 * relative_l1(ref, truth)
    assert cosine(out, truth) >= 0.999 and relative_l1(out, truth) <= BOUNDS[pv]


# -- the Mosaic GPU (Hopper) kernel: numerics in the Mosaic GPU interpreter, the real lowering on the CPU -------------


@pytest.mark.parametrize("d, h, hk, sq, sk, lengths, pv, block_k", [
    # GQA 2:1, two CTAs of 128 query rows (the second half padding), 5 key blocks through a 2-slot ring, one batch
    # element's length (150) in the middle of a block
    (64, 4, 2, 200, 300, [300, 150], "bf16", 64),
    (128, 2, 2, 130, 200, None, "bf16", 128),  # head_dim 128, no mask, keys padded to whole blocks
    (64, 4, 2, 200, 300, [300, 150], "fp8", 64),
    (128, 2, 2, 130, 200, [200, 77], "fp8", 128),
])
def test_mosaic_kernel_matches_the_reference_in_interpret_mode(d, h, hk, sq, sk, lengths, pv, block_k):
    """The interpreter runs the shared-memory P path (its wgmma reads A from shared memory only); the register P
    path of bf16 on the GPU is checked by the lowering test below."""
    from mxdit.pallas_kernels.attention import int8_attention

    q, k, v = inputs(6, sq=sq, sk=sk, h=h, hk=hk, d=d, k_outlier=20.0)
    kv = None if lengths is None else jnp.asarray(lengths)
    out = int8_attention(q, k, v, kv_lengths=kv, pv=pv, backend="mosaic", interpret=True,
                         config=AttentionConfig(block_k=block_k))
    # the Mosaic kernel's FP8 P.V smooths V
    ref = int8_attention_reference(q, k, v, kv_lengths=kv, pv=pv, block_q=64, block_k=block_k, smooth_v=pv == "fp8")
    assert out.shape == q.shape
    truth = exact(q, k, v, kv)
    # As for the Triton kernel. Measured: bf16 0.0021 from the reference (max abs 0.0015); FP8 0.033 from it, 0.035
    # from exact attention where the reference is 0.037-0.038.
    if pv == "bf16":
        assert relative_l1(out, ref) <= 5e-3
        assert np.abs(np.asarray(out) - np.asarray(ref)).max() <= 5e-3
    else:
        assert relative_l1(out, truth) <= 1.02 * relative_l1(ref, truth)
    assert cosine(out, truth) >= 0.999 and relative_l1(out, truth) <= BOUNDS[pv]


def test_mosaic_kernel_writes_bf16_directly():
    """out_dtype=bf16: the kernel's output tile is bf16 (half the shared memory); the same values as its float32
    output, rounded once."""
    from mxdit.pallas_kernels.attention import int8_attention

    q, k, v = inputs(8, sq=130, sk=200, h=2, hk=1, d=64)
    kv = jnp.asarray([200, 90])
    f32 = int8_attention(q, k, v, kv_lengths=kv, backend="mosaic", interpret=True, config=AttentionConfig())
    bf16 = int8_attention(q, k, v, kv_lengths=kv, backend="mosaic", interpret=True, config=AttentionConfig(),
                          out_dtype=jnp.bfloat16)
    assert bf16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(bf16), np.asarray(f32.astype(jnp.bfloat16)))


@pytest.mark.parametrize("d, pv, p_in_smem, block_k, num_stages, out_dtype, accumulation", [
    (128, "bf16", False, 128, 2, jnp.float32, "two_level"),  # the fast path: P from registers
    (128, "bf16", False, 128, 3, jnp.bfloat16, "two_level"),  # bf16 output: three stages fit in shared memory
    (64, "bf16", False, 128, 3, jnp.float32, "two_level"),
    (128, "bf16", True, 64, 2, jnp.float32, "two_level"),
    (128, "fp8", True, 128, 2, jnp.float32, "two_level"),
    (64, "fp8", True, 64, 2, jnp.bfloat16, "two_level"),
    (128, "fp8", False, 128, 2, jnp.bfloat16, "two_level"),  # FP8 P from registers (`_p_as_8bit_operand`)
    (64, "fp8", False, 64, 3, jnp.float32, "two_level"),
    (128, "fp8", False, 128, 2, jnp.bfloat16, "in_place"),  # FP8 P.V accumulated in place (the models')
])
@pytest.mark.usefixtures("hopper")  # FP8 P.V's V operand is a Triton pass
def test_mosaic_kernel_lowers_for_the_gpu(d, pv, p_in_smem, block_k, num_stages, out_dtype, accumulation):
    """Mosaic GPU's own lowering (layouts, wgmma operand checks, TMA slices) runs in Python, so the CPU can check
    that every variant lowers, including those the interpreter cannot run. Not checked: LLVM/ptxas, and speed."""
    from mxdit.pallas_kernels import attention as A

    q, k, v = inputs(7, sq=200, sk=300, h=4, hk=2, d=d)
    lengths = jnp.asarray([300, 150])
    qi, qs, ki, ks, v32, _ = A._prologue(q, k, v, lengths, 64, block_k, d**-0.5)
    config = AttentionConfig(block_k=block_k, num_stages=num_stages, pv_accumulation=accumulation)
    lowered = A.mosaic.mosaic_attention(qi, qs, ki, ks, v32, lengths, pv=pv, config=config, p_in_smem=p_in_smem,
                                        lower_only=True, out_dtype=out_dtype)
    assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.parametrize("d, pv, out_dtype, accumulation, batched_tables", [
    (128, "fp8", jnp.bfloat16, "in_place", False),  # the models' (Krea 2: bf16 Q and output)
    (128, "bf16", jnp.bfloat16, "two_level", True),  # bf16 V's tiles: the most shared memory
    (64, "fp8", jnp.float32, "two_level", False),
])
@pytest.mark.usefixtures("hopper")
def test_mosaic_kernel_making_q_itself_lowers_for_the_gpu(d, pv, out_dtype, accumulation, batched_tables):
    """`q_prologue`: the register paths the interpreter does not run (`_pairs_from_table`, `_rotate_pairs`), the
    tables' copies and shared memory."""
    from mxdit.pallas_kernels import attention as A

    q, k, v, (nq, nk), cos, sin = _raw_projections(7, s=200, d=d, batched_tables=batched_tables)
    lengths = jnp.asarray([200, 150])
    _, _, ki, ks = A._qk_prologue(q, (0, 4), k, (0, 2), nq, nk, 1e-6, cos, sin, lengths, scale=d**-0.5, block_q=64,
                                  block_k=128, smooth_k=True, interpret=True, k_only=True)
    prologue = A.MosaicQPrologue(nq, 1e-6, cos, sin, d**-0.5, 4)
    q = q.astype(out_dtype)  # raw Q in the output's dtype, as the kernel takes it
    options = dict(pv=pv, config=AttentionConfig(block_k=128, pv_accumulation=accumulation), p_in_smem=False,
                   lower_only=True, out_dtype=out_dtype, q_prologue=prologue)
    lowered = A.mosaic.mosaic_attention(q, None, ki, ks, v, lengths, **options)
    assert "mosaic_gpu" in lowered.as_text()
    other = jnp.bfloat16 if out_dtype == jnp.float32 else jnp.float32
    with pytest.raises(ValueError, match="must have the output's dtype"):
        A.mosaic.mosaic_attention(q.astype(other), None, ki, ks, v, lengths, **options)


def test_smoothed_v_matches_the_mosaic_kernel_and_keeps_channel_means():
    """`smooth_v`: V's channel means leave before FP8 P.V and come back after. The Mosaic kernel (interpreter) gives
    the reference's numbers, and on V with large channel means the error stays what zero-mean V gives (its FP8
    rounding is relative to V centred). On the GPU it also removes the in-place accumulator's bias
    (docs/kernels/int8_attention.md), which neither the interpreter nor the reference models."""
    from mxdit.pallas_kernels import attention as A

    q, k, v = inputs(8, sq=130, sk=200, h=4, hk=2, d=128, k_outlier=20.0)
    v = v + jnp.linspace(-6.0, 6.0, 128)  # channel means several times their spread
    kv = jnp.asarray([200, 77])
    truth = exact(q, k, v, kv)
    ref = int8_attention_reference(q, k, v, kv_lengths=kv, pv="fp8", block_q=64, block_k=128, smooth_v=True)
    plain = int8_attention_reference(q, k, v, kv_lengths=kv, pv="fp8", block_q=64, block_k=128)
    out = A.int8_attention(q, k, v, kv_lengths=kv, pv="fp8", backend="mosaic", interpret=True)
    assert relative_l1(out, ref) <= 2e-3
    # the centred V's FP8 rounding: the error of the output's varying part against exact attention's
    centred = truth - jnp.mean(truth, axis=1, keepdims=True)
    assert relative_l1(ref - jnp.mean(ref, axis=1, keepdims=True), centred) <= BOUNDS["fp8"]
    assert relative_l1(ref, truth) < 0.5 * relative_l1(plain, truth)


@pytest.mark.usefixtures("hopper")
def test_mosaic_kernel_with_row_sums_by_wgmma_lowers_for_the_gpu():
    """FP8 P.V accumulated in place takes the softmax's row sums from a second wgmma (P times a ones column, N = 8)
    into a fresh accumulator a key block, and V's channel means out and back in. The interpreter cannot run it (P
    from registers): its lowering is checked here, the numerics on the GPU (tests/test_gpu_kernels.py)."""
    from mxdit.pallas_kernels import attention as A

    q, k, v, (nq, nk), cos, sin = _raw_projections(7, s=200, d=128)
    lengths = jnp.asarray([200, 150])
    q = q.astype(jnp.bfloat16)
    _, _, ki, ks = A._qk_prologue(q, (0, 4), k, (0, 2), nq, nk, 1e-6, cos, sin, lengths, scale=128**-0.5,
                                  block_q=64, block_k=128, smooth_k=True, interpret=True, k_only=True)
    lowered = A.mosaic.mosaic_attention(q, None, ki, ks, v, lengths, pv="fp8",
                                        config=AttentionConfig(block_k=128, pv_accumulation="in_place"),
                                        p_in_smem=False, lower_only=True, out_dtype=jnp.bfloat16,
                                        q_prologue=A.MosaicQPrologue(nq, 1e-6, cos, sin, 128**-0.5, 4))
    assert "mosaic_gpu" in lowered.as_text()


def test_pair_table_order_is_what_a_wgmma_thread_holds():
    """Read as a (rows, pairs) array in the WGMMA layout, a table in `_pair_table_order` gives the thread of lane c
    (mod 4), at its register vector of column tile t, the values of pairs 8t + c and 8t + 4 + c: the pairs of the
    full (rows, 2 * pairs) array's column tiles 2t and 2t + 1 that the same thread holds (columns 8u + 2c, +1)."""
    from mxdit.pallas_kernels.attention.mosaic_fragments import _pair_table_order

    pairs = 64
    natural = np.arange(pairs)
    ordered = np.asarray(_pair_table_order(jnp.asarray(natural)))
    for t in range(pairs // 8):
        for c in range(4):
            held = ordered[8 * t + 2 * c:8 * t + 2 * c + 2]  # the thread's vector of two columns in tile t
            full_tiles = [2 * t, 2 * t + 1]
            assert list(held) == [(8 * u + 2 * c) // 2 for u in full_tiles]
    np.testing.assert_array_equal(np.asarray(_pair_table_order(jnp.asarray(ordered), inverse=True)), natural)


@pytest.mark.parametrize("pv, batched_tables", [("bf16", False), ("fp8", True)])
def test_mosaic_kernel_making_q_itself_matches_the_reference_with_q_per_row(pv, batched_tables):
    """`int8_attention_fused(backend="mosaic")` with bf16 Q and output: the kernel norms, rotates and quantizes Q
    per row itself, and K's pass writes the natural channel order. Against `int8_attention_reference` with Q
    quantized per row (block_q=1) on the same bf16 inputs; per 64 rows (the pass's blocks) is measurably farther,
    so the comparison tells them apart. Measured: bf16 0.0055 from the per-row reference (its float32 output rounded
    to bf16 accounts for most), the per-64-row reference 0.0096 from it."""
    from mxdit.pallas_kernels import attention as A

    q, k, v, (nq, nk), cos, sin = _raw_projections(8, s=200, batched_tables=batched_tables)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    lengths = jnp.asarray([200, 61])
    out = A.int8_attention_fused(q, k, v, nq, nk, 1e-6, cos, sin, kv_lengths=lengths, pv=pv, backend="mosaic",
                                 config=AttentionConfig(), interpret=True, out_dtype=jnp.bfloat16).astype(jnp.float32)
    qn, kn = A.rms_rope_reference(q, nq, 1e-6, cos, sin), A.rms_rope_reference(k, nk, 1e-6, cos, sin)
    smooth = dict(smooth_v=pv == "fp8")  # as the Mosaic kernel's FP8 P.V
    per_row = A.int8_attention_reference(qn, kn, v, kv_lengths=lengths, pv=pv, block_q=1, block_k=64, **smooth)
    per_block = A.int8_attention_reference(qn, kn, v, kv_lengths=lengths, pv=pv, block_q=64, block_k=64, **smooth)
    truth = exact(qn, kn, v.astype(jnp.float32), lengths)
    if pv == "bf16":
        assert relative_l1(out, per_row) <= 7e-3 < relative_l1(per_block, per_row)
    else:  # each P rounding its own (as for the Mosaic kernel above): at least as close to exact as the reference
        assert relative_l1(out, truth) <= 1.02 * relative_l1(per_row, truth)
    assert cosine(out, truth) >= 0.999 and relative_l1(out, truth) <= BOUNDS[pv]


def test_fp8_p_registers_read_as_the_8bit_operand_hold_p_in_pv_key_order():
    """The register P path for FP8 P.V regroups the accumulator-layout registers (WGMMA: two bytes a vector) into
    the 8-bit operand layout (WGMMA_8BIT: four) without moving data, and permutes V's keys to match. Which element
    each thread's registers hold is computed here from the two layouts' own tilings (as Mosaic GPU's
    `thread_idxs` does, in numpy): the regrouped registers must hold P[row, order[col]] at (row, col), order being
    `_pv_key_order`. The interpreter cannot run this path (its wgmma takes A from shared memory only); on the GPU
    it gives the shared-memory path's output (cosine and relative L1 against exact attention equal to 7 digits)."""
    from jax.experimental.mosaic.gpu import fragmented_array as fa

    from mxdit.pallas_kernels.attention.mosaic_fragments import _pv_key_order

    def held(layout, shape):  # thread -> register index -> the (row, col) of each element of its vector
        contiguous = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
        strides = layout.tiling.tile_strides(contiguous)
        tiled, tile_strides = layout.tiled_tiling_shape, strides[-layout.tiled_tiling_rank:]

        def offset(index, dims):
            sizes = [tiled[d] for d in dims]
            return sum((index // int(np.prod(sizes[i + 1:]))) % size * tile_strides[d]
                       for i, (d, size) in enumerate(zip(dims, sizes)))

        return {t: {r: [divmod(offset(t // 32, layout.warp_dims) + offset(t % 32, layout.lane_dims)
                               + sum(i * s for i, s in zip(r, strides)) + e * tile_strides[layout.vector_dim], shape[1])
                        for e in range(layout.vector_length)]
                    for r in np.ndindex(layout.registers_shape(shape))}
                for t in range(128)}

    shape = (64, 128)
    wgmma, operand = held(fa.WGMMA_LAYOUT, shape), held(fa.WGMMA_LAYOUT_8BIT, shape)
    every = [(r, c) for r in range(64) for c in range(128)]
    for layout in (wgmma, operand):  # the emulation is a partition of the tile, as a layout must be
        assert sorted(x for regs in layout.values() for v in regs.values() for x in v) == every
    order = _pv_key_order(128)
    for t in range(128):
        for r, positions in operand[t].items():
            pair = wgmma[t][(r[0], 2 * r[1], *r[2:])] + wgmma[t][(r[0], 2 * r[1] + 1, *r[2:])]
            assert [(row, order[col]) for row, col in positions] == pair
    assert sorted(order) == list(range(128))


@pytest.mark.parametrize("permute_keys, smooth", [(False, False), (True, False), (True, True)])
def test_v_fp8_operand_kernel_gives_v_transposed_and_in_pv_key_order(permute_keys, smooth):
    """The Triton pass that makes FP8 P.V's V operand: V / scale in E4M3 (V less its channel means with `smooth`),
    transposed to (dim, keys), the keys in `_pv_key_order` for P from registers; the same bytes as XLA's
    quantization, transpose and gather."""
    from mxdit.pallas_kernels.attention import v_fp8_operand
    from mxdit.pallas_kernels.attention.mosaic_fragments import _pv_key_order
    from mxdit.pallas_kernels.attention.reference import _quantize_v_fp8

    v32 = jax.random.normal(jax.random.key(3), (2, 64, 3, 32)) * jnp.arange(1, 33) + jnp.arange(-16, 16)
    v8, scale, mean = _quantize_v_fp8(v32, smooth=smooth)
    want = np.asarray(v8.transpose(0, 2, 3, 1).astype(jnp.float32))
    if permute_keys:
        want = want[..., _pv_key_order(64)]
    got, got_scale, got_mean = v_fp8_operand(v32, 32, permute_keys=permute_keys, interpret=True, smooth=smooth)
    assert got.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), want)
    np.testing.assert_array_equal(np.asarray(got_scale), np.asarray(scale))
    np.testing.assert_array_equal(np.asarray(got_mean), np.asarray(mean))
    if smooth:  # the means are V's, and the scales those of V centred
        np.testing.assert_allclose(np.asarray(mean), np.asarray(v32.mean(axis=1)), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(scale), np.abs(v32 - mean[:, None]).max(axis=1) / 448, rtol=1e-6)


def test_v_fp8_operand_zeroes_masked_keys_read_as_they_are():
    """V in bf16 as the projection gives it, masked keys holding large values, 50 keys (padded to 64): the operand
    and scales of the float32 V with those keys zeroed first (the masked keys neither reach P.V nor V's range)."""
    from mxdit.pallas_kernels.attention import v_fp8_operand

    v = (jax.random.normal(jax.random.key(4), (2, 50, 3, 32)) * jnp.arange(1, 33)).astype(jnp.bfloat16)
    lengths = jnp.asarray([50, 21])
    garbage = v.at[1, 21:].set(3e4)
    zeroed = jnp.where((jnp.arange(50) < 21)[None, :, None, None] | (jnp.arange(2) == 0)[:, None, None, None],
                       v.astype(jnp.float32), 0.0)
    for permute_keys in (False, True):
        got = v_fp8_operand(garbage, 32, permute_keys=permute_keys, kv_lengths=lengths, interpret=True)
        want = v_fp8_operand(zeroed, 32, permute_keys=permute_keys, interpret=True)
        assert got[0].shape == (2, 3, 32, 64)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
    # smoothed: the means and ranges of the valid keys only (the first batch element's are all valid)
    got = v_fp8_operand(garbage, 32, permute_keys=True, kv_lengths=lengths, interpret=True, smooth=True)
    short = v_fp8_operand(v[1:, :21], 32, permute_keys=True, interpret=True, smooth=True)
    np.testing.assert_array_equal(np.asarray(got[2][1:]), np.asarray(short[2]))
    np.testing.assert_array_equal(np.asarray(got[1][1:]), np.asarray(short[1]))
    np.testing.assert_array_equal(np.asarray(got[0][1:, :, :, :32].astype(jnp.float32)),
                                  np.asarray(short[0].astype(jnp.float32)))
    assert not np.asarray(got[0][1:, :, :, 32:].astype(jnp.float32)).any()


@pytest.mark.parametrize("keys", [64, 50])
def test_v_fp8_operand_reads_heads_of_a_stacked_source_in_place(keys):
    """`heads=(first, count)`: V's heads read in place from a wider (stacked) source, with precomputed scales and
    means (the models' path) or without, keys a whole number of blocks or not (then padded): the same operand as
    the sliced V gives."""
    from mxdit.pallas_kernels.attention import v_fp8_operand
    from mxdit.pallas_kernels.attention.reference import _v_fp8_scale_and_mean

    stacked = jax.random.normal(jax.random.key(5), (2, keys, 7, 32)).astype(jnp.bfloat16)
    lengths = jnp.asarray([keys, 21])
    v = stacked[:, :, 3:5]
    scale_and_mean = _v_fp8_scale_and_mean(v, lengths, True)
    for given in (None, scale_and_mean):
        options = dict(permute_keys=True, kv_lengths=lengths, interpret=True, smooth=True, scale_and_mean=given)
        got = v_fp8_operand(stacked, 32, heads=(3, 2), **options)
        want = v_fp8_operand(v, 32, **options)
        assert got[0].shape == (2, 2, 32, 64)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))


@pytest.mark.usefixtures("hopper")
def test_mosaic_backend_names_its_limits():
    from mxdit.pallas_kernels.attention import int8_attention

    q, k, v = inputs(8, sq=64, sk=64, h=2, hk=2)
    with pytest.raises(ValueError, match="block_q must be 64"):
        int8_attention(q, k, v, config=AttentionConfig(block_q=128), backend="mosaic", interpret=True)
    with pytest.raises(ValueError, match="backend must be"):
        int8_attention(q, k, v, backend="cuda")
    from mxdit.pallas_kernels import attention as A

    qi, qs, ki, ks, v32, _ = A._prologue(q, k, v, None, 64, 64, 0.125)
    for pv, p_in_smem, accumulation in (("fp8", False, "fresh"), ("bf16", False, "in_place"),
                                        ("fp8", True, "in_place")):
        with pytest.raises(ValueError, match="pv_accumulation"):
            A.mosaic.mosaic_attention(qi, qs, ki, ks, v32, None, pv=pv, p_in_smem=p_in_smem, lower_only=True,
                                      config=AttentionConfig(pv_accumulation=accumulation))
    with pytest.raises(ValueError, match="mosaic backend's"):
        int8_attention(q, k, v, pv="fp8", config=AttentionConfig(pv_accumulation="in_place"))


# the Mosaic kernel in a model: ~30 s on 2 cores (its interpret-mode tests above run by default)
@pytest.mark.parametrize("kernel, head_dim", [("int8", 32), pytest.param("int8_mosaic_fp8", 64, marks=pytest.mark.slow)])
def test_krea2_transformer_runs_on_the_int8_attention_kernel(kernel, head_dim):
    """The model switch: `attention="int8"` (or "int8_mosaic_fp8": the Hopper kernel, FP8 P.V) takes the Pallas
    kernel (interpret mode on the CPU) in every block, and the velocity stays within the INT8-QK error of exact
    attention for its P.V precision."""
    from flax import nnx

    from mxdit.model.krea2 import Krea2Config, Krea2Transformer

    rope = {32: (8, 12, 12), 64: (16, 24, 24)}[head_dim]  # the Mosaic kernel takes head_dim a multiple of 64
    text_dim = 2 * head_dim  # two text heads of head_dim
    cfg = Krea2Config(in_channels=16, num_layers=1, attention_head_dim=head_dim, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, timestep_embed_dim=32, text_hidden_dim=text_dim,
                      num_text_layers=2, text_num_attention_heads=2, text_num_key_value_heads=2,
                      text_intermediate_size=64, axes_dims_rope=rope,
                      num_layerwise_text_blocks=1, num_refiner_text_blocks=1)
    model = Krea2Transformer(cfg, dtype=jnp.float32, attention="xla", rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.standard_normal((1, 24, 16)), jnp.float32)
    text = jnp.asarray(rng.standard_normal((1, 10, 2, text_dim)), jnp.float32)
    ids = np.zeros((34, 3), np.float32)
    ids[10:, 1], ids[10:, 2] = np.arange(24) // 6, np.arange(24) % 6
    mask = jnp.asarray(np.arange(10)[None] < 7)
    args = (hidden, text, jnp.array([0.6], jnp.float32), jnp.asarray(ids), mask)
    # Triton: one compiled program per model (the module a pytree, its attention choice static), where op by op the
    # interpreted kernel and every layer compile hundreds of small programs. The Mosaic GPU interpreter runs op by
    # op: under jit on the CPU it hangs.
    run = jax.jit(lambda model, *args: model(*args)) if kernel == "int8" else lambda model, *args: model(*args)
    reference = run(model, *args)
    model.attention = kernel
    quantized = run(model, *args)
    assert cosine(quantized, reference) > 0.999
    assert relative_l1(quantized, reference) < BOUNDS["fp8" if kernel.endswith("_fp8") else "bf16"]
    # stacked QKVG: the prologue reads Q and K in place from the stacked product; the same velocity
    from mxdit.model.krea2 import stack_projections

    stacked = nnx.clone(model)
    assert stack_projections(stacked) > 0
    np.testing.assert_allclose(np.asarray(run(stacked, *args)), np.asarray(quantized), rtol=0,
                               atol=1e-5 * float(jnp.max(jnp.abs(quantized))))


# -- the fused prologue: RMSNorm + rotary + K smoothing + INT8 quantization in one kernel -----------------------------


def _raw_projections(seed, b=2, s=100, h=4, hk=2, d=64, batched_tables=False):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, s, h, d)) * 3, jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, s, hk, d)) * 3 + 5.0 * (np.arange(d) == 6), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, s, hk, d)), jnp.float32)
    norms = [jnp.asarray(rng.standard_normal(d) * 0.1, jnp.float32) for _ in range(2)]
    positions = np.arange(s)[None, :] + (np.arange(b)[:, None] * 7 if batched_tables else 0)
    angles = positions[..., None] * (1.0 / 100 ** (np.arange(0, d, 2) / d))
    cos, sin = (jnp.asarray(np.repeat(f(angles), 2, -1), jnp.float32) for f in (np.cos, np.sin))
    if not batched_tables:
        cos, sin = cos[0], sin[0]
    return q, k, v, norms, cos, sin


def test_compute_warpgroup_registers_fit_the_sm():
    """What the Mosaic kernel asks `setmaxnreg` for must fit in 65536 registers with the memory warpgroup's 40."""
    from mxdit.pallas_kernels.attention.mosaic_fragments import compute_registers

    assert compute_registers(2) == 232  # jax's own FA3 kernel uses the same
    assert compute_registers(3, 24) == 160  # three compute warpgroups, the memory warpgroup keeping 24
    for wgs in (1, 2, 3):
        for memory in (24, 40):
            registers = compute_registers(wgs, memory)
            assert registers % 8 == 0 and wgs * 128 * registers + 128 * memory <= 65536


def test_mosaic_kernel_takes_turns_in_a_ring_as_in_pairs():
    """`turns="ring"` (what three compute warpgroups use) with two: the interpreter runs it, and the output is the
    pairs' schedule's to the bit (the order of the tensor cores' work changes, not the arithmetic)."""
    from mxdit.pallas_kernels import attention as A

    q, k, v = inputs(6, sq=130, sk=200, h=2, hk=2, d=128, k_outlier=20.0)
    options = dict(kv_lengths=jnp.asarray([200, 77]), pv="fp8", backend="mosaic", interpret=True)
    pairs = A.int8_attention(q, k, v, config=AttentionConfig(block_k=128), **options)
    ring = A.int8_attention(q, k, v, config=AttentionConfig(block_k=128, turns="ring"), **options)
    np.testing.assert_array_equal(np.asarray(ring), np.asarray(pairs))


def test_mosaic_compute_warpgroups_choice_and_limits():
    """Three compute warpgroups for FP8 P.V at head_dim <= 128 where 192-row CTAs pad no more than 128-row ones (Krea
    2 at 1024^2: 4224 tokens, no padding either way); two for bf16 P.V, head_dim 256, 4096 tokens (22 x 192 would
    pad 128 rows) and in interpret mode; other counts and pairs of three are named."""
    from mxdit.pallas_kernels import attention as A

    wgs = A.config.mosaic_compute_wgs
    assert wgs("fp8", 128, 4224, False) == 3 and wgs("fp8", 64, 4608, False) == 3
    assert wgs("fp8", 128, 4096, False) == 2
    assert wgs("bf16", 128, 4224, False) == wgs("fp8", 256, 4224, False) == 2
    assert wgs("fp8", 128, 4224, True) == 2
    # Q made in the kernel from float32 tiles (a float32 output): three fit in shared memory at head_dim 64 only
    assert wgs("fp8", 128, 4224, False, float32_q_tiles=True) == 2
    assert wgs("fp8", 64, 4224, False, float32_q_tiles=True) == 3
    q, k, v = inputs(7, sq=192, sk=128, h=2, hk=2, d=64)
    qi, qs, ki, ks, v32, _ = A._prologue(q, k, v, None, 64, 128, 0.125)
    for options, message in ((dict(compute_wgs=4), "compute_wgs must be 2 or 3, got 4"),
                             (dict(compute_wgs=3, turns="pairs"), "'pairs' takes two")):
        with pytest.raises(ValueError, match=message):
            A.mosaic.mosaic_attention(qi, qs, ki, ks, v32, None, pv="fp8", lower_only=True,
                                      config=AttentionConfig(block_k=128, **options))


@pytest.mark.parametrize("d, q_in_kernel, out_dtype", [(128, True, jnp.bfloat16), (128, False, jnp.bfloat16),
                                                       (64, True, jnp.bfloat16), (64, True, jnp.float32),
                                                       (128, True, jnp.float32)])
@pytest.mark.usefixtures("hopper")
def test_mosaic_kernel_with_the_default_compute_warpgroups_lowers_for_the_gpu(d, q_in_kernel, out_dtype):
    """192 query rows, FP8 P.V: three compute warpgroups by default (the models' case), but two where Q is made in
    the kernel from float32 tiles at head_dim 128 (three would overflow shared memory); registers, barriers and
    shared memory (with Q made in the kernel, INT8 Q takes the tables' memory). The interpreter cannot run three
    here (`config.mosaic_compute_wgs`); on the GPU their output equals two warpgroups' to the bit."""
    from mxdit.pallas_kernels import attention as A

    q, k, v, (nq, nk), cos, sin = _raw_projections(7, s=192, d=d)
    lengths = jnp.asarray([192, 150])
    q = q.astype(out_dtype)
    qi, qs, ki, ks = A._qk_prologue(q, (0, 4), k, (0, 2), nq, nk, 1e-6, cos, sin, lengths, scale=d**-0.5,
                                    block_q=64, block_k=128, smooth_k=True, interpret=True, k_only=q_in_kernel)
    options = dict(pv="fp8", p_in_smem=False, lower_only=True, out_dtype=out_dtype)  # the default config
    if q_in_kernel:
        qi, options["q_prologue"] = q, A.MosaicQPrologue(nq, 1e-6, cos, sin, d**-0.5, 4)
    lowered = A.mosaic.mosaic_attention(qi, qs, ki, ks, v, lengths, **options)
    assert "mosaic_gpu" in lowered.as_text()
    if d == 128 and q_in_kernel and out_dtype == jnp.float32:  # the choice above is what makes it fit
        with pytest.raises(Exception, match="exceeds available shared memory"):
            A.mosaic.mosaic_attention(qi, qs, ki, ks, v, lengths, **options,
                                      config=AttentionConfig(block_k=128, compute_wgs=3, pv_accumulation="in_place"))


def test_int32_to_biased_float32_by_bits_is_exact_over_the_int8_product_range():
    """The Mosaic kernel's conversion of Q.K^T (an integer add, not the slow convert instruction) gives x + 1.5 * 2^23
    exactly for every product of 256 INT8 pairs, the largest head_dim it takes."""
    from mxdit.pallas_kernels.attention.mosaic_fragments import _MAGIC_FLOAT, _int32_to_biased_float32

    bound = 256 * 127 * 127
    x = jnp.concatenate([jnp.arange(-2000, 2000, dtype=jnp.int32), jnp.array([bound, -bound, bound - 1], jnp.int32),
                         jax.random.randint(jax.random.key(0), (100_000,), -bound, bound + 1, jnp.int32)])
    biased = jax.jit(_int32_to_biased_float32)(x)
    np.testing.assert_array_equal(np.asarray(biased - _MAGIC_FLOAT), np.asarray(x).astype(np.float32))
