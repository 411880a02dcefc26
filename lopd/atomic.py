"""Atomic file writes: a killed process leaves the old file or the new one, never half a file.

Every file a run, a bank, a benchmark or a task export writes in one piece goes through
:func:`atomic_write`: the bytes go to a temporary file in the same directory (so the final
``os.replace`` is a rename within one file system), are ``fsync``-ed, and replace the target in
one step. A failed write removes its temporary file and leaves the target as it was.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

__all__ = ["atomic_torch_save", "atomic_write", "atomic_write_bytes", "atomic_write_text"]


def atomic_write(path: str | os.PathLike[str], write: Callable[[IO[bytes]], Any]) -> None:
    """Replace ``path`` by what ``write(f)`` writes to a binary file object.

    The file is created readable by everyone (``0644``, like a plain ``open``: ``mkstemp``'s
    ``0600`` would make shared artifacts private). The parent directory must exist.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace ``path`` by ``data``."""
    atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Replace ``path`` by ``text`` (UTF-8)."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_torch_save(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj, path)``, atomically."""
    atomic_write(path, lambda f: torch.save(obj, f))
