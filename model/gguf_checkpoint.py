"""GGUF files of diffusion transformers, as ComfyUI-GGUF's converter writes them and ComfyUI-GGUF and diffusers read
them: the original release's key names, each tensor in PyTorch's order with its blocks running along the last axis,
F32/F16/BF16 where the converter kept a tensor (small or with a last axis the blocks do not divide), else one of
llama.cpp's block types. Read with the `gguf` package, the format's own reader; each tensor is dequantized on read to
float32 by the package's dequantizer, exactly: Q8_0 is d * q (fp16 d, int8 q, blocks of 32), Q4_0 d * (q - 8), the
K-quants their super-blocks of 256, all of them values float32 holds. The model's dtype (or `--precision`) decides
what they become on the device; Q8_0 matrices can instead stay as they are (`quantized`: our `int8_b32`, the same
codes and scales)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .loading import CheckpointError

# The block types read: llama.cpp's plain floats, its legacy blocks of 32 and its K-quants, as diffusers reads them
# (and BF16). The others (the IQ and ternary types, MXFP4, NVFP4) are refused by name.
READ_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0", "Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K")
ORIGINAL_SHAPE = "comfy.gguf.orig_shape."  # ComfyUI-GGUF's record of a tensor stored in another shape


class GGUFCheckpoint:
    """The tensors of one GGUF file, read lazily by key (`model.loading.Checkpoint`)."""

    def __init__(self, file: Path):
        self.files = [Path(file)]
        try:
            import gguf
        except ImportError:  # an optional dependency (mxdit[gguf])
            raise CheckpointError(f"{file}: reading GGUF files needs the gguf package (pip install gguf)") from None
        self._gguf = gguf
        if not self.files[0].is_file():
            raise CheckpointError(f"{file}: file not found")
        try:
            reader = gguf.GGUFReader(str(file))
        except Exception as e:  # the reader raises ValueError, struct errors or IndexError for what is not GGUF
            raise CheckpointError(f"{file}: not a readable GGUF file ({e})") from None
        self._tensors = {t.name: t for t in reader.tensors}
        self._shapes = {}
        for name, tensor in self._tensors.items():
            kind = gguf.GGMLQuantizationType(tensor.tensor_type).name
            if kind not in READ_TYPES:
                raise CheckpointError(f"{file}: tensor {name!r} is stored as {kind}, a GGUF block type mxdit does not "
                                      f"read (it reads {', '.join(READ_TYPES)})")
            field = reader.get_field(ORIGINAL_SHAPE + name)
            stored = tuple(int(d) for d in reversed(tensor.shape.tolist()))
            self._shapes[name] = tuple(int(d) for d in field.contents()) if field is not None else stored

    def keys(self) -> list[str]:
        return list(self._tensors)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._shapes[key]

    def block_type(self, key: str) -> str:
        """How `key` is stored: one of `READ_TYPES`."""
        return self._gguf.GGMLQuantizationType(self._tensors[key].tensor_type).name

    def quantized(self, key: str):
        """A Q8_0 matrix as a `quant.formats.QuantizedArray` of format int8_b32 (numpy arrays: its int8 codes and
        float16 scales as stored, blocks of 32 along the last axis); None for other block types and shapes."""
        from mxdit.quant.formats import QuantizedArray

        tensor, shape = self._tensors[key], self._shapes[key]
        if self.block_type(key) != "Q8_0" or len(shape) != 2 or shape[1] % 32:
            return None
        try:
            blocks = np.asarray(tensor.data).reshape(shape[0], shape[1] // 32, 34)  # fp16 d, then 32 int8 codes
        except ValueError as e:
            raise CheckpointError(f"{self.files[0]}: cannot read tensor {key!r} ({e})") from None
        scale = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]
        codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(shape)
        return QuantizedArray(codes, scale, None, "int8_b32", tuple(shape), 1)

    def get(self, key: str) -> np.ndarray:
        tensor = self._tensors[key]
        try:
            kind = self._gguf.GGMLQuantizationType(tensor.tensor_type)
            if kind.name in ("F32", "F16"):
                array = np.array(tensor.data)  # a copy: the reader's arrays are views of the memory-mapped file
            else:
                array = self._gguf.quants.dequantize(tensor.data, kind)
            return array.reshape(self._shapes[key])
        except Exception as e:
            raise CheckpointError(f"{self.files[0]}: cannot read tensor {key!r} ({e})") from None

