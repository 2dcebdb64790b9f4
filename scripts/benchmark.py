"""Benchmarks on the GPU (not tests): ours beside diffusers in the same run, each framework in its own process.

    python scripts/benchmark.py krea2-step                      # full size, 1024x1024, JAX variants + diffusers
    python scripts/benchmark.py krea2-step --num-layers 2 --no-diffusers   # a quick smoke run
    python scripts/benchmark.py krea2-energy                    # energy a kernel of the fp8 step at the power cap
    python scripts/benchmark.py vae-decode                      # Qwen-Image and FLUX VAE decode, 1024 and 2048
    python scripts/benchmark.py krea2-pipeline                  # Turbo 8 steps end to end, warm and cold
    python scripts/benchmark.py first-image                     # process start to PNG, ours twice and diffusers
    python scripts/benchmark.py throughput --batches 1 4 16     # warm images/s per batch size, ours and diffusers
    python scripts/benchmark.py flux-step                       # FLUX.1-dev, one step at 1024x1024
    python scripts/benchmark.py minimax-h3-step --precisions bf16 fp8 int8_rot   # a video denoiser evaluation + gates
    python scripts/benchmark.py gemm                            # block-scaled GEMM kernels vs XLA and torch
    python scripts/benchmark.py krea2-sharded-step --meshes seq=8 cfg=2,seq=4 --guidance   # all GPUs, per mesh
    python scripts/benchmark.py krea2-lora-step --remat none block   # LoRA training step, rank 32, 1024x1024
    python scripts/benchmark.py krea2-lora-step --bases bf16 fp8_e4m3 --memory-caps none 24   # + diffusers+PEFT
    python scripts/benchmark.py krea2-lora-step --tiny          # the same on a tiny model (runs on a CPU)

Weights are random (bf16); the shapes are the released model's: 4096 image tokens (1024x1024), 512 text tokens of
which 120 are real (the padding mask). JAX is timed with many steps inside one jitted program (`lax.fori_loop`),
diffusers with CUDA events after warm-up; both report the median over repeats. Diffusers runs in a subprocess so that
the two frameworks never hold GPU memory at the same time. Results print as a table and, with --json, to a file.
A command's `-jax`, `-diffusers` and `-torch` variants are the halves the command runs in subprocesses.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # the benchmarks package beside this file
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from mxdit.ops.names import AttentionKernel, Precision  # noqa: E402 (plain names, no jax)

from benchmarks import (attention, diffusers_side, first_image, flux, gemm, krea2, lora, minimax_h3,  # noqa: E402
                        offload, pipeline, sharding, throughput, vae)

COMMANDS = {
    "krea2-step": krea2.krea2_step, "krea2-step-diffusers": diffusers_side.diffusers_krea2_step,
    "krea2-profile": krea2.krea2_profile, "krea2-energy": krea2.krea2_energy,
    "krea2-offload": offload.krea2_offload, "krea2-offload-jax": offload.jax_krea2_offload,
    "krea2-pipeline": pipeline.krea2_pipeline, "krea2-pipeline-diffusers": diffusers_side.diffusers_krea2_pipeline,
    "krea2-pipeline-jax": pipeline.jax_krea2_pipeline,
    "first-image": first_image.first_image, "first-image-write": first_image.write_model,
    "first-image-read": first_image.jax_read, "first-image-diffusers": first_image.diffusers_first_image,
    "throughput": throughput.throughput, "throughput-jax": throughput.jax_throughput,
    "throughput-diffusers": throughput.diffusers_throughput,
    "krea2-sharded-step": sharding.krea2_sharded_step,
    "krea2-lora-step": lora.lora_step, "krea2-lora-step-jax": lora.jax_lora_step,
    "krea2-lora-step-diffusers": diffusers_side.diffusers_lora_step,
    "flux-lora-step-diffusers": diffusers_side.diffusers_lora_step,
    "flux-lora-step": lora.lora_step, "flux-lora-step-jax": lora.jax_lora_step,
    "flux-step": flux.flux_step, "flux-step-diffusers": diffusers_side.diffusers_flux_step,
    "flux-step-jax": flux.jax_flux_step,
    "minimax-h3-step": minimax_h3.h3_step, "minimax-h3-step-jax": minimax_h3.jax_h3_step,
    "minimax-h3-step-diffusers": minimax_h3.diffusers_h3_step,
    "vae-decode": vae.vae_decode, "vae-decode-diffusers": diffusers_side.diffusers_vae_decode,
    "vae-decode-jax": vae.jax_vae_decode,
    "gemm": gemm.gemm_benchmark, "gemm-jax": gemm.jax_gemm, "gemm-torch": diffusers_side.torch_gemm,
    "attention": attention.attention_benchmark, "attention-jax": attention.jax_attention,
    "attention-torch": diffusers_side.torch_attention, "qk-prologue": attention.qk_prologue,
}

# The released tokenizers beside the repository (../shared/tokenizers)
SHARED_TOKENIZERS = Path(__file__).resolve().parents[2] / "shared" / "tokenizers"
# The models' own lists of names, for choices=
PRECISION_CHOICES = tuple(p.value for p in Precision)
ATTENTION_CHOICES = tuple(a.value for a in AttentionKernel)
# `training.train.REMAT_POLICIES`' names (that module imports jax, which the parser does without)
REMAT_CHOICES = ("none", "block", "dots", "dots_all")


def _help(name: str, parent: str, text: str) -> str:
    """A command's help; the halves a parent command runs in subprocesses say whose they are."""
    return text if name == parent else f"{parent}'s {name[len(parent) + 1:]} half (a subprocess of it)"


