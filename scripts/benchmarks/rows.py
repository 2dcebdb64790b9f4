"""Result rows: a benchmark prints each as a JSON line, its parent process reads them back from a child's output,
prints them as a table and writes them with --json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CLI = Path(__file__).resolve().parents[1] / "benchmark.py"


def error_text(e: BaseException) -> str:
    """An exception as a row's "error": one variant's failure is a result, and the others go on."""
    return f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"


def emit(row: dict) -> dict:
    """Print a row as a JSON line (the parent process reads it from this process's output)."""
    print(json.dumps(row), flush=True)
    return row


def subprocess_rows(args, command: str, forwarded: list[str], env: dict | None = None) -> list[dict]:
    """Run part of a benchmark as `benchmark.py command *forwarded` in a subprocess (so that frameworks and models
    never share GPU memory); its result rows. `env`: variables added to the subprocess's environment. With --json,
    its standard error goes to a log beside the file as it is written (what a variant that never ends did last)."""
    env = {**os.environ, **(env or {})}
    log_file = Path(args.json).with_suffix(f".{command}.log").open("a+") if args.json else tempfile.TemporaryFile("w+")
    with log_file as log:
        log.write(f"$ {command} {' '.join(forwarded)}\n")
        log.flush()
        start = log.tell()
        proc = subprocess.run([sys.executable, str(CLI), command, *forwarded], stdout=subprocess.PIPE, stderr=log,
                              text=True, env=env)
        log.seek(start)
        stderr = log.read()
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode:
        tail = " | ".join(stderr.strip().splitlines()[-3:])[-600:] if stderr else "failed"
        # named by its command line: a variant that fails before its row names itself
        rows.append({"name": " ".join([command, *forwarded]), "error": f"exit {proc.returncode}: {tail}"})
    return rows


def write_json(args, rows: list[dict]) -> None:
    """The rows to --json's file, if given."""
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def flags(args, *names: str) -> list[str]:
    """The command-line flags that give `args`' values of `names` (attribute names) to a subprocess: lists as
    several values, booleans as the bare flag when true, None left out."""
    out = []
    for name in names:
        value, flag = getattr(args, name), "--" + name.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, (list, tuple)):
            out += [flag, *map(str, value)]
        else:
            out += [flag, str(value)]
    return out


def step_table(rows: list[dict], title: str) -> None:
    """The step benchmarks' table: time, TFLOP/s, memory, and the GPU's clock, power and energy a step."""
    print(f"\n{title}")
    print(f"{'implementation':<62} {'s/step':>8} {'TFLOP/s':>8} {'peak GB':>8} {'warm-up s':>9} {'weights GB':>10} "
          f"{'temp GB':>8} {'SM MHz':>7} {'max W':>6} {'mean W':>6} {'J/step':>6}")
    for r in rows:
        if "name" not in r:
            continue
        if "error" in r:
            print(f"{r['name']:<62} error: {r['error']}")
            continue
        extra = "".join(f" {r[k]:{w}.{d}f}" if k in r else f" {'':>{w}}"
                        for k, w, d in (("weights_gb", 10, 1), ("temp_gb", 8, 1), ("sm_mhz_median", 7, 0),
                                        ("power_w_max", 6, 0), ("power_w_mean", 6, 0), ("joules_per_step", 6, 1)))
        print(f"{r['name']:<62} {r['s_per_step']:8.4f} {r['tflops']:8.0f} {r['peak_gb']:8.1f} {r['compile_s']:9.1f}"
              + extra)
