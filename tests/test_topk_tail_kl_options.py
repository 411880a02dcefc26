"""``support`` x ``divergence`` on every backend of ``topk_tail_kl``, against the float64
reference; and ``support="teacher"`` with the KLs bit for bit as before the options existed
(golden digests of the previous build: tests/topk_teacher_golden.py)."""

from __future__ import annotations

import json

import pytest

import lopd_kernels as lk
from lopd_kernels import _backend
from tests import topk_teacher_golden as golden

HAS_CPP = _backend.has_kernel("topk_tail_kl_cpu_fwd", "CPU")
requires_cpp = pytest.mark.skipif(not HAS_CPP, reason="lopd_kernels._C (C++ ops) is not built")


# --------------------------------------------------------------------------------- teacher: bits


def _recorded() -> dict:
    return json.loads(golden.GOLDEN.read_text())


@requires_cpp
@pytest.mark.parametrize("isa", golden.ISAS)
def test_teacher_support_kernels_bitwise_as_before(isa, monkeypatch):
    """Every output and both gradients of the C++ kernels with support="teacher" (reverse and
    forward KL, top-M and full vocabulary, three dtype pairs, strided rows, ties, -inf) hash to
    what the build before ``support`` / ``"jsd"`` produced, per ISA copy of the kernel."""
    data = _recorded()
    if golden.build_key() != data["compiler"]:
        pytest.skip(f"digests recorded with {data['compiler']}, this build: {golden.build_key()}")
    monkeypatch.setenv("LOPD_CPU_ISA", isa)
    got = golden.case_digests(lk.topk_tail_kl)
    assert got == data["digests"][isa]
