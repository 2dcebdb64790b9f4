"""Krea 2 inference on a mesh: the pipeline's denoising step with sequence, CFG and data parallelism.

- `seq`: the joint [image, text] sequence is split across devices; the joint blocks' attention is Ulysses (or ring,
  when the query heads do not divide by the degree). Everything else in a block acts per token, so XLA keeps the
  blocks' activations split along the sequence without communication. The text-fusion stage (a few blocks over the
  text alone) runs whole on each device of a `seq` group.
- `cfg` (Base, guidance > 0): the batch [conditional; unconditional] is split so that each half runs on its own
  devices; the guidance combination exchanges only the image velocities. Without guidance the axis splits the batch
  like `data`.
- `data`, `fsdp`: the batch of images is split across devices.

Weights are replicated, or with `weights="sharded"` split over every device of the mesh (for a model larger than one
device; XLA gathers each layer's weights when it runs).

The joint sequence must divide by the `seq` degree: when it does not, the step pads the text with masked tokens
(ordered after the real ones and excluded by the key lengths like any text padding), which leaves the result
unchanged.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mxdit.model.krea2 import Krea2Transformer
from mxdit.model.pipeline_krea2 import Krea2Pipeline, denoise_step

from .attention import Method, sequence_parallel_model
from .mesh import BATCH_AXES, activation_rules, batch_sharding, check_batch, describe


def pad_text(embeds: jax.Array, mask: jax.Array, position_ids: jax.Array, image_len: int,
             multiple: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Pad the text with masked tokens until text_len + image_len is a multiple of `multiple`.

    embeds (batch, text_len, ...), mask (batch, text_len) bool, position_ids (text_len + image_len, 3) with the text
    rows first; returns the three with text_len grown by the padding (zeros, False, zero positions).
    """
    text_len = embeds.shape[1]
    pad = -(text_len + image_len) % multiple
    if pad == 0:
        return embeds, mask, position_ids
    embeds = jnp.pad(embeds, [(0, 0), (0, pad)] + [(0, 0)] * (embeds.ndim - 2))
    mask = jnp.pad(mask, [(0, 0), (0, pad)])
    position_ids = jnp.concatenate(
        [position_ids[:text_len], jnp.zeros((pad, position_ids.shape[1]), position_ids.dtype), position_ids[text_len:]]
    )
    return embeds, mask, position_ids


def krea2_denoise_step(transformer: Krea2Transformer, mesh: Mesh, *, method: Method | None = None,
                       weights: Literal["replicated", "sharded"] = "replicated") -> Callable:
    """`denoise_step` on `mesh`, as a function of the same arguments without the model.

    The transformer is copied onto the mesh (the original stays where it is). Returns
    `step(latents, embeds, mask, ids, t, sigma, sigma_next, guidance, cfg) -> latents` (see `denoise_step`): the
    latents come back on the first local device, like the unsharded step's. Raises ValueError when the batch does
    not split over the mesh, when the query heads do not divide by `seq` with method="ulysses" (at the first call),
    or for `tensor` > 1.

    Multi-process (`jax.distributed.initialize`): every process calls the step with the same whole inputs and gets
    the whole result back (not tested here: CPU tests run one process).
    """
    if mesh.shape["tensor"] > 1:
        raise ValueError(f"mesh {describe(mesh)}: tensor parallelism is not implemented; use seq")
    degree = mesh.shape["seq"]
    graphdef, state = sequence_parallel_model(transformer, mesh, method, weights)
    replicated = NamedSharding(mesh, P())

    def sharded_step(state, latents, embeds, mask, ids, t, sigma, sigma_next, guidance, cfg: bool):
        embeds, mask, ids = pad_text(embeds, mask, ids, latents.shape[1], degree)
        return denoise_step(nnx.merge(graphdef, state), latents, embeds, mask, ids, t, sigma, sigma_next, guidance, cfg)

    @functools.cache
    def compiled(embeds_ndim: int):
        """The step for embeds of this rank (tapped text states: 4; the pipeline's fused text: 3)."""
        # The latents (batch, image_len, in_channels) are small: replicated, each device takes its part of the
        # batch. The same placement in and out, so that the next step neither reshards nor recompiles.
        in_shardings = (jax.tree.map(lambda x: x.sharding, state), replicated, batch_sharding(mesh, embeds_ndim),
                        batch_sharding(mesh, 2)) + (replicated,) * 5
        return jax.jit(sharded_step, static_argnums=9, in_shardings=in_shardings,
                       out_shardings=replicated), in_shardings

    def step(latents, embeds, mask, ids, t, sigma, sigma_next, guidance, cfg: bool):
        check_batch(embeds.shape[0], mesh, BATCH_AXES, "batch of images (with CFG: twice, conditional and not)")
        jitted, in_shardings = compiled(np.ndim(embeds))
        args = (latents, embeds, mask, ids, t, sigma, sigma_next, guidance)
        # Placed before the call, so that every step sees the same committed placements (jit compiles again when an
        # input changes from uncommitted to committed, even with in_shardings).
        if jax.process_count() == 1:
            args = jax.device_put(args, in_shardings[1:])
        else:  # the same whole inputs on every process: global arrays of them
            args = tuple(jax.make_array_from_process_local_data(sharding, np.asarray(x), np.shape(x))
                         for sharding, x in zip(in_shardings[1:], args))
        with activation_rules(mesh):
            out = jitted(state, *args, cfg)
        # Back to this process's first device, where the rest of the pipeline (the VAE) runs.
        return jax.device_put(out.addressable_data(0), jax.local_devices()[0])

    def lower(*args, cfg: bool):  # for HLO inspection
        with activation_rules(mesh):
            return compiled(np.ndim(args[1]))[0].lower(state, *args, cfg)

    step.lower = lower
    return step


def shard_krea2_pipeline(pipe: Krea2Pipeline, mesh: Mesh, *, method: Method | None = None,
                         weights: Literal["replicated", "sharded"] = "replicated") -> Krea2Pipeline:
    """A copy of `pipe` whose denoising loop runs on `mesh` (`krea2_denoise_step`); the text encoder and the VAE stay
    on the default device. The returned pipeline is called exactly as the original."""
    sharded = copy.copy(pipe)
    sharded.denoise_step_fn = krea2_denoise_step(pipe.transformer, mesh, method=method, weights=weights)
    return sharded
