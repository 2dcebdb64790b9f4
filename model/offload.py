"""Weight streaming (`generate.py --offload`, `generate_video.py --offload`): a Krea 2, FLUX.1 or MiniMax H3
transformer on a GPU smaller than the model.

The first `resident` blocks (in running order: Krea 2's and H3's transformer blocks; FLUX.1's double, then single
blocks) keep their
weights on the device; the others live in pinned host memory. Each block runs as one compiled program (blocks of one
kind share one structure, so one compilation serves them all), the embedding and the final layer as two more. Each
streamed block's weights are copied by a `device_put` of their own, issued `prefetch` blocks ahead; the runtime runs
it on its host-to-device stream beside the programs dispatched after it. What the device waits for per step (the
"exposed" transfer time) is the streamed step's time minus the all-resident one (`scripts/benchmark.py
krea2-offload`; FLUX.1's streaming is CPU-tested only).

FP8 Krea 2 under a 24 GB cap: a block's 0.43 GB cross PCIe in about twice a block's compute at 4224 tokens, and
beside a `device_put` a block takes the copy's time, not the sum; with 20 of 28 blocks resident and prefetch 4, about
3% of a step waits for copies (docs/performance.md). A copy made inside the program of an earlier block would be
scheduled before that block's compute and add to it: hence a `device_put` of its own a block.
"""

from __future__ import annotations

import copy
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from .flux import FluxTransformer
from .krea2 import Krea2Transformer
from . import pipeline_flux, pipeline_krea2, pipeline_minimax_h3
from .pipeline_flux import FluxPipeline
from .pipeline_krea2 import Krea2Pipeline
from .pipeline_minimax_h3 import MiniMaxH3Pipeline


class _BlockStream:
    """The blocks of a model in running order, the first `resident` with their weights on the device, the others in
    pinned host memory; `run` calls each block's program with its weights on the device."""

    def __init__(self, blocks, *, resident: int, prefetch: int):
        if not 0 <= resident <= len(blocks):
            raise ValueError(f"resident must be between 0 and the {len(blocks)} blocks, got {resident}")
        if prefetch < 1:
            raise ValueError(f"prefetch must be at least 1, got {prefetch}")
        self.resident, self.prefetch = resident, prefetch
        device = jax.devices()[0]
        self.on_device = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
        on_host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
        self.states = [nnx.state(b) if i < resident else jax.device_put(nnx.state(b), on_host)
                       for i, b in enumerate(blocks)]

    def run(self, programs, carry):
        """`programs[i](state, carry) -> carry` for each block i in order, `state` block i's weights on the device.

        Before the program of block i, the streamed blocks up to i + prefetch are copied (at the step's start the
        first prefetch + 1 of them: no streamed block holds device memory then), each by a `device_put` of its own,
        which the runtime runs on its host-to-device stream beside the programs dispatched after it. Dispatch runs
        ahead of the device, but device memory stays bounded: at most prefetch + 1 streamed blocks' weights are alive
        at once, each dropped (freed) once its block's program is dispatched."""
        n, resident, prefetch = len(self.states), self.resident, self.prefetch
        copies, issued = {}, resident
        for i in range(n):
            upto = min(n, max(i, resident) + prefetch + 1)
            for j in range(issued, upto):
                copies[j] = jax.device_put(self.states[j], self.on_device)
            issued = max(issued, upto)
            carry = programs[i](copies.pop(i) if i >= resident else self.states[i], carry)
        return carry


class _Streamed:
    """What both streamed transformers share: the block stream, the rest of the model (everything but the blocks:
    what the pipeline keeps of the transformer) and its embedding and final programs."""

    block_lists: tuple[str, ...] = ()  # the model's lists of blocks, in running order
    finish_static: tuple[int, ...] = (3,)  # the static arguments of the jitted `finish(state, ...)`

    def __init__(self, model: nnx.Module, *, resident: int, prefetch: int):
        lists = self.block_lists
        blocks = [block for name in lists for block in getattr(model, name)]
        self.stream = _BlockStream(blocks, resident=resident, prefetch=prefetch)
        self.block_states = self.stream.states
        self.block_graphs = {name: nnx.graphdef(getattr(model, name)[0]) for name in lists if len(getattr(model, name))}
        rest = nnx.merge(*nnx.split(model))  # a copy of the graph, its block lists emptied
        for name in lists:
            setattr(rest, name, nnx.List([]))
        self.rest_graph, self.rest_state = nnx.split(rest)
        self.rest_model = rest
        self.config, self.dtype = model.config, model.dtype
        embed = jax.jit(lambda state, *args: nnx.merge(self.rest_graph, state).embed(*args))
        # The inputs committed to the device: jit compiles an uncommitted array (the first step's, made by jnp) and
        # a committed one (a later step's, a program's output) apart, and every block program after them, so the
        # second step would compile everything again.
        self._embed = lambda state, *args: embed(state, *jax.device_put(args, self.stream.on_device))
        self._finish = jax.jit(lambda state, *args: nnx.merge(self.rest_graph, state).finish(*args),
                               static_argnums=self.finish_static)

    def _block_program(self, list_name: str, run: str):
        """The jitted program of one block of `list_name`: `model.<run>(block, *args)`."""
        graph = self.block_graphs[list_name]

        @jax.jit
        def program(rest_state, state, args):
            return getattr(nnx.merge(self.rest_graph, rest_state), run)(nnx.merge(graph, state), *args)

        return program


