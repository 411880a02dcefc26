"""The SIMT emulator (csrc/emu/simt_emulator.h) that runs the CUDA kernels on CPU in the tests:
its collectives compute the right values in any schedule, it reports the bugs it promises to
report (with source lines), and its AddressSanitizer build catches out-of-bounds accesses while
the real CUDA kernels run clean under it (the CPU stand-in for compute-sanitizer memcheck)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.kernels import simt_emu

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    simt_emu.unavailable_reason() is not None, reason=str(simt_emu.unavailable_reason())
)


@pytest.fixture(autouse=True)
def emulator():
    simt_emu.load()
    simt_emu.set_schedule_seed(0)
    yield torch.ops.lopd_simt_emu
    simt_emu.set_schedule_seed(0)


@pytest.mark.parametrize("seed", [0, 1, 7])
@pytest.mark.parametrize("threads", [32, 96, 256, 1024])
def test_warp_and_block_reductions(emulator, seed, threads):
    simt_emu.set_schedule_seed(seed)
    x = torch.randn(3, 1001, generator=torch.Generator().manual_seed(threads))
    out = emulator.selftest_block_sum(x, threads)
    torch.testing.assert_close(out[:3], x.sum(1), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out[3], x.sum(), rtol=1e-5, atol=1e-3)  # atomicAdd across blocks


def test_partial_warp_masks_are_refused(emulator):
    # 100 threads: the last warp has 4 lanes, so the kernel's full mask 0xffffffff is wrong there.
    with pytest.raises(RuntimeError, match="only the full-warp mask 0xf is emulated"):
        emulator.selftest_block_sum(torch.zeros(1, 10), 100)


def test_divergent_barrier_is_reported_with_source_lines(emulator):
    with pytest.raises(
        RuntimeError, match=r"divergent synchronisation.*simt_selftest_emu\.cpp:\d+"
    ):
        emulator.selftest_divergent_barrier(64)


def test_exit_under_a_barrier_is_reported(emulator):
    with pytest.raises(RuntimeError, match=r"deadlock.*32 thread\(s\) wait in __syncthreads"):
        emulator.selftest_early_exit(64)


def test_block_size_is_checked(emulator):
    with pytest.raises(RuntimeError, match=r"block size must be in \[1, 1024\]"):
        emulator.selftest_block_sum(torch.zeros(1, 10), 2048)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(
    ("m", "n", "k", "warps"), [(16, 16, 16, 1), (32, 32, 32, 4), (48, 32, 64, 3)]
)
def test_wmma_gemm_matches_torch_matmul(emulator, dtype, m, n, k, warps):
    """nvcuda::wmma m16n16k16 (row-major A, col-major B, fp32 accumulator loaded from memory or
    zero-filled, an element-wise op through num_elements / x[]) against torch.matmul on the same
    half-precision inputs: the products are exact in fp32; only the fp32 sums' rounding differs."""
    gen = torch.Generator().manual_seed(m + n + k)
    a = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(k, n, generator=gen).to(dtype)
    c = torch.randn(m, n, generator=gen)
    expected = torch.matmul(a.double(), b.double())
    out = emulator.selftest_wmma_gemm(a, b, c, 1.0, False, warps)
    torch.testing.assert_close(out, expected.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, torch.matmul(a.float(), b.float()), rtol=1e-5, atol=1e-5)
    out = emulator.selftest_wmma_gemm(a, b, c, 0.5, True, warps)
    torch.testing.assert_close(out, (0.5 * (expected + c.double())).float(), rtol=1e-5, atol=1e-5)


def test_wmma_reached_by_part_of_a_warp_is_reported(emulator):
    with pytest.raises(RuntimeError, match=r"deadlock.*16 thread\(s\) wait in wmma::mma_sync"):
        emulator.selftest_wmma_partial_warp()


def test_launch_limits_are_those_of_the_gpu(emulator):
    assert emulator.selftest_launch_limits(3, 2, 227 * 1024).item() == 1.0
    with pytest.raises(RuntimeError, match="dynamic shared memory"):
        emulator.selftest_launch_limits(1, 1, 227 * 1024 + 1)
    with pytest.raises(RuntimeError, match="outside CUDA's limits"):
        emulator.selftest_launch_limits(1, 65536, 0)


def test_wmma_layout_requirements_are_enforced(emulator):
    """The GPU needs 256-bit aligned WMMA pointers and 16-byte multiples as leading dimension;
    the emulator refuses the rest instead of quietly working."""
    assert emulator.selftest_wmma_layout(16, 16).item() == 1.0
    assert emulator.selftest_wmma_layout(0, 24).item() == 1.0  # 48 bytes: allowed
    with pytest.raises(RuntimeError, match="not 256-bit"):
        emulator.selftest_wmma_layout(8, 16)  # 16 bytes off
    with pytest.raises(RuntimeError, match="not a multiple of 16 bytes"):
        emulator.selftest_wmma_layout(0, 20)  # 40 bytes


def _gcc_lib(name: str) -> str | None:
    path = subprocess.run(
        ["g++", f"-print-file-name={name}"], capture_output=True, text=True
    ).stdout.strip()
    return path if path and Path(path).is_file() else None


def _asan_env() -> dict[str, str] | None:
    asan, stdcxx = _gcc_lib("libasan.so"), _gcc_lib("libstdc++.so")
    if asan is None or stdcxx is None:
        return None
    env = dict(os.environ)
    env.update(
        # libstdc++ right after libasan: loaded later (by torch), C++ exceptions thrown in the
        # extension (TORCH_CHECK) would abort the process without a word.
        LD_PRELOAD=f"{asan} {stdcxx}",
        # Python and torch keep allocations to exit; the emulator's fibers switch stacks, which
        # ASan supports with a warning (printed once).
        ASAN_OPTIONS="detect_leaks=0:detect_stack_use_after_return=0",
        LOPD_SIMT_SANITIZE="address",
        LOPD_TEST_SMALL="1",
    )
    return env


@pytest.mark.skipif(_asan_env() is None, reason="g++ has no libasan.so / libstdc++.so to preload")
def test_emulated_cuda_kernels_under_address_sanitizer():
    """First the sanitizer must catch a deliberate one-past-the-end read (so this test can fail),
    then every emulated CUDA kernel test must run clean under it."""
    env = _asan_env()
    canary = subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch; from tests.kernels import simt_emu; simt_emu.load(); "
            "torch.ops.lopd_simt_emu.selftest_oob_read(torch.zeros(5))",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert canary.returncode != 0 and "heap-buffer-overflow" in canary.stderr, (
        "AddressSanitizer missed the out-of-bounds canary:\n" + canary.stderr[-3000:]
    )
    files = sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "kernels").glob("test_*_cuda.py")
    )
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *files],
        cwd=ROOT,
        env={**env, "PYTEST_ADDOPTS": "-k emulated"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    tail = (run.stdout + run.stderr)[-4000:]
    assert run.returncode == 0, "emulated CUDA kernels under AddressSanitizer:\n" + tail
    assert "ERROR: AddressSanitizer" not in run.stderr, tail
    assert " passed" in run.stdout, tail
