"""Backends of the ops: one vocabulary, one resolver, one error; and loading of ``_C``.

Every ``backend=`` word means one thing for every op that has it (:data:`BACKEND_MEANINGS`):

* ``"torch"``: the op's PyTorch reference (float64-capable; the oracle of every test). Every op
  has it, and it is where ``"auto"`` ends when nothing else can run.
* ``"cpu"``: C++ kernels for CPU tensors, in ``lopd_kernels._C``.
* ``"cuda"``: hand-written CUDA kernels, in ``lopd_kernels._C`` built with nvcc.
* ``"triton"``: Triton kernels (CUDA tensors; CPU tensors under ``TRITON_INTERPRET=1``).
* ``"chunked"``: the LM-head chunk loop of the fused-linear ops
  (:mod:`lopd_kernels.chunked_linear`): vendor GEMMs per chunk, per-row work on each chunk; any
  device.

Each kernel implementation of op ``<op>`` is the custom-op pair ``torch.ops.lopd.<op>_<impl>_fwd``
and ``..._bwd``, the forward differentiable through the backward (names and registration:
:mod:`lopd_kernels._custom_ops`). An op module declares one :class:`OpBackends`: the words it has,
what this install lacks (:func:`compiled_unavailable`) and the order in which ``"auto"`` tries
implementations per device type. :meth:`OpBackends.resolve` turns a ``backend=`` argument into an
implementation word or raises :class:`BackendUnavailableError`, whose message always reads
``"<op>: backend='<b>' <reason>; ..."``.

Adding an op: give it a reference, declare its ``OpBackends`` and register ``<op>_<impl>_fwd/_bwd``
for each kernel through its ``CustomOps`` (C++ ops declared in ``csrc/common/schemas.h`` +
``csrc/ops.cpp``; Python ones defined by ``CustomOps.define`` in ``lopd_kernels/<op>.py``).
A second algorithm for a kernel keeps the op name and is chosen inside its launcher
(:mod:`lopd_kernels.kernel_variants`), so the resolver and the autograd wiring do not change.

``import lopd_kernels`` always works: when ``lopd_kernels._C`` is missing (a pure-Python install,
or a build that failed) the compiled implementations are unavailable and one warning says so.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from collections.abc import Mapping

import torch

from lopd_kernels._constants import BACKEND_MEANINGS, IMPLS
from lopd_kernels._custom_ops import NAMESPACE, op_name

BACKENDS = ("auto", *IMPLS)

EXTENSION_MISSING = (
    "needs the compiled extension lopd_kernels._C (build it with "
    "`pip install --no-build-isolation -e .`)"
)
CUDA_MISSING = (
    "needs lopd_kernels._C built with its CUDA kernels (a CUDA torch and nvcc at build time)"
)
NOT_BUILT = "has no kernel in this build of lopd_kernels._C"
TRITON_MISSING = "needs triton (pip install triton) and a CUDA device, or TRITON_INTERPRET=1"


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot run these inputs in this install (the op has no
    such implementation, this install lacks it, or the inputs are outside its limits)."""


def triton_import_error(op: str, err: ImportError) -> RuntimeError:
    """The error of a Triton implementation whose launchers cannot be imported (they are imported
    on first use: triton is optional)."""
    return RuntimeError(
        f"{op}: backend='triton' needs triton ({err}); install triton (pip install 'lopd[gpu]') "
        "or use backend='auto'"
    )


@functools.cache
def extension_loaded() -> bool:
    """Whether ``lopd_kernels._C`` (the C++/CUDA ops) could be imported."""
    try:
        # The compiled extension is optional (a pure-Python install has none): imported here,
        # once, so that a missing one costs a warning instead of the import of lopd_kernels.
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
    """Whether ``torch.ops.lopd.<name>`` is declared by the compiled extension."""
    return extension_loaded() and hasattr(torch.ops.lopd, name)


def has_cuda_kernel(name: str) -> bool:
    """Whether the extension was built with a CUDA implementation of ``torch.ops.lopd.<name>``."""
    return has_kernel(name, "CUDA")


def has_kernel(name: str, dispatch_key: str) -> bool:
    """Whether ``torch.ops.lopd.<name>`` has a kernel for ``dispatch_key`` ("CPU", "CUDA")."""
    if not has_cpp_op(name):
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"{NAMESPACE}::{name}", dispatch_key)


def compiled_unavailable(op: str) -> dict[str, str]:
    """Why this install cannot run ``<op>``'s compiled ``"cpu"`` / ``"cuda"`` implementations
    (absent key: it can), from the kernels ``lopd_kernels._C`` registered."""
    out = {}
    for impl, key in (("cpu", "CPU"), ("cuda", "CUDA")):
        if not extension_loaded():
            out[impl] = EXTENSION_MISSING
        elif not has_kernel(op_name(op, impl, "fwd"), key):
            out[impl] = CUDA_MISSING if impl == "cuda" else NOT_BUILT
    return out


