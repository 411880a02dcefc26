"""What ptxas reports for every CUDA kernel: registers, static shared memory, spills, per arch.

Compiles each ``csrc/cuda/*.cu`` with ``-Xptxas -v`` (compile only, under the CPU torch wheel's
headers, like tools/cuda_compile_check.sh) and prints one line per kernel and architecture,
template instances folded together when they agree. With the launch's block size and dynamic
shared memory (given per kernel below) it also prints how many blocks fit on one SM: the
occupancy a streaming kernel relies on to keep loads in flight. No GPU needed.

    python tools/cuda_resource_report.py [--arch 90a] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import torch.utils.cpp_extension as cpp

ROOT = Path(__file__).resolve().parents[1]
# (threads per block, dynamic shared memory bytes) of each kernel's launch, from its launcher,
# at a representative shape: topk_tail_kl with M = 20; varlen_cross_attention at the QFormer's
# D = 128, Lq = 32, G = Hq / Hkv = 4 (its shared memory grows with D and G * Lq).
LAUNCH = {
    ("topk_tail_kl.cu", "topk_tail_kl_fwd_kernel"): (256, 4096 * 8),
    ("topk_tail_kl.cu", "topk_tail_kl_bwd_kernel"): (256, 2 * 21 * 4),
    ("varlen_cross_attention.cu", "fwd_kernel"): (256, 57_600),
    ("varlen_cross_attention.cu", "dq_kernel"): (256, 69_888),
    ("varlen_cross_attention.cu", "dkdv_kernel"): (256, 74_240),
    ("varlen_cross_attention.cu", "delta_kernel"): (256, 0),
    # The tensor-core (WMMA) kernels of bf16 / fp16 inputs: fwd_wmma_smem / dq_wmma_smem /
    # dkdv_wmma_smem at D = 128 (independent of G * Lq).
    ("varlen_cross_attention.cu", "fwd_wmma_kernel"): (128, 112_640),
    ("varlen_cross_attention.cu", "dq_wmma_kernel"): (128, 109_568),
    ("varlen_cross_attention.cu", "dkdv_wmma_kernel"): (128, 158_976),
}
# Per-SM limits (sm_80: A100, sm_90a: H100/H200).
SM = {
    "80": {"regs": 65536, "smem": 164 * 1024, "threads": 2048, "blocks": 32},
    "90a": {"regs": 65536, "smem": 228 * 1024, "threads": 2048, "blocks": 32},
}


def blocks_per_sm(
    arch: str, regs: int, static_smem: int, file: str, kernel: str
) -> tuple[int, str] | None:
    launch = LAUNCH.get((file, kernel))
    if launch is None:
        return None
    threads, dyn = launch
    lim = SM[arch]
    # Registers are allocated per warp in units of 256.
    regs_per_warp = -(-regs * 32 // 256) * 256
    by = {
        "registers": lim["regs"] // (regs_per_warp * (threads // 32)),
        "shared memory": lim["smem"] // max(1, static_smem + dyn + 1024),  # 1 KB reserved/block
        "threads": lim["threads"] // threads,
        "blocks": lim["blocks"],
    }
    limiter = min(by, key=by.get)
    return by[limiter], limiter


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", action="append", choices=sorted(SM), help="default: all")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON")
    args = ap.parse_args()
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not Path(nvcc).exists():
        print("no nvcc found", file=sys.stderr)
        return 1
    includes = [f"-I{p}" for p in cpp.include_paths()] + [f"-I{ROOT / 'csrc'}"]
    rows = []
    for arch in args.arch or sorted(SM):
        for src in sorted((ROOT / "csrc" / "cuda").glob("*.cu")):
            cmd = [nvcc, "-std=c++20", f"-arch=sm_{arch}", "--expt-relaxed-constexpr", "-O3"]
            cmd += ["-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE", "-DLOPD_WITH_CUDA=1", *includes]
            cmd += ["-Xptxas", "-v", "-c", str(src), "-o", "/dev/null"]
            log = subprocess.run(cmd, capture_output=True, text=True)
            if log.returncode != 0:
                print(log.stderr[-3000:], file=sys.stderr)
                return log.returncode
            seen = defaultdict(set)
            kernel = None
            for line in log.stderr.splitlines():
                m = re.search(r"Compiling entry function '(\w+)'", line)
                if m:
                    demangled = subprocess.run(
                        ["c++filt"], input=m.group(1), capture_output=True, text=True
                    ).stdout.strip()
                    named = demangled.replace("(anonymous namespace)", "anon")
                    found = re.search(r"(\w+)\s*(?:<|\()", named)
                    kernel = found.group(1) if found else m.group(1)
                    continue
                m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
                if m and kernel:
                    spill = int(m.group(1)) + int(m.group(2))
                    continue
                m = re.search(r"Used (\d+) registers.*?(?:(\d+) bytes smem)?$", line)
                if m and kernel:
                    regs, smem = int(m.group(1)), int(m.group(2) or 0)
                    seen[kernel].add((regs, smem, spill))
            for kernel, variants in sorted(seen.items()):
                for regs, smem, spill in sorted(variants):
                    occ = blocks_per_sm(arch, regs, smem, src.name, kernel)
                    rows.append(
                        {
                            "file": src.name,
                            "kernel": kernel,
                            "arch": f"sm_{arch}",
                            "registers": regs,
                            "static_smem_bytes": smem,
                            "spill_bytes": spill,
                            "blocks_per_sm": occ[0] if occ else None,
                            "limited_by": occ[1] if occ else None,
                        }
                    )
    print(f"{'kernel':34} {'arch':7} {'regs':>4} {'smem':>6} {'spill':>5}  blocks/SM")
    for r in rows:
        occ = f"{r['blocks_per_sm']} ({r['limited_by']})" if r["blocks_per_sm"] else "-"
        print(
            f"{r['kernel']:34} {r['arch']:7} {r['registers']:>4} {r['static_smem_bytes']:>6} "
            f"{r['spill_bytes']:>5}  {occ}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
