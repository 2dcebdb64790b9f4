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
    # measured: 1.7e-6 apart at most (the streamed blocks are separate programs), 3.0e-7 from diffusers' output
    np.testing.assert_allclose(np.asarray(out), np.asarray(model(*args)), rtol=0, atol=5e-6)
    assert float(jnp.linalg.norm(out - expected) / jnp.linalg.norm(expected)) <= 1e-6


def test_later_steps_reuse_the_first_steps_programs(tiny_and_inputs):
    """A step fed the previous step's output (a committed device array) runs the programs the first step compiled
    for numpy / jnp inputs: before, each program compiled again at the second step (tens of seconds on the GPU)."""
    model, args, _ = tiny_and_inputs
    streamed = StreamedKrea2(nnx.clone(model), resident=1, prefetch=1)
    out = streamed(*args)
    sizes = streamed._block._cache_size()
    assert sizes >= 1
    for _ in range(2):
        out = streamed(out.astype(jnp.float32), *args[1:])
    assert streamed._block._cache_size() == sizes


def test_bad_streaming_arguments_are_named(tiny_and_inputs):
    model, _, _ = tiny_and_inputs
    with pytest.raises(ValueError, match="resident must be between 0 and the 2 blocks"):
        StreamedKrea2(model, resident=3)
    with pytest.raises(ValueError, match="prefetch must be at least 1"):
        StreamedKrea2(model, resident=0, prefetch=0)


@pytest.mark.parametrize("resident, prefetch", [(0, 1), (1, 2), (3, 1), (2, 3), (8, 2)])
def test_at_most_prefetch_plus_one_streamed_blocks_are_on_the_device(resident, prefetch, monkeypatch):
    """Every streamed block is copied once, before its program runs, and never more than prefetch + 1 streamed
    blocks' device copies are alive (what the device memory budget assumes), counted on a stand-in stream of 8
    blocks whose programs record what they see."""
    from mxdit.model import offload

    stream = offload._BlockStream([nnx.Linear(2, 2, rngs=nnx.Rngs(i)) for i in range(8)], resident=resident,
                                  prefetch=prefetch)
    live, seen, most, copies = {}, [], 0, 0
    put = offload.jax.device_put

    def counting_put(state, sharding):
        nonlocal most, copies
        copy = put(state, sharding)
        live[id(copy)] = copy
        most, copies = max(most, len(live)), copies + 1
        return copy

    def program(i):
        def run(state, carry):
            seen.append((i, state["kernel"].get_value().sharding.memory_kind))
            live.pop(id(state), None)  # dropped after its program (the stream holds no reference afterwards)
            return carry + 1
        return run

    monkeypatch.setattr(offload.jax, "device_put", counting_put)
    assert stream.run([program(i) for i in range(8)], 0) == 8
    assert [i for i, _ in seen] == list(range(8)) and all(kind == "device" for _, kind in seen)
    assert copies == 8 - resident and most <= prefetch + 1


def test_offloaded_pipeline_makes_the_same_image(tmp_path):
    """The pipeline with its joint blocks streamed (`offload_pipeline`) gives the unstreamed latents."""
    from mxdit.model.offload import offload_pipeline
    from mxdit.model.pipeline_krea2 import demo_pipeline

    kwargs = dict(height=64, width=64, num_inference_steps=2, seed=3, max_sequence_length=16, output_type="latent")
    pipe = demo_pipeline(tmp_path / "tok", dtype=jnp.float32)
    expected = pipe("a red fox", **kwargs).latents
    streamed = offload_pipeline(demo_pipeline(tmp_path / "tok2", dtype=jnp.float32), resident=1)
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


