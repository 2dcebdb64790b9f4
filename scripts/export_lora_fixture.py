"""Step 2 of the LoRA export fixtures (see scripts/make_fixtures.py): export an mxdit LoRA on the tiny Krea 2
pipeline's transformer in the diffusers and ComfyUI layouts, for diffusers to load (`make_fixtures.py --only
lora_export`).

    .venv/bin/python scripts/export_lora_fixture.py     # writes tests/fixtures/krea2/lora/mxdit_{diffusers,comfyui}.safetensors

The adapters have two ranks and two alphas (attention and SwiGLU: rank 3, alpha 1.5; the input, time, text and output
projections: rank 2, alpha 4), so the export's per-module rank and alpha patterns are exercised.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np

FOLDER = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "krea2"


def exported_model():
    """The tiny pipeline's transformer (float32) with the random adapters that are exported."""
    from mxdit.model.krea2 import Krea2Transformer
    from mxdit.training.lora import KREA2_ATTENTION_AND_MLP, LoraConfig, add_lora, adapters

    model = Krea2Transformer.from_pretrained(FOLDER / "tiny_pipeline" / "transformer", dtype=jnp.float32)
    add_lora(model, LoraConfig(rank=3, alpha=1.5, targets=KREA2_ATTENTION_AND_MLP))
    add_lora(model, LoraConfig(rank=2, alpha=4.0, targets=(r"img_in|final_layer\.linear|txt_in\.linear_[12]|"
                                                           r"time_embed\.linear_[12]|time_mod_proj",)))
    rng = np.random.default_rng(12)
    for _, adapter in adapters(model):
        for var in (adapter.A, adapter.B):
            var.set_value(jnp.asarray(rng.standard_normal(var.shape) * 0.3 / np.sqrt(var.shape[-1]), jnp.float32))
    return model


def main() -> None:
    from mxdit.training.lora_files import LAYOUTS, export_lora

    model = exported_model()
    for layout in LAYOUTS:
        path = FOLDER / "lora" / f"mxdit_{layout}.safetensors"
        export_lora(model, path, layout)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
