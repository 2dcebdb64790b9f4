"""A warm generation server: one loaded, compiled pipeline behind an HTTP API (aiohttp) and a queue that batches
compatible requests. scripts/serve.py is its command line.

    POST /v1/generate      a request's JSON (model/requests.py's fields but `output`): waits for the image, answers
                           {"id", "image": "/v1/images/<id>.png", "seed", "batch_size", "timings": {...}}
    GET  /v1/images/<id>.png   the PNG of a finished request (the newest `keep_images` are kept)
    GET  /v1/health        status, queue length and limits, images generated
    GET  /v1/loras         the LoRAs loaded (--lora) and the weights they ran with last

A bad request gets 400 with {"error": "..."} naming the field, a full queue 503 (with Retry-After), a failed
generation 500; none of them touches the other requests. One worker thread runs the pipeline: it takes the oldest
request, waits up to `batch_wait_s` for more of its batch key, and runs up to `max_batch` of them as one call,
padded to a power of two so that few programs are compiled. LoRA weights change per batch without recompiling
(`lora_files.LoraSlots`).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import io
import threading
import time
import uuid
from pathlib import Path

from mxdit.model.requests import GenerationRequest, generate_batch, parse_request


class QueueFull(Exception):
    """The queue holds `max_queue` requests: the caller should come back later."""


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """max_batch: images per pipeline call; min_batch: the smallest call (a mesh's data axis splits every batch);
    max_queue: requests waiting before 503; batch_wait_s: how long the oldest
    request waits for others of its batch key; keep_images: finished PNGs kept for GET; output_dir: also write each
    PNG there (as <id>.png); sizes: the (height, width) a request may ask for (empty: any), so that no request makes
    the worker compile a new shape while the others wait; the rest as generate.py's flags."""

    max_batch: int = 4
    min_batch: int = 1
    max_queue: int = 64
    batch_wait_s: float = 0.02
    keep_images: int = 256
    output_dir: Path | None = None
    tiled_decode: bool = False
    true_cfg: float = 1.0
    max_sequence_length: int | None = None
    sizes: tuple[tuple[int, int], ...] = ()


@dataclasses.dataclass
class _Job:
    request: GenerationRequest
    future: concurrent.futures.Future
    submitted: float
    id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)


def padded_batch_size(n: int, max_batch: int, min_batch: int = 1) -> int:
    """The batch size a call of n requests runs at: the next power of two, at most max_batch, at least min_batch."""
    size = min_batch
    while size < n:
        size *= 2
    return min(size, max_batch)


