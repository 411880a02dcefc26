#!/usr/bin/env bash
# The prepared GPU check: build, test and benchmark everything GPU-side in one call on one H200,
# inside a global time budget (LOPD_GPU_BUDGET_S, default 540 s of a 600 s device call).
#
#   bash benchmarks/gpu_all.sh OUT                 # on the GPU machine ($OUT there)
#   bash benchmarks/gpu_all.sh OUT --dry-run-cpu   # every step on the CPU at tiny shapes (CI)
#   bash benchmarks/gpu_all.sh OUT --only probe,tests_cuda   # a rerun of some steps
#   bash benchmarks/gpu_all.sh OUT --list          # the steps, in run order
#
# The steps, their time caps and what comes back (<= 8 files in OUT) are described in
# benchmarks/gpu_run.py; PYTHON picks the interpreter (default python3, the one with torch on
# the GPU machine). Exit status 0 only if every step that ran passed.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ]; then
  echo "usage: bash benchmarks/gpu_all.sh OUT [--dry-run-cpu] [--only STEP,...] [--list]" >&2
  exit 2
fi
PYTHONUNBUFFERED=1 exec "${PYTHON:-python3}" benchmarks/gpu_run.py "$@"
