"""Compiled programs kept on disk, so that a second start of a process skips tracing, lowering and compiling.

JAX's persistent compilation cache saves XLA's compile only: a new process still traces each function and lowers it
to StableHLO before the cache is consulted, seconds for a full-size transformer. `stored_jit` is `jax.jit` for the
pipelines' programs; inside `use_program_store(folder)` its first call of a shape either loads the executable that
an earlier process serialized into `folder` (`jax.experimental.serialize_executable`), or lowers and compiles it and
writes it there. Outside a store it is plain `jax.jit`.

A first start compiles the stages of a pipeline concurrently: in `ProgramStore.ahead()` a stored program's first call
of a shape does not run. It is lowered in the calling thread and compiled on a pool of threads (a stored one is
loaded in the calling thread), and returns zeros of its outputs' shapes, so that a dry run of the pipeline
(`compile_ahead`) reaches every program while the earlier ones compile. The real call that follows waits for each
program as it needs it. A run that recorded its programs (`ProgramStore.note_run`) and finds them all stored skips
the dry run: it would only load them.

A stored program is keyed by everything that decides what it computes and where it runs: the function's name, its
static arguments, the inputs' tree structure (which holds a module's config, dtype, attention kernel and
precision: their static fields) with each leaf's shape, dtype and sharding, the jax and jaxlib versions, the backend
and its version, the devices' kinds and count, `XLA_FLAGS`, and a hash of this package's source. A changed program
gets a new key, never an old executable; a file that cannot be read or loaded is compiled again and replaced.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib
import importlib.metadata
import inspect
import json
import os
import pickle
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp

from .loading import write_atomically

UNUSED_DAYS = 30  # a stored program not loaded or written for this long is deleted when the store next writes
FORMAT = 3  # a stored file: (FORMAT, out_tree, serialized executable, the device's id, the outputs' weak types)
SUFFIX = ".xla"
COMPILE_THREADS = 4  # compiles at once ahead: XLA's GPU autotuning runs kernels on the device while it compiles
_SOURCE_FOLDERS = ("model", "ops", "quant", "pallas_kernels", "sharding")


@dataclasses.dataclass
class StoreStats:
    """What a store did in this process: programs loaded from disk or compiled (and written), with their seconds."""

    loaded: int = 0
    load_s: float = 0.0
    compiled: int = 0
    compile_s: float = 0.0
    failed_loads: list[str] = dataclasses.field(default_factory=list)


class ProgramStore:
    """Serialized executables in `folder`, one file per program and input shape, with an in-process table in front."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.stats = StoreStats()
        self._programs: dict = {}
        self._lock = threading.Lock()  # guards the tables and the stats
        self._program_locks: dict = {}  # one per program: two threads never compile the same one, others go on
        self._environment: str | None = None
        self._pruned = False
        self._outputs: dict = {}  # a compiling program's output shapes, for the zeros it returns ahead
        self._pool: ThreadPoolExecutor | None = None
        self._served: set[str] = set()  # the stored programs' file names this process loaded or wrote

    @contextlib.contextmanager
    def ahead(self) -> Iterator[ProgramStore]:
        """Within the block, in this thread, a program's first call of a shape is traced and lowered here and
        compiled on the store's threads (a stored one is loaded here), and returns zeros shaped and placed as its
        outputs; its later calls return zeros too. Only for a dry run whose results are thrown away: after the block
        the same calls run the compiled programs. A call whose inputs span several devices runs for real (its
        outputs' placement is the program's own)."""
        previous = getattr(_active, "ahead", False)
        _active.ahead = True
        try:
            yield self
        finally:
            _active.ahead = previous

    def close(self) -> None:
        """Drop the compiles queued ahead and not started (a started one finishes); a later call compiles its
        program itself."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def _run_path(self, run: str) -> Path:
        digest = hashlib.sha256(f"{self.environment()}\nrun {run}".encode()).hexdigest()
        return self.folder / "runs" / f"{digest[:32]}.json"

    def stored_run(self, run: str) -> bool:
        """Whether a run described by `run` (the settings that choose its programs, e.g. the model, precision, image
        size and batch) was recorded (`note_run`) in this environment and every program it used is still stored:
        compiling ahead would then only load them, and its dry run would slow the weights' read."""
        try:
            names = json.loads(self._run_path(run).read_text())
        except (OSError, ValueError):
            return False
        return bool(names) and all((self.folder / name).is_file() for name in names)

    def note_run(self, run: str) -> None:
        """Record that the run `run` used the programs this store has loaded or written in this process."""
        with self._lock:
            names = sorted(self._served)
        if not names:
            return
        path = self._run_path(run)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(path, lambda tmp: tmp.write_text(json.dumps(names)))
        except OSError:  # a read-only store: the next start compiles ahead again
            pass

    def prune(self, unused_days: float = UNUSED_DAYS) -> int:
        """Delete the stored programs and run records not loaded or written for `unused_days` (another jax, another
        version of this code, a size no longer asked for: their keys are never met again); returns how many."""
        cutoff, removed = time.time() - unused_days * 86400, 0
        for path in [*self.folder.glob(f"*{SUFFIX}"), *self.folder.glob("runs/*.json")]:
            try:
                if path.stat().st_mtime < cutoff:
                    path.unlink()
                    removed += 1
            except OSError:  # another process removed or replaced it
                pass
        return removed

    def _note(self, path: Path, problem: str) -> None:
        with self._lock:
            self.stats.failed_loads.append(f"{path.name}: {problem}")

    def summary(self) -> str:
        """One line, e.g. "executables: 4 loaded (0.3 s), 1 compiled and stored (2.1 s)"."""
        s = self.stats
        line = f"executables: {s.loaded} loaded ({s.load_s:.1f} s), {s.compiled} compiled and stored ({s.compile_s:.1f} s)"
        return line + (f"; {len(s.failed_loads)} not loaded or not stored: {s.failed_loads[0]}" if s.failed_loads else "")

    def environment(self) -> str:
        """The part of every key that depends on the process, not on the call: versions, devices, flags, source."""
        if self._environment is None:
            backend = jax.extend.backend.get_backend()
            devices = jax.devices()
            parts = [f"format {FORMAT}", f"jax {jax.__version__}", f"jaxlib {jax.lib.__version__}",
                     f"platform {backend.platform} {backend.platform_version}",
                     f"devices {len(devices)} x {sorted({d.device_kind for d in devices})}",
                     f"processes {jax.process_count()}", f"XLA_FLAGS {os.environ.get('XLA_FLAGS', '')}",
                     f"x64 {jax.config.jax_enable_x64}",
                     f"matmul precision {jax.config.jax_default_matmul_precision}",
                     f"flax {importlib.metadata.version('flax')}", f"source {source_hash()}"]
            self._environment = "\n".join(parts)
        return self._environment

    def call(self, name: str, jitted, dynamic: Sequence, static: dict):
        """`jitted(*dynamic, **static)` by the stored executable of this shape (loaded, or compiled and stored)."""
        leaves, treedef = jax.tree.flatten(tuple(dynamic))
        if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):  # inside another program's trace
            return jitted(*dynamic, **static)
        ahead = getattr(_active, "ahead", False) and len(_devices(leaves)) <= 1
        signature = tuple(_leaf_signature(leaf) for leaf in leaves)
        memo = (name, treedef, signature, tuple(sorted(static.items())))
        program = self._programs.get(memo)
        if program is None:
            with self._lock:
                program_lock = self._program_locks.setdefault(memo, threading.Lock())
            with program_lock:
                program = self._programs.get(memo)
                if program is None:
                    program = self._load_or_compile(memo, jitted, dynamic, static, ahead)
                    self._programs[memo] = program
        if ahead:
            return _zeros(self._outputs[memo], leaves)
        if isinstance(program, Future):  # compiled ahead: wait for it
            try:
                program = program.result()
            except CancelledError:  # dropped by `close`: compiled now
                self._programs.pop(memo, None)
                return self.call(name, jitted, dynamic, static)
            except Exception:  # as a compile that fails in the call: raised here, tried again by the next call
                self._programs.pop(memo, None)
                raise
            self._programs[memo] = program
        if program is _ON_DEVICES:
            return jitted(*dynamic, **static)
        return program(*dynamic)

    def _load_or_compile(self, memo, jitted, dynamic, static, ahead: bool):
        name, treedef, signature, _ = memo
        key = hashlib.sha256("\n".join([
            self.environment(), f"program {name}", f"static {sorted(static.items())!r}", f"tree {treedef}",
            *(f"{shape} {dtype} {weak} {sharding}" for shape, dtype, weak, sharding in signature)]).encode()).hexdigest()
        path = self.folder / f"{name.rsplit('.', 1)[-1]}-{key[:32]}{SUFFIX}"
        in_tree = jax.tree.structure((tuple(dynamic), {}))  # as a compiled executable is called: no keyword arguments
        if path.is_file():
            t0 = time.perf_counter()
            try:
                fmt, *stored = pickle.loads(path.read_bytes())
                if fmt != FORMAT:
                    raise ValueError(f"format {fmt}, expected {FORMAT}")
                out_tree, payload, device_id, out_weak = stored
                # Its own device: by default an executable is loaded onto all of the backend's devices.
                device = next(d for d in jax.devices() if d.id == device_id)
                from jax.experimental.serialize_executable import deserialize_and_load

                _prepare_backend()
                program = deserialize_and_load(payload, in_tree, out_tree, execution_devices=[device])
                self._outputs[memo] = _with_weak_types(program.out_info, out_weak)
                with self._lock:
                    self._served.add(path.name)
                    self.stats.loaded += 1
                    self.stats.load_s += time.perf_counter() - t0
                try:
                    os.utime(path)  # in use: `prune` keeps it
                except OSError:  # a read-only store still serves
                    pass
                return program
            except Exception as e:  # a stale or damaged file: compiled again below and replaced
                self._note(path, f"{type(e).__name__}: {str(e)[:200]}")
        t0 = time.perf_counter()
        traced = jitted.trace(*dynamic, **static)
        self._outputs[memo] = traced.out_info  # with the outputs' weak types, which the lowered program lacks
        out_weak = tuple(bool(out.weak_type) for out in jax.tree.leaves(traced.out_info))
        lowered = traced.lower()
        lower_s = time.perf_counter() - t0
        if ahead:  # lowered here, compiled there: the caller goes on to the next program meanwhile
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max(1, min(COMPILE_THREADS, os.cpu_count() or 1)),
                                                    thread_name_prefix="mxdit-compile")
                return self._pool.submit(self._compile, lowered, path, in_tree, dynamic, out_weak, lower_s)
        return self._compile(lowered, path, in_tree, dynamic, out_weak, lower_s)

    def _compile(self, lowered, path: Path, in_tree, dynamic: Sequence, out_weak: tuple, lower_s: float):
        """Compile `lowered` and write its executable to `path`; the executable (or `_ON_DEVICES`)."""
        t0 = time.perf_counter()
        compiled = lowered.compile()
        if not _one_device(compiled):
            return _ON_DEVICES
        with self._lock:
            self.stats.compiled += 1
            self.stats.compile_s += lower_s + time.perf_counter() - t0
        from jax.experimental.serialize_executable import serialize

        try:
            payload, _, out_tree = serialize(compiled)
        except Exception as e:  # an executable the backend cannot serialize still runs in this process
            self._note(path, f"not serializable: {type(e).__name__}: {str(e)[:200]}")
            return compiled
        (device,) = {d for sharding in jax.tree.leaves(compiled.input_shardings) for d in sharding.device_set}
        if device.platform == "cpu" and not _runs_when_loaded(payload, in_tree, out_tree, device, dynamic):
            self._note(path, "not stored: its executable does not run when loaded")
            return compiled
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with self._lock:  # once a process, when it adds a program: the folder does not grow without end
                prune, self._pruned = not self._pruned, True
            if prune:
                self.prune()
            write_atomically(path, lambda tmp: tmp.write_bytes(
                pickle.dumps((FORMAT, out_tree, payload, device.id, out_weak))))
            with self._lock:
                self._served.add(path.name)
        except OSError as e:  # a full disk or a read-only store: the program still runs in this process
            self._note(path, f"not stored: {e}")
        return compiled


