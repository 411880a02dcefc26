"""GPU benchmark entry: QFormer compressor and its varlen cross-attention, bf16.

Same item mix as ``bench_qformer.py`` (12 items, T_j evenly spread over [200, 2000]) at the widths
of the paper's backbones: d = 2560 (Qwen3-4B: 32 heads, 8 kv heads, head dim 80) and d = 4096
(Qwen3-8B: 32 heads, 8 kv heads, head dim 128); K = 32 queries, 8 shared layers.

Measured (CUDA events, median of ``--reps``), each recorded in ``<out>/qformer_gpu.json``:

* module forward + backward: :class:`QFormerCompressor` (Triton attention, K/V once) vs the
  straightforward padded QFormer (K/V per layer, padding + mask, PyTorch SDPA);
* attention alone, forward + backward: ``varlen_cross_attention(backend="triton")`` vs the
  hand-written CUDA kernels (``backend="cuda"``: WMMA tensor cores for these bf16 shapes, when
  the extension was built with them), vs flash-attn's ``flash_attn_varlen_func`` (queries packed
  as ``B`` items of ``K`` rows) when it is importable, and vs padded PyTorch SDPA.

Peak memory is ``torch.cuda.max_memory_allocated`` above the inputs.

    python benchmarks/gpu_qformer.py --out DIR

Without a CUDA device it prints "no CUDA device: skipped" and exits 0. ``--device cpu`` runs a
tiny fp32 version (d = 64, three short items; the ``"cpu"`` attention backend) that only checks
that this script works (tests/test_gpu_scripts.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

WIDTHS = {2560: (32, 8), 4096: (32, 8)}  # d -> (heads, kv heads)
LENGTHS = torch.linspace(200, 2000, 12).round().int().tolist()
NUM_QUERIES, NUM_LAYERS = 32, 8
DEVICE, DTYPE = torch.device("cuda"), torch.bfloat16


def _time(fn, reps: int) -> tuple[float, int | None]:
    """Median seconds of ``fn()`` over ``reps`` runs (after one warm-up) and its peak bytes (CUDA
    events and the allocator's peak on a GPU; wall clock and no memory figure on the CPU)."""
    fn()
    if DEVICE.type != "cuda":
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times), None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times), torch.cuda.max_memory_allocated() - base


