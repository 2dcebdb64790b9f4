"""Write the small reference fixtures under tests/fixtures/ with PyTorch (CPU) + diffusers.

This is the only place that needs PyTorch: it builds tiny random models in the real checkpoint layouts (key names,
shapes, config.json), runs the diffusers implementation on fixed inputs and saves inputs and outputs as .npz, so that
the test suite compares against diffusers without importing it. It also records the key names and shapes of the
full-size released checkpoints, built on the meta device (`--only key_coverage`, see `write_key_coverage`).

    python3.11 -m venv /tmp/torch && /tmp/torch/bin/pip install torch==2.13.0 diffusers==0.42.1 transformers
    /tmp/torch/bin/python scripts/make_fixtures.py            # rewrites tests/fixtures/
    /tmp/torch/bin/python scripts/make_fixtures.py --only lora   # one group (repeatable); see GROUPS

The LoRA export check takes two steps, because the exporter is mxdit's (JAX) and the reference diffusers' (torch):
`--only lora` writes the diffusers/kohya/ComfyUI LoRA files and reference outputs under tests/fixtures/krea2/lora/;
then `.venv/bin/python scripts/export_lora_fixture.py` (mxdit's venv) exports an mxdit LoRA there in the diffusers
and ComfyUI layouts; then `--only lora_export` loads those files with diffusers' `load_lora_weights` and saves its
outputs (export_reference.npz). FLUX.1 the same way under tests/fixtures/flux/lora/: `--only flux_lora`, the same
export script (diffusers layout), then `--only flux_lora_export`.

Every parameter is random (norm scales and modulation tables included), so that a term that is silently wrong in our
implementation cannot hide behind a zero or a one.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import torch

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"

# A tiny Krea 2 transformer: GQA with two query heads per KV head in the joint blocks, GQA in the text fusion blocks
# too, a rotary split that exercises all three axes, and more than one block of each kind.
KREA2_TINY_CONFIG = dict(
    in_channels=16,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=48,
    timestep_embed_dim=32,
    text_hidden_dim=24,
    num_text_layers=3,
    text_num_attention_heads=4,
    text_num_key_value_heads=2,
    text_intermediate_size=40,
    num_layerwise_text_blocks=2,
    num_refiner_text_blocks=2,
    axes_dims_rope=(4, 6, 6),
    rope_theta=1000.0,
    norm_eps=1e-5,
)


def _randomize(module: torch.nn.Module, generator: torch.Generator) -> None:
    """Give every parameter a random value at a scale that keeps activations O(1)."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if name.endswith("scale_shift_table") or "norm" in name:
                param.copy_(0.2 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.05 * noise)
            else:
                fan_in = param.shape[-1] if param.ndim > 1 else 1
                param.copy_(noise / np.sqrt(fan_in))


def krea2_diffusers_to_original_key(key: str) -> str:
    """Inverse of diffusers' `convert_krea2_transformer_checkpoint_to_diffusers` (the ComfyUI single-file names)."""
    block_renames = {
        ".attn.to_q.": ".attn.wq.",
        ".attn.to_k.": ".attn.wk.",
        ".attn.to_v.": ".attn.wv.",
        ".attn.to_out.0.": ".attn.wo.",
        ".attn.to_gate.": ".attn.gate.",
        ".attn.norm_q.weight": ".attn.qknorm.qnorm.scale",
        ".attn.norm_k.weight": ".attn.qknorm.knorm.scale",
        ".ff.": ".mlp.",
        ".norm1.weight": ".prenorm.scale",
        ".norm2.weight": ".postnorm.scale",
        ".scale_shift_table": ".mod.lin",
    }
    prefix_renames = {
        "img_in.": "first.",
        "time_embed.linear_1.": "tmlp.0.",
        "time_embed.linear_2.": "tmlp.2.",
        "time_mod_proj.": "tproj.1.",
        "txt_in.norm.weight": "txtmlp.0.scale",
        "txt_in.linear_1.": "txtmlp.1.",
        "txt_in.linear_2.": "txtmlp.3.",
        "text_fusion.": "txtfusion.",
        "transformer_blocks.": "blocks.",
        "final_layer.linear.": "last.linear.",
        "final_layer.norm.weight": "last.norm.scale",
        "final_layer.scale_shift_table": "last.modulation.lin",
    }
    for new, old in prefix_renames.items():
        if key.startswith(new):
            key = old + key[len(new) :]
            break
    if not key.startswith("last."):
        for new, old in block_renames.items():
            key = key.replace(new, old)
    return key


def write_krea2_transformer(out: Path) -> None:
    from diffusers import Krea2Transformer2DModel
    from diffusers.loaders.single_file_utils import convert_krea2_transformer_checkpoint_to_diffusers
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    model = Krea2Transformer2DModel(**KREA2_TINY_CONFIG).eval()
    _randomize(model, generator)

    # The diffusers folder layout, a sharded copy of it (with its index), and the original single-file layout.
    for name in ("tiny", "tiny_sharded"):
        shutil.rmtree(out / name, ignore_errors=True)
    model.save_pretrained(out / "tiny")
    model.save_pretrained(out / "tiny_sharded", max_shard_size="40KB")
    assert (out / "tiny_sharded" / "diffusion_pytorch_model.safetensors.index.json").exists()

    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    original = {}
    for key, value in state.items():
        if key.startswith("transformer_blocks.") and key.endswith(".scale_shift_table"):
            value = value.reshape(-1)  # the release stores the six modulation vectors flattened into one
        original["model.diffusion_model." + krea2_diffusers_to_original_key(key)] = value.contiguous()
    # The mapping must be exactly what diffusers' own single-file converter undoes.
    round_trip = convert_krea2_transformer_checkpoint_to_diffusers(dict(original))
    assert set(round_trip) == set(state), set(round_trip) ^ set(state)
    for key in state:
        assert torch.equal(round_trip[key], state[key]), key
    save_file(original, str(out / "tiny_original.safetensors"))

    # Reference inputs and outputs: batch 2 on a non-square 3x5 latent grid with 7 text tokens.
    batch, text_len, grid_h, grid_w = 2, 7, 3, 5
    cfg = KREA2_TINY_CONFIG
    hidden = torch.randn(batch, grid_h * grid_w, cfg["in_channels"], generator=generator)
    text = torch.randn(batch, text_len, cfg["num_text_layers"], cfg["text_hidden_dim"], generator=generator)
    timestep = torch.tensor([0.83, 0.27])
    image_ids = torch.zeros(grid_h, grid_w, 3)
    image_ids[..., 0] = 2.0  # a non-zero frame coordinate exercises the first rotary axis too
    image_ids[..., 1] = torch.arange(grid_h)[:, None]
    image_ids[..., 2] = torch.arange(grid_w)[None, :]
    position_ids = torch.cat([torch.zeros(text_len, 3), image_ids.reshape(-1, 3)], dim=0)
    # Padding inside the sequence (as Krea 2's template pads in the middle), and a sample with no padding at all.
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)

    with torch.no_grad():
        out_masked = model(hidden, text, timestep, position_ids, encoder_attention_mask=mask, return_dict=False)[0]
        out_unmasked = model(hidden, text, timestep, position_ids, return_dict=False)[0]
    # bfloat16 as users load it, the inputs as the pipeline passes them (in bfloat16, the timestep too)
    model_bf16 = Krea2Transformer2DModel.from_pretrained(out / "tiny", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        out_bf16 = model_bf16(hidden.bfloat16(), text.bfloat16(), timestep.bfloat16(), position_ids,
                              encoder_attention_mask=mask, return_dict=False)[0]
    np.savez_compressed(
        out / "reference.npz",
        hidden_states=hidden.numpy(),
        encoder_hidden_states=text.numpy(),
        timestep=timestep.numpy(),
        position_ids=position_ids.numpy(),
        encoder_attention_mask=mask.numpy(),
        output_masked=out_masked.numpy(),
        output_unmasked=out_unmasked.numpy(),
        output_masked_bf16=out_bf16.float().numpy(),
    )
    print(f"wrote Krea 2 transformer fixtures to {out}")


# (num_inference_steps, image_seq_len, is_distilled): Turbo's fixed shift and Base's resolution-aware shift.
SCHEDULER_CASES = [(8, 4096, True), (28, 4096, False), (28, 1024, False), (20, 6400, False), (4, 256, False),
                   (50, 16384, False), (1, 4096, True)]


def write_scheduler(out: Path) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.krea2.pipeline_krea2 import calculate_shift, retrieve_timesteps

    out.mkdir(parents=True, exist_ok=True)
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=6400,
        time_shift_type="exponential",
    )
    arrays = {}
    for steps, seq_len, distilled in SCHEDULER_CASES:
        # Exactly what Krea2Pipeline.__call__ does in its step 5.
        sigmas = np.linspace(1.0, 1 / steps, steps)
        mu = 1.15 if distilled else calculate_shift(seq_len, 256, 6400, 0.5, 1.15)
        timesteps, _ = retrieve_timesteps(scheduler, steps, "cpu", sigmas=sigmas, mu=mu)
        tag = f"{steps}_{seq_len}_{int(distilled)}"
        arrays[f"timesteps_{tag}"] = timesteps.numpy()
        arrays[f"sigmas_{tag}"] = scheduler.sigmas.numpy()
        # One Euler step on a random sample, to pin the update rule too.
        sample = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(steps))
        velocity = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(steps + 1))
        scheduler.set_begin_index(0)
        arrays[f"euler_in_{tag}"] = sample.numpy()
        arrays[f"euler_v_{tag}"] = velocity.numpy()
        arrays[f"euler_out_{tag}"] = scheduler.step(velocity, timesteps[0], sample, return_dict=False)[0].numpy()
    np.savez(out / "scheduler_reference.npz", **arrays)
    (out / "scheduler_cases.json").write_text(json.dumps(SCHEDULER_CASES))
    print(f"wrote scheduler fixtures to {out}")