class StreamedKrea2(_Streamed):
    """Call as the transformer: `streamed(hidden_states, encoder_hidden_states, timestep, position_ids, mask)`.

    resident: how many of the first joint blocks stay on the device (all: nothing is streamed).
    prefetch: how many streamed blocks are copied ahead of the one that runs (their device memory is the cost).
    The model is taken apart: its streamed blocks' weights are copied to host memory; drop the model afterwards so
    that their device copies are freed.
    """

    block_lists = ("transformer_blocks",)

    def __init__(self, model: Krea2Transformer, *, resident: int, prefetch: int = 2):
        super().__init__(model, resident=resident, prefetch=prefetch)
        self._block = self._block_program("transformer_blocks", "run_block")

    def __call__(self, hidden_states, encoder_hidden_states, timestep, position_ids, encoder_attention_mask=None):
        x, temb, temb_mod, rotary, kv_lengths = self._embed(self.rest_state, hidden_states, encoder_hidden_states,
                                                            timestep, position_ids, encoder_attention_mask)

        def program(state, x):
            return self._block(self.rest_state, state, (x, temb_mod, rotary, kv_lengths))

        x = self.stream.run([program] * len(self.block_states), x)
        return self._finish(self.rest_state, x, temb, hidden_states.shape[1])

    def denoise_step(self, latents, embeds, mask, ids, t, sigma, sigma_next, guidance, cfg: bool):
        """`pipeline_krea2.denoise_step` on the streamed transformer (the pipeline's `denoise_step_fn`). Not its
        unjitted `_denoise_step`, as StreamedFlux uses FLUX.1's: run eagerly, the guided Euler step rounds differently
        from the jitted one the unstreamed pipeline runs (one pixel level apart in a test image)."""
        x = jnp.concatenate([latents, latents]) if cfg else latents
        velocity = self(x.astype(self.dtype), embeds, jnp.full((x.shape[0],), t, jnp.float32), ids, mask)
        return _guided_euler(latents, velocity, sigma, sigma_next, guidance, cfg)


class StreamedFlux(_Streamed):
    """FLUX.1's transformer with weight streaming, as `StreamedKrea2`: call it as the transformer. The blocks run
    in order, the double blocks, then the single ones; `resident` counts from the first double block."""

    block_lists = ("transformer_blocks", "single_transformer_blocks")

    def __init__(self, model: FluxTransformer, *, resident: int, prefetch: int = 2):
        super().__init__(model, resident=resident, prefetch=prefetch)
        self.num_double = len(model.transformer_blocks)
        self._double = self._block_program("transformer_blocks", "run_double_block")
        if len(model.single_transformer_blocks):
            self._single = self._block_program("single_transformer_blocks", "run_single_block")
        self._join = jax.jit(lambda x, context: jnp.concatenate([context, x], axis=1))

    def __call__(self, hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids,
                 guidance=None):
        x, context, temb, rotary = self._embed(self.rest_state, hidden_states, encoder_hidden_states,
                                               pooled_projections, timestep, img_ids, txt_ids, guidance)
        text_len = context.shape[1]

        def double(state, carry):
            return self._double(self.rest_state, state, (*carry, temb, rotary))

        def first_single(state, carry):  # the streams joined [text, image] before it
            return single(state, self._join(*carry))

        def single(state, x):
            return self._single(self.rest_state, state, (x, temb, rotary))

        n_single = len(self.block_states) - self.num_double
        programs = [double] * self.num_double + ([first_single] + [single] * (n_single - 1) if n_single else [])
        carry = self.stream.run(programs, (x, context))
        x = carry if n_single else self._join(*carry)
        return self._finish(self.rest_state, x, temb, text_len)

    def denoise_step(self, *args):
        """`pipeline_flux.denoise_step` on the streamed transformer (the pipeline's `denoise_step_fn`), as
        `StreamedKrea2.denoise_step`."""
        return pipeline_flux._denoise_step(self, *args)


