#!/usr/bin/env bash
# The first run on an AMD Instinct GPU (MI300X, MI355X) with ROCm 7, in one command: jax's ROCm plugin installed,
# the kernels' AMD builds, the GPU tier (`pytest -m gpu`; the Mosaic and cuDNN tests skip themselves) and the step
# benchmarks with the Triton kernels, every output under one folder to send back. Each part runs even if one before
# it failed. Not yet run on an AMD GPU.
#
#     bash scripts/amd_gpu_check.sh [FOLDER]      (default: amd-gpu-check-DATE)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-amd-gpu-check-$(date +%Y%m%d-%H%M)}
mkdir -p "$out"
bash scripts/setup.sh && .venv/bin/pip install -q -e '.[rocm,amd]' || { echo "amd_gpu_check: install failed" >&2; exit 1; }
py=.venv/bin/python
{ command -v rocm-smi >/dev/null && rocm-smi --showproductname --showpower --showmaxpower; \
  $py -c "import jax; d = jax.devices()[0]; print(jax.__version__, d.platform, d.device_kind, d.compute_capability)"; \
} > "$out/device.txt" 2>&1
cat "$out/device.txt"
run() {  # run NAME COMMAND...: its output to FOLDER/NAME.log, its exit status noted
    local name=$1; shift
    echo "== $name: $*"
    "$@" > "$out/$name.log" 2>&1
    echo "$name: exit $?" | tee -a "$out/status.txt"
}
run amd_builds $py scripts/amd_builds.py --json "$out/amd_builds.json"
run gpu_tier $py -m pytest -m gpu -q -rs --junitxml="$out/gpu_tier.xml"
run krea2_step $py scripts/benchmark.py krea2-step --precisions bf16 fp8 mxfp6 mxfp4 int8 --stacked yes \
    --jax-attention xla int8 int8_fp8 --text-len 128 --fused-text --modes "one jitted loop" --json "$out/krea2_step.json"
run flux_step $py scripts/benchmark.py flux-step --precisions bf16 fp8 --stacked yes --jax-attention xla int8_fp8 \
    --json "$out/flux_step.json"
run krea2_pipeline $py scripts/benchmark.py krea2-pipeline-jax --precisions fp8 --jax-attention int8_fp8 --repeats 2 \
    --json "$out/krea2_pipeline.json"
echo "results in $out"
