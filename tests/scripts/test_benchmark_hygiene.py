"""Benchmarks leave no global state behind (threads, environment, RNG, global torch settings).

``pytest benchmarks --benchmark-only`` runs every benchmark file in one process: a file that
changed the thread count (as ``bench_qformer.py`` once did with ``torch.set_num_threads(1)``)
silently slowed every file collected after it. The pytest-collected benchmark files and the
setup code they ``exec`` may set such state only through the scoped helpers of
``benchmarks/common.py`` (``torch_threads``) or inside ``torch.random.fork_rng()``.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
from pathlib import Path

import pytest
import torch

from benchmarks.common import torch_threads

ROOT = Path(__file__).resolve().parents[2]
BENCH_FILES = sorted(
    p for p in (ROOT / "benchmarks").glob("bench_*.py") if "def test_" in p.read_text()
)

# Calls that change process-wide state when made outside a scoped helper.
GLOBAL_CALLS = {
    "torch.set_num_threads",
    "torch.set_num_interop_threads",
    "torch.set_default_dtype",
    "torch.set_default_device",
    "torch.use_deterministic_algorithms",
    "torch.set_flush_denormal",
    "torch.manual_seed",
    "torch.seed",
    "os.putenv",
    "os.unsetenv",
    "os.environ.setdefault",
    "os.environ.update",
    "os.environ.pop",
    "os.environ.clear",
}


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _violations(tree: ast.AST) -> list[str]:
    """Global-state writes in ``tree`` that are not inside ``with torch.random.fork_rng()``."""
    found = []

    def visit(node: ast.AST, forked: bool) -> None:
        if isinstance(node, ast.With):
            names = {_dotted(item.context_expr.func) for item in node.items
                     if isinstance(item.context_expr, ast.Call)}  # fmt: skip
            forked = forked or bool(names & {"torch.random.fork_rng", "random.fork_rng"})
        if isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name in GLOBAL_CALLS and not (forked and name == "torch.manual_seed"):
                found.append(f"line {node.lineno}: {name}()")
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for target in targets:
                if isinstance(target, ast.Subscript) and _dotted(target.value) == "os.environ":
                    found.append(f"line {node.lineno}: os.environ[...] written")
        for child in ast.iter_child_nodes(node):
            visit(child, forked)

    visit(tree, False)
    return found


def test_the_checker_catches_global_state():
    """The checker itself can fail: each kind of write is reported, a forked seed is not."""
    bad = "torch.set_num_threads(1)\nos.environ['X'] = '1'\ntorch.manual_seed(0)\n"
    assert len(_violations(ast.parse(bad))) == 3
    ok = "import torch\nwith torch.random.fork_rng():\n    torch.manual_seed(0)\n"
    assert _violations(ast.parse(ok)) == []


@pytest.mark.parametrize("path", BENCH_FILES, ids=lambda p: p.name)
def test_benchmark_sets_no_global_state(path):
    """The file and every ``*SETUP`` source it executes in the pytest process."""
    assert _violations(ast.parse(path.read_text())) == [], path.name
    module = importlib.import_module(f"benchmarks.{path.stem}")
    for name, value in vars(module).items():
        if name.endswith("SETUP") and isinstance(value, str):
            assert _violations(ast.parse(value)) == [], f"{path.name}: {name}"


def test_benchmark_files_are_found():
    assert {p.name for p in BENCH_FILES} >= {
        "bench_qformer.py",
        "bench_topk_tail_kl.py",
        "bench_fused_linear_topk_tail_kl.py",
    }


def test_torch_threads_restores_even_on_error():
    before = torch.get_num_threads()
    target = 1 if before != 1 else 2
    with pytest.raises(RuntimeError, match="boom"), torch_threads(target) as n:
        assert n == torch.get_num_threads() == target
        raise RuntimeError("boom")
    assert torch.get_num_threads() == before


def test_qformer_inputs_leave_the_global_rng_alone():
    from benchmarks.bench_qformer import make_inputs

    state, env, threads = torch.random.get_rng_state(), dict(os.environ), torch.get_num_threads()
    first = make_inputs(seed=3)[1]
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(make_inputs(seed=3)[1], first)  # still seeded: the same inputs
    assert dict(os.environ) == env and torch.get_num_threads() == threads


# The index: benchmarks/README.md names every script and every result, and nothing that is gone.
BENCH_DIR = ROOT / "benchmarks"
INDEX = BENCH_DIR / "README.md"
# A results path as the index writes it: `results/x.json`, (results/x), benchmarks/results/x/y;
# group 2 marks a pattern (`results/gpu_<op>.json`, `results/memory_*.json`), not a path.
RESULT_PATH = re.compile(r"(?<![\w.-])results/([\w./-]*)([<*]?)")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _named(text: str, name: str) -> bool:
    return re.search(rf"(?<![\w.-]){re.escape(name)}(?![\w-]|\.\w)", text) is not None


def test_every_benchmark_script_is_in_the_index():
    text = INDEX.read_text()
    scripts = sorted(p.name for p in BENCH_DIR.iterdir() if p.suffix in {".py", ".sh"})
    assert {"common.py", "gpu_all.sh", "bench_qformer.py"} <= set(scripts)
    missing = [name for name in scripts if not _named(text, f"`{name}`")]
    assert not missing, f"benchmarks/README.md does not name {missing}"


def test_every_result_is_in_the_index():
    text = INDEX.read_text()
    named = {m.group(1).split("/")[0] for m in RESULT_PATH.finditer(text) if not m.group(2)}
    named |= {Path(t).parts[1] for t in LINK.findall(text) if t.startswith("results/")}
    entries = sorted(p.name for p in (BENCH_DIR / "results").iterdir())
    assert {"topk_tail_kl.json", "compare"} <= set(entries)
    missing = [name for name in entries if name not in named]
    assert not missing, f"benchmarks/README.md does not name results/{missing}"


def test_every_path_the_index_names_exists():
    text = INDEX.read_text()
    paths = [m.group(1).rstrip("./") for m in RESULT_PATH.finditer(text) if not m.group(2)]
    gone = [f"results/{p}" for p in paths if p and not (BENCH_DIR / "results" / p).exists()]
    links = [t for t in LINK.findall(text) if "://" not in t]
    gone += [t for t in links if not (BENCH_DIR / t).exists()]
    assert links and not gone, f"benchmarks/README.md names missing paths: {gone}"


def test_the_index_checks_can_fail():
    assert _named("| `gpu_env.py` |", "`gpu_env.py`")
    assert not _named("| `gpu_env.py.bak` |", "`gpu_env.py`")
    sample = (
        "`results/gpu_<op>.json`, [x](results/compare), benchmarks/results/probe/a.json, results/*"
    )
    found = [(m.group(1), m.group(2)) for m in RESULT_PATH.finditer(sample)]
    assert found == [("gpu_", "<"), ("compare", ""), ("probe/a.json", ""), ("", "*")]
