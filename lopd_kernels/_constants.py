"""Constants shared by the ops, their kernels and the trainer's configuration (one definition each).

Nothing here imports anything but torch, so every module of ``lopd_kernels`` (and ``lopd``) can
import it without an import cycle.
"""

from __future__ import annotations

import torch

#: The implementation words, the ``backend=`` values besides ``"auto"``; each means one thing for
#: every op that has it (:data:`BACKEND_MEANINGS`).
IMPLS = ("torch", "cpu", "cuda", "triton", "chunked")

#: What each ``backend=`` word runs (docs/kernels.md, ``python -m lopd_kernels.info``).
BACKEND_MEANINGS = {
    "auto": "per op and device type, the first of the op's implementations that can run here "
    "(its order: OpBackends.auto), else 'torch'; float64 inputs take 'torch'",
    "torch": "the op's PyTorch reference: plain autograd, float64-capable, the oracle of every "
    "test",
    "cpu": "C++ kernels for CPU tensors (lopd_kernels._C; AVX2 / AVX-512 chosen at run time)",
    "cuda": "hand-written CUDA kernels for CUDA tensors (lopd_kernels._C built with nvcc)",
    "triton": "Triton kernels (CUDA tensors; CPU tensors under TRITON_INTERPRET=1)",
    "chunked": "the LM-head chunk loop (lopd_kernels/chunked_linear.py), any device: one vendor "
    "GEMM (MKL / cuBLAS) per chunk of h @ W^T, then the per-row work on the chunk (topk_tail_kl's "
    "'auto' kernels there, or ATen passes)",
}

#: ``divergence=`` values of ``topk_tail_kl`` and ``fused_linear_topk_tail_kl``: KL(student ||
#: teacher) (the paper's), KL(teacher || student), and TRL's generalized Jensen-Shannon divergence
#: with ``beta`` (docs/math.md, section 1b).
DIVERGENCES = ("reverse", "forward", "jsd")

#: The two KL divergences: what ``sparse_teacher_topk_tail_kl`` and the trainer's methods take.
KL_DIVERGENCES = ("reverse", "forward")

#: ``support=`` values: whose top-M ids get their own buckets (the rest is one exact tail): the
#: teacher's (the paper's), the student's, or the union of both (up to 2M ids).
SUPPORTS = ("teacher", "student", "union")

#: ``reduction=`` values of the loss modules.
REDUCTIONS = ("none", "mean", "sum")

#: Input dtypes of the compiled and Triton kernels (all of them compute in float32).
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: Input dtypes of the references: the kernels' plus float64 (the test oracle's precision).
REFERENCE_DTYPES = (*KERNEL_DTYPES, torch.float64)

#: Largest ``top_m`` the Triton ``topk_tail_kl`` kernels take (besides 0, the full vocabulary):
#: known here without importing Triton, so backend choice never has to import it.
TRITON_TOPK_MAX_TOP_M = 256

#: Largest ``top_m`` the CUDA ``topk_tail_kl`` kernels take (csrc/cuda/topk_tail_kl_kernels.cuh).
CUDA_TOPK_MAX_TOP_M = 1024

#: Largest M (teacher top-M slots) the Triton ``sparse_teacher_topk_tail_kl`` kernels take.
TRITON_SPARSE_TEACHER_MAX_TOP_M = 256
