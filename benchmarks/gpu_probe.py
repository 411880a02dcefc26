"""Which backends run here: each op once on tiny inputs per backend, through the public API.

    python benchmarks/gpu_probe.py --env-json OUT/env.json [--backends triton,cuda,chunked]

Adds ``{"backends": {"<op>/<backend>": "ok" | "<error>"}}`` to the environment file and prints
it; exit status 0 when every probe ran. ``benchmarks/gpu_run.py`` runs it after the extension
build: a build that left out the CUDA kernels (or kernels that fail at once) shows here, and the
CUDA steps are skipped with this reason instead of failing one by one. A probe only checks that
a call returns finite values; correctness is the tests' job.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as gc


def probes(lk, device: torch.device, backend: str) -> dict:
    g = torch.Generator(device=device).manual_seed(0)

    def topk():
        s = torch.randn(3, 50, generator=g, device=device).requires_grad_(True)
        t = torch.randn(3, 50, generator=g, device=device).requires_grad_(True)
        a = torch.randint(0, 50, (3,), generator=g, device=device)
        out = lk.topk_tail_kl(s, t, a, top_m=4, backend=backend)
        (out.kl.sum() + out.student_logprob.sum()).backward()
        return out.kl, s.grad

    def fused():
        hs = torch.randn(4, 16, generator=g, device=device).requires_grad_(True)
        ht = torch.randn(4, 16, generator=g, device=device).requires_grad_(True)
        ws = torch.randn(40, 16, generator=g, device=device)
        wt = torch.randn(40, 16, generator=g, device=device)
        a = torch.randint(0, 40, (4,), generator=g, device=device)
        out = lk.fused_linear_topk_tail_kl(hs, ws, ht, wt, a, top_m=4, backend=backend)
        (out.kl.sum() + out.privilege.sum()).backward()
        return out.kl, hs.grad, ht.grad

    def varlen():
        q = torch.randn(2, 3, 2, 16, generator=g, device=device).requires_grad_(True)
        k = torch.randn(7, 1, 16, generator=g, device=device)
        cu = torch.tensor([0, 4, 7], dtype=torch.int32, device=device)
        out = lk.varlen_cross_attention(q, k, k, cu, max_seqlen_k=4, backend=backend)
        out.sum().backward()
        return out, q.grad

    # Each op with the backend words it has (docs/kernels.md, "Backends").
    ops = {
        "topk_tail_kl": (topk, ("cpu", "cuda", "triton")),
        "fused_linear_topk_tail_kl": (fused, ("chunked", "triton")),
        "varlen": (varlen, ("cpu", "cuda", "triton")),
    }
    return {op: fn for op, (fn, words) in ops.items() if backend in words}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env-json", required=True)
    parser.add_argument("--backends", default="triton,cuda,chunked", help="comma-separated")
    args, device = gc.parse_args(parser, argv, reps=1)
    if device is None:
        return 0
    import lopd_kernels as lk

    result = {}
    for backend in args.backends.split(","):
        for op, fn in probes(lk, device, backend).items():
            try:
                outs = fn()
                gc.sync(device)
                finite = all(bool(torch.isfinite(x).all()) for x in outs)
                result[f"{op}/{backend}"] = "ok" if finite else "non-finite output"
            except Exception as err:  # the message is the finding
                result[f"{op}/{backend}"] = f"{type(err).__name__}: {str(err)[:300]}"
    path = Path(args.env_json)
    env = json.loads(path.read_text()) if path.exists() else {}
    env["backends"] = result
    path.write_text(json.dumps(env, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0 if all(v == "ok" for v in result.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
