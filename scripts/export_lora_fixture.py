"""Step 2 of the LoRA export fixtures (see scripts/make_fixtures.py): export mxdit LoRAs on the tiny pipelines'
transformers for diffusers to load: Krea 2's in the diffusers and ComfyUI layouts (then `make_fixtures.py --only
lora_export`), FLUX.1's in the diffusers layout (then `make_fixtures.py --only flux_lora_export`).

    .venv/bin/python scripts/export_lora_fixture.py     # writes tests/fixtures/krea2/lora/mxdit_{diffusers,comfyui}
                                                        # and tests/fixtures/flux/lora/mxdit_diffusers.safetensors

The adapters have two ranks and two alphas (attention and MLP: rank 3, alpha 1.5; the input, time, text, modulation
and output projections: rank 2, alpha 4), so the export's per-module rank and alpha patterns are exercised; on FLUX.1
the output projection `proj_out` is in the second group while the single blocks' `proj_out` layers are in the first.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
FOLDER = FIXTURES / "krea2"
FLUX_FOLDER = FIXTURES / "flux"
# FLUX.1's projections outside the attention and MLP layers: input, time/guidance/pooled text, modulation, output.
FLUX_PROJECTIONS = (r"x_embedder|context_embedder|proj_out|norm_out\.linear|"
                    r"time_text_embed\.(timestep|guidance|text)_embedder\.linear_[12]|"
                    r"transformer_blocks\.\d+\.norm1(_context)?\.linear|single_transformer_blocks\.\d+\.norm\.linear",)


def _randomize_adapters(model, seed: int) -> None:
    from mxdit.model.lora import adapters

    rng = np.random.default_rng(seed)
    for _, adapter in adapters(model):
        for var in (adapter.A, adapter.B):
            var.set_value(jnp.asarray(rng.standard_normal(var.shape) * 0.3 / np.sqrt(var.shape[-1]), jnp.float32))


def exported_model():
    """The Krea 2 tiny pipeline's transformer (float32) with the random adapters that are exported."""
    from mxdit.model.krea2 import Krea2Transformer
    from mxdit.model.lora import LoraConfig
    from mxdit.training.lora import KREA2_ATTENTION_AND_MLP, add_lora

    model = Krea2Transformer.from_pretrained(FOLDER / "tiny_pipeline" / "transformer", dtype=jnp.float32)
    add_lora(model, LoraConfig(rank=3, alpha=1.5, targets=KREA2_ATTENTION_AND_MLP))
    add_lora(model, LoraConfig(rank=2, alpha=4.0, targets=(r"img_in|final_layer\.linear|txt_in\.linear_[12]|"
                                                           r"time_embed\.linear_[12]|time_mod_proj",)))
    _randomize_adapters(model, 12)
    return model


def exported_flux_model():
    """The FLUX.1 tiny pipeline's transformer (float32) with the random adapters that are exported."""
    from mxdit.model.flux import FluxTransformer
    from mxdit.model.lora import LoraConfig
    from mxdit.training.lora import FLUX_ATTENTION_AND_MLP, add_lora

    model = FluxTransformer.from_pretrained(FLUX_FOLDER / "tiny_pipeline" / "transformer", dtype=jnp.float32)
    add_lora(model, LoraConfig(rank=3, alpha=1.5, targets=FLUX_ATTENTION_AND_MLP))
    add_lora(model, LoraConfig(rank=2, alpha=4.0, targets=FLUX_PROJECTIONS))
    _randomize_adapters(model, 13)
    return model


def main() -> None:
    from mxdit.model.lora_files import LAYOUTS, export_lora

    model = exported_model()
    for layout in LAYOUTS:
        path = FOLDER / "lora" / f"mxdit_{layout}.safetensors"
        export_lora(model, path, layout)
        print(f"wrote {path}")
    path = FLUX_FOLDER / "lora" / "mxdit_diffusers.safetensors"  # the ComfyUI layout is written for Krea 2 only
    export_lora(exported_flux_model(), path, "diffusers")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
