#!/usr/bin/env bash
# Compile every csrc/cuda/*.cu for sm_80 and sm_90a without linking, warnings as errors.
# Runs under a CPU-only torch: the wheel ships the ATen/c10 CUDA headers.
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
if [ ! -x "$NVCC" ]; then
  echo "cuda_compile_check: no nvcc found; skipping (set NVCC=...)" >&2
  exit 0
fi
prefix=$(python -c 'import torch; print(torch.utils.cmake_prefix_path)')
build=build/cuda-check
cmake -S . -B "$build" -GNinja -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_CUDA_COMPILER="$NVCC" \
  -DPython3_EXECUTABLE="$(command -v python)" -DLOPD_CUDA_COMPILE_CHECK=ON >/dev/null
cmake --build "$build" --target cuda_compile_check -j "${MAX_JOBS:-2}"
echo "cuda_compile_check: all csrc/cuda/*.cu compiled for sm_80 and sm_90a"
