"""Attention kernels: jax's cuDNN and XLA attention (bf16) and our INT8-QK kernels (`pallas_kernels/attention`,
Triton and Mosaic GPU lowerings) against torch's SDPA (in a subprocess), and the INT8 kernels' fused Q/K prologue.
B=1, 48 query heads of 128, GQA 48/12 and 48/48, with and without the key padding mask."""

from __future__ import annotations

import faulthandler
import itertools
import sys

from .rows import emit, error_text, flags, subprocess_rows, write_json
from .timing import cupti_seconds

HEADS, HEAD_DIM = 48, 128


def padded_length(seq: int) -> int:
    """Valid keys of the masked variants: Krea 2's 512 text tokens come last, 120 of them real."""
    return seq - 512 + 120


def attention_benchmark(args) -> None:
    """torch (a subprocess), then jax (another): the two in one table."""
    forwarded = flags(args, "seq", "kv_heads", "iters")
    rows = subprocess_rows(args, "attention-torch", forwarded + ["--repeats", "3"])
    jax_args = forwarded + flags(args, "variant_timeout", "v_channel_means", "only")
    jax_args += ["--int8-configs", *(",".join(map(str, c)) for c in args.int8_configs)]
    jax_args += ["--mosaic-attention-configs", *(",".join(map(str, c)) for c in args.mosaic_attention_configs)]
    rows += subprocess_rows(args, "attention-jax", jax_args)
    # TOPS: the whole call (with the XLA quantization prologue for the INT8 kernels); kernel: its longest kernel alone
    print(f"\n{'implementation':<100} {'TOPS':>6} {'kernel':>6} {'cosine':>9} {'rel L1':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:<100} error: {r['error']}")
        else:
            tops = r.get("tflops", 0)
            kernel = tops * r["s"] / max(r["kernels"].values()) if r.get("kernels") and r.get("s") else tops
            cos = f"{r['cosine']:9.6f}" if "cosine" in r else f"{'':>9}"
            rel = f"{r['rel_l1']:7.4f}" if "rel_l1" in r else f"{'':>7}"
            print(f"{r['name']:<100} {tops:6.0f} {kernel:6.0f} {cos} {rel}")
    write_json(args, rows)


def _qkv(seq: int, kv_heads: int, v_channel_means: float):
    """Random Q, K, V (bf16). Drawn in float32, then rounded: normals drawn in bf16 take few distinct values, on
    which V's FP8 rounding errors repeat instead of averaging out. K has a channel of large mean, as real DiTs have
    (what K smoothing is for); V channel means of about `v_channel_means` times its spread (what V smoothing is
    for)."""
    import jax
    import jax.numpy as jnp

    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (1, seq, HEADS, HEAD_DIM), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(kk, (1, seq, kv_heads, HEAD_DIM), jnp.float32) + 4.0 * (jnp.arange(HEAD_DIM) == 7)
    v = jax.random.normal(kv, (1, seq, kv_heads, HEAD_DIM), jnp.float32)
    v = v + v_channel_means * jnp.sin(0.37 * jnp.arange(kv_heads * HEAD_DIM)).reshape(kv_heads, HEAD_DIM)
    return q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)


