"""GPU benchmark of topk_tail_kl: forward + backward at N = 8192, V = 151,936, bf16, M = 20.

    python benchmarks/gpu_topk_tail_kl.py --out DIR

Times each GPU backend present (``triton``; ``cuda`` once the CUDA kernel is built) against two
eager baselines, the PyTorch reference (float32 math, plain autograd) and, when TRL is installed,
TRL's ``compute_topk_self_distillation_loss`` + ``log_softmax(x).gather(target)`` on both
sides. All variants backpropagate ``sum(kl) + sum(privilege) + sum(student_logprob)`` into both
logits.

Reports per variant: median seconds (CUDA events), peak allocated memory beyond the inputs and
the two [N, V] gradients, and the achieved bandwidth for the ``6 * N * V * 2`` bytes the op must
move (read s, t forward; read s, t and write ds, dt backward) as a fraction of the measured
device copy bandwidth (``dst.copy_(src)`` on an [N, V] bf16 tensor; the GPU target is >= 85%).
Results: ``DIR/topk_tail_kl_gpu.json`` and, through ``benchmarks.common.record``,
``DIR/topk_tail_kl.json``. Without a CUDA device it prints "no CUDA device: skipped" and exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _timer(device: torch.device):
    """Returns ``measure(fn) -> seconds`` using CUDA events on CUDA, perf_counter otherwise."""

    def measure(fn) -> float:
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return measure


def _peak_bytes(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated() if device.type == "cuda" else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for the JSON results")
    p.add_argument("--n", type=int, default=8192, help="token rows (default 8192)")
    p.add_argument("--v", type=int, default=151_936, help="vocabulary size (default 151,936)")
    p.add_argument("--m", type=int, default=20, help="top-M (default 20)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per variant")
    p.add_argument(
        "--device",
        default="cuda",
        help="cuda (default); 'cpu' only smoke-tests this script with the C++ backend",
    )
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_topk_tail_kl: no CUDA device: skipped")
        return 0

    import lopd_kernels as lk
    from benchmarks import common
    from lopd_kernels import _backend

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    common.RESULTS_DIR = out_dir
    n, v, m = args.n, args.v, args.m
    dtype = torch.bfloat16
    elt = torch.finfo(dtype).bits // 8
    shapes = {"N": n, "V": v, "M": m, "dtype": "bfloat16", "pass": "fwd+bwd"}
    measure = _timer(device)

    g = torch.Generator(device=device).manual_seed(0)
    s = torch.randn(n, v, generator=g, device=device, dtype=dtype).mul_(2).requires_grad_(True)
    t = torch.randn(n, v, generator=g, device=device, dtype=dtype).add_(s.detach())
    t.requires_grad_(True)
    a = torch.randint(0, v, (n,), generator=g, device=device)
    grad_bytes = 2 * n * v * elt

    # Device copy bandwidth: bytes read + written per second.
    src = s.detach()
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy_s = statistics.median([measure(lambda: dst.copy_(src)) for _ in range(5)])
    copy_gbps = 2 * n * v * elt / copy_s / 1e9
    dst = None  # free it before the variants run
    print(f"copy bandwidth: {copy_gbps:.0f} GB/s")

    def lopd(backend):
        def run():
            out = lk.topk_tail_kl(s, t, a, top_m=m, backend=backend)
            (out.kl.sum() + out.privilege.sum() + out.student_logprob.sum()).backward()

        return run

    def reference():
        out = lk.topk_tail_kl_reference(s, t, a, top_m=m)
        (out.kl.sum() + out.privilege.sum() + out.student_logprob.sum()).backward()

    variants = {}
    if device.type == "cuda":
        if _backend.has_cuda_kernel("topk_tail_kl_cuda_fwd"):
            variants["cuda"] = lopd("cuda")
        if _backend.triton_available():
            variants["triton"] = lopd("triton")
    else:
        variants["cpu"] = lopd("cpu")
    variants["torch_reference"] = reference
    try:
        from trl.experimental.sdpo.loss_utils import compute_topk_self_distillation_loss

        def trl_eager():
            kl = compute_topk_self_distillation_loss(
                t, s, distillation_topk=m, distillation_alpha=0.0, distillation_add_tail=True
            )
            slp = torch.log_softmax(s.float(), -1).gather(1, a[:, None]).squeeze(1)
            tlp = torch.log_softmax(t.float(), -1).gather(1, a[:, None]).squeeze(1)
            (kl.sum() + (tlp - slp.detach()).sum() + slp.sum()).backward()

        variants["trl_eager"] = trl_eager
    except ImportError:
        print("trl not installed: the TRL eager baseline is skipped")

    results = {"device": common.device_name(args.device), "copy_gbps": copy_gbps, "runs": []}
    eager_median = None
    for name, fn in variants.items():
        s.grad = t.grad = None
        try:
            fn()  # warm-up: Triton JIT, allocator
            s.grad = t.grad = None
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            base = _peak_bytes(device)
            times = []
            for _ in range(args.reps):
                s.grad = t.grad = None
                times.append(measure(fn))
            peak = _peak_bytes(device)
        except torch.OutOfMemoryError as err:
            print(f"{name}: out of memory ({err}); skipped")
            continue
        s.grad = t.grad = None
        med = statistics.median(times)
        gbps = 6 * n * v * elt / med / 1e9
        extra = max(0, peak - base - grad_bytes) if device.type == "cuda" else None
        row = {
            "backend": name,
            "median_s": med,
            "peak_mem_extra_bytes": extra,
            "achieved_gbps": gbps,
            "fraction_of_copy_bw": gbps / copy_gbps,
        }
        if name in ("torch_reference", "trl_eager"):
            eager_median = med if eager_median is None else min(eager_median, med)
        results["runs"].append(row)
        fields = {k: x for k, x in row.items() if k not in ("backend", "median_s")}
        common.record("topk_tail_kl", name, shapes, med, extra, device=args.device, **fields)
        print(
            f"{name:>16}: {med * 1e3:9.2f} ms  {gbps:7.0f} GB/s "
            f"({100 * gbps / copy_gbps:5.1f}% of copy)  extra memory "
            f"{'n/a' if extra is None else f'{extra / 2**20:.1f} MiB'}"
        )
    if eager_median is not None:
        for row in results["runs"]:
            row["speedup_vs_fastest_eager"] = eager_median / row["median_s"]
    (out_dir / "topk_tail_kl_gpu.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