class StreamedMiniMaxH3(_Streamed):
    """MiniMax H3's transformer with weight streaming, as `StreamedKrea2`: call it as the transformer (without
    `padding`). Its `denoise_step` is the pipeline's step (`MiniMaxH3Pipeline.denoise_step_fn`)."""

    block_lists = ("transformer_blocks",)
    finish_static = ()

    def __init__(self, model, *, resident: int, prefetch: int = 2):
        super().__init__(model, resident=resident, prefetch=prefetch)
        self._block = self._block_program("transformer_blocks", "run_block")

    def __call__(self, hidden_states, audio_hidden_states, encoder_hidden_states, timestep, timestep_indices,
                 token_tags, position_ids, video_indices, audio_indices, text_indices):
        structure = (timestep_indices, video_indices, audio_indices)
        x, temb, adaln_indices, rotary, _ = self._embed(
            self.rest_state, hidden_states, audio_hidden_states, encoder_hidden_states, timestep, timestep_indices,
            token_tags, position_ids, video_indices, audio_indices, text_indices)

        def program(state, x):
            return self._block(self.rest_state, state, (x, temb, adaln_indices, rotary))

        x = self.stream.run([program] * len(self.block_states), x)
        return self._finish(self.rest_state, x, temb, *jax.device_put(structure, self.stream.on_device))

    def denoise_step(self, prompt_embeds, video_rows, audio_rows, structure, sigma, audio_sigma):
        """`pipeline_minimax_h3.denoise_step` on the streamed transformer."""
        return pipeline_minimax_h3.denoise_step(self, prompt_embeds, video_rows, audio_rows, structure, sigma,
                                                audio_sigma, flow=_h3_flow_steps)


_h3_flow_steps = jax.jit(pipeline_minimax_h3.flow_steps)
_guided_euler = jax.jit(pipeline_krea2.guided_euler_step, static_argnums=5)


def streamed_block_placement(resident: int, num_double_blocks: int = 0):
    """For `loading.place_parameters`: the weights of the blocks from `resident` on (in running order) to pinned host
    memory as they are read, so the transformer loads on a device smaller than it. The running order: Krea 2's
    joint blocks; FLUX.1's double blocks (`transformer_blocks`), then its single blocks, which come after the
    `num_double_blocks` double ones."""
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    first = {"transformer_blocks": 0, "single_transformer_blocks": num_double_blocks}

    def place(key: str, value: jax.Array) -> jax.Array:
        parts = key.split(".")
        if parts[0] in first and len(parts) > 1 and parts[1].isdigit() and first[parts[0]] + int(parts[1]) >= resident:
            return jax.device_put(value, host)
        return value

    return place


def streamed_placement_for_folder(folder: str | Path, resident: int):
    """`streamed_block_placement` for the model folder's pipeline (FLUX.1's double-block count from its
    transformer/config.json)."""
    from .loading import read_json

    folder = Path(folder)
    if read_json(folder / "model_index.json").get("_class_name") == "FluxPipeline":
        return streamed_block_placement(resident, int(read_json(folder / "transformer" / "config.json")["num_layers"]))
    return streamed_block_placement(resident)


def offload_pipeline(pipe: Krea2Pipeline | FluxPipeline | MiniMaxH3Pipeline, *, resident: int, prefetch: int = 2):
    """A copy of `pipe` whose denoising streams the transformer's blocks after the first `resident` (in running
    order; more than there are: all resident) from host memory (`StreamedKrea2`, `StreamedFlux`,
    `StreamedMiniMaxH3`). `pipe` should not be used afterwards: its transformer was taken apart."""
    streamed_type = (StreamedFlux if isinstance(pipe, FluxPipeline) else
                     StreamedMiniMaxH3 if isinstance(pipe, MiniMaxH3Pipeline) else StreamedKrea2)
    blocks = sum(len(getattr(pipe.transformer, name)) for name in streamed_type.block_lists)
    streamed = streamed_type(pipe.transformer, resident=min(resident, blocks), prefetch=prefetch)
    out = copy.copy(pipe)
    out.transformer = streamed.rest_model
    out.denoise_step_fn = streamed.denoise_step
    return out
