"""MiniMax H3 on a mesh: the denoising step with the packed sequence split over `seq`.

One request is one packed sequence of text, video and audio rows (batch 1), so the parallelism is over the sequence:
the transformer blocks' attention is Ulysses (or ring, when the query heads do not divide by the degree); everything
else in a block acts per row, so the activations stay split along the sequence. At 124 frames of 768x1344 that is
37.8k rows, a block's attention most of its time. The token refiner (the text rows alone) runs whole on each device.

Weights are replicated, or with `weights="sharded"` split over the `seq` devices (for a model larger than one device;
XLA gathers each layer's weights when it runs).

The sequence must divide by the `seq` degree: when it does not, the step appends padding rows that no row attends
to (`MiniMaxH3Transformer`'s `padding`), which leaves the result unchanged.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Literal

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mxdit.model.minimax_h3 import MiniMaxH3Transformer
from mxdit.model.pipeline_minimax_h3 import MiniMaxH3Pipeline, denoise_step, pad_structure

from .attention import Method, sequence_parallel_model
from .mesh import BATCH_AXES, activation_rules, describe


def minimax_h3_denoise_step(transformer: MiniMaxH3Transformer, mesh: Mesh, *, method: Method | None = None,
                            weights: Literal["replicated", "sharded"] = "replicated") -> Callable:
    """`pipeline_minimax_h3.denoise_step` on `mesh`, as a function of the same arguments without the model (the
    pipeline's `denoise_step_fn`): `step(prompt_embeds, video_rows, audio_rows, structure, sigma, audio_sigma)`. The
    transformer is copied onto the mesh (the original stays where it is); the rows come back on the first local
    device. Raises ValueError for a mesh with an axis other than `seq` above 1 (one video is one sequence), or, at
    the first call, when the query heads do not divide by `seq` with method="ulysses"."""
    split = [axis for axis in ("tensor", *BATCH_AXES) if mesh.shape[axis] > 1]
    if split:
        raise ValueError(f"mesh {describe(mesh)}: MiniMax H3 splits one video's sequence, over seq alone (weights="
                         f"'sharded' spreads the weights over it), not {', '.join(split)}")
    degree = mesh.shape["seq"]
    graphdef, state = sequence_parallel_model(transformer, mesh, method, weights)
    replicated = NamedSharding(mesh, P())

    def sharded_step(state, prompt_embeds, video_rows, audio_rows, structure, sigma, audio_sigma):
        padding = -structure[0].shape[0] % degree
        return denoise_step(nnx.merge(graphdef, state), prompt_embeds, video_rows, audio_rows,
                            pad_structure(structure, padding), sigma, audio_sigma, padding=padding)

    # Everything but the weights is small beside the activations: replicated in and out, so that the next step
    # neither reshards nor compiles again.
    jitted = jax.jit(sharded_step, in_shardings=(jax.tree.map(lambda x: x.sharding, state),) + (replicated,) * 6,
                     out_shardings=replicated)

    def step(prompt_embeds, video_rows, audio_rows, structure, sigma, audio_sigma):
        # Placed before the call, so that every step sees the same committed placements (jit compiles again when an
        # input changes from uncommitted to committed, even with in_shardings).
        args = jax.device_put((prompt_embeds, video_rows, audio_rows, structure, sigma, audio_sigma), replicated)
        with activation_rules(mesh):
            out = jitted(state, *args)
        first = jax.local_devices()[0]  # where the rest of the pipeline (the VAEs) runs
        return tuple(jax.device_put(x.addressable_data(0), first) for x in out)

    def lower(*args):  # for HLO inspection
        with activation_rules(mesh):
            return jitted.lower(state, *args)

    step.lower = lower
    return step


def shard_minimax_h3_pipeline(pipe: MiniMaxH3Pipeline, mesh: Mesh, *, method: Method | None = None,
                              weights: Literal["replicated", "sharded"] = "replicated") -> MiniMaxH3Pipeline:
    """A copy of `pipe` whose denoising loop runs on `mesh` (`minimax_h3_denoise_step`); the text encoder and the
    VAEs stay on the default device. The returned pipeline is called exactly as the original."""
    sharded = copy.copy(pipe)
    sharded.denoise_step_fn = minimax_h3_denoise_step(pipe.transformer, mesh, method=method, weights=weights)
    return sharded
