"""Dry run only: the GPU check's steps as forked children of one preloaded process.

A CPU dry run of ``benchmarks/gpu_run.py`` (``--dry-run-cpu``, tests/scripts/test_gpu_scripts.py in
CI) has ~25 Python steps; as fresh processes each would spend 5-10 s importing torch, lopd_kernels
and transformers. :func:`preload` imports them once and :class:`Forked` runs each step in a forked
child: the same script, arguments and environment as an exec, in a process group of its own.
Never used on a GPU (CUDA does not survive a fork; there every step is a fresh process).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def forkable(cmd: list[str], py: str) -> bool:
    """A Python step of this repo (a script or ``-m pytest``) run by this interpreter."""
    return (
        cmd[0] == py == sys.executable
        and "torch" in sys.modules  # preloaded
        and (cmd[1].endswith(".py") or cmd[1:3] == ["-m", "pytest"])
    )


def preload(models: bool) -> None:
    """Dry run only: import what the steps import, once, so that each forked step starts in a
    fraction of a second (a fresh CPU process spends 5-10 s importing torch, lopd_kernels and
    transformers; the dry run has 25 steps). ``models``: transformers too (the train steps).
    Never on a GPU: CUDA does not survive a fork, and there every step is a fresh process."""
    import torch  # noqa: F401

    import lopd_kernels  # noqa: F401

    if models:
        from transformers import Qwen3ForCausalLM  # noqa: F401


class Forked:
    """A step run in a forked child of this (preloaded) process, with the ``Popen`` surface
    ``Run.run_cmd`` uses: ``pid`` (a process group of its own), ``stdout``, ``wait``, ``poll``.
    The child runs the same script with the same arguments and environment as an exec would."""

    def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
        read, write = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:  # the child
            code = 1
            try:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.setsid()
                os.dup2(write, 1)
                os.dup2(write, 2)
                os.close(read)
                sys.stdout.reconfigure(line_buffering=True)
                os.chdir(ROOT)
                os.environ.clear()
                os.environ.update(env)
                sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
                code = run_in_child(cmd)
            except SystemExit as exit_:
                code = (
                    exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
                )
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        os.close(write)
        self.stdout = os.fdopen(read, "r", errors="replace")
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
            time.sleep(0.05)
        assert self.returncode is not None
        return self.returncode


def run_in_child(cmd: list[str]) -> int:
    import runpy

    if cmd[1:3] == ["-m", "pytest"]:
        sys.argv = ["pytest", *cmd[3:]]
        runpy.run_module("pytest", run_name="__main__", alter_sys=True)
    else:
        sys.argv = cmd[1:]
        sys.path.insert(0, str((ROOT / cmd[1]).parent))
        runpy.run_path(str(ROOT / cmd[1]), run_name="__main__")
    return 0
