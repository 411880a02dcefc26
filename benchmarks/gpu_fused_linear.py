"""GPU benchmark of ``fused_linear_topk_tail_kl`` and its peers: one variant per process.

    python benchmarks/gpu_fused_linear.py --variant materialized    # N=8192, d=4096, V=151,936

Variants (``--variant``), each forward and backward timed apart, with peak memory:

* ``materialized``: ``lk.topk_tail_kl(h_s @ W_s^T, h_t @ W_t^T, ...)`` (cuBLAS logits, [N, V]
  twice, then the per-row kernel);
* ``chunked``: ``lk.fused_linear_topk_tail_kl(..., backend="chunked")`` (cuBLAS logit blocks per
  token chunk + the per-row kernels ``topk_tail_kl``'s ``"auto"`` picks on the GPU);
* ``chunked_loss``: ``lk.fused_linear_topk_tail_kl_loss(..., backend="chunked")``, the same loss
  as a fixed weighting of the rows (weights 1 on the KL and both log-probs: the gradient of
  ``sum(kl) + sum(privilege) + sum(student_logprob)``), its gradients formed in the forward;
* ``triton``: ``backend="triton"``, the fully fused kernel;
* ``trl_chunked_divergence``: TRL's ``ChunkedDivergenceFunction`` (``trl.kernels.
  chunked_divergence``, the ``DistillationTrainer`` loss) with ``beta=1``: full-vocabulary
  reverse KL, gradient to the student only;
* ``liger_fused_linear_jsd``: Liger's ``LigerFusedLinearJSD(jsd_beta=1)`` (reverse KL over the
  full vocabulary, student gradient only), when the package is importable.

Options: the LOPD fused variants (``chunked``, ``triton``) are also timed with ``--options``
(default ``student``, ``union``, ``jsd``: ``support="student"``, ``support="union"``,
``divergence="jsd", beta=0.5``) in the first gradient setting, each a record of its own
(``shapes["support"]``, ``["divergence"]``, ``["beta"]``) checked against the float64 reference
like the teacher's (the union's ``topk_ids`` too), with ``time_vs_teacher``: its median over the
teacher's reverse KL's in the same process.

All LOPD variants backpropagate ``sum(kl) + sum(privilege) + sum(student_logprob)`` into both
hidden states (and the student head under ``student-head``). Two gradient settings, each its own
records (``shapes["grads"]``): ``frozen-heads`` (LoRA student, frozen teacher: the hidden states
only) first, then ``student-head`` (``W_s`` trained too). ``peak_mem_bytes`` is the allocator's
peak beyond the inputs and the gradients the caller keeps (``grad_bytes``; a fused variant's
float32 weight-gradient accumulator counts as working memory). The LOPD variants and TRL's are
checked against the float64 reference on the first rows (``max_err_kl``, ``check_ok``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as gc

VARIANTS = ("materialized", "chunked", "chunked_loss", "triton", "trl_chunked_divergence",
            "liger_fused_linear_jsd")  # fmt: skip
SETTINGS = ("frozen-heads", "student-head")
SIZES = {"full": (8192, 4096, 151_936, 20), "tiny": (6, 16, 70, 4)}
CHECK_ROWS = 16
# --options: (support, divergence, beta) of each case timed after the teacher's reverse KL.
OPTIONS = {
    "student": ("student", "reverse", None),
    "union": ("union", "reverse", None),
    "jsd": ("teacher", "jsd", 0.5),
}
# bf16 inputs (tests/utils.py's bf16 row): |out - ref| <= ATOL + RTOL * |ref|.
RTOL, ATOL = 2e-2, 8e-3


def make_inputs(n: int, d: int, v: int, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """Hidden states ``[n, d]``, heads ``[v, d]`` (logits of std ~2, teacher close to the
    student) and random targets ``[n]``."""
    g = torch.Generator(device=device).manual_seed(seed)
    ws = torch.randn(v, d, generator=g, device=device).mul_(d**-0.5)
    wt = torch.randn(v, d, generator=g, device=device).mul_(0.1 * d**-0.5).add_(ws)
    hs = torch.randn(n, d, generator=g, device=device).mul_(2)
    ht = torch.randn(n, d, generator=g, device=device).mul_(0.5).add_(hs)
    a = torch.randint(0, v, (n,), generator=g, device=device)
    return hs.to(dtype), ws.to(dtype), ht.to(dtype), wt.to(dtype), a


def _lopd_sum(out) -> torch.Tensor:
    return out.kl.sum() + out.privilege.sum() + out.student_logprob.sum()


def variant_fns(name: str, lk, hs, ws, ht, wt, a, m: int, device: torch.device, opts=None):
    """``(forward, backward, check(out) -> dict)`` of one variant (``opts``: support / divergence
    / beta of a LOPD fused variant)."""
    opts = opts or {}
    if name == "materialized":
        fwd = lambda: lk.topk_tail_kl(hs @ ws.T, ht @ wt.T, a, top_m=m)
        return (
            fwd,
            lambda out: _lopd_sum(out).backward(),
            lambda out: check_rows(lk, out.kl, hs, ws, ht, wt, a, m, rounded_logits=True),
        )
    if name in ("chunked", "triton"):
        fwd = lambda: lk.fused_linear_topk_tail_kl(hs, ws, ht, wt, a, top_m=m, backend=name, **opts)
        return (
            fwd,
            lambda out: _lopd_sum(out).backward(),
            lambda out: check_rows(lk, out.kl, hs, ws, ht, wt, a, m, ids=out.topk_ids, **opts),
        )
    if name == "chunked_loss":
        weights = {"kl_weight": 1.0, "student_logprob_weight": 1.0, "teacher_logprob_weight": 1.0}
        fwd = lambda: lk.fused_linear_topk_tail_kl_loss(
            hs, ws, ht, wt, a, top_m=m, backend="chunked", **weights, **opts
        )
        return (
            fwd,
            lambda res: res.loss.backward(),
            lambda res: check_rows(
                lk, res.output.kl, hs, ws, ht, wt, a, m, ids=res.output.topk_ids, **opts
            ),
        )
    if name == "trl_chunked_divergence":
        from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

        # beta = 1: reverse KL(student || teacher) over the full vocabulary, per token.
        fwd = lambda: ChunkedDivergenceFunction.apply(hs, ws, None, ht, wt, None, 1.0, 1.0)
        return (
            fwd,
            lambda out: out[0].sum().backward(),
            lambda out: check_rows(lk, out[0], hs, ws, ht, wt, a, None),
        )
    if name == "liger_fused_linear_jsd":
        from liger_kernel.transformers.fused_linear_jsd import LigerFusedLinearJSD

        loss = LigerFusedLinearJSD(jsd_beta=1.0)
        fwd = lambda: loss(hs, ws, ht, wt, a)
        return fwd, lambda out: out.backward(), lambda out: {}  # a scalar: nothing per row
    raise ValueError(f"unknown variant {name!r}")


def check_rows(
    lk, kl, hs, ws, ht, wt, a, top_m: int | None, rounded_logits=False, ids=None, **opts
) -> dict:
    """``kl`` of the first rows against the float64 reference on the same (rounded) inputs;
    ``rounded_logits``: on the logits rounded to the inputs' dtype, as the materialized path
    forms them (its own rounding is not an error of the kernel); ``ids``: the support's ids,
    compared too where given; ``opts``: support / divergence / beta."""
    r = min(CHECK_ROWS, a.shape[0])
    with torch.no_grad():
        if rounded_logits:
            s, t = (hs[:r] @ ws.T).double(), (ht[:r] @ wt.T).double()
            ref = lk.topk_tail_kl_reference(s, t, a[:r], top_m=top_m, **opts)
        else:
            ref = lk.fused_linear_topk_tail_kl_reference(
                hs[:r].double(), ws.double(), ht[:r].double(), wt.double(), a[:r], top_m=top_m,
                **opts,
            )  # fmt: skip
    diff = (kl.detach()[:r].double() - ref.kl).abs()
    ok = bool((diff <= ATOL + RTOL * ref.kl.abs()).all())
    out = {"max_err_kl": float(diff.max())}
    if ids is not None and opts:
        # The selection is exact on the fp32 logits both form (ties aside: none at these sizes).
        out["ids_match"] = bool(torch.equal(ids[:r], ref.topk_ids))
        ok = ok and out["ids_match"]
    out["check_ok"] = ok
    return out


def bench_setting(args, lk, rec, device, setting: str) -> None:
    """One gradient setting: the variant, then its ``--options`` cases."""
    teacher_r = _bench_one(args, lk, rec, device, setting, args.variant, args.budget_s)
    gc.free_cuda(device)
    if args.variant in ("chunked", "triton") and setting == args.settings.split(",")[0]:
        for key in filter(None, args.options.split(",")):
            support, divergence, beta = OPTIONS[key]
            opts = {"support": support, "divergence": divergence, "beta": beta}
            _bench_one(args, lk, rec, device, setting, args.variant, args.budget_s, opts=opts,
                       baseline=teacher_r)  # fmt: skip
            gc.free_cuda(device)


def _bench_one(
    args, lk, rec, device, setting: str, label: str, budget_s: float, *, opts=None,
    baseline=None,
):  # fmt: skip
    """One variant in one gradient setting (``opts``: support / divergence / beta); returns
    the timings (``baseline``: the teacher's reverse KL's, for ``time_vs_teacher``)."""
    n, d, v, m = SIZES[args.size]
    dtype = torch.bfloat16
    hs, ws, ht, wt, a = make_inputs(n, d, v, device, dtype)
    head_grad = setting == "student-head"
    lopd = args.variant in ("materialized", "chunked", "triton")
    hs.requires_grad_(True)
    ht.requires_grad_(lopd)  # the peers give the student a gradient only
    ws.requires_grad_(head_grad)
    fwd, bwd, check = variant_fns(args.variant, lk, hs, ws, ht, wt, a, m, device, opts)

    def clear() -> None:
        hs.grad = ht.grad = ws.grad = None

    extra: dict = {"teacher_grad": lopd, "grad_fp32": head_grad and lopd}
    # The warm-up call (JIT, allocator; at least one: the check needs it) also gives the
    # correctness check its output; how long it took decides how many timed calls fit in
    # budget_s.
    reps = args.reps
    for _ in range(max(1, args.warmup)):
        clear()
        gc.sync(device)
        t0 = time.perf_counter()
        out = fwd()
        extra.update(check(out))
        bwd(out)
        del out
        gc.sync(device)
        reps = max(1, min(args.reps, int(budget_s / (time.perf_counter() - t0))))
    r = gc.time_fwd_bwd(fwd, bwd, device, reps, clear, warmup=0)
    grad_bytes = hs.numel() * 2 + (ht.numel() * 2 if lopd else 0) + (ws.numel() * 2 * head_grad)
    peak = None if r["peak_bytes"] is None else max(0, r["peak_bytes"] - grad_bytes)
    shapes = {"N": n, "d": d, "V": v, "M": m if lopd else "full", "dtype": "bfloat16",
              "grads": setting, **(opts or {})}  # fmt: skip
    for pas in ("fwd", "bwd", "fwd+bwd"):
        if baseline:
            extra["time_vs_teacher"] = r[pas] / baseline[pas]
        rec.add("fused_linear_topk_tail_kl", label, {**shapes, "pass": pas}, r[pas],
                peak if pas == "fwd+bwd" else None, reps=r["reps"], grad_bytes=grad_bytes,
                peak_allocated_bytes=r["peak_bytes"], **extra)  # fmt: skip
    if extra.get("check_ok") is False:
        raise AssertionError(f"{label} {setting} {opts or ''}: wrong against the reference: "
                             f"{extra}")  # fmt: skip
    return r


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", required=True, choices=VARIANTS)
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated")
    parser.add_argument(
        "--budget-s", type=float, default=8.0, help="fewer reps when one call is this slow"
    )
    parser.add_argument(
        "--options",
        default=",".join(OPTIONS),
        help="chunked / triton: option cases timed in the first gradient setting "
        f"(comma-separated of {', '.join(OPTIONS)}; empty: none)",
    )
    args, device = gc.parse_args(parser, argv, reps=5)
    if device is None:
        return 0
    import lopd_kernels as lk

    rec = gc.Recorder(args.records, device)
    ok = gc.run_each(
        f"fused_linear {args.variant}", args.settings.split(","),
        lambda setting: bench_setting(args, lk, rec, device, setting), device,
    )  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