# A program that runs on several devices (a mesh's, from its arguments or from a mesh context): `jax.jit` serves it,
# since jax.jit moves the arguments it is given onto the program's devices and a compiled executable does not.
_ON_DEVICES = object()


def _devices(leaves: Sequence) -> set:
    return {d for leaf in leaves if isinstance(leaf, jax.Array) for d in leaf.sharding.device_set}


def _with_weak_types(shapes, weak: Sequence[bool]):
    """`shapes` (a loaded executable's outputs, which do not say which are weakly typed) with their weak types."""
    leaves, tree = jax.tree.flatten(shapes)
    return jax.tree.unflatten(tree, [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=s.sharding, weak_type=w)
                                     for s, w in zip(leaves, weak, strict=True)])


def _zeros(shapes, inputs: Sequence):
    """Zeros of `shapes` (a tree of ShapeDtypeStruct) as the program would return them: on its output sharding or
    else on the inputs' one device, weakly typed where its outputs are, so that the programs a dry run calls next
    see the arguments of the real run."""
    devices = _devices(inputs)
    default = next(iter(devices)) if len(devices) == 1 else None

    def zeros(shape):
        place = getattr(shape, "sharding", None) or default
        if shape.weak_type:  # a Python scalar's zero is weakly typed, and broadcasting keeps it
            zero = jnp.asarray(shape.dtype.type(0).item())
            if zero.dtype == shape.dtype:
                return jax.device_put(jnp.broadcast_to(zero, shape.shape), place)
        return jnp.zeros(shape.shape, shape.dtype, device=place)

    return jax.tree.map(zeros, shapes)