def _attention_variants(args, lengths, tag: str) -> dict:
    """name -> fn(q, k, v) of normed and rotated Q and K: jax's bf16 attention, and the INT8-QK kernels with bf16
    and FP8 P.V at each of --int8-configs (Triton) and --mosaic-attention-configs (Mosaic GPU: the default config
    with that key block and ring; FP8 P.V accumulated in two levels and in place)."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from mxdit.pallas_kernels import attention

    variants = {
        f"jax cuDNN bf16, {tag}": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, key_value_seq_lengths=lengths, implementation="cudnn"),
        f"jax XLA bf16, {tag}": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, key_value_seq_lengths=lengths, implementation="xla"),
    }
    for pv in ("bf16", "fp8"):
        for bq, bk, warps, stages in args.int8_configs:
            config = attention.AttentionConfig(block_q=bq, block_k=bk, num_warps=warps, num_stages=stages)
            variants[f"int8-QK {pv}-PV triton q{bq} k{bk} w{warps} s{stages}, {tag}"] = (
                lambda q, k, v, pv=pv, config=config: attention.int8_attention(
                    q, k, v, kv_lengths=lengths, pv=pv, config=config))
        mosaic = attention.default_config("mosaic", pv, HEAD_DIM, args.seq)
        for bk, stages in args.mosaic_attention_configs:
            for accumulation in ("two_level", "in_place") if pv == "fp8" else ("two_level",):
                config = dataclasses.replace(mosaic, block_k=bk, num_stages=stages, pv_accumulation=accumulation)
                in_place = " in-place" if accumulation == "in_place" else ""
                variants[f"int8-QK {pv}-PV{in_place} mosaic k{bk} s{stages}, {tag}"] = (
                    lambda q, k, v, pv=pv, config=config: attention.int8_attention(
                        q, k, v, kv_lengths=lengths, pv=pv, backend="mosaic", config=config,
                        out_dtype=jnp.bfloat16))  # bf16 out, as cuDNN's and the models'
    return variants


def _fused_variants(lengths, tag: str, norm, cos, sin) -> dict:
    """name -> fn(q, k, v) of raw Q and K projections: XLA's RMSNorm + rotary then cuDNN, against the INT8 kernels
    with their fused RMSNorm + rotary + quantize prologue, in their default configs (as the models call them)."""
    import jax
    import jax.numpy as jnp

    from mxdit.pallas_kernels import attention

    variants = {f"XLA RMSNorm+rotary, then jax cuDNN bf16, {tag}": lambda q, k, v: jax.nn.dot_product_attention(
        attention.rms_rope_reference(q, norm, 1e-6, cos, sin).astype(jnp.bfloat16),
        attention.rms_rope_reference(k, norm, 1e-6, cos, sin).astype(jnp.bfloat16), v,
        key_value_seq_lengths=lengths, implementation="cudnn")}
    for pv in ("bf16", "fp8"):
        for backend in ("triton", "mosaic"):
            out_dtype = jnp.bfloat16 if backend == "mosaic" else jnp.float32
            variants[f"int8-QK {pv}-PV {backend} with fused RMSNorm+rotary+quantize prologue, {tag}"] = (
                lambda q, k, v, pv=pv, backend=backend, out_dtype=out_dtype: attention.int8_attention_fused(
                    q, k, v, norm, norm, 1e-6, cos, sin, kv_lengths=lengths, pv=pv, backend=backend,
                    out_dtype=out_dtype))
    return variants


def jax_attention(args) -> list[dict]:
    """Each variant's CUPTI time, and its cosine and relative L1 against float32 attention."""
    import jax
    import jax.numpy as jnp

    from mxdit.pallas_kernels import attention

    s, d = args.seq, HEAD_DIM
    flops = 4.0 * s * s * d * HEADS
    norm = jnp.zeros((d,), jnp.float32)
    angles = jnp.arange(s)[:, None] * (1.0 / 10000 ** (jnp.arange(0, d, 2) / d))
    cos, sin = jnp.repeat(jnp.cos(angles), 2, -1), jnp.repeat(jnp.sin(angles), 2, -1)
    rows = []
    for kv_heads in args.kv_heads:
        q, k, v = _qkv(s, kv_heads, args.v_channel_means)
        for masked in (False, True):
            lengths = jnp.array([padded_length(s)], jnp.int32) if masked else None
            tag = f"GQA {HEADS}/{kv_heads}" + (", masked" if masked else "")

            def exact(q, k, v, lengths=lengths):
                return jax.nn.dot_product_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                                                    v.astype(jnp.float32), key_value_seq_lengths=lengths,
                                                    implementation="xla")

            truths = (jax.jit(exact)(q, k, v), jax.jit(lambda q, k, v: exact(
                attention.rms_rope_reference(q, norm, 1e-6, cos, sin),
                attention.rms_rope_reference(k, norm, 1e-6, cos, sin), v))(q, k, v))
            for fused, variants in enumerate((_attention_variants(args, lengths, tag),
                                              _fused_variants(lengths, tag, norm, cos, sin))):
                for name, fn in variants.items():
                    if not args.only or any(text in name for text in args.only):
                        rows.append(emit(_run_variant(args, name, fn, (q, k, v), truths[fused], flops)))
    return rows


