"""The kernel library's conventions: one backend resolver and error, op names built and
registered in one place with one schema per op, an nn.Module per loss op, references that resolve
inside the repo, no import cycles (function-local imports counted), small modules, and
`python -m lopd_kernels.info`."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lopd_kernels as lk
from lopd_kernels import _backend, _custom_ops

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lopd_kernels"
SOURCES = [*PACKAGE.rglob("*.py"), *(ROOT / "csrc").rglob("*.[ch]*"),
           *(ROOT / "docs").glob("*.md")]  # fmt: skip
# Paths the sources cite, e.g. ``csrc/cpu/vec_exp.h`` or `docs/math.md`.
CITED = re.compile(r"\b((?:lopd_kernels|csrc|docs|tests|benchmarks|tools)/[\w./<>*-]*[\w>*])")


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


def _import_nodes(path: Path, *, nested: bool) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of ``path``: module level only, or also those inside functions."""
    return [n for n, local in _imports_by_level(path) if nested or not local]


def _imports_by_level(path: Path) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement of ``path`` with whether it is function-local."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    return [
        (n, id(n) not in top) for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
    ]


def _imports(path: Path, *, nested: bool = False) -> set[str]:
    """lopd_kernels modules imported by ``path`` (function-local imports too when ``nested``)."""
    out = set()
    for node in _import_nodes(path, nested=nested):
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
    """No circle among lopd_kernels' modules, function-local imports counted."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        modules[name] = _imports(path, nested=True) - {name, "lopd_kernels"}

    def visit(name, stack):
        if name in stack:
            raise AssertionError(" -> ".join([*stack[stack.index(name) :], name]))
        for dep in modules.get(name, ()):
            visit(dep, [*stack, name])

    for name in modules:
        if name != "lopd_kernels":
            visit(name, [])


# Function-local imports are allowed only for what a machine may lack, each with a comment on
# the line or just above saying so ("optional"): Triton (and this package's Triton modules),
# the compiled extension, psutil.
OPTIONAL = ("triton", "lopd_kernels.triton", "lopd_kernels._C", "psutil")


def _is_optional(module: str) -> bool:
    return any(module == o or module.startswith(o + ".") for o in OPTIONAL)


def test_function_local_imports_are_optional_dependencies_with_a_comment():
    bad = []
    for path in PACKAGE.rglob("*.py"):
        lines = path.read_text().splitlines()
        for node, local in _imports_by_level(path):
            if not local:
                continue
            if isinstance(node, ast.ImportFrom) and node.module == "lopd_kernels":
                mods = [f"lopd_kernels.{a.name}" for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mods = [node.module]
            else:
                mods = [a.name for a in node.names]
            above = lines[max(0, node.lineno - 4) : node.lineno]
            commented = any("#" in line and "optional" in line for line in above)
            if not (all(_is_optional(m) for m in mods) and commented):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} {mods}")
    assert not bad, "\n".join(bad)


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
        (
            lambda: lk.fused_linear_logprob(
                torch.zeros(2, 4), torch.zeros(9, 4), torch.zeros(2).long(), backend="cuda"
            ),
            "fused_linear_logprob",
        ),
    ],
    ids=["topk_tail_kl", "varlen_cross_attention", "fused_linear_topk_tail_kl",
         "fused_linear_logprob"],
)  # fmt: skip
def test_one_error_for_an_unavailable_backend(call, op):
    """Every op reports an explicit backend that cannot run the same way: a RuntimeError whose
    message starts with the op and the backend (one the op lacks: "is not an implementation")."""
    match = rf"^{op}: backend='cuda' (needs CUDA|is not an implementation)"
    with pytest.raises(lk.BackendUnavailableError, match=match):
        call()
    assert issubclass(lk.BackendUnavailableError, RuntimeError)
    assert not issubclass(lk.BackendUnavailableError, ValueError)


OPS = ("topk_tail_kl", "fused_linear_topk_tail_kl", "sparse_teacher_topk_tail_kl",
       "fused_linear_logprob", "varlen_cross_attention")  # fmt: skip


def _implementations(op: str) -> list[str]:
    """The implementation words of ``op`` (its ``OpBackends.impls``) this install has as custom
    ops (the C++ ones exist when the extension loaded)."""
    module = importlib.import_module(f"lopd_kernels.{op}")
    return [i for i in module.BACKENDS.impls if module.CUSTOM_OPS.declared(i)]


def test_op_names_follow_the_convention():
    """Each kernel implementation is torch.ops.lopd.<op>_<impl>_{fwd,bwd}, nothing else."""
    for op in OPS:
        for impl in _implementations(op):
            for phase in ("fwd", "bwd"):
                assert hasattr(torch.ops.lopd, _custom_ops.op_name(op, impl, phase)), (op, impl)
    assert not hasattr(torch.ops.lopd, "sparse_teacher_topk_tail_kl_cuda_fwd")
    for legacy in (
        "topk_tail_kl_fwd",
        "varlen_cross_attention_fwd",
        "fused_linear_topk_tail_kl_fwd",
    ):
        assert not hasattr(torch.ops.lopd, legacy), legacy
    with pytest.raises(ValueError, match="no custom op"):
        _custom_ops.op_name("topk_tail_kl", "torch", "fwd")


def _signature(op: str, impl: str, phase: str) -> tuple:
    """Argument names and types and return types of a custom op's schema (its name left out)."""
    schema = getattr(torch.ops.lopd, _custom_ops.op_name(op, impl, phase)).default._schema
    args = tuple((a.name, str(a.type)) for a in schema.arguments)
    return args, tuple(str(r.type) for r in schema.returns)


