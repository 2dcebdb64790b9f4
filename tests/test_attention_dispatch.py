"""ops/: the kernel entry points under their own jit, and the INT8 attention kernels as the models call them on a
GPU (traced here on the CPU with the GPU's options)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mxdit.model.krea2 import RMSNorm
from mxdit.ops import attention as attention_ops
from mxdit.ops.attention import attend, attention, attention_implementation
from mxdit.ops.kernels import jitted
from mxdit.ops.names import AttentionKernel
from mxdit.pallas_kernels import attention as attention_kernels


def test_jitted_makes_every_argument_without_an_array_static():
    """Names, sizes and None are static (a string cannot be traced), arrays traced, read from each call: one trace
    per static values and shapes, whatever the keyword's place in the signature."""
    traces = []

    def kernel(x, n, *, name, bias=None):
        traces.append((n, name, bias is None))
        assert isinstance(n, int) and isinstance(name, str)
        return x * n + (0.0 if bias is None else bias)

    function = jitted(kernel)
    x = jnp.ones((3,))
    for _ in range(2):
        np.testing.assert_array_equal(np.asarray(function(x, 2, name="a")), 2 * np.ones(3))
    np.testing.assert_array_equal(np.asarray(function(x, 2, name="a", bias=x)), 3 * np.ones(3))
    function(x, 3, name="b")
    assert traces == [(2, "a", True), (2, "a", False), (3, "b", True)]


def test_attention_names_are_checked():
    assert attention_implementation(None, jnp.float32) == AttentionKernel.XLA  # the CPU's default
    assert attention_implementation("int8_mosaic", jnp.bfloat16) is AttentionKernel.INT8_MOSAIC
    with pytest.raises(ValueError, match="attention must be one of xla, cudnn, int8, .*got 'flash'"):
        attention_implementation("flash", jnp.bfloat16)


@pytest.mark.parametrize("kernel", ["int8_fp8", "int8_mosaic", "int8_mosaic_fp8"])
def test_int8_kernels_trace_under_their_own_jit_with_the_gpu_options(monkeypatch, kernel):
    """On a GPU the models call the INT8 kernels under their own jit (`ops.kernels.jitted`); on the CPU they run
    unjitted, so only tracing with the GPU's options (and the configs chosen for the GPU) finds an option the jit
    cannot take. Each entry point (plain, fused prologue, fused prologue on the stacked product) gets the kernel's
    backend and P.V precision."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    options = []
    for entry in ("int8_attention", "int8_attention_fused", "int8_attention_fused_stacked"):
        original = getattr(attention_kernels, entry)

        @functools.wraps(original)
        def spy(*args, original=original, **kwargs):
            options.append((original.__name__, kwargs["backend"], kwargs["pv"], kwargs["interpret"]))
            return original(*args, **kwargs)

        monkeypatch.setattr(attention_kernels, entry, spy)
    rng = np.random.default_rng(9)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 128, h, 64)), jnp.bfloat16) for h in (2, 1, 1))
    lengths = jnp.asarray([100])
    norms = (RMSNorm(64, 1e-6), RMSNorm(64, 1e-6))
    rotary = (jnp.ones((128, 64), jnp.float32), jnp.zeros((128, 64), jnp.float32))
    qkv = jnp.concatenate([q, k, v], axis=2).reshape(1, 128, 4 * 64)
    jax.jit(lambda q, k, v: attention(q, k, v, lengths, kernel)).trace(q, k, v)
    jax.jit(lambda q, k, v: attend(q, k, v, lengths, kernel, norms=norms, rotary=rotary)).trace(q, k, v)
    jax.jit(lambda q, k, v, qkv: attend(q, k, v, lengths, kernel, norms=norms, rotary=rotary, stacked=qkv)).trace(
        q, k, v, qkv)
    backend = "mosaic" if "mosaic" in kernel else "triton"
    pv = "fp8" if kernel.endswith("_fp8") else "bf16"
    assert options == [(entry, backend, pv, False) for entry in
                       ("int8_attention", "int8_attention_fused", "int8_attention_fused_stacked")]


def test_attend_without_an_int8_kernel_normalises_rotates_then_attends():
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 12, h, 8)), jnp.float32) for h in (4, 2, 2))
    norms = (RMSNorm(8, 1e-6), RMSNorm(8, 1e-6))
    norms[0].weight.set_value(jnp.asarray(rng.standard_normal(8), jnp.float32))
    angles = jnp.asarray(rng.standard_normal((12, 4)), jnp.float32)
    rotary = (jnp.repeat(jnp.cos(angles), 2, axis=-1), jnp.repeat(jnp.sin(angles), 2, axis=-1))
    lengths = jnp.asarray([12, 7])
    got = attend(q, k, v, lengths, "xla", norms=norms, rotary=rotary)
    rotated = [attention_ops.apply_rotary(norm(x), *rotary) for norm, x in zip(norms, (q, k))]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(attention(*rotated, v, lengths, "xla")))
