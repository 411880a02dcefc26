"""lopd_kernels and the trainer import and run where Triton cannot be imported (a deployment
without a JIT compiler): "auto" then picks the compiled kernels or the references."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import sys

class BlockTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("triton is blocked in this test")

sys.meta_path.insert(0, BlockTriton())
import torch
import lopd_kernels as lk
from lopd_kernels import _backend

assert not _backend.triton_available()
s, t = torch.randn(4, 100), torch.randn(4, 100)
a = torch.randint(0, 100, (4,))
out = lk.topk_tail_kl(s.requires_grad_(), t, a)
out.kl.sum().backward()
q, k, v = torch.randn(2, 3, 4, 16), torch.randn(10, 2, 16), torch.randn(10, 2, 16)
cu = torch.tensor([0, 4, 10], dtype=torch.int32)
assert lk.varlen_cross_attention(q, k, v, cu).shape == q.shape
h = torch.randn(5, 8)
w = torch.randn(50, 8)
assert lk.fused_linear_topk_tail_kl(h, w, h, w, torch.arange(5), top_m=4).kl.shape == (5,)
import lopd.trainer  # noqa: F401
print("ok")
"""


def test_kernels_and_trainer_work_without_triton():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
