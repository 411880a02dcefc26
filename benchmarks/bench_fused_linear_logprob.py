"""fused_linear_logprob on CPU against the materialized cross-entropy and the peers that run here.

The obvious PyTorch code a user would otherwise write, per token row::

    logprob = -F.cross_entropy((h @ W.T).float(), targets, reduction="none")

and ``lk.fused_linear_logprob(h, W, targets, backend="cpu").logprob``, both backpropagating
``sum(logprob * u)`` for a random ``u`` (GRPO's advantages), gradients to ``h`` and ``W``
(``LOPD_BENCH_LP_GRADS=frozen-head``: to ``h`` only, the cold start's frozen head, where the op
takes its gradient projection). Peers, each skipped with its reason when it does not import or
does not run on CPU tensors: Liger's ``LigerFusedLinearCrossEntropyLoss`` (Triton kernels) and
Apple's Cut Cross-Entropy ``linear_cross_entropy`` (``impl="torch_compile"``, its CPU fallback).
They are not dependencies of lopd: run the file with a Python that has them (and torch, pytest,
pytest-benchmark) and this repository on ``PYTHONPATH``.

Shapes: N = 2,048 rows, V = 151,936 (Qwen3), d in {256, 1024}, float32 and bfloat16. Per shape
all variants are timed in the same process, ``LOPD_BENCH_LP_ROUNDS`` calls each, alternating
their order (a drifting machine load hits all alike), forward and backward apart; the extra peak
memory of each is measured in a fresh process (peak RSS beyond inputs, parameters and the
gradients the call returns). Recorded via :func:`benchmarks.common.record` into
``benchmarks/results/fused_linear_logprob.json``: medians, ratios to the materialized path, the
GEMM flops and the ``[N, V]`` bytes each variant moves, and the fraction of the GEMM roofline
(the flops at the best rate of the logit GEMM alone, in the inputs' dtype, measured in the same
process before and after the rounds). The aim: fused
<= 1.3x the materialized time, a small fraction of its extra memory.

    pytest benchmarks/bench_fused_linear_logprob.py --benchmark-only           # ~1 h on 2 cores
    LOPD_CPU_ISA=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 pytest ...  # AVX2

``LOPD_BENCH_LP_N``, ``LOPD_BENCH_LP_V``, ``LOPD_BENCH_LP_DS`` (comma-separated d),
``LOPD_BENCH_LP_DTYPES`` and ``LOPD_BENCH_THREADS`` (default 2) change the setting.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import subprocess
import time

import pytest
import torch

from benchmarks.common import load_average, peak_rss_bytes, record, torch_threads

N = int(os.environ.get("LOPD_BENCH_LP_N", "2048"))
V = int(os.environ.get("LOPD_BENCH_LP_V", "151936"))
DS = [int(x) for x in os.environ.get("LOPD_BENCH_LP_DS", "256,1024").split(",")]
DTYPES = os.environ.get("LOPD_BENCH_LP_DTYPES", "float32,bfloat16").split(",")
ROUNDS = int(os.environ.get("LOPD_BENCH_LP_ROUNDS", "2"))
THREADS = int(os.environ.get("LOPD_BENCH_THREADS", "2"))
HEAD_GRAD = os.environ.get("LOPD_BENCH_LP_GRADS", "head") != "frozen-head"
ISA = os.environ.get("LOPD_CPU_ISA", "native")

# The same source runs here (timing) and in a fresh process per variant (peak RSS). Valid Python
# before formatting too, so tests/scripts/test_benchmark_hygiene.py can parse it.
SETUP = """
import torch
import torch.nn.functional as F
import lopd_kernels as lk