@pytest.mark.parametrize("op", OPS)
def test_every_implementation_of_an_op_has_one_schema(op):
    """The C++ schemas (csrc/common/schemas.h) and the Python custom ops agree, so every
    implementation is called the same way and one set of fakes and autograd serves them all."""
    impls = _implementations(op)
    assert len(impls) >= 2 or not lk.extension_loaded(), impls
    for phase in ("fwd", "bwd"):
        first = _signature(op, impls[0], phase)
        for impl in impls[1:]:
            assert _signature(op, impl, phase) == first, (op, impl, phase)


def test_custom_op_names_are_built_in_one_place():
    """Op modules register through _custom_ops.CustomOps: no literal ``"lopd::..."`` name, no
    ``torch.library`` registration call anywhere else in the package."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "_custom_ops.py":
            continue
        text = path.read_text()
        for needle in ('"lopd::', "torch.library.custom_op", "torch.library.register_",
                       "getattr(torch.ops.lopd"):  # fmt: skip
            if needle in text:
                offenders.append(f"{path.relative_to(ROOT)}: {needle}")
    assert not offenders, offenders


def test_every_loss_op_has_a_module():
    """A loss op's nn.Module returns its functional KL, reduced: none, sum, mean over the kept
    tokens."""
    torch.manual_seed(0)
    s, t = torch.randn(2, 3, 40), torch.randn(2, 3, 40)
    target = torch.randint(0, 40, (2, 3))
    target[0, 1] = -100
    h_s, h_t, w = torch.randn(6, 8), torch.randn(6, 8), torch.randn(40, 8)
    lp = torch.log_softmax(t, -1).topk(5).values
    ids = t.topk(5).indices
    cases = [
        (lk.TopKTailKL, lk.topk_tail_kl, (s, t, target), {"top_m": 5}),
        (lk.SparseTeacherTopKTailKL, lk.sparse_teacher_topk_tail_kl, (s, lp, ids, target), {}),
        (lk.FusedLinearTopKTailKL, lk.fused_linear_topk_tail_kl,
         (h_s, w, h_t, w, target.reshape(-1)), {"top_m": 5}),
    ]  # fmt: skip
    for module, function, args, kw in cases:
        kl = function(*args, backend="torch", **kw).kl
        kept = (args[-1] != -100).sum()
        for reduction, want in (("none", kl), ("sum", kl.sum()), ("mean", kl.sum() / kept)):
            got = module(**kw, reduction=reduction, backend="torch")(*args)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        with pytest.raises(ValueError, match="reduction must be one of"):
            module(reduction="max")
        assert "reduction='mean'" in repr(module(**kw))


def test_auto_resolution_and_errors():
    spec = _backend.OpBackends(
        "op", impls=("cuda",), unavailable={"cuda": "is missing"}, auto={"cuda": ("cuda",)}
    )
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


def test_the_file_map_lists_every_module():
    """docs/kernels.md names every module of lopd_kernels/ (the Triton ones by their patterns)."""
    text = (ROOT / "docs" / "kernels.md").read_text()
    missing = [p.name for p in PACKAGE.glob("*.py") if p.name not in text]
    assert not missing, missing
