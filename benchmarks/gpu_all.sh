#!/usr/bin/env bash
# The prepared GPU check: build with CUDA, run the GPU tests (CUDA tests also under
# compute-sanitizer memcheck at small shapes), then every GPU benchmark entry. One command,
# budgeted for < 8 minutes on one H200. Results (JSON + logs) go under OUTDIR.
#
#   bash benchmarks/gpu_all.sh OUTDIR
#
# Without a CUDA device it still runs its CPU-side parts (build, import) and says plainly that the
# GPU parts were skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} LOPD_BENCH_RESULTS="$OUT"
PY=${PYTHON:-python3}
log() { echo "== [$(date +%H:%M:%S)] $*"; }
status=0

log "build (LOPD_CUDA_ARCHS=${LOPD_CUDA_ARCHS:-90a})"
export LOPD_CUDA_ARCHS=${LOPD_CUDA_ARCHS:-90a}
if ! $PY -m pip install -q --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"; log "build FAILED"; exit 1
fi
has_cuda=$($PY -c 'import torch; print(int(torch.cuda.is_available()))')
$PY - <<'PYEOF' | tee "$OUT/env.txt"
import torch, lopd_kernels, lopd_kernels._backend as b
print("torch", torch.__version__, "cuda", torch.version.cuda, "device",
      torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
print("extension", b.extension_loaded(), "cuda topk_tail_kl kernel",
      b.has_cuda_kernel("topk_tail_kl_fwd"))
PYEOF
if [ "$has_cuda" != "1" ]; then
  log "no CUDA device: GPU tests and benchmarks skipped (build and import checked)"
  exit 0
fi

log "GPU tests"
# The SIMT-emulated runs of the CUDA kernels (CPU) are covered by CI; here only the real ones.
timeout 180 $PY -m pytest -q -x tests -m "not slow" -k "(cuda or triton or gpu) and not emulated" \
  2>&1 | tee "$OUT/tests.log" | tail -15 || status=1

if command -v compute-sanitizer >/dev/null && ls tests/test_*cuda*.py >/dev/null 2>&1; then
  log "CUDA tests under compute-sanitizer memcheck (small shapes)"
  LOPD_TEST_SMALL=1 timeout 90 compute-sanitizer --tool memcheck --error-exitcode 9 \
    $PY -m pytest -q -x tests/test_*cuda*.py -k "not emulated" 2>&1 | tail -15 | tee "$OUT/memcheck.log" || status=1
fi

log "benchmarks"
for b in benchmarks/gpu_*.py; do
  [ -f "$b" ] || continue
  log "$b"
  timeout 120 $PY "$b" --out "$OUT" 2>&1 | tail -20 | tee -a "$OUT/bench.log" || status=1
done
log "done (status $status); results in $OUT"
exit $status
