"""Golden digests of the C++ ``topk_tail_kl`` kernels with ``support="teacher"``: the bytes of
every output and both gradients, recorded from the build before ``support`` and ``"jsd"``
existed, so that a test can show the teacher-support reverse / forward kernels are bitwise
unchanged.

The inputs come from integer hashing (no random number generator whose stream could change
between torch versions): odd V, ``-inf`` entries, exact ties, an ignored row, three dtype pairs,
dense and row-strided ``[B, L, V]`` layouts. A digest depends on the compiler and the ISA copy
of the kernel (``LOPD_CPU_ISA``), so the recorded file is keyed by both; a build with another
compiler has nothing to compare against (the test says so and skips).

``python -m tests.kernels.topk_teacher_golden OUT.json`` records the digests of the ``lopd_kernels``
that Python imports (run it with the previous build on ``PYTHONPATH`` to refresh the file).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from pathlib import Path

import torch

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "topk_tail_kl_teacher_digests.json"
ISAS = ("default", "avx2", "avx512")

# (name, rows, V, student dtype, teacher dtype, top_m, divergence, temperature, strided)
CASES = [
    ("f32_m20_rev", 6, 4099, torch.float32, torch.float32, 20, "reverse", 0.9, False),
    ("f32_m20_fwd", 6, 4099, torch.float32, torch.float32, 20, "forward", 1.3, False),
    ("bf16_m5_rev_strided", 6, 1031, torch.bfloat16, torch.bfloat16, 5, "reverse", 1.0, True),
    ("f16f32_m1_fwd", 5, 257, torch.float16, torch.float32, 1, "forward", 0.7, False),
    ("f32_full_rev", 5, 515, torch.float32, torch.float32, None, "reverse", 1.1, False),
    ("bf16_full_fwd_strided", 6, 333, torch.bfloat16, torch.bfloat16, None, "forward", 0.8, True),
]


def _hashed(n: int, salt: int) -> torch.Tensor:
    """``n`` float64 values in [-1, 1) from an integer hash of (index, salt): reproducible
    bit for bit on any machine and torch version."""
    i = torch.arange(n, dtype=torch.int64) + salt * 1_000_003
    h = (i * 2654435761 + 12345) % 4294967296
    h = (h ^ (h >> 13)) * 1274126177 % 4294967296
    return (h % 1_000_000).double() / 500_000.0 - 1.0


def make_case(rows: int, vocab: int, s_dtype, t_dtype, strided: bool):
    """``(student, teacher, target, upstream)`` of one case; strided: ``[B, L, V]`` views with a
    dropped last position (``logits[:, :-1]``)."""
    t = _hashed(rows * vocab, 1).reshape(rows, vocab) * 4.0
    s = t + _hashed(rows * vocab, 2).reshape(rows, vocab) * 1.5
    # Exact ties in the teacher (equal values at several ids) and a padded vocabulary.
    t[:, 3] = t[:, 7] = t[:, 11] = 5.0
    s[:, 5] = s[:, 9] = 4.5
    s[:, -3:] = -math.inf
    t[:, -3:] = -math.inf
    target = (torch.arange(rows) * 37 + 11) % (vocab - 3)
    target[2] = -100
    s, t = s.to(s_dtype), t.to(t_dtype)
    if strided:
        b = rows // 2
        s = torch.cat([s.reshape(b, 2, vocab), s[:b].reshape(b, 1, vocab)], 1)[:, :-1]
        t = torch.cat([t.reshape(b, 2, vocab), t[:b].reshape(b, 1, vocab)], 1)[:, :-1]
        target = target.reshape(b, 2)
    upstream = [_hashed(rows, 10 + k).reshape(target.shape) for k in range(4)]
    return s, t, target, upstream


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for x in tensors:
        h.update(str(x.dtype).encode())
        h.update(x.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def case_digests(topk_tail_kl) -> dict[str, str]:
    """``name -> sha256`` of every output and both gradients of each case, computed by
    ``topk_tail_kl(..., backend="cpu")`` (the teacher support, reverse / forward KL)."""
    out = {}
    for name, rows, vocab, s_dt, t_dt, top_m, div, temp, strided in CASES:
        s, t, target, up = make_case(rows, vocab, s_dt, t_dt, strided)
        s = s.detach().requires_grad_(True)
        t = t.detach().requires_grad_(True)
        res = topk_tail_kl(
            s, t, target, top_m=top_m, temperature=temp, divergence=div, backend="cpu"
        )
        loss = sum((o.double() * u).sum() for o, u in zip(res[:4], up))
        loss.backward()
        fields = (res.kl, res.privilege, res.student_logprob, res.teacher_logprob, res.topk_ids)
        out[name] = _digest((*fields, res.teacher_topk_mass, s.grad, t.grad))
    return out


def build_key() -> str:
    """The compiler of the imported ``lopd_kernels._C`` (digests are per compiler)."""
    from lopd_kernels import _C

    return str(_C.build_info()["compiler"])


def record(path: str) -> None:
    import lopd_kernels as lk

    torch.set_num_threads(1)
    result = {}
    for isa in ISAS:
        os.environ["LOPD_CPU_ISA"] = isa
        result[isa] = case_digests(lk.topk_tail_kl)
    os.environ.pop("LOPD_CPU_ISA")
    data = {"compiler": build_key(), "torch": torch.__version__, "digests": result}
    Path(path).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    record(sys.argv[1])
