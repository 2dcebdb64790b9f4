"""Weight streaming (`generate.py --offload`): a Krea 2 transformer on a GPU smaller than the model.

The first `resident` joint blocks keep their weights on the device; the others live in pinned host memory and are
copied to the device `prefetch` blocks ahead of their use, so that the copies (host-to-device DMA, on a stream of
their own) overlap the blocks that run meanwhile. Each block runs as one compiled program (the blocks share one
structure, so one compilation serves all), the embedding and the final layer as two more: dispatch is asynchronous,
so the host queues the copies and the blocks in order and the device waits only where a copy has not arrived. What
the device then waits for per step (the "exposed" transfer time) is the streamed step's time minus the resident one
(`scripts/benchmark.py krea2-step --offload`).
"""

from __future__ import annotations

import jax
from flax import nnx

from .krea2 import Krea2Transformer


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
        self.config = model.config

        @jax.jit
        def embed(state, *args):
            return nnx.merge(self.rest_graph, state).embed(*args)

        @jax.jit
        def block(rest_state, state, x, temb_mod, rotary, kv_lengths):
            model = nnx.merge(self.rest_graph, rest_state)
            return model.run_block(nnx.merge(self.block_graph, state), x, temb_mod, rotary, kv_lengths)

        @jax.jit(static_argnums=3)
        def finish(state, x, temb, image_len):
            return nnx.merge(self.rest_graph, state).finish(x, temb, image_len)

        self._embed, self._block, self._finish = embed, block, finish

    def __call__(self, hidden_states, encoder_hidden_states, timestep, position_ids, encoder_attention_mask=None):
        n = len(self.block_states)
        copies = {}

        def fetch(i):  # queue block i's host-to-device copy (returns at once)
            if self.resident <= i < n and i not in copies:
                copies[i] = jax.device_put(self.block_states[i], self.on_device)

        for i in range(self.resident, self.resident + self.prefetch):
            fetch(i)  # the first streamed blocks travel while the resident ones run
        x, temb, temb_mod, rotary, kv_lengths = self._embed(self.rest_state, hidden_states, encoder_hidden_states,
                                                            timestep, position_ids, encoder_attention_mask)
        for i in range(n):
            if i > self.resident:
                # Dispatch runs ahead of the device: without this wait every copy would be queued at once and the
                # streamed blocks would all be on the device together. Block i - 1 done frees its weights.
                x.block_until_ready()
            fetch(i + self.prefetch)
            state = copies.pop(i) if i >= self.resident else self.block_states[i]
            x = self._block(self.rest_state, state, x, temb_mod, rotary, kv_lengths)
        return self._finish(self.rest_state, x, temb, hidden_states.shape[1])
