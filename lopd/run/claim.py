"""Claiming a run directory: one run at a time, never another run's files, its identity on record.

Before a run loads anything, :func:`claim_run_dir` (on rank 0, from ``Trainer.run``) makes sure
the directory is this run's and nobody else's:

* **a lock**: ``flock`` on ``run_dir/.lock`` (exclusive, non-blocking), held until the run ends.
  A second run on the directory stops with one line naming the holder's pid. The kernel drops
  the lock when its holder dies, however it dies, so a killed run never blocks the next one; the
  pid in the file is only for the message.
* **a fresh run** (no ``--resume``) needs a new or empty directory. A directory that holds a run
  is refused with one line; ``--overwrite`` removes that run's files first (and only a run's:
  a directory holding anything else is refused), so no phase of another run (its bank, cold
  start, vanilla evaluation, checkpoints, metrics) is ever reused or appended to.
* **a resumed run** needs the run's ``config.yaml`` whole and unedited: it records the run's
  identity (the SHA-256 of its fields, the seed and the model), checked against the fields
  (:func:`read_saved_run`); the command line may not change the seed or the model.
* ``config.yaml`` is written atomically (:func:`lopd.atomic.atomic_write_text`), and on resume
  only when the command line changed a field.

Every refusal is a :class:`~lopd.run.run_dir.RunDirError` with a one-line message: a path that
is not a directory, or that cannot be created or written (read-only), included.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import yaml

from lopd.config import Config
from lopd.config.config import IDENTITY_KEY
from lopd.parallel.distributed import Dist
from lopd.run.run_dir import RunDir, RunDirError

__all__ = [
    "RunLock",
    "claim_on_rank0",
    "claim_run_dir",
    "clear_run_dir",
    "read_saved_run",
    "refuse_used_runs",
    "run_identity",
]

LOCK_FILE = ".lock"


def run_identity(cfg: Config) -> dict[str, Any]:
    """What makes a run this run: the SHA-256 of its fields (``run_dir`` aside: a moved
    directory is the same run), its seed and its model (``None``: the shipped tiny model)."""
    fields = cfg.to_dict()
    fields.pop("run_dir", None)
    text = json.dumps(fields, sort_keys=True, default=str)
    return {
        "config_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "seed": cfg.seed,
        "model": cfg.model.path,
    }


def _model_name(model: str | None) -> str:
    return "the shipped tiny model" if model is None else repr(model)


def read_saved_run(run_dir: RunDir) -> dict[str, Any]:
    """The identity recorded in a run directory's ``config.yaml``, checked against its fields.

    Raises:
        RunDirError: no ``config.yaml``, an empty or unreadable one, one without an identity,
            or one whose fields no longer hash to its identity (edited or damaged).
    """
    path = run_dir.config
    where = f"--resume: {run_dir.root}"
    if not path.exists():
        raise RunDirError(f"{where} holds no run to resume (no config.yaml)")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise RunDirError(f"{where}: config.yaml cannot be read ({_reason(err)})") from None
    if not text.strip():
        raise RunDirError(
            f"{where}: config.yaml is empty, so the run it holds is unknown; nothing resumed "
            "(--overwrite starts a new run there)"
        )
    try:
        mapping = yaml.safe_load(text)
    except yaml.YAMLError:
        mapping = None
    if not isinstance(mapping, dict):
        raise RunDirError(f"{where}: config.yaml is not a run configuration (not a YAML mapping)")
    identity = mapping.pop(IDENTITY_KEY, None)
    if not isinstance(identity, dict) or not {"config_sha256", "seed", "model"} <= set(identity):
        raise RunDirError(f"{where}: config.yaml records no run identity; nothing resumed")
    cfg = Config()
    try:
        cfg.update(mapping, source="config.yaml")
    except Exception as err:  # any bad field: the file is not the run's configuration
        raise RunDirError(
            f"{where}: config.yaml is not a valid run configuration ({err})"
        ) from None
    if run_identity(cfg)["config_sha256"] != identity["config_sha256"]:
        raise RunDirError(
            f"{where}: config.yaml no longer matches the run it records (edited or damaged); "
            "nothing resumed (change fields with section.field=value on the command line)"
        )
    return identity


class RunLock:
    """The exclusive lock of one run directory (an open, ``flock``-ed ``.lock`` file)."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd: int | None = fd
        self.path = path

    def release(self) -> None:
        """Drop the lock (idempotent). The kernel also drops it when the process dies."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _reason(err: OSError | UnicodeDecodeError) -> str:
    if isinstance(err, OSError):
        return err.strerror or type(err).__name__
    return "not UTF-8 text"


def _lock(root: Path) -> RunLock:
    path = root / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as err:
        raise RunDirError(f"run directory {root} is not writable ({_reason(err)})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise RunDirError(
                f"run directory {root} is in use by another run (pid {holder}); wait for it to "
                "end or give another --run-dir"
            ) from None
        raise RunDirError(f"run directory {root} cannot be locked ({_reason(err)})") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as err:
        os.close(fd)
        raise RunDirError(f"run directory {root} is not writable ({_reason(err)})") from None
    return RunLock(fd, path)


def _is_run_file(run_dir: RunDir, name: str) -> bool:
    """A name a run writes (atomic writes' temporary files ``.<name>.*.tmp`` included)."""
    names = run_dir.entry_names()
    return name in names or (
        name.endswith(".tmp") and any(name.startswith(f".{n}.") for n in names)
    )


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def claim_run_dir(
    run_dir: RunDir,
    cfg: Config,
    *,
    resume: bool = False,
    overwrite: bool = False,
    shared_phases: tuple[Path, ...] = (),
) -> RunLock:
    """Lock ``run_dir`` for the run of ``cfg`` and record the run's identity in ``config.yaml``.

    Args:
        run_dir: the run directory (created if missing).
        cfg: the run's configuration.
        resume: continue the run the directory holds (its identity must match ``cfg``'s seed
            and model).
        overwrite: a fresh run in a directory holding a run: remove that run's files first.
        shared_phases: paths a fresh run may find already there (``lopd.compare`` copies the
            phases every method of a seed shares: :meth:`RunDir.shared_phases`).

    Returns:
        The lock; release it when the run ends.

    Raises:
        RunDirError: the directory cannot be used (one-line message: why, and what to do).
        ValueError: ``resume`` and ``overwrite`` together.
    """
    if resume and overwrite:
        raise ValueError("resume and overwrite exclude each other")
    root = run_dir.root
    if root.exists() and not root.is_dir():
        raise RunDirError(f"run directory {root} exists and is not a directory")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunDirError(f"run directory {root} cannot be created ({_reason(err)})") from None
    lock = _lock(root)
    try:
        identity = run_identity(cfg)
        if resume:
            saved = read_saved_run(run_dir)
            for key, what in (("seed", "seed"), ("model", "model")):
                if saved[key] != identity[key]:
                    shown = _model_name if key == "model" else repr
                    raise RunDirError(
                        f"--resume: {root} holds the run of {what} {shown(saved[key])}, not "
                        f"{shown(identity[key])}: a resumed run continues the run it finds "
                        "(drop that override, or start a new run elsewhere)"
                    )
            if saved["config_sha256"] != identity["config_sha256"]:
                cfg.save(run_dir.config, identity)  # command-line overrides changed a field
        else:
            _make_fresh(run_dir, overwrite, shared_phases)
            cfg.save(run_dir.config, identity)
        run_dir.checkpoints.mkdir(exist_ok=True)
    except OSError as err:
        lock.release()
        raise RunDirError(f"run directory {root} is not writable ({_reason(err)})") from None
    except BaseException:
        lock.release()
        raise
    return lock


def _make_fresh(run_dir: RunDir, overwrite: bool, shared_phases: tuple[Path, ...]) -> None:
    """Leave nothing of another run in ``run_dir`` (with ``overwrite``: remove it)."""
    root = run_dir.root
    allowed = {p.relative_to(root).parts[0] for p in shared_phases}
    present = sorted(p.name for p in root.iterdir() if p.name not in (LOCK_FILE, *allowed))
    if not present:
        return
    foreign = [name for name in present if not _is_run_file(run_dir, name)]
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise RunDirError(
            f"run directory {root} is not empty and holds files no run writes ({shown}); give a "
            "new or empty --run-dir"
        )
    if not overwrite:
        held = "a run" if run_dir.config.name in present else "part of a run"
        with contextlib.suppress(RunDirError):
            saved = read_saved_run(run_dir)
            held = f"the run of seed {saved['seed']} on {_model_name(saved['model'])}"
        raise RunDirError(
            f"run directory {root} already holds {held}: --resume continues it, --overwrite "
            "deletes it and starts a new run"
        )
    for name in present:
        _remove(root / name)


def clear_run_dir(run_dir: RunDir) -> None:
    """Remove a run's files from ``run_dir`` (what ``--overwrite`` does; a missing directory is
    fine).

    Raises:
        RunDirError: the directory holds files no run writes (nothing is removed then).
    """
    if run_dir.root.is_dir():
        _make_fresh(run_dir, overwrite=True, shared_phases=())


def claim_on_rank0(dist: Dist, run_dir: RunDir, cfg: Config, **kw: Any) -> RunLock | None:
    """:func:`claim_run_dir` on rank 0, with every rank told whether it worked (so no rank waits
    for a run that will not start). Returns rank 0's lock (``None`` on the others).

    Raises:
        RunDirError: on every rank when rank 0 could not claim the directory (rank 0's says why).
    """
    lock, error = None, None
    if dist.is_main:
        try:
            lock = claim_run_dir(run_dir, cfg, **kw)
        except RunDirError as err:
            error = err
    if dist.all_reduce_sum([float(error is not None)])[0] > 0:
        raise error or RunDirError(f"rank 0 could not claim the run directory {run_dir.root}")
    return lock


def refuse_used_runs(runs: Path) -> None:
    """For commands that start many runs under one folder (``lopd.compare``, ``lopd.chain``):
    refuse, before any run starts, a folder where an earlier invocation left runs.

    Raises:
        RunDirError: a run directory under ``runs`` holds a run (names up to three).
    """
    used = sorted(d.name for d in runs.glob("*") if (d / "config.yaml").exists())
    if used:
        shown = ", ".join(used[:3]) + (", ..." if len(used) > 3 else "")
        raise RunDirError(
            f"{runs} already holds runs ({shown}): --overwrite starts them over, or give another "
            "--out"
        )
