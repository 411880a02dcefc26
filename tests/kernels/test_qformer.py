"""QFormerCompressor vs the straightforward QFormer (K/V recomputed per layer), same weights."""

from __future__ import annotations

import copy

import pytest
import torch

from lopd_kernels import QFormerCompressor
from lopd_kernels._backend import triton_available
from lopd_kernels.qformer import straightforward_qformer
from tests.kernels.utils import cu_seqlens
from tests.utils import assert_close, tol

BACKENDS = ["cpu"] + (["triton"] if triton_available() else [])
DEVICE = {"cpu": "cpu", "triton": "cuda" if torch.cuda.is_available() else "cpu"}
LENGTHS = [3, 0, 40, 1, 7]


def _module(seed=0, **kwargs):
    torch.manual_seed(seed)
    config = {"hidden_size": 32, "num_heads": 4, "num_kv_heads": 2, "num_queries": 5}
    config.update(num_layers=3)
    config.update(kwargs)
    module = QFormerCompressor(**config)
    # Non-trivial norms and biases so that their gradients are checked too.
    with torch.no_grad():
        for p in module.parameters():
            if p is not module.queries:
                p.add_(0.1 * torch.randn_like(p))
    return module


def assert_close_at_scale(actual, expected, dtype, msg):
    """``assert_close`` with the table's atol taken relative to the tensor's largest entry.

    Parameter gradients of a 3-layer module are sums over many rows with entries up to ~20; fp32
    rounding then leaves absolute errors of a few 1e-6 (1e-7 of the scale) on entries near 0.
    """
    assert not torch.isnan(actual).any(), f"{msg}: NaN in result"
    rtol, atol = tol(dtype).values()
    scale = max(1.0, expected.abs().max().item())
    torch.testing.assert_close(
        actual.detach().double(), expected.detach().double(), rtol=rtol, atol=atol * scale, msg=msg
    )


def saved_activation_bytes(fn, params) -> int:
    """Bytes of distinct storages autograd saves during ``fn()``, parameters excluded."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    storages: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_ptrs:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("share_layers", "perceiver"),
    [(True, False), (False, False), (True, True)],
    ids=["shared", "unshared", "shared-perceiver"],
)
def test_module_matches_straightforward(backend, share_layers, perceiver):
    """Forward, every parameter gradient and dH vs the float64 per-item implementation."""
    device = DEVICE[backend]
    module = _module(share_layers=share_layers, perceiver=perceiver, backend=backend).to(device)
    cu = cu_seqlens(LENGTHS, device)
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(sum(LENGTHS), 32, generator=gen).to(device).requires_grad_()
    grad = torch.randn(len(LENGTHS), 5, 32, generator=gen).to(device)

    out = module(hidden, cu, max_seqlen=max(LENGTHS))
    names = ["hidden_states"] + [n for n, _ in module.named_parameters()]
    grads = torch.autograd.grad(out, [hidden, *module.parameters()], grad)

    ref_module = copy.deepcopy(module).cpu().double()
    hidden64 = hidden.detach().cpu().double().requires_grad_()
    ref = straightforward_qformer(ref_module, hidden64, cu.cpu(), padded=False)
    ref_grads = torch.autograd.grad(ref, [hidden64, *ref_module.parameters()], grad.cpu().double())

    assert out.shape == (len(LENGTHS), 5, 32)
    assert_close(out.cpu(), ref, torch.float32, "latents")
    for name, g, r in zip(names, grads, ref_grads):
        assert_close_at_scale(g.cpu(), r, torch.float32, f"grad {name}")


@pytest.mark.parametrize("perceiver", [False, True], ids=["cross", "perceiver"])
def test_padded_straightforward_equals_looped(perceiver):
    """The benchmark's padded + masked baseline computes the same function (empty item included)."""
    module = _module(perceiver=perceiver).double()
    cu = cu_seqlens(LENGTHS)
    hidden = torch.randn(sum(LENGTHS), 32, dtype=torch.float64, requires_grad=True)
    looped = straightforward_qformer(module, hidden, cu, padded=False)
    padded = straightforward_qformer(module, hidden, cu, padded=True)
    torch.testing.assert_close(padded, looped)
    g_loop, g_pad = (torch.autograd.grad(o.square().sum(), hidden)[0] for o in (looped, padded))
    torch.testing.assert_close(g_pad, g_loop)


