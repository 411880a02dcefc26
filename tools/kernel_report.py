"""Static report of every GPU kernel compiled for sm_90: registers, spills, shared memory,
barriers and SASS instructions per vocabulary entry. No GPU needed.

* Triton kernels (``lopd_kernels/triton/*_kernels.py``) are lowered with Triton's own compiler
  for ``GPUTarget("cuda", 90, 32)`` at their launchers' GPU defaults (bf16 logits, the
  16-divisible pointers / strides Triton specializes on at run time, see :data:`TRITON`);
* CUDA kernels (``csrc/cuda/*.cu``) are compiled by ``nvcc -cubin -arch=sm_90a`` with the flags
  of the CI compile check (``CMakeLists.txt``, target ``cuda_compile_check``; the CPU torch
  wheel's headers); the report keeps the ``bf16``/``bf16`` template instance of each kernel
  (``--all-instances`` keeps all).

Registers, shared memory and spills (local memory bytes) come from ``cuobjdump
--dump-resource-usage`` of the cubin; for Triton the shared memory is the compiler's
``metadata.shared`` (what the launch requests), for CUDA the static shared memory only (the
launchers add dynamic shared memory: ``tools/cuda_resource_report.py`` counts it). The SASS
(``cuobjdump -sass``) gives the barriers and the loops (``tools/sass_stats.py``: every loop's
static size, its shortest path = the common path of a streaming loop whose rare work sits
behind a branch, its longest path, and the ``BAR`` barriers on the shortest path).

Instructions per vocabulary entry, for kernels that stream a logit row with one block
(``entries`` per main-loop iteration, declared below from the kernel's source: Triton's
``BLOCK_V``): ``min_path * warps / entries`` warp-instructions per entry and
row, where the main loop is the largest outermost loop. As a check of
the declared ``entries``, ``entries_from_loads = threads * LDG bytes on the path /
bytes_per_entry`` counts what one iteration actually loads (both logit rows: 4 bytes per entry
in bf16). GEMM-tiled kernels (fused linear, attention) get no per-entry figure, nor does the
natural_exp CUDA forward: its per-entry guards (``i < valid`` for a row's last partial tile,
``base < V``) are branches, so the shortest path through its loop skips the per-entry work and
is no common path (its loops are still listed, with static size and both path lengths, in the
JSON). The base2 CUDA forward (``csrc/cuda/topk_tail_kl_kernels_base2.cuh``) handles the partial
tile after its main loop, so its figure is declared (:data:`CUDA_ENTRIES`) like a Triton
kernel's.

    python tools/kernel_report.py [--only NAME,...] [--json OUT] [--md OUT] [--no-cuda]

The Markdown table goes to stdout (and ``--md``), the full rows (every loop) to ``--json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT))

import sass_stats  # noqa: E402

ARCH = 90


@dataclasses.dataclass
class TritonSpec:
    """One Triton kernel at one configuration.

    Attributes:
        name: row name in the report.
        module, fn: where the ``@triton.jit`` function lives.
        types: Triton type of each non-constexpr argument (``"*bf16"``, ``"i32"``, ...); names
            not listed default to ``default_type``.
        constexprs: the ``tl.constexpr`` arguments.
        num_warps: warps per program.
        entries: vocabulary entries one main-loop iteration processes (None: not a row stream).
        bytes_per_entry: bytes of logits read per vocabulary entry (both rows).
    """

    name: str
    module: str
    fn: str
    types: dict
    constexprs: dict
    num_warps: int
    entries: int | None = None
    bytes_per_entry: int | None = None
    default_type: str = "i64"
    aligned_ints: tuple[str, ...] = ()
    options: dict = dataclasses.field(default_factory=dict)  # compile options, e.g. maxnreg


def _topk_types() -> dict:
    t = {n: "*bf16" for n in ("s_ptr", "t_ptr", "gs_ptr", "gt_ptr")}
    t.update({"tgt_ptr": "*i64", "ids_ptr": "*i64", "V": "i32", "scale2": "fp32", "inv_t": "fp32"})
    t.update({n: "fp32" for n in ("beta", "log_1mb", "log_b")})
    for n in ("kl_ptr", "slp_ptr", "tlp_ptr", "lse_ptr", "blp_ptr", "gkl_ptr", "gsl_ptr"):
        t[n] = "*fp32"
    t["gtl_ptr"] = "*fp32"
    return t


def _fused_types() -> dict:
    t = {n: "*bf16" for n in ("HS", "WS", "BS", "HT", "WT", "BT")}
    t.update({"TGT": "*i32", "TOP_I": "*i32", "IDS": "*i64", "inv_temp": "fp32"})
    t.update({n: "fp32" for n in ("beta", "log_1mb", "log_b")})
    t.update({n: "i32" for n in ("N", "V", "DS", "DT", "split_len")})
    t.update({f"stride_{n}": "i32" for n in ("hs", "ws", "ht", "wt", "h", "w")})
    return t  # every other argument: an fp32 pointer


def _attn_types() -> dict:
    t = {n: "*bf16" for n in ("Q", "K", "V", "DO", "DQ", "DK", "DV", "Out")}
    t.update({"CU": "*i32", "LSE": "*fp32", "DELTA": "*fp32"})
    t.update({"sm_scale": "fp32", "qk_scale_log2": "fp32"})
    return t


def triton_specs() -> list[TritonSpec]:
    """The Triton kernels at their launchers' GPU defaults (bf16 inputs, M = 20)."""
    from lopd_kernels.triton import topk_tail_kl as tk

    k = "lopd_kernels.triton.topk_tail_kl_kernels"
    kb = "lopd_kernels.triton.topk_tail_kl_kernels_bwd"
    m20 = {"M": 20, "MP": 32, "K": 20}
    teacher = {"DIV": 0, "SUPPORT": 0}  # reverse KL over the teacher's top-M
    specs = [
        TritonSpec(
            "topk_tail_kl fwd top-M", k, "_fwd_topm_kernel", _topk_types(),
            {**m20, "BLOCK_V": tk._FWD_BLOCK_V, **teacher, "BULK": False, "BULK_MIN": 0},
            tk._FWD_WARPS, tk._FWD_BLOCK_V, 4, aligned_ints=("V",),
        ),
        TritonSpec(
            "topk_tail_kl fwd top-M union jsd", k, "_fwd_topm_kernel", _topk_types(),
            {**m20, "K": 40, "BLOCK_V": tk._FWD_BLOCK_V, "DIV": 2, "SUPPORT": 2, "BULK": False,
             "BULK_MIN": 0},
            tk._FWD_WARPS, tk._FWD_BLOCK_V, 4, aligned_ints=("V",),
        ),
        TritonSpec(
            "topk_tail_kl fwd full", k, "_fwd_full_kernel", _topk_types(),
            {"BLOCK_V": tk._FULL_BLOCK_V, "DIV": 0}, tk._FWD_WARPS, tk._FULL_BLOCK_V, 4,
            aligned_ints=("V",),
        ),
        TritonSpec(
            "topk_tail_kl bwd top-M", kb, "_bwd_kernel", _topk_types(),
            {"K": 20, "KP": 32, "BLOCK_V": tk._BWD_BLOCK_V, "DIV": 0, "FULL": False,
             "GRAD_S": True, "GRAD_T": True},
            tk._BWD_WARPS, tk._BWD_BLOCK_V, 4, aligned_ints=("V",),
        ),
        TritonSpec(
            "topk_tail_kl bwd full", kb, "_bwd_kernel", _topk_types(),
            {"K": 0, "KP": 32, "BLOCK_V": tk._BWD_BLOCK_V, "DIV": 0, "FULL": True,
             "GRAD_S": True, "GRAD_T": True},
            tk._BWD_WARPS, tk._BWD_BLOCK_V, 4, aligned_ints=("V",),
        ),
    ]  # fmt: skip
    specs += _variant_specs()
    f = "lopd_kernels.triton.fused_linear_topk_tail_kl_kernels"
    tiles = {"BLOCK_N": 64, "BLOCK_V": 128, "BLOCK_D": 128, "PRECISION": "tf32", "UPCAST": False}
    flags = {"M": 20, "FULL": False, "DIV": 0, "HAS_BS": False, "HAS_BT": False}
    need = ("S", "T", "DHS", "DWS", "DBS", "DHT", "DWT", "DBT")
    specs += [
        TritonSpec("fused_linear fwd", f, "_fwd_kernel", _fused_types(),
                   {**flags, "M_PAD": 32, "SUPPORT": 0, "SETS": 1, **tiles}, 8,
                   default_type="*fp32"),
        TritonSpec("fused_linear bwd", f + "_bwd", "_bwd_kernel", _fused_types(),
                   {**flags, **{f"NEED_{n}": n in ("S", "T", "DHS", "DWS") for n in need},
                    **tiles}, 8, default_type="*fp32"),
    ]  # fmt: skip
    a = "lopd_kernels.triton.varlen_cross_attention_kernels"
    c = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_D": 128, "PRECISION": "tf32", "UPCAST": False}
    specs += [
        TritonSpec("varlen_xattn fwd", a, "_fwd_kernel", _attn_types(), c, 4, default_type="i32"),
        TritonSpec("varlen_xattn bwd dq", a, "_bwd_dq_kernel", _attn_types(), c, 4,
                   default_type="i32"),
        TritonSpec("varlen_xattn bwd dkdv", a, "_bwd_dkdv_kernel", _attn_types(),
                   {**c, "BLOCK_M": 32}, 4, default_type="i32"),
    ]  # fmt: skip
    return specs


