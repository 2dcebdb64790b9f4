"""The GPU tier, models: the tiny fixtures' Krea 2 and FLUX.1 transformers and pipelines run on the GPU as
generate.py runs them (bf16 weights, cuDNN attention, the blocks' matrices through the GEMM kernels at each
precision, Q/K/V stacked) against diffusers' float32 outputs recorded on the CPU; and the INT8-QK attention kernels
in a Krea 2 model of the real head width. `pytest -m gpu`; skipped where JAX sees no GPU.

Each quantized precision is also run through the kernels' jnp reference on the CPU (the default CPU path), so that
the GPU's error is judged against the error the precision itself brings, not only a fixed bound."""

import dataclasses
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import FIXTURES, relative_l2
from mxdit.model.flux import FluxTransformer
from mxdit.model.krea2 import Krea2Config, Krea2Transformer
from mxdit.model.pipelines import prepare_transformer

pytestmark = pytest.mark.gpu

PRECISIONS = ["bf16", "fp8", "mxfp8", "mxfp6", "mxfp4", "int8"]


def _forward(model, args):
    return np.asarray(nnx.jit(lambda m, *a: m(*a))(model, *args), np.float32)


def _on_cpu(function: str, *args) -> dict:
    """`function(*args)` of this module (a dict of arrays) in a process whose JAX has only the CPU, where the
    models take the CPU's default paths (the GEMM kernels' jnp reference, XLA attention)."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "out.npz"
        code = (f"import numpy as np, test_gpu_models as m; np.savez({str(out)!r}, **m.{function}(*{args!r}))")
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
        subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=Path(__file__).parent)
        return dict(np.load(out))


def _check_precision(record_property, function, precision, expected):
    gpu = globals()[function](precision)["output"]
    error = relative_l2(gpu, expected)
    record_property("relative_l2_vs_diffusers_fp32", error)
    assert np.isfinite(gpu).all()
    if precision != "bf16":
        cpu_error = relative_l2(_on_cpu(function, precision)["output"], expected)
        record_property("cpu_reference_path_vs_diffusers_fp32", cpu_error)
        # The kernels' own error (summation order, bf16 roundings they skip or add) is small next to what the format
        # loses: the GPU is within 25% of the jnp reference's distance from the float32 model.
        assert error <= 1.25 * cpu_error
    return error


# relative L2 against diffusers' float32 output: a margin over what the tiny fixtures measured on the GPU.
KREA2_BOUNDS = {"bf16": 0.02, "fp8": 0.06, "mxfp8": 0.06, "mxfp6": 0.08, "mxfp4": 0.3, "int8": 0.06}
FLUX_BOUNDS = {"bf16": 0.02, "fp8": 0.06, "mxfp8": 0.06, "mxfp6": 0.08, "mxfp4": 0.3, "int8": 0.06}


def krea2_step(precision: str) -> dict:
    """The tiny Krea 2 fixture's velocity on the fixture's inputs, bf16 weights prepared at `precision`."""
    reference = np.load(FIXTURES / "krea2" / "reference.npz")
    args = [reference[k] for k in ("hidden_states", "encoder_hidden_states", "timestep", "position_ids",
                                   "encoder_attention_mask")]
    model = prepare_transformer(Krea2Transformer.from_pretrained(FIXTURES / "krea2" / "tiny", jnp.bfloat16),
                                precision)
    return {"output": _forward(model, args)}


def flux_step(precision: str) -> dict:
    """The tiny FLUX.1 fixture's velocity, as `krea2_step`."""
    reference = np.load(FIXTURES / "flux" / "reference.npz")
    args = [reference[k] for k in ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep",
                                   "img_ids", "txt_ids", "guidance")]
    model = prepare_transformer(FluxTransformer.from_pretrained(FIXTURES / "flux" / "tiny", jnp.bfloat16), precision)
    return {"output": _forward(model, args)}


@pytest.mark.parametrize("precision", PRECISIONS)
def test_krea2_step_on_the_gpu_matches_diffusers(record_property, precision):
    expected = np.load(FIXTURES / "krea2" / "reference.npz")["output_masked"]
    assert _check_precision(record_property, "krea2_step", precision, expected) <= KREA2_BOUNDS[precision]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_flux_step_on_the_gpu_matches_diffusers(record_property, precision):
    expected = np.load(FIXTURES / "flux" / "reference.npz")["output"]
    assert _check_precision(record_property, "flux_step", precision, expected) <= FLUX_BOUNDS[precision]


def krea2_turbo_latents() -> dict:
    from mxdit.model.pipeline_krea2 import Krea2Pipeline

    reference = np.load(FIXTURES / "krea2" / "pipeline_reference.npz")
    pipe = Krea2Pipeline.from_pretrained(FIXTURES / "krea2" / "tiny_pipeline", dtype=jnp.bfloat16)
    prepare_transformer(pipe.transformer, "bf16")
    turbo = Krea2Pipeline(pipe.transformer, pipe.vae, pipe.text_encoder, pipe.tokenizer,
                          dataclasses.replace(pipe.config, is_distilled=True))
    out = turbo("a red fox in the snow, photo", height=64, width=48, num_inference_steps=3, num_images_per_prompt=2,
                latents=reference["turbo_latents_in"], max_sequence_length=24, output_type="latent")
    return {"latents": np.asarray(out.latents, np.float32)}


