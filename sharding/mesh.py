"""The device mesh and the rules that place parameters and activations on it.

Every mesh has the same five named axes, of size 1 when unused, so that one set of `PartitionSpec`s serves every
configuration:

- `data`: data parallel, a batch of prompts (inference) or of examples (training) split across devices;
- `cfg`: classifier-free guidance parallel, the conditional and unconditional halves of the batch on different
  devices (degree 2);
- `seq`: sequence parallel, the joint [image, text] token sequence split across devices (Ulysses or ring attention,
  `sharding/attention.py`);
- `fsdp`: fully sharded data parallel, parameters (and optimizer state) split across devices and the batch too;
- `tensor`: reserved for tensor parallelism (not implemented: a size above 1 is refused where it would be used).

The order of the axes in the mesh puts `seq` and `tensor`, whose collectives run every layer, on the nearest devices
(`jax.make_mesh` lays out the last axes over the fastest links), and `data` across hosts.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

AXES = ("data", "cfg", "fsdp", "seq", "tensor")
# The batch axis of activations is split over these, in this order: with CFG the batch is [conditional;
# unconditional], so `cfg` being the major axis puts each half on its own group of devices.
BATCH_AXES = ("cfg", "data", "fsdp")
# The logical axis names of the models' activation constraints (`model.layers.shard_activation`) on the mesh.
ACTIVATION_RULES = (("batch", BATCH_AXES), ("sequence", "seq"))


def parse_mesh(text: str) -> dict[str, int]:
    """Parse "data=2,seq=4,cfg=2" into {"data": 2, "seq": 4, "cfg": 2}; the empty string is no sharding ({}).

    Raises ValueError naming the mesh text and the offending entry: an unknown axis, a repeated one, a size that is
    not a positive integer.
    """
    sizes: dict[str, int] = {}
    for entry in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = entry.partition("=")
        name = name.strip()
        if not sep:
            raise ValueError(f"mesh {text!r}: entry {entry!r} is not axis=size")
        if name not in AXES:
            raise ValueError(f"mesh {text!r}: unknown axis {name!r}; the axes are {', '.join(AXES)}")
        if name in sizes:
            raise ValueError(f"mesh {text!r}: axis {name!r} given twice")
        try:
            size = int(value)
        except ValueError:
            size = 0
        if size < 1:
            raise ValueError(f"mesh {text!r}: size of {name!r} must be a positive integer, got {value.strip()!r}")
        sizes[name] = size
    return sizes


def make_mesh(sizes: Mapping[str, int] | str = "", devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with all of `AXES`, sized by `sizes` (a mapping or "data=2,seq=4" text; missing axes are 1).

    The mesh takes the first prod(sizes) of `devices` (default `jax.devices()`, every process's devices): their
    number must be a multiple of it, and in a multi-process run equal to it (every process takes part).
    """
    sizes = parse_mesh(sizes) if isinstance(sizes, str) else dict(sizes)
    unknown = set(sizes) - set(AXES)
    if unknown:
        raise ValueError(f"mesh: unknown axes {sorted(unknown)}; the axes are {', '.join(AXES)}")
    shape = tuple(int(sizes.get(name, 1)) for name in AXES)
    if min(shape) < 1:
        raise ValueError(f"mesh: axis sizes must be positive, got {dict(zip(AXES, shape))}")
    devices = list(jax.devices() if devices is None else devices)
    count = math.prod(shape)
    described = ",".join(f"{n}={s}" for n, s in zip(AXES, shape) if s > 1) or "no sharding"
    if len(devices) % count:
        raise ValueError(f"mesh {described}: needs {count} devices, which does not divide the {len(devices)} devices")
    if jax.process_count() > 1 and count != len(devices):
        raise ValueError(f"mesh {described}: a multi-process run must use all {len(devices)} devices, not {count}")
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices[:count])


def describe(mesh: Mesh) -> str:
    """The axes above size 1 as mesh text, e.g. "data=2,seq=4"."""
    return ",".join(f"{n}={s}" for n, s in mesh.shape.items() if s > 1) or "1 device"


def axes_size(mesh: Mesh, axes: Sequence[str]) -> int:
    """The number of devices across `axes` of `mesh`: the product of their sizes."""
    return math.prod(mesh.shape[a] for a in axes)


# --------------------------------------------------------------------------------------------------------------------
# Parameters


def param_spec(shape: Sequence[int], degree: int, axes: tuple[str, ...]) -> P:
    """Shard a parameter of `shape` over `axes` (`degree` devices in all) along its largest axis that `degree`
    divides (the first such on a tie); vectors and scalars, and arrays with no divisible axis, are replicated.

    Vectors (biases, norm scales) are a negligible share of a transformer's bytes; matrices and tables are the rest.
    """
    if degree == 1 or len(shape) < 2:
        return P()
    candidates = [i for i, n in enumerate(shape) if n % degree == 0]
    if not candidates:
        return P()
    axis = max(candidates, key=lambda i: (shape[i], -i))
    return P(*(axes if i == axis else None for i in range(len(shape))))


def param_shardings(state, mesh: Mesh, axes: Sequence[str] = ("fsdp",)):
    """NamedShardings for a pytree of parameters (an `nnx.State`, a dict of arrays): each array split over the mesh
    `axes` by `param_spec`, replicated over the others. `axes=()` replicates everything."""
    axes = tuple(axes)
    degree = axes_size(mesh, axes)
    return jax.tree.map(lambda x: NamedSharding(mesh, param_spec(np.shape(x), degree, axes)), state)


def shard_params(model, mesh: Mesh, axes: Sequence[str] = ("fsdp",)) -> None:
    """Move an `nnx.Module`'s variables onto `mesh` in place, placed by `param_shardings(..., axes)`.

    FSDP training: `axes=("fsdp",)`. Inference of a model larger than one device: `axes=AXES` (the weights spread
    over every device, gathered layer by layer by XLA). Replicated weights: `axes=()`.
    """
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, param_shardings(state, mesh, axes)))


# --------------------------------------------------------------------------------------------------------------------
# Activations


@contextlib.contextmanager
def activation_rules(mesh: Mesh) -> Iterator[None]:
    """Trace (call a jitted function for the first time, or lower it) inside this: the models' named activation
    constraints (`model.layers.shard_activation`) then resolve to `mesh`'s axes; outside it they do nothing."""
    with jax.set_mesh(mesh), nnx.logical_axis_rules(ACTIVATION_RULES):
        yield


def batch_sharding(mesh: Mesh, ndim: int, axes: Sequence[str] = BATCH_AXES) -> NamedSharding:
    """An array of rank `ndim` split along its leading (batch) axis over `axes`, replicated otherwise."""
    return NamedSharding(mesh, P(tuple(axes), *([None] * (ndim - 1))))


def check_batch(batch: int, mesh: Mesh, axes: Sequence[str] = BATCH_AXES, what: str = "batch") -> None:
    """Raise a ValueError naming the mesh unless `batch` splits evenly over the mesh `axes`."""
    degree = axes_size(mesh, axes)
    if batch % degree:
        sizes = "*".join(f"{a}={mesh.shape[a]}" for a in axes if mesh.shape[a] > 1)
        raise ValueError(f"mesh {describe(mesh)}: {what} of {batch} does not split over {sizes} = {degree} devices")