# Tiny VAEs with the released structure (four levels, 8x downsampling, two residual blocks a level) at small widths.
QWENIMAGE_VAE_TINY_CONFIG = dict(base_dim=2, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                                 temperal_downsample=[False, True, True])
QWENIMAGE_VAE_OUTPUT_SCALE = 0.25
FLUX_VAE_TINY_CONFIG = dict(
    in_channels=3, out_channels=3, latent_channels=16, layers_per_block=2, norm_num_groups=2,
    block_out_channels=[4, 4, 8, 8], down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4, sample_size=64, scaling_factor=0.3611, shift_factor=0.1159,
    use_quant_conv=False, use_post_quant_conv=False,
)


def qwenimage_vae_diffusers_to_original_key(key: str, num_res_blocks: int = 2) -> str:
    """Inverse of diffusers' `convert_wan_vae_to_diffusers`: the Wan 2.1 layout of ComfyUI's single file."""
    import re

    residual = {"norm1.gamma": "residual.0.gamma", "conv1.": "residual.2.", "norm2.gamma": "residual.3.gamma",
                "conv2.": "residual.6.", "conv_shortcut.": "shortcut."}

    def rename_residual(rest: str) -> str:
        for new, old in residual.items():
            if rest.startswith(new):
                return old + rest[len(new):]
        return rest

    for part in ("encoder", "decoder"):
        if key.startswith(f"{part}.conv_in."):
            return key.replace(f"{part}.conv_in.", f"{part}.conv1.")
        if key.startswith(f"{part}.norm_out."):
            return key.replace(f"{part}.norm_out.", f"{part}.head.0.")
        if key.startswith(f"{part}.conv_out."):
            return key.replace(f"{part}.conv_out.", f"{part}.head.2.")
        if m := re.match(rf"{part}\.mid_block\.resnets\.(\d)\.(.*)", key):
            return f"{part}.middle.{2 * int(m[1])}.{rename_residual(m[2])}"
        if m := re.match(rf"{part}\.mid_block\.attentions\.0\.(.*)", key):
            return f"{part}.middle.1.{m[1]}"
    if m := re.match(r"encoder\.down_blocks\.(\d+)\.(.*)", key):
        return f"encoder.downsamples.{m[1]}.{rename_residual(m[2])}"
    per_block = num_res_blocks + 2  # residual blocks, then the resampler
    if m := re.match(r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.*)", key):
        return f"decoder.upsamples.{int(m[1]) * per_block + int(m[2])}.{rename_residual(m[3])}"
    if m := re.match(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.(.*)", key):
        return f"decoder.upsamples.{int(m[1]) * per_block + per_block - 1}.{m[2]}"
    return {"quant_conv.weight": "conv1.weight", "quant_conv.bias": "conv1.bias",
            "post_quant_conv.weight": "conv2.weight", "post_quant_conv.bias": "conv2.bias"}[key]


def flux_vae_diffusers_to_original_key(key: str, num_blocks: int = 4) -> str:
    """Inverse of diffusers' `convert_ldm_vae_checkpoint`: the layout of FLUX's `ae.safetensors`."""
    import re

    key = key.replace("conv_shortcut", "nin_shortcut").replace("conv_norm_out", "norm_out")
    if m := re.match(r"encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.(.*)", key):
        return f"encoder.down.{m[1]}.block.{m[2]}.{m[3]}"
    if m := re.match(r"encoder\.down_blocks\.(\d+)\.downsamplers\.0\.(.*)", key):
        return f"encoder.down.{m[1]}.downsample.{m[2]}"
    if m := re.match(r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.*)", key):
        return f"decoder.up.{num_blocks - 1 - int(m[1])}.block.{m[2]}.{m[3]}"
    if m := re.match(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.(.*)", key):
        return f"decoder.up.{num_blocks - 1 - int(m[1])}.upsample.{m[2]}"
    if m := re.match(r"(encoder|decoder)\.mid_block\.resnets\.(\d)\.(.*)", key):
        return f"{m[1]}.mid.block_{int(m[2]) + 1}.{m[3]}"
    if m := re.match(r"(encoder|decoder)\.mid_block\.attentions\.0\.(.*)", key):
        rest = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
        name, _, param = m[2].rpartition(".")
        return f"{m[1]}.mid.attn_1.{rest[name]}.{param}"
    return key


def _save_original(state: dict, convert_back, path: Path, to_original, reshape=lambda k, v: v) -> None:
    """Write `state` in an original layout and check that diffusers' own converter maps it back exactly."""
    from safetensors.torch import save_file

    original = {to_original(k): reshape(k, v).contiguous() for k, v in state.items()}
    assert len(original) == len(state), "two keys mapped to one"
    back = convert_back(dict(original))
    assert set(back) == set(state), set(back) ^ set(state)
    for key in state:
        assert torch.equal(back[key].reshape(state[key].shape), state[key]) and back[key].shape == state[key].shape, key
    save_file(original, str(path))


def write_vaes(out: Path) -> None:
    from diffusers import AutoencoderKL, AutoencoderKLQwenImage
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint, convert_wan_vae_to_diffusers

    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(1)
    qwen = AutoencoderKLQwenImage(**QWENIMAGE_VAE_TINY_CONFIG).eval()
    flux = AutoencoderKL(**FLUX_VAE_TINY_CONFIG).eval()
    for model in (qwen, flux):
        _randomize(model, generator)
        with torch.no_grad():  # GroupNorm/RMS scales near 1, so the activations stay O(1) through the depth
            for name, param in model.named_parameters():
                if name.endswith(("gamma", "norm1.weight", "norm2.weight", "norm.weight", "norm_out.weight")):
                    param.add_(1.0)
    # The Qwen decoder's output layer scaled down, so that its images lie mostly inside (-1, 1) where its decode does
    # not clamp them (at the common scale most pixels are at +-1, where an error would not show).
    with torch.no_grad():
        qwen.decoder.conv_out.weight.mul_(QWENIMAGE_VAE_OUTPUT_SCALE)
        qwen.decoder.conv_out.bias.mul_(QWENIMAGE_VAE_OUTPUT_SCALE)
    for name, model in (("qwenimage_vae", qwen), ("flux_vae", flux)):
        shutil.rmtree(out / name, ignore_errors=True)
        model.save_pretrained(out / name)

    qwen_state = {k: v.detach().clone() for k, v in qwen.state_dict().items()}
    _save_original(qwen_state, convert_wan_vae_to_diffusers, out / "qwenimage_vae_original.safetensors",
                   qwenimage_vae_diffusers_to_original_key)
    flux_state = {k: v.detach().clone() for k, v in flux.state_dict().items()}
    attention_conv = lambda k, v: v[:, :, None, None] if ".attentions." in k and v.ndim == 2 else v  # 1x1 convs there
    _save_original(flux_state, lambda c: convert_ldm_vae_checkpoint(c, FLUX_VAE_TINY_CONFIG),
                   out / "flux_vae_original.safetensors", flux_vae_diffusers_to_original_key, attention_conv)

    # Odd-sized inputs: a 5x7 latent grid (40x56 pixels), batch 2; and a larger one for tiling with small tiles.
    image = torch.rand(2, 3, 40, 56, generator=generator) * 2 - 1
    latent = torch.randn(2, 16, 5, 7, generator=generator)
    big_image = torch.rand(1, 3, 96, 112, generator=generator) * 2 - 1
    big_latent = torch.randn(1, 16, 12, 14, generator=generator)
    arrays = dict(image=image.numpy(), latent=latent.numpy(), big_image=big_image.numpy(), big_latent=big_latent.numpy())
    with torch.no_grad():
        arrays["qwen_encode_mean"] = qwen.encode(image[:, :, None]).latent_dist.mean[:, :, 0].numpy()
        arrays["qwen_decode"] = qwen.decode(latent[:, :, None]).sample[:, :, 0].numpy()
        arrays["flux_encode_mean"] = flux.encode(image).latent_dist.mean.numpy()
        arrays["flux_decode"] = flux.decode(latent).sample.numpy()
        arrays["qwen_decode_big"] = qwen.decode(big_latent[:, :, None]).sample[:, :, 0].numpy()
        arrays["flux_decode_big"] = flux.decode(big_latent).sample.numpy()
        arrays["qwen_encode_big"] = qwen.encode(big_image[:, :, None]).latent_dist.mean[:, :, 0].numpy()
        arrays["flux_encode_big"] = flux.encode(big_image).latent_dist.mean.numpy()
        # diffusers' own tiling with tiles small enough that the 96x112 image needs several of them
        qwen.enable_tiling(tile_sample_min_height=64, tile_sample_min_width=64,
                           tile_sample_stride_height=48, tile_sample_stride_width=48)
        arrays["qwen_decode_big_tiled"] = qwen.decode(big_latent[:, :, None]).sample[:, :, 0].numpy()
        arrays["qwen_encode_big_tiled"] = qwen.encode(big_image[:, :, None]).latent_dist.mean[:, :, 0].numpy()
        flux.enable_tiling()  # its tile is config.sample_size (64 pixels here) with 25% overlap
        arrays["flux_decode_big_tiled"] = flux.decode(big_latent).sample.numpy()
        arrays["flux_encode_big_tiled"] = flux.tiled_encode(big_image).latent_dist.mean.numpy()
    # bfloat16, as the pipelines load the VAEs (`dtype=torch.bfloat16`), on the same inputs
    for name, cls, folder in (("qwen", AutoencoderKLQwenImage, "qwenimage_vae"), ("flux", AutoencoderKL, "flux_vae")):
        model = cls.from_pretrained(out / folder, dtype=torch.bfloat16).eval()
        frames = (lambda x: x[:, :, None], lambda x: x[:, :, 0]) if name == "qwen" else (lambda x: x, lambda x: x)
        with torch.no_grad():
            mean = model.encode(frames[0](image.to(torch.bfloat16))).latent_dist.mean
            decoded = model.decode(frames[0](latent.to(torch.bfloat16))).sample
        arrays[f"{name}_encode_mean_bf16"] = frames[1](mean).float().numpy()
        arrays[f"{name}_decode_bf16"] = frames[1](decoded).float().numpy()
    np.savez_compressed(out / "vae_reference.npz", **arrays)
    clamped = np.mean(np.abs(arrays["qwen_decode"]) >= 1)
    print(f"wrote VAE fixtures to {out} (Qwen decode: {clamped:.1%} of the values clamped at +-1)")


QWEN3VL_TEXT_TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, max_position_embeddings=256,
                         rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "mrope_section": [2, 1, 1],
                                          "mrope_interleaved": True})
