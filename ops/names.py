"""The names a user picks a kernel or a precision by: the one list of each. Plain Python, importable without jax, so
that the command lines build their `choices=` from them before importing the models."""

from __future__ import annotations

import enum


class AttentionKernel(enum.StrEnum):
    """The attention kernels the models offer.

    XLA: `jax.nn.dot_product_attention`'s own, any device and dtype. CUDNN: cuDNN's fused attention (GPU, 16-bit
    dtypes). The INT8-QK kernels of `pallas_kernels.attention` trade attention's accuracy for speed and run only
    when asked for: INT8 through the Triton lowering, INT8_MOSAIC the Hopper one (head_dim a multiple of 64), both
    with P.V in bf16; the `_FP8` ones take P.V in FP8 (V per channel, P scaled by 448): faster, less exact."""

    XLA = "xla"
    CUDNN = "cudnn"
    INT8 = "int8"
    INT8_FP8 = "int8_fp8"
    INT8_MOSAIC = "int8_mosaic"
    INT8_MOSAIC_FP8 = "int8_mosaic_fp8"

    @property
    def is_int8(self) -> bool:
        """An INT8-QK kernel of `pallas_kernels.attention`."""
        return self.value.startswith("int8")


class Precision(enum.StrEnum):
    """The precision of a transformer's block matrices at inference, multiplied by the low-precision GEMM kernels
    with activations quantized per token (FP8, or INT8 for INT8 weights). `weight_format` is the quant format
    (`quant.formats`) the matrices are quantized to; None for BF16: the weights as they are."""

    weight_format: str | None

    def __new__(cls, name: str, weight_format: str | None):
        member = str.__new__(cls, name)
        member._value_ = name
        member.weight_format = weight_format
        return member

    BF16 = "bf16", None
    FP8 = "fp8", "fp8_e4m3"
    MXFP8 = "mxfp8", "mxfp8_e4m3"
    MXFP6 = "mxfp6", "mxfp6_e2m3"
    MXFP4 = "mxfp4", "mxfp4_e2m1"
    INT8 = "int8", "int8"
