"""The fused vocabulary-parallel ops' cases for tests/kernels/vocab_parallel_worker.py:
``fused_linear_topk_tail_kl_loss`` and ``fused_linear_logprob`` on head shards against the
single-process ops and the float64 references (the loss, the per-row outputs and the gradients of
the hidden states, both heads' shards and biases), ``fused_linear_logprob`` against
Megatron-core's own ``vocab_parallel_cross_entropy`` on the same shards, and no full-vocabulary
``[N, V]`` or ``[N, V_local]`` float tensor on any rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import lopd_kernels as lk
from lopd_kernels import vocab_parallel as vp
from tests.kernels.vocab_parallel_cases import gather_full, layout
from tests.utils import TOLERANCES, assert_close

F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
IGNORE = -100


@dataclass(frozen=True)
class Head:
    """A fused case: hidden states, heads, targets and options."""

    kw: dict = field(default_factory=dict)
    n: int = 10
    d: int = 8
    dtype: torch.dtype = F32
    shards: str = "even"
    ignore_rows: tuple[int, ...] = (3,)
    padded: str = ""  # "zero_rows": the last 5 head rows 0; "bias": their bias -inf
    bias: bool = False
    shared_head: bool = False  # one head for student and teacher
    frozen_teacher: bool = False  # the teacher's head and hidden states need no gradient
    reduce: bool = True  # reduce_hidden_grad
    sure_target: bool = False  # one row whose target holds all but ~1e-9 of the mass


def head_inputs(case: Head, sizes: list[int]):
    v = sum(sizes)
    g = torch.Generator().manual_seed(17)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=F64) * scale).to(case.dtype)

    hs, ht = rand(case.n, case.d), rand(case.n, case.d)
    ws, wt = rand(v, case.d, scale=0.6), rand(v, case.d, scale=0.9)
    with_bias = case.bias or case.padded == "bias" or case.sure_target
    bs = rand(v) if with_bias else None
    bt = rand(v) if with_bias else None
    if case.padded == "zero_rows":
        ws[v - 5 :], wt[v - 5 :] = 0, 0
    if case.padded == "bias":
        bs[v - 5 :], bt[v - 5 :] = -torch.inf, -torch.inf
    target = torch.randint(0, v - (5 if case.padded else 0), (case.n,), generator=g)
    if case.sure_target:  # its id then holds all but ~e^-25 of every row's mass
        bs[target[0]] = 25.0
    for r in case.ignore_rows:
        if r < case.n:
            target[r] = IGNORE
    return hs, ws, bs, ht, wt, bt, target


def _close(actual, expected, dtype, what):
    assert_close(actual, expected, F64 if dtype == F64 else F32, what)


def _grad_close(actual, expected, dtype, what):
    """A head's or hidden states' gradient (sums over rows or over the vocabulary), elementwise
    with the dtype's tolerance, as the single-process fused ops' tests compare them."""
    if actual is None or expected is None:  # no gradient: None, or zeros (an empty batch)
        present = actual if expected is None else expected
        assert present is None or not present.any(), f"{what}: one gradient is missing"
        return
    assert actual.dtype == expected.dtype or expected.dtype == F64, f"{what}: dtype"
    assert_close(actual, expected, dtype, what)


def _loss_close(loss, ref, weights, dtype, what):
    """The weighted sum, to the dtype's tolerance of the sum of its terms' magnitudes (signed
    weights make the loss a small difference of larger terms)."""
    terms = sum(
        (torch.as_tensor(w, dtype=F64).abs() * getattr(ref.output, name).double().abs()).sum()
        for w, name in zip(weights, ("kl", "student_logprob", "teacher_logprob"))
    )
    rtol, atol = TOLERANCES[F64 if dtype == F64 else F32]
    err = (loss.double() - ref.loss.double()).abs().item()
    assert err <= atol + rtol * float(terms), f"{what}: {loss.item()} != {ref.loss.item()}"


# --------------------------------------------------------------------- the fused loss op


def check_loss(case: Head, rank: int, world: int) -> None:
    starts, sizes, explicit = layout(world, case.shards)
    hs, ws, bs, ht, wt, bt, target = head_inputs(case, sizes)
    lo, hi = starts[rank], starts[rank] + sizes[rank]
    g = torch.Generator().manual_seed(5)
    w_kl = torch.rand(case.n, generator=g)
    w_t = torch.randn(case.n, generator=g)
    weights = {"kl_weight": w_kl, "student_logprob_weight": 0.3, "teacher_logprob_weight": w_t}

    def run(fn, shard, f64=False, **kw):
        def leaf(x, trainable=True):
            if x is None:
                return None
            x = (x.double() if f64 else x).detach().clone()
            return x.requires_grad_(trainable)

        cut = (lambda x: x[lo:hi]) if shard else (lambda x: x)
        w_s = leaf(cut(ws))
        args = [leaf(hs), w_s, leaf(ht, not case.frozen_teacher)]
        args.append(w_s if case.shared_head else leaf(cut(wt), not case.frozen_teacher))
        biases = {
            "student_bias": leaf(None if bs is None else cut(bs)),
            "teacher_bias": leaf(None if bt is None else cut(bt), not case.frozen_teacher),
        }
        options = {**case.kw, **kw, **({"backend": "torch"} if f64 else {})}  # the oracle
        res = fn(*args, target, **weights, **biases, **options)
        res.loss.backward()
        named = {"student_hidden": args[0], "student_weight": args[1],
                 "teacher_hidden": args[2], "teacher_weight": args[3], **biases}  # fmt: skip
        return res, {k: None if x is None else x.grad for k, x in named.items()}

    res, grads = run(
        vp.fused_linear_topk_tail_kl_loss,
        True,
        chunk_size=4,
        vocab_start=lo if explicit else None,
        reduce_hidden_grad=case.reduce,
    )
    if not case.reduce:  # the partial hidden-state gradients: their sum over the group
        for key in ("student_hidden", "teacher_hidden"):
            if grads[key] is not None:
                dist.all_reduce(grads[key])
    for key in ("student_weight", "teacher_weight", "student_bias", "teacher_bias"):
        if grads[key] is not None and not (case.shared_head and key == "teacher_weight"):
            grads[key] = gather_full(grads[key], starts, dim=0)
    single = (run(lk.fused_linear_topk_tail_kl_loss, False), "single-process")
    exact = (run(lk.fused_linear_topk_tail_kl_loss, False, f64=True), "float64 reference")
    for (ref, ref_grads), what in (single, exact):
        _loss_close(res.loss, ref, list(weights.values()), case.dtype, f"loss vs {what}")
        for name in ("kl", "student_logprob", "teacher_logprob", "privilege", "teacher_topk_mass"):
            _close(getattr(res.output, name), getattr(ref.output, name), case.dtype,
                   f"{name} vs {what}")  # fmt: skip
        assert torch.equal(res.output.topk_ids, ref.output.topk_ids), f"topk_ids vs {what}"
        for key, got in grads.items():
            if case.shared_head and key == "teacher_weight":
                continue  # the same tensor as the student's: its gradient holds both
            _grad_close(got, ref_grads[key], case.dtype, f"{key} gradient vs {what}")


LOSS = {
    "loss_base": Head(kw={"top_m": 5}),
    "loss_bf16": Head(kw={"top_m": 5}, dtype=BF16),
    "loss_union_jsd": Head(kw={"top_m": 4, "support": "union", "divergence": "jsd"}),
    "loss_student_forward": Head(kw={"top_m": 4, "support": "student", "divergence": "forward"}),
    "loss_full_vocab": Head(kw={"top_m": None}),
    "loss_full_vocab_jsd": Head(kw={"top_m": None, "divergence": "jsd", "beta": 0.2}),
    "loss_temperature_bias": Head(kw={"top_m": 5, "temperature": 0.8}, bias=True),
    "loss_uneven_shards": Head(kw={"top_m": 5}, shards="uneven"),
    "loss_shards_narrower_than_m": Head(kw={"top_m": 8}, shards="small"),
    "loss_padded_zero_rows": Head(kw={"top_m": 5}, padded="zero_rows"),
    "loss_padded_bias": Head(kw={"top_m": 5, "support": "union"}, padded="bias"),
    "loss_shared_head": Head(kw={"top_m": 5}, shared_head=True),
    "loss_frozen_teacher": Head(kw={"top_m": 5}, frozen_teacher=True),
    "loss_partial_hidden_grad": Head(kw={"top_m": 5}, reduce=False),
    "loss_all_rows_ignored": Head(kw={"top_m": 5}, ignore_rows=tuple(range(10))),
    "loss_no_rows": Head(kw={"top_m": 5}, n=0, ignore_rows=()),
    "loss_float64": Head(kw={"top_m": 5, "backend": "torch"}, dtype=F64),
    "loss_torch_backend": Head(kw={"top_m": 5, "backend": "torch", "support": "union"}),
    "loss_chunked_backend": Head(kw={"top_m": 5, "backend": "chunked"}),
}


# ------------------------------------------------------------------ fused_linear_logprob


def check_logprob(case: Head, rank: int, world: int) -> None:
    starts, sizes, explicit = layout(world, case.shards)
    h, w, b, *_, target = head_inputs(case, sizes)
    lo, hi = starts[rank], starts[rank] + sizes[rank]
    g = torch.Generator().manual_seed(3)
    u, v = torch.randn(case.n, generator=g, dtype=F64), torch.randn(case.n, generator=g, dtype=F64)
    entropy_only = case.kw.get("entropy_only", False)
    kw = {k: x for k, x in case.kw.items() if k != "entropy_only"}

    def run(fn, shard, f64=False, **extra):
        cut = (lambda x: x[lo:hi]) if shard else (lambda x: x)
        parts = (h, cut(w), None if b is None else cut(b))
        leaves = [
            None if x is None else (x.double() if f64 else x).detach().clone().requires_grad_()
            for x in parts
        ]
        out = fn(leaves[0], leaves[1], target, bias=leaves[2], **{**kw, **extra})
        loss = 0.0 if entropy_only else (out.logprob.double() * u).sum()
        if out.entropy is not None:
            loss = loss + (out.entropy.double() * v).sum()
        loss.backward()
        return out, [None if x is None else x.grad for x in leaves]

    out, grads = run(
        vp.fused_linear_logprob,
        True,
        chunk_size=4,
        vocab_start=lo if explicit else None,
        reduce_hidden_grad=case.reduce,
    )
    if not case.reduce:
        dist.all_reduce(grads[0])
    grads[1] = gather_full(grads[1], starts, dim=0)
    if grads[2] is not None:
        grads[2] = gather_full(grads[2], starts, dim=0)
    single = (run(lk.fused_linear_logprob, False), "single-process")
    exact = (run(lk.fused_linear_logprob, False, f64=True, backend="torch"), "float64 reference")
    # Against the single-process op (the same arithmetic per vocabulary block): float32's
    # tolerance. Against the float64 reference, a bf16 head's: where the CPU has AVX512-BF16 the
    # C++ op runs bf16 GEMMs whose logits are rounded to bf16 (csrc/cpu/fused_linear_logprob.cpp,
    # native_bf16), as the single-process op's own tests allow (test_cpu_bf16_gemms).
    same_math = F64 if case.dtype == F64 else F32
    for (ref, ref_grads), what, values in ((*single, same_math), (*exact, case.dtype)):
        assert_close(out.logprob, ref.logprob, values, f"logprob vs {what}")
        if kw.get("with_entropy"):
            assert_close(out.entropy, ref.entropy, values, f"entropy vs {what}")
        for name, got, want in zip(("hidden", "weight", "bias"), grads, ref_grads):
            _grad_close(got, want, case.dtype, f"{name} gradient vs {what}")


LOGPROB = {
    "logprob_base": Head(),
    "logprob_entropy": Head(kw={"with_entropy": True}),
    "logprob_entropy_only_gradient": Head(kw={"with_entropy": True, "entropy_only": True}),
    "logprob_temperature_bias": Head(kw={"with_entropy": True, "temperature": 0.7}, bias=True),
    "logprob_bf16": Head(kw={"with_entropy": True}, dtype=BF16),
    "logprob_uneven_shards": Head(kw={"with_entropy": True}, shards="uneven"),
    "logprob_padded_bias": Head(kw={"with_entropy": True}, padded="bias"),
    "logprob_padded_zero_rows": Head(padded="zero_rows"),
    "logprob_sure_target": Head(sure_target=True),
    "logprob_partial_hidden_grad": Head(kw={"with_entropy": True}, reduce=False),
    "logprob_all_rows_ignored": Head(ignore_rows=tuple(range(10))),
    "logprob_no_rows": Head(n=0, ignore_rows=()),
    "logprob_float64": Head(kw={"with_entropy": True, "backend": "torch"}, dtype=F64),
    "logprob_chunked_backend": Head(kw={"with_entropy": True, "backend": "chunked"}),
    "logprob_triton_backend": Head(n=4, kw={"with_entropy": True, "backend": "triton"}),
}


# ------------------------------------------------------------------------ megatron-core


def check_megatron(rank: int, world: int) -> str | None:
    """``-vocab_parallel.fused_linear_logprob`` equals Megatron-core's
    ``tensor_parallel.vocab_parallel_cross_entropy`` of the same shard's logits, in value and in
    the gradients of the hidden states (Megatron's partial one all-reduced, as its
    column-parallel layer does) and of the head shard."""
    try:
        from megatron.core import parallel_state, tensor_parallel
    except ImportError:
        return "skip: megatron-core is not installed"
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    starts, sizes, _ = layout(world, "even")
    h, w, _, *_, target = head_inputs(Head(ignore_rows=()), sizes)
    lo, hi = starts[rank], starts[rank] + sizes[rank]
    u = torch.randn(h.shape[0], generator=torch.Generator().manual_seed(2))
    h1, w1 = h.clone().requires_grad_(True), w[lo:hi].clone().requires_grad_(True)
    group = parallel_state.get_tensor_model_parallel_group()
    out = vp.fused_linear_logprob(h1, w1, target, temperature=0.9, group=group)
    (out.logprob * u).sum().backward()
    h2, w2 = h.clone().requires_grad_(True), w[lo:hi].clone().requires_grad_(True)
    logits = (h2 @ w2.T / 0.9)[None]  # [1, N, V_local]: Megatron's [s, b, v] layout
    loss = tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), target[None])
    (-loss[0] * u).sum().backward()
    dist.all_reduce(h2.grad, group=group)
    _close(out.logprob, -loss[0], F32, "logprob vs Megatron-core")
    _grad_close(h1.grad, h2.grad, F32, "hidden gradient vs Megatron-core")
    _grad_close(w1.grad, w2.grad, F32, "head shard gradient vs Megatron-core")
    return None


# ------------------------------------------------------------- no vocabulary-sized tensor


class LargeFloatTensors(TorchDispatchMode):
    """Records every new float tensor an op creates with at least ``limit`` elements (views and
    in-place results of inputs are not new), and every ``fused_linear_logprob`` kernel op
    handed a logit block that large (the C++ op maps its block out of this hook's sight)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.caught: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if "fused_linear_logprob" in name:
            rows, vb = args[-2:] if name.endswith("_fwd.default") else args[-3:-1]
            if rows * vb >= self.limit:
                self.caught.append(f"{func} -> its [{rows}, {vb}] logit block")
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}  # fmt: skip
        for t in tree_flatten(out)[0]:
            if (isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() >= self.limit
                    and t.untyped_storage().data_ptr() not in inputs):  # fmt: skip
                self.caught.append(f"{func} -> {tuple(t.shape)} {t.dtype}")
        return out


