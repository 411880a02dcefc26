"""Runs the code blocks of the README and of docs/integrations.md ("Use the kernels in your
trainer"), exactly as written.

Each block is the ```python fence after a ``<!-- snippet: NAME -->`` line; the test fails when
a block is renamed, removed or added without a check here, and when one raises or computes
nonsense. The TRL and verl blocks need those frameworks (skipped with the reason otherwise; CI
runs the verl block in an environment with verl, see ``.ci/run``).
"""

import importlib.util
import math
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_SNIPPET = re.compile(r"<!-- snippet: ([\w-]+) -->\n```python\n(.*?)```", re.DOTALL)


def snippets() -> dict[str, str]:
    found = [f for page in PAGES for f in _SNIPPET.findall(page.read_text())]
    names = [name for name, _ in found]
    assert len(names) == len(set(names)), f"duplicate snippet names in the docs: {names}"
    return dict(found)


def run(name: str, tmp_path, monkeypatch) -> dict:
    monkeypatch.chdir(tmp_path)  # snippets may write (e.g. TRL's output_dir)
    namespace: dict = {"__name__": f"readme_{name}"}
    exec(compile(snippets()[name], f"snippet:{name}", "exec"), namespace)
    return namespace


def test_every_snippet_is_checked():
    assert set(snippets()) == {"pytorch", "trl", "sparse-teacher", "teacher-topk", "verl"}


def test_pytorch_snippet(tmp_path, monkeypatch):
    ns = run("pytorch", tmp_path, monkeypatch)
    # Same weights for student and teacher: the KL is 0 up to rounding; the gradient exists.
    assert math.isfinite(ns["loss"].item()) and abs(ns["loss"].item()) < 1e-4
    assert ns["student"].lm_head.weight.grad is not None
    assert (ns["out"].kl[ns["target"].reshape(-1) == -100] == 0).all()


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


def test_trl_snippet(tmp_path, monkeypatch):
    trl = pytest.importorskip("trl", reason="TRL not installed (pip install 'lopd[trl]')")
    if tuple(int(x) for x in trl.__version__.split(".")[:2]) < (1, 16):
        pytest.skip(f"the TRL integration needs trl>=1.16, found {trl.__version__}")
    ns = run("trl", tmp_path, monkeypatch)
    logs = [h for h in ns["trainer"].state.log_history if "loss" in h]
    assert len(logs) == 1 and math.isfinite(logs[0]["loss"])
    assert 0 < logs[0]["teacher_topk_mass"] <= 1
    assert torch.isfinite(ns["trainer"].model.lm_head.weight).all()


def test_verl_snippet(tmp_path, monkeypatch):
    if importlib.util.find_spec("verl") is None:
        pytest.skip("verl not installed (pip install 'lopd[verl]'; needs transformers < 5.11)")
    ns = run("verl", tmp_path, monkeypatch)
    assert ns["loss_config"].loss_mode == "lopd_topk_tail"
