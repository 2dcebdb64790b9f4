"""server.py: the HTTP API on 127.0.0.1, called with a real HTTP client (urllib): a good request and its PNG, bad
requests as 400 JSON naming the field, a full queue as 503, a failed batch as 500 that leaves the others alone, and
LoRA weights swapped per request on the compiled program."""

import concurrent.futures
import io
import json
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest
from PIL import Image

from conftest import FIXTURES
from mxdit.model.inference import InferenceOptions, build_pipeline
from mxdit.model.programs import ProgramStore
from mxdit.model.requests import GenerationRequest
from mxdit.server import GenerationServer, RunningServer, ServerConfig

DEFAULTS = GenerationRequest(prompt="", height=64, width=64, steps=1)
LORAS = FIXTURES / "krea2" / "lora"


@pytest.fixture(scope="module")
def pipe():
    options = InferenceOptions(dtype="float32", loras=((LORAS / "kohya.safetensors", 1.0),
                                                       (LORAS / "diffusers.safetensors", 0.0)), swap_loras=True)
    return build_pipeline(FIXTURES / "krea2" / "tiny_pipeline", options)


def call(url: str, body=None) -> tuple[int, dict | bytes]:
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            status, payload, kind = response.status, response.read(), response.headers.get_content_type()
    except urllib.error.HTTPError as e:
        status, payload, kind = e.code, e.read(), e.headers.get_content_type()
    return status, (json.loads(payload) if kind == "application/json" else payload)


def test_generate_health_loras_and_bad_requests(pipe, tmp_path):
    store = ProgramStore(tmp_path / "executables")
    running = RunningServer(GenerationServer(pipe, ServerConfig(max_batch=2, output_dir=tmp_path, sizes=((64, 64),)),
                                             DEFAULTS,
                                             program_store=store, model_name="tiny"))
    try:
        url = running.url
        status, health = call(f"{url}/v1/health")
        assert status == 200 and health["status"] == "ok" and health["model"] == "tiny" and health["queued"] == 0
        status, loras = call(f"{url}/v1/loras")
        assert status == 200 and [lora["name"] for lora in loras["loras"]] == ["kohya", "diffusers"]

        status, result = call(f"{url}/v1/generate", {"prompt": "a cat", "seed": 3, "loras": {"kohya": 1.0}})
        assert status == 200, result
        assert {"queue", "text encode", "denoise", "decode", "total"} <= set(result["timings"]) and result["seed"] == 3
        status, png = call(url + result["image"])
        assert status == 200 and (tmp_path / f"{result['id']}.png").read_bytes() == png
        with Image.open(io.BytesIO(png)) as image:
            assert image.size == (64, 64)
            with_kohya = np.asarray(image, np.float32)
        compiled = store.stats.compiled

        # Another LoRA at another weight: the same compiled programs, another picture.
        status, result = call(f"{url}/v1/generate", {"prompt": "a cat", "seed": 3, "loras": {"diffusers": 1.5}})
        assert status == 200, result
        assert store.stats.compiled == compiled
        with Image.open(io.BytesIO(call(url + result["image"])[1])) as image:
            assert np.abs(np.asarray(image, np.float32) - with_kohya).mean() > 1.0
        status, loras = call(f"{url}/v1/loras")
        assert {lora["name"]: lora["weight"] for lora in loras["loras"]} == {"kohya": 0.0, "diffusers": 1.5}

        for body, message in [
            (b"{not json", "the body is not JSON"),
            ({"prompt": "a", "height": 100}, "height: 100 is not a multiple of 16"),
            ({"prompt": "a", "colour": "red"}, "unknown field 'colour'"),
            ({"prompt": "a", "loras": {"missing": 1.0}}, "loras: 'missing' is not loaded (loaded: kohya, diffusers)"),
            ({"seed": 1}, "prompt: a non-empty string is required"),
            ({"prompt": "a", "output": "x.png"}, "output: not a server field"),
            ({"prompt": "a", "height": 128}, "height, width: 128x64 is not served (served: 64x64)"),
        ]:
            status, error = call(f"{url}/v1/generate", body)
            assert status == 400 and message in error["error"], (body, error)
        status, error = call(f"{url}/v1/images/0123.png")
        assert status == 404 and "no image '0123'" in error["error"]
        status, error = call(f"{url}/v1/nothing")
        assert status == 404 and "error" in error
    finally:
        running.close()


class GatedPipeline:
    """The pipeline, held at a gate while a test fills the queue; a prompt "fail" raises."""

    def __init__(self, pipe):
        self.pipe, self.lora_slots = pipe, None
        self.gate, self.entered = threading.Event(), threading.Event()

    def __call__(self, prompts, *args, **kwargs):
        self.entered.set()
        self.gate.wait(timeout=300)
        if "fail" in prompts:
            raise RuntimeError("the device is on fire")
        return self.pipe(prompts, *args, **kwargs)


def test_full_queue_is_503_and_a_failed_batch_is_500_without_losing_the_others(pipe):
    gated = GatedPipeline(pipe)
    saved_slots, pipe.lora_slots = pipe.lora_slots, None  # the slots stay attached, at their last weights
    running = RunningServer(GenerationServer(gated, ServerConfig(max_batch=1, max_queue=2, batch_wait_s=0), DEFAULTS))
    try:
        url = f"{running.url}/v1/generate"
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            first = pool.submit(call, url, {"prompt": "fail"})
            assert gated.entered.wait(timeout=60)  # the worker holds "fail"; the next two wait in the queue
            queued = [pool.submit(call, url, {"prompt": p, "seed": i}) for i, p in enumerate(["a cat", "a dog"])]
            while running.server.queued() < 2:
                threading.Event().wait(0.01)
            status, error = call(url, {"prompt": "one too many"})
            assert status == 503 and "queue is full" in error["error"]
            gated.gate.set()
            status, error = first.result()
            assert status == 500 and "the device is on fire" in error["error"]
            assert [future.result()[0] for future in queued] == [200, 200]
        status, health = call(f"{running.url}/v1/health")
        assert health["generated"] == 2 and health["queued"] == 0
    finally:
        running.close()
        pipe.lora_slots = saved_slots


def test_serve_bad_arguments_exit_with_one_line(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("serve", Path(__file__).parent.parent / "scripts" / "serve.py")
    serve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve)
    lora = LORAS / "kohya.safetensors"
    args = serve.parse_args(["--demo", "--lora", f"{lora}:0.7"])  # a request without loras runs them as given
    assert args.defaults.loras == (("kohya", 0.7),) and args.defaults.prompt == ""
    assert serve.parse_args(["--demo", "--lora", str(lora), "--fuse-lora"]).defaults.loras == ()
    for argv, message in [(["--max-batch", "0"], "--max-batch 0: must be >= 1"),
                          (["--height", "100"], "--height: 100 is not a multiple of 16"),
                          (["--output-dir", str(tmp_path / "missing")], "no such folder"),
                          (["--port", "70000"], "--port 70000: must be between 0 and 65535"),
                          (["--sizes", "1024"], "--sizes 1024: each size is HEIGHTxWIDTH"),
                          (["--sizes", "1024x1000"], "--sizes 1024x1000: sides must be multiples of 16")]:
        with pytest.raises(SystemExit) as exit_:
            serve.parse_args(["--demo"] + argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and message in err and err.count("\n") == 1, err


def test_batches_are_padded_to_few_sizes():
    from mxdit.server import padded_batch_size

    assert [padded_batch_size(n, 8) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert [padded_batch_size(n, 6, min_batch=3) for n in range(1, 7)] == [3, 3, 3, 6, 6, 6]  # a data=3 mesh
