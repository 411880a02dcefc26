"""Kernel variants: one switch per kernel that has a previous and a new implementation.

A new kernel that reads better in its compiled code (``tools/kernel_report.py``) may still run
slower on a real GPU, so until a GPU benchmark has timed both, the previous kernel stays
selectable: each switch names a kernel slot (an op's launcher picks the kernel from it at every
call) and its variants, the first of which is the previous kernel. ``benchmarks/
gpu_topk_tail_kl.py`` times every variant of a switch in the same process.

A switch is read from its environment variable at each call (so a benchmark can flip it between
calls, and a user can pin one without code changes), or set for a block with
:func:`use_variant`. The op, its schema, the backend resolver and autograd do not change: a
variant is chosen inside the launcher (``lopd_kernels/_backend.py``).

    LOPD_TOPK_TAIL_KL_TRITON_FWD=v2 python train.py
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator


@dataclasses.dataclass(frozen=True)
class Switch:
    """One kernel slot with selectable implementations.

    Attributes:
        env: the environment variable that selects the variant.
        choices: the variants; the first is the previous kernel.
        default: the variant used when ``env`` is unset.
        doc: what each variant is.
    """

    env: str
    choices: tuple[str, ...]
    default: str
    doc: str


SWITCHES: dict[str, Switch] = {
    "topk_tail_kl.triton_fwd": Switch(
        env="LOPD_TOPK_TAIL_KL_TRITON_FWD",
        choices=("v1", "v2"),
        default="v1",
        doc=(
            "Triton top-M forward (top_m >= 1; rows merged by the bitonic path, top_m > 64 by "
            "default, always run v1). v1: lopd_kernels/triton/topk_tail_kl_kernels.py, five "
            "block reductions per block on the common path, evicted student logits re-read "
            "from global memory. v2: lopd_kernels/triton/topk_tail_kl_kernels_v2.py, two "
            "tuple reductions per block on the common path, the top-M student logits kept in "
            "registers."
        ),
    ),
    "topk_tail_kl.cuda_fwd": Switch(
        env="LOPD_TOPK_TAIL_KL_CUDA_FWD",
        choices=("v1", "v2"),
        default="v2",
        doc=(
            "CUDA forward of topk_tail_kl (backend='cuda'; read by the C++ launcher, "
            "csrc/cuda/topk_tail_kl_launch.cuh). v1: csrc/cuda/topk_tail_kl_kernels.cuh, a "
            "branchy natural-log lse_add with accurate expf per entry and side, the 64-bit key "
            "built for every entry, one tile in flight, the full-vocabulary mode merging a "
            "one-entry state per entry. v2: csrc/cuda/topk_tail_kl_kernels_v2.cuh, base-2 tails "
            "(one FFMA + MUFU.EX2 per entry and side, one rescale per 8 entries, admitted "
            "candidates masked to -inf), a float compare before the 64-bit key, the next tile "
            "loaded while the current one is processed, and the same chunked base-2 state in "
            "the full-vocabulary mode."
        ),
    ),
    "fused_linear_logprob.cpu_half": Switch(
        env="LOPD_FUSED_LOGPROB_CPU_HALF",
        choices=("upcast", "native"),
        default="native",
        doc=(
            "GEMMs of fused_linear_logprob's C++ CPU op for a bfloat16 head (read by the C++ op, "
            "csrc/cpu/fused_linear_logprob.cpp). upcast: float32 GEMMs of operands converted a "
            "block at a time (float32 logits of the bf16 operands). native: bfloat16 GEMMs "
            "(oneDNN through at::mm, float32 accumulation, each block's logits and gradient "
            "products rounded to bfloat16, as torch.matmul on bf16 tensors gives them), on CPUs "
            "with AVX512-BF16 and LOPD_CPU_ISA not below avx512; float16 heads always upcast."
        ),
    ),
}


def variant(switch: str) -> str:
    """The variant ``switch`` selects now (its environment variable, else its default).

    Raises:
        KeyError: unknown switch.
        ValueError: the environment variable names no variant of the switch.
    """
    sw = SWITCHES[switch]
    value = os.environ.get(sw.env, sw.default)
    if value not in sw.choices:
        raise ValueError(
            f"{sw.env}={value!r} is not a variant of {switch}; choose one of {sw.choices}"
        )
    return value


@contextlib.contextmanager
def use_variant(switch: str, value: str) -> Iterator[None]:
    """Selects ``value`` for ``switch`` inside the block (restores the previous setting after)."""
    sw = SWITCHES[switch]
    if value not in sw.choices:
        raise ValueError(f"{value!r} is not a variant of {switch}; choose one of {sw.choices}")
    old = os.environ.get(sw.env)
    os.environ[sw.env] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(sw.env, None)
        else:
            os.environ[sw.env] = old
