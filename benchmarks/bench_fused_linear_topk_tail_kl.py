"""fused_linear_topk_tail_kl forward + backward on CPU: fused (chunked) vs the materialized path.

Shape (the issue's): N = 2048 token rows, d = 1024, V = 151,936 (Qwen3), M = 20, float32.
Gradients as in distillation with a trained student head and a frozen teacher head:
``student_hidden``, ``student_weight`` and ``teacher_hidden`` require grad, ``teacher_weight``
does not (``LOPD_BENCH_FL_GRADS=frozen-heads``: only the hidden states, as with a LoRA student).
Both variants backpropagate ``sum(kl) + sum(privilege) + sum(student_logprob)``:

* ``materialized``: ``s = h_s W_s^T``, ``t = h_t W_t^T`` then ``lk.topk_tail_kl`` (its C++
  kernel), autograd through the matmuls;
* ``fused``: ``lk.fused_linear_topk_tail_kl(..., backend="chunked")``.

Recorded per variant via :func:`benchmarks.common.record` into
``benchmarks/results/fused_linear_topk_tail_kl.json``: median seconds, and the peak RSS of a fresh
process beyond its inputs, parameters and their gradients (``peak - after_setup - grads``; the
targets: fused <= 1/10 of materialized in memory, <= 1.3x in time).

    pytest benchmarks/bench_fused_linear_topk_tail_kl.py --benchmark-only -k "not trl"  # ~15 min

``-k apart`` times forward and backward apart, fused, materialized and
``fused_linear_topk_tail_kl_loss`` (the same loss as a fixed row weighting, gradients formed in
the forward: backend ``chunked[loss]``) alternating in one process, with both heads trained
(``LOPD_BENCH_FL_APART_GRADS``) at d = 256 and 1,024 (``LOPD_BENCH_FL_DS``), and records
``fwd_vs_materialized`` / ``bwd_vs_materialized``.

Each pass is ~2 TFLOP of GEMMs: on a small machine set ``LOPD_BENCH_FL_N=256`` (and/or
``LOPD_BENCH_FL_V``) for a quick look; ``LOPD_BENCH_THREADS`` sets the thread count (default 2,
set for the run and restored).

**Against TRL's chunked divergence** (``-k trl``, ~3 min): TRL's ``DistillationTrainer`` ships
``trl.kernels.chunked_divergence.ChunkedDivergenceFunction`` (Triton on GPU, a torch tile
fallback elsewhere), the tool a TRL user already has. Its setting: N = 1,024, d = 256,
V = 151,936 fp32, reverse KL over the full vocabulary, gradients to the student's hidden states
and head, a frozen teacher (TRL differentiates only the student). Variants, all
backpropagating ``sum(kl)`` and each measured for peak RSS in its own fresh process:

* ``materialized``: both logits, then ``lk.topk_tail_kl(top_m=None)`` (C++ kernel);
* ``fused``: ``lk.fused_linear_topk_tail_kl(top_m=None)``; ``fused_top20``: the same at M = 20
  (the paper's setting, a different loss);
* ``trl_chunked``: ``ChunkedDivergenceFunction.apply(..., beta=1.0)`` (beta = 1: reverse KL).

The full-vocabulary variants must agree on the mean KL (recorded next to the times).
"""

from __future__ import annotations

import os

import pytest

from benchmarks.common import peak_rss_bytes, record, torch_threads

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

# Which leaves require grad, per gradient setting (LOPD_BENCH_FL_GRADS / the interleaved test).
GRAD_SETTINGS = {
    "student-head": ("True", "False"),  # h_s, W_s, h_t (a trained student, a frozen teacher head)
    "frozen-heads": ("False", "False"),  # h_s, h_t (a LoRA student)
    "both-heads": ("True", "True"),  # h_s, W_s, h_t, W_t
}