def check_no_vocab_sized_tensors(rank: int, world: int) -> None:
    """Both fused ops, forward and backward, on 32 rows in chunks of 8: no rank creates a float
    tensor of ``N x V_local`` elements or more (the whole vocabulary's is ``world`` times that);
    the hook catches the obvious ``h @ W.T`` first."""
    sizes = [64] * world  # wide enough that the O(N K world) candidates stay below N V_local
    starts = [64 * r for r in range(world)]
    case = Head(n=32, d=8, ignore_rows=(1,))
    hs, ws, _, ht, wt, _, target = head_inputs(case, sizes)
    lo, hi = starts[rank], starts[rank] + sizes[rank]
    limit = case.n * sizes[rank]
    leaves = [x.clone().requires_grad_(True) for x in (hs, ws[lo:hi], ht, wt[lo:hi])]
    with LargeFloatTensors(limit) as hook:
        (leaves[0] @ leaves[1].T).sum().backward()
    assert hook.caught, "the hook missed h @ W.T"
    with LargeFloatTensors(limit) as hook:
        res = vp.fused_linear_topk_tail_kl_loss(*leaves, target, top_m=4, chunk_size=8)
        res.loss.backward()
        out = vp.fused_linear_logprob(leaves[0], leaves[1], target, with_entropy=True,
                                      chunk_size=8)  # fmt: skip
        (out.logprob.sum() + out.entropy.sum()).backward()
    assert not hook.caught, "\n".join(hook.caught)


def fused_cases() -> list[tuple[str, Callable[[int, int], str | None]]]:
    out: list[tuple[str, Callable]] = []
    for name, case in LOSS.items():
        out.append((name, lambda r, w, c=case: check_loss(c, r, w)))
    for name, case in LOGPROB.items():
        out.append((name, lambda r, w, c=case: check_logprob(c, r, w)))
    out.append(("logprob_equals_megatron_core_cross_entropy", check_megatron))
    out.append(("fused_ops_build_no_vocab_sized_tensor", check_no_vocab_sized_tensors))
    return out