QWEN3VL_VISION_TINY = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           patch_size=4, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                           deepstack_visual_indexes=[])
# Taps include the last layer, so that whether the final norm applies there is pinned down too.
KREA2_PIPELINE_TAPS = (1, 2, 4)
PROMPTS = ["a red fox in the snow, photo", "an old house near the river at night"]


def _load_tokenizer_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("mxdit_tokenizer", Path(__file__).parent.parent / "model" / "tokenizer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_krea2_pipeline(out: Path) -> None:
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, Krea2Pipeline, Krea2Transformer2DModel
    from transformers import PreTrainedTokenizerFast, Qwen3VLConfig, Qwen3VLModel

    folder = out / "tiny_pipeline"
    shutil.rmtree(folder, ignore_errors=True)
    _load_tokenizer_module().save_demo_tokenizer(folder / "tokenizer")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder / "tokenizer")
    generator = torch.Generator().manual_seed(2)

    text_config = dict(QWEN3VL_TEXT_TINY, vocab_size=tokenizer.vocab_size)
    text_encoder = Qwen3VLModel(Qwen3VLConfig(text_config=text_config, vision_config=QWEN3VL_VISION_TINY)).eval()
    transformer = Krea2Transformer2DModel(**dict(
        KREA2_TINY_CONFIG, in_channels=64, text_hidden_dim=32, num_text_layers=len(KREA2_PIPELINE_TAPS),
        text_num_attention_heads=4,
        text_num_key_value_heads=2)).eval()
    vae = AutoencoderKLQwenImage(**QWENIMAGE_VAE_TINY_CONFIG).eval()
    for model in (text_encoder, transformer, vae):
        _randomize(model, generator)
    with torch.no_grad():
        for name, param in list(text_encoder.named_parameters()) + list(vae.named_parameters()):
            if name.endswith(("norm.weight", "layernorm.weight", "gamma")):
                param.add_(1.0)  # standard (not zero-centred) norms: scales near 1
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=6400)
    pipe = Krea2Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                         transformer=transformer, text_encoder_select_layers=KREA2_PIPELINE_TAPS)
    pipe.save_pretrained(folder)

    # Which hidden state is the last one? (transformers returns the normed output there.)
    ids = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        outputs = text_encoder(**ids, output_hidden_states=True)
    assert len(outputs.hidden_states) == QWEN3VL_TEXT_TINY["num_hidden_layers"] + 1
    last_is_normed = bool(torch.allclose(outputs.hidden_states[-1], outputs.last_hidden_state))

    max_len, height, width = 24, 64, 48
    arrays = {"last_hidden_state_is_normed": np.array(last_is_normed)}
    with torch.no_grad():
        embeds, mask = pipe.get_text_hidden_states(PROMPTS, max_sequence_length=max_len, device="cpu")
        arrays.update(prompt_embeds=embeds.numpy(), prompt_mask=mask.numpy())
        neg, neg_mask = pipe.get_text_hidden_states(["blurry"], max_sequence_length=max_len, device="cpu")
        arrays.update(negative_embeds=neg.numpy(), negative_mask=neg_mask.numpy())
        # Base: CFG with a negative prompt, dynamic shift; latents as the pipeline packs them.
        seq, channels = (height // 16) * (width // 16), transformer.config.in_channels
        latents = torch.randn(2, seq, channels, generator=generator)
        base = pipe(prompt=PROMPTS, negative_prompt="blurry", height=height, width=width, num_inference_steps=4,
                    guidance_scale=4.5, latents=latents.clone(), max_sequence_length=max_len, output_type="latent")
        arrays.update(base_latents_in=latents.numpy(), base_latents_out=base.images.numpy())
        images = pipe(prompt=PROMPTS, negative_prompt="blurry", height=height, width=width, num_inference_steps=4,
                      guidance_scale=4.5, latents=latents.clone(), max_sequence_length=max_len, output_type="np")
        arrays.update(base_images=images.images)
        # Turbo: the distilled schedule (fixed shift), no CFG, two images of one prompt.
        turbo_pipe = Krea2Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                                   transformer=transformer, text_encoder_select_layers=KREA2_PIPELINE_TAPS,
                                   is_distilled=True)
        latents = torch.randn(2, seq, channels, generator=generator)
        turbo = turbo_pipe(prompt=PROMPTS[0], height=height, width=width, num_inference_steps=3, guidance_scale=0.0,
                           num_images_per_prompt=2, latents=latents.clone(), max_sequence_length=max_len,
                           output_type="latent")
        arrays.update(turbo_latents_in=latents.numpy(), turbo_latents_out=turbo.images.numpy())
    # bfloat16, as users load the pipeline: the Base run above (its latents are cast to bfloat16 by the pipeline)
    pipe_bf16 = Krea2Pipeline.from_pretrained(folder, dtype=torch.bfloat16)
    with torch.no_grad():
        embeds, _ = pipe_bf16.get_text_hidden_states(PROMPTS, max_sequence_length=max_len, device="cpu")
        kwargs = dict(prompt=PROMPTS, negative_prompt="blurry", height=height, width=width, num_inference_steps=4,
                      guidance_scale=4.5, max_sequence_length=max_len)
        latents = torch.from_numpy(arrays["base_latents_in"])
        base = pipe_bf16(latents=latents.clone(), output_type="latent", **kwargs)
        images = pipe_bf16(latents=latents.clone(), output_type="np", **kwargs)
    arrays.update(prompt_embeds_bf16=embeds.float().numpy(), base_latents_out_bf16=base.images.float().numpy(),
                  base_images_bf16=images.images)
    np.savez_compressed(out / "pipeline_reference.npz", **arrays)
    print(f"wrote Krea 2 pipeline fixtures to {folder} (last hidden state normed: {last_is_normed})")


# The LoRA fixtures (issue #12): adapters on the tiny pipeline's transformer, in the layouts the ecosystem uses.
KREA2_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "to_gate", "ff.gate", "ff.up", "ff.down", "img_in",
                      "time_mod_proj", "txt_in.linear_1", "final_layer.linear", "text_fusion.projector"]
KREA2_LORA_RANK, KREA2_LORA_ALPHA = 4, 8.0  # scale 2: a file that drops the alpha gives a visibly wrong answer


def _krea2_lora_inputs(transformer, generator: torch.Generator) -> dict:
    """Transformer inputs for the LoRA references: batch 2, a 3x5 latent grid, 7 text tokens with padding."""
    cfg = transformer.config
    batch, text_len, grid_h, grid_w = 2, 7, 3, 5
    image_ids = torch.zeros(grid_h, grid_w, 3)
    image_ids[..., 1] = torch.arange(grid_h)[:, None]
    image_ids[..., 2] = torch.arange(grid_w)[None, :]
    return dict(
        hidden_states=torch.randn(batch, grid_h * grid_w, cfg.in_channels, generator=generator),
        encoder_hidden_states=torch.randn(batch, text_len, cfg.num_text_layers, cfg.text_hidden_dim,
                                          generator=generator),
        timestep=torch.tensor([0.83, 0.27]),
        position_ids=torch.cat([torch.zeros(text_len, 3), image_ids.reshape(-1, 3)], dim=0),
        encoder_attention_mask=torch.tensor([[1, 1, 0, 0, 1, 1, 0], [1] * 7], dtype=torch.bool),
    )


def _krea2_lora_output(pipe, inputs: dict) -> np.ndarray:
    with torch.no_grad():
        return pipe.transformer(**inputs, return_dict=False)[0].numpy()


def _krea2_pipeline_fp32(folder: Path):
    from diffusers import Krea2Pipeline

    return Krea2Pipeline.from_pretrained(folder, dtype=torch.float32)