def _one_device(program) -> bool:
    return all(len(sharding.device_set) == 1 for sharding in jax.tree.leaves(program.input_shardings))


def _runs_when_loaded(payload: bytes, in_tree, out_tree, device, dynamic: Sequence) -> bool:
    """Whether the serialized executable loads and runs. XLA:CPU can compile a program that calls kernels an earlier
    program of the process compiled, which its serialized form then lacks ("Function ... not found" when run): such a
    file is not kept. Run once on the call's arguments (zeros for those given as shapes: `pipeline_shapes`), on the
    CPU only, where the programs are small."""
    from jax.experimental.serialize_executable import deserialize_and_load

    dynamic = jax.tree.map(lambda x: _zeros(x, ()) if isinstance(x, jax.ShapeDtypeStruct) else x, dynamic)
    try:
        program = deserialize_and_load(payload, in_tree, out_tree, execution_devices=[device])
        jax.block_until_ready(program(*dynamic))
        return True
    except Exception:
        return False


@functools.cache
def _prepare_backend() -> None:
    """What a loaded executable needs that compiling it would have set up: Mosaic GPU kernels link against its
    runtime library, which `jax.experimental.mosaic.gpu` names (MOSAIC_GPU_RUNTIME_LIB_PATH) when imported; a process
    that loads them without that import fails to link their host code."""
    if jax.default_backend() == "gpu":
        try:
            importlib.import_module("jax.experimental.mosaic.gpu")
        except ImportError:  # a GPU build without Mosaic GPU: nothing to link
            pass


