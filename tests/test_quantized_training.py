"""LoRA training on a frozen quantized base (training/lora.py's `quantize_base`): the products run through the GEMM
kernels' weights as inference runs them, the backward to the activations multiplies the weights' codes
(`ops.linear.transposed_product`), training resumes bit for bit, and a LoRA trained on an FP8 base works on the
bf16 base and on the FP8 one."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import relative_l2
from mxdit.model.lora import LoraConfig, adapters, remove_lora
from mxdit.model.pipeline_krea2 import demo_pipeline
from mxdit.ops.linear import differentiated_products, fp8_input_backend, linear
from mxdit.pallas_kernels import gemm
from mxdit.pallas_kernels.gemm.reference import _epilogue, dequantize_weight
from mxdit.quant.model import krea2_rules
from mxdit.training.lora import quantize_base
from mxdit.model.pipeline_common import image_position_ids
from mxdit.training.train import TrainConfig, train
from test_lora_training import write_photo_patches

# Per-channel weights fold their scales into the gradient before the product (float32 rounding: measured 1.2e-7;
# the rotated INT8 rotates after it: 4.5e-7); block-scaled and MX weights multiply their dequantized values (exact).
CHANNEL_TOLERANCE = {"fp8_e4m3": 1e-6, "int8": 1e-6, "int8_rot": 2e-6}
# The velocity change of a LoRA trained on the FP8 base against that of one trained on the bf16 base, relative to the
# latter's effect: measured 0.140 on the bf16 base, 0.161 on the FP8 base (the effect: 21% of the velocity).
GAP_BOUND = 0.25


@pytest.mark.parametrize("fmt,layout", [("fp8_e4m3", "mosaic"), ("int8", "triton"), ("int8_rot", "triton"),
                                        ("mxfp8_e4m3", "mosaic"), ("mxfp6_e2m3", "triton"),
                                        ("mxfp4_e2m1", "triton")])
def test_backward_through_a_quantized_frozen_linear_is_that_of_its_dequantized_weight(fmt, layout):
    """d/dx of the kernels' product (activations quantized per token in the forward) is dy @ W, W the weight's
    dequantized values; through the DiT's gated residual too (the gate scales it, the residual takes dy)."""
    kx, kw, kd, kr, kg, kb = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(kx, (3, 5, 256), jnp.float32)
    w = gemm.prepare_weight(jax.random.normal(kw, (192, 256), jnp.float32) / 16, fmt, backend=layout)
    dy = jax.random.normal(kd, (3, 5, 192), jnp.float32)
    bias = jax.random.normal(kb, (192,))
    dense = dequantize_weight(w)

    grad = jax.grad(lambda x: jnp.sum(linear(x, w, bias) * dy))(x)
    expected = jnp.einsum("bsn,nk->bsk", dy, dense, precision="highest")
    tolerance = CHANNEL_TOLERANCE.get(fmt, 0.0)
    assert relative_l2(grad, expected) <= tolerance

    residual, gate = jax.random.normal(kr, (1, 5, 192)), jax.random.normal(kg, (1, 1, 192))
    dx, d_residual, d_gate = jax.grad(lambda x, r, g: jnp.sum(linear(x, w, bias, residual=r, gate=g) * dy[:1]),
                                      argnums=(0, 1, 2))(x[:1], residual, gate)
    assert relative_l2(dx, jnp.einsum("bsn,nk->bsk", dy[:1] * gate, dense, precision="highest")) <= tolerance
    np.testing.assert_array_equal(d_residual, dy[:1])
    product = gemm.scaled_matmul(x[:1].reshape(5, 256), w, backend="reference", out_dtype=jnp.float32) + bias
    assert relative_l2(d_gate, jnp.sum(dy[:1] * product, axis=(0, 1), keepdims=True)) <= 1e-6


def test_an_activation_in_the_epilogue_is_differentiated_at_the_kernels_product():
    """gelu(x W^T + b): its derivative is taken at the product the kernel computed (activations quantized), and the
    quantization passes the gradient straight through to x."""
    kx, kw, kd = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(kx, (7, 128), jnp.float32)
    w = gemm.prepare_weight(jax.random.normal(kw, (64, 128), jnp.float32) / 8, "fp8_e4m3", backend="mosaic")
    dy = jax.random.normal(kd, (7, 64), jnp.float32)
    grad = jax.grad(lambda x: jnp.sum(linear(x, w, activation="gelu_tanh") * dy))(x)
    product = gemm.scaled_matmul(x, w, backend="reference", out_dtype=jnp.float32)
    _, gelu_vjp = jax.vjp(lambda p: _epilogue(p, None, "gelu_tanh", None, None), product)
    expected = jnp.dot(gelu_vjp(dy)[0], dequantize_weight(w), precision="highest")
    assert relative_l2(grad, expected) <= 1e-6


