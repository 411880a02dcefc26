#!/usr/bin/env bash
# The prepared GPU check, one command on one H200, inside a time budget (LOPD_GPU_BUDGET_S,
# default 450 s, so that a 600 s device call has room to spare):
#   1. build the extension with CUDA (sm_90a) against the machine's own torch;
#   2. the kernel tests on the GPU: the real CUDA kernels and the Triton kernels (the kernel test
#      files only: the trainer's tests need packages a bare GPU image lacks);
#   3. every benchmarks/gpu_*.py (JSON results in OUTDIR);
#   4. the CUDA tests under compute-sanitizer memcheck at small shapes, with the time left.
# Each phase gets a share of what is left, so a slow phase cannot starve the ones after it.
# Results (JSON + logs) go under OUTDIR; the exit status is 0 only if every phase passed.
#
#   bash benchmarks/gpu_all.sh OUTDIR
#
# Without a CUDA device it still builds and imports, and says plainly that the GPU parts were
# skipped. tests/test_gpu_scripts.py runs each gpu_*.py on the CPU so that they do not rot.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} LOPD_BENCH_RESULTS="$OUT"
PY=${PYTHON:-python3}
BUDGET=${LOPD_GPU_BUDGET_S:-450}
T0=$(date +%s)
log() { echo "== [$(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*"; }
# Seconds for a phase: `share` of the time left (percent), at least 20.
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
slice() { local s=$(( $(left) * $1 / 100 )); [ "$s" -lt 20 ] && s=20; echo "$s"; }
status=0
KERNEL_TESTS="tests/test_topk_tail_kl.py tests/test_topk_tail_kl_triton.py tests/test_topk_tail_kl_cuda.py
  tests/test_fused_linear_topk_tail_kl.py tests/test_varlen_cross_attention.py tests/test_qformer.py"
[ -f tests/test_varlen_cross_attention_cuda.py ] && KERNEL_TESTS="$KERNEL_TESTS tests/test_varlen_cross_attention_cuda.py"

log "build (LOPD_CUDA_ARCHS=${LOPD_CUDA_ARCHS:-90a})"
export LOPD_CUDA_ARCHS=${LOPD_CUDA_ARCHS:-90a}
if ! timeout "$(slice 60)" $PY -m pip install -q --no-build-isolation --no-deps -e . \
    >"$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"; log "build FAILED"; exit 1
fi
has_cuda=$($PY -c 'import torch; print(int(torch.cuda.is_available()))')
$PY - <<'PYEOF' | tee "$OUT/env.txt"
import torch, triton, lopd_kernels, lopd_kernels._backend as b
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__,
      "device", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
print("extension", b.extension_loaded(), "cuda kernels:",
      {op: b.has_cuda_kernel(op) for op in ("topk_tail_kl_fwd", "varlen_cross_attention_cuda_fwd")})
PYEOF
if [ "$has_cuda" != "1" ]; then
  log "no CUDA device: GPU tests and benchmarks skipped (build and import checked)"
  exit 0
fi
# A build without the CUDA kernels would make every CUDA test skip and look green.
if ! $PY -c 'import lopd_kernels._backend as b, sys; sys.exit(not (
    b.has_cuda_kernel("topk_tail_kl_fwd") and b.has_cuda_kernel("varlen_cross_attention_cuda_fwd")))'
then
  grep -iE "cuda|nvcc" "$OUT/build.log" | tail -20
  log "the extension was built WITHOUT the CUDA kernels (see $OUT/build.log); Triton parts only"
  status=1
fi

log "GPU tests (real CUDA and Triton kernels; the SIMT-emulated runs are CI's)"
# shellcheck disable=SC2086
timeout "$(slice 45)" $PY -m pytest -q --maxfail=10 -p no:cacheprovider $KERNEL_TESTS \
  -k "(cuda or triton or gpu) and not emulated" 2>&1 | tee "$OUT/tests.log" | tail -25 || status=1

log "benchmarks"
benches=(benchmarks/gpu_*.py)
for i in "${!benches[@]}"; do
  b=${benches[$i]}
  n_left=$(( ${#benches[@]} - i ))
  log "$b"
  timeout "$(slice $(( 75 / n_left )))" $PY "$b" --out "$OUT" 2>&1 | tail -20 | tee -a "$OUT/bench.log" \
    || status=1
done

if command -v compute-sanitizer >/dev/null; then
  log "CUDA tests under compute-sanitizer memcheck (small shapes), $(left) s left"
  LOPD_TEST_SMALL=1 timeout "$(slice 90)" compute-sanitizer --tool memcheck --error-exitcode 9 \
    $PY -m pytest -q -x -p no:cacheprovider tests/test_*_cuda.py -k "not emulated" \
    >"$OUT/memcheck.log" 2>&1
  rc=$?
  tail -15 "$OUT/memcheck.log"
  if grep -q "Device not supported" "$OUT/memcheck.log"; then
    log "compute-sanitizer does not support this device here (gVisor): memcheck NOT run"
  elif [ "$rc" -ne 0 ]; then
    status=1
  fi
else
  log "compute-sanitizer not found: memcheck NOT run"
fi
log "done (status $status); results in $OUT"
exit $status
