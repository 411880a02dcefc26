"""CPU benchmark: QFormerCompressor vs a plain padded SDPA QFormer, fp32 forward + backward.

Workload (issue 20, what a user would try): 12 items with T_j evenly spread over [100, 1000]
(6,600 tokens packed, 12,000 padded), d = 512, 8 heads, K = 32 queries, 8 layers with shared
weights, 2 threads. Both sides use the same module weights. The baseline is what a user would
write: :func:`lopd_kernels.qformer.straightforward_qformer` with ``padded=True`` -- items padded
to T_max with a key-padding mask, LN / K / V of H re-projected in every layer,
``F.scaled_dot_product_attention`` (BLIP-2 / open_flamingo / perceiver-pytorch do the same).

Time: median wall time of full forward + backward passes (parameter and dH gradients); the two
sides alternate pass by pass, so load drift on a shared machine hits both alike (the 1-minute
load average is recorded next to every figure). Memory: **saved activation bytes**, counted with
``torch.autograd.graph.saved_tensors_hooks`` -- the distinct storages autograd keeps for the
backward, parameters excluded. (``--rss`` also measures the peak RSS of each side in a fresh
process.)

    python benchmarks/bench_qformer.py            # prints the table, writes results/qformer.json
    pytest benchmarks/bench_qformer.py --benchmark-only   # the same workloads, same threads

Targets: >= 3x faster and <= 1/4 of the baseline's saved activations. ``--threads`` (or
``LOPD_BENCH_THREADS`` under pytest) sets the thread count, restored afterwards.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import pytest
import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `lopd_kernels` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import load_average, peak_rss_bytes, record, torch_threads
from lopd_kernels import QFormerCompressor
from lopd_kernels.qformer import straightforward_qformer

CONFIG = {"hidden_size": 512, "num_heads": 8, "num_queries": 32, "num_layers": 8}
LENGTHS = torch.linspace(100, 1000, 12).round().int().tolist()
THREADS = int(os.environ.get("LOPD_BENCH_THREADS", "2"))
SHAPES = {
    "items": len(LENGTHS),
    "T": "100..1000 (evenly spread)",
    "total_tokens": sum(LENGTHS),
    "d": CONFIG["hidden_size"],
    "heads": CONFIG["num_heads"],
    "K": CONFIG["num_queries"],
    "layers": CONFIG["num_layers"],
    "shared": True,
    "dtype": "fp32",
    "pass": "fwd+bwd",
}


def make_inputs(seed: int = 0):
    """Module (shared layers), packed hidden states ``[6600, 512]`` and ``cu_seqlens``."""
    with torch.random.fork_rng():  # seeded without touching the caller's global RNG
        torch.manual_seed(seed)
        module = QFormerCompressor(**CONFIG, share_layers=True)
        hidden = torch.randn(sum(LENGTHS), CONFIG["hidden_size"], requires_grad=True)
    cu = torch.zeros(len(LENGTHS) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(LENGTHS).cumsum(0)
    return module, hidden, cu


def step_fused(module, hidden, cu):
    out = module(hidden, cu, max_seqlen=max(LENGTHS))
    out.sum().backward()


def step_padded_sdpa(module, hidden, cu):
    out = straightforward_qformer(module, hidden, cu, padded=True)
    out.sum().backward()


STEPS = {"fused": step_fused, "padded_sdpa": step_padded_sdpa}


def saved_activation_bytes(name: str, module, hidden, cu) -> int:
    """Distinct storages autograd saves during one pass of ``name``, parameters excluded."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_ptrs:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    module.zero_grad(set_to_none=True)
    hidden.grad = None
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        STEPS[name](module, hidden, cu)
    return sum(storages.values())


