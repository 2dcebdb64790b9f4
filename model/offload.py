"""Weight streaming (`generate.py --offload`): a Krea 2 transformer on a GPU smaller than the model.

The first `resident` joint blocks keep their weights on the device; the others live in pinned host memory. Each block
runs as one compiled program (the blocks share one structure, so one compilation serves all), the embedding and the
final layer as two more; the program of block i also copies block i + `prefetch`'s weights to the device, and XLA
runs that copy beside the block's compute. What the device waits for per step (the "exposed" transfer time) is the
streamed step's time minus the all-resident one (`scripts/benchmark.py krea2-offload`).

Measured on the H200 (NOTES.md, session 5): a bf16 block (0.87 GB) crosses PCIe in 16.7 ms (52 GB/s) and computes in
6.7 ms at 4224 tokens, so the copies overlap the compute but streamed blocks are copy-bound: 18 of 28 blocks resident
under a 24 GB cap, 0.273 s a step against 0.187 all resident (31.7% exposed; 79.7% when each copy was its own
`device_put` and the host waited per block). FP8 blocks (0.43 GB, session 6): 20 of 28 resident 0.174 s against
0.120, 10 resident 0.254 (31% and 53% exposed), ~7 ms a streamed block where the copy alone should take ~8.3 and
overlap ~4.2 of compute. The first repeat of every capped run took 11-12 s a step: XLA had run `stack_projections`'
concatenation of host-memory weights as host compute (now stacked on the device, `layers.stacked_linear`), a
suspect not yet confirmed on the GPU.
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
from flax import nnx

from .krea2 import Krea2Transformer
from .pipeline_krea2 import Krea2Pipeline, guided_euler_step


class StreamedKrea2:
    """Call as the transformer: `streamed(hidden_states, encoder_hidden_states, timestep, position_ids, mask)`.

    resident: how many of the first joint blocks stay on the device (all: nothing is streamed).
    prefetch: how many streamed blocks are copied ahead of the one that runs (their device memory is the cost).
    The model is taken apart: its streamed blocks' weights are copied to host memory; drop the model afterwards so
    that their device copies are freed.
    """

    def __init__(self, model: Krea2Transformer, *, resident: int, prefetch: int = 2):
        blocks = list(model.transformer_blocks)
        if not 0 <= resident <= len(blocks):
            raise ValueError(f"resident must be between 0 and the {len(blocks)} blocks, got {resident}")
        if prefetch < 1:
            raise ValueError(f"prefetch must be at least 1, got {prefetch}")
        self.resident, self.prefetch = resident, prefetch
        self.device = jax.devices()[0]
        self.on_device = jax.sharding.SingleDeviceSharding(self.device, memory_kind="device")
        on_host = jax.sharding.SingleDeviceSharding(self.device, memory_kind="pinned_host")
        self.block_graph = nnx.graphdef(blocks[0])
        self.block_states = [nnx.state(b) if i < resident else jax.device_put(nnx.state(b), on_host)
                             for i, b in enumerate(blocks)]
        # The rest of the model: everything but the blocks (their list emptied in a copy of the graph).
        rest = nnx.merge(*nnx.split(model))
        rest.transformer_blocks = nnx.List([])
        self.rest_graph, self.rest_state = nnx.split(rest)
        self.rest_model = rest  # what the pipeline keeps of the transformer (its text stage runs once per prompt)
        self.config, self.dtype = model.config, model.dtype

        @jax.jit
        def embed(state, *args):
            return nnx.merge(self.rest_graph, state).embed(*args)

        @jax.jit
        def block(rest_state, state, x, temb_mod, rotary, kv_lengths, ahead):
            # `ahead`: a later block's weights in host memory (or None). The program copies them to the device while
            # the block computes: XLA runs a host-to-device copy that nothing in the program uses beside the compute
            # (measured: a block and a copy together take the copy's time, not the sum).
            model = nnx.merge(self.rest_graph, rest_state)
            x = model.run_block(nnx.merge(self.block_graph, state), x, temb_mod, rotary, kv_lengths)
            return x, (None if ahead is None else jax.device_put(ahead, self.on_device))

        @jax.jit(static_argnums=3)
        def finish(state, x, temb, image_len):
            return nnx.merge(self.rest_graph, state).finish(x, temb, image_len)

        self._embed, self._block, self._finish = embed, block, finish

    def __call__(self, hidden_states, encoder_hidden_states, timestep, position_ids, encoder_attention_mask=None):
        n, resident, prefetch = len(self.block_states), self.resident, self.prefetch
        copies = {}  # streamed block -> its weights on the device, made by the program `prefetch` blocks earlier
        for i in range(resident, min(resident + prefetch, n)):
            if i < prefetch:  # no earlier block's program to carry this one: copied before the first
                copies[i] = jax.device_put(self.block_states[i], self.on_device)
        x, temb, temb_mod, rotary, kv_lengths = self._embed(self.rest_state, hidden_states, encoder_hidden_states,
                                                            timestep, position_ids, encoder_attention_mask)
        for i in range(n):
            state = copies.pop(i) if i >= resident else self.block_states[i]
            j = i + prefetch
            ahead = self.block_states[j] if max(resident, prefetch) <= j < n else None
            # Dispatch runs ahead of the device; device memory stays bounded because each copy is made by a block's
            # program, in order, and dropped (freed) once its block has run.
            x, copy = self._block(self.rest_state, state, x, temb_mod, rotary, kv_lengths, ahead)
            if copy is not None:
                copies[j] = copy
        return self._finish(self.rest_state, x, temb, hidden_states.shape[1])

    def denoise_step(self, latents, embeds, mask, ids, t, sigma, sigma_next, guidance, cfg: bool):
        """`pipeline_krea2.denoise_step` on the streamed transformer (the pipeline's `denoise_step_fn`)."""
        x = jnp.concatenate([latents, latents]) if cfg else latents
        velocity = self(x.astype(self.dtype), embeds, jnp.full((x.shape[0],), t, jnp.float32), ids, mask)
        return _guided_euler(latents, velocity, sigma, sigma_next, guidance, cfg)


_guided_euler = jax.jit(guided_euler_step, static_argnums=5)


def streamed_block_placement(resident: int):
    """For `loading.place_parameters`: the weights of joint blocks `resident`, `resident + 1`, ... to pinned host
    memory as they are read, so the transformer loads on a device smaller than it."""
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")

    def place(key: str, value: jax.Array) -> jax.Array:
        parts = key.split(".")
        if parts[0] == "transformer_blocks" and int(parts[1]) >= resident:
            return jax.device_put(value, host)
        return value

    return place


def offload_krea2_pipeline(pipe: Krea2Pipeline, *, resident: int, prefetch: int = 2) -> Krea2Pipeline:
    """A copy of `pipe` whose denoising streams the joint blocks after the first `resident` from host memory
    (`StreamedKrea2`). `pipe` should not be used afterwards: its transformer was taken apart."""
    streamed = StreamedKrea2(pipe.transformer, resident=resident, prefetch=prefetch)
    out = copy.copy(pipe)
    out.transformer = streamed.rest_model
    out.denoise_step_fn = streamed.denoise_step
    return out
