"""One MiniMax H3 denoiser evaluation at a video length, ours per precision and attention against diffusers' (each in
its own process), with the admission gates of each precision against our bf16 output on the same inputs."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

from mxdit.cli import progress

from .rows import emit, error_text, flags, step_table, subprocess_rows, write_json
from .timing import jax_peak_gb, timed

# diffusers' MiniMaxH3Transformer3DModel config of a tiny model (--tiny: the path on a CPU)
TINY_H3 = dict(num_attention_heads=2, attention_head_dim=16, hidden_size=32, num_layers=2, num_refiner_layers=1,
               ffn_dim=64, in_channels=8, audio_in_channels=8, text_dim=32, freq_dim=32, time_embed_hidden_dim=32,
               time_embed_dim=16, rope_freq_dim=2)
# JAX's device memory pool for our evaluations: the rest of the card is left to CUDA's context and cuDNN's workspace
H3_MEMORY_FRACTION = "0.92"


def h3_step(args) -> None:
    """bf16 first (the gates' reference output), then each other precision and attention, then diffusers."""
    forwarded = flags(args, "num_frames", "height", "width", "text_len", "num_layers", "iters", "repeats", "settle_s",
                      "tiny", "offload", "prefetch")
    outputs = tempfile.mkdtemp(prefix="mxdit-h3-outputs-")
    # the bf16 weights (66 GB) outgrow JAX's default pool of 75% of an 80 GB card; a fraction the caller set is kept
    env = {"XLA_PYTHON_CLIENT_MEM_FRACTION": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", H3_MEMORY_FRACTION)}
    precisions = ["bf16"] + [p for p in args.precisions if p != "bf16"]
    rows = []
    for precision in precisions:
        for attention in args.jax_attention:
            rows += subprocess_rows(args, "minimax-h3-step-jax", forwarded + [
                "--precisions", precision, "--jax-attention", attention, "--outputs-dir", outputs], env=env)
    if args.diffusers:
        rows += subprocess_rows(args, "minimax-h3-step-diffusers", forwarded)
    step_table(rows, f"MiniMax H3 denoiser evaluation, {args.num_frames} frames of {args.height}x{args.width}, text "
                     f"{args.text_len}: {rows[0].get('tokens', '?')} tokens")
    for r in rows:
        for key, what in (("input_rounding", "its inputs moved by a bf16 rounding, against itself"),
                          ("gate", "its gate against bf16")):
            if key in r:
                g = r[key]
                print(f"{r['name']}, {what}: {'passes' if g['passed'] else 'FAILS'}: video cosine "
                      f"{g['video_cosine']:.6f}, relative L2 {g['video_relative_l2']:.4g}; audio cosine "
                      f"{g['audio_cosine']:.6f}, relative L2 {g['audio_relative_l2']:.4g}; non-finite "
                      f"{g['nonfinite']}")
    write_json(args, rows)


def h3_config(args):
    """The transformer's config: the release's, --num-layers blocks of it, or --tiny's."""
    import dataclasses

    from mxdit.model.minimax_h3 import MiniMaxH3Config

    if args.tiny:
        return MiniMaxH3Config(**TINY_H3)
    cfg = MiniMaxH3Config()
    return dataclasses.replace(cfg, num_layers=args.num_layers) if args.num_layers else cfg


def h3_inputs(cfg, args, seed: int = 0):
    """The packed text-to-video layout of --num-frames frames of --height x --width with --text-len text tokens, and
    random inputs of its shapes (numpy): video rows, audio rows, text states; two noise levels."""
    from mxdit.model import pipeline_minimax_h3 as h3

    frames = h3.align_num_frames(args.num_frames)
    layout = h3.packed_layout(args.text_len, h3.video_latent_frames(frames), args.height // h3.SPATIAL_COMPRESSION,
                              args.width // h3.SPATIAL_COMPRESSION, h3.audio_latent_frames(frames), cfg.patch_size)
    rng = np.random.default_rng(seed)
    video = rng.standard_normal((1, len(layout.video_indices), cfg.video_patch_dim), np.float32)
    audio = rng.standard_normal((1, len(layout.audio_indices), cfg.audio_in_channels), np.float32)
    text = rng.standard_normal((1, args.text_len, cfg.text_dim), np.float32)
    return layout, video, audio, text, np.array([0.6, 0.7], np.float32), h3.timestep_slots(layout).astype(np.int64)


def h3_flops(cfg, tokens: int) -> float:
    """Matrix-product FLOPs of one evaluation: the blocks' projections and attention (the refiner's few text
    tokens, the AdaLN rows and the heads are left out)."""
    inner = cfg.num_attention_heads * cfg.attention_head_dim
    projections = 4 * cfg.hidden_size * inner + 3 * cfg.hidden_size * cfg.ffn_dim
    return cfg.num_layers * (2 * tokens * projections + 4 * tokens * tokens * inner)


def jax_h3_step(args) -> list[dict]:
    """Our evaluation (random full-size weights, made tensor by tensor and quantized as made) for --precisions and
    --jax-attention, a jitted call per evaluation dispatched back to back; the output on the fixed inputs saved
    (bf16) or gated against the saved bf16 one."""
    import functools
    import time

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mxdit.model.layers import RMSNorm
    from mxdit.model.minimax_h3 import MiniMaxH3Transformer
    from mxdit.model.offload import StreamedMiniMaxH3, streamed_block_placement
    from mxdit.model.pipeline_minimax_h3 import PRECISIONS, layout_arrays
    from mxdit.quant.gates import evaluate
    from mxdit.quant.model import minimax_h3_rules, quantize_on_load

    from .inputs import random_model

    cfg = h3_config(args)
    layout, video, audio, text, timestep, _ = h3_inputs(cfg, args)
    (precision,), (attention,) = args.precisions, args.jax_attention
    fmt = PRECISIONS[precision]
    places = [quantize_on_load(minimax_h3_rules(fmt))] if fmt else []
    if args.offload is not None:  # the streamed blocks to host memory as they are made (after quantizing)
        places.append(streamed_block_placement(args.offload))
    start = time.perf_counter()
    model = random_model(lambda: MiniMaxH3Transformer(cfg, dtype=jnp.bfloat16, attention=attention,
                                                      rngs=nnx.Rngs(0)), *places)
    on_device = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="device")
    for _, module in nnx.iter_graph(model):  # norm gains near 1, as trained ones are, so that every block matters
        if isinstance(module, RMSNorm):  # (added on the device: a streamed block's weights are in host memory)
            weight = module.weight.get_value()
            module.weight.set_value(jax.device_put(1.0 + jax.device_put(weight, on_device), weight.sharding))
    jax.block_until_ready(nnx.state(model))
    progress(f"{precision} model built in {time.perf_counter() - start:.1f} s")
    structure = (jnp.asarray(timestep), *layout_arrays(layout))
    video, audio, text = (jnp.asarray(a, jnp.bfloat16) for a in (video, audio, text))
    name = f"jax MiniMax H3 {precision}, {model.attention} attention"
    if args.offload is None:
        graphdef, state = nnx.split(model)
        jitted = jax.jit(lambda state, video, audio: nnx.merge(graphdef, state)(video, audio, text, *structure))
        evaluation = functools.partial(jitted, state)
    else:  # a program a block, the streamed blocks' weights copied ahead
        streamed = StreamedMiniMaxH3(model, resident=args.offload, prefetch=args.prefetch)
        del model  # its streamed blocks' device copies

        def evaluation(video, audio):
            return streamed(video, audio, text, *structure)
        name += f", {min(args.offload, cfg.num_layers)} of {cfg.num_layers} blocks resident"

    def steps(n):
        v, a = video, audio
        for _ in range(n):  # each evaluation on the last one's output: nothing to hoist or skip
            dv, da = evaluation(v, a)
            v, a = (v + 1e-3 * dv).astype(v.dtype), (a + 1e-3 * da).astype(a.dtype)
        return jax.block_until_ready((v, a))

    row = {"name": name, "tokens": layout.length}
    try:
        row.update(timed(steps, args.iters, args.repeats, args.settle_s))  # its warm-up compiles: compile_s
        progress(f"compiled in {row['compile_s']:.1f} s, {row['s_per_step']:.3f} s an evaluation")
        row["tflops"] = h3_flops(cfg, layout.length) / row["s_per_step"] / 1e12
        out = [np.asarray(x, np.float32) for x in evaluation(video, audio)]
        reference = Path(args.outputs_dir) / "bf16.npz" if args.outputs_dir else None
        if precision == "bf16" and reference is not None and not reference.exists():
            np.savez(reference, video=out[0], audio=out[1])
            # What the gates can tell on this model: its own output's change when the inputs move by a rounding of
            # bf16's (relative 2^-8 each, random signs). A random deep model may amplify any change alike.
            signs = [np.where(np.random.default_rng(1).random(x.shape) < 0.5, -1.0, 1.0) for x in (video, audio)]
            moved = [(x * (1.0 + jnp.asarray(s, jnp.float32) * 2.0 ** -8)).astype(x.dtype)
                     for x, s in zip((video, audio), signs)]
            nudged = [np.asarray(x, np.float32) for x in evaluation(*moved)]
            row["input_rounding"] = _gate_figures([evaluate("bf16", a, b) for a, b in zip(nudged, out)])
        elif reference is not None and reference.exists():
            saved = np.load(reference)
            row["gate"] = _gate_figures([evaluate(fmt or "bf16", got, saved[key])
                                         for got, key in zip(out, ("video", "audio"))])
    except Exception as e:  # an out-of-memory variant is a result too
        row["error"] = error_text(e)
    row["peak_gb"] = jax_peak_gb()
    return [emit(row)]


def _gate_figures(gates) -> dict:
    """The (video, audio) `GateReport`s as a row's figures."""
    video, audio = gates
    return {"passed": video.passed and audio.passed, "video_cosine": video.cosine,
            "video_relative_l2": video.relative_l2, "audio_cosine": audio.cosine,
            "audio_relative_l2": audio.relative_l2, "nonfinite": video.nonfinite + audio.nonfinite,
            "failures": video.failures + audio.failures}


def diffusers_h3_step(args) -> list[dict]:
    """diffusers' MiniMaxH3Transformer3DModel of random weights in the release's mixed precision (bf16 blocks,
    float32 input and output projections and timestep MLP), eager, on the same layout."""
    import torch
    from diffusers import MiniMaxH3Transformer3DModel

    from .diffusers_side import torch_row

    cfg = h3_config(args)
    layout, video, audio, text, timestep, timestep_indices = h3_inputs(cfg, args)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = MiniMaxH3Transformer3DModel(**({**TINY_H3} if args.tiny else
                                               {"num_layers": cfg.num_layers})).eval()
    torch.set_default_dtype(torch.float32)
    for name in MiniMaxH3Transformer3DModel._keep_in_fp32_modules:
        getattr(model, name).float()
    progress(f"diffusers model built, {sum(p.numel() for p in model.parameters()) / 1e9:.1f}B parameters")

    def to(a, dtype=None):
        return torch.from_numpy(np.asarray(a)).to(device, dtype)

    inputs = dict(hidden_states=to(video, torch.bfloat16), audio_hidden_states=to(audio, torch.bfloat16),
                  encoder_hidden_states=to(text, torch.bfloat16), timestep=to(timestep),
                  timestep_indices=to(timestep_indices), token_tags=to(layout.token_tags.astype(np.int64)),
                  position_ids=to(layout.position_ids.astype(np.float32)),
                  video_indices=to(layout.video_indices), audio_indices=to(layout.audio_indices),
                  text_indices=to(layout.text_indices), return_dict=False)
    with torch.no_grad():
        return [torch_row(f"diffusers MiniMax H3 eager (bf16 blocks), {layout.length} tokens", lambda: model(**inputs),
                          args, h3_flops(cfg, layout.length), warmup=1)]
