"""Low-precision number formats (FP8, OCP MX, NVFP4, INT8), model quantization by rules, and numerical gates."""

from .formats import FORMATS, Format, QuantizedArray, formats, quantize
from .model import dequantize_model, load_quantized, quantize_model, save_quantized

__all__ = ["FORMATS", "Format", "QuantizedArray", "dequantize_model", "formats", "load_quantized", "quantize",
           "quantize_model", "save_quantized"]
