"""The cases tests/kernels/vocab_parallel_worker.py runs on every rank of a gloo group: the
vocabulary-parallel ``topk_tail_kl`` and ``sparse_teacher_topk_tail_kl`` against the single-process
ops and the float64 references (outputs and every gradient, each argument varied alone from a base
case), and bad input raising one clear error on every rank.

Every rank builds the same whole-vocabulary inputs from a seed, runs the vocabulary-parallel op
on its shard and the single-process op on the whole, and checks the outputs and the whole
gradient (the shards gathered from every rank) itself. A case returns None (passed), or a
string starting with "skip:"; it raises on a mismatch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import lopd_kernels as lk
from lopd_kernels import vocab_parallel as vp
from tests.kernels.utils import assert_grad_close
from tests.utils import assert_close

IGNORE = -100
F32 = torch.float32


# ------------------------------------------------------------------------------ shard layouts


def layout(world: int, kind: str) -> tuple[list[int], list[int], bool]:
    """``(starts, sizes, explicit)`` by rank. ``even``: Megatron's equal partition (vocab_start
    None); ``uneven``: sizes that differ; ``permuted``: equal sizes in reverse rank order;
    ``small``: some shards narrower than the cases' M (the kernels need M < V_local)."""
    if kind == "even":
        sizes = [12] * world
    elif kind == "uneven":
        sizes = [9, 17, 6, 13][:world]
    elif kind == "small":
        sizes = [3, 20, 4, 15][:world]
    elif kind == "permuted":
        sizes = [11] * world
        starts = [11 * (world - 1 - r) for r in range(world)]
        return starts, sizes, True
    else:
        raise ValueError(kind)
    starts = [sum(sizes[:r]) for r in range(world)]
    return starts, sizes, kind != "even"


def gather_full(shard: torch.Tensor, starts: list[int], dim: int = -1) -> torch.Tensor:
    """The whole tensor from every rank's shard of it along ``dim`` (the vocabulary's)."""
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, shard.detach())
    order = sorted(range(len(parts)), key=lambda r: starts[r])
    return torch.cat([parts[r] for r in order], dim)


def upstream(n: int, count: int, seed: int = 7) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g, dtype=torch.float64) for _ in range(count)]


def backprop(outputs, ups) -> None:
    loss = sum((o.double() * u.reshape(o.shape)).sum() for o, u in zip(outputs, ups))
    if loss.requires_grad:
        loss.backward()


# ------------------------------------------------------------------------------- topk_tail_kl


@dataclass(frozen=True)
class Dense:
    """One ``topk_tail_kl`` case: inputs and options."""

    kw: dict = field(default_factory=lambda: {"top_m": 5})
    n: int = 9
    s_dtype: torch.dtype = F32
    t_dtype: torch.dtype = F32
    shards: str = "even"
    pad: int = 0  # trailing -inf vocabulary entries (Megatron's padding)
    ties: str = ""  # "boundary": equal maxima across every shard edge; "round": integer logits
    ignore_rows: tuple[int, ...] = (2, 5)
    strided: bool = False  # [B, L, V] logits[:, :-1] rows
    ignore_index: int = IGNORE