def write_lora(out: Path) -> None:
    """A PEFT LoRA made by diffusers on the tiny pipeline's transformer, saved by `save_lora_weights`, the same
    weights converted by hand to the kohya and ComfyUI layouts, and diffusers' transformer output with it."""
    from diffusers import Krea2Pipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    folder = out / "lora"
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(12)
    pipe = _krea2_pipeline_fp32(out / "tiny_pipeline")
    inputs = _krea2_lora_inputs(pipe.transformer, generator)
    arrays = {k: v.numpy() for k, v in inputs.items()}
    arrays["output_base"] = _krea2_lora_output(pipe, inputs)

    transformer = pipe.transformer
    config = LoraConfig(r=KREA2_LORA_RANK, lora_alpha=KREA2_LORA_ALPHA, target_modules=KREA2_LORA_TARGETS,
                        init_lora_weights="gaussian")
    transformer.add_adapter(config, adapter_name="fixture")
    with torch.no_grad():  # B is zero after PEFT's init: give both matrices random values of a useful size
        for name, param in transformer.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3 / np.sqrt(param.shape[-1]))
    state = get_peft_model_state_dict(transformer, adapter_name="fixture")
    state = {k: v.detach().clone().contiguous() for k, v in state.items()}
    metadata = dict(config.to_dict(), target_modules=sorted(config.target_modules))  # a set: sorted, for stable bytes
    Krea2Pipeline.save_lora_weights(folder, transformer_lora_layers=state, weight_name="diffusers.safetensors",
                                    transformer_lora_adapter_metadata=metadata)
    transformer.delete_adapters("fixture")

    # The file as a user gets it: loaded by the pipeline, at two weights.
    pipe.load_lora_weights(folder / "diffusers.safetensors", adapter_name="lora")
    arrays["output_lora_1.0"] = _krea2_lora_output(pipe, inputs)
    pipe.set_adapters(["lora"], [0.5])
    arrays["output_lora_0.5"] = _krea2_lora_output(pipe, inputs)
    pipe.delete_adapters("lora")
    after = _krea2_lora_output(pipe, inputs)
    assert np.linalg.norm(after - arrays["output_base"]) <= 1e-6 * np.linalg.norm(arrays["output_base"])

    # kohya: `lora_unet_` + the original module name with dots as underscores, lora_down (= A), lora_up (= B) and
    # the alpha as a scalar tensor. ComfyUI: `diffusion_model.` + the original module name with lora_A / lora_B, as
    # diffusers' `_convert_non_diffusers_krea2_lora_to_diffusers` reads it; that layout carries no alpha, so the
    # scale alpha / rank is folded into lora_B.
    kohya, comfy = {}, {}
    scale = KREA2_LORA_ALPHA / KREA2_LORA_RANK
    for key, value in state.items():
        module, part = key.removeprefix("transformer.").rsplit(".lora_", 1)
        original = krea2_diffusers_to_original_key(module + ".weight").removesuffix(".weight")
        kohya_name = "lora_unet_" + original.replace(".", "_")
        kohya[f"{kohya_name}.lora_{'down' if part.startswith('A') else 'up'}.weight"] = value
        kohya[f"{kohya_name}.alpha"] = torch.tensor(KREA2_LORA_ALPHA)
        comfy[f"diffusion_model.{original}.lora_{part}"] = (value * scale if part.startswith("B") else value).contiguous()
    save_file(kohya, str(folder / "kohya.safetensors"))
    save_file(comfy, str(folder / "comfyui.safetensors"))
    # The hand-made ComfyUI file must give what the diffusers file gives, through diffusers' own converter.
    pipe.load_lora_weights(folder / "comfyui.safetensors", adapter_name="comfy")
    comfy_out = _krea2_lora_output(pipe, inputs)
    pipe.delete_adapters("comfy")
    rel = np.linalg.norm(comfy_out - arrays["output_lora_1.0"]) / np.linalg.norm(arrays["output_lora_1.0"])
    assert rel < 1e-5, rel
    np.savez(folder / "reference.npz", **arrays)
    print(f"wrote Krea 2 LoRA fixtures to {folder} (LoRA changes the output by "
          f"{np.linalg.norm(arrays['output_lora_1.0'] - arrays['output_base']) / np.linalg.norm(arrays['output_base']):.3f}"
          f" relative L2; ComfyUI file vs diffusers file in diffusers: {rel:.2e})")


def write_lora_export(out: Path) -> None:
    """Step 2 of the export check: load the LoRAs that mxdit exported (tests/fixtures/krea2/lora/mxdit_*.safetensors,
    written by `python scripts/export_lora_fixture.py` with mxdit's venv) into diffusers' pipeline and save the
    transformer outputs on the inputs of `write_lora`'s reference.npz."""
    folder = out / "lora"
    reference = np.load(folder / "reference.npz")
    inputs = {k: torch.from_numpy(reference[k]) for k in ("hidden_states", "encoder_hidden_states", "timestep",
                                                             "position_ids", "encoder_attention_mask")}
    pipe = _krea2_pipeline_fp32(out / "tiny_pipeline")
    arrays = {}
    for layout in ("diffusers", "comfyui"):
        path = folder / f"mxdit_{layout}.safetensors"
        pipe.load_lora_weights(path, adapter_name=layout)
        arrays[f"output_{layout}"] = _krea2_lora_output(pipe, inputs)
        pipe.delete_adapters(layout)
    np.savez(folder / "export_reference.npz", **arrays)
    print(f"wrote diffusers' outputs with mxdit's exported LoRAs to {folder / 'export_reference.npz'}")


FLUX_TINY_CONFIG = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
                        num_attention_heads=2, joint_attention_dim=24, pooled_projection_dim=12, guidance_embeds=True,
                        axes_dims_rope=(4, 6, 6))


def flux_diffusers_to_original(state: dict) -> dict:
    """The original FLUX single-file layout of a diffusers state dict (fused QKV, fused linear1, shift-first final
    modulation): the inverse of diffusers' `convert_flux_transformer_checkpoint_to_diffusers`."""
    out = {}
    take = state.pop
    for src, dst in (("time_in", "timestep_embedder"), ("vector_in", "text_embedder"), ("guidance_in", "guidance_embedder")):
        if f"time_text_embed.{dst}.linear_1.weight" not in state:
            continue  # schnell has no guidance embedding
        for p in ("weight", "bias"):
            out[f"{src}.in_layer.{p}"] = take(f"time_text_embed.{dst}.linear_1.{p}")
            out[f"{src}.out_layer.{p}"] = take(f"time_text_embed.{dst}.linear_2.{p}")
    for p in ("weight", "bias"):
        out[f"txt_in.{p}"] = take(f"context_embedder.{p}")
        out[f"img_in.{p}"] = take(f"x_embedder.{p}")
        out[f"final_layer.linear.{p}"] = take(f"proj_out.{p}")
        scale, shift = take(f"norm_out.linear.{p}").chunk(2, dim=0)
        out[f"final_layer.adaLN_modulation.1.{p}"] = torch.cat([shift, scale])
    doubles = sorted({int(k.split(".")[1]) for k in state if k.startswith("transformer_blocks.")})
    for i in doubles:
        n, o = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        for p in ("weight", "bias"):
            out[f"{o}img_mod.lin.{p}"] = take(f"{n}norm1.linear.{p}")
            out[f"{o}txt_mod.lin.{p}"] = take(f"{n}norm1_context.linear.{p}")
            out[f"{o}img_attn.qkv.{p}"] = torch.cat([take(f"{n}attn.to_{x}.{p}") for x in "qkv"])
            out[f"{o}txt_attn.qkv.{p}"] = torch.cat([take(f"{n}attn.add_{x}_proj.{p}") for x in "qkv"])
            out[f"{o}img_mlp.0.{p}"] = take(f"{n}ff.net.0.proj.{p}")
            out[f"{o}img_mlp.2.{p}"] = take(f"{n}ff.net.2.{p}")
            out[f"{o}txt_mlp.0.{p}"] = take(f"{n}ff_context.net.0.proj.{p}")
            out[f"{o}txt_mlp.2.{p}"] = take(f"{n}ff_context.net.2.{p}")
            out[f"{o}img_attn.proj.{p}"] = take(f"{n}attn.to_out.0.{p}")
            out[f"{o}txt_attn.proj.{p}"] = take(f"{n}attn.to_add_out.{p}")
        out[f"{o}img_attn.norm.query_norm.scale"] = take(f"{n}attn.norm_q.weight")
        out[f"{o}img_attn.norm.key_norm.scale"] = take(f"{n}attn.norm_k.weight")
        out[f"{o}txt_attn.norm.query_norm.scale"] = take(f"{n}attn.norm_added_q.weight")
        out[f"{o}txt_attn.norm.key_norm.scale"] = take(f"{n}attn.norm_added_k.weight")
    singles = sorted({int(k.split(".")[1]) for k in state if k.startswith("single_transformer_blocks.")})
    for i in singles:
        n, o = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        for p in ("weight", "bias"):
            out[f"{o}modulation.lin.{p}"] = take(f"{n}norm.linear.{p}")
            out[f"{o}linear1.{p}"] = torch.cat([take(f"{n}attn.to_{x}.{p}") for x in "qkv"] + [take(f"{n}proj_mlp.{p}")])
            out[f"{o}linear2.{p}"] = take(f"{n}proj_out.{p}")
        out[f"{o}norm.query_norm.scale"] = take(f"{n}attn.norm_q.weight")
        out[f"{o}norm.key_norm.scale"] = take(f"{n}attn.norm_k.weight")
    assert not state, f"unmapped keys {sorted(state)}"
    return {"model.diffusion_model." + k: v.contiguous() for k, v in out.items()}


def _diffusers_flux_converter(inner_dim: int):
    """diffusers' converter hard-codes FLUX.1's width (3072); rebuild it for the tiny width to check our inverse."""
    import inspect

    from diffusers.loaders import single_file_utils

    source = inspect.getsource(single_file_utils.convert_flux_transformer_checkpoint_to_diffusers)
    assert "inner_dim = 3072" in source
    namespace = dict(vars(single_file_utils))
    exec(source.replace("inner_dim = 3072", f"inner_dim = {inner_dim}"), namespace)
    return namespace["convert_flux_transformer_checkpoint_to_diffusers"]