def _variant_specs() -> list[TritonSpec]:
    """The second kernels of lopd_kernels/kernel_variants.py's slots, at the same defaults
    (none in a tree without them: the report then covers the other kernels)."""
    from lopd_kernels.triton import topk_tail_kl as tk

    if importlib.util.find_spec("lopd_kernels.triton.topk_tail_kl_kernels_joined") is None:
        return []

    specs = [
        TritonSpec(
            "topk_tail_kl fwd top-M joined", "lopd_kernels.triton.topk_tail_kl_kernels_joined",
            "_fwd_topm_joined_kernel", _topk_types(),
            {"M": 20, "MP": 32, "K": 20, "BLOCK_V": tk._FWD_BLOCK_V, "DIV": 0, "SUPPORT": 0},
            tk._FWD_WARPS,
            tk._FWD_BLOCK_V, 4, aligned_ints=("V",),
            options={"maxnreg": tk._FWD_JOINED_MAXNREG},
        ),
    ]  # fmt: skip
    if importlib.util.find_spec("lopd_kernels.triton.fused_linear_topk_tail_kl_chunked"):
        from lopd_kernels.triton import fused_linear_topk_tail_kl_chunked as tp

        # The chunked fused-linear path's tail pass: one fp32 logit row in, bf16 out.
        types = {"X": "*fp32", "LSE": "*fp32", "IDS": "*i64", "OUT": "*bf16", "inv_temp": "fp32"}
        specs.append(
            TritonSpec(
                "fused_linear chunked tail probs",
                "lopd_kernels.triton.fused_linear_topk_tail_kl_chunked_kernels",
                "_tail_probs_kernel", types, {"M": 20, "M_PAD": 32, "BLOCK_V": tp._BLOCK_V},
                8, tp._BLOCK_V, 4, default_type="i32", aligned_ints=("V",),
            )
        )  # fmt: skip
    return specs


