"""Table 2 of ``benchmarks/precision.py``: what the tail bucket's formula does to a sharp teacher.

Teachers whose top-M holds a chosen mass (top logits N(0, 1) on M random ids, the other logits
N(0, 1) shifted down per row until the top-M mass is the target; built in float64, then rounded
to the input dtype) and two students (``near``: teacher + N(0, 0.5^2); ``broad``: the same with
its tail raised until it puts 0.9 on the teacher's top-M). Every method computes in float32 from
the rounded logits (cast to float32: the table isolates the tail's formula from bf16
arithmetic) over the teacher's top-M; gradients are w.r.t. those float32 logits. The truth is the
float64 exact-tail bucket KL on the same rounded values (:mod:`benchmarks.precision_truth`).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

import lopd_kernels as lk
from benchmarks.common import record
from benchmarks.precision_truth import loss_errors, rel_err, teacher_top, truth_dense, worst_row_err

#: The teacher top-M masses; 1 - 1e-9 goes below the field's clamp floor (a tail of ~1e-7).
MASSES = (0.99, 0.9999, 1 - 1e-7, 1 - 1e-9)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
STUDENTS = ("near", "broad")
TAIL_DIVERGENCES = ("reverse", "forward")
BROAD_STUDENT_MASS = 0.9
CLAMP = -1e-7  # the field's clamp of log(sum of the top-M probabilities)


def _shift_complement(x: torch.Tensor, ids: torch.Tensor, mass: float) -> torch.Tensor:
    """``x`` (float64 ``[R, V]``) with every entry outside ``ids`` shifted per row so that
    ``softmax(x)`` puts ``mass`` on ``ids``."""
    top = torch.zeros_like(x, dtype=torch.bool).scatter(1, ids, True)
    a = torch.logsumexp(x.masked_fill(~top, -math.inf), -1, keepdim=True)
    b = torch.logsumexp(x.masked_fill(top, -math.inf), -1, keepdim=True)
    delta = a - b - math.log(mass / (1 - mass))
    return torch.where(top, x, x + delta)


def sharp_pair(n: int, v: int, m: int, mass: float, student: str, seed: int):
    """Float64 ``[n, v]`` student and teacher logits: the teacher's top-``m`` mass is ``mass``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(n, v, generator=g).argsort(-1)[:, :m]
    t = _shift_complement(torch.randn(n, v, generator=g, dtype=torch.float64), ids, mass)
    s = t + 0.5 * torch.randn(n, v, generator=g, dtype=torch.float64)
    if student == "broad":
        s = _shift_complement(s, ids, BROAD_STUDENT_MASS)
    return s, t, torch.randint(0, v, (n,), generator=g)


# ------------------------------------------------------------------------------------ methods
# Each: (s, t, y, m, div) with float32 leaves -> (per-row KL [N], fraction of rows clamped)


def exact_tail(s, t, y, m, div):
    kl = lk.topk_tail_kl(s, t, y, top_m=m, divergence=div, backend="cpu").kl
    return kl, None


def _top_logprobs(s, t, m, log_softmax: bool = False):
    """Both sides' log-probs on the teacher's top-``m``: ``x[ids] - logsumexp(x)`` as TRL's
    ``compute_topk_self_distillation_loss`` forms them, or ``log_softmax(x)[ids]`` as verl does
    (``log_softmax=True``; PyTorch's float32 CPU ``log_softmax`` is the less accurate of the two
    on a sharp row: ``docs/kernels.md``, Benchmarks)."""
    ids = teacher_top(t.detach(), m)
    if log_softmax:
        return torch.log_softmax(s, -1).gather(1, ids), torch.log_softmax(t, -1).gather(1, ids)
    return tuple(x.gather(1, ids) - torch.logsumexp(x, -1, keepdim=True) for x in (s, t))


def clamped_tail(s, t, y, m, div):
    """TRL's ``add_tail_bucket`` on both sides (the clamp at -1e-7), then its divergence."""
    # trl is an optional benchmark peer (heavy import): imported on use.
    from trl.experimental.sdpo.loss_utils import add_tail_bucket, compute_divergence

    ls, lt = _top_logprobs(s, t, m)
    active = (torch.logsumexp(ls, -1) > CLAMP) | (torch.logsumexp(lt, -1) > CLAMP)
    kl = compute_divergence(
        add_tail_bucket(ls), add_tail_bucket(lt), 1.0 if div == "reverse" else 0.0
    )
    return kl, float(active.float().mean())


def renormalized(s, t, y, m, div):
    """Top-M renormalized over the top-M (axolotl; TRL's ``distillation_add_tail=False``)."""
    # trl is an optional benchmark peer (heavy import): imported on use.
    from trl.experimental.sdpo.loss_utils import compute_divergence

    ls, lt = _top_logprobs(s, t, m)
    ls, lt = ls - ls.logsumexp(-1, keepdim=True), lt - lt.logsumexp(-1, keepdim=True)
    return compute_divergence(ls, lt, 1.0 if div == "reverse" else 0.0), None