def _yes(text: str) -> bool:
    return text == "yes"


def _ints(text: str) -> tuple[int, ...]:
    return tuple(map(int, text.split(",")))


def _image_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--height", type=int, default=1024)
    p.add_argument("--width", type=int, default=1024)


def _shape_arguments(p: argparse.ArgumentParser) -> None:
    """The image size, the text length (and how much of it is real) and a block count for quick runs."""
    _image_arguments(p)
    p.add_argument("--text-len", type=int, default=512)
    p.add_argument("--valid-text", type=int, default=120)
    p.add_argument("--num-layers", type=int, default=None, help="fewer blocks, for a quick smoke run")


def _timing_arguments(p: argparse.ArgumentParser, iters: int, settle: bool = True) -> None:
    p.add_argument("--iters", type=int, default=iters, help="steps per timed repeat")
    p.add_argument("--repeats", type=int, default=3)
    if settle:
        p.add_argument("--settle-s", type=float, default=3.0,
                       help="seconds of untimed steps before timing: the GPU settles at its power cap (0: time the "
                            "faster burst an idle GPU starts with)")


def _json_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", default=None, help="write the result rows to this file")


def _add_krea2_commands(sub) -> None:
    p = sub.add_parser("krea2-profile", help="a step's GPU time by kernel (jax.profiler)")
    _shape_arguments(p)
    p.add_argument("--precision", default="fp8", choices=PRECISION_CHOICES)
    p.add_argument("--attention", default="int8_mosaic", choices=ATTENTION_CHOICES)
    p.add_argument("--iters", type=int, default=2, help="steps traced")
    p.add_argument("--top", type=int, default=40, help="kernels listed")
    p.add_argument("--trace-dir", default="/tmp/mxdit-profile")
    p = sub.add_parser("krea2-energy", help="energy a kernel of the fp8 step at the power cap")
    _shape_arguments(p)
    p.set_defaults(text_len=128)
    p.add_argument("--attention", default="int8_mosaic_fp8", choices=ATTENTION_CHOICES)
    p.add_argument("--cluster-n", type=int, default=1, help="the GEMMs' CTAs a cluster (MosaicConfig.cluster_n)")
    p.add_argument("--seconds", type=float, default=2.5, help="each kernel's timed loop")
    p.add_argument("--norm-rows", type=int, nargs="+", default=None,
                   help="the adaptive norm's rows a program (`rows_per_program`), each timed; the first enters the "
                        "sum (default: the kernel's)")
    _json_argument(p)
    for name in ("krea2-step", "krea2-step-diffusers"):
        p = sub.add_parser(name, help=_help(name, "krea2-step", "the transformer step, ours and diffusers'"))
        _shape_arguments(p)
        _timing_arguments(p, iters=10)
        p.add_argument("--torch-compile", action="store_true", help="also time diffusers under torch.compile")
        p.add_argument("--no-diffusers", dest="diffusers", action="store_false")
        p.add_argument("--jax-attention", nargs="+", default=["cudnn"], choices=ATTENTION_CHOICES)
        p.add_argument("--precisions", nargs="+", default=["bf16"], choices=PRECISION_CHOICES,
                       help="the blocks' matrices in this format through the GEMM kernels (bf16: XLA's dots)")
        p.add_argument("--stacked", nargs="+", type=_yes, default=[False], metavar="{no,yes}",
                       help="also (yes) or only with Q/K/V/gate and gate/up stacked into single products")
        p.add_argument("--unmasked-too", action="store_true", help="also time the step without a text mask")
        p.add_argument("--fused-text", action="store_true",
                       help="the text stage once before the timed steps, as the pipeline runs it (not in each step)")
        p.add_argument("--modes", nargs="+", default=list(krea2.STEP_MODES), choices=krea2.STEP_MODES)
        _json_argument(p)
    for name in ("krea2-offload", "krea2-offload-jax"):
        p = sub.add_parser(name, help=_help(name, "krea2-offload", "the step with weight streaming"))
        _shape_arguments(p)
        p.add_argument("--prefetch", type=int, default=2)
        p.add_argument("--precision", default="bf16", choices=PRECISION_CHOICES,
                       help="the blocks' matrices in this format, streamed as such (bf16: as they are)")
        _timing_arguments(p, iters=5)
        _json_argument(p)
        if name == "krea2-offload":
            p.add_argument("--resident", nargs="+", default=["16", "20"], help="blocks kept on the device, per run")
            p.add_argument("--device-memory-gb", type=float, default=24.0)
        else:
            p.add_argument("--resident", default="all")
    p = sub.add_parser("krea2-sharded-step", help="the denoising step on device meshes")
    p.add_argument("--meshes", nargs="+", default=["", "seq=2", "seq=4", "seq=8"],
                   help='mesh texts as for generate.py --mesh ("" is one device)')
    p.add_argument("--method", choices=["ulysses", "ring"], default=None, help="sequence-parallel attention")
    p.add_argument("--guidance", action="store_true", help="CFG (Base): conditional and unconditional in one batch")
    p.add_argument("--batch", type=int, default=1, help="images per step")
    _shape_arguments(p)
    p.add_argument("--tiny", action="store_true", help="the tiny demo transformer in float32 (CPU smoke run)")
    _timing_arguments(p, iters=10, settle=False)
    _json_argument(p)


