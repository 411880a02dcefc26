"""The per-phase memory account (lopd.run.memory_account): each figure counts what it says."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch
from torch import nn

from lopd.run.memory_account import MemoryAccount, release_memory, resident_bytes, tensor_bytes


def test_phase_record_counts_weights_grads_optimizer_and_saved_activations(tmp_path):
    torch.manual_seed(0)
    student, backbone = nn.Linear(64, 32), nn.Linear(64, 32).to(torch.bfloat16)
    backbone.weight.data = student.weight.data.to(torch.bfloat16)  # a separate 16-bit copy
    models = SimpleNamespace(student=student, backbone=backbone, composer=None)
    logged: list[str] = []
    account = MemoryAccount(True, tmp_path / "memory.jsonl", torch.device("cpu"), logged.append)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-3)
    x = torch.randn(8, 64)
    with account.activations([student]):
        y = torch.tanh(student(x))  # saves x (8 x 64) for the weight grad and tanh's output
    y.sum().backward()
    opt.step()
    rec = account.phase("step", models, [opt], step=3)

    n = 64 * 32 + 32
    assert rec["weights_by_part"] == {"student": 4 * n, "backbone": 2 * n, "phi": 0}
    assert rec["weights_by_dtype"] == {"float32": 4 * n, "bfloat16": 2 * n}
    assert rec["grads"] == 4 * n
    assert 2 * 4 * n <= rec["optimizer"] <= 2 * 4 * n + 2 * 8  # two moments (+ step scalars)
    assert rec["activations"] == 4 * (8 * 64 + 8 * 32)  # parameters are not counted
    assert rec["step"] == 3 and rec["peak"] >= rec["now"] > 0
    assert json.loads((tmp_path / "memory.jsonl").read_text()) == rec
    assert logged and logged[0].startswith("memory step: peak")
    # The next phase starts from zero saved activations.
    assert account.phase("next", models, [opt])["activations"] == 0


def test_disabled_account_records_nothing_and_tensor_bytes_counts_storage_once(tmp_path):
    account = MemoryAccount(False, tmp_path / "m.jsonl", torch.device("cpu"), print)
    with account.activations():
        torch.randn(4, requires_grad=True).exp().sum().backward()
    assert account.phase("x") is None and not (tmp_path / "m.jsonl").exists()
    t = torch.zeros(100)
    assert tensor_bytes([t, t[10:], t.view(10, 10)]) == 400  # views share one storage
    assert release_memory() >= 0 and resident_bytes()[1] >= resident_bytes()[0] > 0


def test_lm_head_bytes_predicts_the_fused_and_the_materialized_paths():
    """The fused log-prob kernel's transient bytes are bounded by its block plan, whatever the
    token count; the materialized path's grow as three float32 [N, V] tensors."""
    from lopd.run.memory_account import lm_head_bytes

    v, d = 151_936, 4096
    mat = lm_head_bytes(40_960, v, d, torch.bfloat16, "cuda", fused=False)
    assert mat == 40_960 * v * 14  # 24.9 GB of float32 logits, their log-softmax and gradient
    fused = lm_head_bytes(40_960, v, d, torch.bfloat16, "cuda")
    assert fused < mat / 5 and fused < 8 << 30
    short = lm_head_bytes(512, v, d, torch.bfloat16, "cuda")
    assert short < fused  # the block shrinks with the rows
    # Frozen head (the cold start): the saved [N, d] projection is counted.
    cold = lm_head_bytes(40_960, v, d, torch.bfloat16, "cuda", head_grad=False)
    assert cold >= 40_960 * d * 2