def write_flux_transformer(out: Path) -> None:
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(3)
    model = FluxTransformer2DModel(**FLUX_TINY_CONFIG).eval()
    _randomize(model, generator)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith(("norm_q.weight", "norm_k.weight", "norm_added_q.weight", "norm_added_k.weight")):
                param.add_(1.0)  # torch RMSNorm multiplies by the weight itself
    shutil.rmtree(out / "tiny", ignore_errors=True)
    model.save_pretrained(out / "tiny")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    original = flux_diffusers_to_original(dict(state))
    back = _diffusers_flux_converter(model.inner_dim)(dict(original))
    assert set(back) == set(state), set(back) ^ set(state)
    for key in state:
        assert torch.equal(back[key], state[key]), key
    save_file(original, str(out / "tiny_original.safetensors"))

    batch, text_len, grid_h, grid_w = 2, 7, 3, 5
    hidden = torch.randn(batch, grid_h * grid_w, FLUX_TINY_CONFIG["in_channels"], generator=generator)
    text = torch.randn(batch, text_len, FLUX_TINY_CONFIG["joint_attention_dim"], generator=generator)
    pooled = torch.randn(batch, FLUX_TINY_CONFIG["pooled_projection_dim"], generator=generator)
    timestep = torch.tensor([0.83, 0.27])
    guidance = torch.tensor([3.5, 3.5])
    img_ids = torch.zeros(grid_h, grid_w, 3)
    img_ids[..., 1] = torch.arange(grid_h)[:, None]
    img_ids[..., 2] = torch.arange(grid_w)[None, :]
    img_ids = img_ids.reshape(-1, 3)
    txt_ids = torch.zeros(text_len, 3)
    with torch.no_grad():
        output = model(hidden, text, pooled, timestep, img_ids, txt_ids, guidance, return_dict=False)[0]
    # bfloat16 as users load it, the inputs as the pipeline passes them (in bfloat16 but the guidance scale)
    model_bf16 = FluxTransformer2DModel.from_pretrained(out / "tiny", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        output_bf16 = model_bf16(hidden.bfloat16(), text.bfloat16(), pooled.bfloat16(), timestep.bfloat16(), img_ids,
                                 txt_ids, guidance, return_dict=False)[0]
    np.savez_compressed(out / "reference.npz", hidden_states=hidden.numpy(), encoder_hidden_states=text.numpy(),
                        pooled_projections=pooled.numpy(), timestep=timestep.numpy(), guidance=guidance.numpy(),
                        img_ids=img_ids.numpy(), txt_ids=txt_ids.numpy(), output=output.numpy(),
                        output_bf16=output_bf16.float().numpy())
    print(f"wrote FLUX transformer fixtures to {out}")


def _word_tokenizer(words, specials, template, pad, model_max_length, folder, **special_tokens):
    """A tiny word-level tokenizer with a post-processor template, saved as transformers saves a fast tokenizer."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(words)}
    for token in specials:
        vocab.setdefault(token, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token=special_tokens.get("unk_token", pad)))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.post_processor = processors.TemplateProcessing(
        single=template, special_tokens=[(t, vocab[t]) for t in specials if t in template])
    tok.add_special_tokens(list(specials))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=pad, model_max_length=model_max_length,
                                   **special_tokens)
    fast.save_pretrained(folder)
    return fast


FLUX_WORDS = ("a an the red green blue cat dog fox snow river house old night photo of in on at with small large "
              "painting forest city , .").split()


def write_flux_pipeline(out: Path) -> None:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    folder = out / "tiny_pipeline"
    shutil.rmtree(folder, ignore_errors=True)
    # CLIP: start/end tokens added around the text, padded with the end token, which has the largest id (so the
    # legacy eos_token_id=2 rule of FLUX's CLIP config, "pool at the argmax id", finds it). T5: an end token appended.
    clip_tok = _word_tokenizer(["<unk>"] + FLUX_WORDS, ["<|startoftext|>", "<|endoftext|>"],
                               "<|startoftext|> $A <|endoftext|>", "<|endoftext|>", 16, folder / "tokenizer",
                               bos_token="<|startoftext|>", eos_token="<|endoftext|>", unk_token="<unk>")
    t5_tok = _word_tokenizer(["<pad>", "</s>", "<unk>"] + FLUX_WORDS, ["<pad>", "</s>", "<unk>"], "$A </s>", "<pad>",
                             512, folder / "tokenizer_2", eos_token="</s>", unk_token="<unk>")
    generator = torch.Generator().manual_seed(4)
    clip = CLIPTextModel(CLIPTextConfig(vocab_size=clip_tok.vocab_size, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=16,
                                        hidden_act="quick_gelu", eos_token_id=2, bos_token_id=0, pad_token_id=1)).eval()
    t5 = T5EncoderModel(T5Config(vocab_size=t5_tok.vocab_size, d_model=24, d_kv=8, d_ff=48, num_layers=2, num_heads=3,
                                 relative_attention_num_buckets=8, relative_attention_max_distance=16,
                                 feed_forward_proj="gated-gelu", decoder_start_token_id=0)).eval()
    transformer = FluxTransformer2DModel(**dict(FLUX_TINY_CONFIG, in_channels=64, joint_attention_dim=24,
                                                pooled_projection_dim=32)).eval()
    vae = AutoencoderKL(**FLUX_VAE_TINY_CONFIG).eval()
    for model in (clip, t5, transformer, vae):
        _randomize(model, generator)
    with torch.no_grad():
        for model in (clip, t5, vae, transformer):
            for name, param in model.named_parameters():
                if name.endswith(("layer_norm.weight", "layer_norm1.weight", "layer_norm2.weight", "norm.weight",
                                  "norm1.weight", "norm2.weight", "norm_q.weight", "norm_k.weight",
                                  "norm_added_q.weight", "norm_added_k.weight", "norm_out.weight")):
                    param.add_(1.0)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)
    pipe = FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=clip, tokenizer=clip_tok, text_encoder_2=t5,
                        tokenizer_2=t5_tok, transformer=transformer)
    pipe.save_pretrained(folder)

    max_len, height, width = 16, 64, 48
    arrays = {}
    with torch.no_grad():
        embeds, pooled, _ = pipe.encode_prompt(PROMPTS, prompt_2=None, max_sequence_length=max_len, device="cpu")
        arrays.update(prompt_embeds=embeds.numpy(), pooled_prompt_embeds=pooled.numpy())
        ids = clip_tok(PROMPTS, padding="max_length", max_length=16, truncation=True, return_tensors="pt").input_ids
        arrays.update(clip_ids=ids.numpy(), clip_last_hidden=clip(ids).last_hidden_state.numpy())
        t5_ids = t5_tok(PROMPTS, padding="max_length", max_length=max_len, truncation=True, return_tensors="pt").input_ids
        arrays.update(t5_ids=t5_ids.numpy())
        seq = (height // 16) * (width // 16)
        latents = torch.randn(2, seq, 64, generator=generator)
        dev = pipe(prompt=PROMPTS, height=height, width=width, num_inference_steps=4, guidance_scale=3.5,
                   latents=latents.clone(), max_sequence_length=max_len, output_type="latent")
        images = pipe(prompt=PROMPTS, height=height, width=width, num_inference_steps=4, guidance_scale=3.5,
                      latents=latents.clone(), max_sequence_length=max_len, output_type="np")
        true_cfg = pipe(prompt=PROMPTS, negative_prompt="blurry", true_cfg_scale=2.0, height=height, width=width,
                        num_inference_steps=3, guidance_scale=3.5, latents=latents.clone(), max_sequence_length=max_len,
                        output_type="latent")
        arrays.update(latents_in=latents.numpy(), dev_latents_out=dev.images.numpy(), dev_images=images.images,
                      true_cfg_latents_out=true_cfg.images.numpy())
    # bfloat16, as users load the pipeline: the text encoders and the dev run above (its latents are cast to bfloat16
    # by the pipeline). All of T5 is bfloat16 then: transformers keeps its `wo` layers in float32 for float16 only.
    pipe_bf16 = FluxPipeline.from_pretrained(folder, dtype=torch.bfloat16)
    assert pipe_bf16.text_encoder_2.encoder.block[0].layer[1].DenseReluDense.wo.weight.dtype == torch.bfloat16
    with torch.no_grad():
        embeds, pooled, _ = pipe_bf16.encode_prompt(PROMPTS, prompt_2=None, max_sequence_length=max_len, device="cpu")
        kwargs = dict(prompt=PROMPTS, height=height, width=width, num_inference_steps=4, guidance_scale=3.5,
                      max_sequence_length=max_len)
        dev = pipe_bf16(latents=latents.clone(), output_type="latent", **kwargs)
        images = pipe_bf16(latents=latents.clone(), output_type="np", **kwargs)
    arrays.update(prompt_embeds_bf16=embeds.float().numpy(), pooled_prompt_embeds_bf16=pooled.float().numpy(),
                  dev_latents_out_bf16=dev.images.float().numpy(), dev_images_bf16=images.images)
    np.savez_compressed(out / "pipeline_reference.npz", **arrays)
    print(f"wrote FLUX pipeline fixtures to {folder}")


# FLUX.1-schnell's scheduler_config.json: no dynamic shifting, static shift 1 (the plain linear sigmas).
FLUX_SCHNELL_SCHEDULER = dict(shift=1.0, use_dynamic_shifting=False, base_shift=0.5, max_shift=1.15,
                              base_image_seq_len=256, max_image_seq_len=4096)
# What differs from the tiny FLUX.1-dev pipeline; its other components (text encoders, tokenizers, VAE) are shared.
FLUX_SCHNELL_PARTS = ("transformer", "scheduler", "model_index.json")


def write_flux_schnell(out: Path) -> None:
    """FLUX.1-schnell end to end on the tiny FLUX pipeline's text encoders and VAE: a transformer without the guidance
    embedding (one block of each kind), schnell's scheduler, and diffusers' latents and images at schnell's settings
    (4 steps, T5 length 256). tiny_schnell/ keeps only FLUX_SCHNELL_PARTS; the tests complete it from tiny_pipeline/."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    folder = out / "tiny_schnell"
    shutil.rmtree(folder, ignore_errors=True)
    generator = torch.Generator().manual_seed(14)
    dev = FluxPipeline.from_pretrained(out / "tiny_pipeline", dtype=torch.float32)
    transformer = FluxTransformer2DModel(**dict(FLUX_TINY_CONFIG, in_channels=64, joint_attention_dim=24,
                                                pooled_projection_dim=32, guidance_embeds=False, num_layers=1,
                                                num_single_layers=1)).eval()
    _randomize(transformer, generator)
    with torch.no_grad():
        for name, param in transformer.named_parameters():
            if name.endswith(("norm_q.weight", "norm_k.weight", "norm_added_q.weight", "norm_added_k.weight")):
                param.add_(1.0)
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_SCHNELL_SCHEDULER), vae=dev.vae,
                        text_encoder=dev.text_encoder, tokenizer=dev.tokenizer, text_encoder_2=dev.text_encoder_2,
                        tokenizer_2=dev.tokenizer_2, transformer=transformer)
    pipe.save_pretrained(folder)
    for path in folder.iterdir():
        if path.name not in FLUX_SCHNELL_PARTS:
            shutil.rmtree(path)

    height, width = 64, 48
    latents = torch.randn(2, (height // 16) * (width // 16), 64, generator=generator)
    kwargs = dict(prompt=PROMPTS, height=height, width=width, num_inference_steps=4, guidance_scale=0.0,
                  max_sequence_length=256)
    with torch.no_grad():
        schnell = pipe(latents=latents.clone(), output_type="latent", **kwargs)
        images = pipe(latents=latents.clone(), output_type="np", **kwargs)
    np.savez_compressed(out / "schnell_reference.npz", latents_in=latents.numpy(), latents_out=schnell.images.numpy(),
                        images=images.images)
    print(f"wrote FLUX.1-schnell fixtures to {folder}")


FLUX_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                     "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp",
                     "single_transformer_blocks.0.proj_out", "single_transformer_blocks.1.proj_out", "norm1.linear",
                     "norm_out.linear"]


def write_flux_lora(out: Path) -> None:
    """FLUX.1 LoRAs on the tiny FLUX pipeline's transformer: a PEFT LoRA saved by diffusers, and a kohya file in the
    original layout (fused qkv, the final modulation's (shift, scale) order), each loaded by `load_lora_weights`,
    with diffusers' transformer outputs. The kohya file has no single-block linear1 (diffusers' converter hard-codes
    FLUX.1's width for it) and the final modulation without an alpha (diffusers' converter ignores that one), which
    diffusers' loader then drops (see below)."""
    from diffusers import FluxPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    folder = out / "lora"
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(13)
    pipe = FluxPipeline.from_pretrained(out / "tiny_pipeline", dtype=torch.float32)
    transformer = pipe.transformer
    cfg, dim = transformer.config, transformer.inner_dim
    batch, text_len, grid_h, grid_w = 2, 7, 3, 5
    img_ids = torch.zeros(grid_h, grid_w, 3)
    img_ids[..., 1] = torch.arange(grid_h)[:, None]
    img_ids[..., 2] = torch.arange(grid_w)[None, :]
    inputs = dict(hidden_states=torch.randn(batch, grid_h * grid_w, cfg.in_channels, generator=generator),
                  encoder_hidden_states=torch.randn(batch, text_len, cfg.joint_attention_dim, generator=generator),
                  pooled_projections=torch.randn(batch, cfg.pooled_projection_dim, generator=generator),
                  timestep=torch.tensor([0.83, 0.27]), img_ids=img_ids.reshape(-1, 3), txt_ids=torch.zeros(text_len, 3),
                  guidance=torch.tensor([3.5, 3.5]))

    def output():
        with torch.no_grad():
            return pipe.transformer(**inputs, return_dict=False)[0].numpy()

    arrays = {k: v.numpy() for k, v in inputs.items()}
    arrays["output_base"] = output()
    config = LoraConfig(r=KREA2_LORA_RANK, lora_alpha=KREA2_LORA_ALPHA, target_modules=FLUX_LORA_TARGETS,
                        init_lora_weights="gaussian")
    transformer.add_adapter(config, adapter_name="fixture")
    with torch.no_grad():
        for name, param in transformer.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3 / np.sqrt(param.shape[-1]))
    state = {k: v.detach().clone().contiguous()
             for k, v in get_peft_model_state_dict(transformer, adapter_name="fixture").items()}
    FluxPipeline.save_lora_weights(folder, transformer_lora_layers=state, weight_name="diffusers.safetensors",
                                   transformer_lora_adapter_metadata=dict(config.to_dict(),
                                                                          target_modules=sorted(config.target_modules)))
    transformer.delete_adapters("fixture")
    pipe.load_lora_weights(folder / "diffusers.safetensors", adapter_name="peft")
    arrays["output_diffusers"] = output()
    pipe.delete_adapters("peft")

    rank, kohya = KREA2_LORA_RANK, {}

    def add(name: str, in_features: int, out_features: int, alpha: float | None = KREA2_LORA_ALPHA):
        kohya[f"lora_unet_{name}.lora_down.weight"] = torch.randn(rank, in_features, generator=generator) * 0.3 / np.sqrt(in_features)
        kohya[f"lora_unet_{name}.lora_up.weight"] = torch.randn(out_features, rank, generator=generator) * 0.3 / np.sqrt(rank)
        if alpha is not None:
            kohya[f"lora_unet_{name}.alpha"] = torch.tensor(alpha)

    for i in range(cfg.num_layers):
        for stream in ("img", "txt"):
            add(f"double_blocks_{i}_{stream}_attn_qkv", dim, 3 * dim)
            add(f"double_blocks_{i}_{stream}_attn_proj", dim, dim)
            add(f"double_blocks_{i}_{stream}_mlp_0", dim, 4 * dim)
            add(f"double_blocks_{i}_{stream}_mlp_2", 4 * dim, dim)
            add(f"double_blocks_{i}_{stream}_mod_lin", dim, 6 * dim)
    for i in range(cfg.num_single_layers):
        add(f"single_blocks_{i}_linear2", 5 * dim, dim)
        add(f"single_blocks_{i}_modulation_lin", dim, 3 * dim)
    add("final_layer_adaLN_modulation_1", dim, 2 * dim, alpha=None)
    save_file({k: v.contiguous() for k, v in kohya.items()}, str(folder / "kohya.safetensors"))
    # diffusers' converter names the final modulation's LoRA `norm_out.linear` without the `transformer.` prefix, so
    # its loader drops it (0.42.1): the output below is without it, and the converted matrices are saved to check
    # the (shift, scale) -> (scale, shift) swap against diffusers' own conversion.
    from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux_lora_to_diffusers

    converted = _convert_kohya_flux_lora_to_diffusers({k: v.clone() for k, v in kohya.items()})
    arrays["kohya_norm_out_A"] = converted["norm_out.linear.lora_A.weight"].numpy()
    arrays["kohya_norm_out_B"] = converted["norm_out.linear.lora_B.weight"].numpy()
    pipe.load_lora_weights(folder / "kohya.safetensors", adapter_name="kohya")
    arrays["output_kohya"] = output()
    pipe.delete_adapters("kohya")
    np.savez(folder / "reference.npz", **arrays)
    base = np.linalg.norm(arrays["output_base"])
    print(f"wrote FLUX LoRA fixtures to {folder} (relative change: PEFT "
          f"{np.linalg.norm(arrays['output_diffusers'] - arrays['output_base']) / base:.3f}, kohya "
          f"{np.linalg.norm(arrays['output_kohya'] - arrays['output_base']) / base:.3f})")