def _run_variant(args, name: str, fn, inputs, truth, flops: float) -> dict:
    import jax
    import jax.numpy as jnp

    row = {"name": name}
    # A kernel that hangs on the device prints nothing; this names it and ends the process.
    print(f"running: {name}", file=sys.stderr, flush=True)
    faulthandler.dump_traceback_later(args.variant_timeout, exit=True)
    try:
        f = jax.jit(fn)
        out = jax.block_until_ready(f(*inputs)).astype(jnp.float32)
        seconds, kernels = cupti_seconds(f, *inputs, iterations=args.iters, by_kernel=True)
        diff = (out - truth).ravel()
        row.update(s=seconds, tflops=flops / seconds / 1e12, kernels=kernels,
                   cosine=float(jnp.dot(out.ravel(), truth.ravel()) / (jnp.linalg.norm(out) * jnp.linalg.norm(truth))),
                   rel_l1=float(jnp.sum(jnp.abs(diff)) / jnp.sum(jnp.abs(truth))))
    except Exception as e:
        row["error"] = error_text(e)
    faulthandler.cancel_dump_traceback_later()
    return row


def qk_prologue(args) -> None:
    """The INT8 attention's fused Q/K prologue (RMSNorm, rotary, K smoothing, INT8 per block: Krea 2's Q and K read
    in place from the stacked QKVG product): its default config, then each --heads-per-program x --warps (both
    passes); CUPTI time of each kernel, and how far the codes and scales are from the default's."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from mxdit.pallas_kernels import attention

    b, s, h, hk, d = 1, args.seq, args.heads, args.kv_heads, HEAD_DIM
    x = (jax.random.normal(jax.random.key(0), (b, s, 2 * h + 2 * hk, d), jnp.float32) * 3).astype(jnp.bfloat16)
    norms = jax.random.normal(jax.random.key(1), (2, d), jnp.float32) * 0.1
    angles = np.arange(s)[:, None] * (1.0 / 1000 ** (np.arange(0, d, 2) / d))
    cos, sin = (jnp.asarray(np.repeat(f(angles), 2, -1), jnp.float32) for f in (np.cos, np.sin))
    lengths = jnp.asarray([s - 8])
    configs = {"default": attention.PrologueConfig()}
    for group, warps in itertools.product(args.heads_per_program, args.warps):
        configs[f"{group} heads a program, {warps} warps"] = attention.PrologueConfig(
            q_warps=warps, k_warps=warps, q_heads=group, k_heads=group)
    print(f"\nQ/K prologue, {s} tokens, {h}/{hk} heads of {d}, stacked source; us per kernel (CUPTI)")
    first = None
    for label, config in configs.items():
        run = jax.jit(lambda x, norms, config=config: attention.int8_qk_prologue_stacked(
            x, h, hk, norms[0], norms[1], 1e-6, cos, sin, lengths, scale=d**-0.5, block_q=64, block_k=128,
            config=config, interpret=jax.default_backend() != "gpu"))
        try:
            out = jax.block_until_ready(run(x, norms))
            total, kernels = cupti_seconds(run, x, norms, iterations=args.iters, by_kernel=True)
        except Exception as e:  # a configuration that does not compile here
            print(f"{label:<40} error: {error_text(e)[:200]}")
            continue
        first = first or out
        # Against the default: a different reduction order (warps, heads a program) may round a block's RMS or
        # maximum differently, moving a few codes by one; anything more is a bug.
        codes = [(np.asarray(a, np.int32), np.asarray(b_, np.int32)) for a, b_ in zip(out[0::2], first[0::2])]
        differ = sum(int(np.sum(a != b_)) for a, b_ in codes) / sum(a.size for a, _ in codes)
        furthest = max(int(np.max(np.abs(a - b_))) for a, b_ in codes)
        scales = max(float(np.max(np.abs(np.asarray(a) / np.asarray(b_) - 1))) for a, b_ in zip(out[1::2], first[1::2]))
        parts = ", ".join(f"{name[:24]} {t * 1e6:.1f}" for name, t in sorted(kernels.items(), key=lambda kv: -kv[1]))
        print(f"{label:<40} total {total * 1e6:7.1f}  codes differing {differ:.1e} (at most {furthest}), scales "
              f"{scales:.1e}  {parts}")