# Threads per block of the CUDA kernels (their launchers; 256 unless listed).
CUDA_THREADS = {"fwd_wmma_kernel": 128, "dq_wmma_kernel": 128, "dkdv_wmma_kernel": 128}
# CUDA kernels whose main loop streams a logit row with no per-entry bounds checks on its
# common path (so that the shortest path is that common path): vocabulary entries per main-loop
# iteration, from the source (csrc/cuda/topk_tail_kl_kernels_base2.cuh: two tiles of 256 threads x 8
# entries per iteration, the next tile's loads issued unconditionally).
CUDA_ENTRIES = {"topk_tail_kl_fwd_base2_kernel": 2 * 2048,
                "topk_tail_kl_fwd_full_base2_kernel": 2 * 2048}  # fmt: skip


def _tool(name: str) -> str | None:
    """A CUDA binary tool: Triton's bundled copy first (always matches its ptxas), else PATH."""
    try:
        import triton.backends.nvidia as nv

        bundled = Path(nv.__file__).parent / "bin" / name
        if bundled.exists():
            return str(bundled)
    except ImportError:
        pass
    return shutil.which(name)


def _resource_usage(cubin: Path) -> dict[str, dict]:
    """{mangled function: {registers, shared_bytes, local_bytes, stack_bytes}} of a cubin."""
    text = subprocess.run(
        [_tool("cuobjdump"), "--dump-resource-usage", str(cubin)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    out = {}
    for m in re.finditer(r"Function (\S+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)",
                         text):  # fmt: skip
        out[m.group(1)] = {
            "registers": int(m.group(2)),
            "stack_bytes": int(m.group(3)),
            "static_shared_bytes": int(m.group(4)),
            "spill_bytes": int(m.group(5)),
        }
    return out


def _sass(cubin: Path) -> dict[str, list]:
    text = subprocess.run(
        [_tool("cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True, check=True
    ).stdout
    return sass_stats.split_functions(text)


def _demangle(names: list[str]) -> dict[str, str]:
    cxxfilt = shutil.which("c++filt")
    if not cxxfilt or not names:
        return {n: n for n in names}
    out = subprocess.run(
        [cxxfilt], input="\n".join(names), capture_output=True, text=True, check=True
    ).stdout.splitlines()
    return dict(zip(names, out, strict=True))


def _row(name, source, res, code, warps, entries, bytes_per_entry) -> dict:
    stats = sass_stats.function_stats(code)
    loops = stats["loops"]
    outer = [lp for lp in loops if lp.depth == 0]
    main = max(outer, key=lambda lp: lp.static_instrs) if outer else None
    row = {
        "kernel": name,
        "source": source,
        "arch": f"sm_{ARCH}",
        "warps": warps,
        **res,
        "sass_instrs": stats["instrs"],
        "barriers": stats["barriers"],
        "main_loop": main.as_dict() if main else None,
        "loops": [lp.as_dict() for lp in loops],
        "entries_per_iter": entries,
        "entries_from_loads": None,
        "instrs_per_entry": None,
    }
    if main and entries:
        row["instrs_per_entry"] = round(main.min_path * warps / entries, 4)
        if bytes_per_entry:
            row["entries_from_loads"] = warps * 32 * main.ldg_bytes_min_path // bytes_per_entry
    return row


def report_triton(spec: TritonSpec) -> dict:
    """Compiles one Triton kernel for sm_90 (no GPU) and returns its report row."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(spec.module), spec.fn)
    sig = {
        n: "constexpr" if n in spec.constexprs else spec.types.get(n, spec.default_type)
        for n in fn.arg_names
    }
    # Triton specializes 16-divisible pointers and integers at run time: declare the pointers,
    # strides and the spec's aligned integers (V) so, as the production shapes have them.
    aligned = [
        i
        for i, n in enumerate(fn.arg_names)
        if sig[n].startswith("*") or n.startswith("stride") or n in spec.aligned_ints
    ]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    src = ASTSource(fn=fn, signature=sig, constexprs=spec.constexprs, attrs=attrs)
    compiled = triton.compile(
        src,
        target=GPUTarget("cuda", ARCH, 32),
        options={"num_warps": spec.num_warps, **spec.options},
    )
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        res = _resource_usage(cubin)[spec.fn]
        code = _sass(cubin)[spec.fn]
    res = {**res, "shared_bytes": int(compiled.metadata.shared)}
    source = f"{spec.module.replace('.', '/')}.py::{spec.fn}"
    return _row(spec.name, source, res, code, spec.num_warps, spec.entries, spec.bytes_per_entry)


def nvcc_command(src: Path, out: Path) -> list[str]:
    """The compile of the CI check (CMakeLists.txt, cuda_compile_check) for sm_90a, to a cubin."""
    import torch.utils.cpp_extension as cpp

    nvcc = os.environ.get("NVCC") or shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    cmd = [nvcc, "-std=c++20", "-arch=sm_90a", "--expt-relaxed-constexpr", "-O3", "-cubin"]
    cmd += ["-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE", "-DLOPD_WITH_CUDA=1"]
    cmd += [f"-I{p}" for p in cpp.include_paths()] + [f"-I{ROOT / 'csrc'}"]
    return [*cmd, str(src), "-o", str(out)]


def _bf16_instance(pretty: str) -> bool:
    """Whether a demangled kernel's template arguments name only bf16 among float types."""
    inst = re.search(r"<(.*?)>\(", pretty)
    if not inst:
        return True
    floats = re.findall(r"c10::BFloat16|__nv_bfloat16|c10::Half|__half|\bfloat\b|\bdouble\b",
                        inst.group(1))  # fmt: skip
    return all(f in ("c10::BFloat16", "__nv_bfloat16") for f in floats)


def report_cuda(src: Path, all_instances: bool = False) -> list[dict]:
    """Compiles one ``csrc/cuda/*.cu`` to an sm_90a cubin and returns a row per kernel."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        subprocess.run(nvcc_command(src, cubin), check=True, capture_output=True, text=True)
        res = _resource_usage(cubin)
        sass = _sass(cubin)
    names = _demangle(sorted(res))
    for mangled, pretty in sorted(names.items(), key=lambda kv: kv[1]):
        if not all_instances and not _bf16_instance(pretty):
            continue
        base = re.search(r"(\w+)(?:<|\()", pretty.replace("(anonymous namespace)", "anon"))
        kernel = base.group(1) if base else mangled
        threads = CUDA_THREADS.get(kernel, 256)
        inst = re.search(r"<(.*?)>\(", pretty)
        name = f"{kernel}<{inst.group(1)}>" if inst else kernel
        entries = CUDA_ENTRIES.get(kernel)
        bf16_rows = _bf16_instance(pretty)  # 2 bytes per entry per row: 4 for both logit rows
        rows.append(
            _row(name, f"csrc/cuda/{src.name}", {**res[mangled], "shared_bytes": None},
                 sass[mangled], threads // 32, entries, 4 if entries and bf16_rows else None)
        )  # fmt: skip
    return rows


def markdown(rows: list[dict]) -> str:
    head = (
        "| kernel | regs | spill B | smem B (Triton: launch; CUDA: static) | BAR (all) |"
        " main loop: static / min / max instr |"
        " BAR on min path | entries / iter (from loads) | warp-instr / entry |"
    )
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        lp = r["main_loop"]
        loop = f"{lp['static_instrs']} / {lp['min_path']} / {lp['max_path']}" if lp else "-"
        bars = lp["barriers_min_path"] if lp else "-"
        ent = "-"
        if r["entries_per_iter"]:
            ent = f"{r['entries_per_iter']} ({r['entries_from_loads']})"
        smem = r["shared_bytes"] if r["shared_bytes"] is not None else r["static_shared_bytes"]
        ipe = r["instrs_per_entry"] if r["instrs_per_entry"] is not None else "-"
        lines.append(
            f"| {r['kernel']} | {r['registers']} | {r['spill_bytes']} | {smem} | {r['barriers']} "
            f"| {loop} | {bars} | {ent} | {ipe} |"
        )
    return "\n".join(lines)


def meta() -> dict:
    """What the figures were compiled from: commit, Triton and nvcc versions."""

    def out(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT).stdout.strip()
        except OSError:
            return ""

    import triton

    nvcc = os.environ.get("NVCC") or shutil.which("nvcc") or "nvcc"
    release = re.search(r"release [\d.]+, V([\d.]+)", out([nvcc, "--version"]))
    dirty = bool(out(["git", "status", "--porcelain", "--untracked-files=no"]))
    return {
        "commit": out(["git", "rev-parse", "HEAD"]) + (" (with uncommitted changes)" * dirty),
        "triton": triton.__version__,
        "nvcc": release.group(1) if release else None,
        "arch": f"sm_{ARCH}",
    }


def available() -> str | None:
    """Why the report cannot run here (None: it can)."""
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        return "needs Triton's NVIDIA backend (ptxas, cuobjdump)"
    if _tool("cuobjdump") is None:
        return "needs cuobjdump (bundled with Triton's NVIDIA backend)"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated substrings of kernel names to keep")
    ap.add_argument("--json", type=Path, help="write every row (all loops) as JSON")
    ap.add_argument("--md", type=Path, help="also write the Markdown table here")
    ap.add_argument("--no-cuda", action="store_true", help="skip the csrc/cuda kernels (nvcc)")
    ap.add_argument("--no-triton", action="store_true", help="skip the Triton kernels")
    ap.add_argument("--all-instances", action="store_true", help="every CUDA template instance")
    args = ap.parse_args(argv)
    why = available()
    if why:
        print(f"kernel_report: {why}", file=sys.stderr)
        return 1
    os.environ.pop("TRITON_INTERPRET", None)  # the interpreter cannot compile
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, unwarned
    only = [s for s in (args.only or "").split(",") if s]

    def keep(name: str) -> bool:
        return not only or any(s in name for s in only)

    rows = []
    if not args.no_triton:
        rows += [report_triton(s) for s in triton_specs() if keep(s.name)]
    if not args.no_cuda:
        nvcc = os.environ.get("NVCC") or shutil.which("nvcc")
        if nvcc is None:
            print("kernel_report: no nvcc; CUDA kernels skipped", file=sys.stderr)
        else:
            for src in sorted((ROOT / "csrc" / "cuda").glob("*.cu")):
                rows += [r for r in report_cuda(src, args.all_instances) if keep(r["kernel"])]
    table = markdown(rows)
    print(table)
    if args.md:
        args.md.write_text(table + "\n")
    if args.json:
        args.json.write_text(json.dumps({"meta": meta(), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
