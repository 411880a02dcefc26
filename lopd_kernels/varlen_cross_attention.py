"""Varlen cross-attention: a few dense queries per item attending over packed variable-length keys.

This is the attention of a QFormer / Perceiver compressor: item ``b`` has ``Lq`` learned-query
rows (the same count for every item, so queries are a dense ``[B, Lq, Hq, D]`` tensor) and ``T_b``
key/value rows packed back to back into ``[total_k, Hkv, D]``; ``cu_seqlens_k`` (int32, ``[B+1]``)
holds the item boundaries, as in flash-attn's varlen API. There is no causal mask: every query of
item ``b`` sees exactly the keys of item ``b``. Grouped-query attention maps query head ``h`` to
key/value head ``h // (Hq // Hkv)``.

For each item, query row ``i`` and query head ``h`` (with ``g = h // (Hq // Hkv)``)::

    s_ij   = scale * <q[b, i, h], k[j, g]>                 j in [cu[b], cu[b+1])
    lse_i  = log sum_j exp(s_ij)                           (-inf for an empty item)
    out_i  = sum_j exp(s_ij - lse_i) v[j, g]               (0 for an empty item)

Backward (``do`` = grad of ``out``, ``dlse`` = grad of ``lse``, usually zero)::

    p_ij   = exp(s_ij - lse_i)
    delta_i = <do_i, out_i> - dlse_i
    ds_ij  = p_ij * (<do_i, v_j> - delta_i)
    dq_i   = scale * sum_j ds_ij k_j
    dk_j   = scale * sum_i ds_ij q_i      (summed over the query heads sharing kv head g)
    dv_j   = sum_i p_ij do_i              (idem)

Besides its inputs (which the QFormer keeps anyway), the op saves only ``out`` and the
``[B, Hq, Lq]`` fp32 log-sum-exp; the probabilities are recomputed in the backward, so the
attention adds no ``T``-sized activation of its own.

Backends:

* ``"torch"``: :func:`varlen_cross_attention_reference`, a per-item
  ``F.scaled_dot_product_attention`` loop differentiated by autograd (float64-capable). The ground
  truth for every test.
* ``"cpu"``: ``torch.ops.lopd.varlen_cross_attention_fwd/_bwd``, registered from Python with
  :func:`torch.library.custom_op`. Per item it calls ATen's fused, vectorized flash-attention CPU
  kernels (``_scaled_dot_product_flash_attention_for_cpu`` and its backward) on strided views of
  the packed keys (no copy, no padding), with the ``G`` query heads of a GQA group folded into
  ``G * Lq`` query rows so that each key is read once per kv head. Measured on one item
  (T = 2000, 16 heads, Lq = 32, D = 64, fp32) it is ~3x faster than the same math written as
  batched GEMMs + softmax (forward 43 vs 116 ms, backward 140 vs 515 ms, on a loaded 2-core box);
  a hand-written C++ kernel would redo what that ATen kernel already does. A nonzero ``lse``
  gradient, and non-CPU tensors, take the unfused GEMM path.
* ``"triton"``: ``torch.ops.lopd.varlen_cross_attention_triton_fwd/_bwd``
  (:mod:`lopd_kernels.triton.varlen_cross_attention`): split-KV online-softmax forward, a dQ pass
  and a dK/dV pass. Runs on CUDA, or on CPU tensors under ``TRITON_INTERPRET=1``.
* ``"cuda"``: ``torch.ops.lopd.varlen_cross_attention_cuda_fwd/_bwd``, hand-written CUDA kernels
  (``csrc/cuda/varlen_cross_attention_kernels.cuh``): a forward with an online softmax over key
  tiles staged in shared memory, a dQ kernel and a dK/dV kernel (one block per key tile, looping
  over the ``G * Lq`` query rows of its kv head: no atomics). Two paths, picked by the launcher:
  bf16 / fp16 inputs with ``D % 16 == 0`` and ``D <= 128`` run on tensor cores through
  ``nvcuda::wmma`` (m16n16k16, i.e. ``mma.sync`` on sm_80 / sm_90; not Hopper's ``wgmma``), in
  the flash-attention manner: fp32 scores, softmax and accumulators, ``P`` and ``dS`` rounded to
  the input dtype only as tensor-core operands (dK/dV also multiplies their rounding errors, as
  a second operand, for accuracy); fp32 inputs and other head dims run CUDA-core fp32 FMA
  kernels. Available when ``lopd_kernels._C`` was built with CUDA. Tested on CPU under the SIMT
  emulator (``tests/test_varlen_cross_attention_cuda.py``, which emulates WMMA too); neither path
  has ever run on a GPU, so neither speed is measured.
* ``"auto"``: Triton for CUDA tensors when Triton is importable; without Triton the CUDA kernels
  (if built, else the ``"cpu"`` op's GEMM path); the ``"cpu"`` op for CPU tensors. Not the CUDA
  kernels while Triton is there: nothing has measured them on a GPU yet. At the QFormer shape
  the op does ~``G * Lq`` flops per byte of ``k``/``v``, near the tensor cores' ridge point, so
  it is decided by tensor-core efficiency: Triton's Hopper ``tl.dot`` against WMMA
  (``mma.sync``) tiles whose accumulators pass through shared memory.
  ``benchmarks/gpu_qformer.py`` measures both.

The Triton kernels read each key/value tile once per kv head (the GQA group's query rows share
it); ``benchmarks/gpu_qformer.py`` times them against the CUDA kernel and flash-attn's
``flash_attn_varlen_func``, which has not been run on a GPU yet.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from lopd_kernels._backend import check_backend, has_cpp_op, has_cuda_kernel, triton_available

__all__ = [
    "varlen_cross_attention",
    "varlen_cross_attention_reference",
]


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------


def varlen_cross_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Per-item ``scaled_dot_product_attention`` loop; differentiable by autograd.

    Works in any floating dtype including float64 (SDPA's math path), which is what the tests
    compare every backend against.

    Args:
        q: ``[B, Lq, Hq, D]`` queries.
        k: ``[total_k, Hkv, D]`` packed keys.
        v: ``[total_k, Hkv, D]`` packed values.
        cu_seqlens_k: ``[B+1]`` int32 cumulative key lengths.
        scale: Softmax scale; ``D ** -0.5`` when ``None``.

    Returns:
        ``[B, Lq, Hq, D]``; rows of an empty item are zeros.
    """
    batch, _, n_q_heads, head_dim = q.shape
    n_kv_heads = k.shape[1]
    scale = head_dim**-0.5 if scale is None else scale
    bounds = cu_seqlens_k.tolist()
    outs = []
    for b in range(batch):
        start, end = bounds[b], bounds[b + 1]
        qb = q[b].transpose(0, 1).unsqueeze(0)  # [1, Hq, Lq, D]
        if end == start:
            # SDPA over zero keys is 0/0; the attention output of an empty set is defined as 0.
            outs.append(torch.zeros_like(qb))
            continue
        kb = k[start:end].transpose(0, 1).unsqueeze(0)  # [1, Hkv, T, D]
        vb = v[start:end].transpose(0, 1).unsqueeze(0)
        ob = F.scaled_dot_product_attention(
            qb, kb, vb, scale=scale, enable_gqa=n_q_heads != n_kv_heads
        )
        outs.append(ob)
    return torch.cat(outs, 0).transpose(1, 2)  # [B, Lq, Hq, D]


