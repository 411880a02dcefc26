#!/usr/bin/env bash
# The GPU check: build, test and benchmark everything GPU-side on one CUDA machine, each step a
# process of its own with a time cap, the whole run bounded by LOPD_GPU_BUDGET_S (default 1800 s).
#
#   bash benchmarks/gpu_all.sh OUT                 # a CUDA machine with torch, triton, nvcc
#   bash benchmarks/gpu_all.sh OUT --dry-run-cpu   # every step on the CPU at tiny shapes (CI)
#   bash benchmarks/gpu_all.sh OUT --only probe,tests_cuda   # a rerun of some steps
#   bash benchmarks/gpu_all.sh OUT --list          # the steps, in run order
#
# OUT receives summary.md (steps and figures), summary.json, records.jsonl, env.json, gpu_all.log
# and logs/; `python benchmarks/gpu_results.py merge OUT/records.jsonl` adds the figures to
# benchmarks/results/. The steps and their caps are described in benchmarks/gpu_run.py; PYTHON
# picks the interpreter (default python3). Exit status 0 only if every step that ran passed.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ]; then
  echo "usage: bash benchmarks/gpu_all.sh OUT [--dry-run-cpu] [--only STEP,...] [--list]" >&2
  exit 2
fi
PYTHONUNBUFFERED=1 exec "${PYTHON:-python3}" benchmarks/gpu_run.py "$@"
