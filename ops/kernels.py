"""The Pallas kernels' entry points under their own `jax.jit`, as the models call them on a GPU.

Inside a model's program every call of one kernel with one shape then lowers to one shared function, so each kernel
is compiled once, not once per layer (196 GEMM calls in a Krea 2 step: seconds of compilation instead of minutes).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import numpy as np


def on_gpu() -> bool:
    """Whether JAX's default backend is a GPU: there the kernels run, elsewhere their references (CPU runs, tests)."""
    return jax.default_backend() == "gpu"


def gpu_architecture() -> str | None:
    """The default device's architecture: NVIDIA's compute capability ("9.0") or AMD's gfx name ("gfx942"), its kind
    where it gives neither; None off a GPU."""
    if not on_gpu():
        return None
    device = jax.devices()[0]
    return str(getattr(device, "compute_capability", "") or device.device_kind)


def kernel_family() -> str:
    """Which kernels this device runs: "mosaic" on Hopper (Mosaic GPU's wgmma and TMA are Hopper's), "triton" on
    other GPUs (AMD Instinct, other NVIDIA generations), "reference" (the jnp definitions) off a GPU."""
    arch = gpu_architecture()
    if arch is None:
        return "reference"
    return "mosaic" if arch.startswith("9.") else "triton"


def on_nvidia() -> bool:
    """Whether the default device is an NVIDIA GPU (cuDNN's attention runs there)."""
    arch = gpu_architecture()
    return arch is not None and not arch.startswith("gfx")


def jitted(function: Callable) -> Callable:
    """`function` (a kernel entry point) under its own `jax.jit`. Every argument that holds no array (a backend name,
    a dtype, a size, eps, a frozen config) is static and every array argument is traced, read from the call itself:
    no list of static names to keep in step with the kernel's signature."""

    @functools.wraps(function)
    def call(*args, **kwargs):
        static_argnums = tuple(i for i, value in enumerate(args) if not _holds_array(value))
        static_argnames = tuple(sorted(name for name, value in kwargs.items() if not _holds_array(value)))
        return _jit(function, static_argnums, static_argnames)(*args, **kwargs)

    return call


@functools.cache
def _jit(function: Callable, static_argnums: tuple[int, ...], static_argnames: tuple[str, ...]):
    return jax.jit(function, static_argnums=static_argnums, static_argnames=static_argnames)


def _holds_array(value) -> bool:
    """An array, or a pytree with one (a `GemmWeight`); None and plain values are not."""
    return any(isinstance(leaf, (jax.Array, np.ndarray)) for leaf in jax.tree.leaves(value))