def test_stacking_host_memory_blocks_keeps_them_there():
    """`stack_projections` on streamed blocks (generate.py --offload stacks after loading): the stacked weights stay
    in host memory (stacked on the device: XLA's host compute for it was slow) and equal the device-stacked ones."""
    from mxdit.model.krea2 import stack_projections
    from mxdit.model.loading import place_parameters
    from mxdit.model.offload import streamed_block_placement

    with place_parameters(streamed_block_placement(1)):
        streamed = Krea2Transformer.from_pretrained(FIXTURES / "krea2" / "tiny", jnp.float32)
    plain = Krea2Transformer.from_pretrained(FIXTURES / "krea2" / "tiny", jnp.float32)
    assert stack_projections(streamed) == stack_projections(plain) > 0
    kind = lambda module: {x.sharding.memory_kind for x in jax.tree.leaves(nnx.state(module))}
    assert kind(streamed.transformer_blocks[1]) == {"pinned_host"} and kind(streamed.transformer_blocks[0]) == {"device"}
    block = streamed.transformer_blocks[1]
    assert block.attn.to_qkvg is not None and block.ff.gate_up is not None
    for a, b in zip(jax.tree.leaves(nnx.state(streamed)), jax.tree.leaves(nnx.state(plain)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_quantized_checkpoint_loads_streamed_blocks_into_host_memory(tmp_path):
    """`load_quantized_model` under `streamed_block_placement` (generate.py --quantized with --offload): the file is
    read into host memory, the resident blocks' kernel weights go to the device, the streamed ones to pinned host
    memory; the same weights as loading it whole."""
    from mxdit.model.loading import iter_params, place_parameters
    from mxdit.model.offload import streamed_block_placement
    from mxdit.quant.model import krea2_rules, load_quantized_model, quantize_model, save_quantized

    model = Krea2Transformer.from_pretrained(FIXTURES / "krea2" / "tiny", jnp.float32)
    path = tmp_path / "q.safetensors"
    save_quantized(quantize_model(dict(iter_params(model)), krea2_rules("fp8_e4m3")), path)
    build = lambda: Krea2Transformer(model.config, dtype=jnp.float32, rngs=nnx.Rngs(0))
    with place_parameters(streamed_block_placement(1)):
        streamed = load_quantized_model(build, path)
    whole = load_quantized_model(build, path)
    kind = lambda module: {x.sharding.memory_kind for x in jax.tree.leaves(nnx.state(module))}
    assert kind(streamed.transformer_blocks[0]) == {"device"} and kind(streamed.transformer_blocks[1]) == {"pinned_host"}
    assert kind(streamed.img_in) == {"device"}
    for a, b in zip(jax.tree.leaves(nnx.state(streamed)), jax.tree.leaves(nnx.state(whole)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("resident, prefetch", [(0, 1), (1, 2), (2, 1), (3, 2), (4, 1)])
def test_streamed_flux_gives_the_transformer_output(resident, prefetch):
    """FLUX.1's double blocks, then its single ones, streamed in running order (prefetches crossing from the double
    to the single blocks): the transformer's output, and diffusers'."""
    from mxdit.model.flux import FluxTransformer
    from mxdit.model.offload import StreamedFlux

    model = FluxTransformer.from_pretrained(FIXTURES / "flux" / "tiny", jnp.float32)
    ref = dict(np.load(FIXTURES / "flux" / "reference.npz"))
    args = tuple(ref[k] for k in ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep",
                                  "img_ids", "txt_ids", "guidance"))
    expected = np.asarray(model(*args))
    streamed = StreamedFlux(nnx.clone(model), resident=resident, prefetch=prefetch)
    kinds = [jax.tree.leaves(s)[0].sharding.memory_kind for s in streamed.block_states]
    assert kinds == ["device"] * resident + ["pinned_host"] * (4 - resident)
    out = np.asarray(streamed(*args))
    # measured: 7.2e-7 apart at most, 7.6e-6 from diffusers' output (the unstreamed model's own distance)
    np.testing.assert_allclose(out, expected, rtol=0, atol=2e-6)
    assert float(np.linalg.norm(out - ref["output"]) / np.linalg.norm(ref["output"])) <= 2e-5


def test_flux_placement_counts_single_blocks_after_the_double_ones():
    from mxdit.model.flux import FluxTransformer
    from mxdit.model.loading import place_parameters
    from mxdit.model.offload import streamed_placement_for_folder

    folder = FIXTURES / "flux" / "tiny_pipeline"
    with place_parameters(streamed_placement_for_folder(folder, 3)):
        model = FluxTransformer.from_pretrained(folder / "transformer", jnp.float32)
    kind = lambda module: {x.sharding.memory_kind for x in jax.tree.leaves(nnx.state(module))}
    assert [kind(b) for b in model.transformer_blocks] == [{"device"}, {"device"}]
    assert [kind(b) for b in model.single_transformer_blocks] == [{"device"}, {"pinned_host"}]
    assert kind(model.proj_out) == {"device"}


# -- MiniMax H3 ------------------------------------------------------------------------------------------------------

H3_ARGUMENTS = ("hidden_states", "audio_hidden_states", "encoder_hidden_states", "timestep", "timestep_indices",
                "token_tags", "position_ids", "video_indices", "audio_indices", "text_indices")


@pytest.fixture(scope="module")
def tiny_h3():
    from mxdit.model.minimax_h3 import MiniMaxH3Transformer

    return MiniMaxH3Transformer.from_pretrained(FIXTURES / "minimax_h3" / "tiny", dtype=jnp.float32)


@pytest.mark.parametrize("resident, prefetch", [(0, 1), (1, 1), (0, 2), (2, 1)])
def test_streamed_minimax_h3_gives_the_transformer_output(tiny_h3, resident, prefetch):
    from mxdit.model.offload import StreamedMiniMaxH3

    ref = dict(np.load(FIXTURES / "minimax_h3" / "reference.npz"))
    args = tuple(jnp.asarray(ref[k]) for k in H3_ARGUMENTS)
    expected = tiny_h3(*args)
    streamed = StreamedMiniMaxH3(nnx.clone(tiny_h3), resident=resident, prefetch=prefetch)
    kinds = [jax.tree.leaves(s)[0].sharding.memory_kind for s in streamed.block_states]
    assert kinds == ["device"] * resident + ["pinned_host"] * (len(kinds) - resident)
    # measured: 1.2e-7 apart at most; 2.3e-7 / 1.4e-7 from diffusers, as the unstreamed model
    for got, want, diffusers in zip(streamed(*args), expected, (ref["sample"], ref["audio_sample"])):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6)
        assert float(jnp.linalg.norm(got - diffusers) / jnp.linalg.norm(diffusers)) <= 1e-6


def test_streamed_minimax_h3_denoises_as_diffusers(tiny_h3):
    """The denoising loop on the streamed transformer (`StreamedMiniMaxH3.denoise_step`): diffusers' latents."""
    from mxdit.model import pipeline_minimax_h3 as h3
    from mxdit.model.offload import StreamedMiniMaxH3

    ref = dict(np.load(FIXTURES / "minimax_h3" / "denoising_reference.npz"))
    patch = tiny_h3.config.patch_size
    layout = h3.packed_layout(ref["prompt_embeds"].shape[1], int(ref["num_latent_frames"]),
                              int(ref["latent_height"]), int(ref["latent_width"]), int(ref["num_audio_latents"]),
                              patch)
    streamed = StreamedMiniMaxH3(nnx.clone(tiny_h3), resident=1, prefetch=1)
    video, audio = h3.denoise(None, layout, jnp.asarray(ref["prompt_embeds"]),
                              h3.patchify(jnp.asarray(ref["initial_latents"]), patch),
                              jnp.asarray(ref["initial_audio_rows"])[None], int(ref["steps"]),
                              step=streamed.denoise_step)
    latents = h3.unpatchify(video, layout.num_latent_frames, layout.latent_height, layout.latent_width, patch)
    audio_latents = h3.audio_rows_to_latents(audio, layout.num_audio_latents).transpose(0, 2, 1)
    for got, want in ((latents, ref["latents"]), (audio_latents, ref["audio_latents"])):  # measured 8.3e-8, 7.2e-8
        assert float(jnp.linalg.norm(got - want) / np.linalg.norm(want)) <= 5e-7


@pytest.mark.slow  # about 34 s on 2 cores: two demo pipelines
def test_offloaded_video_pipeline_makes_the_same_video(tmp_path):
    from mxdit.model.pipeline_minimax_h3 import demo_pipeline

    kwargs = dict(height=32, width=64, num_steps=3, seed=2)
    expected = demo_pipeline(tmp_path / "tok")("a red fox", **kwargs)
    pipe = demo_pipeline(tmp_path / "tok2").offloaded(1, prefetch=1)
    assert [jax.tree.leaves(s)[0].sharding.memory_kind for s in pipe.denoise_step_fn.__self__.block_states] == [
        "device", "pinned_host"]
    out = pipe("a red fox", **kwargs)  # measured: equal (latents up to 6.6); the blocks run as separate programs
    np.testing.assert_allclose(out.latents, expected.latents, rtol=0, atol=1e-6)
    np.testing.assert_allclose(out.audio_latents, expected.audio_latents, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="offload -1: the number of resident blocks must be >= 0"):
        demo_pipeline(tmp_path / "tok3").offloaded(-1)
