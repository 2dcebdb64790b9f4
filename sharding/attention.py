"""Sequence-parallel attention over the mesh's `seq` axis: Ulysses (all-to-all) and ring (ppermute) attention.

Both take and return arrays split along the sequence over `seq` (and along the batch over `BATCH_AXES`), and equal
`jax.nn.dot_product_attention` on the whole arrays, key lengths included: the caller orders padded keys last, and
only the first `kv_lengths[b]` keys of the whole sequence are attended to.

- Ulysses: one all-to-all turns the sequence-split q, k and v into head-split ones over the whole sequence, the local
  kernel (XLA or cuDNN) attends, and a second all-to-all turns the head-split output back into a sequence-split
  one: exactly two all-to-alls per attention, no gather of the sequence. It needs the query heads divisible by the
  `seq` degree. GQA key/value heads are split too when the degree divides them; otherwise each device's shard of K
  and V is first repeated locally up to lcm(kv_heads, degree) heads, so that after the all-to-all every device
  holds the one or few KV heads its query heads read (less traffic than gathering all KV heads).
- Ring: every device keeps its query block; key/value blocks travel around the ring (`jax.lax.ppermute`, degree - 1
  hops) and the partial results merge by log-sum-exp. Any degree, any head count; computed in float32.

`SequenceParallelAttention` packages either as the `(q, k, v, kv_lengths) -> out` hook a model's attention takes
(`Krea2Transformer.joint_attention`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from mxdit.ops.attention import attention

from .mesh import AXES, BATCH_AXES, shard_params

SEQ = "seq"
Method = Literal["ulysses", "ring"]


def _specs(kv_lengths):
    qkv = P(BATCH_AXES, SEQ, None, None)
    return (qkv, qkv, qkv, None if kv_lengths is None else P(BATCH_AXES)), qkv


def _check(q: jax.Array, k: jax.Array, mesh: Mesh) -> int:
    degree = mesh.shape[SEQ]
    batch, seq, heads, _ = q.shape
    if seq % degree:
        raise ValueError(f"sequence length {seq} is not divisible by the mesh's seq={degree} (pad the sequence)")
    if heads % k.shape[2]:
        raise ValueError(f"{heads} query heads are not a multiple of the {k.shape[2]} key/value heads")
    return degree


def ulysses_attention(q: jax.Array, k: jax.Array, v: jax.Array, kv_lengths: jax.Array | None, *, mesh: Mesh,
                      implementation: str = "xla") -> jax.Array:
    """Ulysses sequence-parallel attention.

    Args:
        q: (batch, seq, heads, head_dim); k, v: (batch, seq, kv_heads, head_dim), split over the mesh's `seq` axis
            along the sequence (any other placement is resharded to that first).
        kv_lengths: (batch,) int32 number of valid keys (padded keys last), or None for all.
        mesh: a mesh from `make_mesh`; `heads` must be divisible by its `seq` size.
        implementation: the local kernel, "xla" or "cudnn" (`jax.nn.dot_product_attention`).

    Returns:
        (batch, seq, heads, head_dim), split like q.
    """
    degree = _check(q, k, mesh)
    if q.shape[2] % degree:
        raise ValueError(f"Ulysses attention needs the {q.shape[2]} query heads divisible by the mesh's seq={degree}; "
                         "use ring attention for this degree")
    in_specs, out_spec = _specs(kv_lengths)
    local = functools.partial(_ulysses_local, degree=degree, implementation=implementation)
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_spec)(q, k, v, kv_lengths)


def _ulysses_local(q, k, v, kv_lengths, *, degree: int, implementation: str):
    batch, block, heads, dim = q.shape
    kv_heads = k.shape[2]
    # Each device must end up with whole KV heads for its query heads: repeat each KV head r times locally, r =
    # lcm(kv_heads, degree) / kv_heads, so that the degree divides the count. GQA still pairs the same heads: query
    # head h read KV head h // g (g = heads / kv_heads) and now reads repeat h // (g / r), a copy of KV head h // g
    # (heads is a multiple of both kv_heads and degree, so of their lcm, and g / r is an integer).
    split_kv = math.lcm(kv_heads, degree)
    if split_kv != kv_heads:
        k, v = (jnp.repeat(x, split_kv // kv_heads, axis=2) for x in (k, v))
    # One all-to-all for q, k and v together: device j's slice of each goes to device j.
    parts = [x.reshape(batch, block, degree, x.shape[2] // degree, dim) for x in (q, k, v)]
    qkv = jax.lax.all_to_all(jnp.concatenate(parts, axis=3), SEQ, split_axis=2, concat_axis=1, tiled=True)
    qkv = qkv.reshape(batch, block * degree, -1, dim)  # the whole sequence, this device's heads
    local_heads, local_kv = heads // degree, split_kv // degree
    q, k, v = jnp.split(qkv, [local_heads, local_heads + local_kv], axis=2)
    out = attention(q, k, v, kv_lengths, implementation)
    # Back: the sequence split over devices, every head here.
    return jax.lax.all_to_all(out, SEQ, split_axis=1, concat_axis=2, tiled=True)


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, kv_lengths: jax.Array | None, *,
                   mesh: Mesh) -> jax.Array:
    """Ring sequence-parallel attention: same arguments and result as `ulysses_attention`, any head count."""
    degree = _check(q, k, mesh)
    in_specs, out_spec = _specs(kv_lengths)
    local = functools.partial(_ring_local, degree=degree)
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_spec)(q, k, v, kv_lengths)


def _ring_local(q, k, v, kv_lengths, *, degree: int):
    batch, block, heads, dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    me = jax.lax.axis_index(SEQ)
    qg = q.astype(jnp.float32).reshape(batch, block, kv_heads, group, dim) * dim**-0.5
    # Running max, sum of exponentials and weighted values, per (batch, kv head, group, query).
    m = jnp.full((batch, kv_heads, group, block), -jnp.inf, jnp.float32)
    l = jnp.zeros_like(m)
    o = jnp.zeros((batch, kv_heads, group, block, dim), jnp.float32)
    lengths = jnp.full((batch,), block * degree, jnp.int32) if kv_lengths is None else kv_lengths
    ring = [(j, (j + 1) % degree) for j in range(degree)]
    for hop in range(degree):
        # After `hop` passes to the right, this device holds the block of device (me - hop).
        source = (me - hop) % degree
        valid = source * block + jnp.arange(block) < lengths[:, None]  # (batch, keys)
        s = jnp.einsum("bqkgd,bskd->bkgqs", qg, k.astype(jnp.float32))
        s = jnp.where(valid[:, None, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=-1))
        # A row with no valid key yet has m_new = -inf: subtract 0 instead, so that its terms are exp(-inf) = 0.
        shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - shift[..., None])
        correction = jnp.exp(m - shift)
        l = l * correction + p.sum(axis=-1)
        o = o * correction[..., None] + jnp.einsum("bkgqs,bskd->bkgqd", p, v.astype(jnp.float32))
        m = m_new
        if hop + 1 < degree:
            k, v = jax.lax.ppermute((k, v), SEQ, ring)
    out = o / l[..., None]  # every query has at least one valid key (kv_lengths >= 1)
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, block, heads, dim).astype(q.dtype)


@dataclasses.dataclass(frozen=True)
class SequenceParallelAttention:
    """The attention hook `(q, k, v, kv_lengths) -> out` of a model, sequence-parallel over `mesh`'s `seq` axis.

    `method`: "ulysses", "ring", or None for Ulysses when the query heads divide by the `seq` degree and ring
    otherwise. `implementation`: Ulysses' local kernel ("xla" or "cudnn"). Frozen and hashable, so that a module
    holding it stays a valid static part of a jitted graph.
    """

    mesh: Mesh
    method: Method | None = None
    implementation: str = "xla"

    def __post_init__(self):
        if self.method not in (None, "ulysses", "ring"):
            raise ValueError(f"method must be 'ulysses', 'ring' or None, got {self.method!r}")

    def method_for(self, heads: int) -> Method:
        if self.method is not None:
            return self.method
        return "ulysses" if heads % self.mesh.shape[SEQ] == 0 else "ring"

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, kv_lengths: jax.Array | None) -> jax.Array:
        if self.method_for(q.shape[2]) == "ulysses":
            return ulysses_attention(q, k, v, kv_lengths, mesh=self.mesh, implementation=self.implementation)
        return ring_attention(q, k, v, kv_lengths, mesh=self.mesh)


def sequence_parallel_model(transformer: nnx.Module, mesh: Mesh, method: Method | None, weights: str):
    """A copy of `transformer` (a new module over the same arrays) for `mesh`: its `joint_attention`
    sequence-parallel over `seq` where that axis is above 1, its weights replicated (`weights="replicated"`) or
    split over every device (`"sharded"`). Returns its (graphdef, state)."""
    if weights not in ("replicated", "sharded"):
        raise ValueError(f"weights must be 'replicated' or 'sharded', got {weights!r}")
    model = nnx.merge(*nnx.split(transformer))
    if mesh.shape[SEQ] > 1:
        model.joint_attention = SequenceParallelAttention(mesh, method, implementation=transformer.attention)
    shard_params(model, mesh, () if weights == "replicated" else AXES)
    return nnx.split(model)
