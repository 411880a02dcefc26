"""topk_tail_kl on row-strided logits, read in place: ``logits[:, :-1]`` of a ``[B, T, V]``
causal-LM buffer (rows of stride V, items of stride T * V: no ``[N, V]`` view covers it) and a
row slice of a wider buffer.

For the backends that read strided rows in place (reference, C++ CPU, Triton): the strided
view gives exactly the results and gradients of its contiguous copy, those match the float64
reference, and the logits are not copied (the ops' profiles hold no copy of their size; the
Triton kernels are launched on the view's own memory and strides). The CUDA op, which reads
such rows in place too, is checked on them (also for copies) in
tests/kernels/test_topk_tail_kl_cuda.py.
"""

from __future__ import annotations

import pytest
import torch

import lopd_kernels as lk
from lopd_kernels.row_layout import rows_in_place
from lopd_kernels.topk_tail_kl import topk_tail_kl_reference
from tests.kernels.utils import copies
from tests.utils import HAS_CPP, HAS_TRITON, TRITON_DEVICE, assert_close, requires_cpp

B, T, V = 2, 6, 70


def _causal(seed: int, device="cpu", dtype=torch.float32):
    """Base buffers ``[B, T, V]`` (leaves), their ``[:, :-1]`` views and targets ``[B, T - 1]``."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(B, T, V, generator=g) * 2
    s = t + torch.randn(B, T, V, generator=g)
    s_base = s.to(device, dtype).requires_grad_(True)
    t_base = t.to(device, dtype).requires_grad_(True)
    target = torch.randint(0, V, (B, T - 1), generator=g).to(device)
    target[1, 2] = -100
    return s_base, t_base, target


def _loss(out) -> torch.Tensor:
    u = torch.linspace(-1, 2, out.kl.numel(), device=out.kl.device).reshape(out.kl.shape)
    return (u * out.kl).sum() + (u * out.privilege).sum() + (u * out.student_logprob).sum()


def _backends():
    out = [pytest.param("torch", "cpu", id="torch")]
    out.append(
        pytest.param(
            "cpu", "cpu", id="cpu", marks=pytest.mark.skipif(not HAS_CPP, reason="no _C build")
        )
    )
    out.append(
        pytest.param(
            "triton", TRITON_DEVICE, id="triton",
            marks=pytest.mark.skipif(not HAS_TRITON, reason="no triton runtime"),
        )
    )  # fmt: skip
    return out


def test_rows_in_place_views():
    x = torch.randn(B, T, V)
    assert rows_in_place(x[:, :-1]).data_ptr() == x.data_ptr()
    assert rows_in_place(x[:, :-1]).shape == (B, T - 1, V)  # no [N, V] view exists
    assert rows_in_place(x[:, 1:]).stride() == (T * V, V, 1)
    wide = torch.randn(5, 2 * V)[:, :V]
    assert rows_in_place(wide).data_ptr() == wide.data_ptr() and rows_in_place(wide).dim() == 2
    assert rows_in_place(x).shape == (B * T, V)  # collapsible: 2-D
    assert rows_in_place(x.transpose(1, 2)).is_contiguous()  # strided vocabulary: copied
    y = torch.randn(4, 3, 2, V)
    cases = ((y[:, 1:], (4, 4, V)), (y[1:, 1:], (3, 4, V)), (y[1:, :, :1], (9, V)))
    for view, shape in (*cases, (y[:, :, 1:], (12, V))):
        got = rows_in_place(view)
        assert got.shape == shape and got.data_ptr() == view.data_ptr(), (view.stride(), shape)
        assert torch.equal(got.reshape(view.shape), view)
    gaps = torch.randn(4, 3, 3, V)[:, 1:, 1:]  # gaps between all three leading dims
    assert rows_in_place(gaps).is_contiguous() and torch.equal(
        rows_in_place(gaps), gaps.reshape(-1, V)
    )


@requires_cpp
def test_compiled_fullgraph_on_a_causal_view():
    """torch.compile(fullgraph=True) traces the view choice (no failed ``view`` to catch)."""
    s_base, t_base, target = _causal(2)
    s, t = s_base.detach(), t_base.detach()

    def loss(s, t, a):
        return lk.topk_tail_kl(s[:, :-1], t[:, :-1], a, top_m=5, backend="cpu").kl

    assert torch.equal(torch.compile(loss, fullgraph=True)(s, t, target), loss(s, t, target))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("top_m", [5, None], ids=["M5", "full"])
@pytest.mark.parametrize(("backend", "device"), _backends())
def test_causal_view_equals_its_contiguous_copy(backend, device, top_m):
    s_base, t_base, target = _causal(3, device)
    s_view, t_view = s_base[:, :-1], t_base[:, :-1]
    assert not s_view.is_contiguous()
    s_copy = s_view.detach().contiguous().requires_grad_(True)
    t_copy = t_view.detach().contiguous().requires_grad_(True)
    kw = {"top_m": top_m, "temperature": 0.8, "backend": backend}
    out_view = lk.topk_tail_kl(s_view, t_view, target, **kw)
    out_copy = lk.topk_tail_kl(s_copy, t_copy, target, **kw)
    for name in out_view._fields:
        assert torch.equal(getattr(out_view, name), getattr(out_copy, name)), name
    _loss(out_view).backward()
    _loss(out_copy).backward()
    assert torch.equal(s_base.grad[:, :-1], s_copy.grad)
    assert torch.equal(t_base.grad[:, :-1], t_copy.grad)
    assert not s_base.grad[:, -1].any() and not t_base.grad[:, -1].any()
    # ... and both are right: the float64 reference on the same values.
    s64 = s_view.detach().cpu().double().requires_grad_(True)
    t64 = t_view.detach().cpu().double().requires_grad_(True)
    ref = topk_tail_kl_reference(s64, t64, target.cpu(), top_m=top_m, temperature=0.8)
    _loss(ref).backward()
    for name in ("kl", "student_logprob", "teacher_logprob"):
        assert_close(getattr(out_view, name).cpu(), getattr(ref, name), torch.float32, name)
    assert torch.equal(out_view.topk_ids.cpu(), ref.topk_ids)
    assert_close(s_base.grad[:, :-1].cpu(), s64.grad, torch.float32, "grad student")
    assert_close(t_base.grad[:, :-1].cpu(), t64.grad, torch.float32, "grad teacher")


@requires_cpp
def test_cpu_ops_do_not_copy_strided_logits():
    s_base, t_base, target = _causal(4)
    s, t = s_base.detach()[:, :-1], t_base.detach()[:, :-1]
    tgt = target.reshape(-1)
    fwd, bwd = torch.ops.lopd.topk_tail_kl_cpu_fwd, torch.ops.lopd.topk_tail_kl_cpu_bwd
    numel = s.numel()
    assert copies(lambda: fwd(s, t, tgt, 5, 1.0, "reverse", 1.0, "teacher", -100), numel) == []
    kl, _slp, _tlp, ids, lse, bucket = fwd(s, t, tgt, 5, 1.0, "reverse", 1.0, "teacher", -100)
    ones = torch.ones_like(kl)
    args = (
        ones,
        ones,
        ones,
        s,
        t,
        tgt,
        ids,
        kl,
        lse,
        bucket,
        1.0,
        "reverse",
        1.0,
        -100,
        True,
        True,
    )
    assert copies(lambda: bwd(*args), numel) == []
    gs, gt = bwd(*args)
    assert gs.shape == gt.shape == s.shape and gs.is_contiguous() and gt.is_contiguous()
    # The public API passes the view itself (3-D) to the op.
    assert copies(lambda: lk.topk_tail_kl(s, t, target, top_m=5, backend="cpu"), numel) == []


def test_reference_does_not_copy_strided_logits():
    s_base, t_base, target = _causal(5)
    s, t = s_base.detach()[:, :-1], t_base.detach()[:, :-1]
    # One gather of the kept rows (index), no whole-tensor copy first.
    assert copies(lambda: topk_tail_kl_reference(s, t, target, top_m=5), s.numel()) == []


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.skipif(not HAS_TRITON, reason="no triton runtime")
def test_triton_kernels_get_the_views_memory(monkeypatch):
    """The Triton launchers hand the kernels the view's own memory and strides."""
    import lopd_kernels.triton.topk_tail_kl as launchers

    seen = []

    class Spy:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(args)
                return self.kernel[grid](*args, **kwargs)

            return launch

    for name in ("_fwd_topm_kernel", "_fwd_topm_joined_kernel", "_bwd_kernel"):
        monkeypatch.setattr(launchers, name, Spy(getattr(launchers, name)))
    s_base, t_base, target = _causal(6, TRITON_DEVICE)
    s_view = s_base[:, :-1]
    out = lk.topk_tail_kl(s_view, t_base[:, :-1], target, top_m=5, backend="triton")
    _loss(out).backward()
    assert len(seen) == 2  # forward, backward
    for args in seen:
        logits = [a for a in args if torch.is_tensor(a) and a.dim() == 3]
        assert [x.data_ptr() for x in logits[:2]] == [s_base.data_ptr(), t_base.data_ptr()]
        assert all(x.stride() == (T * V, V, 1) for x in logits[:2])
