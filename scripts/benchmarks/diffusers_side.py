"""The PyTorch side of each comparison: diffusers' models and pipeline, torch's matmuls and SDPA, with random
weights of the same shapes as ours. Each runs in a subprocess of its own (the parent benchmark starts it), so the
two frameworks never hold GPU memory at the same time; timed by CUDA events after warm-up."""

from __future__ import annotations

import dataclasses
import statistics
import time

from .inputs import (QWEN3VL_4B_TEXT, flux_flops, flux_inputs, krea2_config, krea2_flops, krea2_inputs,
                     lora_step_config)
from .rows import emit, error_text
from .timing import torch_timed

# diffusers' FLUX.1 VAE: AutoencoderKL's defaults but for these
FLUX_VAE = dict(block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
                up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=2, latent_channels=16, use_quant_conv=False,
                use_post_quant_conv=False, sample_size=1024)


def torch_row(name: str, fn, args, flops: float, warmup: int = 3) -> dict:
    """A row of `fn()`'s median seconds a call (`torch_timed` over --repeats runs of --iters calls), TFLOP/s and
    the peak memory torch allocated."""
    import torch

    row = {"name": name}
    try:
        row.update(torch_timed(fn, args.iters, args.repeats, getattr(args, "settle_s", 0.0), warmup=warmup))
        row["tflops"] = flops / row["s_per_step"] / 1e12
    except Exception as e:
        row["error"] = error_text(e)
    row["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
    return emit(row)


def _krea2_transformer(cfg, device: str = "cuda"):
    """diffusers' Krea2Transformer2DModel of random bf16 weights on the GPU, its norms in float32 as
    `_keep_in_fp32_modules` leaves them after from_pretrained."""
    import torch
    from diffusers import Krea2Transformer2DModel
    from diffusers.models.transformers.transformer_krea2 import Krea2RMSNorm

    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = Krea2Transformer2DModel(**dataclasses.asdict(cfg)).eval()
    torch.set_default_dtype(torch.float32)
    for module in model.modules():
        if isinstance(module, Krea2RMSNorm):
            module.float()
    return model


def _krea2_step_inputs(cfg, args, device: str = "cuda") -> dict:
    """diffusers' Krea2Transformer2DModel's keyword arguments for `krea2_inputs` of --height, --width and --text-len."""
    import torch

    hidden, text, timestep, position_ids, mask = krea2_inputs(cfg, args.height, args.width, args.text_len,
                                                              args.valid_text)
    return dict(hidden_states=torch.from_numpy(hidden).to(device).bfloat16(),
                encoder_hidden_states=torch.from_numpy(text).to(device).bfloat16(),
                timestep=torch.from_numpy(timestep).to(device).bfloat16(),
                position_ids=torch.from_numpy(position_ids).to(device),
                encoder_attention_mask=torch.from_numpy(mask).to(device), return_dict=False)


def diffusers_krea2_step(args) -> list[dict]:
    """diffusers' Krea 2 step eager (and under torch.compile with --torch-compile)."""
    import torch

    cfg = krea2_config(args)
    model = _krea2_transformer(cfg)
    inputs = _krea2_step_inputs(cfg, args)
    flops = krea2_flops(cfg, inputs["hidden_states"].shape[1], inputs["encoder_hidden_states"].shape[1])
    rows = [torch_row("diffusers eager bf16, masked", lambda: model(**inputs), args, flops)]
    if args.torch_compile:
        compiled = torch.compile(model)
        rows.append(torch_row("diffusers torch.compile bf16, masked", lambda: compiled(**inputs), args, flops))
    return rows


def _flux_transformer_and_inputs(cfg, args, device: str = "cuda"):
    """diffusers' FluxTransformer2DModel of random bf16 weights on `device` (in eval mode), and its keyword arguments
    for `flux_inputs` of --height, --width and --text-len, timestep 0.5 and guidance 3.5."""
    import torch
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = FluxTransformer2DModel(**dataclasses.asdict(cfg)).eval()
    torch.set_default_dtype(torch.float32)
    hidden, text, pooled, img_ids, txt_ids = flux_inputs(cfg, args.height, args.width, args.text_len)

    def to(a, dtype=torch.bfloat16):
        return torch.from_numpy(a).to(device).to(dtype)

    inputs = dict(hidden_states=to(hidden), encoder_hidden_states=to(text), pooled_projections=to(pooled),
                  timestep=torch.full((1,), 0.5, device=device, dtype=torch.bfloat16),
                  img_ids=to(img_ids, torch.float32), txt_ids=to(txt_ids, torch.float32),
                  guidance=torch.full((1,), 3.5, device=device), return_dict=False)
    return model, inputs


def diffusers_flux_step(args) -> list[dict]:
    """diffusers' FLUX.1-dev step, eager."""
    from mxdit.model.flux import FluxConfig

    cfg = FluxConfig()
    model, inputs = _flux_transformer_and_inputs(cfg, args)
    flops = flux_flops(cfg, inputs["hidden_states"].shape[1], inputs["encoder_hidden_states"].shape[1])
    return [torch_row("diffusers FLUX.1-dev eager bf16", lambda: model(**inputs), args, flops, warmup=2)]


def diffusers_vae_decode(args) -> list[dict]:
    """diffusers' VAE decodes (Qwen-Image's, FLUX.1's) of random bf16 weights at each of --sizes."""
    import torch
    from diffusers import AutoencoderKL, AutoencoderKLQwenImage

    rows = []
    for name in args.vaes:
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("cuda"):
            vae = (AutoencoderKLQwenImage() if name == "qwen" else AutoencoderKL(**FLUX_VAE)).eval()
        torch.set_default_dtype(torch.float32)
        for size in args.sizes:
            row = {"name": f"diffusers {name} VAE decode bf16, {size}x{size}"}
            try:
                shape = (1, 16, 1, size // 8, size // 8) if name == "qwen" else (1, 16, size // 8, size // 8)
                latents = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
                torch.cuda.reset_peak_memory_stats()
                row.update(_decode_times(vae, latents, args.repeats))
                row["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
            except Exception as e:
                row["error"] = error_text(e)
            rows.append(emit(row))
        del vae
        torch.cuda.empty_cache()
    return rows


def _decode_times(vae, latents, repeats: int) -> dict:
    """The first decode's seconds (host clock) and the median of `repeats` more (CUDA events)."""
    import torch

    with torch.inference_mode():
        t0 = time.perf_counter()
        vae.decode(latents)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            vae.decode(latents)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    return {"compile_s": compile_s, "s": statistics.median(times)}


def _krea2_pipeline(args):
    """diffusers' Krea2Pipeline of random full-size bf16 weights and the demo tokenizer, Turbo."""
    import tempfile

    import torch
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, Krea2Pipeline
    from transformers import PreTrainedTokenizerFast, Qwen3VLConfig, Qwen3VLModel

    from mxdit.model.tokenizer import save_demo_tokenizer

    transformer = _krea2_transformer(krea2_config(args))
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        vae = AutoencoderKLQwenImage().eval()
        rope = {"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [24, 20, 20],
                "mrope_interleaved": True}
        config = Qwen3VLConfig(text_config=dict(QWEN3VL_4B_TEXT, rope_parameters=rope),
                               vision_config=dict(out_hidden_size=2560))
        text_encoder = Qwen3VLModel(config).eval()
    torch.set_default_dtype(torch.float32)
    with tempfile.TemporaryDirectory(prefix="mxdit-bench-tokenizer-") as folder:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(save_demo_tokenizer(folder))
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=6400)
    pipe = Krea2Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                         transformer=transformer, is_distilled=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _flux_dev_pipeline(args):
    """diffusers' FluxPipeline of random full-size bf16 weights (FLUX.1-dev: the transformer with its guidance
    embedding, CLIP ViT-L/14's text tower, T5-XXL's encoder, the VAE, dev's scheduler) and the released CLIP and T5
    tokenizers from --tokenizers. With --num-layers, that many blocks of each kind and T5 layers (a smoke run)."""
    from pathlib import Path

    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel, T5TokenizerFast

    # diffusers' defaults are FLUX.1's sizes; dev adds the guidance embedding
    blocks = dict(num_layers=args.num_layers, num_single_layers=args.num_layers) if args.num_layers else {}
    t5_layers = args.num_layers or 24
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        transformer = FluxTransformer2DModel(guidance_embeds=True, **blocks).eval()
        clip = CLIPTextModel(CLIPTextConfig(hidden_size=768, intermediate_size=3072, num_attention_heads=12,
                                            num_hidden_layers=12, projection_dim=768, hidden_act="quick_gelu",
                                            bos_token_id=0, eos_token_id=2, pad_token_id=1)).eval()
        t5 = T5EncoderModel(T5Config(d_model=4096, d_kv=64, d_ff=10240, num_layers=t5_layers, num_heads=64,
                                     feed_forward_proj="gated-gelu", tie_word_embeddings=False)).eval()
        vae = AutoencoderKL(**FLUX_VAE, scaling_factor=0.3611, shift_factor=0.1159).eval()
    torch.set_default_dtype(torch.float32)
    tokenizers = Path(args.tokenizers)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)
    pipe = FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=clip,
                        tokenizer=CLIPTokenizer.from_pretrained(tokenizers / "clip"), text_encoder_2=t5,
                        tokenizer_2=T5TokenizerFast.from_pretrained(tokenizers / "t5"), transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def diffusers_krea2_pipeline(args) -> list[dict]:
    """diffusers' Krea 2 Turbo pipeline, a cold run and --repeats warm ones: the text encoding alone, the pipeline
    to latents, and to images (the parts' times are their differences)."""
    import torch

    t0 = time.perf_counter()
    pipe = _krea2_pipeline(args)
    emit({"diffusers_pipeline_init_s": time.perf_counter() - t0})
    prompt = args.prompt

    def timed(fn):
        torch.cuda.synchronize()
        t = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t, result

    rows = []
    with torch.inference_mode():
        for run in range(1 + args.repeats):
            text_s, _ = timed(lambda: pipe.encode_prompt(prompt, device="cuda"))
            latent_s, _ = timed(lambda: pipe(prompt, height=args.height, width=args.width,
                                             num_inference_steps=args.steps, guidance_scale=0.0,
                                             output_type="latent").images)
            total_s, _ = timed(lambda: pipe(prompt, height=args.height, width=args.width,
                                            num_inference_steps=args.steps, guidance_scale=0.0))
            rows.append(emit({"name": f"diffusers pipeline {'cold' if run == 0 else f'warm run {run}'}",
                              "text encode": text_s, "denoise": latent_s - text_s, "decode": total_s - latent_s,
                              "total": total_s}))
    rows.append(emit({"name": "diffusers peak", "peak_gb": torch.cuda.max_memory_allocated() / 1e9}))
    return rows


def torch_gemm(args) -> list[dict]:
    """torch's bf16 matmul and `_scaled_mm` (FP8, row-wise and tensor-wise scales) on each of --shapes."""
    import torch

    rows = []
    for shape in args.shapes:
        m, k, n = map(int, shape.split("x"))
        flops = 2.0 * m * k * n
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
        sx = x.abs().amax(dim=1, keepdim=True).float() / 448
        sw = w.abs().amax(dim=1, keepdim=True).float() / 448
        x8 = (x / sx).to(torch.float8_e4m3fn)
        w8 = (w / sw).to(torch.float8_e4m3fn)
        one = torch.ones((), device="cuda")
        variants = {
            "torch bf16 matmul": lambda: x @ w.t(),
            "torch _scaled_mm fp8 rowwise": lambda: torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw.t(),
                                                                     out_dtype=torch.bfloat16),
            "torch _scaled_mm fp8 tensorwise": lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one,
                                                                        out_dtype=torch.bfloat16),
        }
        for name, fn in variants.items():
            row = torch_row(name, fn, args, flops)
            row.update(shape=shape, s=row.pop("s_per_step", None))
            rows.append(row)
    return rows


