"""The GPU tier, models: the tiny fixtures' Krea 2 and FLUX.1 transformers and pipelines run on the GPU as
generate.py runs them (bf16 weights, cuDNN attention, the blocks' matrices through the GEMM kernels at each
precision, Q/K/V stacked) against diffusers' bf16 and float32 outputs recorded on the CPU; and every attention
kernel in a Krea 2 model of the real head width. `pytest -m gpu`; skipped where JAX sees no GPU.

Each run is repeated on the CPU (the kernels' jnp reference, XLA attention: the default CPU path), so that the GPU's
distance from diffusers is judged against the distance that bf16 and the precision itself bring, not only a fixed
bound."""

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
from mxdit.ops.names import AttentionKernel, Precision

pytestmark = pytest.mark.gpu

PRECISIONS = [p.value for p in Precision]


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


def _check_against_diffusers(record_property, function, reference, keys, *args):
    """`function(*args)` on the GPU against diffusers' bf16 run of the same fixture (`keys`: our output name ->
    the reference's bf16 key; its float32 key is the same without `_bf16`), recording the float32 distance too.
    The GPU's distance from diffusers' bf16 output must be no more than 1.5 times that of the same run on the CPU
    (the kernels' jnp reference, XLA attention): bf16 rounding differs between the two, the arithmetic must not."""
    gpu, cpu = globals()[function](*args), _on_cpu(function, *args)
    errors = {}
    for name, key in keys.items():
        assert np.isfinite(gpu[name]).all()
        error, cpu_error = relative_l2(gpu[name], reference[key]), relative_l2(cpu[name], reference[key])
        record_property(f"{name}_vs_diffusers_bf16", error)
        record_property(f"{name}_cpu_vs_diffusers_bf16", cpu_error)
        record_property(f"{name}_vs_diffusers_fp32", relative_l2(gpu[name], reference[key.removesuffix("_bf16")]))
        assert error <= 1.5 * cpu_error
        errors[name] = error
    return errors


def krea2_step(precision: str) -> dict:
    """The tiny Krea 2 fixture's velocity on the fixture's inputs, bf16 weights prepared at `precision`, the timestep
    rounded to bf16 as the pipeline passes it (and as diffusers' bf16 reference took it: unrounded, this tiny
    model's output moves by ~20%)."""
    reference = dict(np.load(FIXTURES / "krea2" / "reference.npz"))
    reference["timestep"] = reference["timestep"].astype(jnp.bfloat16).astype(np.float32)
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


# relative L2 against diffusers' bf16 output: a margin over what the tiny fixtures measured on the GPU.
STEP_BOUNDS = {"bf16": 0.03, "fp8": 0.06, "mxfp8": 0.06, "mxfp6": 0.08, "mxfp4": 0.3, "int8": 0.06}


def krea2_lora_gradients(base: str, dtype: str) -> dict:
    """The flow-matching loss's gradient w.r.t. rank-4 adapters (B drawn, so that every adapter matrix gets one) on
    the tiny Krea 2 fixture with its block matrices quantized to `base` as training freezes them
    (`training.lora.quantize_base`), in `dtype`; the adapters' gradients concatenated."""
    from mxdit.model.lora import LoraConfig, adapters
    from mxdit.quant.model import krea2_rules
    from mxdit.training.lora import add_lora, quantize_base
    from mxdit.training.train import flow_matching_loss

    reference = np.load(FIXTURES / "krea2" / "reference.npz")
    model = Krea2Transformer.from_pretrained(FIXTURES / "krea2" / "tiny", getattr(jnp, dtype))
    quantize_base(model, krea2_rules(base))
    add_lora(model, LoraConfig(rank=4, alpha=4))
    for i, (_, adapter) in enumerate(adapters(model)):
        adapter.B.set_value(0.05 * jax.random.normal(jax.random.key(i), adapter.B.shape))
    graphdef, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)
    latents = jnp.asarray(reference["hidden_states"])
    noise = jax.random.normal(jax.random.key(7), latents.shape)

    def loss(lora):
        return flow_matching_loss(nnx.merge(graphdef, lora, frozen), latents,
                                  jnp.asarray(reference["encoder_hidden_states"], getattr(jnp, dtype)),
                                  jnp.asarray(reference["encoder_attention_mask"]),
                                  jnp.asarray(reference["position_ids"]), noise, jnp.array([0.3, 0.8]))

    grads = jax.jit(jax.grad(loss))(lora)
    return {"grads": np.concatenate([np.asarray(g, np.float32).ravel() for g in jax.tree.leaves(grads)])}


