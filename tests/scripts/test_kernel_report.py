"""tools/kernel_report.py and tools/sass_stats.py: the static kernel report (no GPU needed).

The SASS analysis is checked on a hand-written listing (exact counts); the report itself on one
real Triton kernel compiled for sm_90 (Triton's bundled ptxas and cuobjdump), in a subprocess
without ``TRITON_INTERPRET`` (which conftest.py sets, and which cannot compile).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import sass_stats  # noqa: E402

# A streaming loop at 0x20..0x90 with a rare path (0x40..0x60) behind a branch, a barrier on
# the common path and one on the rare path, a nested loop inside the rare path, and an
# out-of-line BRA.DIV stub after EXIT that jumps back, and the end-of-code trap (not loops).
_SASS = """
        Function : k
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   NOP ;
        /*0020*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0030*/              @!P0 BRA 0x70 ;
        /*0040*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0050*/                   LDG.E.U16 R8, desc[UR4][R2.64] ;
        /*0060*/               @P1 BRA 0x50 ;
        /*0070*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0080*/                   BRA.DIV UR4, 0xc0 ;
        /*0090*/               @P2 BRA 0x20 ;
        /*00a0*/                   EXIT ;
        /*00b0*/                   NOP ;
        /*00c0*/                   WARPSYNC.ALL ;
        /*00d0*/                   BRA 0x90 ;
        /*00e0*/                   BRA 0xe0 ;
"""


def test_sass_loops_paths_and_barriers():
    code = sass_stats.split_functions(_SASS)["k"]
    stats = sass_stats.function_stats(code)
    assert stats["instrs"] == 13 and stats["barriers"] == 2
    outer, inner = stats["loops"]
    assert (outer.head, outer.back_branch, outer.depth) == (0x20, 0x90, 0)
    assert (inner.head, inner.back_branch, inner.depth) == (0x50, 0x60, 1)
    # Common path 0x20, 0x30, 0x70, 0x80, 0x90; the rare one adds 0x40..0x60.
    assert (outer.static_instrs, outer.min_path, outer.max_path) == (8, 5, 8)
    assert (outer.barriers_min_path, outer.barriers_in_range) == (1, 2)
    assert outer.ldg_bytes_min_path == 16


def _report(tmp_path: Path, only: str) -> dict:
    pytest.importorskip("triton.backends.nvidia", reason="needs Triton's NVIDIA backend")
    import kernel_report

    why = kernel_report.available()
    if why:
        pytest.skip(why)
    out = tmp_path / "r.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "tools/kernel_report.py", "--no-cuda", "--only", only, "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert only in proc.stdout  # the Markdown table
    return json.loads(out.read_text())


def test_report_of_one_triton_kernel_is_sane(tmp_path):
    report = _report(tmp_path, "topk_tail_kl bwd full")
    assert report["meta"]["arch"] == "sm_90" and report["meta"]["commit"]
    (row,) = report["rows"]
    assert 16 <= row["registers"] <= 255 and row["spill_bytes"] == 0
    assert row["barriers"] >= 0 and row["sass_instrs"] > 100
    loop = row["main_loop"]
    assert 0 < loop["min_path"] <= loop["max_path"] <= loop["static_instrs"]
    # The loop reads both bf16 rows of BLOCK_V entries per iteration: the loads confirm it.
    assert row["entries_from_loads"] == row["entries_per_iter"] == 2048
    assert 0.05 < row["instrs_per_entry"] < 5
    assert row["instrs_per_entry"] == pytest.approx(loop["min_path"] * row["warps"] / 2048, 1e-3)
