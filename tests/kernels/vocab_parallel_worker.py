"""The process side of tests/kernels/test_vocab_parallel.py: every case of
tests/kernels/vocab_parallel_cases.py in one group of ``WORLD`` gloo processes on CPU.

Usage: ``python tests/kernels/vocab_parallel_worker.py WORLD PORT OUT_DIR``. Forks ``WORLD``
processes; each runs every case for its world size in order and writes ``OUT_DIR/rank<r>.json``:
``{case: "ok" | "skip: ..." | "FAIL: <message>"}`` and ``{"seconds": ...}``. A case that fails
on one rank only would desynchronize the group's collectives, so after every case the ranks
exchange their verdicts (one small collective), and the group has a 120 s timeout.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import traceback
from pathlib import Path

# Before anything imports triton: the Triton cases run in its interpreter on CPU tensors.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _run_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from tests.kernels.vocab_parallel_cases import cases_for

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    verdicts: dict[str, str] = {}
    seconds: dict[str, float] = {}
    for name, case in cases_for(world):
        t0 = time.perf_counter()
        try:
            verdict = case(rank, world) or "ok"
        except Exception as err:
            tb = traceback.format_exc(limit=6)
            verdict = f"FAIL: {type(err).__name__}: {err}\n{tb}"
        seconds[name] = time.perf_counter() - t0
        verdicts[name] = verdict
        # A sync point per case: a case that failed on one rank before its collectives must
        # not pair the next case's collectives with this one's.
        dist.barrier()
    Path(out_dir, f"rank{rank}.json").write_text(
        json.dumps({"verdicts": verdicts, "seconds": seconds})
    )
    dist.destroy_process_group()


def main() -> None:
    import contextlib

    import torch.multiprocessing as mp

    # Imported once here and forked into the ranks: on 2 loaded cores, each rank importing
    # torch, the kernels, triton and megatron-core itself took most of a spawn's minute.
    import tests.kernels.vocab_parallel_cases  # noqa: F401

    # Without the Triton launchers (or megatron-core) their cases fail (skip) with the import's
    # message; the others run.
    with contextlib.suppress(ImportError):
        import lopd_kernels.triton.topk_tail_kl  # noqa: F401
    with contextlib.suppress(ImportError):
        import megatron.core.tensor_parallel  # noqa: F401

    world, port, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    mp.start_processes(_run_rank, args=(world, port, out_dir), nprocs=world, start_method="fork")


if __name__ == "__main__":
    main()
