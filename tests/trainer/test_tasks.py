"""The run's task sets: a task-set seed and the held-out split come from ``cfg.data``."""

from __future__ import annotations

import pytest

from lopd.config import ConfigError, load_config
from lopd.envs import builtin_tasks, save_tasks_jsonl
from lopd.run.tasks import load_tasks


def ids(tasks):
    return [t.task_id for t in tasks]


def instructions(tasks):
    return [t.instruction for t in tasks]


def test_task_seed_and_eval_split_of_the_builtin_generator():
    cfg = load_config("smoke")  # data.task_seed null: the run seed picks the task set
    train, heldout = load_tasks(cfg)
    assert instructions(train) == instructions(builtin_tasks("tool_use", "train", n=6, seed=0))
    assert {t.split for t in heldout} == {"test"}
    cfg = load_config("smoke", overrides=["data.task_seed=5", "data.eval_split=val"])
    train5, val5 = load_tasks(cfg)
    assert instructions(train5) == instructions(builtin_tasks("tool_use", "train", n=6, seed=5))
    assert instructions(train5) != instructions(train)
    assert {t.split for t in val5} == {"val"}
    assert instructions(val5) == instructions(builtin_tasks("tool_use", "val", n=4, seed=5))


def test_eval_split_of_a_tasks_file(tmp_path):
    path = tmp_path / "tasks.jsonl"
    tasks = builtin_tasks("tool_use", "train", n=3) + builtin_tasks("tool_use", "val", n=2)
    save_tasks_jsonl(tasks, path)
    files = [f"data.tasks_path={path}", "data.n_train=3", "data.n_test=2"]
    cfg = load_config("smoke", overrides=[*files, "data.eval_split=val"])
    train, val = load_tasks(cfg)
    assert ids(train) == ids(tasks[:3]) and ids(val) == ids(tasks[3:])
    cfg = load_config("smoke", overrides=files)
    with pytest.raises(ConfigError, match="split='test'"):
        load_tasks(cfg)
