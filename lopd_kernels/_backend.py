"""Backend selection and loading of the compiled extension.

``import lopd_kernels`` always works: when ``lopd_kernels._C`` is missing (a pure-Python
install, or a build that failed) every op falls back to its PyTorch reference and one warning
says so.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

BACKENDS = ("auto", "torch", "cpu", "triton", "cuda")


@functools.cache
def extension_loaded() -> bool:
    """Whether ``lopd_kernels._C`` (the C++/CUDA ops) could be imported."""
    try:
        from lopd_kernels import _C  # noqa: F401
    except ImportError as err:
        warnings.warn(
            f"lopd_kernels._C could not be imported ({err}); falling back to the PyTorch "
            "reference kernels. Build it with `pip install --no-build-isolation -e .`.",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    return True


def has_cpp_op(name: str) -> bool:
    """Whether ``torch.ops.lopd.<name>`` is registered by the compiled extension."""
    return extension_loaded() and hasattr(torch.ops.lopd, name)


def has_cuda_kernel(name: str) -> bool:
    """Whether the extension was built with a CUDA implementation of ``torch.ops.lopd.<name>``."""
    if not has_cpp_op(name):
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"lopd::{name}", "CUDA")


@functools.cache
def triton_available() -> bool:
    """Whether Triton can run here: a CUDA device, or the interpreter (``TRITON_INTERPRET=1``)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
