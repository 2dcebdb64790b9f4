"""Files as a user's disk leaves them: a truncated safetensors file (a download or copy cut short) gives a one-line
error naming it, whichever loader reads it; a write that fails midway (disk full, Ctrl-C) leaves the file that was
there as it was and no temporary file beside it."""

import importlib.util
import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import FIXTURES
from mxdit.model.krea2 import Krea2Transformer
from mxdit.model.loading import (CheckpointError, SafetensorsCheckpoint, open_checkpoint, save_safetensors,
                                 write_atomically)
from mxdit.quant.model import QuantizedCheckpointError, load_quantized, save_quantized

TINY = FIXTURES / "krea2" / "tiny"


def header_length(path: Path) -> int:
    return int.from_bytes(path.read_bytes()[:8], "little")


def cut_points(path: Path) -> dict[str, int]:
    """Where a copy of `path` may end: inside the 8-byte header length, inside the JSON header, right after it, in
    the middle of the tensor data, one byte short."""
    size, header = path.stat().st_size, header_length(path)
    return {"empty": 0, "in the header length": 5, "in the header": 8 + header // 2, "after the header": 8 + header,
            "in the data": (8 + header + size) // 2, "one byte short": size - 1}


def truncated_copy(source: Path, destination: Path, at: int) -> Path:
    destination.parent.mkdir(parents=True, exist_ok=True)
    destination.write_bytes(source.read_bytes()[:at])
    return destination


def assert_one_line_naming(error: Exception, path: Path, cut: str | None = None) -> None:
    """One line naming `path`; one cut after a whole header says the file is truncated (before, the header itself is
    cut, and a corrupt file looks the same)."""
    message = str(error)
    assert len(message.splitlines()) == 1 and str(path) in message, message
    if cut in ("after the header", "in the data", "one byte short"):
        assert f"{path}: truncated: " in message, message
    elif cut == "empty":
        assert f"{path}: empty file" in message, message


@pytest.mark.parametrize("cut", list(cut_points(TINY / "diffusion_pytorch_model.safetensors")))
def test_truncated_checkpoint_gives_a_one_line_error_naming_the_file(tmp_path, cut):
    source = TINY / "diffusion_pytorch_model.safetensors"
    folder = tmp_path / "transformer"
    weights = truncated_copy(source, folder / source.name, cut_points(source)[cut])
    shutil.copy(TINY / "config.json", folder / "config.json")
    for load in (lambda: SafetensorsCheckpoint([weights]), lambda: open_checkpoint(weights, "unused"),
                 lambda: Krea2Transformer.from_pretrained(folder, jnp.float32)):
        with pytest.raises(CheckpointError) as error:
            load()
        assert_one_line_naming(error.value, weights, cut)


def test_truncated_shard_is_named(tmp_path):
    source = FIXTURES / "krea2" / "tiny_sharded"
    folder = tmp_path / "sharded"
    shutil.copytree(source, folder)
    index = json.loads((folder / "diffusion_pytorch_model.safetensors.index.json").read_text())
    shard = folder / sorted(set(index["weight_map"].values()))[-1]
    truncated_copy(shard, shard, cut_points(shard)["in the data"])
    with pytest.raises(CheckpointError) as error:
        Krea2Transformer.from_pretrained(folder, jnp.float32)
    assert_one_line_naming(error.value, shard, "in the data")


@pytest.mark.parametrize("cut", ["in the header length", "in the header", "in the data", "one byte short"])
def test_truncated_quantized_checkpoint_and_lora_files_are_named(tmp_path, cut):
    from mxdit.model.layers import Linear
    from mxdit.model.lora import LoraConfig
    from mxdit.model.lora_files import LoraFileError, read_lora
    from mxdit.training.lora import add_lora, load_lora, save_lora

    quantized = tmp_path / "q.safetensors"
    save_quantized({"w": np.ones((4, 32), np.float32)}, quantized)
    truncated_copy(quantized, quantized, cut_points(quantized)[cut])
    with pytest.raises(QuantizedCheckpointError) as error:
        load_quantized(quantized)
    assert_one_line_naming(error.value, quantized, cut)

    model = nnx.List([Linear(32, 16, bias=False, dtype=jnp.float32, rngs=nnx.Rngs(0))])
    add_lora(model, LoraConfig(rank=2, targets=(r"0",)))
    lora = tmp_path / "lora.safetensors"
    save_lora(model, lora, LoraConfig(rank=2, targets=(r"0",)))
    truncated_copy(lora, lora, cut_points(lora)[cut])
    for load, kind in ((lambda: load_lora(model, lora), ValueError), (lambda: read_lora(lora, model), LoraFileError)):
        with pytest.raises(kind) as error:
            load()
        assert_one_line_naming(error.value, lora, cut)


def test_a_header_length_past_the_end_of_the_file_is_refused_at_once(tmp_path):
    """A header length claiming terabytes (a corrupt first 8 bytes) is refused, not read or allocated."""
    path = tmp_path / "huge.safetensors"
    path.write_bytes((2**40).to_bytes(8, "little") + b'{"__metadata__": {}}')
    with pytest.raises(CheckpointError) as error:
        SafetensorsCheckpoint([path])
    assert_one_line_naming(error.value, path)


# --------------------------------------------------------------------------------------------------------------------
# Interrupted writes


class DiskFull(OSError):
    pass


def fail_midway(write):
    """`write(obj, path, ...)` replaced by one that writes half of what `write` would have, then raises."""
    def failing(obj, path, *args, **kwargs):
        write(obj, path, *args, **kwargs)
        data = Path(path).read_bytes()
        Path(path).write_bytes(data[: len(data) // 2])
        raise DiskFull(28, "No space left on device")
    return failing


def listing(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("error", [DiskFull(28, "No space left on device"), KeyboardInterrupt()])
def test_atomic_write_keeps_the_old_file_when_the_write_fails(tmp_path, error):
    path = tmp_path / "out.bin"
    path.write_bytes(b"what the user had")
    before = listing(tmp_path)

    def write_half(tmp):
        assert tmp.parent == path.parent and tmp != path
        tmp.write_bytes(b"half of the new")
        raise error

    with pytest.raises(type(error)):
        write_atomically(path, write_half)
    assert listing(tmp_path) == before
    write_atomically(path, lambda tmp: tmp.write_bytes(b"the new content"))
    assert listing(tmp_path) == {"out.bin": b"the new content"}


def test_interrupted_safetensors_writes_keep_the_old_file(tmp_path, monkeypatch):
    """save_safetensors (and save_lora through it: a LoRA file, training's final lora.safetensors) and
    save_quantized, with safetensors' writer failing after writing half the file."""
    import safetensors.numpy

    from mxdit.model.layers import Linear
    from mxdit.model.lora import LoraConfig
    from mxdit.training.lora import add_lora, save_lora

    model = nnx.List([Linear(32, 16, bias=False, dtype=jnp.float32, rngs=nnx.Rngs(0))])
    add_lora(model, LoraConfig(rank=2, targets=(r"0",)))
    writes = {"tensors.safetensors": lambda path: save_safetensors({"a": np.arange(64, dtype=np.float32)}, path),
              "lora.safetensors": lambda path: save_lora(model, path, LoraConfig(rank=2, targets=(r"0",))),
              "q.safetensors": lambda path: save_quantized({"w": np.ones((4, 32), np.float32)}, path)}
    for name, write in writes.items():
        write(tmp_path / name)
    before = listing(tmp_path)
    monkeypatch.setattr(safetensors.numpy, "save_file", fail_midway(safetensors.numpy.save_file))
    for name, write in writes.items():
        with pytest.raises(DiskFull):
            write(tmp_path / name)
        assert listing(tmp_path) == before, name


def test_interrupted_png_and_json_writes_keep_the_old_file(tmp_path, monkeypatch):
    """generate.py's images and the trainer's JSON files (its run config), failing after writing half."""
    from PIL import Image

    from mxdit.training import train as train_lib

    spec = importlib.util.spec_from_file_location("generate", Path(__file__).parent.parent / "scripts" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    image = Image.fromarray(np.full((8, 8, 3), 200, np.uint8))
    generate.save_png(image, tmp_path / "image.png")
    train_lib._write_json(tmp_path / "config.json", {"steps": 10})
    before = listing(tmp_path)

    save = Image.Image.save

    def failing_save(self, path, *args, **kwargs):
        fail_midway(lambda image, p: save(image, p, *args, **kwargs))(self, path)

    def failing_write_text(self, text):
        fail_midway(lambda t, p: Path(p).write_bytes(t.encode()))(text, self)

    monkeypatch.setattr(Image.Image, "save", failing_save)
    with pytest.raises(DiskFull):
        generate.save_png(Image.fromarray(np.zeros((8, 8, 3), np.uint8)), tmp_path / "image.png")
    monkeypatch.setattr(Path, "write_text", failing_write_text)
    with pytest.raises(DiskFull):
        train_lib._write_json(tmp_path / "config.json", {"steps": 20})
    assert listing(tmp_path) == before


@pytest.mark.parametrize("threads", [1, 3])
def test_read_ahead_keeps_the_order_bounds_the_reads_and_raises_where_the_item_is(threads):
    import threading
    import time

    from mxdit.model.loading import read_ahead

    started, lock = [], threading.Lock()

    def read(i):
        with lock:
            started.append(i)
        time.sleep(0.001 * (i % 3))  # reads on several threads finish out of order
        if i == 7:
            raise ValueError("item 7 is damaged")
        return i * i

    seen = []
    with pytest.raises(ValueError, match="item 7 is damaged"):
        for i, value in read_ahead(range(20), read, depth=3, threads=threads):
            assert max(started) <= i + 3  # never more than `depth` reads ahead of the consumer
            seen.append((i, value))
    assert seen == [(i, i * i) for i in range(7)] and max(started) <= 10
