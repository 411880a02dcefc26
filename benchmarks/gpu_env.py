"""The machine and its two ceilings, measured first in every GPU run.

    python benchmarks/gpu_env.py --env-json OUT/env.json

Writes the versions (python, torch, CUDA, Triton, transformers and the optional peers), the device
(name, capability, multiprocessors, memory) and two measured ceilings, each also a record (op
``device``): the device-to-device copy bandwidth (bytes read + written per second, on a 4 GiB
bf16 tensor: well past the 60 MB L2) and the dense bf16 matrix-product rate (8192^3, random
data, never zeros). Every benchmark's "% of copy bandwidth" is against a copy measured in its
own process; these are the run-level figures to compare them with.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as gc

PACKAGES = ("triton", "transformers", "trl", "datasets", "liger-kernel", "flash-attn", "peft")


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__,
                                  "cuda": torch.version.cuda}  # fmt: skip
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def matmul_tflops(device: torch.device, n: int, reps: int = 10) -> float:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, generator=g, device=device).to(dtype)
    b = torch.randn(n, n, generator=g, device=device).to(dtype)
    r = gc.time_fwd_bwd(lambda: a @ b, None, device, reps, warmup=3)
    return 2 * n**3 / r["fwd"] / 1e12


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env-json", required=True, help="where to write the environment")
    gc.add_common_args(parser, reps=10)
    args = parser.parse_args(argv)
    env: dict = {"versions": versions(), "commit": gc.git_commit()}
    device = gc.resolve_device(args.device)
    if device is None:
        env["device"] = None
        Path(args.env_json).write_text(json.dumps(env, indent=1) + "\n")
        return 0
    env["device"] = gc.device_name(device)
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(capability=f"{p.major}.{p.minor}", multiprocessors=p.multi_processor_count,
                   memory_bytes=p.total_memory)  # fmt: skip
    Path(args.env_json).write_text(json.dumps(env, indent=1) + "\n")  # before anything can fail
    rec = gc.Recorder(args.records, device)
    elems = 2**31 if args.size == "full" else 2**20
    x = torch.randn(elems, device=device, dtype=torch.float32).to(torch.bfloat16)
    copy = gc.copy_gbps(x, reps=args.reps)
    nbytes = 2 * x.numel() * x.element_size()
    del x
    rec.add("device", "copy", {"bytes": nbytes}, nbytes / copy / 1e9, copy_gbps=copy)
    n = 8192 if args.size == "full" else 256
    tflops = matmul_tflops(device, n, args.reps)
    dt = "bfloat16" if device.type == "cuda" else "float32"
    rec.add("device", "matmul", {"M": n, "N": n, "K": n, "dtype": dt}, 2 * n**3 / tflops / 1e12,
            tflops=tflops)  # fmt: skip
    env.update(copy_gbps=copy, matmul_tflops=tflops)
    Path(args.env_json).write_text(json.dumps(env, indent=1) + "\n")
    print(f"copy {copy:.0f} GB/s, {dt} matmul {tflops:.1f} TFLOP/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
