"""The kernel library's conventions: one backend resolver and error, op names, references that
resolve inside the repo, no import cycles, small modules, and `python -m lopd_kernels.info`."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lopd_kernels as lk
from lopd_kernels import _backend

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lopd_kernels"
SOURCES = [*PACKAGE.rglob("*.py"), *(ROOT / "csrc").rglob("*.[ch]*"), ROOT / "docs" / "math.md"]
# Paths the sources cite, e.g. ``csrc/cpu/vec_exp.h`` or `docs/math.md`.
CITED = re.compile(r"\b((?:lopd_kernels|csrc|docs|tests|benchmarks|tools)/[\w./-]*\w)")


def test_every_cited_path_exists_in_the_repo():
    """A user's clone has only the repo: no file may point outside it or at a missing file."""
    missing = []
    for src in SOURCES:
        text = src.read_text()
        assert "/work/" not in text and "../shared" not in text, f"{src}: path outside the repo"
        for ref in CITED.findall(text):
            ref = ref.rstrip(".")
            if "<" in ref or "*" in ref or ref.endswith("/"):
                continue
            candidates = [ROOT / ref, ROOT / (ref.replace(".", "/") + ".py")]
            if not any(c.exists() for c in candidates):
                missing.append(f"{src.relative_to(ROOT)} -> {ref}")
    assert not missing, "\n".join(missing)


def test_modules_stay_small():
    """One concern per file: no module of lopd_kernels/ over 600 lines."""
    sizes = {p.relative_to(ROOT): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert not {p: n for p, n in sizes.items() if n > 600}, sizes


def _imports(path: Path) -> set[str]:
    """lopd_kernels modules imported at module level by ``path`` (lazy imports excluded)."""
    out = set()
    for node in ast.parse(path.read_text()).body:
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.startswith("lopd_kernels")
        ):
            names = [f"{node.module}.{a.name}" for a in node.names]
            out |= {n for n in names if (ROOT / (n.replace(".", "/") + ".py")).exists()}
            if node.module != "lopd_kernels":
                out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("lopd_kernels.")}
    return out


def test_no_import_cycles():
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        modules[name] = _imports(path) - {name, "lopd_kernels"}

    def visit(name, stack):
        if name in stack:
            raise AssertionError(" -> ".join([*stack[stack.index(name) :], name]))
        for dep in modules.get(name, ()):
            visit(dep, [*stack, name])

    for name in modules:
        if name != "lopd_kernels":
            visit(name, [])


def test_bucket_maths_is_a_leaf():
    assert _imports(PACKAGE / "bucket_math.py") == set()


@pytest.mark.parametrize(
    ("call", "op"),
    [
        (
            lambda: lk.topk_tail_kl(torch.zeros(2, 9), torch.zeros(2, 9), torch.zeros(2).long(),
                                    top_m=2, backend="cuda"),
            "topk_tail_kl",
        ),
        (
            lambda: lk.varlen_cross_attention(
                torch.zeros(1, 2, 2, 8), torch.zeros(3, 1, 8), torch.zeros(3, 1, 8),
                torch.tensor([0, 3], dtype=torch.int32), backend="cuda",
            ),
            "varlen_cross_attention",
        ),
        (
            lambda: lk.fused_linear_topk_tail_kl(
                torch.zeros(2, 4), torch.zeros(9, 4), torch.zeros(2, 4), torch.zeros(9, 4),
                torch.zeros(2).long(), top_m=2, backend="cuda",
            ),
            "fused_linear_topk_tail_kl",
        ),
    ],
    ids=["topk_tail_kl", "varlen_cross_attention", "fused_linear_topk_tail_kl"],
)  # fmt: skip
def test_one_error_for_an_unavailable_backend(call, op):
    """Every op reports an explicit backend that cannot run the same way (and the error is both a
    RuntimeError and a ValueError, what the per-op resolvers it replaced raised)."""
    with pytest.raises(lk.BackendUnavailableError, match=rf"^{op}: backend='cuda' needs CUDA"):
        call()
    assert issubclass(lk.BackendUnavailableError, RuntimeError)
    assert issubclass(lk.BackendUnavailableError, ValueError)