def test_a_traced_loss_keeps_the_fused_fp8_producers_out():
    """Inside `differentiated_products` no layer input is quantized by a fused producer (whose quantization would
    cut the gradient): each product quantizes its own input."""
    from flax import nnx

    from mxdit.model.layers import Linear

    layer = Linear(128, 64, bias=False, dtype=jnp.float32, rngs=nnx.Rngs(0))
    layer.weight.set_value(gemm.prepare_weight(layer.weight.get_value(), "fp8_e4m3", backend="mosaic"))
    assert fp8_input_backend(layer) == "reference"
    with differentiated_products():
        assert fp8_input_backend(layer) is None
    assert fp8_input_backend(layer) == "reference"


LORA = LoraConfig(rank=4, alpha=4)
CONFIG = TrainConfig(steps=8, batch_size=4, learning_rate=1e-2, resolution=32, bucket_multiple=16, aspects=(1.0,),
                     max_sequence_length=16, save_every=4, keep_checkpoints=2, seed=0)


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    folder = tmp_path_factory.mktemp("photos") / "data"
    write_photo_patches(folder, per_photo=2)
    return folder


def quantized_pipeline(tmp_path, fmt: str):
    pipe = demo_pipeline(tmp_path / f"tokenizer-{fmt}", seed=0, dtype=jnp.float32, distilled=False)
    if fmt != "bf16":
        quantize_base(pipe.transformer, krea2_rules(fmt))
    return pipe


@pytest.mark.slow  # three trainings
def test_training_on_an_fp8_base_resumes_bit_for_bit(photos, tmp_path):
    pipe = quantized_pipeline(tmp_path, "fp8_e4m3")
    weight = pipe.transformer.transformer_blocks[0].attn.to_q.weight.get_value()
    assert isinstance(weight, gemm.GemmWeight) and weight.fmt == "fp8_e4m3"
    straight = train(pipe, photos, tmp_path / "straight", CONFIG, LORA, model_tag="demo-fp8", progress=False)
    remove_lora(pipe.transformer)
    half = train(pipe, photos, tmp_path / "halves", CONFIG, LORA, model_tag="demo-fp8", stop_at=4, progress=False)
    remove_lora(pipe.transformer)
    resumed = train(pipe, photos, tmp_path / "halves", CONFIG, LORA, model_tag="demo-fp8", resume=True,
                    progress=False)
    assert [loss for _, loss in half.losses + resumed.losses] == [loss for _, loss in straight.losses]
    assert all(np.isfinite(loss) for _, loss in straight.losses)
    for a, b in zip(jax.tree.leaves(straight.lora), jax.tree.leaves(resumed.lora), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow  # two trainings
def test_a_lora_trained_on_an_fp8_base_works_on_the_bf16_base_and_on_the_fp8_one(photos, tmp_path):
    """The LoRA trained on the FP8 base and the one trained on the unquantized base, each put on either base: the
    FP8-trained one changes the velocity as the other does, up to a gap stated relative to the LoRA's effect."""
    pipes = {fmt: quantized_pipeline(tmp_path, fmt) for fmt in ("bf16", "fp8_e4m3")}
    trained = {}
    for fmt, pipe in pipes.items():
        train(pipe, photos, tmp_path / f"run-{fmt}", CONFIG, LORA, model_tag=f"demo-{fmt}", progress=False)
        trained[fmt] = {name: (a.A[...], a.B[...]) for name, a in adapters(pipe.transformer)}
    cfg = pipes["bf16"].transformer.config
    key = jax.random.key(5)
    latents = jax.random.normal(key, (2, 16, cfg.in_channels))
    embeds = jax.random.normal(jax.random.fold_in(key, 1), (2, 8, cfg.num_text_layers, cfg.text_hidden_dim))
    ids = jnp.asarray(np.concatenate([np.zeros((8, 3), np.float32), image_position_ids(4, 4)]))
    mask = jnp.asarray(np.arange(8)[None, :] < np.array([[5], [8]]))

    def velocity(base: str, lora: str | None) -> np.ndarray:
        model = pipes[base].transformer
        for name, adapter in adapters(model):
            A, B = trained[lora][name] if lora else (adapter.A[...], jnp.zeros_like(adapter.B[...]))
            adapter.A.set_value(A)
            adapter.B.set_value(B)
        return np.asarray(model(latents, embeds, jnp.array([0.4, 0.7]), ids, mask))

    for base in pipes:
        effect = velocity(base, "bf16") - velocity(base, None)
        gap = relative_l2(velocity(base, "fp8_e4m3"), velocity(base, "bf16")) * np.linalg.norm(
            velocity(base, "bf16")) / np.linalg.norm(effect)
        print(f"{base} base: the fp8-trained LoRA's velocity differs from the bf16-trained one's by {gap:.3f} of the "
              f"LoRA's effect ({np.linalg.norm(effect) / np.linalg.norm(velocity(base, None)):.3f} of the velocity)")
        assert np.isfinite(gap) and gap < GAP_BOUND
