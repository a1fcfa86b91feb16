#!/usr/bin/env bash
# One prepared check of the CUDA verification kernel, for a machine with a CUDA GPU, CUDA
# torch, nvcc and ninja (no network needed). Builds the kernel, checks it against the torch
# reference (greedy exact, random identical tokens) and the chi-square on the GPU; with two or
# more GPUs, checks tensor parallelism over NCCL (scripts/gpu_tp_check.py: TP=2, and TP=4 on
# four GPUs, token-identical to TP=1 in fp32); then prints the bandwidth table of
# benchmarks/gpu_verify.py. Takes under 5 minutes (7 with the tensor-parallel check).
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

num_gpus=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$num_gpus" -ge 2 ]; then
  echo "== tensor parallelism over NCCL ($num_gpus GPUs): TP=2 greedy == TP=1"
  timeout 240 python scripts/gpu_tp_check.py
else
  echo "== tensor parallelism: skipped (one GPU visible; it needs two or more)"
fi

echo "== bandwidth (bytes of logits read per second)"
timeout 200 python benchmarks/gpu_verify.py "$@"
