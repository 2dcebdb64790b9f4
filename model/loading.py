"""Reading checkpoints from local disk: config.json into frozen dataclasses, and safetensors (one file, or shards with
an index) streamed tensor by tensor into a Flax NNX module.

Every model in `model/` loads through `load_state`: it builds the module abstractly (no memory), reads one tensor at
a time from the safetensors files, puts it on the device and casts it there, so the host never holds a second copy of
the whole model. Problems are reported all at once, naming the file and key.

Each model states how a checkpoint's keys become its own in a `KeyMap` (made by the model's `key_map`, which its
`from_pretrained` uses); `plan_load` checks a `KeyMap` against the module from key names and shapes alone, so a
`ShapeCheckpoint` (names and shapes, no data) goes through the very checks a real load makes.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import contextvars
import dataclasses
import functools
import json
import os
import stat
import threading
import typing
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded. The message names the file, key or setting at fault."""


T = TypeVar("T")


def read_json(path: Path) -> dict[str, Any]:
    """Read a JSON object from `path`, with an error naming the file when it is missing or malformed."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def config_from_dict(cls: type[T], data: Mapping[str, Any], source: str) -> T:
    """Build the frozen config dataclass `cls` from a config.json dict.

    Keys starting with `_` (`_class_name`, `_diffusers_version`, ...) are bookkeeping and skipped; other keys the
    dataclass does not know are reported in a warning rather than silently dropped. Lists become tuples where the
    field is a tuple, so configs stay hashable (they are static arguments of jitted functions).
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = sorted(k for k in data if not k.startswith("_") and k not in fields)
    if unknown:
        warnings.warn(f"{source}: ignoring config keys that {cls.__name__} does not use: {unknown}", stacklevel=3)
    kwargs = {}
    for name, value in data.items():
        if name not in fields:
            continue
        if isinstance(value, list) and typing.get_origin(hints[name]) is tuple:
            value = tuple(value)
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{source}: invalid {cls.__name__}: {e}") from None


def folder_config(cls: type[T], path: Path, config: T | str | Path | None) -> T:
    """The config a model at `path` loads with: `config` as given (a `cls` or a config.json path), else the
    config.json of the folder `path`. A single file without `config` is refused: it holds no sizes of its own."""
    if isinstance(config, (str, Path)):
        return cls.from_json(config)
    if config is not None:
        return config
    if not path.is_dir():
        raise CheckpointError(f"{path}: a single file holds no config; pass config= (a {cls.__name__} or a "
                              "config.json path)")
    return cls.from_json(path / "config.json")


def known_config(cls: type[T], data: Mapping[str, Any], source: str) -> T:
    """`config_from_dict` on the keys of `data` that `cls` has: a transformers config.json holds many settings (token
    ids of generation, dropout, architectures) the models do not use, and says nothing by holding them."""
    known = {f.name for f in dataclasses.fields(cls)}
    return config_from_dict(cls, {k: v for k, v in data.items() if k in known}, source)


READ_AHEAD = 4  # tensors read ahead of the one going to the device (`read_ahead`)
# Threads those reads run on: a single thread's copies (Python's read into newly touched memory) are slower than what
# a disk or the page cache give several; the bytes in flight stay READ_AHEAD tensors.
READ_THREADS = 4
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")  # PyTorch's torch.save files: pickles, which run code when read


def pickle_error(file: Path) -> CheckpointError:
    """The error for a PyTorch pickle where safetensors were expected: mxdit never unpickles (that can run code)."""
    return CheckpointError(f"{file}: a PyTorch pickle; mxdit reads safetensors only, not pickles (convert it to "
                           ".safetensors, or download the release's safetensors files)")


_RAW_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
               "F8_E8M0": ml_dtypes.float8_e8m0fnu}


def unreadable_safetensors(file: Path, error: Exception) -> str:
    """The one-line reason the safetensors file `file` did not open (`error`: the library's): empty, truncated (its
    header whole but the tensors it describes cut short: a copy or download that stopped), or the library's reason."""
    try:
        size = Path(file).stat().st_size
        if size == 0:
            return f"{file}: empty file, not a safetensors file"
        with open(file, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(min(header_len, size)))
        end = 8 + header_len + max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"),
                                   default=0)
        if size < end:
            return f"{file}: truncated: {size} bytes where its header describes {end} (a copy or download cut short?)"
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        pass
    return f"{file}: not a readable safetensors file ({error})"


