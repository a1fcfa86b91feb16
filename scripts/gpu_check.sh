#!/usr/bin/env bash
# One prepared check of the CUDA verification kernel, for a machine with a CUDA GPU, CUDA
# torch, nvcc and ninja (no network needed). Builds the kernel, checks it against the torch
# reference (greedy exact, random identical tokens) and the chi-square on the GPU, then prints
# the bandwidth table of benchmarks/gpu_verify.py. Takes under 5 minutes.
#
#   bash scripts/gpu_check.sh            # full table (27 shapes)
#   bash scripts/gpu_check.sh --quick    # one shape
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

python - <<'PY'
import shutil, torch
assert torch.cuda.is_available(), "no CUDA device visible to torch"
assert shutil.which("nvcc"), "nvcc not on PATH"
print("device:", torch.cuda.get_device_name(), "| torch", torch.__version__, "| CUDA", torch.version.cuda)
PY

echo "== build (cached in \${BATCHSPEC_CACHE:-~/.cache/batchspec}/kernels)"
start=$SECONDS
timeout 240 python -m batchspec.spec._build --cuda
echo "built in $((SECONDS - start)) s"

echo "== CUDA kernel vs torch reference, chi-square on the GPU"
timeout 180 python -m pytest -q -p no:cacheprovider tests/test_kernel.py -k cuda

echo "== bandwidth (bytes of logits read per second)"
timeout 200 python benchmarks/gpu_verify.py "$@"