@pytest.mark.parametrize("base", ["fp8_e4m3", "int8", "mxfp8_e4m3"])
def test_lora_gradients_on_a_quantized_base_on_the_gpu(record_property, base):
    """The adapters' gradients through the GEMM kernels on the GPU (bf16) against the same model in float32 on the
    CPU: no further from it than the CPU's own bf16 run (the kernels' jnp reference), with a margin of 1.5."""
    gpu = krea2_lora_gradients(base, "bfloat16")["grads"]
    cpu = _on_cpu("krea2_lora_gradients", base, "bfloat16")["grads"]
    exact = _on_cpu("krea2_lora_gradients", base, "float32")["grads"]
    assert np.isfinite(gpu).all() and np.linalg.norm(exact) > 0
    error, cpu_error = relative_l2(gpu, exact), relative_l2(cpu, exact)
    record_property("grads_vs_cpu_fp32", error)
    record_property("grads_cpu_bf16_vs_cpu_fp32", cpu_error)
    assert error <= 1.5 * cpu_error


@pytest.mark.parametrize("precision", PRECISIONS)
def test_krea2_step_on_the_gpu_matches_diffusers(record_property, precision):
    reference = np.load(FIXTURES / "krea2" / "reference.npz")
    errors = _check_against_diffusers(record_property, "krea2_step", reference, {"output": "output_masked_bf16"},
                                      precision)
    assert errors["output"] <= STEP_BOUNDS[precision]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_flux_step_on_the_gpu_matches_diffusers(record_property, precision):
    reference = np.load(FIXTURES / "flux" / "reference.npz")
    errors = _check_against_diffusers(record_property, "flux_step", reference, {"output": "output_bf16"}, precision)
    assert errors["output"] <= STEP_BOUNDS[precision]


PROMPTS = ["a red fox in the snow, photo", "an old house near the river at night"]


def krea2_base_outputs() -> dict:
    """The tiny Base pipeline in bf16 with CFG (Qwen3-VL text encoder, 4 steps as one program, VAE decode)."""
    from mxdit.model.pipeline_krea2 import Krea2Pipeline

    reference = np.load(FIXTURES / "krea2" / "pipeline_reference.npz")
    pipe = Krea2Pipeline.from_pretrained(FIXTURES / "krea2" / "tiny_pipeline", dtype=jnp.bfloat16)
    prepare_transformer(pipe.transformer, "bf16")
    out = pipe(PROMPTS, "blurry", height=64, width=48, num_inference_steps=4, guidance_scale=4.5,
               latents=reference["base_latents_in"], max_sequence_length=24, output_type="np")
    return {"latents": np.asarray(out.latents, np.float32), "images": np.asarray(out.images, np.float32)}


def flux_dev_outputs() -> dict:
    """The tiny FLUX.1-dev pipeline in bf16 (T5 and CLIP, 4 steps as one program, VAE decode)."""
    from mxdit.model.pipeline_flux import FluxPipeline

    reference = np.load(FIXTURES / "flux" / "pipeline_reference.npz")
    pipe = FluxPipeline.from_pretrained(FIXTURES / "flux" / "tiny_pipeline", jnp.bfloat16)
    prepare_transformer(pipe.transformer, "bf16")
    out = pipe(PROMPTS, height=64, width=48, num_inference_steps=4, guidance_scale=3.5, output_type="np",
               latents=reference["latents_in"], max_sequence_length=16)
    return {"latents": np.asarray(out.latents, np.float32), "images": np.asarray(out.images, np.float32)}


PIPELINES = {"krea2_base_outputs": ("krea2", {"latents": "base_latents_out_bf16", "images": "base_images_bf16"}),
             "flux_dev_outputs": ("flux", {"latents": "dev_latents_out_bf16", "images": "dev_images_bf16"})}


@pytest.mark.parametrize("function", list(PIPELINES))
def test_pipeline_in_bf16_on_the_gpu_matches_diffusers(record_property, function):
    family, keys = PIPELINES[function]
    reference = np.load(FIXTURES / family / "pipeline_reference.npz")
    errors = _check_against_diffusers(record_property, function, reference, keys)
    assert max(errors.values()) <= 0.15


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


@pytest.mark.parametrize("attention", [a.value for a in AttentionKernel])
def test_krea2_attention_kernels_in_the_model(record_property, wide_heads, attention):
    """Every attention the models offer on the GPU, bf16 weights, Q/K/V(/gate) stacked as generate.py runs them:
    within the INT8-QK error (bf16 or FP8 P.V) of the float32 model with exact attention."""
    capability = getattr(jax.devices()[0], "compute_capability", "")
    if "mosaic" in attention and not capability.startswith("9."):
        pytest.skip(f"the Mosaic attention needs a Hopper GPU (compute capability 9.x), this is {capability!r}")
    if attention == "cudnn" and capability.startswith("gfx"):
        pytest.skip(f"cuDNN's attention runs on NVIDIA GPUs only (the models default to XLA's elsewhere); this GPU "
                    f"is {capability!r}")
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