class GenerationServer:
    """The queue and the worker thread around `pipe`; `defaults`: the request fields a body leaves out;
    `program_store`: the worker's `ProgramStore` (serialized executables), or None."""

    def __init__(self, pipe, config: ServerConfig = ServerConfig(), defaults: GenerationRequest | None = None,
                 program_store=None, model_name: str = "model"):
        self.pipe, self.config, self.model_name = pipe, config, model_name
        self.defaults = defaults or GenerationRequest(prompt="")
        self.program_store = program_store
        self.images: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        self.generated = 0
        self._pending: list[_Job] = []
        self._cond = threading.Condition()
        self._stopped = False
        self._worker = threading.Thread(target=self._run, name="mxdit-generation", daemon=True)

    # -- the queue -------------------------------------------------------------------------------------------------

    def start(self) -> None:
        self._worker.start()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._worker.join()

    def queued(self) -> int:
        with self._cond:
            return len(self._pending)

    def submit(self, request: GenerationRequest) -> _Job:
        """Queue a request; its job's future gets the result dict. Raises QueueFull, or ValueError for LoRAs that are
        not loaded."""
        slots = self.pipe.lora_slots
        known = slots.names if slots is not None else ()
        unknown = [name for name, _ in request.loras if name not in known]
        if unknown:
            raise ValueError(f"loras: {unknown[0]!r} is not loaded (loaded: {', '.join(known) or 'none'})")
        if self.config.sizes and (request.height, request.width) not in self.config.sizes:
            served = ", ".join(f"{h}x{w}" for h, w in self.config.sizes)
            raise ValueError(f"height, width: {request.height}x{request.width} is not served (served: {served})")
        job = _Job(request, concurrent.futures.Future(), time.perf_counter())
        with self._cond:
            if self._stopped:
                raise QueueFull("the server is stopping")
            if len(self._pending) >= self.config.max_queue:
                raise QueueFull(f"the queue is full ({len(self._pending)} requests waiting); try again later")
            self._pending.append(job)
            self._cond.notify_all()
        return job

    def _next_batch(self) -> list[_Job] | None:
        """The oldest job and up to max_batch - 1 more of its batch key, after waiting up to batch_wait_s for them."""
        with self._cond:
            while not self._pending and not self._stopped:
                self._cond.wait()
            if self._stopped:
                return None
            key = self._pending[0].request.batch_key()
            deadline = time.monotonic() + self.config.batch_wait_s
            while True:
                same = [job for job in self._pending if job.request.batch_key() == key]
                remaining = deadline - time.monotonic()
                if len(same) >= self.config.max_batch or remaining <= 0 or self._stopped:
                    break
                self._cond.wait(remaining)
            batch = same[:self.config.max_batch]
            taken = {id(job) for job in batch}
            self._pending = [job for job in self._pending if id(job) not in taken]
            return batch

    def _run(self) -> None:
        from mxdit.model.programs import use_program_store

        with use_program_store(self.program_store):
            while (batch := self._next_batch()) is not None:
                # a request whose caller went away (its future cancelled) is dropped, not run
                batch = [job for job in batch if job.future.set_running_or_notify_cancel()]
                if not batch:
                    continue
                try:
                    self._run_batch(batch)
                except Exception as e:  # the worker goes on; a request not answered yet gets the error
                    for job in batch:
                        if not job.future.done():
                            job.future.set_exception(e)
        with self._cond:  # what is left when stopping fails rather than waits forever
            left, self._pending = self._pending, []
        for job in left:
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(QueueFull("the server stopped"))

    def _run_batch(self, batch: list[_Job]) -> None:
        started = time.perf_counter()
        c = self.config
        try:
            images, timings = generate_batch(
                self.pipe, [job.request for job in batch],
                pad_to=padded_batch_size(len(batch), c.max_batch, c.min_batch),
                lora_slots=self.pipe.lora_slots, tiled_decode=c.tiled_decode, true_cfg=c.true_cfg,
                max_sequence_length=c.max_sequence_length)
            pngs = []
            for image in images:
                buffer = io.BytesIO()
                image.save(buffer, format="PNG")
                pngs.append(buffer.getvalue())
        except Exception as e:  # this batch's requests fail; the server and the queue go on
            for job in batch:
                job.future.set_exception(e)
            return
        for job, png in zip(batch, pngs, strict=True):
            with self._cond:
                self.images[job.id] = png
                while len(self.images) > c.keep_images:
                    self.images.popitem(last=False)
                self.generated += 1
            result = {"id": job.id, "image": f"/v1/images/{job.id}.png", "seed": job.request.seed,
                      "batch_size": len(batch)}
            if c.output_dir is not None:
                from mxdit.model.loading import write_atomically

                try:
                    write_atomically(c.output_dir / f"{job.id}.png", lambda tmp, png=png: tmp.write_bytes(png))
                except OSError as e:  # the image is still kept for GET: the answer says what was not written
                    result["warning"] = f"not written to {c.output_dir}: {e}"
            result["timings"] = {"queue": started - job.submitted, **timings,
                                 "total": time.perf_counter() - job.submitted}
            job.future.set_result(result)

    # -- HTTP ------------------------------------------------------------------------------------------------------

    def app(self):
        """The aiohttp application serving the API."""
        from aiohttp import web

        @web.middleware
        async def json_errors(request, handler):
            try:
                return await handler(request)
            except web.HTTPException as e:  # aiohttp's own (404, 405, 413): as JSON like ours
                if e.status < 400:
                    raise
                return web.json_response({"error": e.reason}, status=e.status)

        app = web.Application(middlewares=[json_errors], client_max_size=1 << 20)
        app.add_routes([web.post("/v1/generate", self._generate), web.get("/v1/images/{id}.png", self._image),
                        web.get("/v1/health", self._health), web.get("/v1/loras", self._loras)])
        return app

    async def _generate(self, request):
        from aiohttp import web

        try:
            fields = await request.json()
        except ValueError:
            return web.json_response({"error": "the body is not JSON"}, status=400)
        if isinstance(fields, dict) and "output" in fields:
            return web.json_response({"error": "output: not a server field (GET the image instead)"}, status=400)
        try:
            job = self.submit(parse_request(fields, self.defaults))
        except ValueError as e:
            return web.json_response({"error": str(e)}, status=400)
        except QueueFull as e:
            return web.json_response({"error": str(e)}, status=503, headers={"Retry-After": "1"})
        try:
            result = await asyncio.wrap_future(job.future)
        except Exception as e:
            status = 503 if isinstance(e, QueueFull) else 500
            message = (str(e).strip().splitlines() or [""])[0][:500]
            return web.json_response({"error": f"{type(e).__name__}: {message}", "id": job.id}, status=status)
        return web.json_response(result)

    async def _image(self, request):
        from aiohttp import web

        png = self.images.get(request.match_info["id"])
        if png is None:
            return web.json_response({"error": f"no image {request.match_info['id']!r} (unknown or no longer kept)"},
                                     status=404)
        return web.Response(body=png, content_type="image/png")

    async def _health(self, request):
        from aiohttp import web

        alive = self._worker.is_alive()
        return web.json_response({"status": "ok" if alive else "worker stopped", "model": self.model_name,
                                  "queued": self.queued(),
                                  "max_queue": self.config.max_queue, "max_batch": self.config.max_batch,
                                  "generated": self.generated}, status=200 if alive else 503)

    async def _loras(self, request):
        from aiohttp import web

        slots = self.pipe.lora_slots
        weights = slots.weights if slots is not None else {}
        return web.json_response({"loras": [{"name": name, "weight": weight} for name, weight in weights.items()]})


class RunningServer:
    """`server`'s app served on host:port from a thread with its own event loop (port 0: a free one, see `.port`);
    `close()` stops the HTTP side and the worker."""

    def __init__(self, server: GenerationServer, host: str = "127.0.0.1", port: int = 0):
        from aiohttp import web

        self.server, self.host = server, host
        self._loop = asyncio.new_event_loop()
        self._runner = web.AppRunner(server.app())
        ready = concurrent.futures.Future()

        async def start():
            await self._runner.setup()
            site = web.TCPSite(self._runner, host, port)
            await site.start()
            return self._runner.addresses[0][1]

        def serve():
            asyncio.set_event_loop(self._loop)
            try:
                ready.set_result(self._loop.run_until_complete(start()))
            except BaseException as e:
                ready.set_exception(e)
                return
            self._loop.run_forever()

        server.start()
        self._thread = threading.Thread(target=serve, name="mxdit-http", daemon=True)
        self._thread.start()
        self.port = ready.result()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self.server.stop()
