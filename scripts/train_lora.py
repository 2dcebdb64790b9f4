"""Train a LoRA on Krea 2 (train on Base, run on Turbo) or FLUX.1 from a folder of captioned images.

    python scripts/train_lora.py --model /models/Krea-2-Base --data photos/ --output runs/style --steps 2000
    python scripts/train_lora.py --model /models/FLUX.1-dev --data photos/ --output runs/flux-style --steps 2000
    python scripts/train_lora.py --model /models/Krea-2-Base --data photos/ --output runs/style --resume
    python scripts/train_lora.py --demo --data photos/ --output /tmp/run --resolution 64 --steps 20   # CPU, RANDOM model

The data folder holds images (.png, .jpg, .jpeg, .webp, .bmp) with a caption each: a `.txt` beside the image, or a
`metadata.jsonl` of {"file_name": ..., "text": ...} lines. The output folder gets `checkpoints/` (the last --keep),
`train_log.jsonl` (one line of metrics per step), `validation/` PNGs, `cache/` (latents and text embeddings) and, at
the end, `lora.safetensors` (diffusers key names). An output folder that already holds a run is never overwritten:
continue it with --resume (the settings must match) or pick another folder.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from mxdit.cli import DTYPES, OneLineErrorParser, add_device_arguments, check_device_arguments, mesh_from_arguments


def build_parser() -> OneLineErrorParser:
    from mxdit.training.lora import TARGET_PRESETS
    from mxdit.training.train import REMAT_POLICIES, TIMESTEP_SAMPLING

    p = OneLineErrorParser(prog="train_lora.py",
                           description="Train a LoRA on Krea 2 or FLUX.1 from a folder of captioned images.")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", type=Path,
                        help="a diffusers-layout Krea 2 folder (Base, the non-distilled one) or FLUX.1 folder")
    source.add_argument("--demo", action="store_true", help="the built-in tiny model with RANDOM weights (CPU tests)")
    p.add_argument("--data", type=Path, required=True, help="folder of images with captions")
    p.add_argument("--output", type=Path, required=True, help="run folder: checkpoints, log, validation, LoRA")
    p.add_argument("--resume", action="store_true", help="continue the run in --output from its latest checkpoint")
    p.add_argument("--cache-dir", type=Path, default=None, help="latent/text cache (default: OUTPUT/cache)")
    p.add_argument("--validation-model", type=Path, default=None,
                   help="validate on this folder of the same family (e.g. Krea 2 Turbo) with the adapters copied "
                        "onto it")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="base weights and compute (default bf16; demo fp32)")
    p.add_argument("--quantize-base", default=None, metavar="FORMAT",
                   help="keep the frozen block matrices in this weight format (e.g. fp8_e4m3, mxfp8_e4m3, int8_rot), "
                        "multiplied by the GEMM kernels as inference runs them")
    lora = p.add_argument_group("LoRA")
    lora.add_argument("--rank", type=int, default=32, help="the adapters' rank (default 32)")
    lora.add_argument("--alpha", type=float, default=None, help="default: the rank (scale 1)")
    lora.add_argument("--dropout", type=float, default=0.0, help="dropout on the adapters' input while training")
    lora.add_argument("--targets", default="attention+mlp",
                      help="a preset (Krea 2: " + ", ".join(TARGET_PRESETS["krea2"]) + "; FLUX.1: "
                           + ", ".join(TARGET_PRESETS["flux"]) + ") or comma-separated regular expressions matched "
                           "in full against module paths such as transformer_blocks.3.attn.to_q")
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, default=1000, help="optimizer steps (default 1000)")
    t.add_argument("--batch-size", type=int, default=1, help="micro-batch")
    t.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    t.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (AdamW; default 3e-4)")
    t.add_argument("--warmup-steps", type=int, default=0, help="steps of linear warm-up from 0 to --lr")
    t.add_argument("--final-lr-ratio", type=float, default=0.1, help="cosine decay ends at lr times this")
    t.add_argument("--weight-decay", type=float, default=1e-4, help="AdamW's decoupled weight decay")
    t.add_argument("--max-grad-norm", type=float, default=1.0, help="gradients clipped to this global norm")
    t.add_argument("--timestep-sampling", choices=TIMESTEP_SAMPLING, default="logit_normal",
                   help="noise levels drawn as sigmoid(N(--logit-mean, --logit-std)), or uniform then time-shifted")
    t.add_argument("--logit-mean", type=float, default=0.0, help="logit_normal: the normal's mean")
    t.add_argument("--logit-std", type=float, default=1.0, help="logit_normal: the normal's standard deviation")
    t.add_argument("--shift-mu", type=float, default=None, help="'shifted': fixed mu (default: from the image size)")
    t.add_argument("--guidance-scale", type=float, default=3.5, help="FLUX.1-dev: the embedded guidance in training")
    t.add_argument("--resolution", type=int, default=None, help="bucket side in pixels (default 1024; demo 64)")
    t.add_argument("--bucket-multiple", type=int, default=None, help="bucket sides round to this (default 64; demo 16)")
    t.add_argument("--aspects", default=None,
                   help="bucket aspect ratios (width/height), comma-separated (default 1/2, 9/16, ..., 1, ..., 2)")
    t.add_argument("--max-sequence-length", type=int, default=512, help="text tokens per caption (default 512)")
    t.add_argument("--remat", choices=list(REMAT_POLICIES), default="none", help="rematerialization of each block")
    t.add_argument("--seed", type=int, default=0, help="adapters' initialization, noise, timesteps and data order")
    t.add_argument("--save-every", type=int, default=500, help="a checkpoint every this many steps (and at the end)")
    t.add_argument("--keep", type=int, default=3, help="checkpoints kept")
    t.add_argument("--validate-every", type=int, default=0,
                   help="validation images every this many steps (0: none; needs --validation-prompt)")
    t.add_argument("--validation-prompt", action="append", default=[], help="repeat for several")
    t.add_argument("--validation-steps", type=int, default=None,
                   help="denoising steps of a validation image (default: the model's, 28 Base, 8 Turbo)")
    t.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_device_arguments(t, "devices by named axes, e.g. data=2,fsdp=4 (data parallel x FSDP); default one device")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    from mxdit.training.lora import TARGET_PRESETS

    p = build_parser()
    args = p.parse_args(argv)
    check_device_arguments(p, args)

    if args.model is not None and not args.model.is_dir():
        p.error(f"--model {args.model}: no such folder")
    if args.validation_model is not None and not args.validation_model.is_dir():
        p.error(f"--validation-model {args.validation_model}: no such folder")
    if not args.data.is_dir():
        p.error(f"--data {args.data}: no such folder")
    if args.output.exists() and not args.output.is_dir():
        p.error(f"--output {args.output}: exists and is not a folder")
    args.dtype = args.dtype or ("fp32" if args.demo else "bf16")
    args.resolution = args.resolution or (64 if args.demo else 1024)
    args.bucket_multiple = args.bucket_multiple or (16 if args.demo else 64)
    if args.aspects is not None:
        try:
            args.aspects = tuple(float(a) for a in args.aspects.split(","))
        except ValueError:
            p.error(f"--aspects {args.aspects}: expected comma-separated numbers such as 0.75,1,1.333")
        if not args.aspects or min(args.aspects) <= 0:
            p.error(f"--aspects {args.aspects}: ratios must be positive")
    presets = {name for family in TARGET_PRESETS.values() for name in family}
    if args.targets not in presets:  # else resolved for the model's family once it is loaded
        args.targets = tuple(t.strip() for t in args.targets.split(",") if t.strip())
        if not args.targets:
            p.error("--targets: give a preset or at least one pattern")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax.numpy as jnp

    from mxdit.model.inference import InferenceOptions, build_pipeline
    from mxdit.model.loading import CheckpointError, place_parameters
    from mxdit.model.lora import LoraConfig
    from mxdit.model.pipelines import load_pipeline
    from mxdit.training.data import DataError
    from mxdit.training.lora import model_family, quantize_base, target_preset
    from mxdit.training.train import TrainConfig, TrainError, check_inputs, train

    try:
        config = TrainConfig(
            steps=args.steps, batch_size=args.batch_size, grad_accum=args.grad_accum, learning_rate=args.lr,
            warmup_steps=args.warmup_steps, final_lr_ratio=args.final_lr_ratio, weight_decay=args.weight_decay,
            max_grad_norm=args.max_grad_norm, timestep_sampling=args.timestep_sampling, logit_mean=args.logit_mean,
            logit_std=args.logit_std, shift_mu=args.shift_mu, guidance_scale=args.guidance_scale,
            resolution=args.resolution,
            bucket_multiple=args.bucket_multiple, **({"aspects": args.aspects} if args.aspects else {}),
            max_sequence_length=args.max_sequence_length, remat=args.remat,
            seed=args.seed, save_every=args.save_every, keep_checkpoints=args.keep,
            validate_every=args.validate_every, validation_prompts=tuple(args.validation_prompt),
            validation_steps=args.validation_steps)
        check_inputs(args.data, args.output, config, resume=args.resume)  # before any model is built or loaded
        mesh = mesh_from_arguments(args)
        dtype = getattr(jnp, DTYPES[args.dtype])
        if args.demo:
            from mxdit.model.pipeline_krea2 import demo_pipeline

            with tempfile.TemporaryDirectory(prefix="mxdit-demo-tokenizer-") as folder:  # read, then removed
                pipe = demo_pipeline(Path(folder), seed=0, dtype=dtype, distilled=False)
            print("mxdit demo: tiny Krea 2-shaped model with RANDOM weights -- training machinery, not a real LoRA.")
            tag = "demo"
        else:
            places = []
            if args.quantize_base:  # quantized as read: the device never holds the base in bf16
                from mxdit.quant.model import any_family_rules, quantize_on_load

                places.append(quantize_on_load(any_family_rules(args.quantize_base)))
            with place_parameters(*places):
                pipe = load_pipeline(args.model, dtype)
            tag = str(args.model.resolve())
        targets = target_preset(pipe.transformer, args.targets) if isinstance(args.targets, str) else args.targets
        lora_config = LoraConfig(rank=args.rank, alpha=args.alpha if args.alpha is not None else float(args.rank),
                                 dropout=args.dropout, targets=targets)
        validation_pipe = None
        if args.validation_model is not None:  # the adapters are copied onto its unstacked projections
            validation_pipe = build_pipeline(args.validation_model, InferenceOptions(dtype=DTYPES[args.dtype],
                                                                                     stack=False))
            if type(validation_pipe) is not type(pipe):
                raise TrainError(f"--validation-model {args.validation_model}: a {type(validation_pipe).__name__}, "
                                 f"but the model trained is a {type(pipe).__name__}")
        if args.quantize_base:  # the demo's base (a folder's was quantized as read; quantized weights are kept)
            from mxdit.quant.model import flux_rules, krea2_rules

            rules = {"krea2": krea2_rules, "flux": flux_rules}[model_family(pipe.transformer)]
            quantize_base(pipe.transformer, rules(args.quantize_base))
        result = train(pipe, args.data, args.output, config, lora_config, resume=args.resume, model_tag=tag,
                       cache_dir=args.cache_dir, validation_pipe=validation_pipe, progress=not args.no_progress,
                       mesh=mesh)
    except (CheckpointError, DataError, TrainError, ValueError) as e:
        print(f"train_lora.py: error: {e}", file=sys.stderr)
        return 2
    if result.losses:
        print(f"steps {result.losses[0][0]}..{result.step}: loss {result.losses[0][1]:.4f} -> {result.losses[-1][1]:.4f}")
    print(f"wrote {result.output_dir / 'lora.safetensors'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
