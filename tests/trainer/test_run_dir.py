"""Run directories a careless or concurrent user meets (lopd.run.claim, lopd.train): a fresh run
into a used directory, ``--overwrite``, ``--resume`` on a missing / empty / edited / other run's
config, two runs on one directory (and a killed holder), a path that is a file or read-only.
Each refusal is one line on stderr, exit code 2, before any model loads, and changes nothing."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from lopd.config import load_config
from lopd.run.claim import claim_run_dir, clear_run_dir, read_saved_run, run_identity
from lopd.run.run_dir import RunDir, RunDirError
from lopd.train import main

ROOT_USER = os.geteuid() == 0


def _cfg(run_dir: Path, *overrides: str):
    return load_config("smoke", overrides=[f"run_dir={str(run_dir)!r}", *overrides])


def _finished_run(run_dir: Path, *overrides: str) -> dict[str, bytes]:
    """A run directory as a finished smoke run leaves it (its files' bytes, to compare)."""
    claim_run_dir(RunDir(run_dir), _cfg(run_dir, *overrides)).release()
    (run_dir / "eval_vanilla.json").write_text('{"reward_mean": 0.25}')
    (run_dir / "bank").mkdir()
    (run_dir / "bank" / "DONE").write_text('{"rollouts": 8}')
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    (run_dir / "checkpoints" / "step_000002.pt").write_bytes(b"weights")
    return _snapshot(run_dir)


def _snapshot(run_dir: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(run_dir)): p.read_bytes()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def _refused(capsys, argv: list[str]) -> str:
    """Run ``python -m lopd.train`` in-process; it must refuse with exit 2 and one line."""
    rc = main([*argv, "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_a_fresh_run_refuses_a_used_directory_and_touches_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    before = _finished_run(run)
    err = _refused(capsys, ["--preset", "smoke", "--run-dir", str(run), "seed=1"])
    assert "already holds the run of seed 0 on the shipped tiny model" in err
    assert "--resume continues it, --overwrite deletes it" in err
    assert _snapshot(run) == before
    # Half a run (no config.yaml: killed before anything, or copied around) is refused too.
    (run / "config.yaml").unlink()
    err = _refused(capsys, ["--preset", "smoke", "--run-dir", str(run)])
    assert "already holds part of a run" in err


def test_overwrite_starts_clean_and_never_removes_what_no_run_writes(tmp_path):
    run = tmp_path / "run"
    _finished_run(run)
    lock = claim_run_dir(RunDir(run), _cfg(run, "seed=1"), overwrite=True)
    lock.release()
    # Nothing of the old run is left to be reused: bank, vanilla evaluation, checkpoints, metrics.
    assert sorted(p.name for p in run.iterdir()) == [".lock", "checkpoints", "config.yaml"]
    assert not any((run / "checkpoints").iterdir())
    assert read_saved_run(RunDir(run))["seed"] == 1
    # A directory that holds anything else is not a run's: --overwrite refuses, removes nothing.
    (run / "notes.txt").write_text("mine")
    with pytest.raises(RunDirError, match=r"holds files no run writes \(notes.txt\)"):
        claim_run_dir(RunDir(run), _cfg(run), overwrite=True)
    with pytest.raises(RunDirError, match="holds files no run writes"):
        clear_run_dir(RunDir(run))
    assert (run / "notes.txt").exists() and (run / "config.yaml").exists()


def test_identity_is_recorded_atomically_and_a_whole_config_resumes(tmp_path):
    run = tmp_path / "run"
    cfg = _cfg(run, "seed=3")
    claim_run_dir(RunDir(run), cfg).release()
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["identity"] == run_identity(cfg) and saved["identity"]["seed"] == 3
    assert saved["identity"]["model"] is None and len(saved["identity"]["config_sha256"]) == 64
    assert not [p for p in run.iterdir() if p.name.endswith(".tmp")]
    # The saved file loads back as the same run (the identity is not a field), moved or not.
    again = load_config("smoke", run / "config.yaml", [f"run_dir={str(tmp_path / 'moved')!r}"])
    assert run_identity(again) == run_identity(cfg)
    mtime = (run / "config.yaml").stat().st_mtime_ns
    time.sleep(0.01)
    claim_run_dir(RunDir(run), cfg, resume=True).release()
    assert (run / "config.yaml").stat().st_mtime_ns == mtime  # unchanged: not rewritten
    more = _cfg(run, "seed=3", "train.steps=9")
    claim_run_dir(RunDir(run), more, resume=True).release()  # an override: recorded
    assert read_saved_run(RunDir(run))["config_sha256"] == run_identity(more)["config_sha256"]


@pytest.mark.parametrize(
    "damage, message",
    [
        ("missing", "holds no run to resume (no config.yaml)"),
        ("empty", "config.yaml is empty, so the run it holds is unknown"),
        ("garbage", "config.yaml is not a run configuration"),
        ("no identity", "config.yaml records no run identity"),
        ("edited", "config.yaml no longer matches the run it records (edited or damaged)"),
        ("other seed", "holds the run of seed 0, not 1"),
    ],
)
def test_resume_refuses_a_config_that_is_not_this_run(tmp_path, capsys, damage, message):
    run = tmp_path / "run"
    _finished_run(run)
    config = run / "config.yaml"
    text = config.read_text()
    extra = []
    if damage == "missing":
        config.unlink()
    elif damage == "empty":
        config.write_text("")
    elif damage == "garbage":
        config.write_bytes(b"\x00\x01 not: [yaml")
    elif damage == "no identity":
        fields = yaml.safe_load(text)
        del fields["identity"]
        config.write_text(yaml.safe_dump(fields, sort_keys=False))
    elif damage == "edited":  # by hand, after the run started: not the run its checkpoints hold
        fields = yaml.safe_load(text)
        fields["train"]["steps"] += 1
        config.write_text(yaml.safe_dump(fields, sort_keys=False))
    else:
        extra = ["seed=1"]
    before = _snapshot(run)
    err = _refused(capsys, ["--preset", "smoke", "--run-dir", str(run), "--resume", *extra])
    assert message in err, err
    assert _snapshot(run) == before


def test_a_second_run_names_the_holder_and_a_killed_holder_blocks_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    _finished_run(run)
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the holder: a run that took the directory and is still going
        try:
            claim_run_dir(RunDir(run), _cfg(run), resume=True)
            os.write(ready_w, b"1")
            time.sleep(120)
        finally:
            os._exit(0)
    try:
        assert os.read(ready_r, 1) == b"1"
        err = _refused(capsys, ["--preset", "smoke", "--run-dir", str(run), "--resume"])
        assert f"is in use by another run (pid {pid})" in err
        with pytest.raises(RunDirError, match=f"pid {pid}"):
            claim_run_dir(RunDir(run), _cfg(run), overwrite=True)
    finally:
        os.kill(pid, signal.SIGKILL)  # killed as a crashed or OOM-killed run would be
        os.waitpid(pid, 0)
        os.close(ready_r)
        os.close(ready_w)
    # The kernel dropped its lock with it: the next run takes the directory at once.
    assert (run / ".lock").read_text().strip() == str(pid)
    claim_run_dir(RunDir(run), _cfg(run), resume=True).release()
    assert (run / ".lock").read_text().strip() == str(os.getpid())


def test_a_run_dir_that_is_a_file_or_under_a_file(tmp_path, capsys):
    a_file = tmp_path / "results.txt"
    a_file.write_text("keep me")
    for run, message in (
        (a_file, f"run directory {a_file} exists and is not a directory"),
        (a_file / "run", f"run directory {a_file / 'run'} cannot be created (Not a directory)"),
    ):
        assert _refused(capsys, ["--preset", "smoke", "--run-dir", str(run)]) == (
            f"lopd.train: {message}"
        )
    assert a_file.read_text() == "keep me"


def _claim_as_nobody(run: Path, **kw) -> str:
    """What claiming ``run`` says in a child process without root's override of file modes."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            if ROOT_USER:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
            try:
                claim_run_dir(RunDir(run), _cfg(run), **kw).release()
                os.write(w, b"claimed")
            except RunDirError as err:
                os.write(w, str(err).encode())
        finally:
            os._exit(0)
    os.close(w)
    out = b""
    while chunk := os.read(r, 4096):
        out += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return out.decode()


@pytest.fixture
def open_tmp():
    """A temporary directory every uid can traverse (pytest's tmp_path is private to us)."""
    path = Path(tempfile.mkdtemp(prefix="lopd-run-dir-"))
    os.chmod(path, 0o755)
    yield path
    for p in [path, *path.rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    shutil.rmtree(path)


def test_a_read_only_run_dir_gives_one_line_even_for_a_finished_run(open_tmp):
    run = open_tmp / "run"
    before = _finished_run(run)
    for p in [run, *run.rglob("*")]:
        os.chmod(p, 0o555 if p.is_dir() else 0o444)
    try:
        for kw in ({"resume": True}, {"overwrite": True}, {}):
            said = _claim_as_nobody(run, **kw)
            assert said.startswith(f"run directory {run} is not writable (Permission denied)"), said
        said = _claim_as_nobody(run / "sub")
        assert said == f"run directory {run / 'sub'} cannot be created (Permission denied)", said
    finally:
        for p in [run, *run.rglob("*")]:
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
    assert _snapshot(run) == before
