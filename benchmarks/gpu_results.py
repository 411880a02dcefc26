"""The GPU run's records: derived ratios, a compact table, and the merge into benchmarks/results/.

    python benchmarks/gpu_results.py show  OUT/records.jsonl
    python benchmarks/gpu_results.py merge OUT/records.jsonl [--results-dir benchmarks/results]
                                           [--commit SHA]

``records.jsonl`` (one record per line, written by ``benchmarks/gpu_*.py`` as each figure is
measured) holds records in the format of ``benchmarks/results/*.json``. ``merge`` adds the
cross-variant ratios (each variant ran in its own process, so no script knows them) and writes
``benchmarks/results/gpu_<op>.json``, replacing an older record of the same (op, backend,
shapes, device); ``python benchmarks/report.py`` then prints them with the CPU tables. A record
whose commit is "unknown" (a source tree without ``.git``) gets ``--commit`` (default: this
checkout's HEAD).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as gc

ROOT = Path(__file__).resolve().parent.parent

# op -> (baseline backend, ratio field, "speedup" (baseline / row) or "ratio" (row / baseline))
_RATIOS: dict[str, list[tuple[str, str, str]]] = {
    "topk_tail_kl": [("trl_eager", "speedup_vs_trl_eager", "speedup"),
                     ("torch_reference", "speedup", "speedup")],
    "fused_linear_topk_tail_kl": [("materialized", "time_ratio", "ratio")],
    "varlen_cross_attention": [("sdpa_padded", "speedup_vs_padded", "speedup")],
    "qformer": [("module_padded", "speedup_vs_padded", "speedup")],
    "lopd_train_step": [("materialized", "time_ratio", "ratio")],
}  # fmt: skip
# Shape keys that differ between a variant and its baseline without making them incomparable.
_LOOSE_KEYS = {"M"}


def load(path: str | Path) -> list[dict[str, Any]]:
    """Records of a JSON-lines file; a torn last line (a killed writer) is skipped."""
    rows = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def _group_key(rec: dict[str, Any]) -> str:
    shapes = {k: v for k, v in rec["shapes"].items() if k not in _LOOSE_KEYS}
    return json.dumps([rec["op"], rec["device"], shapes], sort_keys=True)


def derive(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of ``records`` with the ratios against each op's baseline(s) at the same shapes;
    ``mem_ratio`` too where both have a peak. Later records of a configuration win."""
    latest: dict[tuple, dict[str, Any]] = {}
    for r in records:
        latest[(r["backend"], _group_key(r))] = r
    out = []
    for r in latest.values():
        r = dict(r)
        for base_name, field, kind in _RATIOS.get(r["op"], []):
            base = latest.get((base_name, _group_key(r)))
            if base is None or base is r or base["median_s"] <= 0 or r["median_s"] <= 0:
                continue
            if kind == "speedup":
                r[field] = base["median_s"] / r["median_s"]
            else:
                r[field] = r["median_s"] / base["median_s"]
                if r.get("peak_mem_bytes") and base.get("peak_mem_bytes"):
                    r["mem_ratio"] = r["peak_mem_bytes"] / base["peak_mem_bytes"]
        out.append(r)
    return out


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return "" if v is None else str(v)


def table(records: list[dict[str, Any]]) -> str:
    """A compact fixed-width table: one line per record, grouped by op."""
    cols = ("backend", "shapes", "ms", "GB/s", "%copy", "peak MiB", "ratio", "check")
    lines = []
    for op in sorted({r["op"] for r in records}):
        rows = [r for r in records if r["op"] == op]
        common = {
            k: v for k, v in rows[0]["shapes"].items() if all(x["shapes"].get(k) == v for x in rows)
        }
        lines.append(f"## {op}  ({', '.join(f'{k}={v}' for k, v in common.items())})")
        cells = []
        for r in rows:
            shape = " ".join(f"{k}={v}" for k, v in r["shapes"].items() if k not in common)
            ratio = next((r[k] for k in ("speedup_vs_trl_eager", "speedup_vs_padded", "time_ratio",
                                          "speedup") if k in r), None)  # fmt: skip
            frac = r.get("fraction_of_copy_bw")
            cells.append([
                r["backend"], shape, f"{r['median_s'] * 1e3:.3f}", _cell(r.get("achieved_gbps")),
                "" if frac is None else f"{100 * frac:.1f}",
                "" if r.get("peak_mem_bytes") is None else f"{r['peak_mem_bytes'] / 2**20:.1f}",
                _cell(ratio), {True: "ok", False: "WRONG"}.get(r.get("check_ok"), ""),
            ])  # fmt: skip
        widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
        lines.append("  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip())
        for row in cells:
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        lines.append("")
    return "\n".join(lines)


def merge(records: list[dict[str, Any]], results_dir: Path, commit: str) -> list[Path]:
    """Writes ``results_dir/gpu_<op>.json`` (JSON lists); returns the files written."""
    results_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for op in sorted({r["op"] for r in records}):
        path = results_dir / f"gpu_{op}.json"
        rows = json.loads(path.read_text()) if path.exists() else []

        new = [dict(r, commit=commit if r.get("commit") in (None, "unknown") else r["commit"])
               for r in records if r["op"] == op]  # fmt: skip
        keys = {gc.record_key(r) for r in new}
        rows = [r for r in rows if gc.record_key(r) not in keys] + new
        gc.atomic_write_text(path, json.dumps(rows, indent=1) + "\n")
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("show", "merge"))
    parser.add_argument("records", help="records.jsonl of a GPU run")
    parser.add_argument("--results-dir", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--commit", default=None, help="for records without one (default HEAD)")
    args = parser.parse_args(argv)
    records = derive(load(args.records))
    if args.action == "show":
        print(table(records))
        return 0
    for path in merge(records, Path(args.results_dir), args.commit or gc.git_commit()):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