def _add_pipeline_commands(sub) -> None:
    for name in ("krea2-pipeline", "krea2-pipeline-diffusers", "krea2-pipeline-jax"):
        p = sub.add_parser(name, help=_help(name, "krea2-pipeline", "Krea 2 Turbo end to end, cold and warm"))
        _image_arguments(p)
        p.add_argument("--steps", type=int, default=8)
        p.add_argument("--num-layers", type=int, default=None, help="fewer transformer blocks, for a quick smoke run")
        p.add_argument("--repeats", type=int, default=2, help="warm runs after the cold one")
        p.add_argument("--no-diffusers", dest="diffusers", action="store_false")
        p.add_argument("--precisions", nargs="+", default=["bf16"], choices=PRECISION_CHOICES,
                       help="the blocks' matrices in this format through the GEMM kernels (bf16: XLA's dots)")
        p.add_argument("--jax-attention", nargs="+", default=["cudnn"], choices=ATTENTION_CHOICES)
        p.add_argument("--no-trim-text", dest="trim_text", action="store_false",
                       help="denoise all 512 text tokens, as diffusers does (default: the padding dropped)")
        p.add_argument("--cached-too", action="store_true",
                       help="a second process of ours that starts from the first one's compilation cache")
        p.add_argument("--prompt", default="a red fox in the snow, photo",
                       help="its length sets the trimmed text (the demo tokenizer: about a token a word)")
        _json_argument(p)
    for name in ("first-image", "first-image-write", "first-image-read", "first-image-diffusers"):
        p = sub.add_parser(name, help=_help(name, "first-image", "process start to the PNG, ours and diffusers'"))
        _benchmark_model_arguments(p)
        p.add_argument("--output", default=None, help="the diffusers half's PNG")
        p.add_argument("--one-by-one-too", action="store_true",
                       help="also a first and a second start of generate.py --no-compile-ahead (their own caches)")
    for name in ("throughput", "throughput-jax", "throughput-diffusers"):
        p = sub.add_parser(name, help=_help(name, "throughput", "warm images per second by batch size"))
        _benchmark_model_arguments(p)
        p.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16])
        p.add_argument("--repeats", type=int, default=2, help="timed calls per batch size after the first")


