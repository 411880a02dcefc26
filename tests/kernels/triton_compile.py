"""Lowering Triton kernels to cubins without a GPU (Triton's own ptxas), for the tests that
check that the GPU path builds: the interpreter accepts code the compiler rejects (early returns,
non-constexpr globals, int64 loop bounds, dtype changes across loop iterations).

Each kernel test file writes a small script that calls :func:`compile_kernel` for its kernels and
prints ``compiled``; :func:`assert_script_compiles` runs it in a fresh interpreter without
``TRITON_INTERPRET`` (which would otherwise swap in the interpreter).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def compile_kernel(
    fn,
    arch: int,
    arg_type: Callable[[str], str],
    aligned: Callable[[str], bool],
    num_warps: int = 8,
    **constexprs,
) -> None:
    """Compiles the ``@triton.jit`` function ``fn`` for ``sm_<arch>``.

    Args:
        arg_type: Triton type string of each non-constexpr argument, e.g. ``"*bf16"``, ``"i32"``.
        aligned: which arguments are 16-divisible (pointers, strides), as Triton specializes
            aligned tensors at run time.
        constexprs: values of the kernel's ``tl.constexpr`` arguments.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {n: "constexpr" if n in constexprs else arg_type(n) for n in fn.arg_names}
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(fn.arg_names)
        if n not in constexprs and aligned(n)
    }
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    out = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    assert out.asm["cubin"], (fn.__name__, arch)


def assert_script_compiles(script: str) -> None:
    """Runs ``script`` in a fresh interpreter (no ``TRITON_INTERPRET``); it must print
    ``compiled``. Skips where Triton has no NVIDIA backend."""
    pytest.importorskip("triton.backends.nvidia", reason="needs Triton's NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-4000:]
