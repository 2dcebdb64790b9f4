"""The benchmarked models' configurations, random inputs of the pipelines' shapes and FLOP counts. Weights are
random; the shapes are the released models': by default 4096 image tokens (1024x1024) and 512 text tokens, of which
120 are real for Krea 2 (the padding mask)."""

from __future__ import annotations

import dataclasses

import numpy as np

# Tiny models of each family: a CPU runs the benchmarks' paths on them.
TINY_KREA2 = dict(in_channels=64, num_layers=2, attention_head_dim=32, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=256, timestep_embed_dim=64, text_hidden_dim=64, num_text_layers=3,
                  text_num_attention_heads=4, text_num_key_value_heads=4, text_intermediate_size=128,
                  num_layerwise_text_blocks=1, num_refiner_text_blocks=1, axes_dims_rope=(8, 12, 12))
TINY_FLUX = dict(num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
                 joint_attention_dim=24, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6))

# Qwen3-VL 4B's text model, Krea 2's text encoder.
QWEN3VL_4B_TEXT = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6)


def krea2_config(args):
    """The released Krea 2 transformer's configuration, with --num-layers blocks if given."""
    from mxdit.model.krea2 import Krea2Config

    cfg = Krea2Config()
    return dataclasses.replace(cfg, num_layers=args.num_layers) if args.num_layers else cfg


def lora_step_config(args):
    """The `args.family` ("krea2" | "flux") transformer's configuration a LoRA step runs: the tiny one with --tiny,
    else the released one with --num-layers blocks if given (FLUX.1: that many double and twice as many single)."""
    if args.family == "flux":
        from mxdit.model.flux import FluxConfig

        if args.tiny:
            return FluxConfig(**TINY_FLUX)
        if args.num_layers is None:
            return FluxConfig()
        return FluxConfig(num_layers=args.num_layers, num_single_layers=2 * args.num_layers)
    from mxdit.model.krea2 import Krea2Config

    return Krea2Config(**TINY_KREA2) if args.tiny else krea2_config(args)


def krea2_inputs(cfg, height: int, width: int, text_len: int, valid_text: int, batch: int = 1, seed: int = 0):
    """Random inputs of the pipeline's shapes, as numpy (float32 / bool): latents, text, timestep, position ids
    (text, then image) and the text mask (`valid_text` real tokens first)."""
    rng = np.random.default_rng(seed)
    grid_h, grid_w = height // 16, width // 16
    hidden = rng.standard_normal((batch, grid_h * grid_w, cfg.in_channels), np.float32)
    text = rng.standard_normal((batch, text_len, cfg.num_text_layers, cfg.text_hidden_dim), np.float32)
    timestep = np.full((batch,), 0.7, np.float32)
    image_ids = np.zeros((grid_h, grid_w, 3), np.float32)
    image_ids[..., 1] = np.arange(grid_h)[:, None]
    image_ids[..., 2] = np.arange(grid_w)[None, :]
    position_ids = np.concatenate([np.zeros((text_len, 3), np.float32), image_ids.reshape(-1, 3)])
    mask = np.zeros((batch, text_len), bool)
    mask[:, :valid_text] = True
    return hidden, text, timestep, position_ids, mask


def krea2_flops(cfg, image_len: int, text_len: int) -> float:
    """Matrix-product FLOPs of one forward (linear layers + attention), for TFLOP/s figures."""
    d, seq = cfg.hidden_size, image_len + text_len
    kv = cfg.num_key_value_heads * cfg.attention_head_dim
    per_token = 2 * (d * d * 3 + 2 * d * kv + 3 * d * cfg.intermediate_size)  # q, gate, out; k, v; SwiGLU
    attention = 4 * seq * seq * d
    return cfg.num_layers * (seq * per_token + attention)


def flux_inputs(cfg, height: int, width: int, text_len: int, seed: int = 0):
    """Random FLUX.1 inputs, as numpy float32: latents, text, pooled text, image and text position ids."""
    rng = np.random.default_rng(seed)
    grid_h, grid_w = height // 16, width // 16
    hidden = rng.standard_normal((1, grid_h * grid_w, cfg.in_channels), np.float32)
    text = rng.standard_normal((1, text_len, cfg.joint_attention_dim), np.float32)
    pooled = rng.standard_normal((1, cfg.pooled_projection_dim), np.float32)
    img_ids = np.zeros((grid_h, grid_w, 3), np.float32)
    img_ids[..., 1], img_ids[..., 2] = np.arange(grid_h)[:, None], np.arange(grid_w)[None, :]
    return hidden, text, pooled, img_ids.reshape(-1, 3), np.zeros((text_len, 3), np.float32)


def flux_flops(cfg, image_len: int, text_len: int) -> float:
    """Matrix-product FLOPs of one FLUX.1 forward (linear layers + attention)."""
    d, seq = cfg.inner_dim, image_len + text_len
    double = 2 * seq * (4 * d * d + 8 * d * d) + 4 * seq * seq * d  # qkv+out and MLP, both streams; attention
    single = 2 * seq * (3 * d * d + 4 * d * d + 5 * d * d) + 4 * seq * seq * d
    return cfg.num_layers * double + cfg.num_single_layers * single


def random_model(build, *places, limit_gb: float | None = None):
    """The module `build()` makes (only traced) with random weights (normal, std 0.02) made on the device tensor by
    tensor, each passed through every `place(module_key, array)` in turn, as `loading.place_parameters` passes what
    it reads (e.g. `quant.model.quantize_on_load`, then `model.offload.streamed_block_placement`): the device never
    holds more of the model in bf16 than one tensor beyond what the places keep, so a model whose bf16 weights exceed
    the device (or a memory cap) can be built quantized. `limit_gb`: a MemoryError before anything is made if the
    placed weights alone would take more (an allocator at its cap fails slowly)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mxdit.model.loading import chained_places, module_key

    place = chained_places(*places)
    graphdef, state = nnx.split(nnx.eval_shape(build))
    flat = nnx.to_flat_state(state)
    if limit_gb is not None:
        placed = [jax.eval_shape(lambda a, key=module_key(path): place(key, a), variable.get_value())
                  for path, variable in flat]
        gb = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(placed)) / 1e9
        if gb > limit_gb:
            raise MemoryError(f"the weights alone take {gb:.3g} GB, over the {limit_gb:g} GB cap")
    for i, (path, variable) in enumerate(flat):
        value = variable.get_value()
        array = (jax.random.normal(jax.random.key(i), value.shape, jnp.float32) * 0.02).astype(value.dtype)
        variable.set_value(place(module_key(path), array))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))
