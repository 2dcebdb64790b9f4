"""The GPU tier, stored programs: an executable holding Mosaic GPU kernels, stored by one process, loads in a fresh
one (no tracing) and computes what the kernel's reference does. `pytest -m gpu`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

pytestmark = pytest.mark.gpu

CHILD = r'''
import json, sys
import jax.numpy as jnp, numpy as np
from mxdit.pallas_kernels import gemm
from mxdit.model.programs import stored_jit, use_program_store

@stored_jit
def one_gemm(xq, xs, w):
    return gemm.scaled_matmul(xq, w, xs, out_dtype=jnp.float32)

shapes = {"A": (256, 512, 512), "B": (512, 1024, 768)}  # two kernels of one name, other shapes
order = sys.argv[2].split(",")
with use_program_store(sys.argv[1]) as store:
    for name in order:
        r = np.random.default_rng(ord(name))
        m, k, n = shapes[name]
        x = jnp.asarray(r.standard_normal((m, k)), jnp.bfloat16)
        w = jnp.asarray(r.standard_normal((n, k)) * k**-0.5, jnp.bfloat16)
        wq = gemm.prepare_weight(w, "fp8_e4m3", backend="mosaic")
        xq, xs = gemm.quantize_activations(x, "token", "fp8_e4m3")
        y = np.asarray(one_gemm(xq, xs, wq), np.float64)
        ref = np.asarray(gemm.scaled_matmul_reference(xq, xs, wq, out_dtype=jnp.float32), np.float64)
        print(json.dumps({"program": name, "relative_l2": float(np.linalg.norm(y - ref) / np.linalg.norm(ref))}))
    print(json.dumps({"loaded": store.stats.loaded, "compiled": store.stats.compiled,
                      "failed": store.stats.failed_loads}))
'''


def _run(folder: Path, order: str) -> list[dict]:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(folder), order], capture_output=True, text=True,
                          env={**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_a_fresh_process_loads_stored_mosaic_kernels_and_they_compute_their_reference(tmp_path):
    capability = getattr(jax.devices()[0], "compute_capability", "")
    if not capability.startswith("9."):
        pytest.skip(f"the Mosaic kernels need a Hopper GPU, this is {capability!r}")
    *stored, summary = _run(tmp_path, "A,B")
    assert summary["compiled"] == 2 and all(row["relative_l2"] < 1e-3 for row in stored), stored
    *loaded, summary = _run(tmp_path, "B,A")  # the other order: no kernel of that name was built in this process
    assert (summary["loaded"], summary["compiled"], summary["failed"]) == (2, 0, []), summary
    assert all(row["relative_l2"] < 1e-3 for row in loaded), loaded  # the channel-scaled FP8 bound of the kernels
