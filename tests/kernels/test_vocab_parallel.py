"""The vocabulary-parallel ops (``lopd_kernels.vocab_parallel``) in gloo groups of 2, 3 and 4
CPU processes: outputs and every gradient against the single-process ops and the float64
references, each argument varied alone (tests/kernels/vocab_parallel_cases.py), and bad input
raising one clear error on every rank. Each group size is one spawn of
tests/kernels/vocab_parallel_worker.py running every case; each case is one test here."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.kernels.vocab_parallel_cases import case_names

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "kernels" / "vocab_parallel_worker.py"
WORLDS = (2, 3, 4)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_RESULTS: dict[int, tuple[list[dict], float] | str] = {}


def group_results(world: int, tmp: str) -> tuple[list[dict], float]:
    """Every rank's ``{"verdicts": ..., "seconds": ...}`` from one spawn (once per group size,
    a failed spawn too: its message is repeated, not the spawn), and its wall time."""
    if world not in _RESULTS:
        try:
            _RESULTS[world] = _spawn(world, tmp)
        except AssertionError as err:
            _RESULTS[world] = str(err)
    got = _RESULTS[world]
    if isinstance(got, str):
        raise AssertionError(got)
    return got


def _spawn(world: int, tmp: str) -> tuple[list[dict], float]:
    out = Path(tmp) / f"world{world}"
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, str(WORKER), str(world), str(_free_port()), str(out)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, env=env, cwd=REPO, start_new_session=True, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        log, _ = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the worker's spawned ranks too
        log, _ = proc.communicate()
        raise AssertionError(f"the {world}-process group timed out:\n{log[-4000:]}") from None
    seconds = time.perf_counter() - t0
    files = [out / f"rank{r}.json" for r in range(world)]
    assert proc.returncode == 0 and all(f.exists() for f in files), log[-6000:]
    return [json.loads(f.read_text()) for f in files], seconds


@pytest.fixture(scope="session")
def results_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("vocab_parallel"))


@pytest.mark.parametrize(
    ("world", "case"), [(w, c) for w in WORLDS for c in case_names(w)], ids=lambda x: str(x)
)
def test_vocab_parallel_case(world, case, results_dir):
    ranks, _ = group_results(world, results_dir)
    verdicts = [res["verdicts"][case] for res in ranks]
    for rank, verdict in enumerate(verdicts):
        assert not verdict.startswith("FAIL"), f"rank {rank} of {world}: {verdict}"
    if all(v.startswith("skip:") for v in verdicts):
        pytest.skip(verdicts[0][len("skip:") :].strip())
