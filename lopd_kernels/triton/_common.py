"""Helpers shared by the Triton kernels of every op (device functions, constants, launch flags).

``@triton.jit`` functions here are called from the kernels of ``lopd_kernels/triton/<op>.py``;
Triton inlines them. Module-level values a kernel reads must be ``tl.constexpr``.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)
#: Smallest float32 > -inf: the ranking key of a real entry whose logit is -inf, so that it still
#: outranks an empty / already-taken slot (key -inf).
NEG_BIG = -3.4028234663852886e38

# The same inside kernels (compiled kernels may only read constexpr globals).
LOG2E_C = tl.constexpr(LOG2E)
LN2_C = tl.constexpr(LN2)
NEG_BIG_C = tl.constexpr(NEG_BIG)


def interpreting() -> bool:
    """Whether kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def upcast_for_interpreter(dtype: torch.dtype) -> bool:
    """The ``UPCAST`` flag of :func:`dot` for operands of ``dtype``: only 16-bit floats under the
    interpreter."""
    return interpreting() and dtype in (torch.float16, torch.bfloat16)


@triton.jit
def dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``tl.dot`` with fp32 accumulation; ``UPCAST`` feeds it fp32 operands.

    Triton's interpreter (3.x) multiplies 16-bit float tiles as raw integers, so under
    ``TRITON_INTERPRET=1`` half-precision operands are upcast first; compiled kernels never are.
    """
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PRECISION)
