"""GPU benchmark of the varlen cross-attention and the QFormer compressor: one variant per process.

    python benchmarks/gpu_qformer.py --variant triton           # bf16, d = 2560 and 4096

Same item mix as ``bench_qformer.py`` (12 items, T_j evenly spread over [200, 2000]) at the widths
of the paper's backbones: d = 2560 (Qwen3-4B: 32 heads, 8 kv heads, head dim 80) and d = 4096
(Qwen3-8B: 32 heads, 8 kv heads, head dim 128); K = 32 queries, 8 shared layers.

Variants (``--variant``), forward and backward timed apart, with peak memory:

* attention alone, ``B`` items x ``K`` queries against the packed keys (op
  ``varlen_cross_attention``): ``triton`` and ``cuda`` (``lk.varlen_cross_attention(backend=)``),
  ``sdpa_padded`` (PyTorch SDPA on keys padded to the longest item, with a key mask: what one
  writes without a varlen kernel), ``flash_attn_varlen`` (flash-attn's ``flash_attn_varlen_func``,
  queries packed as B items of K rows; only when the package is importable);
* the whole module (op ``qformer``): ``module_fused`` (:class:`lk.QFormerCompressor`, K/V of H
  once, varlen attention) and ``module_padded`` (the usual QFormer with the same weights: K/V per
  layer, padding + mask, SDPA).

The inputs (27 MB of keys and values at d = 4096) fit in the 60 MB L2 cache: these figures are of
warm-cache attention, as inside a training step that has just computed the keys.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as gc

VARIANTS = (
    "triton", "cuda", "sdpa_padded", "flash_attn_varlen", "module_fused", "module_padded",
)  # fmt: skip
# size -> ({d: (heads, kv heads)}, item lengths, queries K, layers)
SIZES = {
    "full": ({2560: (32, 8), 4096: (32, 8)}, torch.linspace(200, 2000, 12).round().int().tolist(),
             32, 8),
    "tiny": ({64: (4, 2)}, [7, 13, 3], 4, 2),
}  # fmt: skip


def _attention_fns(variant, lk, q, k, v, cu, t_max, grad, device):
    """``(forward, backward)`` of one attention variant on the packed inputs."""
    batch, n_q, heads, head_dim = q.shape
    if variant in ("triton", "cuda"):
        # CPU dry run: the C++ kernel stands in for CUDA (Triton runs under its interpreter)
        backend = "cpu" if variant == "cuda" and device.type != "cuda" else variant
        fwd = lambda: lk.varlen_cross_attention(q, k, v, cu, max_seqlen_k=t_max, backend=backend)
        return fwd, lambda out: out.backward(grad)
    if variant == "flash_attn_varlen":
        from flash_attn import flash_attn_varlen_func

        cu_q = torch.arange(0, (batch + 1) * n_q, n_q, device=device, dtype=torch.int32)
        q_packed = q.view(batch * n_q, heads, head_dim)
        fwd = lambda: flash_attn_varlen_func(q_packed, k, v, cu_q, cu, n_q, t_max)
        return fwd, lambda out: out.backward(grad.view_as(out))
    if variant == "sdpa_padded":
        kv_heads = k.shape[1]
        lengths = (cu[1:] - cu[:-1]).long()
        valid = torch.arange(t_max, device=device)[None] < lengths[:, None]
        k_pad = torch.zeros(batch, t_max, kv_heads, head_dim, device=device, dtype=k.dtype)
        v_pad = torch.zeros_like(k_pad)
        k_pad[valid], v_pad[valid] = k.detach(), v.detach()
        k_pad.requires_grad_(True)
        v_pad.requires_grad_(True)
        mask = valid[:, None, None, :]

        def fwd():
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k_pad.transpose(1, 2), v_pad.transpose(1, 2),
                attn_mask=mask, enable_gqa=True,
            )  # fmt: skip
            return out.transpose(1, 2)

        return fwd, lambda out: out.backward(grad)
    raise ValueError(variant)


def bench_width(args, lk, rec, device, dtype, d, heads, kv_heads, lengths, n_q, layers) -> None:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    cu = cu.to(device)
    total, t_max, batch = sum(lengths), max(lengths), len(lengths)
    g = torch.Generator(device=device).manual_seed(0)
    shapes = {"items": batch, "T": f"{min(lengths)}..{max(lengths)}", "d": d, "heads": heads,
              "kv_heads": kv_heads, "K": n_q,
              "dtype": str(dtype).removeprefix("torch.")}  # fmt: skip
    if args.variant.startswith("module_"):
        from lopd_kernels.qformer import straightforward_qformer

        torch.manual_seed(0)
        module = lk.QFormerCompressor(d, heads, kv_heads, n_q, layers).to(device, dtype)
        hidden = torch.randn(total, d, generator=g, device=device).to(dtype).requires_grad_(True)
        if args.variant == "module_fused":
            fwd = lambda: module(hidden, cu, max_seqlen=t_max)
        else:
            fwd = lambda: straightforward_qformer(module, hidden, cu, padded=True)
        bwd = lambda out: out.float().sum().backward()

        def clear() -> None:
            module.zero_grad(set_to_none=True)
            hidden.grad = None

        op, shapes = "qformer", {**shapes, "layers": layers}
    else:
        head_dim = d // heads
        q = torch.randn(batch, n_q, heads, head_dim, generator=g, device=device).to(dtype)
        k = torch.randn(total, kv_heads, head_dim, generator=g, device=device).to(dtype)
        v = torch.randn(total, kv_heads, head_dim, generator=g, device=device).to(dtype)
        grad = torch.randn(batch, n_q, heads, head_dim, generator=g, device=device).to(dtype)
        for x in (q, k, v):
            x.requires_grad_(True)
        fwd, bwd = _attention_fns(args.variant, lk, q, k, v, cu, t_max, grad, device)

        def clear() -> None:
            q.grad = k.grad = v.grad = None

        op = "varlen_cross_attention"
    r = gc.time_fwd_bwd(fwd, bwd, device, args.reps, clear, warmup=args.warmup)
    for pas in ("fwd", "bwd", "fwd+bwd"):
        rec.add(op, args.variant, {**shapes, "pass": pas}, r[pas],
                r["peak_bytes"] if pas == "fwd+bwd" else None)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", required=True, choices=VARIANTS)
    args, device = gc.parse_args(parser, argv, reps=20)
    if device is None:
        return 0
    import lopd_kernels as lk

    widths, lengths, n_q, layers = SIZES[args.size]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rec = gc.Recorder(args.records, device)
    ok = True
    for d, (heads, kv_heads) in widths.items():
        ok &= gc.run_guarded(
            f"{args.variant} d={d}",
            lambda d=d, heads=heads, kv_heads=kv_heads: bench_width(
                args, lk, rec, device, dtype, d, heads, kv_heads, lengths, n_q, layers
            ),
        )
        gc.free_cuda(device)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