N, D, V, DTYPE, HEAD_GRAD = {n}, {d}, {v}, getattr(torch, "{dtype}"), {head_grad}
_g = torch.Generator().manual_seed(0)
# In place only: a temporary as large as the head would raise the RSS high-water mark of the
# setup above what the measured call adds.
w = torch.empty(V, D).normal_(generator=_g).mul_(2 * D**-0.5).to(DTYPE).requires_grad_(HEAD_GRAD)
h = torch.empty(N, D).normal_(generator=_g).to(DTYPE).requires_grad_(True)
t = torch.randint(0, V, (N,), generator=_g)
u = torch.randn(N, generator=_g)


def fwd_materialized():
    return -F.cross_entropy((h @ w.T).float(), t, reduction="none")


def fwd_fused():
    return lk.fused_linear_logprob(h, w, t, backend="cpu").logprob


def fwd_liger():
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    return -LigerFusedLinearCrossEntropyLoss(reduction="none")(w, h, t)


def fwd_cce():
    from cut_cross_entropy import linear_cross_entropy

    return -linear_cross_entropy(h, w, t, reduction="none", impl="torch_compile")


def bwd(lp):
    (lp * u).sum().backward()


def clear_grads():
    h.grad = w.grad = None


# Lazy initialization (extension, thread pools, MKL) on a tiny problem, outside the measurement.
_x = torch.randn(4, 8, dtype=DTYPE, requires_grad=True)
_w = torch.randn(64, 8, dtype=DTYPE, requires_grad=True)
lk.fused_linear_logprob(_x, _w, torch.arange(4), backend="cpu").logprob.sum().backward()
(-F.cross_entropy((_x @ _w.T).float(), torch.arange(4))).backward()
"""

VARIANTS = ("materialized", "fused", "liger", "cce")
# Variants whose first call at a shape compiles (torch.compile): one untimed call first, in the
# timing process and in the fresh process of the peak (compilation is not the op's memory).
COMPILED = ("cce",)


def _setup(d: int, dtype: str) -> str:
    return SETUP.format(n=N, d=d, v=V, dtype=dtype, head_grad=HEAD_GRAD)


def _gemm_flops(variant: str, d: int) -> tuple[float, float]:
    """GEMM flops of the forward and the backward (2 N V d each; the fused op recomputes the
    logits in its backward, or with a frozen head forms the projection in its forward)."""
    one = 2.0 * N * V * d
    if variant == "materialized":
        return one, one * (2 if HEAD_GRAD else 1)
    if variant == "fused" and not HEAD_GRAD:
        return 2 * one, 0.0
    return one, one * (3 if HEAD_GRAD else 2)


def _nv_bytes(variant: str, dtype: str) -> float:
    """Bytes of ``[N, V]`` tensors written and read to memory (0 for the blocked variants, whose
    blocks stay in cache between the GEMM and the row kernels): the materialized path writes the
    logits (and their float32 copy), the log-softmax, the gradient, and reads each back."""
    if variant != "materialized":
        return 0.0
    half = dtype != "float32"
    per = N * V * 4
    return per * (2 * 3 + (3 if half else 0))


def _peer_unavailable(variant: str) -> str | None:
    modules = {"liger": "liger_kernel", "cce": "cut_cross_entropy"}
    if variant in modules and importlib.util.find_spec(modules[variant]) is None:
        return f"{modules[variant]} is not installed"
    return None


def _gemm_rate(env: dict) -> float:
    """Flops per second of the logit GEMM itself here, ``h @ W[:16384].T`` in the inputs' dtype
    (MKL sgemm for float32, oneDNN for bfloat16): best of three, the roofline of every variant."""
    h, w = env["h"].detach(), env["w"].detach()[:16384]
    torch.mm(h, w.T)
    best = min(_timed(lambda: torch.mm(h, w.T)) for _ in range(3))
    return 2.0 * h.shape[0] * h.shape[1] * w.shape[0] / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", DS)
def test_fused_linear_logprob_vs_materialized_and_peers(benchmark, d, dtype):
    shapes = {"N": N, "d": d, "V": V, "dtype": dtype, "isa": ISA,
              "grads": "h, W" if HEAD_GRAD else "h (frozen head)"}  # fmt: skip
    grad_bytes = (N * d + (V * d if HEAD_GRAD else 0)) * (4 if dtype == "float32" else 2)
    skipped, extra = {}, {}
    # Fresh-process peaks first: this process holds nothing large yet.
    for variant in VARIANTS:
        reason = _peer_unavailable(variant)
        if reason is None:
            try:
                warm = f"bwd(fwd_{variant}())\nclear_grads()\n" if variant in COMPILED else ""
                before, peak = peak_rss_bytes(
                    _setup(d, dtype) + warm, f"bwd(fwd_{variant}())\n", threads=THREADS
                )
                extra[variant] = max(0, peak - before - grad_bytes)
            except subprocess.CalledProcessError as err:  # a peer that does not run on CPU
                lines = (err.stderr or "").strip().splitlines() or ["no message"]
                reason = f"does not run here: {lines[-1][:300]}"
        if reason is not None:
            skipped[variant] = reason
    live = [v for v in VARIANTS if v not in skipped]
    times: dict[str, dict[str, list[float]]] = {v: {"fwd": [], "bwd": []} for v in live}
    with torch_threads(THREADS):
        env: dict = {}
        exec(_setup(d, dtype), env)
        rate = _gemm_rate(env)
        for variant in live:
            if variant in COMPILED:
                env["bwd"](env[f"fwd_{variant}"]())
                env["clear_grads"]()

        def rounds() -> None:
            for r in range(ROUNDS):
                for variant in live if r % 2 == 0 else live[::-1]:
                    env["clear_grads"]()
                    t0 = time.perf_counter()
                    lp = env[f"fwd_{variant}"]()
                    t1 = time.perf_counter()
                    env["bwd"](lp)
                    times[variant]["fwd"].append(t1 - t0)
                    times[variant]["bwd"].append(time.perf_counter() - t1)
                    del lp
            env["clear_grads"]()
            nonlocal rate
            rate = max(rate, _gemm_rate(env))  # the best the machine gave around the rounds

        benchmark.group = f"fused_linear_logprob N={N} d={d} V={V} {dtype}"
        benchmark.pedantic(rounds, rounds=1, iterations=1)
    med = {v: {p: statistics.median(ts) for p, ts in times[v].items()} for v in live}
    base = med["materialized"]
    for variant in live:
        m = med[variant]
        total = m["fwd"] + m["bwd"]
        flops_f, flops_b = _gemm_flops(variant, d)
        fields = {
            "threads": THREADS,
            "fwd_s": m["fwd"],
            "bwd_s": m["bwd"],
            "calls_fwd_s": times[variant]["fwd"],
            "calls_bwd_s": times[variant]["bwd"],
            "gemm_flops": flops_f + flops_b,
            "nv_bytes": _nv_bytes(variant, dtype),
            "gemm_gflops_per_s": rate / 1e9,
            "roofline_fraction": (flops_f + flops_b) / rate / total,
            "load_avg_end": load_average(),
        }
        if variant == "fused":
            fields["peers_skipped"] = skipped
        if variant != "materialized":
            fields["time_vs_materialized"] = total / (base["fwd"] + base["bwd"])
            fields["fwd_vs_materialized"] = m["fwd"] / base["fwd"]
            fields["bwd_vs_materialized"] = m["bwd"] / base["bwd"]
            fields["memory_vs_materialized"] = extra[variant] / max(1, extra["materialized"])
        backend = "cpu" if variant == "fused" else variant
        record("fused_linear_logprob", backend, shapes, total, extra[variant], **fields)
        print(f"\n{variant}: fwd {m['fwd']:.2f} s bwd {m['bwd']:.2f} s, peak RSS beyond "
              f"inputs/params/grads {extra[variant] / 2**20:.0f} MiB", fields)  # fmt: skip
    for variant, reason in skipped.items():
        print(f"\n{variant}: skipped ({reason})")