class SafetensorsCheckpoint:
    """The tensors of one checkpoint, spread over one or several safetensors files, read lazily by key."""

    def __init__(self, files: Sequence[Path]):
        self.files = [Path(f) for f in files]
        self._handles = {}
        self._headers: dict[Path, tuple[int, dict]] = {}
        self._header_lock = threading.Lock()
        self._where: dict[str, Path] = {}
        for file in self.files:
            handle = self._open(file)
            for key in handle.keys():
                self._where[key] = file

    def _open(self, file: Path):
        if file not in self._handles:
            if not file.is_file():
                raise CheckpointError(f"{file}: file not found")
            if file.suffix.lower() in PICKLE_SUFFIXES:
                raise pickle_error(file)
            try:
                self._handles[file] = safe_open(str(file), framework="numpy")
            except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
                raise CheckpointError(unreadable_safetensors(file, e)) from None
        return self._handles[file]

    def keys(self) -> list[str]:
        return list(self._where)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._open(self._where[key]).get_slice(key).get_shape())

    def get(self, key: str) -> np.ndarray:
        file = self._where[key]
        try:
            dtype = self._open(file).get_slice(key).get_dtype()
            if dtype in _RAW_DTYPES:  # dtypes safetensors' numpy backend cannot build: read the bytes ourselves
                return self._raw(file, key, _RAW_DTYPES[dtype])
            return self._open(file).get_tensor(key)
        except Exception as e:
            raise CheckpointError(f"{file}: cannot read tensor {key!r} ({e})") from None

    def _raw(self, file: Path, key: str, dtype) -> np.ndarray:
        data_start, header = self._header(file)
        entry = header[key]
        begin, end = entry["data_offsets"]
        with open(file, "rb") as f:  # a handle per read: reads run on several threads (`read_ahead`)
            f.seek(data_start + begin)
            data = np.frombuffer(f.read(end - begin), np.uint8)
        return data.view(dtype).reshape(entry["shape"])

    def _header(self, file: Path) -> tuple[int, dict]:
        """(where the tensor data starts, the parsed JSON header) of `file`, read once."""
        with self._header_lock:  # the reader threads of `read_ahead` ask at once
            if file not in self._headers:
                with open(file, "rb") as f:
                    header_len = int.from_bytes(f.read(8), "little")
                    self._headers[file] = (8 + header_len, json.loads(f.read(header_len)))
            return self._headers[file]


class ShapeCheckpoint:
    """A checkpoint's key names and shapes without tensor data (a recorded layout): enough for `plan_load` to check
    how it maps onto a module, which is all a load does before it reads a tensor."""

    def __init__(self, shapes: Mapping[str, Sequence[int]], name: str = "shapes"):
        self.files = [Path(name)]
        self._shapes = {key: tuple(shape) for key, shape in shapes.items()}

    def keys(self) -> list[str]:
        return list(self._shapes)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._shapes[key]

    def get(self, key: str) -> np.ndarray:
        raise CheckpointError(f"{self.files[0]}: {key!r} has a shape but no data")


class Checkpoint(typing.Protocol):
    """What loading reads of a checkpoint: `SafetensorsCheckpoint`, `ShapeCheckpoint` or a view of one."""

    files: list[Path]

    def keys(self) -> list[str]: ...

    def shape(self, key: str) -> tuple[int, ...]: ...

    def get(self, key: str) -> np.ndarray: ...


class DerivedCheckpoint:
    """A checkpoint seen through a key map: each derived key reads (a function of) one stored tensor, for layouts
    that fuse several of our tensors into one. Stored keys named in `passthrough` stay visible as they are (so that
    unknown tensors are still reported)."""

    def __init__(self, base: Checkpoint, derived: Mapping[str, tuple], passthrough: Sequence[str] = ()):
        self.base, self.derived = base, dict(derived)  # key -> (stored key, fn or None, shape)
        self.passthrough = {k: (k, None, base.shape(k)) for k in passthrough}
        self.files = base.files

    def _entry(self, key: str):
        return self.derived.get(key) or self.passthrough[key]

    def keys(self) -> list[str]:
        return [*self.derived, *self.passthrough]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._entry(key)[2])

    def stored_key(self, key: str) -> str:
        """The key of the stored tensor that `key` reads."""
        return self._entry(key)[0]

    def get(self, key: str) -> np.ndarray:
        stored, fn, _ = self._entry(key)
        array = self.base.get(stored)
        return np.ascontiguousarray(fn(array)) if fn is not None else array

    def quantized(self, key: str):
        """The stored tensor's `quantized` form (see `keep_file_blocks`), where the view takes it whole or a
        `Rows` range of it; else None."""
        stored, fn, _ = self._entry(key)
        quantized = getattr(self.base, "quantized", None)
        if quantized is None or not (fn is None or isinstance(fn, Rows)):
            return None
        q = quantized(stored)
        return q if q is None or fn is None else fn.of(q)


