"""Quantize a transformer checkpoint, or print the weight bytes of the full-size models at every format.

    python scripts/quantize.py --model /models/Krea-2-Turbo/transformer --format mxfp6_e2m3 --output krea2_mxfp6.safetensors
    python scripts/quantize.py --sizes          # full-size Krea 2 and FLUX.1-dev, ours and GGUF files, from shapes

The output is mxdit's quantized checkpoint (one safetensors file; see quant/model.py). Existing files are never
overwritten unless --overwrite is given.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from mxdit.cli import OneLineErrorParser, check_output


def size_table() -> list[tuple[str, str, int]]:
    """(model, format, bytes) for the full-size Krea 2 and FLUX.1-dev transformers under their default rules."""
    import jax.numpy as jnp
    from flax import nnx

    from mxdit.model.flux import FluxConfig, FluxTransformer
    from mxdit.model.krea2 import Krea2Config, Krea2Transformer
    from mxdit.model.loading import iter_params
    from mxdit.quant.formats import formats
    from mxdit.quant.model import flux_rules, krea2_rules, weight_bytes

    rows = []
    for name, build, rules in (
        ("Krea 2", lambda: Krea2Transformer(Krea2Config(), dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), krea2_rules),
        ("FLUX.1-dev", lambda: FluxTransformer(FluxConfig(), dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), flux_rules),
    ):
        shapes = {k: (tuple(v.shape), v.dtype) for k, v in iter_params(nnx.eval_shape(build))}
        rows.append((name, "bf16", weight_bytes(shapes, [])))
        rows += [(name, fmt, weight_bytes(shapes, rules(fmt))) for fmt in formats()]
        rows += [(name, f"GGUF {kind}", gguf_file_bytes(shapes, kind)) for kind in GGUF_SIZES]
    return rows


# GGUF block types: (values a block, bytes a block), llama.cpp's (gguf.GGML_QUANT_SIZES)
GGUF_SIZES = {"Q8_0": (32, 34), "Q6_K": (256, 210), "Q5_K": (256, 176), "Q4_K": (256, 144), "Q4_0": (32, 18),
              "Q3_K": (256, 110), "Q2_K": (256, 84)}


def gguf_file_bytes(shapes, kind: str) -> int:
    """Bytes of a GGUF file of these parameters as ComfyUI-GGUF's converter writes one: the matrices whose rows the
    blocks divide in `kind`, the rest in F16 (1-D tensors in F32). Read by mxdit, it becomes --precision's weights on
    the device (its rows above); Q8_0 stays as it is at the default precision (int8_b32's row)."""
    values, nbytes = GGUF_SIZES[kind]
    total = 0
    for key, (shape, _) in shapes.items():
        size = int(np.prod(shape))
        if key.endswith(".weight") and len(shape) == 2 and shape[-1] % values == 0:
            total += size // values * nbytes
        else:
            total += size * (4 if len(shape) == 1 else 2)
    return total


# quant.formats.formats(), listed here so that parsing needs no jax (a test keeps the two equal)
FORMAT_CHOICES = ("fp8_e4m3", "fp8_e5m2", "mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp4_e2m1", "nvfp4",
                  "int8", "int8_rot", "int8_b32")


def build_parser() -> OneLineErrorParser:
    parser = OneLineErrorParser(prog="quantize.py", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path,
                        help="a Krea 2 or FLUX.1 transformer/ folder (diffusers layout) or single safetensors file")
    parser.add_argument("--format", choices=FORMAT_CHOICES, metavar="FORMAT",
                        help="the block matrices' format: " + ", ".join(FORMAT_CHOICES) + " (quant/formats.py)")
    parser.add_argument("--output", type=Path, help="the quantized checkpoint to write (one .safetensors file)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    parser.add_argument("--sizes", action="store_true",
                        help="print the weight bytes of the full-size models at every format and exit")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.sizes:
        return args
    missing = [f"--{name}" for name in ("model", "format", "output") if getattr(args, name) is None]
    if missing:
        parser.error(f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} required (or --sizes)")
    if not args.model.exists():
        parser.error(f"--model {args.model}: no such file or folder")
    check_output(parser, args.output, args.overwrite)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.sizes:
        print(f"{'model':<12}{'format':<13}{'GB':>8}   (GGUF: the file, read into --precision's format)")
        for model, fmt, nbytes in size_table():
            print(f"{model:<12}{fmt:<13}{nbytes / 1e9:8.2f}")
        return 0

    import jax.numpy as jnp

    from mxdit.model.flux import FluxTransformer
    from mxdit.model.krea2 import Krea2Transformer
    from mxdit.model.loading import CheckpointError, iter_params, read_json
    from mxdit.quant.model import flux_rules, krea2_rules, quantize_model, save_quantized

    try:
        config = args.model / "config.json" if args.model.is_dir() else None
        is_flux = config is not None and read_json(config).get("_class_name") == "FluxTransformer2DModel"
        model = (FluxTransformer if is_flux else Krea2Transformer).from_pretrained(args.model, jnp.bfloat16)
    except (CheckpointError, ValueError) as e:
        print(f"quantize.py: error: {e}", file=sys.stderr)
        return 2
    params = dict(iter_params(model))
    quantized = quantize_model(params, (flux_rules if is_flux else krea2_rules)(args.format))
    save_quantized(quantized, args.output)
    before = sum(v.size * v.dtype.itemsize for v in params.values())
    after = args.output.stat().st_size
    count = sum(1 for k in quantized if quantized[k] is not params[k])
    print(f"{count} of {len(params)} tensors in {args.format}: {before / 1e6:.3f} MB of bf16 -> {after / 1e6:.3f} MB "
          f"on disk ({100 * (1 - after / before):.1f}% saved); wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
