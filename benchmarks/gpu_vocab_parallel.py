"""The GPU check's multi-GPU step: the vocabulary-parallel ops over every visible GPU (NCCL, one
process per GPU under ``torchrun``), against the all-gather of the logits: one ``torchrun`` of
benchmarks/vocab_parallel.py measuring every (op, variant) in turn. With fewer than 2 GPUs it
says so and exits 0 (``benchmarks/gpu_steps.py`` marks the step skipped before it would run).
With ``--device cpu`` (the CPU dry run) 2 gloo processes forked from this one, at tiny shapes.

    python benchmarks/gpu_vocab_parallel.py [--device cuda] [--size full|tiny] [--reps R]

Each rank-0 figure is one record (op ``vocab_parallel.<op>``, backend the variant, world size,
per-rank time and memory, bytes per token) appended to ``$LOPD_RECORDS`` (benchmarks/common.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402
from benchmarks.vocab_parallel import run_rank, summarize  # noqa: E402
from benchmarks.vocab_parallel_ops import OPS, Shapes  # noqa: E402

SIZES = {"full": Shapes(2048, 151_936, 4096, 20), "tiny": Shapes(64, 4096, 64, 20)}
GPU_VARIANTS = ("vocab_parallel", "allgather")


def gpu_count() -> int:
    """Visible CUDA devices (0 without torch's CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _by_pair(results) -> dict[tuple, list[dict]]:
    found: dict[tuple, list[dict]] = {}
    for res in results:
        found.setdefault((res["op"], res["variant"]), []).append(res)
    return {k: sorted(v, key=lambda r: r["rank"]) for k, v in found.items()}


def torchrun(world: int, shapes: Shapes, device: str, reps: int) -> dict[tuple, list[dict]]:
    """One ``torchrun`` of ``world`` ranks measuring every (op, variant) in turn; their results
    by (op, variant)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={world}", str(ROOT / "benchmarks" / "vocab_parallel.py"),
           "--rank-of", ",".join(OPS), ",".join(GPU_VARIANTS), "--device", device,
           "--tokens", str(shapes.n), "--vocab", str(shapes.vocab), "--hidden", str(shapes.hidden),
           "--top-m", str(shapes.top_m), "--reps", str(reps)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"torchrun exited {out.returncode}\n{out.stderr[-3000:]}")
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("LOPD_RANK ")]
    return _by_pair(json.loads(ln[len("LOPD_RANK ") :]) for ln in lines)


def _forked_rank(rank: int, world: int, port: int, shapes: Shapes, reps: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    with open(Path(out) / f"rank{rank}.jsonl", "w") as f:
        for res in run_rank(list(OPS), list(GPU_VARIANTS), shapes, reps, "cpu"):
            f.write(json.dumps(res) + "\n")


def forked(world: int, shapes: Shapes, reps: int) -> dict[tuple, list[dict]]:
    """The CPU dry run: ``world`` gloo ranks forked from this process (torch and the kernels
    already imported: a fresh ``torchrun`` spends most of a tiny run importing them)."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_forked_rank, args=(world, port, shapes, reps, out), nprocs=world,
                           start_method="fork")  # fmt: skip
        lines = [ln for r in range(world) for ln in (Path(out) / f"rank{r}.jsonl").open()]
    return _by_pair(json.loads(ln) for ln in lines)


def check(op: str, ours: list[dict], gathered: list[dict]) -> dict:
    """The loss of the vocabulary-parallel op against the all-gather's on the same inputs (every
    rank's): equal to float32 rounding where both read the same bf16 logits; the fused ops'
    all-gather rounds its float32 logits to bf16, hence a looser bound there."""
    tol = 2e-2 if op.startswith("fused_linear") else 1e-3
    err = max(abs(a["loss"] - b["loss"]) / max(abs(b["loss"]), 1.0) for a, b in zip(ours, gathered))
    return {"check_ok": err <= tol, "check_rel_err": err, "check_tol": tol}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--size", default="full", choices=tuple(SIZES))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--records", default=os.environ.get(common.RECORDS_ENV, ""))
    args = parser.parse_args(argv)
    if args.device == "cuda":
        world = gpu_count()
        if world < 2:
            print(f"vocab_parallel: needs 2 or more GPUs for tensor parallelism, found {world}: "
                  "skipped")  # fmt: skip
            return 0
    else:
        world = 2
    shapes = SIZES[args.size]
    import torch

    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    recorder = common.Recorder(args.records, device) if args.records else None
    if args.device == "cuda":
        found = torchrun(world, shapes, args.device, args.reps)
    else:
        found = forked(world, shapes, args.reps)
    for (op, variant), ranks in found.items():
        fig = summarize(ranks, shapes)
        median_s, peak = fig.pop("median_s"), fig.pop("peak_mem_bytes")
        if variant == "vocab_parallel" and (op, "allgather") in found:
            fig.update(check(op, ranks, found[(op, "allgather")]))
        print(f"{op} / {variant} x{world}: {median_s * 1e3:.2f} ms, extra peak "
              f"{peak / 2**20:.0f} MiB per rank", flush=True)  # fmt: skip
        if recorder is not None:
            recorder.add(f"vocab_parallel.{op}", variant, shapes._asdict(), median_s, peak, **fig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
