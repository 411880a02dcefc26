"""GPU benchmark of fused_linear_topk_tail_kl against the materialized path (forward + backward).

    python benchmarks/gpu_fused_linear.py --out DIR      # N=16,384, d=4096, V=151,936, bf16

Variants, all backpropagating ``sum(kl) + sum(privilege) + sum(student_logprob)``:

* ``materialized``: ``lk.topk_tail_kl(h_s @ W_s^T, h_t @ W_t^T, ...)`` (cuBLAS + its kernels);
* ``triton``: ``lk.fused_linear_topk_tail_kl(..., backend="triton")``;
* ``chunked``: ``backend="cuda"`` (token chunks: cuBLAS GEMMs + the per-row kernels).

Two gradient settings: ``frozen-heads`` (hidden states only: LoRA student, frozen teacher) and
``student-head`` (``W_s`` trained too). Per (variant, setting): median of ``--reps`` timed calls
(CUDA events) and the peak of ``torch.cuda.max_memory_allocated`` beyond the inputs, parameters
and their gradients; the fused variants also report their ratios to the materialized path
(targets: <= 1/25 memory, <= 1.1x time). A trained head's fp32 gradient accumulator is counted
as gradient storage (``grad_fp32``), not as working memory. Records go to
``DIR/fused_linear_topk_tail_kl.json`` through :func:`benchmarks.common.record`.

Without a CUDA device it prints "no CUDA device: skipped" and exits 0; ``--device cpu`` (with
small ``--n/--d/--v``) runs the materialized and chunked variants on the CPU, which only checks
that the script works (tests/test_gpu_scripts.py does, so that GPU time is never lost to it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _measure(fn, clear, reps: int, device: torch.device) -> tuple[float, int | None]:
    """Median seconds of ``fn`` over ``reps`` calls and its peak allocated bytes (CUDA events
    and the caching allocator's peak on a GPU; wall clock and no memory figure on the CPU)."""
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    clear()
    fn()  # warm-up: Triton compilation, cuBLAS handles
    clear()
    sync()
    times = []
    for _ in range(reps):
        clear()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            sync()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    if not cuda:
        return statistics.median(times), None
    clear()
    sync()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    sync()
    peak = torch.cuda.max_memory_allocated() - base
    return statistics.median(times), peak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for the results JSON")
    parser.add_argument("--n", type=int, default=16_384)
    parser.add_argument("--d", type=int, default=4096)
    parser.add_argument("--v", type=int, default=151_936)
    parser.add_argument("--m", type=int, default=20)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--device",
        default="cuda",
        help="cuda (default); 'cpu' only smoke-tests this script (chunked path, small shapes)",
    )
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: skipped")
        return 0
    os.environ["LOPD_BENCH_RESULTS"] = args.out
    import lopd_kernels as lk
    from benchmarks.common import record

    n, d, v, m = args.n, args.d, args.v, args.m
    dev, dt = torch.device(args.device), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    ws = torch.empty(v, d, device=dev, dtype=dt).normal_(generator=g).mul_(d**-0.5)
    wt = torch.empty(v, d, device=dev, dtype=dt).normal_(generator=g).mul_(0.1 * d**-0.5)
    wt.add_(ws)
    hs = torch.empty(n, d, device=dev, dtype=dt).normal_(generator=g).mul_(2)
    ht = torch.empty(n, d, device=dev, dtype=dt).normal_(generator=g).mul_(0.5).add_(hs)
    a = torch.randint(0, v, (n,), device=dev, generator=g)
    hs.requires_grad_(True)
    ht.requires_grad_(True)

    def loss(out):
        return out.kl.sum() + out.privilege.sum() + out.student_logprob.sum()

    runs = {
        "materialized": lambda: loss(lk.topk_tail_kl(hs @ ws.T, ht @ wt.T, a, top_m=m)).backward(),
        "triton": lambda: loss(
            lk.fused_linear_topk_tail_kl(hs, ws, ht, wt, a, top_m=m, backend="triton")
        ).backward(),
        "chunked": lambda: loss(
            lk.fused_linear_topk_tail_kl(hs, ws, ht, wt, a, top_m=m, backend=dev.type)
        ).backward(),
    }
    if dev.type != "cuda":
        del runs["triton"]  # the CPU smoke run checks this script, not the interpreter

    def clear():
        hs.grad = ht.grad = ws.grad = None

    status = 0
    for setting, head_grad in (("frozen-heads", False), ("student-head", True)):
        ws.requires_grad_(head_grad)
        # Gradients the caller keeps: both hidden states' and, if trained, the student head's
        # (bf16); the fused variants also hold the head's fp32 accumulator while they run.
        grad_bytes = 2 * n * d * 2 + (v * d * 2 if head_grad else 0)
        fp32_acc = v * d * 4 if head_grad else 0
        shapes = {"N": n, "d": d, "V": v, "M": m, "dtype": "bfloat16", "pass": "fwd+bwd",
                  "grads": setting}  # fmt: skip
        base = None
        for name, fn in runs.items():
            try:
                median, peak = _measure(fn, clear, args.reps, dev)
            except Exception as err:  # report and go on with the other variants
                print(f"{setting} {name}: FAILED {type(err).__name__}: {err}")
                status = 1
                torch.cuda.empty_cache()
                continue
            extra = (
                None
                if peak is None
                else max(0, peak - grad_bytes - (0 if name == "materialized" else fp32_acc))
            )
            fields = {"peak_allocated_bytes": peak, "grad_fp32": head_grad}
            if name == "materialized":
                base = (median, extra)
            elif base is not None:
                fields["time_vs_materialized"] = median / base[0]
                if extra is not None:
                    fields["memory_vs_materialized"] = extra / max(1, base[1])
            record("fused_linear_topk_tail_kl", name, shapes, median, extra, dev.type, **fields)
            ratios = {k: round(x, 4) for k, x in fields.items() if k.endswith("materialized")}
            mem = "n/a" if extra is None else f"{extra / 2**30:7.3f} GiB"
            print(f"{setting:13s} {name:12s} {median * 1e3:9.1f} ms  extra {mem}  {ratios}")
            torch.cuda.empty_cache()
    return status


if __name__ == "__main__":
    sys.exit(main())