# --------------------------------------------------------------------------------------------------------------------
# Full-size key coverage: the key names and shapes of the released checkpoints, from diffusers / transformers built
# at the released configs on the meta device (no weights), and the original single-file layouts derived with the
# inverse maps above and checked against diffusers' own converters. tests/test_key_coverage.py maps every one onto our
# modules. Where a value is not given below, the library default is the released model's.

# Krea2Transformer2DModel's defaults are Krea-2-Turbo's transformer/config.json: the same values as invoke-ai/InvokeAI's
# invokeai/backend/model_manager/load/model_loaders/krea2.py (KREA2_TRANSFORMER_CONFIG, copied from that file) and
# the SingleStreamDiT defaults of comfyanonymous/ComfyUI's comfy/ldm/krea2/model.py.
KREA2_RELEASED: dict = {}
# FluxTransformer2DModel's defaults are FLUX.1's sizes; black-forest-labs/flux src/flux/util.py (`configs`) sets
# guidance_embed=True for flux-dev and False for flux-schnell.
FLUX_DEV_RELEASED = dict(guidance_embeds=True)
FLUX_SCHNELL_RELEASED = dict(guidance_embeds=False)
# FLUX.1's vae/config.json: black-forest-labs/flux src/flux/util.py `ae_params` (ch=128, ch_mult=[1, 2, 4, 4],
# num_res_blocks=2, z_channels=16, scale_factor=0.3611, shift_factor=0.1159; its AutoEncoder has no quant convs).
FLUX_VAE_RELEASED = dict(
    block_out_channels=[128, 256, 512, 512], down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4, layers_per_block=2, latent_channels=16, sample_size=1024,
    scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
)
# AutoencoderKLQwenImage's defaults are Qwen-Image's vae/config.json (the VAE Krea 2 ships).
QWENIMAGE_VAE_RELEASED: dict = {}
# Qwen/Qwen3-VL-4B-Instruct's config.json (Krea 2's text_encoder/ is its Qwen3VLModel), as modelscope/DiffSynth-Studio's
# diffsynth/models/krea2_text_encoder.py vendors it; transformers' Qwen3VLConfig defaults are another size.
QWEN3VL_4B_TEXT = dict(
    vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=262144,
    attention_bias=False, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 5000000, "mrope_section": [24, 20, 20],
                     "mrope_interleaved": True},
)
QWEN3VL_4B_VISION = dict(
    depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2560, patch_size=16,
    spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304, deepstack_visual_indexes=[5, 11, 17],
    hidden_act="gelu_pytorch_tanh", in_channels=3,
)
# google/t5-v1_1-xxl's config.json, as comfyanonymous/ComfyUI's comfy/t5_config_xxl.json vendors it (its gated GELU
# is transformers' feed_forward_proj="gated-gelu").
T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
              relative_attention_num_buckets=32, layer_norm_epsilon=1e-6, feed_forward_proj="gated-gelu",
              tie_word_embeddings=False)