def flux_dev_outputs() -> dict:
    from mxdit.model.pipeline_flux import FluxPipeline

    reference = np.load(FIXTURES / "flux" / "pipeline_reference.npz")
    pipe = FluxPipeline.from_pretrained(FIXTURES / "flux" / "tiny_pipeline", jnp.bfloat16)
    prepare_transformer(pipe.transformer, "bf16")
    out = pipe(["a red fox in the snow, photo", "an old house near the river at night"], height=64, width=48,
               num_inference_steps=4, guidance_scale=3.5, output_type="np", latents=reference["latents_in"],
               max_sequence_length=16)
    return {"latents": np.asarray(out.latents, np.float32), "images": np.asarray(out.images, np.float32)}


PIPELINE_REFERENCES = {"krea2_turbo_latents": ("krea2", {"latents": "turbo_latents_out"}),
                       "flux_dev_outputs": ("flux", {"latents": "dev_latents_out", "images": "dev_images"})}


@pytest.mark.parametrize("function", list(PIPELINE_REFERENCES))
def test_pipeline_in_bf16_on_the_gpu_matches_diffusers(record_property, function):
    """The tiny pipelines end to end in bf16 (text encoders, all steps as one program, the VAE), against diffusers'
    float32 run: bf16 rounding over several steps moves the tiny random models' outputs by several percent, so
    the GPU's distance is judged against the same bf16 pipeline's on the CPU."""
    family, names = PIPELINE_REFERENCES[function]
    reference = np.load(FIXTURES / family / "pipeline_reference.npz")
    gpu, cpu = globals()[function](), _on_cpu(function)
    for name, key in names.items():
        error, cpu_error = relative_l2(gpu[name], reference[key]), relative_l2(cpu[name], reference[key])
        record_property(f"{name}_relative_l2_vs_diffusers_fp32", error)
        record_property(f"{name}_cpu_bf16_vs_diffusers_fp32", cpu_error)
        assert np.isfinite(gpu[name]).all()
        assert error <= 1.5 * cpu_error


# -- the INT8-QK attention kernels inside a model of Krea 2's head width -------------------------------------------


@pytest.fixture(scope="module")
def wide_heads():
    """A 2-block Krea 2 with 128-wide heads (the Mosaic kernel's width), random weights, 1024 image tokens and a
    padded prompt, and its float32 output with exact XLA attention on the CPU."""
    cfg = Krea2Config(in_channels=16, num_layers=2, attention_head_dim=128, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=256, timestep_embed_dim=64, text_hidden_dim=256,
                      num_text_layers=2, text_num_attention_heads=2, text_num_key_value_heads=2,
                      text_intermediate_size=256, axes_dims_rope=(32, 48, 48))
    rng = np.random.default_rng(0)
    grid, text = 32, 40
    ids = np.zeros((text + grid * grid, 3), np.float32)
    ids[text:, 1], ids[text:, 2] = np.arange(grid * grid) // grid, np.arange(grid * grid) % grid
    args = [rng.standard_normal((1, grid * grid, 16)).astype(np.float32),
            rng.standard_normal((1, text, 2, 256)).astype(np.float32), np.array([0.6], np.float32), ids,
            np.arange(text)[None] < 29]
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        model = Krea2Transformer(cfg, dtype=jnp.float32, attention="xla", rngs=nnx.Rngs(0))
        expected = _forward(model, [jax.device_put(a, cpu) for a in args])  # XLA attention, no kernels
        state = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    return cfg, state, args, expected


@pytest.mark.parametrize("attention", ["cudnn", "xla", "int8", "int8_fp8", "int8_mosaic", "int8_mosaic_fp8"])
def test_krea2_attention_kernels_in_the_model(record_property, wide_heads, attention):
    """Every attention the models offer on the GPU, bf16 weights, Q/K/V(/gate) stacked as generate.py runs them:
    within the INT8-QK error (bf16 or FP8 P.V) of the float32 model with exact attention."""
    cfg, state, args, expected = wide_heads
    model = Krea2Transformer(cfg, dtype=jnp.bfloat16, attention=attention, rngs=nnx.Rngs(0))
    # the same weights in the dtypes the bf16 model declares (its norms stay float32)
    nnx.update(model, jax.tree.map(lambda t, a: jnp.asarray(a, t.dtype), nnx.state(model, nnx.Param), state))
    prepare_transformer(model, "bf16")
    out = _forward(model, args)
    error = relative_l2(out, expected)
    record_property("relative_l2_vs_fp32_exact_cpu", error)
    assert np.isfinite(out).all()
    assert error <= {"cudnn": 0.02, "xla": 0.02, "int8": 0.03, "int8_mosaic": 0.03, "int8_fp8": 0.06,
                     "int8_mosaic_fp8": 0.06}[attention]
