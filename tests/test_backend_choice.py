"""Which kernels run where (`ops.kernels.kernel_family`): Mosaic GPU on Hopper, Triton on other GPUs (AMD Instinct,
other NVIDIA generations), the jnp references off a GPU; the GEMM per weight format, the weights' layout and the
attention kernel for each, with a clear error for a kernel the device cannot run. The device is described to the
choice here (its architecture), as jax reports it: NVIDIA's compute capability, AMD's gfx name."""

import jax
import jax.numpy as jnp
import pytest

from mxdit.ops import kernels
from mxdit.ops.attention import attention_implementation
from mxdit.ops.linear import gemm_backend
from mxdit.ops.names import AttentionKernel
from mxdit.pallas_kernels import gemm
from mxdit.quant.model import weight_layout

DEVICES = {"H100": "9.0", "B200": "10.0", "MI300X": "gfx942", "MI355X": "gfx950", "CPU": None}
FAMILY = {"H100": "mosaic", "B200": "triton", "MI300X": "triton", "MI355X": "triton", "CPU": "reference"}


@pytest.fixture
def device(monkeypatch, request):
    monkeypatch.setattr(kernels, "gpu_architecture", lambda: DEVICES[request.param])
    return request.param


@pytest.mark.parametrize("device", list(DEVICES), indirect=True)
@pytest.mark.parametrize("fmt", gemm.WEIGHT_FORMATS)
def test_gemm_kernel_and_weight_layout_per_device_and_format(device, fmt):
    assert kernels.kernel_family() == FAMILY[device]
    weight = gemm.prepare_weight(jnp.ones((128, 128)) * 0.01, fmt, backend=weight_layout())
    if FAMILY[device] == "mosaic":  # MX folded to E4M3 per 128 x 128 for wgmma; INT8 (no wgmma) through Triton
        assert weight_layout() == "mosaic"
        assert gemm_backend(weight) == ("triton" if fmt.startswith("int8") else "mosaic")
    elif FAMILY[device] == "triton":  # MX codes kept packed, unpacked in the kernel
        assert weight_layout() == "triton" and gemm_backend(weight) == "triton"
        assert weight.layout == ("mx" if fmt.startswith("mx") else "channel")
    else:
        assert weight_layout() == "mosaic" and gemm_backend(weight) == "reference"


@pytest.mark.parametrize("device", list(DEVICES), indirect=True)
def test_attention_kernel_per_device(device):
    default = attention_implementation(None, jnp.bfloat16)
    assert default is (AttentionKernel.CUDNN if device in ("H100", "B200") else AttentionKernel.XLA)
    assert attention_implementation(None, jnp.float32) is AttentionKernel.XLA
    for kernel in (AttentionKernel.INT8, AttentionKernel.INT8_FP8, AttentionKernel.XLA):
        assert attention_implementation(kernel.value, jnp.bfloat16) is kernel
    for kernel in (AttentionKernel.INT8_MOSAIC, AttentionKernel.INT8_MOSAIC_FP8):
        if device in ("H100", "CPU"):  # the CPU runs every kernel's reference
            assert attention_implementation(kernel.value, jnp.bfloat16) is kernel
        else:
            with pytest.raises(ValueError, match=rf"attention {kernel.value}: a Mosaic GPU kernel for Hopper .*"
                                                 rf"\({DEVICES[device]}\) runs {kernel.value.replace('_mosaic', '')}"):
                attention_implementation(kernel.value, jnp.bfloat16)
    if device.startswith("MI"):
        with pytest.raises(ValueError, match=r"attention cudnn: NVIDIA's library; this GPU \(gfx9[45][02]\)"):
            attention_implementation("cudnn", jnp.bfloat16)


def test_the_architecture_is_read_from_the_device():
    assert kernels.gpu_architecture() is None and kernels.kernel_family() == "reference"
    assert jax.default_backend() == "cpu"
