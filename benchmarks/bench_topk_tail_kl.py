"""topk_tail_kl forward + backward on CPU: C++ kernel vs the PyTorch reference vs TRL eager.

Shape: N = 256 token rows, V = 151,936 (Qwen3), M = 20, float32, both logits requiring grad,
2 threads.
Every variant computes the same quantities and backpropagates the same loss
``sum(kl) + sum(privilege) + sum(student_logprob)`` (gradients to student *and* teacher):

* ``cpu``: ``lk.topk_tail_kl(..., backend="cpu")`` (the C++ kernel);
* ``torch``: :func:`lopd_kernels.topk_tail_kl_reference` (plain autograd);
* ``trl_eager``: TRL's ``compute_topk_self_distillation_loss(teacher, student, top-k, alpha=0,
  tail)`` plus the sampled-token log-prob gathers, ``log_softmax(x).gather(target)`` on both
  sides. (Not TRL's ``selective_log_softmax``: its per-row loop is meant for no-grad log-probs;
  its backward materializes an [N, V] gradient per row, O(N^2 V), 65 s here at N = 512.)

Reported per variant, via :func:`benchmarks.common.record` into
``benchmarks/results/topk_tail_kl.json``: median seconds of warm calls (pytest-benchmark), peak
RSS of a fresh process beyond its inputs *and* the two [N, V] gradients (target for the kernel:
<= 64 * N * M bytes), achieved GB/s for the 6 * N * V * 4 bytes the op must move (read s, t in
forward; read s, t and write ds, dt in backward) and that as a fraction of the copy bandwidth
measured in the same run (``dst.copy_(src)`` on warm [N, V] float32 tensors, read + write;
target for the kernel: >= 0.7). For the C++ kernel also the first two full-size calls of a fresh
process (target: the first within 2x of the warm median): the first one maps and zeroes the
gradients' pages, later ones reuse them (the op's CPU buffer cache, csrc/cpu/buffer_cache.h).

    pytest benchmarks/bench_topk_tail_kl.py --benchmark-only        # ~2 minutes on 2 cores

``LOPD_BENCH_N`` overrides N, ``LOPD_BENCH_THREADS`` the thread count (set for the run, then
restored); the buffer cache is released at the end.
"""

from __future__ import annotations

import os
import statistics
import time

import pytest
import torch

from benchmarks.common import (
    child_call_seconds,
    load_average,
    peak_rss_bytes,
    record,
    torch_threads,
)

N = int(os.environ.get("LOPD_BENCH_N", "256"))
THREADS = int(os.environ.get("LOPD_BENCH_THREADS", "2"))
V = 151_936
M = 20
SHAPES = {"N": N, "V": V, "M": M, "dtype": "float32", "pass": "fwd+bwd"}
GRAD_BYTES = 2 * N * V * 4
OP_BYTES = 6 * N * V * 4

# The same source runs in this process (timing) and in a fresh one (peak RSS).
SETUP = f"""
import torch
import lopd_kernels as lk
from trl.experimental.sdpo.loss_utils import compute_topk_self_distillation_loss

N, V, M = {N}, {V}, {M}
_g = torch.Generator().manual_seed(0)
# In-place construction: no [N, V] temporary may raise the RSS high-water mark during setup.
s = torch.randn(N, V, generator=_g).mul_(2).requires_grad_(True)
t = torch.randn(N, V, generator=_g).add_(s.detach()).requires_grad_(True)
a = torch.randint(0, V, (N,), generator=_g)
# Two-row copies for warm-up calls (lazy initialization) that leave the RSS high-water mark low.
sw = s.detach()[:2].clone().requires_grad_(True)
tw = t.detach()[:2].clone().requires_grad_(True)
aw = a[:2].clone()


def run_lopd(s, t, a, backend):
    out = lk.topk_tail_kl(s, t, a, top_m=M, backend=backend)
    (out.kl.sum() + out.privilege.sum() + out.student_logprob.sum()).backward()


def run_reference(s, t, a):
    out = lk.topk_tail_kl_reference(s, t, a, top_m=M)
    (out.kl.sum() + out.privilege.sum() + out.student_logprob.sum()).backward()


def run_trl_eager(s, t, a):
    # Support = top-k of the first argument (the teacher); alpha=0 gives KL(student || teacher).
    kl = compute_topk_self_distillation_loss(
        t, s, distillation_topk=M, distillation_alpha=0.0, distillation_add_tail=True
    )
    slp = torch.log_softmax(s, -1).gather(1, a[:, None]).squeeze(1)
    tlp = torch.log_softmax(t, -1).gather(1, a[:, None]).squeeze(1)
    (kl.sum() + (tlp - slp.detach()).sum() + slp.sum()).backward()


def clear_grads():
    for x in (s, t, sw, tw):
        x.grad = None
"""

RUNS = {
    "cpu": "run_lopd(s, t, a, 'cpu')",
    "torch": "run_reference(s, t, a)",
    "trl_eager": "run_trl_eager(s, t, a)",
}
# (rounds, warm-up rounds): the slow baselines get few rounds to keep the run to a few minutes.
ROUNDS = {"cpu": (5, 1), "torch": (1, 0), "trl_eager": (2, 1)}

