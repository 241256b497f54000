#!/usr/bin/env bash
# On a machine with an NVIDIA GPU, from the repository root: environment, every kernel test compiled for the GPU,
# the copy and matmul ceilings, GEMV per weight format, paged attention at 4K/32K/128K, and decode (CUDA graphs on and
# off) and prefill (low-bit kernels and --prefill-cublas) of a
# synthetic 27B-shaped model under a 12 GiB cap. A short table is printed last; details go to $OUT (default ./gpu-check).
# Expect 3-5 minutes. Usage: scripts/gpu_check.sh [--memory-cap-gib 12] [--skip-tests]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-./gpu-check}"
mkdir -p "$OUT"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || echo "nvidia-smi did not run (see $OUT/nvidia-smi.txt)"
exec python -m engine.tools.gpu_check --out "$OUT" --device cuda "$@"