def truncated(s, t, y, m, div):
    """The top-M terms only, then ``clamp_min(0)`` (verl 0.9's ``compute_forward_kl_topk`` +
    ``kl_divergence``; the reverse KL written the same way)."""
    ls, lt = _top_logprobs(s, t, m, log_softmax=True)
    raw = (lt.exp() * (lt - ls)).sum(-1) if div == "forward" else (ls.exp() * (ls - lt)).sum(-1)
    return raw.clamp_min(0.0), float((raw < 0).float().mean())


METHODS = {
    "exact tail (lk.topk_tail_kl)": exact_tail,
    "clamped 1 - sum (TRL/SDPO)": clamped_tail,
    "renormalized top-M (axolotl)": renormalized,
    "truncated + clamp_min(0) (verl)": truncated,
}
NEEDS_TRL = (clamped_tail, renormalized)


def tail_table(n, v, m, seed, results_dir: Path | None, write: bool, peers: bool) -> list[dict]:
    """Runs every (mass, dtype, student, divergence, method), records and prints the table."""
    recs = []
    for mass in MASSES:
        for dname, dtype in DTYPES.items():
            for student in STUDENTS:
                s64, t64, y = sharp_pair(n, v, m, mass, student, seed)
                s0, t0 = s64.to(dtype), t64.to(dtype)
                ids = teacher_top(t0.double(), m)
                achieved = torch.log_softmax(t0.double(), -1).gather(1, ids).exp().sum(-1)
                s_mass = torch.log_softmax(s0.double(), -1).gather(1, ids).exp().sum(-1)
                info = {
                    "teacher_tail_mass_median": float((1 - achieved).median()),
                    "student_top_mass_median": float(s_mass.median()),
                }
                for div in TAIL_DIVERGENCES:
                    rows64, gs64, gt64 = truth_dense(s0, t0, div, None, m)
                    for name, fn in METHODS.items():
                        if not peers and fn in NEEDS_TRL:
                            continue
                        # Fresh float32 leaves (``.float()`` of a float32 tensor is itself).
                        s = s0.to(torch.float32, copy=True).requires_grad_(True)
                        t = t0.to(torch.float32, copy=True).requires_grad_(True)
                        c0 = time.perf_counter()
                        kl, active = fn(s, t, y, m, div)
                        kl.sum().backward()
                        secs = time.perf_counter() - c0
                        met = loss_errors(kl.detach(), rows64)
                        met |= {
                            "grad_s_rel_err": rel_err(s.grad, gs64),
                            "grad_t_rel_err": rel_err(t.grad, gt64),
                            "grad_s_worst_row": worst_row_err(s.grad, gs64),
                            "kl_truth_mean": float(rows64.mean()),
                            "clamp_active_frac": active,
                            **info,
                        }
                        shapes = {
                            "N": n,
                            "V": v,
                            "M": m,
                            "dtype": dname,
                            "teacher_top_mass": mass,
                            "student": student,
                            "divergence": div,
                        }
                        if write:
                            rec = record(
                                "precision_tail",
                                name,
                                shapes,
                                secs,
                                None,
                                results_dir=results_dir,
                                threads=torch.get_num_threads(),
                                **met,
                            )
                        else:
                            rec = {"backend": name, "shapes": shapes, **met}
                        recs.append(rec)
    print(tail_markdown(recs))
    return recs


def _e(v) -> str:
    return "n/a" if v is None else f"{v:.1e}"


def tail_markdown(recs: list[dict]) -> str:
    """One row per (mass, dtype, student, method): both divergences' KL and student-gradient
    errors, and how often the method's clamp was active (clamped tail: either side's top-M
    log-mass above -1e-7; truncation: ``clamp_min(0)``, reverse / forward)."""
    head = [
        "teacher top-M mass (achieved tail)",
        "inputs",
        "student",
        "method",
        "reverse KL err",
        "reverse grad err",
        "forward KL err",
        "forward grad err",
        "clamp active",
    ]
    out = ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by: dict[tuple, dict] = {}
    for r in recs:
        sh = r["shapes"]
        key = (sh["teacher_top_mass"], sh["dtype"], sh["student"], r["backend"])
        by.setdefault(key, {})[sh["divergence"]] = r
    for (mass, dtype, student, name), d in by.items():
        rv, fw = d.get("reverse", {}), d.get("forward", {})
        act = [x.get("clamp_active_frac") for x in (rv, fw)]
        if act == [None, None]:
            act_s = "–"
        elif act[0] == act[1]:
            act_s = f"{act[0]:.0%}"
        else:
            act_s = " / ".join("–" if a is None else f"{a:.0%}" for a in act) + " (rev / fwd)"
        tail = (rv or fw).get("teacher_tail_mass_median")
        cells = [f"{mass:.10g} ({tail:.1e})", dtype, student, name]
        cells += [_e(x.get(k)) for x in (rv, fw) for k in ("loss_rel_err", "grad_s_rel_err")]
        out.append("| " + " | ".join([*cells, act_s]) + " |")
    return "\n".join(out)
