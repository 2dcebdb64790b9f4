"""Write the small reference fixtures under tests/fixtures/ with PyTorch (CPU) + diffusers.

This is the only place that needs PyTorch: it builds tiny random models in the real checkpoint layouts (key names,
shapes, config.json), runs the diffusers implementation on fixed inputs and saves inputs and outputs as .npz, so that
the test suite compares against diffusers without importing it. It also records the key names and shapes of the
full-size released checkpoints, built on the meta device (`--only key_coverage`, see `fixtures/key_coverage.py`).

    python3.11 -m venv /tmp/torch && /tmp/torch/bin/pip install torch==2.13.0 diffusers==0.42.1 transformers peft sentencepiece protobuf
    /tmp/torch/bin/python scripts/make_fixtures.py            # rewrites tests/fixtures/
    /tmp/torch/bin/python scripts/make_fixtures.py --only lora   # one group (repeatable); see GROUPS

The LoRA export check takes two steps, because the exporter is mxdit's (JAX) and the reference diffusers' (torch):
`--only lora` writes the diffusers/kohya/ComfyUI LoRA files and reference outputs under tests/fixtures/krea2/lora/;
then `.venv/bin/python scripts/export_lora_fixture.py` (mxdit's venv) exports an mxdit LoRA there in the diffusers
and ComfyUI layouts; then `--only lora_export` loads those files with diffusers' `load_lora_weights` and saves its
outputs (export_reference.npz). FLUX.1 the same way under tests/fixtures/flux/lora/: `--only flux_lora`, the same
export script (diffusers layout), then `--only flux_lora_export`.

Every parameter is random (norm scales and modulation tables included), so that a term that is silently wrong in our
implementation cannot hide behind a zero or a one. The writers are in scripts/fixtures/, one module per subject.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent) not in sys.path:  # the fixtures package beside this file
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from fixtures import (clip, flux, gguf, key_coverage, krea2, lora, minimax_h3, minimax_h3_audio_vae,  # noqa: E402
                      minimax_h3_vae, tokenizer_parity, vae)

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"


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
# flux_schnell and flux_lora flux's; the export groups read mxdit's exported files (see lora.write_lora_export), so they
# run only when asked.
EXPORT_GROUPS = ("lora_export", "flux_lora_export")
GROUPS = {
    "krea2_transformer": (krea2.write_krea2_transformer, "krea2"),
    "scheduler": (krea2.write_scheduler, "scheduler"),
    "vae": (vae.write_vaes, "vae"),
    "krea2_pipeline": (krea2.write_krea2_pipeline, "krea2"),
    "flux_transformer": (flux.write_flux_transformer, "flux"),
    "flux_pipeline": (flux.write_flux_pipeline, "flux"),
    "lora": (lora.write_lora, "krea2"),
    "lora_export": (lora.write_lora_export, "krea2"),
    "flux_schnell": (flux.write_flux_schnell, "flux"),
    "flux_lora": (lora.write_flux_lora, "flux"),
    "key_coverage": (key_coverage.write_key_coverage, "."),
    "tokenizers": (tokenizer_parity.write_tokenizers, "tokenizers"),
    "flux_lora_export": (lora.write_flux_lora_export, "flux"),
    "clip": (clip.write_clip, "clip"),
    "gguf": (gguf.write_gguf_fixtures, "gguf"),  # reads krea2's and flux's tiny_original
    "minimax_h3_transformer": (minimax_h3.write_minimax_h3_transformer, "minimax_h3"),
    "minimax_h3_denoising": (minimax_h3.write_minimax_h3_denoising, "minimax_h3"),  # reads the tiny transformer
    "minimax_h3_audio_vae": (minimax_h3_audio_vae.write_minimax_h3_audio_vae, "minimax_h3/audio_vae"),
    "minimax_h3_vae": (minimax_h3_vae.write_minimax_h3_vae, "minimax_h3/vae"),
    "minimax_h3_released_keys": (minimax_h3.write_minimax_h3_released_keys, "minimax_h3"),
    "minimax_h3_conditioner": (minimax_h3.write_minimax_h3_conditioner, "minimax_h3"),
}


if __name__ == "__main__":
    main()
