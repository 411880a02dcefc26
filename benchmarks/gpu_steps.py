"""The steps of the GPU check (``benchmarks/gpu_run.py`` runs them), most valuable first.

Each step is one command with a weight (its share of the time left is its cap), the probe keys
it needs (``"<op>/<backend>"``: a CUDA step is skipped when the probe found that backend absent)
and the modules it requires (optional peers compared against: TRL, Liger, flash-attn; a step
whose peer is not installed is skipped and says so). ``--list`` prints them.
"""

from __future__ import annotations

import dataclasses
import glob
import shutil
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

KERNEL_TESTS = (
    "tests/kernels/test_topk_tail_kl*.py", "tests/kernels/test_fused_linear*.py",
    "tests/kernels/test_varlen_cross_attention*.py", "tests/kernels/test_qformer*.py",
)  # fmt: skip
# Real-GPU selections: the SIMT-emulated runs and the CPU-side compile checks are CI's.
TRITON_TESTS_K = "(triton or gpu) and not cuda and not emulated and not compile"
CUDA_TESTS_K = "cuda and not emulated and not compile"
MEMCHECK_TESTS = (
    "tests/kernels/test_topk_tail_kl_cuda.py", "tests/kernels/test_varlen_cross_attention_cuda.py",
    "tests/kernels/test_topk_tail_kl_triton.py",
)  # fmt: skip
MEMCHECK_K = "(cuda or out_of_bounds) and not emulated and not compile"
MEMCHECK_K_TRITON_ONLY = "out_of_bounds and not emulated and not compile"


@dataclasses.dataclass
class Step:
    """One subprocess of the run.

    Attributes:
        name: unique id (``--only`` takes these).
        weight: nominal seconds; the cap is this share of the time left.
        cmd: argv (``None`` for the built-in step: probe).
        needs: probe keys (``"<op>/<backend>"``) that must have run, else the step is skipped.
        requires: importable modules (optional peers), else the step is skipped.
        env: extra environment.
        tests: a pytest step (its junit XML and counts go into the summary).
    """

    name: str
    weight: float
    cmd: list[str] | None = None
    needs: tuple[str, ...] = ()
    requires: tuple[str, ...] = ()
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    tests: bool = False
    status: str = "pending"
    note: str = ""
    cap_s: float | None = None
    elapsed_s: float | None = None
    rc: int | None = None
    details: dict[str, Any] = dataclasses.field(default_factory=dict)


def gpu_count() -> int:
    """The GPUs ``nvidia-smi -L`` lists (0 without it)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30,
                             check=True).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def sanitizer_path() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/compute-sanitizer")
    return str(default) if default.exists() else None


def plan(run: Any) -> list[Step]:
    """Every step in run order (most valuable first)."""
    py, dev = run.py, run.device_args()

    def bench(script: str, *args: str) -> list[str]:
        return [py, f"benchmarks/{script}", *args, *dev]

    files = sorted({f for pattern in KERNEL_TESTS for f in glob.glob(pattern, root_dir=ROOT)})
    sanitizer = sanitizer_path()
    steps = [
        Step("env", 15, bench("gpu_env.py", "--env-json", str(run.env_json))),
        # Both top-M forward kernels (slot topk_tail_kl.triton_forward), timed in one process.
        Step("topk_triton", 40, bench("gpu_topk_tail_kl.py", "--variant", "triton")),
        Step("topk_torch_topk", 12, bench("gpu_topk_tail_kl.py", "--variant", "torch_topk")),
        Step("topk_torch_reference", 18,
             bench("gpu_topk_tail_kl.py", "--variant", "torch_reference")),
        Step("topk_trl_eager", 18, bench("gpu_topk_tail_kl.py", "--variant", "trl_eager"),
             requires=("trl", "datasets")),
        Step("topk_sweep", 40, bench("gpu_topk_sweep.py")),
        Step("tests_triton", 100, run.pytest_cmd("tests_triton", files, TRITON_TESTS_K),
             tests=True),
        Step("probe", 15),
        Step("tests_cuda", 45, run.pytest_cmd("tests_cuda", files, CUDA_TESTS_K), tests=True,
             needs=("topk_tail_kl/cuda",)),
        Step("topk_cuda", 20, bench("gpu_topk_tail_kl.py", "--variant", "cuda"),
             needs=("topk_tail_kl/cuda",)),
        Step("fused_materialized", 20, bench("gpu_fused_linear.py", "--variant", "materialized")),
        Step("fused_chunked", 20, bench("gpu_fused_linear.py", "--variant", "chunked"),
             needs=("fused_linear_topk_tail_kl/chunked",)),
        Step("fused_triton", 40, bench("gpu_fused_linear.py", "--variant", "triton")),
        Step("fused_chunked_loss", 20, bench("gpu_fused_linear.py", "--variant", "chunked_loss"),
             needs=("fused_linear_topk_tail_kl/chunked",)),
        Step("fused_trl", 20, bench("gpu_fused_linear.py", "--variant", "trl_chunked_divergence"),
             requires=("trl", "datasets")),
        Step("fused_liger", 20, bench("gpu_fused_linear.py", "--variant",
                                      "liger_fused_linear_jsd"), requires=("liger_kernel",)),
        Step("varlen_triton", 20, bench("gpu_qformer.py", "--variant", "triton")),
        Step("varlen_cuda", 15, bench("gpu_qformer.py", "--variant", "cuda"),
             needs=("varlen/cuda",)),
        Step("varlen_sdpa_padded", 12, bench("gpu_qformer.py", "--variant", "sdpa_padded")),
        Step("varlen_flash_attn", 12, bench("gpu_qformer.py", "--variant", "flash_attn_varlen"),
             requires=("flash_attn",)),
        Step("qformer_module_fused", 20, bench("gpu_qformer.py", "--variant", "module_fused")),
        Step("qformer_module_padded", 12, bench("gpu_qformer.py", "--variant", "module_padded")),
        Step("train_fused_linear", 35, bench("gpu_train_step.py", "--variant", "fused_linear")),
        Step("train_materialized", 35, bench("gpu_train_step.py", "--variant", "materialized")),
        # Tensor parallelism: torchrun over every visible GPU (NCCL); 2 gloo ranks in a dry run.
        Step("vocab_parallel", 30, bench("gpu_vocab_parallel.py")),
    ]  # fmt: skip
    gpus = gpu_count()
    if gpus < 2 and not run.dry:
        steps[-1].status = "skipped"
        steps[-1].note = f"needs 2 or more GPUs for tensor parallelism, found {gpus}"
    memcheck = run.pytest_cmd("memcheck", list(MEMCHECK_TESTS), MEMCHECK_K)
    if sanitizer and not run.dry:
        memcheck = [sanitizer, "--tool", "memcheck", "--error-exitcode", "9", "--print-limit",
                    "30", *memcheck]  # fmt: skip
    no_cache = {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1", "LOPD_TEST_SMALL": "1"}
    steps.append(Step("memcheck", 60, memcheck, tests=True, env=no_cache))
    if not sanitizer and not run.dry:
        steps[-1].status, steps[-1].note = "skipped", "compute-sanitizer not found"
    return steps
