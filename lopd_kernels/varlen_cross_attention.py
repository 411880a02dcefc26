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

Implementations (``torch.ops.lopd.varlen_cross_attention_<impl>_fwd/_bwd``, one schema):

* ``"torch"``: :func:`varlen_cross_attention_reference`, a per-item loop of the formulas above
  differentiated by autograd (float64-capable). The ground truth for every test.
* ``"cpu"``: C++ kernels (``csrc/cpu/isa/varlen_cross_attention_kernel.cpp``), one call for the
  whole batch: work units are the (item, kv head) pairs, taken longest first by every thread;
  the ``G`` query heads of a GQA group are folded into ``G * Lq`` query rows held in vector
  lanes, so each key is read once per kv head and the softmax over keys is lane-wise. Keys
  stream in chunks (online softmax in the forward), every product is a register-blocked
  micro-kernel on fp32 data, and each unit writes its own rows of every output once: no
  per-call zero-fill, no copies of the packed keys, no padding.
* ``"triton"``: ``lopd_kernels/triton/varlen_cross_attention.py``: split-KV online-softmax
  forward, a dQ pass and a dK/dV pass. Runs on CUDA, or on CPU tensors under
  ``TRITON_INTERPRET=1``.
* ``"cuda"``: hand-written CUDA kernels (``csrc/cuda/varlen_cross_attention_kernels.cuh`` and
  ``csrc/cuda/varlen_cross_attention_kernels_wmma.cuh``, launched by
  ``csrc/cuda/varlen_cross_attention_launch.cuh``): a forward with an online softmax over key tiles
  staged in shared memory, a dQ kernel and a dK/dV kernel (one block per key tile, looping over the
  ``G * Lq`` query rows of its kv head: no atomics). Two paths, picked by the launcher: bf16 / fp16
  inputs with ``D % 16 == 0`` and ``D <= 128`` run on tensor cores through ``nvcuda::wmma``
  (m16n16k16, i.e. ``mma.sync`` on sm_80 / sm_90; not Hopper's ``wgmma``), in the flash-attention
  manner: fp32 scores, softmax and accumulators, ``P`` and ``dS`` rounded to the input dtype only
  as tensor-core operands (dK/dV also multiplies their rounding errors, as a second operand, for
  accuracy); fp32 inputs and other head dims run CUDA-core fp32 FMA kernels. Available when
  ``lopd_kernels._C`` was built with CUDA. Tested on CPU under the SIMT emulator
  (``tests/kernels/test_varlen_cross_attention_cuda.py``, which emulates WMMA too); neither path has
  ever run on a GPU, so neither speed is measured.
* ``"auto"``: the ``"cpu"`` kernels for CPU tensors; Triton for CUDA tensors when Triton is
  importable, else the CUDA kernels (if built); else (and for float64) the reference. Not the
  CUDA kernels while Triton is there: nothing has measured them on a GPU yet. At the QFormer
  shape the op does ~``G * Lq`` flops per byte of ``k``/``v``, near the tensor cores' ridge
  point, so it is decided by tensor-core efficiency: Triton's Hopper ``tl.dot`` against WMMA
  (``mma.sync``) tiles whose accumulators pass through shared memory.
  ``benchmarks/gpu_qformer.py`` measures both, and flash-attn's ``flash_attn_varlen_func``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from lopd_kernels._backend import OpBackends, compiled_unavailable, triton_import_error
from lopd_kernels._custom_ops import CustomOps, input_grads
from lopd_kernels.op_outputs import VarlenCrossAttentionOpGrads, VarlenCrossAttentionOpOutput
from lopd_kernels.varlen_cross_attention_checks import check_inputs, check_values

__all__ = [
    "varlen_cross_attention",
    "varlen_cross_attention_reference",
]

OP = "varlen_cross_attention"
BACKENDS = OpBackends(
    OP,
    impls=("cpu", "cuda", "triton"),
    unavailable=compiled_unavailable(OP),
    auto={"cpu": ("cpu",), "cuda": ("triton", "cuda")},
)


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
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-item softmax attention written out (scores, log-sum-exp, weights); autograd-friendly.

    Works in any floating dtype including float64, which is what the tests compare every backend
    against; 16-bit inputs are computed in float32 and the output is rounded once.

    Args:
        q: ``[B, Lq, Hq, D]`` queries.
        k: ``[total_k, Hkv, D]`` packed keys.
        v: ``[total_k, Hkv, D]`` packed values.
        cu_seqlens_k: ``[B+1]`` int32 cumulative key lengths.
        scale: Softmax scale; ``D ** -0.5`` when ``None``.
        return_lse: Also return the ``[B, Hq, Lq]`` log-sum-exp of the scaled scores (float32,
            float64 for float64 inputs; ``-inf`` for an empty item).

    Returns:
        ``[B, Lq, Hq, D]`` (rows of an empty item are zeros), or a
        ``VarlenCrossAttentionOpOutput`` ``(out, lse)``.
    """
    batch, seq_q, n_q_heads, head_dim = q.shape
    group = n_q_heads // k.shape[1]
    scale = head_dim**-0.5 if scale is None else scale
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    bounds = cu_seqlens_k.tolist()
    outs, lses = [], []
    for b in range(batch):
        start, end = bounds[b], bounds[b + 1]
        if end == start:
            # The attention output of an empty set is defined as 0 (its lse as -inf).
            outs.append(q.new_zeros(seq_q, n_q_heads, head_dim, dtype=dtype))
            lses.append(q.new_full((n_q_heads, seq_q), -math.inf, dtype=dtype))
            continue
        # Query head h reads kv head h // G.
        kb = k[start:end].to(dtype).repeat_interleave(group, 1)  # [T, Hq, D]
        vb = v[start:end].to(dtype).repeat_interleave(group, 1)
        scores = torch.einsum("ihd,thd->hit", q[b].to(dtype), kb) * scale  # [Hq, Lq, T]
        lse = torch.logsumexp(scores, -1)
        weights = torch.exp(scores - lse.unsqueeze(-1))
        outs.append(torch.einsum("hit,thd->ihd", weights, vb))
        lses.append(lse)
    out = torch.stack(outs).to(q.dtype) if outs else q.new_zeros(q.shape)
    if not out.requires_grad:
        # No item has keys (an empty batch, or only empty items): the output is a constant 0;
        # an empty slice of each input keeps it in the graph, so that their gradients are 0.
        out = out + sum(x.flatten()[:0].sum() for x in (q, k, v)).to(out.dtype)
    if not return_lse:
        return out
    lse = torch.stack(lses) if lses else q.new_zeros((0, n_q_heads, seq_q), dtype=dtype)
    return VarlenCrossAttentionOpOutput(out, lse)


# --------------------------------------------------------------------------------------------
# Custom ops: varlen_cross_attention_{cpu,cuda}_{fwd,bwd} are declared in C++ (schemas in
# csrc/common/schemas.h), varlen_cross_attention_triton_{fwd,bwd} here. One schema for all
# three; fakes and autograd are registered for each by CUSTOM_OPS.
# --------------------------------------------------------------------------------------------


def _fwd_fake(q, k, v, cu_seqlens_k, scale, max_seqlen_k):
    batch, lq, hq, _ = q.shape
    return torch.empty_like(q), q.new_empty((batch, hq, lq), dtype=torch.float32)


def _bwd_fake(grad_out, grad_lse, q, k, v, out, lse, cu_seqlens_k, scale, max_seqlen_k):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class _FwdArgs(NamedTuple):
    """The arguments of ``varlen_cross_attention_<impl>_fwd`` (csrc/common/schemas.h)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens_k: torch.Tensor
    scale: float
    max_seqlen_k: int


def _setup_context(ctx, inputs, output) -> None:
    args, res = _FwdArgs(*inputs), VarlenCrossAttentionOpOutput(*output)
    ctx.save_for_backward(args.q, args.k, args.v, res.out, res.lse, args.cu_seqlens_k)
    ctx.scale = args.scale
    ctx.max_seqlen_k = args.max_seqlen_k


def _make_backward(bwd_op):
    """The autograd backward of a forward op (out and lse are differentiable), through
    ``bwd_op``."""

    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, cu_seqlens_k = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        if grad_lse is None:
            grad_lse = torch.zeros_like(lse)
        # -inf lse rows (empty items) may receive a gradient; it has no keys to flow into.
        grads = VarlenCrossAttentionOpGrads(*bwd_op(
            grad_out.contiguous(), grad_lse.contiguous(), q, k, v, out, lse, cu_seqlens_k,
            ctx.scale, ctx.max_seqlen_k,
        ))  # fmt: skip
        return input_grads(_FwdArgs._fields, q=grads.q, k=grads.k, v=grads.v)

    return backward


CUSTOM_OPS = CustomOps(OP, _fwd_fake, _bwd_fake, _setup_context, _make_backward)


def _triton_launchers():
    """The Triton launchers, imported on first use."""
    try:
        # triton is optional (machines without it use the other backends): imported lazily.
        from lopd_kernels.triton.varlen_cross_attention import varlen_xattn_bwd, varlen_xattn_fwd
    except ImportError as err:
        raise triton_import_error(OP, err) from err
    return varlen_xattn_fwd, varlen_xattn_bwd


def _triton_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
    max_seqlen_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton forward: returns ``out [B, Lq, Hq, D]`` and ``lse [B, Hq, Lq]`` (fp32)."""
    fwd, _ = _triton_launchers()
    return fwd(q, k, v, cu_seqlens_k, scale, max_seqlen_k)


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
    _, bwd = _triton_launchers()
    return bwd(grad_out, grad_lse, q, k, v, out, lse, cu_seqlens_k, scale, max_seqlen_k)


CUSTOM_OPS.define("triton", _triton_fwd, _triton_bwd)
CUSTOM_OPS.register_compiled()


# --------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------


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
            (``-inf`` for an empty item; float64 from the float64 reference); it is
            differentiable.

    Returns:
        ``[B, Lq, Hq, D]`` in q's dtype, or a ``VarlenCrossAttentionOpOutput`` ``(out, lse)``
        (lopd_kernels/op_outputs.py) when ``return_lse``.

    Raises:
        ValueError / TypeError: naming the offending argument for bad shapes, dtypes, devices,
            boundaries or backend.
    """
    check_inputs(q, k, v, cu_seqlens_k, max_seqlen_k, scale)
    check_values(k, cu_seqlens_k, max_seqlen_k, q.shape[0])
    impl = BACKENDS.resolve(backend, q.device, fp64=q.dtype == torch.float64)
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    if impl == "torch":
        return varlen_cross_attention_reference(
            q, k, v, cu_seqlens_k, scale=scale, return_lse=return_lse
        )
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if max_seqlen_k is None:
        if impl == "cpu":
            max_seqlen_k = 0  # unused by the CPU kernels: no need to read the boundaries
        else:
            lengths = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
            max_seqlen_k = int(lengths.max()) if lengths.numel() else 0
    res = VarlenCrossAttentionOpOutput(
        *CUSTOM_OPS.fwd_op(impl)(q, k, v, cu_seqlens_k, scale, int(max_seqlen_k))
    )
    return res if return_lse else res.out
