"""Shared test helpers: the per-dtype tolerance table, comparison utilities, and what this
machine runs (``HAS_CPP`` / ``HAS_TRITON`` and their ``requires_*`` marks, ``requires_cuda``),
defined here once for every test folder. Helpers of one layer live in that folder
(``tests/kernels/utils.py``, ``tests/kernels/fused_linear_utils.py``).

Every kernel test compares against a float64 PyTorch reference; tolerances depend only on the
*input* dtype (the kernels compute in float32 whatever the input dtype).
"""

from __future__ import annotations

import os

import pytest
import torch

from lopd_kernels import _backend

# (rtol, atol) per input dtype, for outputs and gradients compared with a float64 reference
# evaluated on the same (already rounded) inputs. fp32 kernels accumulate over V up to 151,936
# terms, hence atol above machine epsilon; bf16/fp16 bounds cover rounding of the *gradients*
# back to the input dtype.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-9, 1e-10),
    torch.float32: (2e-5, 2e-6),
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (2e-2, 8e-3),
}


def tol(dtype: torch.dtype) -> dict[str, float]:
    """``dict(rtol=..., atol=...)`` for ``torch.testing.assert_close`` at this input dtype."""
    rtol, atol = TOLERANCES[dtype]
    return {"rtol": rtol, "atol": atol}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, msg: str = ""):
    """Compare in float64 with the tolerance of ``dtype``; NaN never passes."""
    assert not torch.isnan(actual).any(), f"{msg}: NaN in result"
    torch.testing.assert_close(
        actual.detach().double(),
        expected.detach().double(),
        msg=lambda detail: f"{msg}: {detail}",  # keep torch's count and largest mismatch
        **tol(dtype),
    )


def assert_close_reordered(
    actual: torch.Tensor, expected: torch.Tensor, model: torch.nn.Module, msg: str = ""
) -> None:
    """Compare two fp32 forward passes of ``model`` that differ only in summation order.

    Not a kernel-vs-reference check (that is :func:`assert_close`): two paths through a library
    model (a padded batch vs a lone row, masked vs unmasked calls) reduce over different key
    lengths, so BLAS blocks the same sums differently, whatever the attention backend (seen:
    5.7e-6 on logits of magnitude ~20 for the tiny model, eager and SDPA alike). The bound is a
    few fp32 roundings per layer at the scale of the logits: ``4 * eps * (layers + 1) * max|x|``.
    A real padding or masking bug moves logits by orders of magnitude more.
    """
    assert not torch.isnan(actual).any(), f"{msg}: NaN in result"
    layers = int(getattr(model.config, "num_hidden_layers", 1))
    scale = float(expected.detach().abs().max())
    atol = 4 * torch.finfo(torch.float32).eps * (layers + 1) * max(scale, 1.0)
    torch.testing.assert_close(
        actual.detach().double(), expected.detach().double(), rtol=0.0, atol=atol, msg=msg
    )


def triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Where tests of the Triton kernels put their tensors: the GPU when there is one (real kernels),
# else the CPU, where conftest.py has set TRITON_INTERPRET=1.
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# Which backends this machine runs, for every test module (one definition, one skip reason each).
def has_cpp(op: str = "topk_tail_kl") -> bool:
    """Whether ``lopd_kernels._C`` registered ``op``'s C++ CPU kernels (the extension is built)."""
    return _backend.has_kernel(f"{op}_cpu_fwd", "CPU")


def _has_triton() -> bool:
    """Triton runs here (importable; a CUDA device or ``TRITON_INTERPRET=1``) and the package's
    Triton launchers import."""
    if not _backend.triton_available():
        return False
    try:
        import lopd_kernels.triton.topk_tail_kl  # noqa: F401
    except ImportError:
        return False
    return True


HAS_CPP = has_cpp()
HAS_TRITON = _has_triton()
requires_cpp = pytest.mark.skipif(not HAS_CPP, reason="lopd_kernels._C (C++ ops) is not built")
requires_triton = pytest.mark.skipif(
    not HAS_TRITON, reason="triton (GPU or TRITON_INTERPRET=1) or its launchers absent"
)
# The Triton kernels on CPU tensors: only the interpreter runs them there.
requires_triton_interpret = pytest.mark.skipif(
    not triton_interpret(), reason="needs TRITON_INTERPRET=1 (Triton on CPU tensors)"
)
