"""One error type per kind of bad input, on every op and backend, and the all ``-inf`` row.

Backends: the float64 reference (``torch``), the C++ kernels (``cpu``), Triton (under the
interpreter on CPU at these small shapes) and, for ``topk_tail_kl``, the CUDA kernels run by the
SIMT emulator. A target outside ``[0, V)`` is a ``ValueError`` everywhere (the C++ kernels raise
it with ``TORCH_CHECK_VALUE``); a row whose student or teacher logits are all ``-inf`` (no
probability mass: no KL, no log-prob) is a ``ValueError`` naming the row and the argument.
"""

from __future__ import annotations

import pytest
import torch

import lopd_kernels as lk
from lopd_kernels._backend import BackendUnavailableError
from tests.kernels import simt_emu

N, V, D, M = 5, 64, 16, 4
BACKENDS = ["torch", "cpu", "triton"]


def _skip_unavailable(fn):
    try:
        return fn()
    except BackendUnavailableError as err:
        pytest.skip(str(err))


def _logits(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, V, generator=g), torch.randn(N, V, generator=g) * 2


def _call(op: str, backend: str, target: torch.Tensor, s=None, t=None):
    """One op on small inputs with ``target`` (other arguments valid)."""
    s0, t0 = _logits()
    s = s0 if s is None else s
    t = t0 if t is None else t
    if op == "topk_tail_kl":
        return lk.topk_tail_kl(s, t, target, top_m=M, backend=backend)
    if op == "topk_tail_kl (cuda, emulated)":
        return simt_emu.topk_tail_kl_emulated(s, t, target, top_m=M)
    if op == "TopKTailKL":
        return lk.TopKTailKL(top_m=M, backend=backend)(s, t, target)
    if op == "sparse_teacher_topk_tail_kl":
        lp, ids = t.log_softmax(-1).topk(M, dim=-1)
        return lk.sparse_teacher_topk_tail_kl(s, lp, ids, target, backend=backend)
    g = torch.Generator().manual_seed(1)
    h_s, h_t = torch.randn(N, D, generator=g), torch.randn(N, D, generator=g)
    w_s, w_t = torch.randn(V, D, generator=g), torch.randn(V, D, generator=g)
    return lk.fused_linear_topk_tail_kl(h_s, w_s, h_t, w_t, target, top_m=M, backend=backend)


OPS = ["topk_tail_kl", "TopKTailKL", "sparse_teacher_topk_tail_kl", "fused_linear_topk_tail_kl"]
CASES = [(op, b) for op in OPS for b in BACKENDS] + [("topk_tail_kl (cuda, emulated)", "cuda")]


def _needs(op: str) -> None:
    if op.endswith("(cuda, emulated)") and simt_emu.unavailable_reason():
        pytest.skip(simt_emu.unavailable_reason())


@pytest.mark.parametrize("op, backend", CASES)
@pytest.mark.parametrize("bad", [V, V + 1000, -1, -101])
def test_a_target_out_of_range_is_a_value_error_everywhere(op, backend, bad):
    _needs(op)
    target = torch.tensor([1, 2, bad, 3, -100])
    with pytest.raises(ValueError, match=rf"target_ids.*{bad}") as err:
        _skip_unavailable(lambda: _call(op, backend, target))
    assert not isinstance(err.value, BackendUnavailableError)


@pytest.mark.parametrize("op, backend", CASES)
def test_one_error_type_per_kind_of_bad_target(op, backend):
    _needs(op)
    with pytest.raises(TypeError, match="target_ids"):  # a dtype
        _skip_unavailable(lambda: _call(op, backend, torch.ones(N)))
    with pytest.raises(ValueError, match="target_ids"):  # a shape
        _skip_unavailable(lambda: _call(op, backend, torch.ones(N + 1, dtype=torch.long)))


ROW_CASES = [("topk_tail_kl", b) for b in BACKENDS] + [
    ("topk_tail_kl (cuda, emulated)", "cuda"),
    ("TopKTailKL", "cpu"),
]


@pytest.mark.parametrize("op, backend", ROW_CASES)
@pytest.mark.parametrize("side", ["student_logits", "teacher_logits"])
def test_an_all_minus_inf_row_is_a_value_error_naming_it(op, backend, side):
    _needs(op)
    s, t = _logits()
    (s if side == "student_logits" else t)[3] = -torch.inf
    target = torch.tensor([1, 2, 3, 4, 5])
    message = rf"^row 3 \(flattened\) of {side} is all -inf \(no probability mass\)"
    with pytest.raises(ValueError, match=message):
        _skip_unavailable(lambda: _call(op, backend, target, s, t))
    # Ignored, the row is fine, and every backend gives the same outputs for the others.
    target[3] = -100
    out = _skip_unavailable(lambda: _call(op, backend, target, s, t))
    ref = lk.topk_tail_kl(s, t, target, top_m=M, backend="torch")
    if op == "TopKTailKL":
        torch.testing.assert_close(out, lk.TopKTailKL(top_m=M, backend="torch")(s, t, target))
        return
    assert out.kl[3] == 0 and out.student_logprob[3] == 0 and out.teacher_logprob[3] == 0
    torch.testing.assert_close(out.kl, ref.kl.float(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_all_minus_inf_student_row_against_a_sparse_teacher(backend):
    s, t = _logits()
    s[0] = -torch.inf
    lp, ids = t.log_softmax(-1).topk(M, dim=-1)
    target = torch.tensor([1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match=r"^row 0 \(flattened\) of student_logits is all -inf"):
        _skip_unavailable(
            lambda: lk.sparse_teacher_topk_tail_kl(s, lp, ids, target, backend=backend)
        )
    target[0] = -100
    out = _skip_unavailable(
        lambda: lk.sparse_teacher_topk_tail_kl(s, lp, ids, target, backend=backend)
    )
    assert out.kl[0] == 0 and torch.isfinite(out.kl).all()


@pytest.mark.parametrize("op", ["topk_tail_kl_cpu_fwd", "sparse_teacher_topk_tail_kl_cpu_fwd"])
def test_the_cpp_kernels_raise_value_error_themselves(op):
    """What ``torch.compile`` and direct ``torch.ops.lopd`` callers meet (no Python check runs)."""
    if not lk.extension_loaded():
        pytest.skip("the compiled extension is not built")
    s, t = _logits()
    target = torch.tensor([1, 2, V + 7, 3, -100])
    with pytest.raises(ValueError, match=rf"target_ids\[2\] = {V + 7} is outside \[0, V = {V}\)"):
        if op == "topk_tail_kl_cpu_fwd":
            torch.ops.lopd.topk_tail_kl_cpu_fwd(
                s, t, target, M, 1.0, "reverse", 1.0, "teacher", -100
            )
        else:
            lp, ids = t.log_softmax(-1).topk(M, dim=-1)
            torch.ops.lopd.sparse_teacher_topk_tail_kl_cpu_fwd(
                s, lp, ids, target, 1.0, True, -100, 1e-6
            )