def _benchmark_model_arguments(p: argparse.ArgumentParser) -> None:
    """first-image's and throughput's: a model folder of random full-size weights (written if missing) and the
    image settings, which default to the model's own."""
    p.add_argument("--model", default="krea2-turbo", choices=tuple(first_image.MODELS))
    p.add_argument("--model-folder", default=None,
                   help="the folder read by both sides, written with random weights if it holds no model "
                        "(default: mxdit-first-image/MODEL in the temporary folder)")
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--guidance", type=float, default=None)
    p.add_argument("--prompt", default="a red fox in the snow, photo")
    p.add_argument("--num-layers", type=int, default=None, help="fewer transformer blocks, for a quick smoke run")
    p.add_argument("--tokenizers", default=str(SHARED_TOKENIZERS),
                   help="FLUX.1's folder writer: the released CLIP and T5 tokenizers (clip/ and t5/ in it)")
    p.add_argument("--precision", default="fp8", choices=PRECISION_CHOICES)
    p.add_argument("--attention", default="int8_mosaic_fp8", choices=ATTENTION_CHOICES)
    p.add_argument("--no-diffusers", dest="diffusers", action="store_false")
    _json_argument(p)


def _add_flux_and_vae_commands(sub) -> None:
    for name in ("flux-step", "flux-step-diffusers", "flux-step-jax"):
        p = sub.add_parser(name, help=_help(name, "flux-step", "the FLUX.1-dev step, ours and diffusers'"))
        _image_arguments(p)
        p.add_argument("--text-len", type=int, default=512)
        _timing_arguments(p, iters=10)
        p.add_argument("--no-diffusers", dest="diffusers", action="store_false")
        p.add_argument("--precisions", nargs="+", default=["bf16"], choices=PRECISION_CHOICES,
                       help="the blocks' matrices in this format through the GEMM kernels (bf16: XLA's dots)")
        p.add_argument("--stacked", type=_yes, default=False, metavar="{no,yes}",
                       help="Q/K/V (and the single blocks' MLP projection) as one product each, as generate.py runs")
        p.add_argument("--jax-attention", nargs="+", default=["cudnn"], choices=ATTENTION_CHOICES)
        _json_argument(p)
    for name in ("minimax-h3-step", "minimax-h3-step-diffusers", "minimax-h3-step-jax"):
        p = sub.add_parser(name, help=_help(name, "minimax-h3-step", "a MiniMax H3 denoiser evaluation, ours (with "
                                                                     "each precision's gates) and diffusers'"))
        p.add_argument("--num-frames", type=int, default=124, help="at 24 fps, 17 * n + 5 (124: 5 s, 37.8k tokens)")
        p.add_argument("--height", type=int, default=768)
        p.add_argument("--width", type=int, default=1344)
        p.add_argument("--text-len", type=int, default=128)
        p.add_argument("--num-layers", type=int, default=None, help="fewer blocks, for a quick smoke run")
        p.add_argument("--tiny", action="store_true", help="a tiny model (checks the path on a CPU)")
        _timing_arguments(p, iters=3)
        p.add_argument("--no-diffusers", dest="diffusers", action="store_false")
        p.add_argument("--precisions", nargs="+", default=["bf16", "fp8", "int8_rot"],
                       choices=PRECISION_CHOICES + ("int8_rot",),
                       help="the blocks' attention and SwiGLU matrices in this format (bf16: XLA's dots)")
        p.add_argument("--jax-attention", nargs="+", default=["cudnn"], choices=ATTENTION_CHOICES)
        p.add_argument("--offload", type=int, default=None, metavar="N",
                       help="ours with the first N blocks on the device, the others streamed from host memory")
        p.add_argument("--prefetch", type=int, default=2, help="with --offload: blocks copied ahead")
        p.add_argument("--outputs-dir", default=None, help=argparse.SUPPRESS)  # the parent's: the bf16 output
        _json_argument(p)
    for name in ("vae-decode", "vae-decode-diffusers", "vae-decode-jax"):
        p = sub.add_parser(name, help=_help(name, "vae-decode", "VAE decoding, ours and diffusers'"))
        p.add_argument("--vaes", nargs="+", default=["qwen", "flux"], choices=["qwen", "flux"])
        p.add_argument("--sizes", nargs="+", type=int, default=[1024, 2048], help="image sides in pixels")
        p.add_argument("--repeats", type=int, default=5)
        p.add_argument("--no-diffusers", dest="diffusers", action="store_false")
        _json_argument(p)