# --------------------------------------------------------------------------------------------
# Input validation
# --------------------------------------------------------------------------------------------


def _validate(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_k: int | None,
    scale: float | None,
) -> None:
    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4:
        raise ValueError(f"q must be [B, Lq, Hq, D], got shape {tuple(q.shape)}")
    if k.dim() != 3:
        raise ValueError(f"k must be packed [total_k, Hkv, D], got shape {tuple(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if k.shape[2] != q.shape[3]:
        raise ValueError(f"k head dim {k.shape[2]} must equal q head dim {q.shape[3]}")
    if k.shape[1] == 0 or q.shape[2] % k.shape[1] != 0:
        raise ValueError(
            f"q heads ({q.shape[2]}) must be a positive multiple of k/v heads ({k.shape[1]})"
        )
    if not q.is_floating_point():
        raise TypeError(f"q must be floating point, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if cu_seqlens_k.dtype != torch.int32:
        raise TypeError(f"cu_seqlens_k must be int32, got {cu_seqlens_k.dtype}")
    if cu_seqlens_k.dim() != 1 or cu_seqlens_k.numel() != q.shape[0] + 1:
        raise ValueError(
            f"cu_seqlens_k must be [B+1] = [{q.shape[0] + 1}], got {tuple(cu_seqlens_k.shape)}"
        )
    for name, t in (("k", k), ("v", v), ("cu_seqlens_k", cu_seqlens_k)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite float, got {scale}")
    if max_seqlen_k is not None and max_seqlen_k < 0:
        raise ValueError(f"max_seqlen_k must be >= 0, got {max_seqlen_k}")
    # Checking the boundaries needs their values: free on CPU, a device sync on GPU (skipped).
    if cu_seqlens_k.device.type == "cpu":
        cu = cu_seqlens_k.long()
        if cu[0] != 0 or cu[-1] != k.shape[0] or bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(
                "cu_seqlens_k must start at 0, be non-decreasing and end at total_k = "
                f"{k.shape[0]}; got {cu_seqlens_k.tolist()}"
            )
        if max_seqlen_k is not None and q.shape[0] > 0:
            longest = int((cu[1:] - cu[:-1]).max())
            if max_seqlen_k < longest:
                raise ValueError(f"max_seqlen_k={max_seqlen_k} is below the longest item {longest}")


# --------------------------------------------------------------------------------------------
# CPU path: per item, ATen's fused flash-attention CPU kernels with the GQA group folded into the
# query rows; registered as torch.ops.lopd.varlen_cross_attention_fwd/_bwd
# --------------------------------------------------------------------------------------------

_flash_cpu_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_cpu_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _group_queries(qb: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """``[Lq, Hq, D]`` -> ``[Hkv, G * Lq, D]``: a GQA group's query heads as extra query rows.

    Without a causal mask the rows of a query are independent, so the ``G`` heads sharing a kv
    head are just ``G * Lq`` rows against the same keys: one attention call, keys read once.
    """
    lq, hq, d = qb.shape
    g = hq // n_kv_heads
    return qb.view(lq, n_kv_heads, g, d).permute(1, 2, 0, 3).reshape(n_kv_heads, g * lq, d)


def _ungroup(xg: torch.Tensor, lq: int) -> torch.Tensor:
    """Inverse of :func:`_group_queries`: ``[Hkv, G * Lq, D]`` -> ``[Lq, Hq, D]``."""
    hkv, gl, d = xg.shape
    g = gl // lq
    return xg.reshape(hkv, g, lq, d).permute(2, 0, 1, 3).reshape(lq, hkv * g, d)


def _item_kv(t: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Rows ``start:end`` of packed ``[total_k, Hkv, D]`` as a ``[1, Hkv, T, D]`` view (no copy)."""
    return t[start:end].transpose(0, 1).unsqueeze(0)


def _explicit_attention_fwd(qg, kb, vb, scale):
    """Unfused fp32 attention of one item: out ``[Hkv, GLq, D]``, lse ``[Hkv, GLq]``."""
    s = torch.matmul(qg.float(), kb.float().transpose(-1, -2)).mul_(scale)[0]  # [Hkv, GLq, T]
    lse = torch.logsumexp(s, -1)
    p = s.sub_(lse.unsqueeze(-1)).exp_()
    return torch.matmul(p, vb.float()[0]), lse


def _explicit_attention_bwd(dog, qg, kb, vb, lse_g, delta_g, scale):
    """Unfused fp32 backward of one item with ``delta = <do, out> - dlse`` given per row."""
    qg, dog, kb, vb = qg.float(), dog.float(), kb.float()[0], vb.float()[0]
    s = torch.bmm(qg, kb.transpose(1, 2)).mul_(scale)
    p = s.sub_(lse_g.unsqueeze(-1)).exp_()  # [Hkv, GLq, T]
    dv = torch.bmm(p.transpose(1, 2), dog)
    ds = torch.bmm(dog, vb.transpose(1, 2)).sub_(delta_g.unsqueeze(-1)).mul_(p).mul_(scale)
    return torch.bmm(ds, kb), torch.bmm(ds.transpose(1, 2), qg), dv


@torch.library.custom_op("lopd::varlen_cross_attention_fwd", mutates_args=())
def _cpu_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_k: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward: returns ``out [B, Lq, Hq, D]`` (q's dtype) and ``lse [B, Hq, Lq]`` (fp32)."""
    batch, lq, hq, _ = q.shape
    hkv = k.shape[1]
    out = torch.zeros_like(q)
    lse = torch.full((batch, hq, lq), float("-inf"), dtype=torch.float32, device=q.device)
    bounds = cu_seqlens_k.tolist()
    for b in range(batch):
        start, end = bounds[b], bounds[b + 1]
        if end == start:
            continue  # empty item: out = 0, lse = -inf
        qg = _group_queries(q[b], hkv).unsqueeze(0)  # [1, Hkv, G*Lq, D]
        kb, vb = _item_kv(k, start, end), _item_kv(v, start, end)  # [1, Hkv, T, D]
        if q.device.type == "cpu":
            og, lse_g = _flash_cpu_fwd(qg, kb, vb, 0.0, False, scale=scale)
            og, lse_g = og[0], lse_g[0]
        else:
            og, lse_g = _explicit_attention_fwd(qg, kb, vb, scale)
        out[b] = _ungroup(og, lq)
        lse[b] = lse_g.reshape(hq, lq)
    return out, lse


@torch.library.custom_op("lopd::varlen_cross_attention_bwd", mutates_args=())
def _cpu_bwd(
    grad_out: torch.Tensor,
    grad_lse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward: returns ``dq, dk, dv`` in the input dtypes; probabilities are recomputed.

    ATen's fused CPU backward derives ``delta = <do, out>`` itself and has no ``lse`` input
    gradient, so it serves the common ``grad_lse == 0`` case; a nonzero ``grad_lse`` (the
    Perceiver merge) takes the unfused fp32 path with ``delta = <do, out> - dlse``.
    """
    batch, lq, _, _ = q.shape
    hkv = k.shape[1]
    dq = torch.zeros_like(q)  # [B, Lq, Hq, D]: small; rows of empty items stay 0
    # Every key row belongs to exactly one item (cu_seqlens_k runs from 0 to total_k), so dk and
    # dv are fully overwritten: no zero-fill of two [total_k, Hkv, D] buffers per layer.
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    fused = q.device.type == "cpu" and not bool(grad_lse.any())
    if not fused:
        delta = (grad_out.float() * out.float()).sum(-1).transpose(1, 2) - grad_lse.float()
    bounds = cu_seqlens_k.tolist()
    for b in range(batch):
        start, end = bounds[b], bounds[b + 1]
        if end == start:
            continue
        qg = _group_queries(q[b], hkv).unsqueeze(0)
        dog = _group_queries(grad_out[b], hkv).unsqueeze(0)
        kb, vb = _item_kv(k, start, end), _item_kv(v, start, end)
        lse_g = lse[b].reshape(hkv, -1)  # [Hkv, G*Lq]
        if fused:
            og = _group_queries(out[b], hkv).unsqueeze(0)
            dqg, dkb, dvb = _flash_cpu_bwd(
                dog, qg, kb, vb, og, lse_g.unsqueeze(0), 0.0, False, scale=scale
            )
            dqg, dkb, dvb = dqg[0], dkb[0], dvb[0]
        else:
            delta_g = delta[b].reshape(hkv, -1)
            dqg, dkb, dvb = _explicit_attention_bwd(dog[0], qg[0], kb, vb, lse_g, delta_g, scale)
        dq[b] = _ungroup(dqg, lq)
        dk[start:end] = dkb.transpose(0, 1)
        dv[start:end] = dvb.transpose(0, 1)
    return dq, dk, dv


def _fwd_fake(q, k, v, cu_seqlens_k, scale, *extra):
    batch, lq, hq, _ = q.shape
    return torch.empty_like(q), q.new_empty((batch, hq, lq), dtype=torch.float32)


def _bwd_fake(grad_out, grad_lse, q, k, v, out, lse, cu_seqlens_k, scale, *extra):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


torch.library.register_fake("lopd::varlen_cross_attention_fwd")(_fwd_fake)
torch.library.register_fake("lopd::varlen_cross_attention_bwd")(_bwd_fake)


# --------------------------------------------------------------------------------------------
# Triton path (kernels in lopd_kernels/triton/varlen_cross_attention.py, imported lazily so that
# CPU-only installs without Triton still import this module)
# --------------------------------------------------------------------------------------------


@torch.library.custom_op("lopd::varlen_cross_attention_triton_fwd", mutates_args=())
def _triton_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
    max_seqlen_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton forward: returns ``out [B, Lq, Hq, D]`` and ``lse [B, Hq, Lq]`` (fp32)."""
    from lopd_kernels.triton.varlen_cross_attention import varlen_xattn_fwd

    return varlen_xattn_fwd(q, k, v, cu_seqlens_k, scale, max_seqlen_k)


@torch.library.custom_op("lopd::varlen_cross_attention_triton_bwd", mutates_args=())
def _triton_bwd(
    grad_out: torch.Tensor,
    grad_lse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
    max_seqlen_k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton backward: returns ``dq, dk, dv`` in the input dtypes."""
    from lopd_kernels.triton.varlen_cross_attention import varlen_xattn_bwd

    return varlen_xattn_bwd(
        grad_out, grad_lse, q, k, v, out, lse, cu_seqlens_k, scale, max_seqlen_k
    )


torch.library.register_fake("lopd::varlen_cross_attention_triton_fwd")(_fwd_fake)
torch.library.register_fake("lopd::varlen_cross_attention_triton_bwd")(_bwd_fake)


# --------------------------------------------------------------------------------------------
# Autograd: the forward ops are differentiable (out and lse), each through its backward op
# --------------------------------------------------------------------------------------------


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_k, scale, *extra = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_k)
    ctx.scale = scale
    ctx.extra = extra  # (max_seqlen_k,) for Triton


def _make_backward(bwd_op):
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, cu_seqlens_k = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        if grad_lse is None:
            grad_lse = torch.zeros_like(lse)
        # -inf lse rows (empty items) may receive a gradient; it has no keys to flow into.
        dq, dk, dv = bwd_op(
            grad_out.contiguous(),
            grad_lse.contiguous(),
            q,
            k,
            v,
            out,
            lse,
            cu_seqlens_k,
            ctx.scale,
            *ctx.extra,
        )
        return (dq, dk, dv, None, None, *([None] * len(ctx.extra)))

    return backward


torch.library.register_autograd(
    "lopd::varlen_cross_attention_fwd",
    _make_backward(torch.ops.lopd.varlen_cross_attention_bwd),
    setup_context=_setup_context,
)
torch.library.register_autograd(
    "lopd::varlen_cross_attention_triton_fwd",
    _make_backward(torch.ops.lopd.varlen_cross_attention_triton_bwd),
    setup_context=_setup_context,
)

# The hand-written CUDA kernels (csrc/cuda/varlen_cross_attention_kernels.cuh): the ops are
# declared by every build of lopd_kernels._C, implemented only by a CUDA build.
_HAS_CPP = has_cpp_op("varlen_cross_attention_cuda_fwd")
_HAS_CUDA_KERNEL = _HAS_CPP and has_cuda_kernel("varlen_cross_attention_cuda_fwd")


def register_compiled_op_impls(namespace: str) -> None:
    """Fake impls and autograd for ``<namespace>::varlen_cross_attention_cuda_fwd/_bwd``, ops
    declared in C++ (``lopd`` here; the SIMT-emulated test build registers its namespace too)."""
    ops = getattr(torch.ops, namespace)
    torch.library.register_fake(f"{namespace}::varlen_cross_attention_cuda_fwd")(_fwd_fake)
    torch.library.register_fake(f"{namespace}::varlen_cross_attention_cuda_bwd")(_bwd_fake)
    torch.library.register_autograd(
        f"{namespace}::varlen_cross_attention_cuda_fwd",
        _make_backward(ops.varlen_cross_attention_cuda_bwd),
        setup_context=_setup_context,
    )


if _HAS_CPP:
    register_compiled_op_impls("lopd")


# --------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------


def _resolve_backend(backend: str, device: torch.device) -> str:
    check_backend(backend)
    if backend == "auto":
        if device.type != "cuda":
            return "cpu"
        if triton_available():
            return "triton"
        # No Triton at run time (a deployment without a JIT): the compiled CUDA kernels when
        # built, else the unfused GEMM path of the "cpu" op (which also takes CUDA tensors).
        return "cuda" if _HAS_CUDA_KERNEL else "cpu"
    if backend == "cuda":
        if device.type != "cuda":
            raise ValueError(f"backend='cuda' needs CUDA tensors, got tensors on {device}")
        if not _HAS_CUDA_KERNEL:
            raise RuntimeError(
                "backend='cuda': lopd_kernels._C was built without the CUDA varlen_cross_attention "
                "kernels (build it with nvcc and a CUDA torch); use backend='triton' or 'auto'"
            )
    if backend == "triton" and not triton_available():
        raise ValueError(
            "backend='triton' needs Triton and a CUDA device (or TRITON_INTERPRET=1 for CPU)"
        )
    return backend


def varlen_cross_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    max_seqlen_k: int | None = None,
    scale: float | None = None,
    backend: str = "auto",
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Dense queries per item attend over that item's packed keys/values (no mask inside an item).

    Args:
        q: ``[B, Lq, Hq, D]`` queries (fp32, bf16, fp16 or, for ``backend="torch"``, fp64).
        k: ``[total_k, Hkv, D]`` keys of all items packed back to back; ``Hq % Hkv == 0`` (GQA).
        v: ``[total_k, Hkv, D]`` values, same layout as ``k``.
        cu_seqlens_k: ``[B+1]`` int32, ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` are item ``b``'s rows
            of ``k``/``v``. Equal neighbours make an empty item, whose output is zeros.
        max_seqlen_k: Longest item; sizes the Triton / CUDA grid without a device sync. Computed
            from ``cu_seqlens_k`` (one sync) when ``None``.
        scale: Softmax scale; ``D ** -0.5`` when ``None``.
        backend: ``"auto"``, ``"torch"`` (reference), ``"cpu"``, ``"triton"``, ``"cuda"`` (the
            hand-written CUDA kernels; CUDA tensors and a CUDA build of the extension, D <= 256).
        return_lse: Also return the fp32 ``[B, Hq, Lq]`` log-sum-exp of the scaled scores
            (``-inf`` for an empty item); it is differentiable. Not available for ``"torch"``.

    Returns:
        ``[B, Lq, Hq, D]`` in q's dtype, or ``(out, lse)`` when ``return_lse``.

    Raises:
        ValueError / TypeError: naming the offending argument for bad shapes, dtypes, devices,
            boundaries or backend.
    """
    _validate(q, k, v, cu_seqlens_k, max_seqlen_k, scale)
    backend = _resolve_backend(backend, q.device)
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    if backend == "torch":
        if return_lse:
            raise ValueError("return_lse=True is not available with backend='torch'")
        return varlen_cross_attention_reference(q, k, v, cu_seqlens_k, scale=scale)
    if q.dtype == torch.float64:
        raise TypeError(f"backend={backend!r} supports fp32/bf16/fp16, got q.dtype {q.dtype}")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if backend == "cpu":
        out, lse = torch.ops.lopd.varlen_cross_attention_fwd(q, k, v, cu_seqlens_k, scale)
    else:
        if max_seqlen_k is None:
            lengths = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
            max_seqlen_k = int(lengths.max()) if lengths.numel() else 0
        fwd = (
            torch.ops.lopd.varlen_cross_attention_cuda_fwd
            if backend == "cuda"
            else torch.ops.lopd.varlen_cross_attention_triton_fwd
        )
        out, lse = fwd(q, k, v, cu_seqlens_k, scale, int(max_seqlen_k))
    return (out, lse) if return_lse else out
