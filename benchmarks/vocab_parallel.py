"""The vocabulary-parallel ops against one process, the obvious all-gather and Megatron-core.

On CPU (the default) every (op, variant) runs in a fresh group of processes (gloo, one thread
each), one group at a time: time of a forward + backward (median over the repetitions after a
warm-up, the slowest rank's; wall and the process's CPU seconds, the steadier figure on a
shared machine), each rank's extra peak memory (its peak RSS during the calls minus
its RSS before them: what the op needs beyond its inputs), and the bytes each rank hands to
collectives per token. Variants: benchmarks/vocab_parallel_ops.py. The records go into
``benchmarks/results/vocab_parallel.json`` (the results format of benchmarks/common.py; one
record per op and variant replaces the older one) and each line printed.

    python benchmarks/vocab_parallel.py                  # N=2048, V=151,936, d=1024, M=20, TP=2
    python benchmarks/vocab_parallel.py --ops fused_linear_logprob --variants vocab_parallel
    python benchmarks/vocab_parallel.py --tokens 64 --vocab 4096 --hidden 64 --results /tmp/r

One rank (what the CPU driver starts, or ``torchrun`` on GPUs, benchmarks/gpu_vocab_parallel.py):

    torchrun --nproc-per-node G benchmarks/vocab_parallel.py --rank-of OPS VARIANTS --device cuda
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402
from benchmarks.vocab_parallel_ops import OPS, VARIANTS, ByteCounter, Shapes, build  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "vocab_parallel.json"


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def run_rank(ops: list[str], variants: list[str], shapes: Shapes, reps: int, device_name: str):
    """This process's measurements of every (op, variant), in order (inside one process group
    when ``WORLD_SIZE`` > 1); yields one result each."""
    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device(device_name)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if world > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=600))
        if "megatron_cross_entropy" in variants:
            # Optional peer of this comparison (megatron-core, the [test] extra).
            from megatron.core import parallel_state

            parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    for op in ops:
        for variant in variants:
            if variant == "megatron_cross_entropy" and op != "fused_linear_logprob":
                continue
            yield _measure(op, variant, shapes, reps, device, world)
    if world > 1:
        dist.destroy_process_group()


def _measure(op: str, variant: str, shapes: Shapes, reps: int, device, world: int) -> dict:
    import torch
    import torch.distributed as dist

    step = build(op, variant, shapes, device)
    value = step()  # warm-up: kernels, allocator, the extension's buffer cache

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if world > 1:
            dist.barrier()

    gc.collect()
    sync()
    if device.type == "cuda":
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        before = _status_kib("VmRSS") * 1024
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    times, cpu = [], []
    with ByteCounter() as counter:
        for _ in range(reps):
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            sync()
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = max(_status_kib("VmHWM") * 1024, before)
    del step
    return {
        "op": op, "variant": variant, "world": world, "rank": int(os.environ.get("RANK", "0")),
        "threads": torch.get_num_threads(), "times_s": times, "cpu_s": cpu,
        "mem_before": before,
        "mem_peak": peak,
        "comm_bytes_per_call": {k: b / reps for k, b in counter.bytes.items()},
        "collectives_per_call": counter.calls / reps, "load_avg_1min": common.load_average(),
        "loss": value,
    }  # fmt: skip


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(op: str, variant: str, world: int, threads: int, args) -> list[dict]:
    """``world`` fresh CPU processes measuring (op, variant); their rank results."""
    port = _free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}  # fmt: skip
        cmd = [sys.executable, __file__, "--rank-of", op, variant, "--tokens", str(args.n),
               "--vocab", str(args.vocab), "--hidden", str(args.hidden),
               "--top-m", str(args.top_m), "--reps", str(args.reps)]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        out, _ = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"{op} / {variant}: a rank exited with {proc.returncode}")
        line = next(ln for ln in out.splitlines() if ln.startswith("LOPD_RANK "))
        results.append(json.loads(line[len("LOPD_RANK ") :]))
    return results


def summarize(ranks: list[dict], shapes: Shapes) -> dict[str, Any]:
    """One record's figures from the ranks of a run."""
    medians = [statistics.median(r["times_s"]) for r in ranks]
    cpu = [statistics.median(r["cpu_s"]) for r in ranks]
    extra = [r["mem_peak"] - r["mem_before"] for r in ranks]
    return {
        "median_s": max(medians),
        "per_rank_median_s": medians,
        # CPU seconds of each rank's process (all its threads): on a shared machine the steadier
        # figure of the work a rank does; the slowest rank's, and the group's total.
        "cpu_s": max(cpu),
        "per_rank_cpu_s": cpu,
        "total_cpu_s": sum(cpu),
        "peak_mem_bytes": max(extra),
        "per_rank_extra_peak_bytes": extra,
        "per_rank_rss_before_bytes": [r["mem_before"] for r in ranks],
        # Per collective kind: the op's all-gathers, and the all-reduce of the hidden states'
        # gradient (the fused ops; Megatron's column-parallel layer does the same one).
        "comm_bytes_per_token_per_rank": {
            kind: max(r["comm_bytes_per_call"].get(kind, 0.0) for r in ranks) / shapes.n
            for kind in sorted({k for r in ranks for k in r["comm_bytes_per_call"]})
        },
        "collectives_per_call": max(r["collectives_per_call"] for r in ranks),
        "world": ranks[0]["world"],
        "threads_per_rank": ranks[0]["threads"],
        "reps": len(ranks[0]["times_s"]),
        "load_avg_1min": max(r["load_avg_1min"] for r in ranks),
    }