def measure(reps: int) -> dict[str, dict[str, float]]:
    """Median wall and CPU seconds per pass of each side (alternating), and saved activations."""
    module, hidden, cu = make_inputs()
    out: dict[str, dict[str, float]] = {}
    for name in STEPS:  # warm-up (lazy init, allocator) and the memory count
        out[name] = {"saved_bytes": saved_activation_bytes(name, module, hidden, cu)}
    walls: dict[str, list[float]] = {name: [] for name in STEPS}
    cpus: dict[str, list[float]] = {name: [] for name in STEPS}
    loads = []
    for _ in range(reps):
        for name, step in STEPS.items():
            module.zero_grad(set_to_none=True)
            hidden.grad = None
            c0, t0 = time.process_time(), time.perf_counter()
            step(module, hidden, cu)
            walls[name].append(time.perf_counter() - t0)
            cpus[name].append(time.process_time() - c0)
        loads.append(load_average())
    for name in STEPS:
        out[name]["median_s"] = statistics.median(walls[name])
        out[name]["median_cpu_s"] = statistics.median(cpus[name])
    out["load_avg_1min"] = {"during": statistics.median(loads)}
    return out


def measure_rss(name: str, threads: int) -> int:
    """Peak RSS increase of one fwd+bwd pass in a fresh process (bytes)."""
    setup = "from benchmarks.bench_qformer import make_inputs, STEPS\nargs = make_inputs()\n"
    before, peak = peak_rss_bytes(setup, f"STEPS[{name!r}](*args)\n", threads=threads)
    return peak - before


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="timed passes of each side")
    parser.add_argument("--rss", action="store_true", help="also measure peak RSS per side")
    parser.add_argument("--threads", type=int, default=THREADS, help="torch intra-op threads")
    args = parser.parse_args(argv)
    with torch_threads(args.threads) as threads:
        res = measure(args.reps)
    fused, base = res["fused"], res["padded_sdpa"]
    speedup = base["median_s"] / fused["median_s"]
    cpu_speedup = base["median_cpu_s"] / fused["median_cpu_s"]
    mem_ratio = fused["saved_bytes"] / base["saved_bytes"]
    extra = {
        "memory_metric": "saved_tensors_hooks activation bytes",
        "threads": threads,
        "load_avg_during": res["load_avg_1min"]["during"],
    }
    if args.rss:
        extra["fused_peak_rss_delta"] = measure_rss("fused", threads)
        extra["baseline_peak_rss_delta"] = measure_rss("padded_sdpa", threads)
    record(
        "qformer", "fused", SHAPES, fused["median_s"], int(fused["saved_bytes"]),
        speedup_vs_padded=speedup, cpu_time_speedup_vs_padded=cpu_speedup,
        mem_ratio=mem_ratio, median_cpu_s=fused["median_cpu_s"], **extra,
    )  # fmt: skip
    record(
        "qformer", "padded_sdpa", SHAPES, base["median_s"], int(base["saved_bytes"]),
        median_cpu_s=base["median_cpu_s"], **extra,
    )  # fmt: skip

    mib = 2**20
    print(f"threads={threads}  items={LENGTHS}  load (1 min) {extra['load_avg_during']:.1f}")
    print(f"{'implementation':<28}{'fwd+bwd s':>11}{'CPU s':>9}{'saved act. MiB':>17}")
    for label, r in (("QFormerCompressor", fused), ("padded SDPA QFormer", base)):
        print(
            f"{label:<28}{r['median_s']:>11.3f}{r['median_cpu_s']:>9.3f}"
            f"{r['saved_bytes'] / mib:>17.1f}"
        )
    print(
        f"speedup {speedup:.2f}x (CPU time {cpu_speedup:.2f}x; target >= 3x); "
        f"memory ratio {mem_ratio:.3f} (target <= 0.25)"
    )
    for key in ("fused_peak_rss_delta", "baseline_peak_rss_delta"):
        if key in extra:
            print(f"{key}: {extra[key] / mib:.0f} MiB")
    return 0 if speedup >= 3 and mem_ratio <= 0.25 else 1


@pytest.fixture
def threads():
    with torch_threads(THREADS) as n:
        yield n


@pytest.mark.parametrize("name", list(STEPS))
def test_qformer(benchmark, threads, name):
    module, hidden, cu = make_inputs()

    def setup():
        module.zero_grad(set_to_none=True)
        hidden.grad = None
        return (module, hidden, cu), {}

    benchmark.group = f"qformer fwd+bwd {SHAPES['T']} d={CONFIG['hidden_size']} threads={threads}"
    benchmark.pedantic(STEPS[name], setup=setup, rounds=3, warmup_rounds=1)
    record(
        "qformer", f"{name}[pytest-benchmark]", SHAPES, benchmark.stats.stats.median,
        threads=threads,
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
