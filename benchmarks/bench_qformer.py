"""CPU benchmark: QFormerCompressor vs the straightforward padded QFormer, fp32 forward + backward.

Workload (issue 4): 12 items with T_j evenly spread over [200, 2000] (13,200 tokens packed, 24,000
padded), d = 1024, 16 heads, K = 32 queries, 8 layers with shared weights. Both sides use the same
module weights; the baseline is :func:`lopd_kernels.qformer.straightforward_qformer` with
``padded=True`` (items padded to T_max with a key-padding mask, LN/K/V of H recomputed in every
layer, SDPA), i.e. what BLIP-2 / open_flamingo / perceiver-pytorch do.

Time: median wall time of full forward + backward passes (parameter and dH gradients), one
torch thread by default (``--threads``): on a shared 2-core box, OpenMP threads that get
descheduled make many small parallel ops spin, which distorts both sides.
Memory: **saved activation bytes**, counted with ``torch.autograd.graph.saved_tensors_hooks``
during the timed passes -- the distinct storages autograd keeps for the backward, parameters
excluded. (Peak RSS via ``benchmarks.common.peak_rss_bytes`` is available with ``--rss``: it
reruns each side in a fresh process, which doubles the runtime.)

    python benchmarks/bench_qformer.py            # prints the table, writes results/qformer.json
    pytest benchmarks/bench_qformer.py            # the same two workloads under pytest-benchmark

Targets: >= 3x faster and <= 1/4 of the baseline's activation memory.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `lopd_kernels` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import peak_rss_bytes, record
from lopd_kernels import QFormerCompressor
from lopd_kernels.qformer import straightforward_qformer

CONFIG = {"hidden_size": 1024, "num_heads": 16, "num_queries": 32, "num_layers": 8}
LENGTHS = torch.linspace(200, 2000, 12).round().int().tolist()
SHAPES = {
    "items": len(LENGTHS),
    "T": "200..2000 (evenly spread)",
    "total_tokens": sum(LENGTHS),
    "d": 1024,
    "heads": 16,
    "K": 32,
    "layers": 8,
    "shared": True,
    "dtype": "fp32",
    "pass": "fwd+bwd",
}


def make_inputs(seed: int = 0):
    """Module (shared layers), packed hidden states ``[13200, 1024]`` and ``cu_seqlens``."""
    torch.manual_seed(seed)
    module = QFormerCompressor(**CONFIG, share_layers=True)
    hidden = torch.randn(sum(LENGTHS), CONFIG["hidden_size"], requires_grad=True)
    cu = torch.zeros(len(LENGTHS) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(LENGTHS).cumsum(0)
    return module, hidden, cu


def step_fused(module, hidden, cu):
    out = module(hidden, cu, max_seqlen=max(LENGTHS))
    out.sum().backward()


def step_straightforward(module, hidden, cu):
    out = straightforward_qformer(module, hidden, cu, padded=True)
    out.sum().backward()


STEPS = {"fused": step_fused, "straightforward_padded": step_straightforward}


def measure(name: str, reps: int, warmup: int) -> tuple[float, int]:
    """Median seconds of ``reps`` fwd+bwd passes and the saved activation bytes of one pass."""
    module, hidden, cu = make_inputs()
    param_ptrs = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_ptrs:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    times = []
    for i in range(warmup + reps):
        module.zero_grad(set_to_none=True)
        hidden.grad = None
        storages.clear()
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            STEPS[name](module, hidden, cu)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times), sum(storages.values())


def measure_rss(name: str, threads: int) -> int:
    """Peak RSS increase of one fwd+bwd pass in a fresh process (bytes)."""
    setup = "from benchmarks.bench_qformer import make_inputs, STEPS\nargs = make_inputs()\n"
    before, peak = peak_rss_bytes(setup, f"STEPS[{name!r}](*args)\n", threads=threads)
    return peak - before


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="timed passes of the fused module")
    parser.add_argument("--baseline-reps", type=int, default=1, help="timed baseline passes")
    parser.add_argument("--rss", action="store_true", help="also measure peak RSS per side")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads for both sides (1: stable timings on a shared machine)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    fused_s, fused_mem = measure("fused", args.reps, warmup=1)
    base_s, base_mem = measure("straightforward_padded", args.baseline_reps, warmup=0)
    speedup, mem_ratio = base_s / fused_s, fused_mem / base_mem
    extra = {"memory_metric": "saved_tensors_hooks activation bytes"}
    if args.rss:
        extra["fused_peak_rss_delta"] = measure_rss("fused", args.threads)
        extra["baseline_peak_rss_delta"] = measure_rss("straightforward_padded", args.threads)
    record("qformer", "fused", SHAPES, fused_s, fused_mem, speedup=speedup, **extra)
    record("qformer", "straightforward_padded", SHAPES, base_s, base_mem, **extra)

    mib = 2**20
    print(f"threads={torch.get_num_threads()}  items={LENGTHS}")
    print(f"{'implementation':<26}{'fwd+bwd s':>12}{'saved act. MiB':>17}")
    print(f"{'QFormerCompressor':<26}{fused_s:>12.2f}{fused_mem / mib:>17.1f}")
    print(f"{'straightforward (padded)':<26}{base_s:>12.2f}{base_mem / mib:>17.1f}")
    print(f"speedup {speedup:.1f}x (target >= 3x); memory ratio {mem_ratio:.3f} (target <= 0.25)")
    for key in ("fused_peak_rss_delta", "baseline_peak_rss_delta"):
        if key in extra:
            print(f"{key}: {extra[key] / mib:.0f} MiB")
    return 0 if speedup >= 3 and mem_ratio <= 0.25 else 1


def test_qformer_fused(benchmark):
    torch.set_num_threads(1)
    module, hidden, cu = make_inputs()
    benchmark.pedantic(step_fused, args=(module, hidden, cu), rounds=3, warmup_rounds=1)
    record("qformer", "fused[pytest-benchmark]", SHAPES, benchmark.stats.stats.median)


def test_qformer_straightforward(benchmark):
    torch.set_num_threads(1)
    module, hidden, cu = make_inputs()
    benchmark.pedantic(step_straightforward, args=(module, hidden, cu), rounds=2)
    record(
        "qformer",
        "straightforward_padded[pytest-benchmark]",
        SHAPES,
        benchmark.stats.stats.median,
    )


if __name__ == "__main__":
    sys.exit(main())