_TRITON: list[bool] = []
_INTERPRET: list[bool] = []


@torch.compiler.assume_constant_result
def triton_interpreting() -> bool:
    """Whether Triton runs in its interpreter (``TRITON_INTERPRET=1``; read once: Triton reads it
    at import). ``torch.compile`` treats the answer as a constant."""
    if not _INTERPRET:
        _INTERPRET.append(os.environ.get("TRITON_INTERPRET") == "1")
    return _INTERPRET[0]


@torch.compiler.assume_constant_result
def triton_available() -> bool:
    """Whether Triton can run here: importable, and a CUDA device or the interpreter.

    Looked up once (importing triton takes a second, so it happens on first use, not at
    ``import lopd_kernels``); ``torch.compile`` treats the answer as a constant.
    """
    if not _TRITON:
        try:
            # triton is optional (machines without it use the other backends): imported lazily.
            import triton  # noqa: F401

            ok = torch.cuda.is_available() or triton_interpreting()
        except ImportError:
            ok = False
        _TRITON.append(ok)
    return _TRITON[0]


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


@dataclasses.dataclass(frozen=True)
class OpBackends:
    """Which implementations one op has, which can run, and which ``"auto"`` picks.

    Attributes:
        op: the op's name (``"topk_tail_kl"``), used in messages and custom-op names.
        impls: the implementation words the op has besides ``"torch"`` (every op has that).
        unavailable: implementation word -> why this install cannot run it at all (absent: it
            can, device permitting). Computed once at import of the op module.
        auto: device type -> implementations ``"auto"`` tries, in order (then ``"torch"``).
    """

    op: str
    impls: tuple[str, ...]
    unavailable: Mapping[str, str]
    auto: Mapping[str, tuple[str, ...]]

    def __post_init__(self) -> None:
        unknown = [i for i in (*self.impls, *(i for o in self.auto.values() for i in o))
                   if i not in IMPLS or i == "torch" or i not in self.impls]  # fmt: skip
        if unknown:
            raise ValueError(f"{self.op}: OpBackends names {unknown}, not implementations of it")

    def why_not(
        self, impl: str, device: torch.device, unsupported: Mapping[str, str] | None = None
    ) -> str | None:
        """Why ``impl`` cannot run on ``device`` (``None``: it can); ``unsupported`` adds
        per-call reasons (an argument outside an implementation's limits)."""
        if impl == "torch":
            return None
        if impl not in self.impls:
            others = ", ".join(repr(i) for i in ("torch", *self.impls))
            return (
                f"is not an implementation of this op ({BACKEND_MEANINGS[impl]}); it has {others}"
            )
        if impl == "cpu" and device.type != "cpu":
            return f"needs CPU tensors, got tensors on {device}"
        if impl == "cuda" and device.type != "cuda":
            return f"needs CUDA tensors, got tensors on {device}"
        if impl == "triton":
            if device.type not in ("cuda", "cpu") or (
                device.type == "cpu" and not triton_interpreting()
            ):
                return (
                    "needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1 set before "
                    f"triton is imported), got tensors on {device}"
                )
            if not triton_available():
                return TRITON_MISSING
        reason = self.unavailable.get(impl)
        if reason is None and unsupported:
            reason = unsupported.get(impl)
        return reason

    def resolve(
        self,
        backend: str,
        device: torch.device,
        *,
        fp64: bool = False,
        unsupported: Mapping[str, str] | None = None,
    ) -> str:
        """Maps ``backend`` (possibly ``"auto"``) to the implementation word that runs.

        Args:
            backend: one of :data:`BACKENDS`.
            device: where the inputs live.
            fp64: whether an input is float64 (only the reference computes in float64).
            unsupported: per-call limits, implementation word -> reason.

        Raises:
            ValueError: ``backend`` is not a backend name.
            TypeError: float64 inputs to a float32 implementation.
            BackendUnavailableError: an explicit backend that cannot run here.
        """
        check_backend(backend)
        if backend not in ("auto", "torch") and backend not in self.impls:
            raise self._unavailable(backend, self.why_not(backend, device))
        if fp64:
            if backend in ("auto", "torch"):
                return "torch"
            raise TypeError(
                f"{self.op}: backend={backend!r} computes in float32: it does not accept float64 "
                "inputs (fp32/bf16/fp16 only); use backend='torch' (the float64 reference) or "
                "cast the inputs"
            )
        if backend == "auto":
            for impl in self.auto.get(device.type, ()):
                if self.why_not(impl, device, unsupported) is None:
                    return impl
            return "torch"
        reason = self.why_not(backend, device, unsupported)
        if reason is not None:
            raise self._unavailable(backend, reason)
        return backend

    def _unavailable(self, backend: str, reason: str | None) -> BackendUnavailableError:
        return BackendUnavailableError(
            f"{self.op}: backend={backend!r} {reason}; backend='auto' picks an "
            "implementation that can run (at worst 'torch', the reference)"
        )
