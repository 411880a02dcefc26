"""Prints the README's benchmark tables from ``benchmarks/results/*.json``.

    python benchmarks/report.py [RESULTS_DIR]

One markdown table per results file: backend, shapes, median time, peak memory and the extra
figures each benchmark recorded (speed-ups, bandwidth fractions), with the device and commit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# Extra fields worth a column when present, in this order.
_EXTRA = (
    "threads",
    "load_avg_1min",
    "speedup_vs_trl_eager",
    "speedup_vs_padded",
    "cpu_time_speedup_vs_padded",
    "speedup",
    "time_ratio",
    "time_vs_materialized",
    "memory_vs_materialized",
    "fused_speedup",
    "fused_top20_speedup",
    "kl_mean",
    "mem_ratio",
    "peak_rss_delta_bytes",
    "achieved_gbps",
    "copy_gbps",
    "fraction_of_copy_bw",
    "first_call_s",
    "first_call_vs_warm",
    "tokens_per_s",
    "records_per_s",
    "queries_per_s",
    "vectors_per_s",
)


def _fmt(v: object) -> str:
    if isinstance(v, float):
        if v == 0 or 1e-3 <= abs(v) < 1e5:
            return f"{v:.4g}"
        return f"{v:.3e}"
    return str(v)


def _mib(b: object) -> str:
    return "" if b in (None, "") else f"{int(b) / 2**20:.1f}"


def table(rows: list[dict]) -> str:
    extras = [k for k in _EXTRA if any(k in r for r in rows)]
    head = ["backend", "shapes", "median s", "peak MiB", *extras]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        shapes = ", ".join(f"{k}={v}" for k, v in r["shapes"].items())
        cells = [r["backend"], shapes, _fmt(r["median_s"]), _mib(r.get("peak_mem_bytes"))]
        for k in extras:
            v = r.get(k, "")
            cells.append(_mib(v) if k.endswith("_bytes") else _fmt(v))
        lines.append("| " + " | ".join(cells) + " |")
    devices = sorted({f"{r['device']} @ {r['commit']}" for r in rows})
    lines.append("")
    lines.append("Measured on: " + "; ".join(devices))
    return "\n".join(lines)


def main() -> None:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "results"
    for path in sorted(root.glob("*.json")):
        rows = json.loads(path.read_text())
        if not rows:
            continue
        print(f"#### {path.stem}\n")
        print(table(rows))
        print()


if __name__ == "__main__":
    main()
