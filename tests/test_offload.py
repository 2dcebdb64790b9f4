"""Weight streaming: the Krea 2 transformer with some joint blocks' weights in host memory, copied ahead of use."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import FIXTURES
from mxdit.model.krea2 import Krea2Transformer
from mxdit.model.offload import StreamedKrea2


@pytest.fixture(scope="module")
def tiny_and_inputs():
    model = Krea2Transformer.from_pretrained(FIXTURES / "krea2" / "tiny", jnp.float32)
    ref = dict(np.load(FIXTURES / "krea2" / "reference.npz"))
    args = (ref["hidden_states"], ref["encoder_hidden_states"], ref["timestep"], ref["position_ids"],
            ref["encoder_attention_mask"])
    return model, args, ref["output_masked"]


@pytest.mark.parametrize("resident, prefetch", [(0, 1), (1, 1), (0, 2), (2, 1)])
def test_streamed_blocks_give_the_transformer_output(tiny_and_inputs, resident, prefetch):
    model, args, expected = tiny_and_inputs
    streamed = StreamedKrea2(nnx.clone(model), resident=resident, prefetch=prefetch)
    kinds = [jax.tree.leaves(s)[0].sharding.memory_kind for s in streamed.block_states]
    assert kinds == ["device"] * resident + ["pinned_host"] * (len(kinds) - resident)
    out = streamed(*args)
    np.testing.assert_allclose(np.asarray(out), np.asarray(model(*args)), rtol=0, atol=1e-5)
    assert float(jnp.linalg.norm(out - expected) / jnp.linalg.norm(expected)) <= 1e-4  # diffusers' output


def test_bad_streaming_arguments_are_named(tiny_and_inputs):
    model, _, _ = tiny_and_inputs
    with pytest.raises(ValueError, match="resident must be between 0 and the 2 blocks"):
        StreamedKrea2(model, resident=3)
    with pytest.raises(ValueError, match="prefetch must be at least 1"):
        StreamedKrea2(model, resident=0, prefetch=0)


def test_offloaded_pipeline_makes_the_same_image(tmp_path):
    """The pipeline with its joint blocks streamed (`offload_krea2_pipeline`) gives the unstreamed latents."""
    from mxdit.model.offload import offload_krea2_pipeline
    from mxdit.model.pipeline_krea2 import demo_pipeline

    kwargs = dict(height=64, width=64, num_inference_steps=2, seed=3, max_sequence_length=16, output_type="latent")
    pipe = demo_pipeline(tmp_path / "tok", dtype=jnp.float32)
    expected = pipe("a red fox", **kwargs).latents
    streamed = offload_krea2_pipeline(demo_pipeline(tmp_path / "tok2", dtype=jnp.float32), resident=1)
    np.testing.assert_allclose(streamed("a red fox", **kwargs).latents, expected, rtol=0, atol=1e-5)


def test_loading_places_streamed_blocks_in_host_memory():
    """`place_parameters` + `streamed_block_placement`: blocks from `resident` on are in pinned host memory as they
    load, the rest on the device."""
    from mxdit.model.loading import place_parameters
    from mxdit.model.offload import streamed_block_placement

    with place_parameters(streamed_block_placement(1)):
        model = Krea2Transformer.from_pretrained(FIXTURES / "krea2" / "tiny", jnp.float32)
    kind = lambda module: {x.sharding.memory_kind for x in jax.tree.leaves(nnx.state(module))}
    assert kind(model.transformer_blocks[0]) == {"device"} and kind(model.transformer_blocks[1]) == {"pinned_host"}
    assert kind(model.img_in) == {"device"}
