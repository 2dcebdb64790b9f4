"""Weight streaming (`generate.py --offload`): a Krea 2 or FLUX.1 transformer on a GPU smaller than the model.

The first `resident` blocks (in running order: Krea 2's joint blocks; FLUX.1's double, then single blocks) keep their
weights on the device; the others live in pinned host memory. Each block runs as one compiled program (blocks of one
kind share one structure, so one compilation serves them all), the embedding and the final layer as two more; the
program of block i also copies block i + `prefetch`'s weights to the device, and XLA runs that copy beside the
block's compute. What the device waits for per step (the "exposed" transfer time) is the
streamed step's time minus the all-resident one (`scripts/benchmark.py krea2-offload`; FLUX.1's streaming is
CPU-tested only).

Measured on the H200 (NOTES.md, session 5): a bf16 block (0.87 GB) crosses PCIe in 16.7 ms (52 GB/s) and computes in
6.7 ms at 4224 tokens, so the copies overlap the compute but streamed blocks are copy-bound: 18 of 28 blocks resident
under a 24 GB cap, 0.273 s a step against 0.187 all resident (31.7% exposed; 79.7% when each copy was its own
`device_put` and the host waited per block). FP8 blocks (0.43 GB, session 6): 20 of 28 resident 0.174 s against
0.120, 10 resident 0.254 (31% and 53% exposed), ~7 ms a streamed block where the copy alone should take ~8.3 and
overlap ~4.2 of compute. The first repeat of every capped run took 11-12 s a step: the second step's inputs were
committed arrays where the first's were not, and jit compiled all programs again (found on the CPU with
JAX_LOG_COMPILES; the inputs are now committed first).
"""

from __future__ import annotations

import copy
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from .flux import FluxTransformer
from .krea2 import Krea2Transformer
from . import pipeline_flux, pipeline_krea2
from .pipeline_flux import FluxPipeline
from .pipeline_krea2 import Krea2Pipeline


# How a streamed block's weights reach the device: "program", by the program of the block `prefetch` earlier (XLA's
# copy-start/copy-done inside it; measured: XLA 0.11.2 schedules the copy before the block's compute, so the two
# add up); "host", by a `device_put` of its own, which the runtime runs on its host-to-device stream.
COPIES = ("program", "host")


class _BlockStream:
    """The blocks of a model in running order, the first `resident` with their weights on the device, the others in
    pinned host memory; `run` calls each block's program with the weights of a later block to copy."""

    def __init__(self, blocks, *, resident: int, prefetch: int, copies: str = "program"):
        if not 0 <= resident <= len(blocks):
            raise ValueError(f"resident must be between 0 and the {len(blocks)} blocks, got {resident}")
        if prefetch < 1:
            raise ValueError(f"prefetch must be at least 1, got {prefetch}")
        if copies not in COPIES:
            raise ValueError(f"copies must be one of {', '.join(COPIES)}, got {copies!r}")
        self.resident, self.prefetch, self.copies = resident, prefetch, copies
        device = jax.devices()[0]
        self.on_device = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
        on_host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
        self.states = [nnx.state(b) if i < resident else jax.device_put(nnx.state(b), on_host)
                       for i, b in enumerate(blocks)]

    def copy_to_device(self, ahead):
        """Inside a block's program: the later block's weights to the device. XLA runs this host-to-device copy,
        which nothing in the program uses, beside the compute (measured: a block and a copy together take the copy's
        time, not the sum)."""
        return None if ahead is None else jax.device_put(ahead, self.on_device)

    def run(self, programs, carry):
        """`programs[i](state, carry, ahead) -> (carry, copy)` for each block i in order: `state` block i's weights
        on the device, `ahead` a later block's host weights (or None) whose device copy the program returns."""
        if self.copies == "host":
            return self._run_host_copies(programs, carry)
        n, resident, prefetch = len(self.states), self.resident, self.prefetch
        copies = {}  # streamed block -> its weights on the device, made by the program `prefetch` blocks earlier
        for i in range(resident, min(resident + prefetch, n)):
            if i < prefetch:  # no earlier block's program to carry this one: copied before the first
                copies[i] = jax.device_put(self.states[i], self.on_device)
        for i in range(n):
            state = copies.pop(i) if i >= resident else self.states[i]
            j = i + prefetch
            ahead = self.states[j] if max(resident, prefetch) <= j < n else None
            # Dispatch runs ahead of the device; device memory stays bounded because each copy is made by a block's
            # program, in order, and dropped (freed) once its block has run.
            carry, copy = programs[i](state, carry, ahead)
            if copy is not None:
                copies[j] = copy
        return carry

    def _run_host_copies(self, programs, carry):
        """`run` with each copy its own `device_put`, issued before the program of block i for the streamed blocks
        up to i + prefetch (at the step's start the first prefetch + 1 of them: no streamed block holds device
        memory then). The runtime copies on its host-to-device stream, after the programs dispatched before the
        copy (whose memory it may reuse) and beside the ones after it; at most prefetch + 1 streamed blocks are on
        the device at once, as with copies inside the programs."""
        n, resident, prefetch = len(self.states), self.resident, self.prefetch
        copies, issued = {}, resident
        for i in range(n):
            upto = min(n, max(i, resident) + prefetch + 1)
            for j in range(issued, upto):
                copies[j] = jax.device_put(self.states[j], self.on_device)
            issued = max(issued, upto)
            state = copies.pop(i) if i >= resident else self.states[i]
            carry, _ = programs[i](state, carry, None)
        return carry


