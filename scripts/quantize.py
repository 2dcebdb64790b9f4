"""Quantize a transformer checkpoint, or print the weight bytes of the full-size models at every format.

    python scripts/quantize.py --model /models/Krea-2-Turbo/transformer --format mxfp6_e2m3 --output krea2_mxfp6.safetensors
    python scripts/quantize.py --sizes          # full-size Krea 2 and FLUX.1-dev, from their shapes (no weights needed)

The output is mxdit's quantized checkpoint (one safetensors file; see quant/model.py). Existing files are never
overwritten unless --overwrite is given.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


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
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="quantize.py", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a Krea 2 or FLUX.1 transformer/ folder or single file")
    parser.add_argument("--format", help="a format of quant.formats()")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--sizes", action="store_true", help="print weight bytes of the full-size models and exit")
    args = parser.parse_args(argv)

    if args.sizes:
        print(f"{'model':<12}{'format':<13}{'GB':>8}")
        for model, fmt, nbytes in size_table():
            print(f"{model:<12}{fmt:<13}{nbytes / 1e9:8.2f}")
        return 0
    from mxdit.quant.formats import formats

    if not (args.model and args.format and args.output):
        parser.error("--model, --format and --output are required (or --sizes)")
    if args.format not in formats():
        parser.error(f"--format {args.format}: unknown; one of {', '.join(formats())}")
    if args.output.exists() and not args.overwrite:
        parser.error(f"--output {args.output}: already exists (pass --overwrite to replace)")

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
