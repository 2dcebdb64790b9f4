"""The Krea 2 Turbo pipeline end to end (text encoding, denoising, decoding), cold and warm, against diffusers'."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import numpy as np

from .inputs import QWEN3VL_4B_TEXT, krea2_config
from .rows import emit, flags, subprocess_rows, write_json
from .timing import jax_peak_gb


def krea2_pipeline(args) -> None:
    """diffusers, then ours in a process with a fresh compilation cache: it compiles (cold); with --cached-too a
    second process of ours starts from that cache on disk (cold, as a second run of generate.py starts)."""
    forwarded = flags(args, "height", "width", "steps", "repeats", "prompt", "num_layers")
    rows = subprocess_rows(args, "krea2-pipeline-diffusers", forwarded) if args.diffusers else []
    ours = forwarded + flags(args, "precisions", "jax_attention") + ([] if args.trim_text else ["--no-trim-text"])
    with tempfile.TemporaryDirectory(prefix="mxdit-bench-cache-") as cache_dir:
        cache = {"JAX_COMPILATION_CACHE_DIR": cache_dir, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5"}
        for _ in range(2 if args.cached_too else 1):  # the second process finds what the first compiled
            rows += subprocess_rows(args, "krea2-pipeline-jax", ours, env=cache)
    print(f"\nKrea 2 Turbo pipeline, {args.height}x{args.width}, {args.steps} steps, random full-size bf16 weights")
    print(f"{'run':<34}{'text encode':>12}{'denoise':>9}{'decode':>8}{'total':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:<34} error: {r['error']}")
        elif "total" in r:
            print(f"{r['name']:<34}{r['text encode']:12.3f}{r['denoise']:9.3f}{r.get('decode', 0):8.3f}"
                  f"{r['total']:8.3f}")
        elif "peak_gb" in r:
            print(f"{r['name']:<34} peak device memory {r['peak_gb']:.1f} GB")
    write_json(args, rows)


def jax_krea2_pipeline(args) -> list[dict]:
    """Our Krea 2 pipeline, full-size random bf16 weights (the demo tokenizer: the text is padded to 512 anyway), for
    each --precisions x --jax-attention: its transformer's block matrices quantized for the GEMM kernels (not bf16),
    projections stacked, as generate.py runs it; a cold run (compiles, or reads JAX_COMPILATION_CACHE_DIR) and
    --repeats warm ones."""
    import jax
    from flax import nnx

    from mxdit.model.inference import InferenceOptions, prepare_pipeline
    from mxdit.ops.attention import attention_implementation

    cache_dir = os.environ.get("JAX_COMPILATION_CACHE_DIR")  # looked at before anything here compiles
    cache = "from the compile cache" if cache_dir and any(Path(cache_dir).iterdir()) else "compiles"
    t0 = time.perf_counter()
    pipe = _random_pipeline(args)
    jax.block_until_ready(nnx.state(pipe.transformer))
    emit({"jax_pipeline_init_s": time.perf_counter() - t0})
    base = pipe.transformer
    embeds, mask = pipe.encode_prompt([args.prompt], 512)
    text_tokens = pipe.trimmed_text(embeds, mask, args.height, args.width)[0].shape[1] if args.trim_text \
        else embeds.shape[1]
    emit({"text_tokens": text_tokens, "real_text_tokens": int(np.asarray(mask).sum())})
    rows = []
    for precision in args.precisions:
        # a copy each: the quantization rules name the unstacked projections, so every precision starts from the
        # unstacked bf16 model; quantized once, then run with each attention kernel
        pipe.transformer = nnx.clone(base)
        pipe = prepare_pipeline(pipe, InferenceOptions(precision=precision))
        for attention in args.jax_attention:
            pipe.transformer.attention = attention_implementation(attention, pipe.transformer.dtype)
            for run in range(1 + args.repeats):
                out = pipe(args.prompt, height=args.height, width=args.width,
                           num_inference_steps=args.steps, trim_text=args.trim_text)
                label = f"cold ({cache})" if run == 0 else f"warm run {run}"
                rows.append(emit({"name": f"jax {precision}, {attention} {label}", "text_tokens": text_tokens,
                                  **out.timings}))
    rows.append(emit({"name": "jax peak", "peak_gb": jax_peak_gb()}))
    return rows


def _random_pipeline(args):
    """Krea 2's pipeline of random full-size bf16 weights (--num-layers transformer blocks if given), Turbo."""
    import jax.numpy as jnp
    from flax import nnx

    from mxdit.model.krea2 import Krea2Transformer
    from mxdit.model.pipeline_krea2 import Krea2Pipeline, Krea2PipelineConfig
    from mxdit.model.qwen3vl_text import Qwen3VLTextConfig, Qwen3VLTextEncoder
    from mxdit.model.tokenizer import TextTokenizer, save_demo_tokenizer
    from mxdit.model.vae_qwenimage import QwenImageVAE, QwenImageVAEConfig

    rngs = nnx.Rngs(0)
    with tempfile.TemporaryDirectory(prefix="mxdit-bench-tokenizer-") as folder:  # read whole, then removed
        tokenizer = TextTokenizer.from_folder(save_demo_tokenizer(folder))
    return Krea2Pipeline(
        Krea2Transformer(krea2_config(args), dtype=jnp.bfloat16, rngs=rngs),
        QwenImageVAE(QwenImageVAEConfig(), dtype=jnp.bfloat16, rngs=rngs),
        Qwen3VLTextEncoder(Qwen3VLTextConfig(**QWEN3VL_4B_TEXT), dtype=jnp.bfloat16, rngs=rngs),
        tokenizer,
        Krea2PipelineConfig(is_distilled=True),
    )