@dataclasses.dataclass(frozen=True)
class Rows:
    """A derived tensor that is rows [start, stop) of its stored one (a fused projection's part): applies to an array
    and to a block-quantized matrix (its codes and scales share the rows)."""

    start: int
    stop: int

    def __call__(self, array: np.ndarray) -> np.ndarray:
        return array[self.start:self.stop]

    def of(self, q):
        return dataclasses.replace(q, data=q.data[self.start:self.stop], scale=q.scale[self.start:self.stop],
                                   shape=(self.stop - self.start, *q.shape[1:]))


_SCALE_SUFFIXES = (".weight_scale", ".scale_weight")  # ComfyUI's quantized layers: new and old scale names
# consumed with the weights: format records, activation scales, NVFP4's tensor scale
_COMFY_EXTRA = (".comfy_quant", ".input_scale", ".scale_input", ".weight_scale_2")
_E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                        np.float32)


def unswizzle_e8m0(blocked: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """ComfyUI's (comfy-kitchen's `from_blocked`) inverse of cuBLAS's block-scale layout: the stored
    (roundup(rows, 128), roundup(cols, 4)) matrix holds each 128x4 tile as 512 contiguous bytes, scale (r, c) of a
    tile at offset (r % 32) * 16 + (r // 32) * 4 + c. Returns the plain (rows, cols) scales."""
    padded_rows, padded_cols = blocked.shape
    x = blocked.reshape(-1, 32, 4, 4).transpose(0, 2, 1, 3)
    x = x.reshape(padded_rows // 128, padded_cols // 4, 128, 4).transpose(0, 2, 1, 3)
    return x.reshape(padded_rows, padded_cols)[:rows, :cols]


def _stored_scalar(checkpoint: Checkpoint, key: str) -> np.float32:
    """A scale stored as a tensor of one value (any shape), as float32."""
    return np.float32(np.asarray(checkpoint.get(key), np.float32).reshape(-1)[0])


def _stored_block_scales(checkpoint: Checkpoint, key: str, rows: int, cols: int) -> np.ndarray:
    """Block scales stored in cuBLAS's swizzled layout, as their (rows, cols) bytes (`unswizzle_e8m0`)."""
    return unswizzle_e8m0(np.asarray(checkpoint.get(key)).view(np.uint8), rows, cols)


def _comfy_config(checkpoint: Checkpoint, layer: str) -> dict:
    """A quantized layer's `.comfy_quant` record ({"format": ..., and the format's options})."""
    record = layer + ".comfy_quant"
    if record in set(checkpoint.keys()):
        return json.loads(bytes(np.asarray(checkpoint.get(record), np.uint8)).decode())
    return {"format": "float8_e4m3fn"}  # the older naming (scale_weight, scaled_fp8 marker) knew only per-tensor FP8


def regular_hadamard(size: int) -> np.ndarray:
    """ConvRot's rotation: the orthonormal Hadamard matrix of Kronecker powers of the regular 4x4 one (every row
    sums to the same value), for `size` a power of 4; symmetric, so its own inverse. float32."""
    if size < 4 or size & (size - 1) or (size.bit_length() - 1) % 2:
        raise ValueError(f"ConvRot group size {size}: must be a power of 4 (4, 16, 64, 256, ...)")
    h4 = np.array([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]], np.float32)
    h = h4
    while h.shape[0] < size:
        h = np.kron(h, h4)
    return h / np.float32(np.sqrt(size))


def _dequantizer(checkpoint: Checkpoint, weight: str, scale_key: str, config: dict):
    fmt = config.get("format")
    if fmt == "int8_tensorwise":  # one scale a tensor or a row; with "convrot", rows rotated in groups along K
        group = int(config.get("convrot_groupsize", 256)) if config.get("convrot") else 0
        try:
            rotation = regular_hadamard(group) if group else None
        except ValueError as e:
            raise CheckpointError(f"{checkpoint.files[0]}: {weight}: {e}") from None

        def dequantize(a):
            scale = np.asarray(checkpoint.get(scale_key), np.float32)
            w = a.astype(np.float32) * (scale.reshape(-1, 1) if scale.size > 1 else scale.reshape(()))
            if rotation is None:
                return w
            rows, cols = w.shape
            return (w.reshape(rows, cols // group, group) @ rotation).reshape(rows, cols)
        return dequantize
    if fmt in ("float8_e4m3fn", "float8_e5m2"):
        scale = _stored_scalar(checkpoint, scale_key)
        return lambda a: a.astype(np.float32) * scale
    if fmt == "mxfp8":
        def dequantize(a):
            rows, cols = a.shape
            bits = _stored_block_scales(checkpoint, scale_key, rows, cols // 32)
            # comfy-kitchen's E8M0 decoding: 2^(e - 127), with e = 0 meaning a zero scale
            scale = np.where(bits == 0, 0.0, np.ldexp(np.float32(1.0), bits.astype(np.int32) - 127)).astype(np.float32)
            return (a.astype(np.float32).reshape(rows, cols // 32, 32) * scale[..., None]).reshape(rows, cols)
        return dequantize
    if fmt == "nvfp4":
        layer = weight[: -len(".weight")]

        def dequantize(a):
            # comfy-kitchen's layout: two E2M1 codes a byte, the even element in the high nibble; E4M3 scales per 16
            # in cuBLAS's swizzled layout; `.weight_scale_2` the float32 tensor scale, multiplied into the block's
            rows, cols = a.shape[0], 2 * a.shape[1]
            codes = np.stack([a >> 4, a & 0x0F], axis=-1).reshape(rows, cols)
            bits = _stored_block_scales(checkpoint, scale_key, rows, cols // 16)
            tensor_scale = _stored_scalar(checkpoint, layer + ".weight_scale_2")
            scale = bits.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * tensor_scale
            return (_E2M1_VALUES[codes].reshape(rows, cols // 16, 16) * scale[..., None]).reshape(rows, cols)
        return dequantize
    raise CheckpointError(f"{checkpoint.files[0]}: {weight} is quantized as {fmt!r}, which mxdit cannot read yet")


def dequantize_comfy(checkpoint: Checkpoint) -> Checkpoint:
    """ComfyUI's quantized files seen as plain weights, dequantized on read: scaled FP8 (`L.weight` FP8 times the
    per-tensor `L.weight_scale`, or the older `L.scale_weight` with the `scaled_fp8` marker), MXFP8 (`L.weight`
    E4M3 with E8M0 block scales in cuBLAS's swizzled layout, `L.comfy_quant` = {"format": "mxfp8"}) and NVFP4
    (`L.weight` packed E2M1 with E4M3 scales per 16 swizzled alike and `L.weight_scale_2` a tensor scale;
    {"format": "nvfp4"}) and INT8 ({"format": "int8_tensorwise"}: one float32 scale a tensor or a row; with
    "convrot", the rows were rotated in groups of "convrot_groupsize" by `regular_hadamard`, which undoes it; ConvRot
    INT8). Scales, format records, activation scales and the marker are consumed; other checkpoints
    pass unchanged. Tensors ComfyUI padded (MXFP8 to multiples of 32, NVFP4 of 16) keep the padded shape (Krea 2's
    and FLUX's are all multiples)."""
    keys = checkpoint.keys()
    scales = {k[: -len(s)] + ".weight": k for k in keys for s in _SCALE_SUFFIXES if k.endswith(s)}
    if not scales:
        return checkpoint
    derived, present, blocks = {}, set(keys), {}
    for weight, scale_key in scales.items():
        if weight not in present:
            raise CheckpointError(f"{checkpoint.files[0]}: scale {scale_key!r} has no weight {weight!r}")
        config = _comfy_config(checkpoint, weight[: -len(".weight")])
        shape = checkpoint.shape(weight)
        if config.get("format") == "nvfp4":  # two codes a byte
            shape = (*shape[:-1], 2 * shape[-1])
        derived[weight] = (weight, _dequantizer(checkpoint, weight, scale_key, config), shape)
        blocks[weight] = functools.partial(_comfy_blocks, checkpoint, weight, scale_key, config)
    consumed = set(scales.values()) | {"scaled_fp8"}
    passthrough = [k for k in keys if k not in derived and k not in consumed and not k.endswith(_COMFY_EXTRA)]
    return _ComfyCheckpoint(checkpoint, derived, passthrough, blocks)


class _ComfyCheckpoint(DerivedCheckpoint):
    """`dequantize_comfy`'s view, which also gives a layer in the format of ours that holds it exactly
    (`quantized`, for `keep_file_blocks`)."""

    def __init__(self, base: Checkpoint, derived, passthrough, blocks: Mapping[str, Callable]):
        super().__init__(base, derived, passthrough)
        self.blocks = dict(blocks)

    def quantized(self, key: str):
        make = self.blocks.get(key)
        return None if make is None else make()


def _comfy_blocks(checkpoint: Checkpoint, weight: str, scale_key: str, config: dict):
    """A ComfyUI layer as a `quant.formats.QuantizedArray` of ours with the same codes, where one holds it exactly
    (numpy arrays): per-tensor E4M3 as fp8_e4m3 (the tensor's scale on every row), MXFP8 as mxfp8_e4m3 and NVFP4 as
    nvfp4 (the scales unswizzled; NVFP4's nibbles swapped). None for the other formats, and for an MXFP8 block whose
    zero scale (comfy-kitchen's 0, our 2^-127) holds non-zero codes."""
    from mxdit.quant.formats import QuantizedArray

    fmt, shape = config.get("format"), tuple(checkpoint.shape(weight))
    if len(shape) != 2 or fmt not in ("float8_e4m3fn", "mxfp8", "nvfp4"):
        return None
    codes = np.asarray(checkpoint.get(weight))
    if fmt == "nvfp4":  # two E2M1 codes a byte, the even element in the high nibble (ours: the low one)
        rows, cols = shape[0], 2 * shape[1]
        if codes.dtype != np.uint8 or cols % 16:
            return None
        layer = weight[: -len(".weight")]
        scales = _stored_block_scales(checkpoint, scale_key, rows, cols // 16)
        tensor_scale = _stored_scalar(checkpoint, layer + ".weight_scale_2")
        return QuantizedArray(((codes & 0x0F) << 4) | (codes >> 4), np.ascontiguousarray(scales).view(
            ml_dtypes.float8_e4m3fn), tensor_scale, "nvfp4", (rows, cols), 1)
    if codes.dtype != ml_dtypes.float8_e4m3fn:
        return None
    rows, cols = shape
    if fmt == "float8_e4m3fn":
        scale = _stored_scalar(checkpoint, scale_key)
        return QuantizedArray(codes, np.full((rows, 1), scale, np.float32), None, "fp8_e4m3", shape, 1)
    if cols % 32:
        return None
    bits = _stored_block_scales(checkpoint, scale_key, rows, cols // 32)
    if np.any((bits == 0) & np.any(codes.view(np.uint8).reshape(rows, cols // 32, 32) & 0x7F, axis=-1)):
        return None
    return QuantizedArray(codes, np.ascontiguousarray(bits).view(ml_dtypes.float8_e8m0fnu), None, "mxfp8_e4m3",
                          shape, 1)


def gguf_files(folder: Path) -> list[Path]:
    """The `.gguf` files in `folder` (a model folder's transformer/ may hold one in place of its safetensors)."""
    return sorted(f for f in Path(folder).iterdir() if f.is_file() and f.suffix.lower() == ".gguf")


def open_checkpoint(path: Path, weights_name: str) -> Checkpoint:
    """Open `path`: a single `.safetensors` or `.gguf` file (`gguf_checkpoint`), or a folder holding
    `{weights_name}.safetensors`, the shards named by `{weights_name}.safetensors.index.json` or one `.gguf` file.
    PyTorch pickles (`.bin`, `.pt`, `.pth`, `.ckpt`) are refused by name: they are never read."""
    path = Path(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        from .gguf_checkpoint import GGUFCheckpoint

        return GGUFCheckpoint(path)
    if path.is_file():
        return dequantize_comfy(SafetensorsCheckpoint([path]))
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such file or folder")
    single = path / f"{weights_name}.safetensors"
    index = path / f"{weights_name}.safetensors.index.json"
    if single.is_file():
        return SafetensorsCheckpoint([single])
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: has no 'weight_map'")
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise CheckpointError(f"{index}: names shard files that are missing: {missing}")
        checkpoint = SafetensorsCheckpoint([path / s for s in shards])
        misplaced = [k for k, s in weight_map.items() if checkpoint._where.get(k) != path / s]
        if misplaced:
            raise CheckpointError(f"{index}: keys not found in the shard it names: {_listing(misplaced)}")
        return checkpoint
    ggufs = gguf_files(path)
    if len(ggufs) == 1:  # a GGUF file in place of the safetensors (the folder's config.json gives the sizes)
        from .gguf_checkpoint import GGUFCheckpoint

        return GGUFCheckpoint(ggufs[0])
    if ggufs:
        raise CheckpointError(f"{path}: several GGUF files ({', '.join(f.name for f in ggufs)}); keep one, or give the "
                              "file itself")
    pickles = sorted(f for f in path.iterdir() if f.is_file() and f.suffix.lower() in PICKLE_SUFFIXES)
    if pickles:  # e.g. diffusion_pytorch_model.bin, pytorch_model-00001-of-00002.bin
        preferred = [f for f in pickles if f.name.startswith(weights_name) or f.name.startswith("pytorch_model")]
        raise pickle_error((preferred or pickles)[0])
    raise CheckpointError(f"{path}: no weights found (expected {single.name} or {index.name})")


def key_problems(expected, found) -> list[str]:
    """The "missing keys" / "unexpected keys" lines of a load error: module keys `expected` against the keys `found`
    in a checkpoint."""
    return _key_lines(sorted(set(expected) - set(found)), sorted(set(found) - set(expected)))


def _key_lines(missing: Sequence[str], unexpected: Sequence[str]) -> list[str]:
    lines = []
    if missing:
        lines.append(f"missing keys ({len(missing)}): {_listing(missing)}")
    if unexpected:
        lines.append(f"unexpected keys ({len(unexpected)}): {_listing(unexpected)}")
    return lines


def _listing(keys: Sequence[str], limit: int = 20) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:limit])
    return f"{shown} (and {len(keys) - limit} more)" if len(keys) > limit else shown


def module_key(path: tuple[Any, ...]) -> str:
    """The checkpoint key of an NNX variable path: ('transformer_blocks', 0, 'attn', 'to_q', 'weight') ->
    'transformer_blocks.0.attn.to_q.weight'. Our modules use diffusers' attribute names, so this is the mapping."""
    return ".".join(str(p) for p in path)


Convert = Callable[[str, tuple[int, ...]], "tuple[tuple[int, ...], Callable[[np.ndarray], np.ndarray]] | None"]


def _same(key: str) -> str:
    return key


def _nothing(key: str) -> bool:
    return False


@dataclasses.dataclass(frozen=True)
class KeyMap:
    """How a checkpoint's keys become a module's. `checkpoint` is the checkpoint as the module reads it (a view for
    layouts that fuse tensors); `rename` maps its key to the module's key; `convert(module key, stored shape)` may
    return `(new_shape, fn)` for a tensor stored in another layout (a flattened table, a 3-D conv kernel used in 2-D);
    `ignore(module key)` marks checkpoint tensors the module deliberately does not use."""

    checkpoint: Checkpoint
    rename: Callable[[str], str] = _same
    convert: Convert | None = None
    ignore: Callable[[str], bool] = _nothing


@dataclasses.dataclass(frozen=True)
class LoadPlan:
    """What loading a checkpoint into a module does, worked out from key names and shapes alone (`plan_load`)."""

    module: str  # the module's class name
    sources: dict[str, str]  # module key -> checkpoint key it reads
    conversions: dict[str, Callable[[np.ndarray], np.ndarray] | None]  # module key -> applied to the stored tensor
    ignored: list[str]  # checkpoint keys the module deliberately does not use
    missing: list[str]  # module keys no checkpoint key gives
    unexpected: list[str]  # checkpoint keys neither used nor ignored
    duplicates: dict[str, str]  # checkpoint key -> the checkpoint key already giving the parameter both map to
    mismatched: list[str]  # "key: checkpoint has shape ..., model expects ..."

    @property
    def problems(self) -> list[str]:
        """The lines of the load error; empty when the checkpoint loads."""
        lines = _key_lines(self.missing, self.unexpected)
        if self.duplicates:
            pairs = [f"{first} and {second}" for second, first in sorted(self.duplicates.items())]
            lines.append(f"two tensors for one parameter ({len(pairs)}): {_listing(pairs)}")
        if self.mismatched:
            lines.append("shape mismatch: " + "; ".join(self.mismatched))
        return lines

    def raise_problems(self, source: str) -> None:
        """Raise one `CheckpointError` naming `source` and every problem, if there are any."""
        if self.problems:
            raise CheckpointError(f"{source}: cannot load into {self.module}: " + " | ".join(self.problems))


def plan_load(abstract: nnx.Module, keys: KeyMap) -> LoadPlan:
    """Match the parameters of `abstract` (a module from `nnx.eval_shape`, holding shapes only) with the checkpoint
    keys of `keys`: which stored key each parameter reads and how it is converted, which stored keys are ignored, and
    every problem (keys missing or unexpected, two stored keys for one parameter, shapes that differ after
    conversion). Reads no tensor data."""
    checkpoint = keys.checkpoint
    expected = {module_key(path): tuple(variable.get_value().shape)
                for path, variable in nnx.to_flat_state(nnx.state(abstract))}
    by_module_key: dict[str, str] = {}
    unexpected, ignored, duplicates = [], [], {}
    for key in checkpoint.keys():
        name = keys.rename(key)
        if name in by_module_key:
            duplicates[key] = by_module_key[name]
        elif name in expected:
            by_module_key[name] = key
        else:
            (ignored if keys.ignore(name) else unexpected).append(key)
    conversions, mismatched = {}, []
    for name, want in expected.items():
        if name not in by_module_key:
            continue
        stored = checkpoint.shape(by_module_key[name])
        shape, conversion = stored, None
        if keys.convert is not None and (converted := keys.convert(name, stored)) is not None:
            shape, conversion = converted
        if shape != want:
            also = f" ({shape} after conversion)" if shape != stored else ""
            mismatched.append(f"{by_module_key[name]}: checkpoint has shape {stored}{also}, model expects {want}")
        conversions[name] = conversion
    return LoadPlan(module=type(abstract).__name__, sources=by_module_key, conversions=conversions,
                    ignored=sorted(ignored), missing=sorted(set(expected) - set(by_module_key)),
                    unexpected=sorted(unexpected), duplicates=duplicates, mismatched=mismatched)


@contextlib.contextmanager
def _while_set(variable: contextvars.ContextVar, value):
    """`variable` holds `value` inside the `with` block and what it held before after it."""
    token = variable.set(value)
    try:
        yield
    finally:
        variable.reset(token)


# Where loaded parameters live: fn(module key, device array) -> the array to keep (another memory, another device).
_PLACEMENT: contextvars.ContextVar[Callable[[str, jax.Array], jax.Array] | None] = contextvars.ContextVar(
    "parameter_placement", default=None)


def place_parameters(*places: Callable[[str, jax.Array], jax.Array]):
    """While active, every parameter `load_state` reads goes through `place(module_key, array)` as it arrives, one
    tensor at a time (through each of `places` in turn): model/offload.py sends the streamed blocks straight to host
    memory, so a model larger than the device loads at all; `quant.model.quantize_on_load` quantizes block matrices."""
    return _while_set(_PLACEMENT, chained_places(*places))


def chained_places(*places: Callable[[str, jax.Array], jax.Array]) -> Callable[[str, jax.Array], jax.Array]:
    """One `place(module_key, array)` that passes the array through each of `places` in turn."""

    def place(key: str, value):
        for step in places:
            value = step(key, value)
        return value

    return place


def placed(key: str, value):
    """`value` (an array or a pytree of them, e.g. a kernel weight) through the active `place_parameters`, or as is."""
    place = _PLACEMENT.get()
    return value if place is None else place(key, value)


_KEEP_BLOCKS: contextvars.ContextVar[Callable[[str], Sequence[str]] | None] = contextvars.ContextVar("keep_blocks",
                                                                                              default=None)


def keep_file_blocks(select: Callable[[str], Sequence[str]]):
    """While active, a parameter whose checkpoint tensor is stored, exactly, in one of the formats `select(module
    key)` names (of `quant.formats`) is read as it is stored, not dequantized: a GGUF Q8_0 matrix as int8_b32, a
    ComfyUI per-tensor E4M3 layer as fp8_e4m3, its MXFP8 as mxfp8_e4m3, its NVFP4 as nvfp4 (the checkpoint's
    `quantized`). It reaches the placement (`place_parameters`; `quant.model.quantize_on_load` makes a kernel weight
    of it without quantizing again) or the module as a `QuantizedArray`, which `ops.linear` dequantizes for each
    product. The others load as always."""
    return _while_set(_KEEP_BLOCKS, select)


_SHAPES_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("shapes_only", default=False)


def shapes_only():
    """While active, in this thread, `load_state` reads no tensor: it checks the checkpoint as a load does and returns
    the module holding `jax.ShapeDtypeStruct`s, each as the load would leave that parameter (cast, then through the
    active `place_parameters`, e.g. quantized), on the default device. Programs can be lowered for such a module
    (`model.programs.compile_ahead`) while the weights are still being read."""
    return _while_set(_SHAPES_ONLY, True)


def on_default_device(module: nnx.Module) -> nnx.Module:
    """`module`'s `jax.ShapeDtypeStruct`s placed as `jax.device_put` places an array: on the default device. A
    program lowered for them is the one the loaded module's arrays call."""
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    graphdef, state = nnx.split(module)
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding, weak_type=x.weak_type)
                         if isinstance(x, jax.ShapeDtypeStruct) else x, state)
    return nnx.merge(graphdef, state)


def holds_shapes(module: nnx.Module) -> bool:
    """Whether `module` holds `jax.ShapeDtypeStruct`s (`shapes_only`, `nnx.eval_shape`) instead of arrays."""
    return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(nnx.state(module)))


def load_state(build: Callable[[], nnx.Module], keys: KeyMap, *, source: str = "checkpoint") -> nnx.Module:
    """Build the module returned by `build()` with its parameters read from the checkpoint of `keys`, as `keys` maps
    them (see `KeyMap`; `plan_load` does all the checking, with `source` naming the file in its error).

    `build` is only traced (`nnx.eval_shape`), so no parameter memory is allocated before the checkpoint's tensors
    arrive. Each tensor goes to the device as stored and is cast there to the parameter's dtype (the module declares
    which stay float32).
    """
    abstract = nnx.eval_shape(build)
    plan = plan_load(abstract, keys)
    plan.raise_problems(source)
    if _SHAPES_ONLY.get():
        return on_default_device(nnx.eval_shape(_placed_zeros, abstract))
    graphdef, state = nnx.split(abstract)
    flat = nnx.to_flat_state(state)
    keep, quantized = _KEEP_BLOCKS.get(), getattr(keys.checkpoint, "quantized", None)

    def read(name: str) -> np.ndarray:
        if keep is not None and quantized is not None and plan.conversions[name] is None and (formats := keep(name)):
            if (q := quantized(plan.sources[name])) is not None and q.fmt in formats:
                return q
        array = keys.checkpoint.get(plan.sources[name])
        if plan.conversions[name] is not None:
            array = np.ascontiguousarray(plan.conversions[name](array))
        return array

    # The next tensors are read from the file while this one goes to the device: the load takes the longer of the
    # two, not their sum.
    names = [module_key(path) for path, _ in flat]
    for (path, variable), (name, array) in zip(flat, read_ahead(names, read), strict=True):
        value = jax.device_put(array, may_alias=False)
        want = variable.get_value()
        if isinstance(value, jax.Array) and value.dtype != want.dtype:  # (a kept block format stays as it is)
            value = value.astype(want.dtype)
        variable.set_value(placed(name, value))
        del array
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _placed_zeros(module: nnx.Module) -> nnx.Module:
    """`module` (being traced) with each parameter as `load_state` would place a tensor of its shape and dtype."""
    for path, variable in nnx.to_flat_state(nnx.state(module)):
        want = variable.get_value()
        variable.set_value(placed(module_key(path), jnp.zeros(want.shape, want.dtype)))
    return module


def read_ahead(items: Sequence[T], read: Callable[[T], Any], depth: int = READ_AHEAD,
               threads: int = READ_THREADS) -> Iterator[tuple[T, Any]]:
    """(item, read(item)) for each item in order, with up to `depth` reads running ahead on `threads` background
    threads (bounded host memory). A read's exception is raised where its item is reached."""
    items = list(items)
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="mxdit-read") as pool:
        pending = collections.deque((item, pool.submit(read, item)) for item in items[:depth])
        try:
            for i in range(len(items)):
                item, future = pending.popleft()
                if i + depth < len(items):
                    pending.append((items[i + depth], pool.submit(read, items[i + depth])))
                yield item, future.result()
        finally:  # an early exit: the reads not started yet are dropped
            for _, future in pending:
                future.cancel()


def iter_params(module: nnx.Module) -> Iterator[tuple[str, jax.Array]]:
    """(checkpoint key, value) for every parameter of `module`, in diffusers' naming."""
    for path, variable in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        yield module_key(path), variable.get_value()


def new_file_mode(path: Path) -> int:
    """The permission bits `open(path, "w")` would leave: an existing file keeps its own; a new one gets 0o666 less
    the process's umask (read from /proc where it can be, so that the umask is never changed, even briefly)."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        pass
    try:
        with open("/proc/self/status") as status:
            mask = next(int(line.split()[1], 8) for line in status if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o022)
        os.umask(mask)
    return 0o666 & ~mask


def write_atomically(path: str | Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` to a temporary file beside `path`, then rename it over `path`: an existing file is never left
    half-written, and nothing is left behind on an error. The result gets `new_file_mode(path)`, as a plain `open()`
    would give it (writers such as safetensors' create private 0o600 files)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # this process's own: no two writers share it
    try:
        write(tmp)
        os.chmod(tmp, new_file_mode(path))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())  # on disk before the rename: a crash leaves the old file or the new one
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def save_safetensors(tensors: Mapping[str, Any], path: Path, metadata: Mapping[str, str] | None = None) -> None:
    """Write `tensors` to the safetensors file `path` atomically (`write_atomically`): an existing file is never left
    half-written; the file gets the mode a plain `open()` would give it."""
    from safetensors.numpy import save_file

    arrays = {k: np.ascontiguousarray(np.asarray(v)) for k, v in tensors.items()}
    write_atomically(path, lambda tmp: save_file(arrays, str(tmp), metadata=metadata))
