"""Helpers shared by the tests of the fused LM-head ops (``fused_linear_topk_tail_kl`` and its
loss, the chunked paths): hidden states and heads, forward + backward under random upstream
gradients, the check against the float64 reference, and the chunked path's CPU cases."""

from __future__ import annotations

import math

import torch

from lopd_kernels.fused_linear_topk_tail_kl import fused_linear_topk_tail_kl
from tests.utils import assert_close

NAMES = ("student_hidden", "student_weight", "teacher_hidden", "teacher_weight")
OUTS = ("kl", "privilege", "student_logprob", "teacher_logprob")


def make_inputs(n, d, vocab, dtype=torch.float32, *, bias=False, tied=False, seed=0, d_t=None):
    """Hidden states and heads whose logits have std ~2 (well-separated top-M)."""
    g = torch.Generator().manual_seed(seed)
    d_t = d if d_t is None else d_t
    x = {
        "student_hidden": torch.randn(n, d, generator=g),
        "student_weight": torch.randn(vocab, d, generator=g) * (2 / math.sqrt(d)),
        "teacher_hidden": torch.randn(n, d_t, generator=g),
        "teacher_weight": torch.randn(vocab, d_t, generator=g) * (2 / math.sqrt(d_t)),
    }
    if tied:
        x["teacher_weight"] = x["student_weight"]
    if bias:
        x["student_bias"] = torch.randn(vocab, generator=g) * 0.5
        x["teacher_bias"] = torch.randn(vocab, generator=g) * 0.5
    target = torch.randint(0, vocab, (n,), generator=g)
    target[1::4] = -100
    return {k: v.to(dtype) for k, v in x.items()}, target


def to_device(inputs, target, device):
    """``make_inputs``' tensors on ``device``, a tied head still one tensor."""
    moved = {k: v.to(device) for k, v in inputs.items()}
    if inputs["teacher_weight"] is inputs["student_weight"]:
        moved["teacher_weight"] = moved["student_weight"]
    return moved, target.to(device)


def run(inputs, target, backend, *, requires=None, seed=1, upcast=False, **kw):
    """Forward + backward with random upstream gradients on the four float outputs.

    Returns (outputs, {name: grad}) for the inputs that require grad (``requires``: names; default
    all). A tied head is one leaf tensor for both models, like a shared nn.Parameter.
    """
    tied = inputs["teacher_weight"] is inputs["student_weight"]
    leaves = {}
    for k, v in inputs.items():
        if tied and k == "teacher_weight":
            continue
        leaf = (
            (v.double() if upcast else v).clone().requires_grad_(requires is None or k in requires)
        )
        leaves[k] = leaf
    args = dict(leaves)
    if tied:
        args["teacher_weight"] = args["student_weight"]
    out = fused_linear_topk_tail_kl(
        args.pop("student_hidden"),
        args.pop("student_weight"),
        args.pop("teacher_hidden"),
        args.pop("teacher_weight"),
        target,
        backend=backend,
        **args,
        **kw,
    )
    g = torch.Generator().manual_seed(seed)
    ups = [torch.randn(target.shape[0], generator=g, dtype=torch.float64) for _ in OUTS]
    ups = [u.to(target.device) for u in ups]
    loss = sum((getattr(out, name).double() * u).sum() for name, u in zip(OUTS, ups))
    want = [v for v in leaves.values() if v.requires_grad]
    if loss.requires_grad:
        loss.backward()
    grads = {k: v.grad for k, v in leaves.items() if v.requires_grad}
    assert all(w.grad is not None for w in want) or not loss.requires_grad
    return out, grads


def check(inputs, target, backend, dtype, requires=None, **kw):
    ref_out, ref_grads = run(inputs, target, "torch", requires=requires, upcast=True, **kw)
    out, grads = run(inputs, target, backend, requires=requires, **kw)
    for name in OUTS:
        assert getattr(out, name).dtype == torch.float32, name
        assert_close(getattr(out, name), getattr(ref_out, name), dtype, f"{backend} {name}")
    assert torch.equal(out.topk_ids, ref_out.topk_ids), f"{backend} topk_ids"
    assert_close(out.teacher_topk_mass, ref_out.teacher_topk_mass, dtype, f"{backend} mass")
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert grad.dtype == inputs[name].dtype, name
        assert_close(grad, ref_grads[name], dtype, f"{backend} d{name}")
    ignored = target == -100
    assert not out.kl[ignored].any() and not out.topk_ids[ignored].any()
    return out, grads


CASES = [
    # (n, d, V, top_m, temperature, divergence, bias, chunk_size)
    (13, 8, 37, 5, 1.0, "reverse", False, 4),
    (13, 8, 37, 5, 0.7, "forward", True, None),
    (9, 64, 301, 20, 1.3, "reverse", True, 3),
    (9, 64, 301, None, 1.0, "forward", False, 2),
    (6, 1024, 129, 20, 0.8, "reverse", True, 1),
    (6, 8, 11, 16, 1.0, "reverse", False, 5),  # M >= V: no tail bucket
    (6, 8, 11, 16, 2.0, "forward", True, None),
    (7, 64, 53, None, 0.5, "reverse", True, 7),
]


def check_case(case):
    """One CASES row through the chunked CPU path, fp32, against the reference."""
    n, d, vocab, top_m, temp, div, bias, chunk = case
    inputs, target = make_inputs(n, d, vocab, bias=bias)
    check(
        inputs, target, "chunked", torch.float32,
        top_m=top_m, temperature=temp, divergence=div, chunk_size=chunk,
    )  # fmt: skip