def test_op_names_follow_the_convention():
    """Each kernel implementation is torch.ops.lopd.<op>_<impl>_{fwd,bwd}, nothing else."""
    for op in ("topk_tail_kl", "varlen_cross_attention", "fused_linear_topk_tail_kl"):
        for impl in ("cpu", "cuda", "triton"):
            if impl == "cpu" and op != "fused_linear_topk_tail_kl" and not lk.extension_loaded():
                continue
            if impl == "cuda" and op != "fused_linear_topk_tail_kl" and not lk.extension_loaded():
                continue
            for phase in ("fwd", "bwd"):
                assert hasattr(torch.ops.lopd, _backend.op_name(op, impl, phase))
    for legacy in (
        "topk_tail_kl_fwd",
        "varlen_cross_attention_fwd",
        "fused_linear_topk_tail_kl_fwd",
    ):
        assert not hasattr(torch.ops.lopd, legacy), legacy


def test_auto_resolution_and_errors():
    spec = _backend.OpBackends("op", unavailable={"cuda": "is missing"}, auto={"cuda": ("cuda",)})
    cuda = torch.device("cuda")
    assert spec.resolve("auto", cuda) == "torch"  # nothing runs: the reference
    assert spec.resolve("auto", torch.device("cpu")) == "torch"
    assert spec.resolve("torch", cuda, fp64=True) == "torch"
    with pytest.raises(TypeError, match="float64"):
        spec.resolve("cuda", cuda, fp64=True)
    with pytest.raises(lk.BackendUnavailableError, match=r"^op: backend='cuda' is missing"):
        spec.resolve("cuda", cuda)
    with pytest.raises(ValueError, match="backend must be one of"):
        spec.resolve("gpu", cuda)


def test_info_reports_build_and_auto_choices():
    from lopd_kernels import info

    data = info.collect()
    assert data["auto"]["topk_tail_kl"]["cpu"] == ("cpu" if lk.extension_loaded() else "torch")
    if lk.extension_loaded():
        ext = data["extension"]
        assert ext["torch_version"] == torch.__version__.split("+")[0]
        assert ext["cpu_isa"] in ext["cpu_isas_compiled"]
    run = subprocess.run(
        [sys.executable, "-m", "lopd_kernels.info"], cwd=ROOT, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    for op in ("topk_tail_kl", "fused_linear_topk_tail_kl", "varlen_cross_attention"):
        assert op in run.stdout
    assert 'backend="auto"' in run.stdout


@pytest.mark.skipif(not lk.extension_loaded(), reason="lopd_kernels._C is not built")
def test_cpu_buffer_cache_recycles_freed_gradients():
    """A freed [N, V] gradient's memory serves the next backward (no fresh, zero-filled pages)."""
    from lopd_kernels import _C

    # 4.8 MB per gradient: above the cache's 4 MiB floor (smaller ones come from at::empty).
    s = torch.randn(4, 300_000, requires_grad=True)
    t = torch.randn(4, 300_000, requires_grad=True)
    a = torch.randint(0, 300_000, (4,))
    _C.release_cpu_buffer_cache()
    before = _C.cpu_buffer_cache_stats()
    lk.topk_tail_kl(s, t, a, backend="cpu").kl.sum().backward()
    first = (s.grad.clone(), t.grad.clone())
    s.grad = t.grad = None  # frees both gradients: they go to the cache
    assert _C.cpu_buffer_cache_stats()["cached_blocks"] == 2
    lk.topk_tail_kl(s, t, a, backend="cpu").kl.sum().backward()
    after = _C.cpu_buffer_cache_stats()
    assert after["hits"] - before["hits"] == 2 and after["cached_blocks"] == 0
    torch.testing.assert_close((s.grad, t.grad), first, rtol=0, atol=0)
    s.grad = t.grad = None
    _C.release_cpu_buffer_cache()
    assert _C.cpu_buffer_cache_stats()["cached_bytes"] == 0