def dense_inputs(case: Dense, starts: list[int], sizes: list[int]):
    v = sum(sizes)
    g = torch.Generator().manual_seed(11)
    rows = case.n + (case.n // 3 + 1 if case.strided else 0)
    t = torch.randn(rows, v, generator=g, dtype=torch.float64) * 2
    s = t + torch.randn(rows, v, generator=g, dtype=torch.float64)
    if case.ties == "round":
        s, t = s.round(), t.round()
    if case.ties == "boundary":
        # Every shard edge gets equal maxima on both sides (and in both models), so the global
        # top-M is decided by the lower-id rule across the boundary.
        for e in sorted(starts)[1:]:
            t[:, e - 1 : e + 1] = 9.0
            s[:, e - 1 : e + 1] = 8.0
        t[:, 0] = 9.0
    if case.pad:
        s[:, v - case.pad :] = -math.inf
        t[:, v - case.pad :] = -math.inf
    target = torch.randint(0, v - case.pad, (rows,), generator=g)
    for r in case.ignore_rows:
        if r < rows:
            target[r] = case.ignore_index
    s, t = s.to(case.s_dtype), t.to(case.t_dtype)
    if case.strided:
        b = 3
        s, t = s[: b * (rows // b)].view(b, -1, v), t[: b * (rows // b)].view(b, -1, v)
        target = target[: b * (rows // b)].view(b, -1)
        s, t, target = s[:, :-1], t[:, :-1], target[:, :-1]
    return s, t, target


def _run_dense(fn, s, t, target, ups, **kw):
    s = s.detach().clone().requires_grad_(True)
    t = t.detach().clone().requires_grad_(True)
    out = fn(s, t, target, **kw)
    backprop(out[:4], ups)
    return out, s.grad, t.grad


def check_dense(case: Dense, rank: int, world: int) -> None:
    starts, sizes, explicit = layout(world, case.shards)
    s, t, target = dense_inputs(case, starts, sizes)
    lo, hi = starts[rank], starts[rank] + sizes[rank]
    ups = upstream(target.numel(), 4)
    kw = {**case.kw, "ignore_index": case.ignore_index}
    out, gs, gt = _run_dense(
        vp.topk_tail_kl, s[..., lo:hi], t[..., lo:hi], target, ups,
        vocab_start=lo if explicit else None, **kw,
    )  # fmt: skip
    full_gs, full_gt = gather_full(gs, starts), gather_full(gt, starts)
    assert gs.dtype == s.dtype and gt.dtype == t.dtype
    ref_kw = {k: v for k, v in kw.items() if k != "backend"}
    f64 = case.s_dtype == torch.float64
    single = (_run_dense(lk.topk_tail_kl, s, t, target, ups, **kw), "single-process")
    exact = (
        _run_dense(lk.topk_tail_kl_reference, s.double(), t.double(), target, ups, **ref_kw),
        "float64 reference",
    )
    for (ref, rgs, rgt), what in (single, exact):
        tol_dtype = torch.float64 if f64 else F32
        for name in ("kl", "privilege", "student_logprob", "teacher_logprob", "teacher_topk_mass"):
            assert_close(getattr(out, name), getattr(ref, name), tol_dtype, f"{name} vs {what}")
        assert torch.equal(out.topk_ids, ref.topk_ids), f"topk_ids vs {what}"
        assert torch.equal(out.support_size, ref.support_size), f"support_size vs {what}"
        assert_grad_close(full_gs, rgs, s.dtype, f"student gradient vs {what}")
        assert_grad_close(full_gt, rgt, t.dtype, f"teacher gradient vs {what}")


BF16 = torch.bfloat16
DENSE = {
    "base": Dense(),
    "bf16": Dense(s_dtype=BF16, t_dtype=BF16),
    "bf16_student_fp32_teacher": Dense(s_dtype=BF16),
    "support_student": Dense(kw={"top_m": 5, "support": "student"}),
    "support_union": Dense(kw={"top_m": 5, "support": "union"}),
    "forward": Dense(kw={"top_m": 5, "divergence": "forward"}),
    "jsd": Dense(kw={"top_m": 5, "divergence": "jsd", "beta": 0.3}),
    "union_jsd_bf16": Dense(kw={"top_m": 4, "support": "union", "divergence": "jsd"}, s_dtype=BF16),
    "student_forward": Dense(kw={"top_m": 3, "support": "student", "divergence": "forward"}),
    "full_vocab_reverse": Dense(kw={"top_m": None}),
    "full_vocab_forward": Dense(kw={"top_m": None, "divergence": "forward"}),
    "full_vocab_jsd": Dense(kw={"top_m": None, "divergence": "jsd", "beta": 0.7}),
    "top_m_at_least_v": Dense(kw={"top_m": 1000}),
    "top_m_1": Dense(kw={"top_m": 1}),
    "temperature": Dense(kw={"top_m": 5, "temperature": 0.7}),
    "uneven_shards": Dense(shards="uneven"),
    "uneven_union": Dense(kw={"top_m": 5, "support": "union"}, shards="uneven"),
    "permuted_shards": Dense(shards="permuted"),
    "shards_narrower_than_m": Dense(kw={"top_m": 8, "support": "union"}, shards="small"),
    "padded_vocab": Dense(pad=5),
    "padded_whole_last_shard": Dense(kw={"top_m": 5, "support": "union"}, pad=14),
    "padded_full_vocab_jsd": Dense(kw={"top_m": None, "divergence": "jsd"}, pad=14),
    "boundary_ties": Dense(kw={"top_m": 3}, ties="boundary"),
    "boundary_ties_union": Dense(kw={"top_m": 3, "support": "union"}, ties="boundary"),
    "boundary_ties_uneven": Dense(kw={"top_m": 4}, ties="boundary", shards="uneven"),
    "rounded_ties": Dense(kw={"top_m": 6, "support": "union"}, ties="round"),
    "all_rows_ignored": Dense(ignore_rows=tuple(range(9))),
    "no_rows": Dense(n=0, ignore_rows=()),
    "strided_3d_rows": Dense(strided=True),
    "ignore_index_is_a_local_id": Dense(ignore_index=0, ignore_rows=(1,)),
    "float64_reference": Dense(s_dtype=torch.float64, t_dtype=torch.float64,
                               kw={"top_m": 5, "backend": "torch", "support": "union"}),
    "torch_backend_fp32": Dense(kw={"top_m": 5, "backend": "torch", "divergence": "jsd"}),
    "triton_backend": Dense(n=4, kw={"top_m": 4, "backend": "triton"}),
    "triton_union_jsd": Dense(n=4, kw={"top_m": 3, "support": "union", "divergence": "jsd",
                                       "backend": "triton"}),
}  # fmt: skip


# ----------------------------------------------------------------- sparse_teacher_topk_tail_kl


@dataclass(frozen=True)
class Sparse:
    """One ``sparse_teacher_topk_tail_kl`` case."""

    kw: dict = field(default_factory=dict)
    m: int = 6
    n: int = 9
    dtype: torch.dtype = F32
    shards: str = "even"
    pad_slots: int = 0  # trailing -inf teacher slots
    sharp: bool = False  # a teacher whose top-M holds all but ~1e-9 of its mass
    ignore_rows: tuple[int, ...] = (1, 4)


def sparse_inputs(case: Sparse, sizes: list[int]):
    v = sum(sizes)
    g = torch.Generator().manual_seed(13)
    t = torch.randn(case.n, v, generator=g, dtype=torch.float64) * 2
    if case.sharp:
        t[:, : case.m] += 30.0
    s = t + torch.randn(case.n, v, generator=g, dtype=torch.float64)
    top = torch.log_softmax(t, -1).topk(min(case.m, v), dim=-1)
    lp, ids = top.values.clone(), top.indices.clone()
    if case.pad_slots:
        lp[:, -case.pad_slots :] = -math.inf
        ids[:, -case.pad_slots :] = 0
    target = torch.randint(0, v, (case.n,), generator=g)
    for r in case.ignore_rows:
        if r < case.n:
            target[r] = IGNORE
    lp_dtype = torch.float64 if case.dtype == torch.float64 else F32
    return s.to(case.dtype), lp.to(lp_dtype), ids, target


def check_sparse(case: Sparse, rank: int, world: int) -> None:
    starts, sizes, explicit = layout(world, case.shards)
    s, lp, ids, target = sparse_inputs(case, sizes)
    lo, hi = starts[rank], starts[rank] + sizes[rank]
    ups = upstream(case.n, 2)

    def run(fn, x, **kw):
        x = x.detach().clone().requires_grad_(True)
        out = fn(x, lp, ids, target, **kw)
        backprop(out[:2], ups)
        return out, x.grad

    out, gs = run(
        vp.sparse_teacher_topk_tail_kl, s[:, lo:hi], vocab_start=lo if explicit else None,
        **case.kw,
    )  # fmt: skip
    full = gather_full(gs, starts)
    ref_kw = {k: v for k, v in case.kw.items() if k != "backend"}
    tol_dtype = torch.float64 if case.dtype == torch.float64 else F32
    single = (run(lk.sparse_teacher_topk_tail_kl, s, **case.kw), "single-process")
    exact = (run(lk.sparse_teacher_topk_tail_kl_reference, s.double(), **ref_kw), "reference")
    for (ref, rgs), what in (single, exact):
        for name in ref._fields:
            assert_close(getattr(out, name), getattr(ref, name), tol_dtype, f"{name} vs {what}")
        assert_grad_close(full, rgs, s.dtype, f"student gradient vs {what}")


SPARSE = {
    "sparse_base": Sparse(),
    "sparse_forward": Sparse(kw={"divergence": "forward"}),
    "sparse_temperature": Sparse(kw={"temperature": 1.5}),
    "sparse_padding_slots": Sparse(pad_slots=2),
    "sparse_bf16": Sparse(dtype=BF16),
    "sparse_uneven_shards": Sparse(shards="uneven"),
    "sparse_m_wider_than_shards": Sparse(m=16, shards="small"),
    "sparse_sharp_teacher": Sparse(sharp=True),
    "sparse_all_rows_ignored": Sparse(ignore_rows=tuple(range(9))),
    "sparse_no_rows": Sparse(n=0, ignore_rows=()),
    "sparse_float64_reference": Sparse(dtype=torch.float64, kw={"backend": "torch"}),
    "sparse_torch_backend_fp32": Sparse(kw={"backend": "torch"}),
    "sparse_triton_backend": Sparse(n=4, kw={"backend": "triton"}),
}


# ----------------------------------------------------------------------------------- errors


def expect_error(call: Callable[[], object], error: type, *needles: str) -> None:
    """``call`` raises ``error`` whose one-line message contains every needle."""
    try:
        call()
    except error as err:
        text = str(err)
        assert "\n" not in text, f"a multi-line message: {text!r}"
        for needle in needles:
            assert needle in text, f"{needle!r} not in {text!r}"
        return
    raise AssertionError(f"no {error.__name__} raised")


def _dense_call(rank: int, world: int, **changes):
    """A base ``topk_tail_kl`` call on an even layout with per-rank ``changes`` applied."""
    starts, sizes, _ = layout(world, "even")
    s, t, target = dense_inputs(Dense(), starts, sizes)
    lo, hi = starts[rank], starts[rank] + sizes[rank]
    args = {"student_logits": s[:, lo:hi], "teacher_logits": t[:, lo:hi], "target_ids": target}
    kw = {"top_m": 5}
    for key, value in changes.items():
        (args if key in args else kw)[key] = value
    return lambda: vp.topk_tail_kl(**args, **kw)


def error_cases(world: int) -> dict[str, Callable[[int, int], None]]:
    last = world - 1

    def overlapping(rank, world):
        expect_error(_dense_call(rank, world, vocab_start=0), ValueError, "do not tile")

    def start_on_one_rank(rank, world):
        call = _dense_call(rank, world, vocab_start=0 if rank == 0 else None)
        expect_error(call, ValueError, "vocab_start is given on ranks [0]")

    def uneven_without_start(rank, world):
        starts, sizes, _ = layout(world, "uneven")
        s, t, target = dense_inputs(Dense(), starts, sizes)
        lo, hi = starts[rank], starts[rank] + sizes[rank]
        call = lambda: vp.topk_tail_kl(s[:, lo:hi], t[:, lo:hi], target, top_m=5)
        expect_error(call, ValueError, "do not tile", "rank * V_local")

    def rows_differ(rank, world):
        starts, sizes, _ = layout(world, "even")
        s, t, target = dense_inputs(Dense(), starts, sizes)
        n = 9 - (rank == last)
        lo, hi = starts[rank], starts[rank] + sizes[rank]
        call = lambda: vp.topk_tail_kl(s[:n, lo:hi], t[:n, lo:hi], target[:n])
        expect_error(call, ValueError, "same rows", f"{[9] * last + [8]}")

    def bad_dtype_on_one_rank(rank, world):
        starts, sizes, _ = layout(world, "even")
        s, t, target = dense_inputs(Dense(), starts, sizes)
        lo, hi = starts[rank], starts[rank] + sizes[rank]
        s = s[:, lo:hi].long() if rank == last else s[:, lo:hi]
        call = lambda: vp.topk_tail_kl(s, t[:, lo:hi], target)
        expect_error(call, TypeError, f"rank {last}", "student_logits must be a floating")

    def option_differs(rank, world):
        call = _dense_call(rank, world, top_m=4 if rank == last else 5)
        expect_error(call, ValueError, "options must be the same on every rank", f"[{last}]")

    def targets_differ(rank, world):
        starts, sizes, _ = layout(world, "even")
        _, _, target = dense_inputs(Dense(), starts, sizes)
        if rank == 0:
            target = target.flip(0)
        call = _dense_call(rank, world, target_ids=target)
        expect_error(call, ValueError, "target_ids must be the same on every rank")

    def target_outside_vocab(rank, world):
        starts, sizes, _ = layout(world, "even")
        _, _, target = dense_inputs(Dense(), starts, sizes)
        target = target.clone()
        target[3] = sum(sizes)
        expect_error(_dense_call(rank, world, target_ids=target), ValueError, "target_ids[3]")

    def row_without_mass(rank, world):
        starts, sizes, _ = layout(world, "even")
        s, t, target = dense_inputs(Dense(), starts, sizes)
        s = s.clone()
        s[4] = -math.inf
        lo, hi = starts[rank], starts[rank] + sizes[rank]
        call = lambda: vp.topk_tail_kl(s[:, lo:hi], t[:, lo:hi], target)
        expect_error(call, ValueError, "row 4", "student_logits is all -inf")

    def not_a_member(rank, world):
        pair = dist.new_group([0, 1])  # every rank takes part in creating it
        if rank >= 2:  # the members would wait for it in their collectives (docs/kernels.md)
            expect_error(_dense_call(rank, world, group=pair), ValueError, "not a member")

    def sparse_ids_differ(rank, world):
        starts, sizes, _ = layout(world, "even")
        s, lp, ids, target = sparse_inputs(Sparse(), sizes)
        if rank == last:
            ids = ids.flip(1)
        lo, hi = starts[rank], starts[rank] + sizes[rank]
        call = lambda: vp.sparse_teacher_topk_tail_kl(s[:, lo:hi], lp, ids, target)
        expect_error(call, ValueError, "teacher_topk_ids must be the same on every rank")

    def sparse_id_outside_vocab(rank, world):
        starts, sizes, _ = layout(world, "even")
        s, lp, ids, target = sparse_inputs(Sparse(), sizes)
        ids = ids.clone()
        ids[0, 0] = sum(sizes) + 3
        lo, hi = starts[rank], starts[rank] + sizes[rank]
        call = lambda: vp.sparse_teacher_topk_tail_kl(s[:, lo:hi], lp, ids, target)
        expect_error(call, ValueError, "teacher_topk_ids")

    def fused_weights_differ(rank, world):
        starts, sizes, _ = layout(world, "even")
        g = torch.Generator().manual_seed(1)
        h, w = torch.randn(6, 4, generator=g), torch.randn(sum(sizes), 4, generator=g)
        target = torch.randint(0, sum(sizes), (6,), generator=g)
        lo, hi = starts[rank], starts[rank] + sizes[rank]
        kl_weight = torch.full((6,), 1.0 + (rank == last))
        call = lambda: vp.fused_linear_topk_tail_kl_loss(
            h, w[lo:hi], h, w[lo:hi], target, kl_weight=kl_weight, top_m=3
        )
        expect_error(call, ValueError, "weights must be the same on every rank", f"[{last}]")

    def logprob_bad_head_on_one_rank(rank, world):
        starts, sizes, _ = layout(world, "even")
        g = torch.Generator().manual_seed(1)
        h, w = torch.randn(6, 4, generator=g), torch.randn(sum(sizes), 4, generator=g)
        target = torch.randint(0, sum(sizes), (6,), generator=g)
        lo, hi = starts[rank], starts[rank] + sizes[rank]
        shard = w[lo:hi, :3] if rank == last else w[lo:hi]  # a head of the wrong hidden size
        call = lambda: vp.fused_linear_logprob(h, shard, target)
        expect_error(call, ValueError, f"rank {last}")

    cases = {
        "error_fused_weights_differ": fused_weights_differ,
        "error_logprob_bad_head_on_one_rank": logprob_bad_head_on_one_rank,
        "error_shards_overlap": overlapping,
        "error_vocab_start_on_one_rank": start_on_one_rank,
        "error_uneven_shards_without_vocab_start": uneven_without_start,
        "error_rows_differ": rows_differ,
        "error_bad_dtype_on_one_rank": bad_dtype_on_one_rank,
        "error_option_differs": option_differs,
        "error_targets_differ": targets_differ,
        "error_target_outside_vocab": target_outside_vocab,
        "error_row_without_mass": row_without_mass,
        "error_sparse_ids_differ": sparse_ids_differ,
        "error_sparse_id_outside_vocab": sparse_id_outside_vocab,
    }
    if world >= 3:
        cases["error_not_a_member_of_group"] = not_a_member
    return cases


def cases_for(world: int) -> list[tuple[str, Callable[[int, int], str | None]]]:
    """Every case for a group of ``world`` ranks, in the order every rank runs them."""
    # The fused ops' cases (a module of their own) build on this module's helpers.
    from tests.kernels.vocab_parallel_fused_cases import fused_cases

    out: list[tuple[str, Callable]] = []
    for name, case in DENSE.items():
        out.append((name, lambda r, w, c=case: check_dense(c, r, w)))
    for name, case in SPARSE.items():
        out.append((name, lambda r, w, c=case: check_sparse(c, r, w)))
    out.extend(fused_cases())
    out.extend(error_cases(world).items())
    return out


def case_names(world: int) -> list[str]:
    return [name for name, _ in cases_for(world)]
