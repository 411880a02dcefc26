"""A small launch-configuration sweep of the Triton ``topk_tail_kl`` kernels (BLOCK_V x num_warps).

    python benchmarks/gpu_topk_sweep.py                # N=8192, V=151,936, bf16, M=20

Times the Triton launchers of ``lopd_kernels.triton.topk_tail_kl`` directly (their ``block_v`` /
``num_warps`` keywords; the public API always takes the defaults), forward (top-M, the streaming
pass with the running top-M) and backward, on the i.i.d. and the Zipf-like teacher of
``gpu_topk_tail_kl.py``. The default configuration runs first and is marked ``default``; each
configuration is one record (op ``topk_tail_kl_triton_sweep``, backend ``BLOCK_V=..,warps=..``)
with GB/s against the copy bandwidth measured in this process. What it is for: choosing the
launch defaults from measurements instead of register counts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as gc
from gpu_topk_tail_kl import SIZES, make_inputs

# (BLOCK_V, num_warps); the first is the launchers' default.
FWD_CONFIGS = {
    "full": [(2048, 8), (1024, 4), (1024, 8), (2048, 4), (4096, 8), (4096, 16)],
    "tiny": [(32, 4), (64, 4)],
}
BWD_CONFIGS = {
    "full": [(2048, 8), (1024, 8), (2048, 4), (4096, 8)],
    "tiny": [(64, 4)],
}


def sweep_teacher(args, rec, device, teacher: str) -> bool:
    from lopd_kernels.triton.topk_tail_kl import topk_tail_kl_bwd_triton, topk_tail_kl_fwd_triton

    n, v, m = SIZES[args.size]
    s, t, a = make_inputs(n, v, teacher, device, torch.bfloat16)
    s, t = s.detach(), t.detach()
    elt = s.element_size()
    copy = gc.copy_gbps(s)
    fwd_args = (s, t, a, m, 1.0, "reverse", 1.0, "teacher", -100)
    kl, _slp, _tlp, ids, lse, blp = topk_tail_kl_fwd_triton(*fwd_args)
    ones = torch.ones(n, device=device)
    bwd_args = (ones, ones, ones, s, t, a, ids, kl, lse, blp, 1.0, "reverse", 1.0, -100, True, True)
    shapes = {"N": n, "V": v, "M": m, "dtype": "bfloat16", "teacher": teacher}
    ok = True
    for pas, configs, launch, args_, nbytes in (
        ("fwd", FWD_CONFIGS[args.size], topk_tail_kl_fwd_triton, fwd_args, 2 * n * v * elt),
        ("bwd", BWD_CONFIGS[args.size], topk_tail_kl_bwd_triton, bwd_args, 4 * n * v * elt),
    ):
        for i, (block_v, warps) in enumerate(configs):

            def one(block_v=block_v, warps=warps, launch=launch, args_=args_, pas=pas, i=i,
                    nbytes=nbytes):  # fmt: skip
                call = lambda: launch(*args_, block_v=block_v, num_warps=warps)
                r = gc.time_fwd_bwd(call, None, device, args.reps, warmup=args.warmup)
                rec.add(
                    "topk_tail_kl_triton_sweep", f"BLOCK_V={block_v},warps={warps}",
                    {**shapes, "pass": pas}, r["fwd"], r["peak_bytes"], default=i == 0,
                    **gc.bandwidth_fields(nbytes, r["fwd"], copy),
                )  # fmt: skip

            ok &= gc.run_guarded(f"sweep {teacher} {pas} BLOCK_V={block_v} warps={warps}", one)
            gc.free_cuda(device)
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teachers", default="iid,zipf", help="comma-separated")
    args, device = gc.parse_args(parser, argv, reps=10)
    if device is None:
        return 0
    rec = gc.Recorder(args.records, device)
    ok = True
    for teacher in args.teachers.split(","):
        ok &= sweep_teacher(args, rec, device, teacher)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
