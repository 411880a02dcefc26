"""Start-up validation a hostile or careless user meets: non-finite config numbers, bad task files,
and a ``--resume`` after a crash that tore the last line of ``metrics.jsonl``."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lopd.config import Config, ConfigError, check_tasks_file, load_config
from lopd.envs import TaskFormatError, builtin_tasks, load_tasks_jsonl
from lopd.run.metrics import _truncate_metrics

REPO = Path(__file__).resolve().parents[2]


def _float_fields(obj=None, prefix: str = "") -> list[str]:
    obj = obj or Config()
    out = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out += _float_fields(value, f"{prefix}{f.name}.")
        elif isinstance(value, float):
            out.append(f"{prefix}{f.name}")
    return out


def test_every_float_field_is_covered():
    fields = _float_fields()
    for name in ("lopd.margin", "train.lr", "eval.temperature", "gen.top_p", "bank.min_reward"):
        assert name in fields
    assert len(fields) >= 15


@pytest.mark.parametrize("field", _float_fields())
@pytest.mark.parametrize("value", ["nan", ".inf", "-.inf"])
def test_non_finite_numbers_stop_at_startup_naming_the_field(field, value):
    cfg = load_config("smoke", overrides=[f"{field}={value}"])
    with pytest.raises(ConfigError, match="^" + re.escape(f"{field} must be a finite number")):
        cfg.validate(check_paths=False)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _train(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "lopd.train", "--preset", "smoke", "--run-dir", str(run_dir)]
    return subprocess.run(
        [*cmd, "--no-progress", *extra],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=REPO,
        timeout=300,
    )


def test_cli_stops_on_nan_before_loading_anything(tmp_path):
    for override, field in (
        ("lopd.margin=nan", "lopd.margin"),
        ("train.lr=nan", "train.lr"),
        ("eval.temperature=nan", "eval.temperature"),
    ):
        t0 = time.perf_counter()
        res = _train(tmp_path / "r", override)
        assert res.returncode == 2, res.stderr[-2000:]
        assert f"{field} must be a finite number, got nan" in res.stderr
        assert "Traceback" not in res.stderr and not (tmp_path / "r").exists()
        assert time.perf_counter() - t0 < 60


def test_moved_keys_are_refused_naming_the_new_key(tmp_path):
    from lopd.config.fields import MOVED_KEYS

    assert MOVED_KEYS["lopd.steps"] == "train.steps" and len(MOVED_KEYS) == 8
    for old, new in MOVED_KEYS.items():
        with pytest.raises(ConfigError) as err:
            load_config("smoke", overrides=[f"{old}=1"])
        assert str(err.value) == f"override '{old}=1': '{old}' is now '{new}'"
    yml = tmp_path / "old.yaml"
    yml.write_text("lopd:\n  margin: 0.1\n  micro_batch: 2\n")
    with pytest.raises(ConfigError, match=r"^--config .*: 'lopd\.micro_batch' is now "):
        load_config("smoke", yml)
    # The command line: one line, before anything is loaded or written.
    res = _train(tmp_path / "r", "lopd.steps=3")
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr == (
        "lopd.train: config error: override 'lopd.steps=3': 'lopd.steps' is now 'train.steps'\n"
    )
    assert not (tmp_path / "r").exists()


# --------------------------------------------------------------------------- task files


def _lines(tmp_path: Path, records: list[bytes]) -> Path:
    path = tmp_path / "tasks.jsonl"
    path.write_bytes(b"\n".join(records) + b"\n")
    return path


def _good() -> list[bytes]:
    return [json.dumps(t.to_dict()).encode() for t in builtin_tasks("tool_use", "train", n=3)]


@pytest.mark.parametrize(
    "line, message",
    [
        ({"world": "casino"}, "line 2: unknown world 'casino'; registered: "),
        (
            {"spec": {"seed": 1, "checks": [{"op": "sort_of_equals", "table": "t"}]}},
            "line 2: invalid check (ValueError: unknown check op 'sort_of_equals'",
        ),
        ({"spec": {"seed": 1, "checks": [{"op": "equals"}]}}, "line 2: invalid check (KeyError"),
    ],
)
def test_tasks_file_with_bad_world_or_check_stops_at_startup(tmp_path, line, message):
    good = _good()
    bad = json.dumps({**json.loads(good[1]), **line}).encode()
    path = _lines(tmp_path, [good[0], bad, good[2]])
    with pytest.raises(ConfigError, match="data.tasks_path .* " + message.replace("(", r"\(")):
        check_tasks_file(path)
    with pytest.raises(TaskFormatError, match=r"tasks\.jsonl:2: "):
        load_tasks_jsonl(path)


def test_tasks_file_that_is_not_utf8_names_the_line(tmp_path):
    good = _good()
    bad = good[2].replace(b'"instruction": "', b'"instruction": "Caf\xe9: ')  # Latin-1
    path = _lines(tmp_path, [good[0], good[1], bad])
    with pytest.raises(ConfigError, match=r"line 3: not valid UTF-8 \(invalid continuation byte"):
        check_tasks_file(path)
    with pytest.raises(TaskFormatError, match=r"tasks\.jsonl:3: not valid UTF-8"):
        load_tasks_jsonl(path)
    cfg = load_config("smoke", overrides=[f"data.tasks_path={path}"])
    with pytest.raises(ConfigError, match="line 3: not valid UTF-8"):
        cfg.validate()


# --------------------------------------------------------------------------- metrics on resume


def test_truncate_metrics_drops_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"step": s, "loss": 0.5}) for s in range(4)]
    path.write_text("\n".join(rows) + '\n{"step": 4, "lo')
    with pytest.warns(RuntimeWarning, match="dropping a torn last line"):
        _truncate_metrics(path, 3)
    assert path.read_text() == "\n".join(rows[:3]) + "\n"
    # Torn into garbage bytes, or into a complete but keyless line: the same.
    path.write_bytes(b"\n".join(r.encode() for r in rows) + b"\n\xff\xfe{\n")
    with pytest.warns(RuntimeWarning):
        _truncate_metrics(path, 2)
    assert path.read_text() == "\n".join(rows[:2]) + "\n"
    # A bad line with lines after it is not a crash artifact.
    path.write_text(rows[0] + "\n{oops\n" + rows[1] + "\n")
    with pytest.raises(RuntimeError, match="unreadable line 2 followed by further lines"):
        _truncate_metrics(path, 5)


def test_resume_after_a_torn_metrics_line_gives_the_uninterrupted_metrics(tmp_path):
    # The smoke run with the shortest evaluation (two tasks, no base+composer pass).
    small = ("data.n_test=2", "eval.with_composer=false")
    ref = tmp_path / "ref"
    res = _train(ref, *small)
    assert res.returncode == 0, res.stderr[-3000:]
    run = tmp_path / "run"
    shutil.copytree(ref, run)
    # As if killed while writing step 2's line, after the step-2 checkpoint: the last
    # checkpoint goes, the summary goes, and a torn line is left.
    (run / "checkpoints" / "step_000003.pt").unlink()
    (run / "summary.json").unlink()
    rows = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(rows[:2]) + "\n" + rows[2][: len(rows[2]) // 2])
    res = _train(run, "--resume", *small)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from step_000002.pt" in res.stdout
    assert "dropping a torn last line" in res.stderr

    def metrics(d: Path) -> list[dict]:
        out = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if not k.startswith("seconds_")} for r in out]

    assert metrics(run) == metrics(ref)


# --------------------------------------------------------------------------- task files: CLI


def _task_line(**changes) -> bytes:
    record = json.loads(_good()[1])
    for key, value in changes.items():
        if key == "spec":
            record["spec"] = value
        else:
            record[key] = value
    return json.dumps(record).encode()


def _coding_line(test: dict) -> bytes:
    spec = {"fn_name": None, "tests": [test], "solution": "print(input())"}
    record = {"task_id": "c1", "domain": "coding", "world": "coding", "instruction": "Echo.",
              "spec": spec, "split": "train"}  # fmt: skip
    return json.dumps(record).encode()


BAD_TASK_FILES = {
    "task_id a list": (
        lambda: [_good()[0], _task_line(task_id=["a", "b"])],
        "line 2: task_id must be a string, got a list",
    ),
    "instruction null": (
        lambda: [_good()[0], _task_line(instruction=None)],
        "line 2: instruction must be a string, got null",
    ),
    "a 2 MB instruction": (
        lambda: [_good()[0], _good()[2], _task_line(instruction="x" * 2_000_000)],
        "line 3: instruction is 2,000,000 characters, over the 1,000,000 limit",
    ),
    "a 100 MB instruction": (
        lambda: [_good()[0], _task_line(instruction="x" * 100_000_000)],
        "line 2: line longer than 64 MiB",
    ),
    "a stdin test whose input is an int": (
        lambda: [_coding_line({"input": 5, "output": "5"})],
        "line 1: test 1: a stdin/stdout test's input must be a string (the program's text), "
        "got a number",
    ),
}


@pytest.mark.parametrize("case", list(BAD_TASK_FILES))
def test_bad_task_file_is_one_line_naming_the_line_before_any_model_loads(case, tmp_path, capsys):
    from lopd.train import main

    records, message = BAD_TASK_FILES[case]
    path = _lines(tmp_path, records())
    run = tmp_path / "run"
    argv = ["--preset", "smoke", "--tasks", str(path), "--run-dir", str(run), "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"lopd.train: config error: data.tasks_path {str(path)!r} {message}", err
    assert not run.exists()  # stopped before anything was created, let alone loaded
    with pytest.raises(TaskFormatError, match=re.escape(f"tasks.jsonl:{message[5:]}")):
        load_tasks_jsonl(path)


def test_a_fifo_as_tasks_file_is_named_and_never_opened(tmp_path, capsys):
    from lopd.train import main

    fifo = tmp_path / "tasks.jsonl"
    os.mkfifo(fifo)  # opening it would block until a writer comes
    empty = tmp_path / "empty"
    empty.mkdir()
    for path, what in (
        (fifo, " is a FIFO, not a regular file"),
        # A directory is read as a benchmark's release (EnvScaler's, ACEBench's).
        (empty, f": {empty}: no .json or .jsonl file in it"),
        (tmp_path, f": {fifo}: is a FIFO, not a regular file; load failed"),
    ):
        argv = ["--preset", "smoke", "--tasks", str(path), "--run-dir", str(tmp_path / "r")]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"lopd.train: config error: data.tasks_path {str(path)!r}{what}", err
    with pytest.raises(TaskFormatError, match="is a FIFO, not a regular file"):
        load_tasks_jsonl(fifo)
    assert main(["--preset", "smoke", "--tasks", str(tmp_path / "none.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err
