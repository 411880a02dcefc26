"""Runs the code blocks of the README and of docs/integrations.md ("Use the kernels in your
trainer"), exactly as written.

Each block is the ```python fence after a ``<!-- snippet: NAME -->`` line; the test fails when
a block is renamed, removed or added without a check here, and when one raises or computes
nonsense. The TRL and verl blocks need those frameworks (skipped with the reason otherwise; CI
runs the verl block in an environment with verl, see ``.ci/run``).
"""

import importlib.util
import math

import pytest
import torch

from tests.scripts.doc_snippets import ROOT, snippets


def run(name: str, tmp_path, monkeypatch) -> dict:
    monkeypatch.chdir(tmp_path)  # snippets may write (e.g. TRL's output_dir)
    namespace: dict = {"__name__": f"readme_{name}"}
    exec(compile(snippets()[name], f"snippet:{name}", "exec"), namespace)
    return namespace


def test_every_snippet_is_checked():
    assert set(snippets()) == {
        "pytorch", "trl", "trl-gkd", "sparse-teacher", "teacher-topk", "verl", "megatron",
    }  # fmt: skip


def test_pytorch_snippet(tmp_path, monkeypatch):
    ns = run("pytorch", tmp_path, monkeypatch)
    # Same weights for student and teacher: the KL is 0 up to rounding; the gradient exists.
    loss, out = ns["res"]
    assert math.isfinite(loss.item()) and abs(loss.item()) < 1e-4
    assert ns["student"].lm_head.weight.grad is not None
    assert (out.kl[ns["target"].reshape(-1) == -100] == 0).all()


def test_sparse_teacher_snippet(tmp_path, monkeypatch):
    ns = run("sparse-teacher", tmp_path, monkeypatch)
    out, dense = ns["out"], ns["dense"]
    assert (out.kl > 0).all() and ns["student_logits"].grad.abs().sum() > 0
    torch.testing.assert_close(out.kl, dense.kl, rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(out.teacher_topk_mass, dense.teacher_topk_mass)


def test_teacher_topk_snippet(tmp_path, monkeypatch):
    ns = run("teacher-topk", tmp_path, monkeypatch)
    assert (ns["out"].kl > 0).all() and not ns["out"].invalid.any()
    assert ns["student_logits"].grad.abs().sum() > 0
    assert ((ns["out"].teacher_mass > 0) & (ns["out"].teacher_mass < 1)).all()


def test_megatron_snippet(tmp_path):
    """The Megatron-core block in 2 gloo processes (tests/scripts/megatron_snippet_worker.py): on
    each rank the single-process loss and log-probs, its slice of the head's gradient, the whole
    hidden states' gradient."""
    pytest.importorskip("megatron.core", reason="megatron-core not installed (the [test] extra)")
    import json
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "scripts" / "megatron_snippet_worker.py"), str(port),
         str(tmp_path)], capture_output=True, text=True, timeout=600, env=env, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for rank in range(2):
        verdict = json.loads((tmp_path / f"rank{rank}.json").read_text())["verdict"]
        assert verdict == "ok", f"rank {rank}: {verdict}"


def _needs_trl() -> None:
    trl = pytest.importorskip("trl", reason="TRL not installed (pip install 'lopd[trl]')")
    if tuple(int(x) for x in trl.__version__.split(".")[:2]) < (1, 16):
        pytest.skip(f"the TRL integration needs trl>=1.16, found {trl.__version__}")


def _trained(trainer) -> list[dict]:
    """The trainer's per-step logs, after checking that it trained: a positive finite loss
    every step (student and teacher differ) and a student that moved away from the shipped
    weights."""
    from transformers import AutoModelForCausalLM

    from lopd.models import TINY_ASSET_DIR

    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3 and all(math.isfinite(h["loss"]) and h["loss"] > 0 for h in logs), logs
    before = AutoModelForCausalLM.from_pretrained(TINY_ASSET_DIR).lm_head.weight.detach()
    after = trainer.model.lm_head.weight.detach().cpu()
    assert torch.isfinite(after).all() and (after - before).abs().max() > 1e-4
    return logs


def test_trl_snippet_trains_a_student_from_a_different_teacher(tmp_path, monkeypatch):
    _needs_trl()
    ns = run("trl", tmp_path, monkeypatch)
    logs = _trained(ns["trainer"])
    assert all(0 < h["teacher_topk_mass"] <= 1 for h in logs)


def test_trl_gkd_snippet_trains_on_messages(tmp_path, monkeypatch):
    _needs_trl()
    ns = run("trl-gkd", tmp_path, monkeypatch)
    _trained(ns["trainer"])


def test_verl_snippet(tmp_path, monkeypatch):
    if importlib.util.find_spec("verl") is None:
        pytest.skip("verl not installed (pip install 'lopd[verl]'; needs transformers < 5.11)")
    ns = run("verl", tmp_path, monkeypatch)
    assert ns["loss_config"].loss_mode == "lopd_topk_tail"
