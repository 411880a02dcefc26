"""GPU benchmark of ``topk_tail_kl``: one variant per process, forward and backward timed apart.

    python benchmarks/gpu_topk_tail_kl.py --variant triton      # N=8192, V=151,936, bf16, M=20

Variants (``--variant``):

* ``triton`` / ``cuda``: ``lk.topk_tail_kl(s, t, a, top_m=M, backend=...)``, gradients into both
  logits through ``sum(kl) + sum(privilege) + sum(student_logprob)``, once per forward kernel of
  the backend's slot in ``lopd_kernels/kernel_variants.py`` (``triton``,
  ``triton[joined_reductions]``; ``cuda``, ``cuda[natural_exp]``): both timed in one process, so
  that the slower one can be deleted;
* ``torch_reference``: ``lk.topk_tail_kl_reference`` (eager PyTorch, plain autograd);
* ``trl_eager``: TRL's ``compute_topk_self_distillation_loss`` + ``log_softmax(x).gather`` on both
  sides (the eager loss a TRL user runs), same backward;
* ``torch_topk``: ``torch.topk(t, M)`` alone, forward only: the floor for "find the top-M".

Options: after the default kernels of ``triton`` / ``cuda`` with the teacher's top-M and the
reverse KL, the same backend with ``--options`` (default: ``student``, ``union`` and ``jsd``:
``support="student"``, ``support="union"``, ``divergence="jsd", beta=0.5``), each a record of
its own (``shapes["support"]``, ``shapes["divergence"]``, ``shapes["beta"]``), checked against
the float64 reference like the teacher's, with ``time_vs_teacher``: its median over the
teacher's reverse KL's in the same process.

Two teachers, each a record of its own (``shapes["teacher"]``): ``iid`` (i.i.d. normal logits,
the top-M scattered over the vocabulary: the most work for a running top-M) and ``zipf`` (logits
falling as ``-1.5 ln(1 + id)`` plus unit noise, as in frequency-ordered BPE vocabularies: the
top-M settles in the first blocks; its mean teacher top-M mass is recorded). The student is the
teacher plus noise; targets are sampled from the student (on-policy).

Per figure: the median of ``--reps`` (CUDA events) for ``fwd``, ``bwd`` and ``fwd+bwd``
(``shapes["pass"]``), the bytes the op must move over that time (forward reads s and t, backward
reads both and writes both gradients: 2 and 4 x N x V x 2 bytes) as GB/s and as a fraction of
the device copy bandwidth measured in the same process, and ``peak_mem_bytes``, the allocator's
peak beyond the inputs and the two [N, V] gradients. The LOPD backends are also checked against
the float64 reference on the first rows (``max_err_*``, ``check_ok``): a figure of a wrong kernel
is worthless.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as gc

# Each compiled backend's forward kernel slot (lopd_kernels/kernel_variants.py; for Triton the
# launcher's FWD_SLOT, named here so that the script imports no Triton before it needs to).
FWD_SLOTS = {"triton": "topk_tail_kl.triton_forward", "cuda": "topk_tail_kl.cuda_forward"}

VARIANTS = ("triton", "cuda", "torch_reference", "trl_eager", "torch_topk")
TEACHERS = ("iid", "zipf")
ZIPF_SLOPE = 1.5
CHECK_ROWS = 32
SIZES = {"full": (8192, 151_936, 20), "tiny": (4, 160, 4)}
# --options: (support, divergence, beta) of each case timed after the teacher's reverse KL.
OPTIONS = {
    "student": ("student", "reverse", None),
    "union": ("union", "reverse", None),
    "jsd": ("teacher", "jsd", 0.5),
}


def make_inputs(n: int, v: int, teacher: str, device: torch.device, dtype: torch.dtype, seed=0):
    """Student and teacher logits ``[n, v]`` (leaves requiring grad) and sampled targets ``[n]``."""
    g = torch.Generator(device=device).manual_seed(seed)
    t = torch.randn(n, v, generator=g, device=device)
    if teacher == "zipf":
        ids = torch.arange(v, device=device, dtype=torch.float32)
        t.add_(torch.log1p(ids).mul_(-ZIPF_SLOPE))
    else:
        t.mul_(2.0)
    s = t + torch.randn(n, v, generator=g, device=device)
    # On-policy targets: sampled from the student (Gumbel-max).
    gumbel = torch.empty_like(s).exponential_(generator=g).log_().neg_()
    a = (s + gumbel).argmax(dim=-1)
    del gumbel
    s = s.to(dtype).requires_grad_(True)
    t = t.to(dtype).requires_grad_(True)
    return s, t, a


def _lopd_forward(lk, backend: str, s, t, a, m, opts=None):
    return lambda: lk.topk_tail_kl(s, t, a, top_m=m, backend=backend, **(opts or {}))


def _sum_backward(out) -> None:
    (out.kl.sum() + out.privilege.sum() + out.student_logprob.sum()).backward()


def _trl_forward(s, t, a, m):
    from trl.experimental.sdpo.loss_utils import compute_topk_self_distillation_loss

    def forward():
        # Support = the first argument's top-k (the teacher's); alpha = 0 is KL(student || teacher)
        # as in benchmarks/bench_topk_tail_kl.py.
        kl = compute_topk_self_distillation_loss(
            t, s, distillation_topk=m, distillation_alpha=0.0, distillation_add_tail=True
        )
        slp = torch.log_softmax(s.float(), -1).gather(1, a[:, None]).squeeze(1)
        tlp = torch.log_softmax(t.float(), -1).gather(1, a[:, None]).squeeze(1)
        return kl, slp, tlp

    def backward(out) -> None:
        kl, slp, tlp = out
        (kl.sum() + (tlp - slp.detach()).sum() + slp.sum()).backward()

    return forward, backward


def check_rows(lk, out, s, t, a, m: int, opts=None) -> dict[str, float | bool]:
    """Outputs and gradients of the first rows against the float64 reference on those rows
    (``opts``: the call's support / divergence / beta)."""
    r = min(CHECK_ROWS, a.shape[0])
    s64 = s.detach()[:r].double().requires_grad_(True)
    t64 = t.detach()[:r].double().requires_grad_(True)
    ref = lk.topk_tail_kl_reference(s64, t64, a[:r], top_m=m, **(opts or {}))
    _sum_backward(ref)
    err = {
        f"max_err_{name}": float((getattr(out, name)[:r].double() - getattr(ref, name)).abs().max())
        for name in ("kl", "student_logprob", "teacher_logprob")
    }
    err["ids_match"] = bool(torch.equal(out.topk_ids[:r], ref.topk_ids))
    for side, x, x64 in (("student", s, s64), ("teacher", t, t64)):
        scale = x64.grad.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
        err[f"max_rel_err_grad_{side}"] = float(
            ((x.grad[:r].double() - x64.grad) / scale).abs().max()
        )
    ok_out = all(err[f"max_err_{k}"] <= 1e-3 for k in ("kl", "student_logprob", "teacher_logprob"))
    ok_grad = all(err[f"max_rel_err_grad_{k}"] <= 3e-2 for k in ("student", "teacher"))
    err["check_ok"] = bool(ok_out and ok_grad and err["ids_match"])
    return err


def bench_teacher(args, lk, rec, device, teacher: str) -> None:
    n, v, m = SIZES[args.size]
    dtype = torch.bfloat16
    s, t, a = make_inputs(n, v, teacher, device, dtype)
    elt = s.element_size()
    copy = gc.copy_gbps(s.detach())
    base_shapes = {"N": n, "V": v, "M": m, "dtype": "bfloat16", "teacher": teacher}
    rec.add("device", "copy", {"bytes": 2 * s.numel() * elt}, 2 * s.numel() * elt / copy / 1e9,
            copy_gbps=copy)  # fmt: skip

    def clear() -> None:
        s.grad = t.grad = None

    extra: dict = {}
    if args.variant == "torch_topk":
        with torch.no_grad():
            r = gc.time_fwd_bwd(
                lambda: torch.topk(t, m), None, device, args.reps, clear, warmup=args.warmup
            )
        rec.add("topk_tail_kl", "torch_topk", {**base_shapes, "pass": "fwd"}, r["fwd"],
                r["peak_bytes"], **gc.bandwidth_fields(n * v * elt, r["fwd"], copy))  # fmt: skip
        return
    if args.variant in FWD_SLOTS:
        from lopd_kernels.kernel_variants import SLOTS, selecting

        # CPU dry run: the C++ kernel stands in for CUDA (Triton runs under its interpreter).
        backend = "cpu" if args.variant == "cuda" and device.type != "cuda" else args.variant
        # Both forward kernels of the backend's slot in this process, so that the slower one can
        # be deleted (one record each: "<backend>" for the slot's default, "<backend>[<kernel>]"
        # for the other).
        name = FWD_SLOTS[args.variant]
        slot = SLOTS[name]
        timed = {}
        for kernel in args.fwd_kernels.split(",") if args.fwd_kernels else slot.choices:
            with selecting(name, kernel):
                label = backend if kernel == slot.default else f"{backend}[{kernel}]"
                timed[kernel] = _time_lopd(args, lk, rec, device, (s, t, a), m, base_shapes,
                                           copy, backend, label, {name: kernel})  # fmt: skip
        _time_options(args, lk, rec, device, (s, t, a), m, base_shapes, copy, backend,
                      timed.get(slot.default))  # fmt: skip
        return
    if args.variant == "torch_reference":
        backend = "torch_reference"
        forward = lambda: lk.topk_tail_kl_reference(s, t, a, top_m=m)
        backward = _sum_backward
    else:
        backend = "trl_eager"
        forward, backward = _trl_forward(s, t, a, m)
    _record(args, rec, device, (s, t), forward, backward, base_shapes, copy, backend, extra)


def _time_options(args, lk, rec, device, inputs, m, base_shapes, copy, backend, teacher_r):
    """The ``--options`` cases on ``backend``'s default kernels, each checked and recorded with
    its options in the shapes and its time over the teacher's reverse KL's (``teacher_r``)."""
    for key in filter(None, args.options.split(",")):
        support, divergence, beta = OPTIONS[key]
        opts = {"support": support, "divergence": divergence, "beta": beta}
        shapes = {**base_shapes, "support": support, "divergence": divergence, "beta": beta}
        _time_lopd(args, lk, rec, device, inputs, m, shapes, copy, backend, backend, None,
                   opts=opts, baseline=teacher_r)  # fmt: skip


def _time_lopd(
    args, lk, rec, device, inputs, m, base_shapes, copy, backend, label, kernels, *, opts=None,
    baseline=None,
):  # fmt: skip
    """Checks one LOPD backend (as the kernel slots now select; ``opts``: support /
    divergence / beta) against the float64 reference on the first rows, then times it and
    records it as ``label``; returns the timings."""
    s, t, a = inputs
    forward, backward = _lopd_forward(lk, backend, s, t, a, m, opts), _sum_backward
    s.grad = t.grad = None
    out = forward()
    backward(out)
    extra = check_rows(lk, out, s, t, a, m, opts)
    extra["teacher_topk_mass"] = float(out.teacher_topk_mass.mean())
    if opts and opts["support"] == "union":
        extra["mean_support_size"] = float(out.support_size.float().mean())
    if kernels:
        extra["kernels"] = kernels
    del out
    return _record(args, rec, device, (s, t), forward, backward, base_shapes, copy, label, extra,
                   baseline)  # fmt: skip


def _record(
    args, rec, device, logits, forward, backward, base_shapes, copy, backend, extra, baseline=None
):  # fmt: skip
    s, t = logits
    n, v = s.shape
    elt = s.element_size()

    def clear() -> None:
        s.grad = t.grad = None

    r = gc.time_fwd_bwd(forward, backward, device, args.reps, clear, warmup=args.warmup)
    grads = 2 * n * v * elt
    peak = None if r["peak_bytes"] is None else max(0, r["peak_bytes"] - grads)
    passes = (("fwd", 2), ("bwd", 4), ("fwd+bwd", 6))
    for name, tensors in passes:
        fields = gc.bandwidth_fields(tensors * n * v * elt, r[name], copy)
        if baseline:
            fields["time_vs_teacher"] = r[name] / baseline[name]
        rec.add("topk_tail_kl", backend, {**base_shapes, "pass": name}, r[name],
                peak if name == "fwd+bwd" else None, **fields, **extra)  # fmt: skip
    if extra and not extra.get("check_ok", True):
        teacher = base_shapes["teacher"]
        raise AssertionError(f"{backend} {teacher}: wrong against the float64 reference: {extra}")
    return r


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", required=True, choices=VARIANTS)
    parser.add_argument("--teachers", default=",".join(TEACHERS), help="comma-separated")
    parser.add_argument(
        "--fwd-kernels",
        help="--variant triton / cuda: the forward kernels to time (slots "
        f"{', '.join(FWD_SLOTS.values())}, lopd_kernels/kernel_variants.py), "
        "comma-separated; default: both",
    )
    parser.add_argument(
        "--options",
        default=",".join(OPTIONS),
        help="--variant triton / cuda: option cases timed after the teacher's reverse KL "
        f"(comma-separated of {', '.join(OPTIONS)}; empty: none)",
    )
    args, device = gc.parse_args(parser, argv, reps=10)
    if device is None:
        return 0
    import lopd_kernels as lk

    rec = gc.Recorder(args.records, device)
    ok = gc.run_each(
        f"topk_tail_kl {args.variant}", args.teachers.split(","),
        lambda teacher: bench_teacher(args, lk, rec, device, teacher), device,
    )  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
