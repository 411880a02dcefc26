"""Removing a directory tree that an untrusted program built: deep, wide, or with hostile modes.

``shutil.rmtree`` recurses once per directory level (a tree 1,000 directories deep raises
``RecursionError`` and stays on disk) and cannot enter a directory whose mode is ``000`` when not
root. :func:`remove_tree` walks iteratively with descriptors relative to the directory at hand,
holding two descriptors at most, so neither the depth nor the path length (``PATH_MAX``)
matters; it restores owner permissions on directories it cannot list or write; it never follows
a symlink.
"""

from __future__ import annotations

import contextlib
import os
import stat

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_dir(name: str, dir_fd: int | None) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except PermissionError:
        # Mode 000 (or no x bit): as the owner we may give ourselves access back.
        os.chmod(name, 0o700, dir_fd=dir_fd)
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)


def _entries(fd: int) -> tuple[list[str], list[str]]:
    """``(subdirectories, other entries)`` of the directory ``fd``."""
    dirs, others = [], []
    with os.scandir(fd) as it:
        for entry in it:
            (dirs if entry.is_dir(follow_symlinks=False) else others).append(entry.name)
    return dirs, others


def _unlink(name: str, fd: int) -> None:
    try:
        os.unlink(name, dir_fd=fd)
    except PermissionError:
        os.fchmod(fd, 0o700)  # the directory was made read-only (no w bit)
        os.unlink(name, dir_fd=fd)
    except FileNotFoundError:
        pass


def remove_tree(path: str | os.PathLike) -> None:
    """Delete ``path`` and everything under it (a missing path is not an error).

    Raises:
        OSError: something could not be removed (e.g. an immutable file, or a file system
            mounted below ``path``); what could be removed is gone.
    """
    path = os.fspath(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        return
    fd = _open_dir(path, None)
    # Per level below ``path``: (name in the parent, the parent's (st_dev, st_ino), the parent's
    # subdirectories still to visit).
    stack: list[tuple[str, tuple[int, int], list[str]]] = []
    pending: list[str] | None = None
    try:
        while True:
            if pending is None:
                with contextlib.suppress(PermissionError):
                    os.fchmod(fd, 0o700)  # list and write it whatever its mode
                dirs, others = _entries(fd)
                for name in others:
                    _unlink(name, fd)
                pending = dirs
            if pending:
                name = pending.pop()
                try:
                    child = _open_dir(name, fd)
                except FileNotFoundError:
                    continue
                except OSError:  # not a directory any more (replaced): unlink it
                    _unlink(name, fd)
                    continue
                here = os.fstat(fd)
                stack.append((name, (here.st_dev, here.st_ino), pending))
                os.close(fd)
                fd, pending = child, None
                continue
            if not stack:
                break
            # This directory is empty: go up (through "..", checked against the recorded
            # parent so that a moved directory cannot lead elsewhere) and remove it.
            name, parent_id, pending = stack.pop()
            parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
            st = os.fstat(parent)
            os.close(fd)
            fd = parent
            if (st.st_dev, st.st_ino) != parent_id:
                raise OSError(f"remove_tree: {path}: a directory was moved during removal")
            os.rmdir(name, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(path)