def torch_attention(args) -> list[dict]:
    """torch's SDPA (bf16, the cuDNN and flash backends) at `attention-jax`'s shapes. GQA through `enable_gqa`;
    the mask as a boolean key mask (torch's cuDNN backend takes it, flash does not)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from .attention import HEAD_DIM, HEADS, padded_length

    rows = []
    s, h, d = args.seq, HEADS, HEAD_DIM
    flops = 4.0 * s * s * d * h
    for kv_heads in args.kv_heads:
        q = torch.randn(1, h, s, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, kv_heads, s, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, kv_heads, s, d, device="cuda", dtype=torch.bfloat16)
        for masked in (False, True):
            mask = (torch.arange(s, device="cuda") < padded_length(s))[None, None, None, :] if masked else None
            for backend, label in ((SDPBackend.CUDNN_ATTENTION, "cuDNN"), (SDPBackend.FLASH_ATTENTION, "flash")):
                if masked and label == "flash":  # flash takes no mask
                    continue

                def fn(backend=backend, mask=mask, kv_heads=kv_heads):
                    with sdpa_kernel(backend):
                        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                                enable_gqa=kv_heads != h)

                name = f"torch SDPA {label} bf16, GQA {h}/{kv_heads}" + (", masked" if masked else "")
                rows.append(torch_row(name, fn, args, flops))
    return rows


def diffusers_lora_step(args) -> list[dict]:
    """diffusers' own LoRA recipe for Krea 2 or FLUX.1-dev (`args.family`), one training step as its
    train_dreambooth_lora scripts run it: PEFT adapters (`add_adapter`) of --rank on our default targets (attention
    and MLP of every block), float32 adapter weights over the bf16 model under bf16 autocast, gradient checkpointing
    with --remat other than none, the flow-matching loss, clipping at 1 and AdamW. Seconds a step by CUDA events
    after warm-up (wall time on a CPU); peak memory torch allocated. The device memory capped to --memory-cap-gb
    where given. Attention is SDPA as torch picks it, without its cuDNN kernel for FLUX.1-dev (the row's name says
    so)."""
    import torch
    from peft import LoraConfig

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.memory_cap_gb and device == "cuda":
        torch.cuda.set_per_process_memory_fraction(
            args.memory_cap_gb * 1e9 / torch.cuda.get_device_properties(0).total_memory)
    model, inputs, targets = (_flux_lora_model if args.family == "flux" else _krea2_lora_model)(args, device)
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=args.rank, lora_alpha=args.rank, init_lora_weights="gaussian",
                                 target_modules="|".join(f"(?:{p})" for p in targets)))
    if args.remat != "none":
        model.enable_gradient_checkpointing()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:  # diffusers' cast_training_params: float32 trainable weights under bf16 mixed precision
        p.data = p.data.float()
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    latents = inputs["hidden_states"].float()  # the step's latents as the clean ones, noised at sigma 0.5
    noise = torch.randn_like(latents)
    sigma = 0.5
    inputs["hidden_states"] = ((1 - sigma) * latents + sigma * noise).bfloat16()
    inputs["timestep"] = torch.full((1,), sigma, device=device, dtype=torch.bfloat16)
    target = (noise - latents).float()
    losses = []

    def step():
        with torch.autocast(device, dtype=torch.bfloat16):
            prediction = model(**inputs)[0]
        loss = torch.nn.functional.mse_loss(prediction.float(), target)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses[:] = [loss]

    title = {"krea2": "Krea 2", "flux": "FLUX.1-dev"}[args.family]
    cap = f", capped at {args.memory_cap_gb:g} GB" if args.memory_cap_gb else ""
    row = {"name": f"diffusers+PEFT {'tiny ' if args.tiny else ''}{title} LoRA step bf16, rank {args.rank}, "
                   f"{len(params) // 2} adapters, remat {args.remat}{cap}",
           "lora_params": sum(p.numel() for p in params)}
    if args.family == "flux":
        # torch's cuDNN attention fails in FLUX.1-dev's backward at 1024x1024 on an H100 (pytorch/pytorch#122695),
        # with an error or with an illegal memory access that leaves the CUDA context unusable, so it cannot be
        # retried in the process; its users turn it off, which leaves SDPA its flash and memory-efficient kernels.
        torch.backends.cuda.enable_cudnn_sdp(False)
        row["name"] += ", cuDNN attention off"
    try:
        row.update(torch_timed(step, args.iters, args.repeats, warmup=2, training=True))
        row["loss"] = float(losses[0].detach())
    except Exception as e:  # an out-of-memory variant is a result too
        row["error"] = error_text(e)
    row["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else 0.0
    return [emit(row)]


def _krea2_lora_model(args, device: str):
    """diffusers' Krea 2 transformer (full size, --num-layers blocks, or --tiny) on `device`, its step's inputs and
    our LoRA targets."""
    from mxdit.training.lora import KREA2_ATTENTION_AND_MLP

    cfg = lora_step_config(args)
    return _krea2_transformer(cfg, device), _krea2_step_inputs(cfg, args, device), KREA2_ATTENTION_AND_MLP


def _flux_lora_model(args, device: str):
    """`_krea2_lora_model` for FLUX.1-dev."""
    from mxdit.training.lora import FLUX_ATTENTION_AND_MLP

    return (*_flux_transformer_and_inputs(lora_step_config(args), args, device), FLUX_ATTENTION_AND_MLP)
