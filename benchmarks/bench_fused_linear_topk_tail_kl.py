"""fused_linear_topk_tail_kl forward + backward on CPU: fused (chunked) vs the materialized path.

Shape (the issue's): N = 2048 token rows, d = 1024, V = 151,936 (Qwen3), M = 20, float32.
Gradients as in distillation with a trained student head and a frozen teacher head:
``student_hidden``, ``student_weight`` and ``teacher_hidden`` require grad, ``teacher_weight``
does not (``LOPD_BENCH_FL_GRADS=frozen-heads``: only the hidden states, as with a LoRA student).
Both variants backpropagate ``sum(kl) + sum(privilege) + sum(student_logprob)``:

* ``materialized``: ``s = h_s W_s^T``, ``t = h_t W_t^T`` then ``lk.topk_tail_kl`` (its C++
  kernel), autograd through the matmuls;
* ``fused``: ``lk.fused_linear_topk_tail_kl(..., backend="cpu")``.

Recorded per variant via :func:`benchmarks.common.record` into
``benchmarks/results/fused_linear_topk_tail_kl.json``: median seconds, and the peak RSS of a fresh
process beyond its inputs, parameters and their gradients (``peak - after_setup - grads``; the
targets: fused <= 1/10 of materialized in memory, <= 1.3x in time).

    pytest benchmarks/bench_fused_linear_topk_tail_kl.py --benchmark-only   # ~15 min, 2 cores

Each pass is ~2 TFLOP of GEMMs: on a small machine set ``LOPD_BENCH_FL_N=256`` (and/or
``LOPD_BENCH_FL_V``) for a quick look; ``LOPD_BENCH_THREADS`` sets the thread count (default 2).
"""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks.common import peak_rss_bytes, record

N = int(os.environ.get("LOPD_BENCH_FL_N", "2048"))
D = int(os.environ.get("LOPD_BENCH_FL_D", "1024"))
V = int(os.environ.get("LOPD_BENCH_FL_V", "151936"))
M = 20
THREADS = int(os.environ.get("LOPD_BENCH_THREADS", "2"))
HEAD_GRAD = os.environ.get("LOPD_BENCH_FL_GRADS", "student-head") != "frozen-heads"
SHAPES = {"N": N, "d": D, "V": V, "M": M, "dtype": "float32", "pass": "fwd+bwd",
          "grads": "h_s, W_s, h_t" if HEAD_GRAD else "h_s, h_t"}  # fmt: skip
# What the caller holds anyway after the backward: the gradients of the two hidden states and of
# the student head.
GRAD_BYTES = (2 * N * D + (V * D if HEAD_GRAD else 0)) * 4

# The same source runs in this process (timing) and in a fresh one (peak RSS).
SETUP = f"""
import torch
import lopd_kernels as lk

N, D, V, M = {N}, {D}, {V}, {M}
_g = torch.Generator().manual_seed(0)
# In place only: a temporary as large as a head would raise the setup's RSS high-water mark
# above what the measured call adds, hiding it.
ws = torch.empty(V, D).normal_(generator=_g).mul_(D**-0.5).requires_grad_({HEAD_GRAD})
wt = torch.empty(V, D).normal_(generator=_g).mul_(0.1 * D**-0.5).add_(ws.detach())
hs = torch.empty(N, D).normal_(generator=_g).mul_(2).requires_grad_(True)
ht = torch.empty(N, D).normal_(generator=_g).mul_(0.5).add_(hs.detach()).requires_grad_(True)
a = torch.randint(0, V, (N,), generator=_g)


def loss(out):
    return out.kl.sum() + out.privilege.sum() + out.student_logprob.sum()


def run_materialized():
    out = lk.topk_tail_kl(hs @ ws.T, ht @ wt.T, a, top_m=M)
    loss(out).backward()


def run_fused():
    loss(lk.fused_linear_topk_tail_kl(hs, ws, ht, wt, a, top_m=M, backend="cpu")).backward()


def clear_grads():
    hs.grad = ws.grad = ht.grad = None


# Lazy initialization (extension, thread pools) on a tiny problem, outside the measurement.
_x = torch.randn(4, 8, requires_grad=True)
_w = torch.randn(64, 8, requires_grad=True)
_a = torch.randint(0, 64, (4,))
loss(lk.topk_tail_kl(_x @ _w.T, _x @ _w.T, _a, top_m=4)).backward()
loss(lk.fused_linear_topk_tail_kl(_x, _w, _x, _w.detach(), _a, top_m=4, backend="cpu")).backward()
"""

RUNS = {"materialized": "run_materialized()", "fused": "run_fused()"}


@pytest.fixture(scope="module")
def peak_extra() -> dict[str, int]:
    """Peak RSS beyond inputs, parameters and gradients of each variant, in fresh processes.

    Measured before this process allocates anything large: Linux carries a parent's RSS
    high-water mark into a forked child (``ru_maxrss`` survives ``exec``), which would otherwise
    mask the child's own peak.
    """
    extra = {}
    for variant, run in RUNS.items():
        before, peak = peak_rss_bytes(SETUP, f"{run}\n", threads=THREADS)
        extra[variant] = max(0, peak - before - GRAD_BYTES)
    return extra


@pytest.fixture(scope="module")
def env(peak_extra):
    torch.set_num_threads(THREADS)
    ns: dict = {}
    exec(SETUP, ns)
    return ns


_medians: dict[str, float] = {}


@pytest.mark.parametrize("variant", ["materialized", "fused"])
def test_fused_linear_topk_tail_kl_fwd_bwd(benchmark, peak_extra, env, variant):
    benchmark.group = f"fused_linear_topk_tail_kl N={N} d={D} V={V} M={M} fp32 fwd+bwd"
    code = compile(RUNS[variant], "<bench>", "exec")
    benchmark.pedantic(lambda: exec(code, env), setup=env["clear_grads"], rounds=1, iterations=1)
    env["clear_grads"]()
    median = benchmark.stats.stats.median
    _medians[variant] = median
    extra = peak_extra[variant]
    fields = {"threads": THREADS}
    if variant == "fused" and "materialized" in _medians:
        fields["time_vs_materialized"] = median / _medians["materialized"]
        fields["memory_vs_materialized"] = extra / max(1, peak_extra["materialized"])
    backend = "cpu" if variant == "fused" else variant
    record("fused_linear_topk_tail_kl", backend, SHAPES, median, extra, **fields)
    print(f"\n{variant}: {median:.2f} s, peak RSS beyond inputs/params/grads "
          f"{extra / 2**20:.0f} MiB", fields)  # fmt: skip
