"""What the command-line scripts (scripts/) share: one-line errors, the dtype names, the device flags, the count of
compilations."""

from __future__ import annotations

import argparse
import threading

DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


class OneLineErrorParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line naming what is wrong (no usage dump), exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_device_arguments(parser, mesh_help: str) -> None:
    """--mesh (named axes, e.g. data=2,seq=4) and --distributed (jax.distributed.initialize() first)."""
    parser.add_argument("--mesh", default=None, help=mesh_help)
    parser.add_argument("--distributed", action="store_true",
                        help="call jax.distributed.initialize() first (one process per host, same command on each)")


def check_device_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject a malformed --mesh at parse time, before any model is loaded."""
    if args.mesh is not None:
        from mxdit.sharding.mesh import parse_mesh

        try:
            parse_mesh(args.mesh)
        except ValueError as e:
            parser.error(f"--mesh: {e}")


def mesh_from_arguments(args: argparse.Namespace):
    """jax.distributed.initialize() if --distributed, then the --mesh's `jax.sharding.Mesh` (None without --mesh).
    A mesh that does not fit the devices raises ValueError starting with "--mesh:"."""
    if args.distributed:
        import jax

        jax.distributed.initialize()  # coordinator, process count and id from the launcher's environment
    if args.mesh is None:
        return None
    from mxdit.sharding.mesh import make_mesh

    try:
        return make_mesh(args.mesh)
    except ValueError as e:
        raise ValueError(f"--mesh: {e}") from None


BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # each program XLA hands back: compiled or read
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"  # ...of which read from the persistent compilation cache


class CompileLog:
    """While active (a context manager), counts the programs JAX compiled and those it read from the persistent
    compilation cache instead, with their seconds, from `jax.monitoring`'s events: each program XLA hands back
    records BACKEND_COMPILE_EVENT's duration, preceded (in the same thread) by CACHE_HIT_EVENT when the persistent
    cache served it. Programs found in this process's in-memory caches record neither."""

    def __init__(self):
        self.compiled, self.compile_s = 0, 0.0
        self.cached, self.cache_s = 0, 0.0
        self._hit = threading.local()

    def _on_event(self, event: str, **kwargs) -> None:
        if event == CACHE_HIT_EVENT:
            self._hit.pending = True

    def _on_duration(self, event: str, seconds: float, **kwargs) -> None:
        if event != BACKEND_COMPILE_EVENT:
            return
        if getattr(self._hit, "pending", False):
            self._hit.pending = False
            self.cached, self.cache_s = self.cached + 1, self.cache_s + seconds
        else:
            self.compiled, self.compile_s = self.compiled + 1, self.compile_s + seconds

    def __enter__(self) -> "CompileLog":
        from jax import monitoring

        monitoring.register_event_listener(self._on_event)
        monitoring.register_event_duration_secs_listener(self._on_duration)
        return self

    def __exit__(self, *exc) -> None:
        from jax import monitoring

        monitoring.unregister_event_listener(self._on_event)
        monitoring.unregister_event_duration_listener(self._on_duration)

    def summary(self, cache_on: bool) -> str:
        """One line: what was compiled and what the persistent cache (`cache_on`: in use) served, e.g. "compilation:
        3 programs compiled (1.2 s), 11 programs read from the compile cache (0.4 s)"."""
        def programs(n: int) -> str:
            return f"{n} program{'s' if n != 1 else ''}"

        if not self.compiled and not self.cached:
            return "compilation: none (every program was already compiled in this process)"
        compiled = f"{programs(self.compiled)} compiled ({self.compile_s:.1f} s)" if self.compiled else "none compiled"
        if not cache_on:
            cached = "compile cache off"
        elif self.cached:
            cached = f"{programs(self.cached)} read from the compile cache ({self.cache_s:.1f} s)"
        else:
            cached = "none read from the compile cache"
        return f"compilation: {compiled}, {cached}"
