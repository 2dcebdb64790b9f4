"""What the command-line scripts (scripts/) share: one-line errors, the dtype names, the device flags."""

from __future__ import annotations

import argparse

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