def save(records: list[dict], path: Path) -> None:
    rows = json.loads(path.read_text()) if path.exists() else []
    keys = {common.record_key(r) for r in records}
    rows = [r for r in rows if common.record_key(r) not in keys] + records
    path.parent.mkdir(parents=True, exist_ok=True)
    common.atomic_write_text(path, json.dumps(rows, indent=1) + "\n")


def configs(ops: list[str], variants: list[str], tp: int) -> list[tuple[str, str, int, int]]:
    """``(op, variant, world, threads)``: TP ranks of one thread each; the single process with
    one thread (the per-rank work) and with TP threads (the same cores)."""
    out = []
    for op in ops:
        for variant in variants:
            if variant == "megatron_cross_entropy" and op != "fused_linear_logprob":
                continue
            if variant == "single_process":
                out += [(op, variant, 1, 1), (op, variant, 1, tp)]
            else:
                out.append((op, variant, tp, 1))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--tokens", "--n", dest="n", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--top-m", type=int, default=20)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--results", type=Path, default=RESULTS.parent)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--rank-of",
        nargs=2,
        metavar=("OPS", "VARIANTS"),
        help="measure, as one rank (RANK / WORLD_SIZE from the environment), every pair of "
        "these comma-separated ops and variants",
    )
    args = parser.parse_args(argv)
    shapes = Shapes(args.n, args.vocab, args.hidden, args.top_m)
    if args.rank_of:
        ops, variants = (x.split(",") for x in args.rank_of)
        for res in run_rank(ops, variants, shapes, args.reps, args.device):
            print("LOPD_RANK " + json.dumps(res), flush=True)
        return 0
    records = []
    for op, variant, world, threads in configs(args.ops.split(","), args.variants.split(","),
                                               args.tp):  # fmt: skip
        print(f"== {op} / {variant}: {world} process(es) x {threads} thread(s)", flush=True)
        fig = summarize(launch(op, variant, world, threads, args), shapes)
        label = variant if variant != "single_process" else f"single_process_{threads}t"
        rec = common.make_record(
            f"vocab_parallel.{op}", label, shapes._asdict(), fig.pop("median_s"),
            fig.pop("peak_mem_bytes"), common.device_name("cpu"), common.git_commit(), **fig,
        )  # fmt: skip
        records.append(rec)
        save([rec], args.results / RESULTS.name)
        comm = ", ".join(f"{k} {v:.0f}" for k, v in rec["comm_bytes_per_token_per_rank"].items())
        mib = rec["peak_mem_bytes"] / 2**20
        line = f"   {rec['median_s']:.2f} s ({rec['cpu_s']:.2f} CPU s per rank), extra peak "
        print(line + f"{mib:.0f} MiB per rank, bytes per token and rank: {comm or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