# openai/clip-vit-large-patch14's text config, as comfyanonymous/ComfyUI's comfy/sd1_clip_config.json vendors it, with
# the released eos_token_id 2 (ComfyUI's copy has 49407; transformers' modeling_clip.py keeps a rule for the 2 of the
# configs from before its PR #24773, which FLUX's text_encoder/ is).
CLIP_L_TEXT = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, projection_dim=768, num_hidden_layers=12,
                   num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu", layer_norm_eps=1e-5,
                   bos_token_id=0, eos_token_id=2, pad_token_id=1)


def _shapes(state: dict) -> dict[str, list[int]]:
    return {k: list(v.shape) for k, v in sorted(state.items())}


def _saved_state(model) -> dict:
    """A transformers model's state dict as `save_pretrained` writes it: tied duplicates removed, names as saved."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    return revert_weight_conversion(model, remove_tied_weights_from_state_dict(model.state_dict(), model))


def _check_converter(state: dict, original: dict, convert_back) -> None:
    """diffusers' own single-file converter maps the `original` layout back to exactly `state`'s keys and shapes."""
    back = convert_back(dict(original))
    assert set(back) == set(state), sorted(set(back) ^ set(state))[:10]
    wrong = [k for k in state if tuple(back[k].shape) != tuple(state[k].shape)]
    assert not wrong, wrong[:10]


def _diffusers_config(model) -> dict:
    return json.loads(model.to_json_string())


def write_key_coverage(out: Path) -> None:
    """{component: {"config": the released config.json as the library writes it, "layouts": {layout: {key: shape}}}}
    for every full-size component, into out/key_coverage.json."""
    from diffusers import AutoencoderKL, AutoencoderKLQwenImage, FluxTransformer2DModel, Krea2Transformer2DModel
    from diffusers.loaders.single_file_utils import (convert_flux_transformer_checkpoint_to_diffusers,
                                                     convert_krea2_transformer_checkpoint_to_diffusers,
                                                     convert_ldm_vae_checkpoint, convert_wan_vae_to_diffusers)
    from transformers import (CLIPTextConfig, CLIPTextModel, Qwen3VLConfig, Qwen3VLForConditionalGeneration,
                              Qwen3VLModel, T5Config, T5EncoderModel)

    coverage = {}
    with torch.device("meta"):
        krea2 = Krea2Transformer2DModel(**KREA2_RELEASED)
        state = krea2.state_dict()
        # The original release names, without ComfyUI's optional `model.diffusion_model.` prefix.
        original = {krea2_diffusers_to_original_key(k): v.reshape(-1) if k.startswith("transformer_blocks.")
                    and k.endswith(".scale_shift_table") else v for k, v in state.items()}
        _check_converter(state, original, convert_krea2_transformer_checkpoint_to_diffusers)
        coverage["krea2_transformer"] = dict(config=_diffusers_config(krea2),
                                             layouts=dict(diffusers=_shapes(state), original=_shapes(original)))

        for name, released in (("flux1_dev_transformer", FLUX_DEV_RELEASED),
                               ("flux1_schnell_transformer", FLUX_SCHNELL_RELEASED)):
            flux = FluxTransformer2DModel(**released)
            state = flux.state_dict()
            original = {k.removeprefix("model.diffusion_model."): v
                        for k, v in flux_diffusers_to_original(dict(state)).items()}  # flux1-dev.safetensors' names
            _check_converter(state, original, convert_flux_transformer_checkpoint_to_diffusers)
            coverage[name] = dict(config=_diffusers_config(flux),
                                  layouts=dict(diffusers=_shapes(state), original=_shapes(original)))

        flux_vae = AutoencoderKL(**FLUX_VAE_RELEASED)
        state = flux_vae.state_dict()
        original = {flux_vae_diffusers_to_original_key(k): v[:, :, None, None] if ".attentions." in k and v.ndim == 2
                    else v for k, v in state.items()}  # ae.safetensors: the attention projections are 1x1 convs
        config = _diffusers_config(flux_vae)
        _check_converter(state, original, lambda c: convert_ldm_vae_checkpoint(c, config))
        coverage["flux_vae"] = dict(config=config, layouts=dict(diffusers=_shapes(state), original=_shapes(original)))

        qwen_vae = AutoencoderKLQwenImage(**QWENIMAGE_VAE_RELEASED)
        state = qwen_vae.state_dict()
        original = {qwenimage_vae_diffusers_to_original_key(k, qwen_vae.config.num_res_blocks): v
                    for k, v in state.items()}  # ComfyUI's qwen_image_vae.safetensors: Wan 2.1's names
        _check_converter(state, original, convert_wan_vae_to_diffusers)
        coverage["qwenimage_vae"] = dict(config=_diffusers_config(qwen_vae),
                                         layouts=dict(diffusers=_shapes(state), original=_shapes(original)))

        # Krea 2's text_encoder/ holds a Qwen3VLModel (vision tower included, no LM head); Qwen's own release is a
        # Qwen3VLForConditionalGeneration whose LM head is tied to the embedding, so not stored.
        qwen3vl_config = Qwen3VLConfig(text_config=QWEN3VL_4B_TEXT, vision_config=QWEN3VL_4B_VISION,
                                       tie_word_embeddings=True)
        krea2_text = _saved_state(Qwen3VLModel(qwen3vl_config))
        qwen_release = _saved_state(Qwen3VLForConditionalGeneration(qwen3vl_config))
        coverage["qwen3vl_text_encoder"] = dict(
            config=qwen3vl_config.to_dict(),
            layouts=dict(krea2_text_encoder=_shapes(krea2_text), qwen3vl_4b_instruct=_shapes(qwen_release)))

        t5_config = T5Config(**T5_XXL)
        coverage["t5_xxl_encoder"] = dict(config=t5_config.to_dict(),
                                          layouts=dict(transformers=_shapes(_saved_state(T5EncoderModel(t5_config)))))

        # transformers 5 saves CLIPTextModel without the `text_model.` prefix that FLUX's text_encoder/ (saved by
        # transformers 4) has.
        clip_config = CLIPTextConfig(**CLIP_L_TEXT)
        clip = _saved_state(CLIPTextModel(clip_config))
        coverage["clip_l_text"] = dict(config=clip_config.to_dict(), layouts=dict(
            flux1=_shapes({"text_model." + k: v for k, v in clip.items()}), transformers=_shapes(clip)))

    path = out / "key_coverage.json"
    path.write_text(_key_coverage_json(coverage))
    counts = ", ".join(f"{c}/{layout} {len(keys)}" for c, entry in coverage.items()
                       for layout, keys in entry["layouts"].items())
    print(f"wrote {path} ({path.stat().st_size // 1024} KiB): {counts}")


def _key_coverage_json(coverage: dict) -> str:
    """Indented JSON with one checkpoint key and its shape a line, so that a change of layout reads as a small diff."""
    lines = ["{"]
    for i, (component, entry) in enumerate(coverage.items()):
        lines.append(f'  "{component}": {{')
        lines.append(f'    "config": {json.dumps(entry["config"], sort_keys=True)},')
        lines.append('    "layouts": {')
        for j, (layout, keys) in enumerate(entry["layouts"].items()):
            lines.append(f'      "{layout}": {{')
            rows = [f"        {json.dumps(k)}: {json.dumps(shape)}" for k, shape in keys.items()]
            lines.append(",\n".join(rows))
            lines.append("      }" + ("," if j < len(entry["layouts"]) - 1 else ""))
        lines.append("    }")
        lines.append("  }" + ("," if i < len(coverage) - 1 else ""))
    lines.append("}")
    return "\n".join(lines) + "\n"
# The tokenizer parity prompts: what users type, and what breaks tokenizers (case, accents composed or not, emoji,
# CJK and right-to-left scripts, digits, contractions, odd whitespace, the special tokens' own text, the empty string,
# prompts past CLIP's 77 tokens and past T5's and Qwen's 512).
TOKENIZER_LONG_PROMPT = (
    "A sprawling fantasy city at dusk, seen from a hillside covered in wild lavender: copper domes and slender "
    "white towers, lanterns being lit along winding stone bridges, airships with patched canvas sails drifting "
    "between the spires, a crowded market street with striped awnings, merchants selling spices, glass bottles "
    "and woven carpets, children chasing a kite shaped like a dragon, a calm river reflecting the violet sky, "
    "distant snow-capped mountains, soft volumetric light, highly detailed matte painting, wide angle, 35mm film "
    "grain, muted teal and orange palette, trending on an art site"
)
TOKENIZER_VERY_LONG_PROMPT = " ".join(
    f"Panel {i}: a {color} {animal} wearing a {item} sits beside {i * 7 % 13} lanterns under a {sky} sky."
    for i, (color, animal, item, sky) in enumerate(
        zip(["red", "teal", "golden", "violet", "pale-green", "charcoal"] * 12,
            ["fox", "heron", "tortoise", "lynx", "octopus", "sparrow", "badger"] * 11,
            ["scarf", "tiny crown", "raincoat", "monocle", "backpack"] * 15,
            ["stormy", "cloudless", "star-filled", "hazy", "pink"] * 15)))
TOKENIZER_PROMPTS = [
    "a photo of a cat",
    "A Red Fox in the SNOW, photographed at DUSK.",
    "ALL CAPS PROMPT WITH SHOUTING AND NO PUNCTUATION",
    TOKENIZER_LONG_PROMPT,
    TOKENIZER_VERY_LONG_PROMPT,
    "café crème brûlée on a naïve façade, Ångström, Zoë, São Paulo, Kraków, Ærø",
    "cafe\u0301 and n\u0303 in decomposed form, A\u030angstro\u0308m",
    "a 🦊 and a 🐱 under the 🌙✨, a family 👩‍👩‍👧‍👦, flags 🇯🇵🇧🇷, skin tones 👍🏽",
    "一只在雪地里的红狐狸，摄影作品，高清",
    "富士山の夕焼け、水彩画。カタカナとひらがな",
    "서울의 밤거리, 네온 사인",
    "قطة تجلس على نافذة في المساء",
    "Красная лиса в снегу, масляная живопись",
    "बर्फ में लाल लोमड़ी, and Greek: αλεπού στο χιόνι",
    "Tokyo 東京 Москва موسكو mixed in one line",
    "3 cats, 12 dogs, 1,024 birds, 3.14159 pies, 2024-05-17, 10:30pm, 50% off, #1, 1st 2nd 3rd",
    "it's the dog's bone; we'll see, they're here, I'd've gone, don't, won't, Y'ALL'RE",
    "curly apostrophes: it’s the fox’s den, “quoted” and «guillemets» and „German“",
    "  leading and trailing spaces  ",
    "tabs\tbetween\twords and\t\tdouble tabs",
    "new\nlines\n\nand a CRLF\r\nbreak",
    "multiple     spaces    inside",
    "non-breaking\u00a0space, em\u2003space, zero\u200bwidth, ideographic\u3000space",
    "a cat <|endoftext|> a dog",
    "<|startoftext|>starts with the start token and ends with the end token<|endoftext|>",
    "upper-case specials <|ENDOFTEXT|> and <|StartOfText|>",
    "text with </s> inside, a <pad> and an <unk> and a sentinel <extra_id_0> <extra_id_99>",
    "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n",
    "vision tokens <|vision_start|><|image_pad|><|vision_end|> and <tool_call>call</tool_call>",
    "!!!??? ... --- (((nested))) [brackets] {braces} @#$%^&* ~`|\\/ <> ;:",
    "https://example.com/a_b?c=d&e=f#frag and snake_case, camelCase, kebab-case, file.name.png",
    "E = mc² ∑ ∫ √2 ≈ 1.414, 90° angle, € £ ¥ ₹ prices, ½ ¼ ¾",
    "ＦＵＬＬＷＩＤＴＨ ｌｅｔｔｅｒｓ １２３ and ﬁ ligature",
    "**bold** _italic_ `code` and a - b – c — d",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "a",
    "   ",
    "\n",
    "",
]


def write_tokenizers(out: Path) -> None:
    """transformers' ids and attention masks for the real tokenizers in ../shared/tokenizers/, called as the diffusers
    pipelines call them: FLUX.1's CLIPTokenizer (77, padded to max_length, truncated; also from vocab.json +
    merges.txt alone) and T5TokenizerFast (512 for dev, 256 for schnell; checked equal when converted from
    spiece.model alone), and Krea 2's AutoTokenizer (Qwen2Tokenizer) on the template-wrapped prompt, padded to
    512 + 34 - 5 with the 5 suffix tokens tokenized on their own."""
    import tempfile
    import types

    from diffusers import Krea2Pipeline
    from transformers import AutoTokenizer, CLIPTokenizer, T5TokenizerFast

    shared = Path(__file__).resolve().parents[2] / "shared" / "tokenizers"
    out.mkdir(parents=True, exist_ok=True)
    arrays = {}

    def record(name, encoded):
        arrays[f"{name}_ids"] = encoded.input_ids.numpy().astype(np.int32)
        arrays[f"{name}_mask"] = encoded.attention_mask.numpy().astype(bool)

    clip = CLIPTokenizer.from_pretrained(shared / "clip")
    assert clip.model_max_length == 77
    record("clip", clip(TOKENIZER_PROMPTS, padding="max_length", max_length=clip.model_max_length, truncation=True,
                        return_tensors="pt"))
    with tempfile.TemporaryDirectory() as files_only:  # vocab.json + merges.txt without the configs: class defaults
        for name in ("vocab.json", "merges.txt"):
            shutil.copy(shared / "clip" / name, files_only)
        record("clip_without_configs", CLIPTokenizer.from_pretrained(files_only)(
            TOKENIZER_PROMPTS, padding="max_length", max_length=77, truncation=True, return_tensors="pt"))

    t5 = T5TokenizerFast.from_pretrained(shared / "t5")
    with tempfile.TemporaryDirectory() as spm_only:  # the same tokenizer converted from spiece.model alone
        for name in ("spiece.model", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(shared / "t5" / name, spm_only)
        t5_spm = T5TokenizerFast.from_pretrained(spm_only)
        for length in (512, 256):
            kwargs = dict(padding="max_length", max_length=length, truncation=True, return_tensors="pt")
            record(f"t5_{length}", t5(TOKENIZER_PROMPTS, **kwargs))
            assert np.array_equal(t5_spm(TOKENIZER_PROMPTS, **kwargs).input_ids.numpy(), arrays[f"t5_{length}_ids"])

    qwen = AutoTokenizer.from_pretrained(shared / "qwen3")
    print(f"tokenizer classes: {type(clip).__name__}, {type(t5).__name__}, {type(qwen).__name__}")
    # Krea 2: the ids diffusers' pipeline gives its text encoder (prompt block padded to 512 + 34 - 5, then the 5
    # suffix tokens), caught by a stand-in text encoder so that no model is built.
    seen = {}

    def text_encoder(input_ids, attention_mask, **kwargs):
        seen.update(input_ids=input_ids, attention_mask=attention_mask)
        return types.SimpleNamespace(hidden_states=[torch.zeros(*input_ids.shape, 1)])

    pipe = Krea2Pipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=qwen, transformer=None,
                         text_encoder_select_layers=(0,))
    object.__setattr__(pipe, "text_encoder", text_encoder)
    pipe.get_text_hidden_states(TOKENIZER_PROMPTS, max_sequence_length=512, device="cpu")
    arrays.update(krea2_ids=seen["input_ids"].numpy().astype(np.int32),
                  krea2_mask=seen["attention_mask"].numpy().astype(bool))
    prefix, suffix = pipe.prompt_template_encode_prefix, pipe.prompt_template_encode_suffix
    arrays.update(qwen_prefix_ids=np.array(qwen(prefix).input_ids, np.int32),
                  qwen_suffix_ids=np.array(qwen(suffix).input_ids, np.int32))
    assert len(arrays["qwen_prefix_ids"]) == pipe.prompt_template_encode_start_idx == 34
    assert len(arrays["qwen_suffix_ids"]) == pipe.prompt_template_encode_num_suffix_tokens == 5
    np.savez_compressed(out / "reference.npz", **arrays)
    (out / "prompts.json").write_text(json.dumps(TOKENIZER_PROMPTS, ensure_ascii=False, indent=1) + "\n")
    untruncated = {name: max(len(ids) for ids in tok(TOKENIZER_PROMPTS).input_ids)
                   for name, tok in (("clip", clip), ("t5", t5), ("qwen", qwen))}
    print(f"wrote tokenizer fixtures to {out} ({len(TOKENIZER_PROMPTS)} prompts; longest untruncated: {untruncated})")


def write_flux_lora_export(out: Path) -> None:
    """Step 2 of the FLUX.1 export check: load the LoRA that mxdit exported (tests/fixtures/flux/lora/
    mxdit_diffusers.safetensors, written by `python scripts/export_lora_fixture.py`) into diffusers' FLUX pipeline and
    save the transformer output on the inputs of `write_flux_lora`'s reference.npz. Every layer of the file must get
    its adapter (diffusers' loader drops keys it cannot place with a warning only)."""
    from diffusers import FluxPipeline
    from safetensors import safe_open

    folder = out / "lora"
    reference = np.load(folder / "reference.npz")
    names = ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "img_ids", "txt_ids",
             "guidance")
    inputs = {k: torch.from_numpy(reference[k]) for k in names}
    pipe = FluxPipeline.from_pretrained(out / "tiny_pipeline", dtype=torch.float32)
    path = folder / "mxdit_diffusers.safetensors"
    pipe.load_lora_weights(path, adapter_name="mxdit")
    with safe_open(str(path), "pt") as f:
        in_file = {k.removeprefix("transformer.").removesuffix(".lora_A.weight") for k in f.keys() if ".lora_A." in k}
    loaded = {n for n, m in pipe.transformer.named_modules() if "mxdit" in getattr(m, "lora_A", {})}
    assert loaded == in_file, sorted(loaded ^ in_file)
    with torch.no_grad():
        output = pipe.transformer(**inputs, return_dict=False)[0].numpy()
    np.savez(folder / "export_reference.npz", output_diffusers=output)
    print(f"wrote diffusers' output with mxdit's exported FLUX LoRA to {folder / 'export_reference.npz'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=FIXTURES)
    parser.add_argument("--only", choices=sorted(GROUPS), action="append",
                        help=f"write only these fixture groups (repeatable; default: all but {', '.join(EXPORT_GROUPS)})")
    args = parser.parse_args()
    torch.manual_seed(0)
    for name in args.only or [g for g in GROUPS if g not in EXPORT_GROUPS]:
        write, folder = GROUPS[name]
        write(args.out / folder)


# name -> (writer, folder under --out), in the order a full run writes them. lora reads krea2's tiny_pipeline, and
# flux_schnell and flux_lora flux's; the export groups read mxdit's exported files (see write_lora_export), so they
# run only when asked.
EXPORT_GROUPS = ("lora_export", "flux_lora_export")
GROUPS = {
    "krea2_transformer": (write_krea2_transformer, "krea2"),
    "scheduler": (write_scheduler, "scheduler"),
    "vae": (write_vaes, "vae"),
    "krea2_pipeline": (write_krea2_pipeline, "krea2"),
    "flux_transformer": (write_flux_transformer, "flux"),
    "flux_pipeline": (write_flux_pipeline, "flux"),
    "lora": (write_lora, "krea2"),
    "lora_export": (write_lora_export, "krea2"),
    "flux_schnell": (write_flux_schnell, "flux"),
    "flux_lora": (write_flux_lora, "flux"),
    "key_coverage": (write_key_coverage, "."),
    "tokenizers": (write_tokenizers, "tokenizers"),
    "flux_lora_export": (write_flux_lora_export, "flux"),
}


if __name__ == "__main__":
    main()