def setup_code(d: int, grads: str, dtype: str = "float32") -> str:
    """The benchmark's inputs and runs at hidden size ``d`` (the same source runs in this process
    for timing and in a fresh one for peak RSS); ``grads``: a key of ``GRAD_SETTINGS``."""
    ws_grad, wt_grad = GRAD_SETTINGS[grads]
    return f"""
import torch
import lopd_kernels as lk

N, D, V, M = {N}, {d}, {V}, {M}
_g = torch.Generator().manual_seed(0)
# In place only: a temporary as large as a head would raise the setup's RSS high-water mark
# above what the measured call adds, hiding it.
ws = torch.empty(V, D, dtype=torch.{dtype}).normal_(generator=_g).mul_(D**-0.5)
wt = torch.empty(V, D, dtype=torch.{dtype}).normal_(generator=_g).mul_(0.1 * D**-0.5).add_(ws)
ws.requires_grad_({ws_grad})
wt.requires_grad_({wt_grad})
hs = torch.empty(N, D, dtype=torch.{dtype}).normal_(generator=_g).mul_(2).requires_grad_(True)
ht = torch.empty(N, D, dtype=torch.{dtype}).normal_(generator=_g).mul_(0.5).add_(hs.detach())
ht.requires_grad_(True)
a = torch.randint(0, V, (N,), generator=_g)


def loss(out):
    return out.kl.sum() + out.privilege.sum() + out.student_logprob.sum()


def fwd_materialized():
    return loss(lk.topk_tail_kl(hs @ ws.T, ht @ wt.T, a, top_m=M))


def fwd_fused():
    return loss(lk.fused_linear_topk_tail_kl(hs, ws, ht, wt, a, top_m=M, backend="chunked"))


def fwd_fused_loss():
    # The same loss as a fixed weighting of the rows (privilege = log pT - sg log pS): the
    # gradients are formed in the forward.
    return lk.fused_linear_topk_tail_kl_loss(
        hs, ws, ht, wt, a, kl_weight=1.0, student_logprob_weight=1.0,
        teacher_logprob_weight=1.0, top_m=M, backend="chunked",
    ).loss  # fmt: skip


def run_materialized():
    fwd_materialized().backward()


def run_fused():
    fwd_fused().backward()


def run_fused_loss():
    fwd_fused_loss().backward()


def clear_grads():
    hs.grad = ws.grad = ht.grad = wt.grad = None


# Lazy initialization (extension, thread pools) on a tiny problem, outside the measurement.
_x = torch.randn(4, 8, requires_grad=True)
_w = torch.randn(64, 8, requires_grad=True)
_a = torch.randint(0, 64, (4,))
loss(lk.topk_tail_kl(_x @ _w.T, _x @ _w.T, _a, top_m=4)).backward()
_out = lk.fused_linear_topk_tail_kl(_x, _w, _x, _w.detach(), _a, top_m=4, backend="chunked")
loss(_out).backward()
lk.fused_linear_topk_tail_kl_loss(_x, _w, _x, _w.detach(), _a, top_m=4).loss.backward()
"""


SETUP = setup_code(D, "student-head" if HEAD_GRAD else "frozen-heads")

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
    with torch_threads(THREADS):
        ns: dict = {}
        exec(SETUP, ns)
        yield ns


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
    backend = "chunked" if variant == "fused" else variant
    record("fused_linear_topk_tail_kl", backend, SHAPES, median, extra, **fields)
    print(f"\n{variant}: {median:.2f} s, peak RSS beyond inputs/params/grads "
          f"{extra / 2**20:.0f} MiB", fields)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Forward and backward apart, interleaved with the materialized path (-k apart)
# ---------------------------------------------------------------------------------------------

# Hidden sizes, gradient setting and dtype of test_fwd_bwd_apart (one record pair per d).
APART_DS = [int(x) for x in os.environ.get("LOPD_BENCH_FL_DS", "256,1024").split(",")]
APART_GRADS = os.environ.get("LOPD_BENCH_FL_APART_GRADS", "both-heads")
APART_DTYPE = os.environ.get("LOPD_BENCH_FL_DTYPE", "float32")
APART_REPS = int(os.environ.get("LOPD_BENCH_FL_APART_REPS", "3"))
APART_VARIANTS = ("materialized", "fused", "fused_loss")
# The record's backend word per variant (fused_loss: fused_linear_topk_tail_kl_loss).
APART_BACKENDS = {"materialized": "materialized", "fused": "chunked", "fused_loss": "chunked[loss]"}
_GRAD_NAMES = {"student-head": "h_s, W_s, h_t", "frozen-heads": "h_s, h_t",
               "both-heads": "h_s, W_s, h_t, W_t"}  # fmt: skip


def _cpu_isa() -> str:
    """The instruction set of the C++ kernels here (``LOPD_CPU_ISA`` caps it)."""
    try:
        # The extension is optional (the epilogue falls back to PyTorch without it).
        from lopd_kernels import _C

        return _C.cpu_isa()
    except ImportError:
        return "none"


def _grad_bytes(d: int, grads: str, itemsize: int) -> int:
    """What the caller holds after the backward: the gradients of the leaves."""
    heads = GRAD_SETTINGS[grads].count("True")
    return (2 * N * d + heads * V * d) * itemsize


