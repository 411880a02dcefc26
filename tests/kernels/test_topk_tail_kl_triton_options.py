"""The Triton ``topk_tail_kl`` launchers with ``support="student" | "union"`` and
``divergence="jsd"``, path by path, against the float64 PyTorch twins of the ops
(``lopd_kernels.bucket_math.rows_fwd_torch`` / ``rows_bwd_torch``: the same inputs and outputs,
``-1`` padding and ``-inf`` slots included).

The public API over every support x divergence x dtype is
tests/kernels/test_topk_tail_kl_options.py; here each way a kernel updates its running top-M is
driven on purpose (sequential inserts with separate and with joined reductions, the
separate-reductions kernel's bitonic merge), with vocabulary orders that make the union's two sets
evict each other's members (an evicted entry joins the tails only once neither set holds it), and
the union's edge cases: sets that coincide, a union covering the whole vocabulary (empty tail).
Small blocks so that a few hundred entries span several of them (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import math

import pytest
import torch

from lopd_kernels.bucket_math import op_divergence, rows_bwd_torch, rows_fwd_torch
from tests.utils import TRITON_DEVICE, assert_close, requires_triton

triton = pytest.importorskip("triton", reason="the triton backend needs the triton package")

from lopd_kernels.triton.topk_tail_kl import (  # noqa: E402
    topk_tail_kl_bwd_triton,
    topk_tail_kl_fwd_triton,
)

IGNORE = -100
DEVICE = TRITON_DEVICE

pytestmark = [
    requires_triton,
    # The interpreter evaluates masked-off lanes too (-inf - -inf there); numpy warns, the
    # kernels discard those lanes.
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]


def check_options(s, t, target, m, temperature, divergence, beta, support, block_v, **launch):
    """Forward and backward of the launchers against the float64 twins (ids exactly, -inf
    pattern of ``bucket_logp`` exactly, the rest at float32 tolerance), upstream gradients
    random on every output."""
    grads = launch.pop("grads", (True, True))
    args = (m, temperature, divergence, beta)
    out = topk_tail_kl_fwd_triton(
        s, t, target, *args, support, IGNORE, block_v=block_v, num_warps=4, **launch
    )
    # The twins take the divergence as the API hands it to the ops ("jsd" at 0 / 1 mapped to a
    # KL); the launchers map it themselves.
    ref_args = (m, temperature, *op_divergence(divergence, beta))
    ref = rows_fwd_torch(s.double(), t.double(), target, *ref_args, support, IGNORE)
    f32 = torch.float32
    k = ref[3].shape[1]
    assert out[3].shape == (s.shape[0], k) and out[5].shape == (s.shape[0], 2, k + 1)
    for name, got, want in zip(("kl", "slp", "tlp"), out[:3], ref[:3]):
        assert_close(got, want, f32, name)
    assert torch.equal(out[3], ref[3]), "topk_ids"
    assert_close(out[4], ref[4], f32, "lse")
    finite = torch.isfinite(ref[5])
    assert torch.equal(torch.isfinite(out[5]), finite), "bucket_logp: -inf pattern"
    assert_close(out[5][finite], ref[5][finite], f32, "bucket_logp")

    gen = torch.Generator().manual_seed(8)
    up = [torch.randn(s.shape[0], generator=gen).to(s.device) for _ in range(3)]
    bwd_args = (target, out[3], out[0], out[4], out[5], temperature, divergence, beta, IGNORE)
    gs, gt = topk_tail_kl_bwd_triton(
        *up, s, t, *bwd_args, *grads, block_v=block_v, num_warps=4
    )  # fmt: skip
    r_args = (target, ref[3], ref[0], ref[4], ref[5], temperature, *ref_args[2:], IGNORE)
    r_gs, r_gt = rows_bwd_torch(*up, s.double(), t.double(), *r_args, *grads)
    for name, need, got, want, x in (("grad_student", grads[0], gs, r_gs, s),
                                     ("grad_teacher", grads[1], gt, r_gt, t)):  # fmt: skip
        if need:
            assert got.dtype == x.dtype and got.shape == x.shape, name
            assert_close(got, want, x.dtype, name)
        else:
            assert got.shape == (0,), name
    return out


def rows(order: str, n: int, v: int, seed: int):
    """Student and teacher logits whose vocabulary order drives the running sets: ``random``;
    ``crossed`` (the teacher rising over the ids, the student falling: every block evicts from
    the teacher's set what the student's set holds, and the reverse); ``shared`` (row 0: the
    student equals the teacher, the two sets coincide; row 1: the student is the teacher
    shifted by a few ids)."""
    gen = torch.Generator().manual_seed(seed)
    s = torch.randn(n, v, generator=gen) * 2
    t = torch.randn(n, v, generator=gen) * 2
    if order == "crossed":
        t = t.sort(dim=-1).values
        s = t.flip(-1) + 0.5 * torch.randn(n, v, generator=gen)
    elif order == "shared":
        s[0] = t[0]
        s[1] = t[1].roll(3) + 0.1 * torch.randn(v, generator=gen)
    return s, t


# (kernel, bulk_min): separate reductions by sequential inserts, by bitonic merges only, joined
# reductions.
PATHS = {
    "separate-insert": ("separate_reductions", -1),
    "separate-merge": ("separate_reductions", 0),
    "joined": ("joined_reductions", -1),
}


# Every path with each support's own update code (the union's evictions, coinciding sets, the
# student's swapped rows); the divergence's finalization is the paths' shared code, so the union
# with random rows (forward KL) runs on one path: the interpreter costs seconds a case.
UPDATE_CASES = [
    (path, *case)
    for path in PATHS
    for case in (("crossed", "union", "jsd", 0.5), ("shared", "union", "reverse", 1.0),
                 ("crossed", "student", "jsd", 0.25))
] + [("separate-insert", "random", "union", "forward", 0.0)]  # fmt: skip


@pytest.mark.parametrize(("path", "order", "support", "divergence", "beta"), UPDATE_CASES)
def test_update_paths(path, order, support, divergence, beta):
    kernel, bulk_min = PATHS[path]
    s, t = rows(order, 3, 131, seed=31)
    target = torch.tensor([7, 130, IGNORE])
    check_options(
        s.to(DEVICE), t.to(DEVICE), target.to(DEVICE), 10, 0.8, divergence, beta, support, 32,
        kernel=kernel, bulk_min=bulk_min,
    )  # fmt: skip


def test_union_large_m_and_whole_vocabulary():
    """M > 64 takes the separate-reductions kernel's merge by default; with 2M >= V the union
    may cover every id (row 0: its tail then has no mass, -inf on both sides) or be the teacher's
    top-M alone (row 1: M slots of padding)."""
    m = 66
    s, t = rows("crossed", 2, 129, seed=5)
    s[0] = t[0].flip(-1)  # the two top-66 sets overlap in 3 ids: together all 129
    s[1] = t[1]
    target = torch.tensor([3, 120])
    out = check_options(
        s.to(DEVICE), t.to(DEVICE), target.to(DEVICE), m, 1.1, "jsd", 0.9, "union", 64
    )
    size = (out[3] >= 0).sum(-1)
    assert size.tolist() == [129, m]
    assert torch.isinf(out[5][0, :, -1]).all(), "row 0: the union covers V, an empty tail"


@pytest.mark.parametrize("divergence, beta", [("jsd", 0.5), ("jsd", 0.0), ("jsd", 1.0)])
def test_full_vocabulary_jsd(divergence, beta):
    """top_m = 0: the JSD's two forward passes and the backward's extra pass (K_P, K_Q); beta 0
    and 1 run the KLs' kernels. Masked entries (-inf on both sides, and on one side only)."""
    s, t = rows("random", 3, 150, seed=2)
    s[:, 140:] = -math.inf
    t[:, 145:] = -math.inf
    s[1, :10] = -math.inf  # the student gives some teacher mass no mass: finite for the JSD
    target = torch.tensor([4, 20, IGNORE])
    if beta in (0.0, 1.0):
        t[:, 140:145] = -math.inf  # the KLs would be infinite there
        s[1, :10] = 0.0
    check_options(
        s.to(DEVICE), t.to(DEVICE), target.to(DEVICE), 0, 0.7, divergence, beta, "union", 32
    )