def _flash_attn_varlen():
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def _bench_width(d: int, heads: int, kv_heads: int, cu: torch.Tensor, reps: int) -> dict:
    """All rows for one width: name -> (median seconds, peak bytes)."""
    from lopd_kernels import QFormerCompressor, varlen_cross_attention
    from lopd_kernels._backend import has_cuda_kernel
    from lopd_kernels.qformer import straightforward_qformer

    device = cu.device
    total, t_max, batch = sum(LENGTHS), max(LENGTHS), len(LENGTHS)
    head_dim = d // heads
    torch.manual_seed(0)
    module = QFormerCompressor(d, heads, kv_heads, NUM_QUERIES, NUM_LAYERS)
    module = module.to(device=device, dtype=DTYPE)
    hidden = torch.randn(total, d, device=device, dtype=DTYPE, requires_grad=True)

    def fused():
        module(hidden, cu, max_seqlen=t_max).float().sum().backward()

    def baseline():
        straightforward_qformer(module, hidden, cu, padded=True).float().sum().backward()

    rows = {"module/fused": _time(fused, reps)}
    rows["module/straightforward_padded"] = _time(baseline, reps)

    # Attention alone: B items x K queries against the packed keys.
    q = torch.randn(batch, NUM_QUERIES, heads, head_dim, device=device, dtype=DTYPE)
    k = torch.randn(total, kv_heads, head_dim, device=device, dtype=DTYPE)
    v = torch.randn_like(k)
    for t in (q, k, v):
        t.requires_grad_()
    grad = torch.randn_like(q)

    main_backend = "triton" if device.type == "cuda" else "cpu"

    def attn_main():
        out = varlen_cross_attention(q, k, v, cu, max_seqlen_k=t_max, backend=main_backend)
        out.backward(grad)

    rows[f"attention/{main_backend}"] = _time(attn_main, reps)
    if device.type == "cuda" and has_cuda_kernel("varlen_cross_attention_cuda_fwd"):

        def attn_cuda():
            out = varlen_cross_attention(q, k, v, cu, max_seqlen_k=t_max, backend="cuda")
            out.backward(grad)

        rows["attention/cuda"] = _time(attn_cuda, reps)
    else:
        print("lopd_kernels._C has no CUDA varlen_cross_attention kernel: comparison skipped")
    flash_varlen = _flash_attn_varlen() if device.type == "cuda" else None
    if flash_varlen is not None:
        cu_q = torch.arange(0, (batch + 1) * NUM_QUERIES, NUM_QUERIES, device=device)
        cu_q = cu_q.to(torch.int32)
        q_packed = q.view(batch * NUM_QUERIES, heads, head_dim)

        def attn_flash():
            out = flash_varlen(q_packed, k, v, cu_q, cu, NUM_QUERIES, t_max)
            out.backward(grad.view_as(out))

        rows["attention/flash_attn_varlen_func"] = _time(attn_flash, reps)
    else:
        print("flash-attn not importable: flash_attn_varlen_func comparison skipped")

    k_pad = torch.zeros(batch, t_max, kv_heads, head_dim, device=device, dtype=DTYPE)
    v_pad = torch.zeros_like(k_pad)
    valid = torch.arange(t_max, device=device)[None] < (cu[1:] - cu[:-1])[:, None].long()
    k_pad[valid], v_pad[valid] = k.detach(), v.detach()
    k_pad.requires_grad_()
    v_pad.requires_grad_()

    def attn_sdpa_padded():
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k_pad.transpose(1, 2),
            v_pad.transpose(1, 2),
            attn_mask=valid[:, None, None, :],
            enable_gqa=True,
        )
        out.transpose(1, 2).backward(grad)

    rows["attention/sdpa_padded"] = _time(attn_sdpa_padded, reps)
    return rows


def run(out_dir: str, reps: int) -> None:
    os.environ["LOPD_BENCH_RESULTS"] = out_dir
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks.common import record

    cu = torch.zeros(len(LENGTHS) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(LENGTHS).cumsum(0)
    cu = cu.to(DEVICE)
    for d, (heads, kv_heads) in WIDTHS.items():
        shapes = {
            "items": len(LENGTHS),
            "T": "200..2000 (evenly spread)",
            "d": d,
            "heads": heads,
            "kv_heads": kv_heads,
            "K": NUM_QUERIES,
            "layers": NUM_LAYERS,
            "dtype": str(DTYPE).removeprefix("torch."),
            "pass": "fwd+bwd",
        }
        rows = _bench_width(d, heads, kv_heads, cu, reps)
        print(f"d={d} heads={heads}/{kv_heads} {shapes['dtype']}, items {LENGTHS}")
        for name, (seconds, peak) in rows.items():
            mem = "n/a" if peak is None else f"{peak / 2**20:.0f} MiB"
            print(f"  {name:<36}{seconds * 1e3:>10.2f} ms{mem:>10}")
            record("qformer_gpu", name, shapes, seconds, peak, device=DEVICE.type)
        speedup = rows["module/straightforward_padded"][0] / rows["module/fused"][0]
        print(f"  module speedup {speedup:.1f}x")
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results", help="results directory")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument(
        "--device", default="cuda", help="cuda (default); 'cpu' only smoke-tests this script"
    )
    args = parser.parse_args(argv)
    global DEVICE, DTYPE, WIDTHS, LENGTHS, NUM_LAYERS
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: skipped")
        return 0
    if args.device != "cuda":
        DEVICE, DTYPE = torch.device(args.device), torch.float32
        WIDTHS, LENGTHS, NUM_LAYERS = {64: (4, 2)}, [7, 13, 3], 2
    Path(args.out).mkdir(parents=True, exist_ok=True)
    run(args.out, args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
