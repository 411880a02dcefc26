#!/usr/bin/env bash
# Downloads the peers the GPU benchmarks compare against, as wheels for the GPU machine's
# python 3.12, into .whl/ (git-ignored), to be carried with the device call (carry [".whl"]);
# benchmarks/gpu_run.py installs them there with --no-deps into a scratch folder.
#
#   bash benchmarks/gpu_wheels.sh        # run here, before the device call (~3 MB, PyPI only)
#
# TRL (its Triton chunked_divergence kernel and the eager top-k loss) needs datasets, which needs
# dill and multiprocess: the GPU image has none of the four. Liger's wheel needs only torch and
# triton. flash-attn cannot be carried: flash-attn 2 is source-only on PyPI (a build of hours),
# and flash-attn 4's CuTe DSL runtime (nvidia-cutlass-dsl-libs-cu13) is a 92 MB wheel, over the
# 64 MiB a call may carry.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 liger-kernel==0.8.5)
mkdir -p .whl
grep -qx '/.whl/' .gitignore 2>/dev/null || echo '/.whl/' >>"$(git rev-parse --git-dir)/info/exclude"
"${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
ls -la .whl
du -sh .whl