@pytest.mark.parametrize("grads", [(True, False), (False, True)], ids=["student", "teacher"])
def test_one_side_gradient_with_padding(grads):
    """The chunked fused path asks one side at a time (the other side's logits unread): the
    union's -1 slots are skipped, the JSD's K_P / K_Q come from the saved buckets."""
    s, t = rows("shared", 2, 97, seed=3)
    target = torch.tensor([0, 96])
    check_options(
        s.to(DEVICE), t.to(DEVICE), target.to(DEVICE), 8, 1.3, "jsd", 0.3, "union", 16,
        grads=grads,
    )  # fmt: skip


def test_dtypes_and_strided_rows():
    """bf16 student and fp16 teacher, rows of wider buffers read in place, -inf student
    entries among the teacher's top ids (the JSD stays finite)."""
    gen = torch.Generator().manual_seed(4)
    n, v = 3, 131
    s_buf = (torch.randn(n, v + 13, generator=gen) * 3).to(torch.bfloat16)
    t_buf = (torch.randn(n, v + 5, generator=gen) * 3).to(torch.float16)
    s, t = s_buf[:, 7 : 7 + v], t_buf[:, :v]
    s[0, t[0].float().topk(3).indices] = -math.inf
    target = torch.tensor([1, IGNORE, 130])
    for support in ("student", "union"):
        check_options(
            s.to(DEVICE), t.to(DEVICE), target.to(DEVICE), 9, 0.9, "jsd", 0.6, support, 32
        )
