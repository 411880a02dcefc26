"""Bad EnvScaler and ACEBench input: one line naming the file and the item, saying whether the
item is skipped or the load fails; never a traceback or a silent wrong answer. The CLIs print
that line and exit 2."""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import pytest

from lopd.envs import load_task_file
from lopd.envs.loaders import SkippedItemWarning, TaskFormatError
from lopd.evaluate import main as evaluate_main

DATA = Path(__file__).parents[1] / "data"
ENVS = json.loads((DATA / "envscaler" / "env_items.json").read_text())
TASKS = json.loads((DATA / "envscaler" / "task_items.json").read_text())


def release(tmp_path, envs=None, tasks=None, extra=None):
    """A release directory: env items as EnvScaler's repository writes them, task items."""
    d = tmp_path / "release"
    d.mkdir(exist_ok=True)
    (d / "191_env_metadata.json").write_text(json.dumps(ENVS if envs is None else envs))
    (d / "rl_scenario_metadata.json").write_text(json.dumps(TASKS if tasks is None else tasks))
    for name, text in (extra or {}).items():
        (d / name).write_text(text)
    return d


def load_skipping(path):
    """The tasks, and the skipped-item lines issued while loading."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SkippedItemWarning)
        tasks = load_task_file(path)
    return tasks, [str(w.message) for w in caught if issubclass(w.category, SkippedItemWarning)]


def env_with(**changes):
    envs = json.loads(json.dumps(ENVS))
    envs["env_lib"].update(changes)
    return envs


def task_with(index=0, **changes):
    tasks = json.loads(json.dumps(TASKS))
    tasks[index].update(changes)
    return tasks


LIB_TASKS = 4  # task items of env_lib in the fixture (of 8)


@pytest.mark.parametrize(
    "envs, tasks, skipped_tasks, message",
    [
        (
            env_with(env_class_code="class LibraryCatalogSystem(:\n    pass"),
            None,
            LIB_TASKS,
            "item 'env_lib' (env 'env_lib'): env_class_code has a syntax error (line 1: ",
        ),
        (
            env_with(env_class_name="Library"),
            None,
            LIB_TASKS,
            "item 'env_lib' (env 'env_lib'): env_class_code defines no class 'Library'; item "
            "skipped",
        ),
        (
            env_with(env_class_code="x = 1\n" * 100_000),
            None,
            LIB_TASKS,
            "env_class_code is 600,000 characters, over the 524,288 limit; item skipped",
        ),
        (
            None,
            task_with(env_id="env_nowhere"),
            1,
            "item 0 (task 'env_lib-task_1'): env_id 'env_nowhere' has no environment; item skipped",
        ),
        (
            None,
            task_with(env_class_name="NotInTheCode"),
            1,
            "(task 'env_lib-task_1'): env_class_code defines no class 'NotInTheCode'; item skipped",
        ),
        (
            None,
            task_with(checklist_with_func=[{"check_item": "x", "check_func": "def check_func("}]),
            1,
            "(task 'env_lib-task_1'): check 0 has a syntax error (line 1: ",
        ),
        (
            None,
            task_with(checklist_with_func=[{"check_item": "x", "check_func": "def f(s): pass"}]),
            1,
            "(task 'env_lib-task_1'): check 0 defines no function check_func; item skipped",
        ),
        (
            None,
            task_with(checklist_with_func=[{"check_item": "x", "check_func": "x" * 70_000}]),
            1,
            "check 0 is 70,000 characters, over the 65,536 limit; item skipped",
        ),
        (
            None,
            task_with(init_config={"blob": "x" * (9 << 20)}),
            1,
            "init_config is 9,437,196 bytes of JSON, over the 8,388,608 limit; item skipped",
        ),
        (
            None,
            task_with(init_config="{not json"),
            1,
            "(task 'env_lib-task_1'): init_config is text that is not valid JSON; item skipped",
        ),
        (None, task_with(task=""), 1, "task (the instruction) must be non-empty text"),
    ],
    ids=[
        "env-syntax-error",
        "env-missing-class",
        "env-oversized",
        "env_id-without-environment",
        "task-missing-class",
        "check-syntax-error",
        "check-without-check_func",
        "check-oversized",
        "init_config-oversized",
        "init_config-bad-json-text",
        "empty-instruction",
    ],
)
def test_a_broken_envscaler_item_is_skipped_with_one_line(
    tmp_path, envs, tasks, skipped_tasks, message
):
    d = release(tmp_path, envs, tasks)
    loaded, lines = load_skipping(d)
    assert len(loaded) == len(TASKS) - skipped_tasks
    (line,) = [x for x in lines if message in x]
    assert "\n" not in line and str(d) in line and line.endswith("; item skipped")


def test_envscaler_sft_files_and_unknown_items_are_skipped_with_one_line(tmp_path):
    sft = [{"env_id": "env_lib", "task_id": "s1", "task": "t", "init_config": "{}"}]
    d = release(tmp_path, extra={"sft_scenario_metadata.json": json.dumps(sft)})
    (d / "notes.json").write_text(json.dumps([{"what": "is this"}]))
    loaded, lines = load_skipping(d)
    assert len(loaded) == len(TASKS)
    assert lines == [
        f"{d / 'notes.json'}: item 0: neither an EnvScaler env item nor a task item; item skipped",
        f"{d / 'sft_scenario_metadata.json'}: task items without checklist_with_func (no reward): "
        "file skipped",
    ]


@pytest.mark.parametrize(
    "envs, tasks, message",
    [
        (
            None,
            [TASKS[0], TASKS[1], TASKS[0]],
            "rl_scenario_metadata.json: item 2 (task 'env_lib-task_1'): duplicate task_id (also ",
        ),
        (
            [*list(ENVS.values()), ENVS["env_lib"]],
            None,
            "191_env_metadata.json: item 2: duplicate env_id 'env_lib' (also ",
        ),
        (None, [{**TASKS[0], "env_id": "elsewhere"}], "no usable EnvScaler task item; load failed"),
        ({}, None, "no EnvScaler env item; load failed"),
    ],
    ids=["duplicate-task_id", "duplicate-env_id", "no-task-left", "no-environment"],
)
def test_an_ambiguous_or_empty_envscaler_release_fails_the_load_in_one_line(
    tmp_path, envs, tasks, message
):
    d = release(tmp_path, envs, tasks)
    with pytest.raises(TaskFormatError) as err, warnings.catch_warnings():
        warnings.simplefilter("ignore", SkippedItemWarning)
        load_task_file(d)
    text = str(err.value)
    assert message in text and "\n" not in text and text.endswith("load failed")


def test_a_file_that_is_neither_json_nor_json_lines_fails_the_load(tmp_path):
    d = release(tmp_path, extra={"broken.jsonl": '{"env_id": 1}\n{not json\n'})
    with pytest.raises(TaskFormatError, match=r"broken.jsonl: line 2: neither a JSON file nor"):
        load_task_file(d)


def test_a_bad_native_envscaler_line_names_its_line(tmp_path):
    task = load_task_file(DATA / "envscaler")[0].to_dict()
    task["spec"]["env_class_code"] = "class X(:"
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(task) + "\n")
    with pytest.raises(TaskFormatError, match=r"tasks.jsonl:1: env_class_code has a syntax error"):
        load_task_file(path)


def acebench_copy(tmp_path):
    d = tmp_path / "acebench"
    shutil.copytree(DATA / "acebench", d)
    return d


def rewrite(path, edit):
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(r) + "\n" for r in edit(rows)))


@pytest.mark.parametrize(
    "edit_tasks, edit_answers, message",
    [
        (None, lambda rows: rows[1:], "line 1 (id 'agent_multi_step_0'): no possible answer has"),
        (
            lambda rows: [{**rows[0], "involved_classes": ["Finance"]}, *rows[1:]],
            None,
            "(id 'agent_multi_step_0'): involved class 'Finance' is not one of",
        ),
        (
            None,
            lambda rows: [{**rows[0], "mile_stone": [1, 2]}, *rows[1:]],
            "(id 'agent_multi_step_0'): mile_stone must be a list of call texts",
        ),
        (
            lambda rows: [{**rows[0], "question": None}, *rows[1:]],
            None,
            "(id 'agent_multi_step_0'): question must be non-empty text",
        ),
    ],
    ids=["no-answer", "unknown-class", "bad-milestones", "no-question"],
)
def test_a_broken_acebench_entry_is_skipped_with_one_line(
    tmp_path, edit_tasks, edit_answers, message
):
    d = acebench_copy(tmp_path)
    if edit_tasks:
        rewrite(d / "data_agent_multi_step.json", edit_tasks)
    if edit_answers:
        rewrite(d / "possible_answer" / "data_agent_multi_step.json", edit_answers)
    loaded, lines = load_skipping(d)
    assert len(loaded) == 4
    (line,) = lines
    assert message in line and "data_agent_multi_step.json" in line
    assert line.endswith("; item skipped")


def test_acebench_load_failures_are_one_line(tmp_path):
    d = acebench_copy(tmp_path)
    rewrite(d / "data_agent_multi_turn.json", lambda rows: [*rows, rows[0]])
    with pytest.raises(TaskFormatError, match=r"line 3 \(id 'agent_multi_turn_0'\): duplicate id"):
        load_task_file(d)
    (d / "data_agent_multi_turn.json").write_text("{oops\n")
    with pytest.raises(TaskFormatError, match=r"multi_turn.json: line 1: not valid JSON; load"):
        load_task_file(d)
    (d / "possible_answer" / "data_agent_multi_step.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"possible_answer/data_agent_multi_step.json"):
        load_task_file(d / "data_agent_multi_step.json")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--bench", "envscaler"], "--bench envscaler needs --tasks"),
        (["--bench", "envscaler", "--tasks", "/no/such/dir"], "/no/such/dir does not exist"),
        (["--bench", "acebench"], "--bench acebench needs --data"),
        (
            ["--bench", "acebench", "--data", str(DATA / "acebench"), "--split", "multi_turn"],
            "--split multi_turn needs --user-model PATH",
        ),
        (
            ["--bench", "acebench", "--data", str(DATA / "acebench"), "--split", "test"],
            "--split test is not an ACEBench category",
        ),
        (["--bench", "acebench", "--data", str(DATA)], "holds neither data_agent_multi_step"),
        (
            ["--bench", "acebench", "--data", str(DATA / "acebench"), "--user-model", "/nope"],
            "--user-model /nope",
        ),
        (["--bench", "builtin", "--data", "x"], "--data applies to --bench acebench only"),
        (
            ["--bench", "envscaler", "--tasks", str(DATA / "envscaler"), "--split", "multi_step"],
            "--split multi_step is not an EnvScaler split",
        ),
    ],
)
def test_evaluate_refuses_bad_benchmark_input_in_one_line(argv, message, tmp_path, capsys):
    assert evaluate_main([*argv, "--out", str(tmp_path / "out")], log=lambda _: None) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and err.startswith("lopd.evaluate: ")


def test_a_fifo_is_refused_in_one_line_never_opened(tmp_path):
    fifo = tmp_path / "tasks.json"
    os.mkfifo(fifo)
    with pytest.raises(TaskFormatError, match=r"tasks.json: is a FIFO, not a regular file"):
        load_task_file(fifo)
    d = release(tmp_path)
    os.mkfifo(d / "more.jsonl")
    with pytest.raises(TaskFormatError, match=r"more.jsonl: is a FIFO, not a regular file; load"):
        load_task_file(d)