@pytest.mark.parametrize("d", APART_DS)
def test_fwd_bwd_apart(benchmark, d):
    """Forward and backward timed apart, the fused op and the materialized path alternating in
    one process (a cold first call each, then ``APART_REPS`` warm rounds, alternating which goes
    first), so that the shared machine's load hits both alike; peak RSS in fresh processes.

    The ISA of the C++ kernels and of ATen's vectorized ops is the process's:
    ``LOPD_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2`` measures an AVX2 machine's code paths (MKL's
    GEMMs pick their own on AMD CPUs, see docs/kernels.md#benchmarks).
    """
    import statistics
    import time

    import torch

    code = setup_code(d, APART_GRADS, APART_DTYPE)
    itemsize = torch.empty(0, dtype=getattr(torch, APART_DTYPE)).element_size()
    extra = {}
    for variant in APART_VARIANTS:
        before, peak = peak_rss_bytes(code, f"run_{variant}()\n", threads=THREADS)
        extra[variant] = max(0, peak - before - _grad_bytes(d, APART_GRADS, itemsize))
    times: dict[str, dict[str, list[float]]] = {v: {"fwd": [], "bwd": []} for v in APART_VARIANTS}
    first: dict[str, float] = {}
    with torch_threads(THREADS):
        ns: dict = {}
        exec(code, ns)

        def one(variant: str) -> tuple[float, float]:
            ns["clear_grads"]()
            t0 = time.perf_counter()
            loss = ns[f"fwd_{variant}"]()
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            return t1 - t0, t2 - t1

        def rounds() -> None:
            for variant in APART_VARIANTS:
                first[variant] = sum(one(variant))
            for i in range(APART_REPS):
                for variant in APART_VARIANTS[:: 1 if i % 2 else -1]:
                    f, b = one(variant)
                    times[variant]["fwd"].append(f)
                    times[variant]["bwd"].append(b)
            ns["clear_grads"]()

        benchmark.group = f"fused_linear_topk_tail_kl fwd/bwd apart N={N} V={V} M={M}"
        benchmark.pedantic(rounds, rounds=1, iterations=1)
    med = {v: {k: statistics.median(x) for k, x in t.items()} for v, t in times.items()}
    shapes = {"N": N, "d": d, "V": V, "M": M, "dtype": APART_DTYPE, "pass": "fwd, bwd apart",
              "grads": _GRAD_NAMES[APART_GRADS], "isa": _cpu_isa(),
              "aten_isa": torch.backends.cpu.get_cpu_capability().lower()}  # fmt: skip
    base = med["materialized"]
    for variant in APART_VARIANTS:
        m = med[variant]
        fields = {"threads": THREADS, "fwd_s": m["fwd"], "bwd_s": m["bwd"],
                  "calls_fwd_s": times[variant]["fwd"], "calls_bwd_s": times[variant]["bwd"],
                  "first_call_s": first[variant]}  # fmt: skip
        if variant != "materialized":
            fields["time_vs_materialized"] = (m["fwd"] + m["bwd"]) / (base["fwd"] + base["bwd"])
            fields["fwd_vs_materialized"] = m["fwd"] / base["fwd"]
            fields["bwd_vs_materialized"] = m["bwd"] / base["bwd"]
            fields["first_call_vs_materialized"] = first[variant] / first["materialized"]
            fields["memory_vs_materialized"] = extra[variant] / max(1, extra["materialized"])
        backend = APART_BACKENDS[variant]
        record("fused_linear_topk_tail_kl", backend, shapes, m["fwd"] + m["bwd"], extra[variant],
               **fields)  # fmt: skip
        print(f"\n{variant} d={d}: fwd {m['fwd']:.2f} s, bwd {m['bwd']:.2f} s, first call "
              f"{first[variant]:.2f} s, peak RSS beyond inputs/params/grads "
              f"{extra[variant] / 2**20:.0f} MiB", {k: v for k, v in fields.items()
                                                    if not k.startswith("calls")})  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Against TRL's chunked divergence kernel (its setting: frozen teacher, full-vocabulary reverse KL)
# ---------------------------------------------------------------------------------------------

TRL_N = int(os.environ.get("LOPD_BENCH_TRL_N", "1024"))
TRL_D = int(os.environ.get("LOPD_BENCH_TRL_D", "256"))
TRL_SHAPES = {"N": TRL_N, "d": TRL_D, "V": V, "dtype": "float32", "pass": "fwd+bwd",
              "grads": "h_s, W_s (frozen teacher)", "divergence": "reverse"}  # fmt: skip
# What the caller holds after the backward: the student's hidden-state and head gradients.
TRL_GRAD_BYTES = (TRL_N * TRL_D + V * TRL_D) * 4

