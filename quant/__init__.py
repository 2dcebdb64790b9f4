"""Low-precision number formats (FP8, OCP MX, NVFP4, INT8), model quantization by rules, and numerical gates.

The package imports only `formats` (the kernels build on it); `model` (rules, quantized checkpoints, a model's
Linear layers quantized) sits above the models and is imported as `mxdit.quant.model`."""

from .formats import FORMATS, Format, QuantizedArray, formats, quantize

__all__ = ["FORMATS", "Format", "QuantizedArray", "formats", "quantize"]