def _add_kernel_commands(sub) -> None:
    for name in ("gemm", "gemm-jax", "gemm-torch"):
        p = sub.add_parser(name, help=_help(name, "gemm", "block-scaled GEMM kernels against XLA and torch"))
        p.add_argument("--shapes", nargs="+", default=gemm.GEMM_SHAPES, help="MxKxN")
        p.add_argument("--backends", nargs="+", default=["mosaic", "triton"], choices=["mosaic", "triton"])
        p.add_argument("--sweep", action="store_true", help="try several tile configurations on the first shape")
        p.add_argument("--iters", type=int, default=20)
        p.add_argument("--repeats", type=int, default=3, help="torch: repeats of --iters calls")
        p.add_argument("--no-torch", dest="torch", action="store_false")
        _json_argument(p)
    for name in ("attention", "attention-jax", "attention-torch"):
        p = sub.add_parser(name, help=_help(name, "attention", "attention kernels against torch's SDPA"))
        p.add_argument("--seq", type=int, default=4608)
        p.add_argument("--kv-heads", nargs="+", type=int, default=[12, 48])
        p.add_argument("--iters", type=int, default=10)
        p.add_argument("--repeats", type=int, default=3, help="torch: repeats of --iters calls")
        p.add_argument("--only", nargs="+", default=None, metavar="TEXT",
                       help="jax: only the variants whose names contain one")
        p.add_argument("--v-channel-means", type=float, default=0.0,
                       help="jax: add channel means of about this size (times V's spread) to V")
        p.add_argument("--variant-timeout", type=float, default=180.0,
                       help="jax: seconds a variant may take (compile + timing) before the process is ended as hung")
        p.add_argument("--int8-configs", nargs="+", type=_ints,
                       default=[(64, 64, 4, 2), (128, 64, 8, 2), (128, 128, 8, 2)],
                       help="block_q,block_k,warps,stages of the Triton INT8 attention")
        p.add_argument("--mosaic-attention-configs", nargs="+", type=_ints,
                       default=[(128, 2), (128, 3), (64, 3), (64, 4)],
                       help="block_k,stages of the Mosaic GPU INT8 attention (its K/V ring)")
        _json_argument(p)
    p = sub.add_parser("qk-prologue", help="the INT8 attention's fused Q/K prologue, per configuration")
    p.add_argument("--seq", type=int, default=4224)
    p.add_argument("--heads", type=int, default=48)
    p.add_argument("--kv-heads", type=int, default=12)
    p.add_argument("--heads-per-program", nargs="+", type=int, default=[1, 2, 4], help="of both passes, each timed")
    p.add_argument("--warps", nargs="+", type=int, default=[8, 16], help="a program of both passes, each timed")
    p.add_argument("--iters", type=int, default=20)


def _add_lora_commands(sub) -> None:
    for name in ("krea2-lora-step", "krea2-lora-step-jax", "krea2-lora-step-diffusers", "flux-lora-step",
                 "flux-lora-step-jax", "flux-lora-step-diffusers"):
        half = name.endswith(("-jax", "-diffusers"))
        p = sub.add_parser(name, help=_help(name, name.removesuffix("-jax").removesuffix("-diffusers"),
                                            "a LoRA training step, per base, remat policy and memory cap"))
        p.set_defaults(family=name.split("-")[0])
        _shape_arguments(p)
        p.add_argument("--rank", type=int, default=32)
        p.add_argument("--tiny", action="store_true", help="a tiny model of the family (checks the path on a CPU)")
        _timing_arguments(p, iters=5, settle=False)
        _json_argument(p)
        if half:
            p.add_argument("--remat", default="none", choices=REMAT_CHOICES)
            p.add_argument("--memory-cap-gb", type=float, default=None, help="the device memory this run may use")
            p.add_argument("--quantize-base", default=None, metavar="FORMAT",
                           help="frozen block matrices in this format")
        else:
            p.add_argument("--remat", nargs="+", default=["none", "block"], choices=REMAT_CHOICES,
                           help="one process per policy")
            p.add_argument("--bases", nargs="+", default=["bf16"], metavar="FORMAT",
                           help="the frozen base: bf16, or a weight format (fp8_e4m3, mxfp8_e4m3, int8_rot, ...)")
            p.add_argument("--memory-caps", nargs="+", default=["none"], metavar="GB",
                           help="each variant uncapped (none) and with its device memory capped to GB, e.g. none 24")
            p.add_argument("--no-diffusers", dest="diffusers", action="store_false",
                           help="without diffusers' own recipe (PEFT adapters, bf16)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_krea2_commands(sub)
    _add_pipeline_commands(sub)
    _add_flux_and_vae_commands(sub)
    _add_kernel_commands(sub)
    _add_lora_commands(sub)
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.command.startswith(("first-image", "throughput")):
        first_image.model_settings(args)
    COMMANDS[args.command](args)


if __name__ == "__main__":
    main()
