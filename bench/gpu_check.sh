#!/usr/bin/env bash
# The GPU path, on a machine with CUDA (never in CI): codecs on the GPU, the profiler's CUDA
# timings and memory, and the local example's shape trained on CUDA in fp32 and bf16 (NCCL with
# three GPUs, else every agent on one GPU with gloo). Prints one table; exit 0 when all is ok.
#   bash bench/gpu_check.sh         (from the repository root, hetlaunch installed)
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import hetlaunch.runtime.model" 2>/dev/null || pip install --quiet -e .
exec python bench/_gpu_check.py "$@"
