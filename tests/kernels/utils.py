"""Helpers shared by the kernel tests: inputs of the logits ops (``topk_tail_kl`` and the ops
built on it), their forward + backward under random upstream gradients, the gradient check, the
profiler's copy detector, and packed varlen attention inputs.

The fused LM-head ops have theirs in :mod:`tests.kernels.fused_linear_utils`.
"""

from __future__ import annotations

import math

import torch
from torch.profiler import ProfilerActivity, profile

from tests.utils import TOLERANCES

# ------------------------------------------------------------------ topk_tail_kl's logits ops


def make_inputs(
    n: int,
    v: int,
    *,
    s_dtype=torch.float32,
    t_dtype=None,
    seed: int = 0,
    ignore_rows=(),
    pad: int = 0,
    scale: float = 2.0,
    ignore_index: int = -100,
):
    """Random student/teacher logits [n, v] and targets [n]; the last ``pad`` vocabulary entries
    are -inf in both (a padded vocabulary). Continuous random logits: no ties."""
    g = torch.Generator().manual_seed(seed)
    t_dtype = t_dtype or s_dtype
    t = torch.randn(n, v, generator=g, dtype=torch.float64) * scale
    s = t + torch.randn(n, v, generator=g, dtype=torch.float64) * (scale / 2)
    if pad:
        s[:, v - pad :] = -math.inf
        t[:, v - pad :] = -math.inf
    target = torch.randint(0, v - pad, (n,), generator=g)
    for r in ignore_rows:
        target[r] = ignore_index
    return s.to(s_dtype), t.to(t_dtype), target


def run(fn, s, t, target, upstream, **kw):
    """Calls ``fn`` with leaf copies; returns (outputs, grad_student, grad_teacher)."""
    s = s.detach().clone().requires_grad_(True)
    t = t.detach().clone().requires_grad_(True)
    out = fn(s, t, target, **kw)
    loss = sum((o.double() * u).sum() for o, u in zip(out[:4], upstream))
    loss.backward()
    return out, s.grad, t.grad


def random_upstream(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g, dtype=torch.float64) for _ in range(4)]


def assert_grad_close(actual, expected, dtype, msg):
    """Gradient check in two parts, with the dtype's (rtol, atol) from tests/utils.py.

    Entries of one row span many orders of magnitude (the target and top-M entries are O(1),
    tail entries O(1/V)), and each is S_j (c_b - u): a product with a cancelling difference, so a
    float32 entry is accurate relative to its *row's* scale, not to itself. Hence (1) elementwise
    ``|a - e| <= atol * rowmax|e| + rtol * |e|``, which pins the large entries, and (2) a
    relative L1 error ``sum|a - e| / sum|e| <= rtol``, which pins the bulk of small (tail) entries
    that (1) alone would let through at V = 151,936.
    """
    assert not torch.isnan(actual).any(), f"{msg}: NaN in gradient"
    assert actual.shape == expected.shape, f"{msg}: shape {actual.shape} != {expected.shape}"
    rtol, atol = TOLERANCES[dtype]
    a, e = actual.double(), expected.double()
    row_max = e.abs().amax(dim=-1, keepdim=True) if e.numel() else e
    # A row whose exact gradient is identically 0 (V = 1: every softmax is exactly 1) still gets
    # float32 rounding of terms of the upstream gradient's size, O(1) in these tests: unit scale.
    row_max = torch.where(row_max > 0, row_max, torch.ones_like(row_max))
    excess = (a - e).abs() - (atol * row_max + rtol * e.abs())
    if e.numel() and excess.max() > 0:
        i = int(excess.argmax())
        raise AssertionError(
            f"{msg}: entry {tuple(int(x) for x in torch.unravel_index(torch.tensor(i), e.shape))}"
            f" = {a.flatten()[i].item():.6g}, expected {e.flatten()[i].item():.6g}"
        )
    total = e.abs().sum().item()
    if total > 0:
        rel_l1 = (a - e).abs().sum().item() / total
        assert rel_l1 <= rtol, f"{msg}: relative L1 error {rel_l1:.3g} > {rtol}"


def opcheck_samples(fwd, top_m, device="cpu", support="teacher", divergence="reverse", beta=1.0):
    """Forward and backward arguments of a ``topk_tail_kl`` op (``fwd``: the forward custom op
    of one backend) for ``torch.library.opcheck``: 3 rows, V = 37, one ignored row, 2 padded ids."""
    s, t, target = (x.to(device) for x in make_inputs(3, 37, ignore_rows=(1,), pad=2, seed=9))
    s.requires_grad_(True)
    t.requires_grad_(True)
    fwd_args = (s, t, target, top_m, 0.9, divergence, beta, support, -100)
    kl, _slp, _tlp, ids, lse, bucket = fwd(
        *(x.detach() if torch.is_tensor(x) else x for x in fwd_args)
    )
    g = [u.to(device) for u in random_upstream(3)]
    bwd_args = (
        g[0].float(),
        g[1].float(),
        g[2].float(),
        s.detach(),
        t.detach(),
        target,
        ids,
        kl,
        lse,
        bucket,
        0.9,
        divergence,
        beta,
        -100,
        True,
        True,
    )
    return fwd_args, bwd_args


# ------------------------------------------------------------------ strided logits, no copies

# A reshape that cannot be a view shows up as the aten::clone it runs.
COPY_OPS = {"aten::clone", "aten::contiguous", "aten::copy_", "aten::_to_copy"}


def copies(fn, numel: int) -> list[tuple[str, list]]:
    """The copy-like aten ops ``fn`` runs (nested ones inside C++ ops included) on tensors of at
    least ``numel`` elements."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    out = []
    for e in prof.events():
        if e.name in COPY_OPS:
            sizes = [s for s in e.input_shapes if s and torch.Size(s).numel() >= numel]
            if sizes:
                out.append((e.name, sizes))
    return out


# ------------------------------------------------------------------ varlen cross-attention


def cu_seqlens(lengths: list[int], device: str = "cpu") -> torch.Tensor:
    """Cumulative lengths ``[0, l0, l0 + l1, ...]`` (int32) of a packed batch."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    return cu.to(device)


def varlen_inputs(lengths, n_q_heads, n_kv_heads, head_dim, seq_q, dtype, device, seed=0):
    """Random q ``[B, seq_q, Hq, d]``, packed k, v ``[total, Hkv, d]`` and an output gradient."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(len(lengths), seq_q, n_q_heads, head_dim, generator=gen)
    k = torch.randn(total, n_kv_heads, head_dim, generator=gen)
    v = torch.randn(total, n_kv_heads, head_dim, generator=gen)
    grad = torch.randn(len(lengths), seq_q, n_q_heads, head_dim, generator=gen)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, grad)]
