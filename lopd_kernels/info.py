"""What this install of lopd_kernels was built with and will use: ``python -m lopd_kernels.info``.

In the manner of ``python -m xformers.info`` and ``torch.__config__.show()``: the compiled
extension (loaded or not, the torch it was built against, the CPU instruction set its kernels
use here, the CUDA architectures compiled), Triton (version, whether it imports, interpreter),
what each ``backend=`` word runs (one meaning for every op), the kernel slots' choices
(:mod:`lopd_kernels.kernel_variants`), and for every op its implementations and the one
``backend="auto"`` picks on this machine for CPU and for CUDA tensors
(:class:`lopd_kernels._backend.OpBackends`). The build facts come from
``lopd_kernels._C.build_info()`` (csrc/module.cpp).
"""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
from typing import Any

import torch

import lopd_kernels
from lopd_kernels import _backend, kernel_variants
from lopd_kernels._constants import BACKEND_MEANINGS
from lopd_kernels.fused_linear_logprob import BACKENDS as FUSED_LINEAR_LOGPROB
from lopd_kernels.fused_linear_topk_tail_kl import BACKENDS as FUSED_LINEAR
from lopd_kernels.sparse_teacher_topk_tail_kl import BACKENDS as SPARSE_TEACHER_TOPK_TAIL_KL
from lopd_kernels.topk_tail_kl import BACKENDS as TOPK_TAIL_KL
from lopd_kernels.varlen_cross_attention import BACKENDS as VARLEN_CROSS_ATTENTION

__all__ = ["collect", "main"]

OPS = (
    TOPK_TAIL_KL,
    FUSED_LINEAR,
    SPARSE_TEACHER_TOPK_TAIL_KL,
    FUSED_LINEAR_LOGPROB,
    VARLEN_CROSS_ATTENTION,
)


def _triton() -> dict[str, Any]:
    spec = importlib.util.find_spec("triton")
    out: dict[str, Any] = {"installed": spec is not None, "version": None, "imports": False}
    if spec is not None:
        try:
            # triton is optional (this report runs on machines without it): imported lazily.
            import triton

            out["version"] = triton.__version__
            out["imports"] = True
        except ImportError as err:  # installed but broken (no compiler, wrong torch, ...)
            out["error"] = str(err)
    out["interpreter"] = os.environ.get("TRITON_INTERPRET") == "1"
    out["usable"] = _backend.triton_available()
    return out


def _extension() -> dict[str, Any]:
    if not _backend.extension_loaded():
        return {"loaded": False}
    # The compiled extension is optional; extension_loaded() just imported it.
    from lopd_kernels import _C

    return {
        "loaded": True,
        "path": _C.__file__,
        **_C.build_info(),
        "cpu_isa": _C.cpu_isa(),
        "cpu_isa_cap": os.environ.get("LOPD_CPU_ISA"),
        "cpu_buffer_cache": _C.cpu_buffer_cache_stats(),
    }


def _auto_choices() -> dict[str, dict[str, str]]:
    out = {}
    for spec in OPS:
        row = {}
        for device in ("cpu", "cuda"):
            row[device] = spec.resolve("auto", torch.device(device))
        row["impls"] = ["torch", *spec.impls]
        row["unavailable"] = {
            impl: why for impl, why in spec.unavailable.items() if impl in spec.impls
        }
        out[spec.op] = row
    return out


def collect() -> dict[str, Any]:
    """Everything :func:`main` prints, as a dict."""
    return {
        "lopd_kernels": lopd_kernels.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "threads": torch.get_num_threads(),
        "extension": _extension(),
        "triton": _triton(),
        "backends": dict(BACKEND_MEANINGS),
        "kernel_slots": {name: kernel_variants.selected(name) for name in kernel_variants.SLOTS},
        "auto": _auto_choices(),
    }


def _lines(info: dict[str, Any]) -> list[str]:
    ext, tri = info["extension"], info["triton"]
    out = [
        f"lopd_kernels {info['lopd_kernels']}  (python {info['python']}, {info['platform']})",
        f"torch {info['torch']}  cuda {info['torch_cuda'] or '-'}  "
        f"device {info['cuda_device'] or 'no CUDA device'}  threads {info['threads']}",
        "",
        "compiled extension lopd_kernels._C:",
    ]
    if not ext["loaded"]:
        out.append("  not loaded: every op runs its PyTorch reference (backend 'torch')")
    else:
        cache = ext["cpu_buffer_cache"]
        cap = f" (capped by LOPD_CPU_ISA={ext['cpu_isa_cap']})" if ext["cpu_isa_cap"] else ""
        out += [
            f"  built against torch {ext['torch_version']} with {ext['compiler']}, "
            f"C++{ext['cxx_standard'] // 100 % 100}, OpenMP {ext['openmp'] or 'off'}",
            f"  CPU kernels: {', '.join(ext['cpu_isas_compiled'])} compiled; this machine uses "
            f"{ext['cpu_isa']}{cap}",
            "  CUDA kernels: "
            + (f"compiled for {ext['cuda_archs']}" if ext["with_cuda"] else "not built"),
            f"  CPU buffer cache: {'on' if cache['enabled'] else 'off'}, "
            f"{cache['cached_blocks']} block(s) / {cache['cached_bytes'] / 2**20:.0f} MiB held, "
            f"{cache['hits']} hits, {cache['misses']} misses",
        ]
    triton_state = (
        f"{tri['version']}, {'usable' if tri['usable'] else 'imports but no CUDA device'}"
        if tri["imports"]
        else ("installed but does not import" if tri["installed"] else "not installed")
    )
    if tri["interpreter"]:
        triton_state += " (TRITON_INTERPRET=1: the interpreter)"
    out += ["", f"triton: {triton_state}", "", "backend= words (the same meaning for every op):"]
    width = max(len(word) for word in info["backends"])
    for word, meaning in info["backends"].items():
        out.append(f"  {word:<{width}}  {meaning}")
    out += ["", "kernel slots (lopd_kernels.kernel_variants.select):"]
    for name, value in info["kernel_slots"].items():
        choices = " | ".join(kernel_variants.SLOTS[name].choices)
        out.append(f"  {name}: {value}  ({choices})")
    out += ["", 'implementations, and what backend="auto" picks on this machine:']
    if not info["cuda_available"]:
        out.append("  (no CUDA device here: the CUDA column is what CUDA tensors would get)")
    width = max(len(op) for op in info["auto"])
    for op, row in info["auto"].items():
        out.append(f"  {op:<{width}}  {', '.join(row['impls'])}")
        out.append(f"  {'':<{width}}  auto: CPU tensors -> {row['cpu']:<7} CUDA tensors -> "
                   f"{row['cuda']}")  # fmt: skip
        for impl, why in row["unavailable"].items():
            out.append(f"  {'':<{width}}  ({impl}: {why})")
    return out


def main(argv: list[str] | None = None) -> int:
    print("\n".join(_lines(collect())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
