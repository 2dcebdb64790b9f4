"""Low-precision number formats (FP8, OCP MX, NVFP4, INT8), model quantization by rules, and numerical gates."""

from .formats import FORMATS, Format, QuantizedArray, formats, quantize

__all__ = ["FORMATS", "Format", "QuantizedArray", "formats", "quantize"]
