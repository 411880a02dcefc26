"""Builds ``lopd_kernels._C`` by driving ``CMakeLists.txt``.

Build against the torch you run with: ``pip install torch`` first, then
``pip install --no-build-isolation -e .``. Environment knobs:

- ``LOPD_CUDA=0|1``: force the CUDA part off/on (default: on when torch has CUDA and nvcc exists).
- ``LOPD_CUDA_ARCHS``: CUDA architectures, default ``80;90a``.
- ``MAX_JOBS``: parallel compile jobs.
- ``LOPD_SKIP_EXT=1``: skip the extension entirely (pure-Python install, reference kernels only).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        import torch  # imported here: the build needs the torch it will run with

        out = Path(self.get_ext_fullpath(ext.name)).resolve()
        build_temp = Path(self.build_temp).resolve() / "cmake"
        build_temp.mkdir(parents=True, exist_ok=True)
        want_cuda = os.environ.get("LOPD_CUDA")
        nvcc = shutil.which("nvcc") or (
            "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None
        )
        has_nvcc = nvcc is not None
        with_cuda = (
            want_cuda == "1"
            if want_cuda is not None
            else (torch.version.cuda is not None and has_nvcc)
        )
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        args = [
            f"-S{ROOT}",
            f"-B{build_temp}",
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-DLOPD_EXT_DIR={out.parent}",
            f"-DLOPD_EXT_SUFFIX={suffix}",
            f"-DLOPD_WITH_CUDA={'ON' if with_cuda else 'OFF'}",
            f"-DLOPD_CUDA_ARCHS={os.environ.get('LOPD_CUDA_ARCHS', '80;90a')}",
        ]
        if with_cuda and nvcc and not os.environ.get("CUDACXX"):
            # CMake looks for nvcc on PATH only; name the one found (e.g. /usr/local/cuda/bin).
            args.append(f"-DCMAKE_CUDA_COMPILER={nvcc}")
        if shutil.which("ninja"):
            args.append("-GNinja")
        subprocess.run(["cmake", *args], check=True)
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.run(
            ["cmake", "--build", str(build_temp), "--target", "_C", "-j", jobs], check=True
        )


ext_modules = [] if os.environ.get("LOPD_SKIP_EXT") == "1" else [CMakeExtension("lopd_kernels._C")]
setup(ext_modules=ext_modules, cmdclass={"build_ext": CMakeBuild})