def _leaf_signature(leaf) -> tuple:
    sharding = getattr(leaf, "sharding", None)
    if not hasattr(leaf, "shape"):  # a Python scalar: traced as a weakly typed scalar
        return ((), type(leaf).__name__, True, None)
    return (tuple(leaf.shape), str(leaf.dtype), bool(getattr(leaf, "weak_type", False)), sharding)


@functools.cache
def source_hash() -> str:
    """A hash of the Python source of the packages that build programs: any change to them gives new keys."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for folder in _SOURCE_FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


_active = threading.local()  # per thread: a server's worker thread and a test's store do not see each other's


def active_store() -> ProgramStore | None:
    return getattr(_active, "store", None)


@contextlib.contextmanager
def use_program_store(store: ProgramStore | str | Path | None) -> Iterator[ProgramStore | None]:
    """Within the block, in this thread, `stored_jit` functions run through `store` (a folder: a new store on it;
    None: plain `jax.jit`)."""
    made = store is not None and not isinstance(store, ProgramStore)
    if made:
        store = ProgramStore(store)
    previous = active_store()
    _active.store = store
    try:
        yield store
    finally:
        _active.store = previous
        if made:
            store.close()


def compile_ahead(dry_run: Callable[[], object]) -> float:
    """Call `dry_run` (a pipeline call whose results are thrown away) in the active store's `ahead` mode: its
    programs are lowered one after another and compile concurrently. Returns its seconds. Without a store nothing is
    called (the dry run would compute for real)."""
    store = active_store()
    if store is None:
        return 0.0
    t0 = time.perf_counter()
    try:
        with store.ahead():
            dry_run()
    except BaseException:  # no real run follows: the queued compiles would only hold up the process's exit
        store.close()
        raise
    return time.perf_counter() - t0


class StoredJit:
    """`jax.jit(fn, static_argnames=...)` whose calls go through the active `ProgramStore`, if any."""

    def __init__(self, fn: Callable, static_argnames: Sequence[str] = ()):
        self.jitted = jax.jit(fn, static_argnames=tuple(static_argnames))
        self.static_argnames = tuple(static_argnames)
        self.signature = inspect.signature(fn)
        self.name = f"{fn.__module__}.{fn.__qualname__}"
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        store = active_store()
        if store is None:
            return self.jitted(*args, **kwargs)
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()  # the dynamic arguments go positionally, each in its place
        static = {name: bound.arguments.pop(name) for name in self.static_argnames if name in bound.arguments}
        dynamic = []
        for name, value in bound.arguments.items():
            if self.signature.parameters[name].kind is inspect.Parameter.VAR_POSITIONAL:
                dynamic.extend(value)
            else:
                dynamic.append(value)
        return store.call(self.name, self.jitted, dynamic, static)

    def lower(self, *args, **kwargs):
        return self.jitted.lower(*args, **kwargs)


def stored_jit(fn: Callable | None = None, *, static_argnames: Sequence[str] = ()):
    """Decorator: `jax.jit` that a `ProgramStore` can serve (`@stored_jit` or `@stored_jit(static_argnames=...)`)."""
    if fn is None:
        return functools.partial(stored_jit, static_argnames=static_argnames)
    return StoredJit(fn, static_argnames)
