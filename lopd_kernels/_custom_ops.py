"""Custom-op names and their registration: one helper for every op of the library.

Each kernel implementation ``<impl>`` (``cpu``, ``cuda``, ``triton``: :data:`KERNEL_IMPLS`) of op
``<op>`` is a pair of custom ops, ``torch.ops.lopd.<op>_<impl>_fwd`` and ``..._bwd``, and all
implementations of an op share one schema. :func:`op_name` is the one place these names are
formed (the C++ declarations in ``csrc/ops.cpp`` take them from the schema macros of
``csrc/common/schemas.h``, which spell the same pattern; ``tests/kernels/test_kernel_library.py``
checks that every implementation of an op has the same schema).

An op module declares one :class:`CustomOps`: the fake (meta) implementations and the autograd
wiring its implementations share. It then registers each implementation through it:

* :meth:`CustomOps.define` for an implementation written in Python (the Triton ones, and every
  ``fused_linear_topk_tail_kl`` one): ``torch.library.custom_op`` on the annotated forward and
  backward functions, then :meth:`CustomOps.register`;
* :meth:`CustomOps.register_compiled` for the C++ / CUDA ops the extension declared: fakes and
  autograd for each of ``cpu`` and ``cuda`` the namespace holds (``lopd``, or the SIMT-emulated
  test build's ``lopd_simt_emu``, ``tests/kernels/simt_emu.py``).

The forward op of every implementation is then differentiable through that implementation's
backward op, and ``torch.compile(fullgraph=True)`` traces it through the fakes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from lopd_kernels._constants import IMPLS

__all__ = [
    "KERNEL_IMPLS",
    "NAMESPACE",
    "PHASES",
    "CustomOps",
    "input_grads",
    "op_name",
    "qualified_name",
]

#: The library of every op (``torch.ops.lopd``; ``TORCH_LIBRARY(lopd, m)`` in ``csrc/ops.cpp``).
NAMESPACE = "lopd"
#: The implementation words that are custom ops (``"torch"`` is the plain-autograd reference).
KERNEL_IMPLS = tuple(i for i in IMPLS if i != "torch")
#: The two ops of an implementation.
PHASES = ("fwd", "bwd")
#: The C++ implementations, declared by the compiled extension (``csrc/ops.cpp``).
COMPILED_IMPLS = ("cpu", "cuda")


def input_grads(fields: tuple[str, ...], **grads: Any) -> tuple:
    """An autograd backward's return value: one entry per input of the forward op, in its
    argument order ``fields`` (a NamedTuple's ``_fields``), the gradients given by name and None
    for every other input."""
    unknown = set(grads) - set(fields)
    if unknown:
        raise ValueError(f"no inputs named {sorted(unknown)}; the op takes {fields}")
    return tuple(grads.get(name) for name in fields)


def op_name(op: str, impl: str, phase: str) -> str:
    """``"<op>_<impl>_<phase>"``: the name of an implementation's custom op (``phase``: fwd/bwd)."""
    if impl not in KERNEL_IMPLS or phase not in PHASES:
        raise ValueError(f"no custom op for impl={impl!r}, phase={phase!r}")
    return f"{op}_{impl}_{phase}"


def qualified_name(op: str, impl: str, phase: str, namespace: str = NAMESPACE) -> str:
    """``"<namespace>::<op>_<impl>_<phase>"``, as ``torch.library`` takes it."""
    return f"{namespace}::{op_name(op, impl, phase)}"


@dataclasses.dataclass(frozen=True)
class CustomOps:
    """The custom ops of one op: their names, fakes and autograd, for every implementation.

    Attributes:
        op: the op's name (``"topk_tail_kl"``).
        fwd_fake: fake implementation of the forward schema (output shapes and dtypes only).
        bwd_fake: fake implementation of the backward schema.
        setup_context: ``torch.library.register_autograd``'s ``setup_context(ctx, inputs,
            output)`` for the forward op (what the backward needs is saved here).
        make_backward: ``bwd_op -> backward(ctx, *grad_outputs)``: the autograd backward of an
            implementation's forward op, computed by that implementation's backward op.
    """

    op: str
    fwd_fake: Callable[..., Any]
    bwd_fake: Callable[..., Any]
    setup_context: Callable[..., None]
    make_backward: Callable[[Any], Callable[..., Any]]

    def name(self, impl: str, phase: str) -> str:
        """``"<op>_<impl>_<phase>"`` (:func:`op_name`)."""
        return op_name(self.op, impl, phase)

    def ops(self, impl: str, namespace: str = NAMESPACE) -> tuple[Any, Any]:
        """``(torch.ops.<namespace>.<op>_<impl>_fwd, ..._bwd)``."""
        ns = getattr(torch.ops, namespace)
        return tuple(getattr(ns, op_name(self.op, impl, p)) for p in PHASES)

    def fwd_op(self, impl: str) -> Any:
        """``torch.ops.lopd.<op>_<impl>_fwd``, the op the public function calls."""
        return self.ops(impl)[0]

    def declared(self, impl: str, namespace: str = NAMESPACE) -> bool:
        """Whether ``<namespace>`` holds both ops of ``impl`` (the C++ ones exist only when the
        extension loaded)."""
        ns = getattr(torch.ops, namespace)
        return all(hasattr(ns, op_name(self.op, impl, p)) for p in PHASES)

    def define(
        self,
        impl: str,
        fwd: Callable[..., Any],
        bwd: Callable[..., Any],
        *,
        fwd_fake: Callable[..., Any] | None = None,
        bwd_mutates_args: tuple[str, ...] = (),
    ) -> tuple[Any, Any]:
        """Defines the Python functions ``fwd`` / ``bwd`` (type-annotated: the schema is inferred
        from them) as ``lopd::<op>_<impl>_fwd`` / ``_bwd`` and registers fakes and autograd.

        ``fwd_fake`` replaces :attr:`fwd_fake` for this implementation only (an implementation
        whose forward leaves an optional output empty). ``bwd_mutates_args``: the arguments the
        backward writes in place (an op whose forward formed the gradients, scaled in place by
        the upstream gradient). Returns the two ops.
        """
        for fn, phase, mutates in ((fwd, "fwd", ()), (bwd, "bwd", bwd_mutates_args)):
            torch.library.custom_op(qualified_name(self.op, impl, phase), fn, mutates_args=mutates)
        self.register(impl, fwd_fake=fwd_fake)
        return self.ops(impl)

    def register(
        self, impl: str, namespace: str = NAMESPACE, *, fwd_fake: Callable[..., Any] | None = None
    ) -> None:
        """Fakes for both ops of ``impl`` in ``namespace`` and autograd for its forward op
        (differentiated by its backward op)."""
        fwd_q, bwd_q = (qualified_name(self.op, impl, p, namespace) for p in PHASES)
        torch.library.register_fake(fwd_q)(fwd_fake or self.fwd_fake)
        torch.library.register_fake(bwd_q)(self.bwd_fake)
        _fwd, bwd_op = self.ops(impl, namespace)
        torch.library.register_autograd(
            fwd_q, self.make_backward(bwd_op), setup_context=self.setup_context
        )

    def register_compiled(self, namespace: str = NAMESPACE) -> tuple[str, ...]:
        """:meth:`register` for each C++ implementation (``cpu``, ``cuda``) whose ops
        ``namespace`` declares; returns those implementation words. For ``lopd``, call it after
        the extension was loaded (the op module's ``compiled_unavailable`` loads it)."""
        done = tuple(impl for impl in COMPILED_IMPLS if self.declared(impl, namespace))
        for impl in done:
            self.register(impl, namespace)
        return done