class _Streamed:
    """What both streamed transformers share: the block stream, the rest of the model (everything but the blocks:
    what the pipeline keeps of the transformer) and its embedding and final programs."""

    block_lists: tuple[str, ...] = ()  # the model's lists of blocks, in running order

    def __init__(self, model: nnx.Module, *, resident: int, prefetch: int, copies: str = "program"):
        lists = self.block_lists
        blocks = [block for name in lists for block in getattr(model, name)]
        self.stream = _BlockStream(blocks, resident=resident, prefetch=prefetch, copies=copies)
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
        # second step compiled everything again: the capped runs' "slow first repeat" of sessions 5 and 6.
        self._embed = lambda state, *args: embed(state, *jax.device_put(args, self.stream.on_device))
        self._finish = jax.jit(lambda state, x, temb, n: nnx.merge(self.rest_graph, state).finish(x, temb, n),
                               static_argnums=3)

    def _block_program(self, list_name: str, run: str):
        """The jitted program of one block of `list_name`: `model.<run>(block, *args)`, and the copy of `ahead`."""
        graph = self.block_graphs[list_name]

        @jax.jit
        def program(rest_state, state, args, ahead):
            out = getattr(nnx.merge(self.rest_graph, rest_state), run)(nnx.merge(graph, state), *args)
            return out, self.stream.copy_to_device(ahead)

        return program


class StreamedKrea2(_Streamed):
    """Call as the transformer: `streamed(hidden_states, encoder_hidden_states, timestep, position_ids, mask)`.

    resident: how many of the first joint blocks stay on the device (all: nothing is streamed).
    prefetch: how many streamed blocks are copied ahead of the one that runs (their device memory is the cost).
    copies: how a streamed block's weights reach the device (`COPIES`).
    The model is taken apart: its streamed blocks' weights are copied to host memory; drop the model afterwards so
    that their device copies are freed.
    """

    block_lists = ("transformer_blocks",)

    def __init__(self, model: Krea2Transformer, *, resident: int, prefetch: int = 2, copies: str = "program"):
        super().__init__(model, resident=resident, prefetch=prefetch, copies=copies)
        self._block = self._block_program("transformer_blocks", "run_block")

    def __call__(self, hidden_states, encoder_hidden_states, timestep, position_ids, encoder_attention_mask=None):
        x, temb, temb_mod, rotary, kv_lengths = self._embed(self.rest_state, hidden_states, encoder_hidden_states,
                                                            timestep, position_ids, encoder_attention_mask)

        def program(state, x, ahead):
            return self._block(self.rest_state, state, (x, temb_mod, rotary, kv_lengths), ahead)

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

    def __init__(self, model: FluxTransformer, *, resident: int, prefetch: int = 2, copies: str = "program"):
        super().__init__(model, resident=resident, prefetch=prefetch, copies=copies)
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

        def double(state, carry, ahead):
            return self._double(self.rest_state, state, (*carry, temb, rotary), ahead)

        def first_single(state, carry, ahead):  # the streams joined [text, image] before it
            return single(state, self._join(*carry), ahead)

        def single(state, x, ahead):
            return self._single(self.rest_state, state, (x, temb, rotary), ahead)

        n_single = len(self.block_states) - self.num_double
        programs = [double] * self.num_double + ([first_single] + [single] * (n_single - 1) if n_single else [])
        carry = self.stream.run(programs, (x, context))
        x = carry if n_single else self._join(*carry)
        return self._finish(self.rest_state, x, temb, text_len)

    def denoise_step(self, *args):
        """`pipeline_flux.denoise_step` on the streamed transformer (the pipeline's `denoise_step_fn`), as
        `StreamedKrea2.denoise_step`."""
        return pipeline_flux._denoise_step(self, *args)


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


def offload_pipeline(pipe: Krea2Pipeline | FluxPipeline, *, resident: int, prefetch: int = 2):
    """A copy of `pipe` whose denoising streams the transformer's blocks after the first `resident` (in running
    order; more than there are: all resident) from host memory (`StreamedKrea2`, `StreamedFlux`). `pipe` should not
    be used afterwards: its transformer was taken apart."""
    streamed_type = StreamedFlux if isinstance(pipe, FluxPipeline) else StreamedKrea2
    blocks = sum(len(getattr(pipe.transformer, name)) for name in streamed_type.block_lists)
    streamed = streamed_type(pipe.transformer, resident=min(resident, blocks), prefetch=prefetch)
    out = copy.copy(pipe)
    out.transformer = streamed.rest_model
    out.denoise_step_fn = streamed.denoise_step
    return out
