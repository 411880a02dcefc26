"""The CUDA kernels of ``csrc/cuda/`` run on the CPU by the SIMT emulator (``csrc/emu/``).

``load()`` compiles ``csrc/emu/*.cpp`` once per test run with g++ (``-DLOPD_SIMT_EMULATION``: the
kernel sources nvcc compiles, with the emulator in place of the CUDA runtime) into
``build/simt-emu/`` and registers ``torch.ops.lopd_simt_emu.*``: the same schemas as
``torch.ops.lopd.*``, on CPU tensors. ``topk_tail_kl_emulated`` and
``varlen_cross_attention_emulated`` wrap the emulated forwards and backwards like
``lopd_kernels`` wraps the real ones, so the CUDA tests run unchanged.

What passing under the emulator shows: the kernels' indexing, per-thread arithmetic, barrier and
warp-collective structure are right (divergent barriers are reported as errors). What it does
not show: speed, the memory model, or anything about the real toolchain's code generation.
"""

from __future__ import annotations

import functools
import importlib
import os
import shutil
from pathlib import Path

import torch

from lopd_kernels import kernel_variants
from lopd_kernels.topk_tail_kl import TopKTailKLOutput, call_fwd_op
from lopd_kernels.topk_tail_kl_checks import check_inputs

# The op modules (lopd_kernels exports functions of the same names).
topk_tail_kl = importlib.import_module("lopd_kernels.topk_tail_kl")
varlen_cross_attention = importlib.import_module("lopd_kernels.varlen_cross_attention")

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "csrc" / "emu").glob("*.cpp"))


def unavailable_reason() -> str | None:
    """Why the emulated build cannot be made here (None: it can)."""
    if shutil.which("g++") is None and shutil.which("c++") is None:
        return "no C++ compiler (g++) to build the SIMT-emulated CUDA kernels"
    if shutil.which("ninja") is None:
        return "ninja (torch.utils.cpp_extension) is needed to build the SIMT-emulated kernels"
    return None


# LOPD_SIMT_SANITIZE=address builds the emulated kernels with AddressSanitizer (the CPU stand-in
# for compute-sanitizer memcheck); the process must then run with libasan preloaded, see
# tests/kernels/test_simt_emulator.py::test_emulated_cuda_kernels_under_address_sanitizer.
SANITIZE = os.environ.get("LOPD_SIMT_SANITIZE", "")


@functools.cache
def load() -> None:
    """Builds (once; cached by torch.utils.cpp_extension) and loads the emulated ops."""
    from torch.utils import cpp_extension

    if SANITIZE not in ("", "address"):
        raise ValueError(f"LOPD_SIMT_SANITIZE must be '' or 'address', got {SANITIZE!r}")
    suffix = "-asan" if SANITIZE else ""
    build = ROOT / "build" / f"simt-emu{suffix}"
    build.mkdir(parents=True, exist_ok=True)
    # -O1: the emulated kernels run on small shapes; compile time dominates.
    cflags = ["-std=c++20", "-O1", "-DLOPD_SIMT_EMULATION", "-Wno-unknown-pragmas"]
    ldflags = []
    if SANITIZE:
        cflags += ["-g", "-fsanitize=address", "-fno-omit-frame-pointer"]
        ldflags += ["-fsanitize=address"]
    cpp_extension.load(
        name="lopd_simt_emu" + suffix.replace("-", "_"),
        sources=[str(s) for s in SOURCES],
        extra_include_paths=[str(ROOT / "csrc")],
        extra_cflags=cflags,
        extra_ldflags=ldflags,
        build_directory=str(build),
        is_python_module=False,
        verbose=False,
    )
    topk_tail_kl.CUSTOM_OPS.register_compiled("lopd_simt_emu")
    varlen_cross_attention.CUSTOM_OPS.register_compiled("lopd_simt_emu")
    # Its CUDA forward follows the process's kernel choice, like lopd's.
    kernel_variants.attach("lopd_simt_emu")


def set_schedule_seed(seed: int) -> None:
    """0: emulated threads resume round-robin; otherwise in a random order seeded by ``seed``."""
    load()
    torch.ops.lopd_simt_emu.set_schedule_seed(seed)


def topk_tail_kl_emulated(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    target_ids: torch.Tensor,
    *,
    top_m: int | None = 20,
    temperature: float = 1.0,
    divergence: str = "reverse",
    beta: float | None = None,
    support: str = "teacher",
    ignore_index: int = -100,
) -> TopKTailKLOutput:
    """``lopd_kernels.topk_tail_kl(..., backend="cuda")`` with the CUDA kernels emulated on CPU
    tensors ``[..., V]``; differentiable in both logits."""
    load()
    m = check_inputs(
        student_logits, teacher_logits, target_ids, top_m, temperature, divergence, ignore_index,
        beta, support,
    )  # fmt: skip
    return call_fwd_op(
        torch.ops.lopd_simt_emu.topk_tail_kl_cuda_fwd,
        student_logits, teacher_logits, target_ids, m, temperature, divergence, ignore_index,
        beta=beta, support=support,
    )  # fmt: skip


def varlen_cross_attention_emulated(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``lopd_kernels.varlen_cross_attention(..., backend="cuda")`` with the CUDA kernels emulated
    on CPU tensors; differentiable in ``q``, ``k``, ``v`` (and through ``lse``)."""
    load()
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    lengths = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    max_seqlen_k = int(lengths.max()) if lengths.numel() else 0
    out, lse = torch.ops.lopd_simt_emu.varlen_cross_attention_cuda_fwd(
        q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens_k, scale, max_seqlen_k
    )
    return (out, lse) if return_lse else out


def cuda_targets(op: str) -> list:
    """``pytest`` params ``"cuda"`` (the real kernels of ``torch.ops.lopd.<op>`` on a GPU; skipped
    without one) and ``"emulated"`` (the same kernels under this emulator), for a fixture that
    runs a CUDA test on both."""
    import pytest

    from lopd_kernels import _backend

    has_gpu_kernel = torch.cuda.is_available() and _backend.has_cuda_kernel(op)
    reason = unavailable_reason()
    return [
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(
                not has_gpu_kernel,
                reason=f"needs a CUDA device and lopd_kernels._C built with the CUDA {op} kernel",
            ),
        ),
        pytest.param("emulated", marks=pytest.mark.skipif(reason is not None, reason=str(reason))),
    ]


def prepare_target(where: str) -> str:
    """Loads the emulated ops (round-robin schedule) for ``"emulated"``; returns ``where``."""
    if where == "emulated":
        load()
        set_schedule_seed(0)
    return where