_medians: dict[str, float] = {}
_cpu_medians: dict[str, float] = {}


def _has_cpp() -> bool:
    from lopd_kernels import _backend

    return _backend.has_kernel("topk_tail_kl_cpu_fwd", "CPU")


@pytest.fixture(scope="module", autouse=True)
def threads():
    """The run's thread count, restored afterwards; the op's buffer cache released at the end."""
    with torch_threads(THREADS) as n:
        yield n
    if _has_cpp():
        from lopd_kernels import _C

        _C.release_cpu_buffer_cache()


@pytest.fixture(scope="module")
def first_calls(threads):
    """Seconds of the first two full-size C++ calls of a fresh process (after a two-row call
    that does the lazy initialization)."""
    if not _has_cpp():
        return None
    warmup = RUNS["cpu"].replace("s, t, a", "sw, tw, aw")
    return child_call_seconds(
        SETUP + f"\n{warmup}\nclear_grads()\n",
        f"{RUNS['cpu']}\nclear_grads()\n",
        calls=2,
        threads=threads,
    )


@pytest.fixture(scope="module")
def peak_rss(threads):
    """(RSS after setup, peak RSS) of each variant's call, each in a fresh process.

    Measured before this process allocates its own [N, V] inputs: on Linux a child's ru_maxrss
    starts from its parent's RSS at fork time (the high-water mark survives exec), so a large
    parent would hide the child's own peak. In the child, a two-row warm-up call does the lazy
    initialization without raising the high-water mark, then the measured call runs.
    """
    out = {}
    for variant, run in RUNS.items():
        if variant == "cpu" and not _has_cpp():
            continue
        warmup = run.replace("s, t, a", "sw, tw, aw")
        out[variant] = peak_rss_bytes(
            SETUP + f"\n{warmup}\nclear_grads()\n",
            f"{run}\n",
            threads=threads,
        )
    return out


@pytest.fixture(scope="module")
def env():
    ns: dict = {}
    exec(SETUP, ns)
    return ns


@pytest.fixture(scope="module")
def copy_gbps(env):
    """Measured copy bandwidth (bytes read + written per second) on a warm [N, V] fp32 buffer."""
    src = env["s"].detach()
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(15):  # a cheap op: enough rounds for a stable median on a noisy machine
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    gbps = 2 * src.numel() * 4 / med / 1e9
    record("topk_tail_kl", "copy_bandwidth", SHAPES, med, None, copy_gbps=gbps)
    return gbps


@pytest.mark.parametrize("variant", ["trl_eager", "torch", "cpu"])
def test_topk_tail_kl_fwd_bwd(benchmark, peak_rss, first_calls, env, copy_gbps, variant):
    if variant == "cpu" and not _has_cpp():
        pytest.skip("lopd_kernels._C is not built: no C++ backend to benchmark")
    benchmark.group = f"topk_tail_kl N={N} V={V} M={M} fp32 fwd+bwd"
    code = compile(RUNS[variant], "<bench>", "exec")
    cpu_times = []

    def call():
        # CPU seconds of this process (all threads) besides wall time: on a shared machine the
        # wall clock also measures the other tenants, the CPU time much less so.
        c0 = time.process_time()
        exec(code, env)
        cpu_times.append(time.process_time() - c0)

    benchmark.pedantic(
        call,
        setup=env["clear_grads"],
        rounds=ROUNDS[variant][0],
        iterations=1,
        warmup_rounds=ROUNDS[variant][1],
    )
    env["clear_grads"]()
    median = benchmark.stats.stats.median
    cpu_median = statistics.median(cpu_times[ROUNDS[variant][1] :])
    _medians[variant] = median
    _cpu_medians[variant] = cpu_median

    # Memory beyond what any caller must hold: the inputs and the two [N, V] gradients.
    before, peak = peak_rss[variant]
    extra = max(0, peak - before - GRAD_BYTES)
    print(f"\n{variant}: peak RSS {peak / 2**20:.1f} MiB, after setup {before / 2**20:.1f} MiB")
    gbps = OP_BYTES / median / 1e9
    fields = {
        "threads": torch.get_num_threads(),
        "median_cpu_s": cpu_median,
        "load_avg_1min": load_average(),
        "peak_rss_delta_bytes": peak - before,
        "achieved_gbps": gbps,
        "copy_gbps": copy_gbps,
        "fraction_of_copy_bw": gbps / copy_gbps,
        "mem_target_bytes": 64 * N * M,
    }
    if variant == "cpu" and first_calls is not None:
        fields["first_call_s"], fields["second_call_s"] = first_calls
        fields["first_call_vs_warm"] = first_calls[0] / median
    if "trl_eager" in _medians:
        fields["speedup_vs_trl_eager"] = _medians["trl_eager"] / median
        fields["cpu_time_speedup_vs_trl_eager"] = _cpu_medians["trl_eager"] / cpu_median
    record("topk_tail_kl", variant, SHAPES, median, extra, **fields)
    benchmark.extra_info.update(fields, peak_mem_extra_bytes=extra)
