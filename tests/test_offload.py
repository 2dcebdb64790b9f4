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