TRL_SETUP = f"""
import torch
import lopd_kernels as lk
from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

N, D, V = {TRL_N}, {TRL_D}, {V}
_g = torch.Generator().manual_seed(0)
# In place only (see SETUP above).
ws = torch.empty(V, D).normal_(generator=_g).mul_(D**-0.5).requires_grad_(True)
wt = torch.empty(V, D).normal_(generator=_g).mul_(0.1 * D**-0.5).add_(ws.detach())
hs = torch.empty(N, D).normal_(generator=_g).mul_(2).requires_grad_(True)
ht = torch.empty(N, D).normal_(generator=_g).mul_(0.5).add_(hs.detach())
a = torch.randint(0, V, (N,), generator=_g)
kl_mean = {{}}


def run_materialized():
    kl = lk.topk_tail_kl(hs @ ws.T, ht @ wt.T, a, top_m=None).kl
    kl.sum().backward()
    kl_mean["materialized"] = kl.mean().item()


def run_fused():
    kl = lk.fused_linear_topk_tail_kl(hs, ws, ht, wt, a, top_m=None, backend="chunked").kl
    kl.sum().backward()
    kl_mean["fused"] = kl.mean().item()


def run_fused_top20():
    kl = lk.fused_linear_topk_tail_kl(hs, ws, ht, wt, a, top_m=20, backend="chunked").kl
    kl.sum().backward()
    kl_mean["fused_top20"] = kl.mean().item()


def run_trl_chunked():
    # beta = 1: KL(student || teacher), the reverse KL; gradients to the student only.
    kl, _entropy = ChunkedDivergenceFunction.apply(hs, ws, None, ht, wt, None, 1.0, 1.0)
    kl.sum().backward()
    kl_mean["trl_chunked"] = kl.mean().item()


def clear_grads():
    hs.grad = ws.grad = None


# Lazy initialization on a tiny problem, outside the measurement.
_x = torch.randn(4, 8, requires_grad=True)
_w = torch.randn(64, 8, requires_grad=True)
_a = torch.randint(0, 64, (4,))
lk.fused_linear_topk_tail_kl(_x, _w, _x.detach(), _w.detach(), _a, top_m=None).kl.sum().backward()
_kl, _ = ChunkedDivergenceFunction.apply(_x, _w, None, _x.detach(), _w.detach(), None, 1.0, 1.0)
_kl.sum().backward()
"""

TRL_RUNS = {
    name: f"run_{name}()" for name in ("materialized", "fused", "fused_top20", "trl_chunked")
}


def _has_trl_kernel() -> bool:
    try:
        import trl.kernels.chunked_divergence  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def trl_peak_extra() -> dict[str, int]:
    """Peak RSS beyond inputs, parameters and gradients, each variant in a fresh process."""
    if not _has_trl_kernel():
        pytest.skip("trl.kernels.chunked_divergence is not installed")
    extra = {}
    for variant, run in TRL_RUNS.items():
        before, peak = peak_rss_bytes(TRL_SETUP, f"{run}\n", threads=THREADS)
        extra[variant] = max(0, peak - before - TRL_GRAD_BYTES)
    return extra


@pytest.fixture(scope="module")
def trl_env(trl_peak_extra):
    with torch_threads(THREADS):
        ns: dict = {}
        exec(TRL_SETUP, ns)
        yield ns


_trl_medians: dict[str, float] = {}


@pytest.mark.parametrize("variant", list(TRL_RUNS))
def test_vs_trl_chunked_divergence(benchmark, trl_peak_extra, trl_env, variant):
    benchmark.group = f"vs TRL chunked_divergence N={TRL_N} d={TRL_D} V={V} fp32 fwd+bwd"
    code = compile(TRL_RUNS[variant], "<bench>", "exec")
    benchmark.pedantic(
        lambda: exec(code, trl_env), setup=trl_env["clear_grads"], rounds=2, iterations=1,
        warmup_rounds=1,
    )  # fmt: skip
    trl_env["clear_grads"]()
    median = benchmark.stats.stats.median
    _trl_medians[variant] = median
    extra = trl_peak_extra[variant]
    fields = {"threads": THREADS, "kl_mean": trl_env["kl_mean"][variant]}
    if variant != "materialized" and "materialized" in _trl_medians:
        fields["time_vs_materialized"] = median / _trl_medians["materialized"]
        fields["memory_vs_materialized"] = extra / max(1, trl_peak_extra["materialized"])
    if variant == "trl_chunked":
        for ours in ("fused", "fused_top20"):
            if ours in _trl_medians:
                fields[f"{ours}_speedup"] = median / _trl_medians[ours]
        # Same loss as ours at the full vocabulary: the KL means agree to ~5 digits.
        full = [trl_env["kl_mean"][k] for k in ("materialized", "fused", "trl_chunked")]
        assert max(full) - min(full) <= 1e-4 * max(1.0, abs(full[0])), trl_env["kl_mean"]
    record("fused_linear_vs_trl", variant, TRL_SHAPES, median, extra, **fields)
    print(f"\n{variant}: {median:.2f} s, peak RSS beyond inputs/params/grads "
          f"{extra / 2**20:.0f} MiB", fields)  # fmt: skip