def test_items_are_independent_and_empty_item_is_finite():
    module = _module()
    cu = cu_seqlens(LENGTHS)
    hidden = torch.randn(sum(LENGTHS), 32)
    batched = module(hidden, cu)
    assert torch.isfinite(batched).all()
    bounds = cu.tolist()
    for b, length in enumerate(LENGTHS):
        alone = module(hidden[bounds[b] : bounds[b + 1]], cu_seqlens([length]))
        torch.testing.assert_close(batched[b : b + 1], alone, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("share_layers", [True, False])
def test_kv_projected_once_when_shared(share_layers):
    """Shared weights: one K/V projection (and one LN_kv) per forward; unshared: one per layer."""
    module = _module(share_layers=share_layers, num_layers=4)
    calls = []
    for layer in module.layers:
        layer.k_proj.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0]))
    module(torch.randn(sum(LENGTHS), 32), cu_seqlens(LENGTHS))
    assert calls == [sum(LENGTHS)] * (1 if share_layers else 4)


def test_shared_kv_activation_memory_is_counted_once():
    """Saved activations of the key side exist once, not once per layer (~3 [total, d] tensors).

    With L = 8 layers the straightforward implementation saves LN_kv(H), K and V per layer; the
    module saves them once, plus small [B, K, d] query-side tensors per layer.
    """
    lengths = [300, 200, 400]
    module = _module(num_layers=8, num_queries=4)
    cu = cu_seqlens(lengths)
    hidden = torch.randn(sum(lengths), 32, requires_grad=True)
    params = list(module.parameters())
    ours = saved_activation_bytes(lambda: module(hidden, cu), params)
    baseline = saved_activation_bytes(
        lambda: straightforward_qformer(module, hidden, cu, padded=True), params
    )
    kv_side = 4 * sum(lengths) * 32 * 4  # H, LN_kv(H), K, V (Hkv * D = 16 = d / 2, counted as d)
    query_side = 8 * 40 * len(lengths) * 4 * 32 * 4  # generous: 40 [B, K, d]-sized saves per layer
    assert ours <= kv_side + query_side
    assert ours * 4 <= baseline


def test_query_init_variance():
    """Queries ~ N(0, 1/sqrt(d)): the variance (not the std) is d ** -0.5."""
    module = QFormerCompressor(256, 4, num_queries=512, num_layers=1)
    var = module.queries.detach().var().item()
    assert abs(var - 256**-0.5) < 0.05 * 256**-0.5


def test_dtype_cast_and_gqa_default():
    module = _module(num_kv_heads=None)
    assert module.layers[0].num_kv_heads == 4
    hidden = torch.randn(sum(LENGTHS), 32, dtype=torch.bfloat16)
    out = module(hidden, cu_seqlens(LENGTHS))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, module(hidden.float(), cu_seqlens(LENGTHS)))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"hidden_size": 30}, "divisible by num_heads"),
        ({"num_kv_heads": 3}, "multiple of num_kv_heads"),
        ({"num_layers": 0}, "num_layers"),
        ({"activation": "relu"}, "activation"),
    ],
)
def test_constructor_validation(kwargs, match):
    config = {"hidden_size": 32, "num_heads": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        QFormerCompressor(**config)


def test_forward_validation():
    module = _module()
    with pytest.raises(ValueError, match="hidden_states"):
        module(torch.randn(2, 5, 32), cu_seqlens([5, 5]))
    with pytest.raises(ValueError, match="hidden_size"):
        module(torch.randn(10, 16), cu_seqlens([5, 5]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        module(torch.randn(10, 32), cu_seqlens([5, 5])[None])
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        module(torch.randn(10, 32), cu_seqlens([5, 4]))


def test_silu_activation_runs_and_differs():
    hidden = torch.randn(sum(LENGTHS), 32)
    gelu = _module(seed=3)(hidden, cu_seqlens(LENGTHS))
    silu = _module(seed=3, activation="silu")(hidden, cu_seqlens(LENGTHS))
    assert torch.isfinite(silu).all() and not torch.allclose(gelu, silu)


def test_cpu_path_is_one_batched_call_per_layer_without_fills():
    """CPU: one varlen C++ call per layer for the whole batch (forward and backward), not one per
    item, and no fill / zero / copy ops inside those calls (issue 20: 96 calls, 534 copies and
    269 fills per step before)."""
    from torch.profiler import ProfilerActivity, profile

    module, lengths = _module(num_layers=3), [3, 0, 40, 1, 7, 12]
    hidden = torch.randn(sum(lengths), 32, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        module(hidden, cu_seqlens(lengths)).sum().backward()
    events = prof.events()
    names = [e.name for e in events]
    assert names.count("lopd::varlen_cross_attention_cpu_fwd") == 3
    assert names.count("lopd::varlen_cross_attention_cpu_bwd") == 3

    def inside_varlen(event):
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith("lopd::varlen_cross_attention_cpu_"):
                return True
            parent = parent.cpu_parent
        return False

    busy = {"aten::fill_", "aten::zero_", "aten::copy_", "aten::zeros", "aten::pad"}
    assert [e.name for e in events if e.name in busy and inside_varlen(e)] == []
