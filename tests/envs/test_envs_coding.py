"""Coding env: code extraction, stdin and function-call tests in the sandbox, loaders."""

from __future__ import annotations

import base64
import json
import pickle
import zlib
from concurrent.futures import ThreadPoolExecutor

import pytest

from lopd.envs import (
    CODING_SYSTEM_PROMPT,
    CodingEnv,
    TaskFormatError,
    builtin_tasks,
    extract_code,
    from_livecodebench,
    from_taco,
    load_tasks_jsonl,
    make_env,
    oracle_actions,
    run_tests,
    save_tasks_jsonl,
    task_from_record,
)
from lopd.envs.coding_match import values_match
from lopd.types import Task

STDIO = {
    "fn_name": None,
    "tests": [{"input": "2 3\n", "output": "5\n"}, {"input": "10 -4\n", "output": "6"}],
    "time_limit_s": 2.0,
}
CALL = {
    "fn_name": "add",
    "tests": [{"input": [1, 2], "output": 3}, {"input": [[1], [2]], "output": [1, 2]}],
    "time_limit_s": 2.0,
}


def coding_task(spec, task_id="t") -> Task:
    return Task(task_id, "coding", "coding", "Add two numbers.", spec, "train")


def play(task: Task, answer: str) -> tuple[float, str]:
    env = make_env(task)
    env.reset(task)
    obs, done = env.step(answer)
    assert done
    return env.reward(), obs


def test_extract_code_variants():
    assert extract_code("Here:\n```python\nprint(1)\n```\nDone.") == "print(1)\n"
    # The last python/untagged block wins; other languages are ignored.
    text = "```python\nx = 1\n```\n```bash\nls\n```\n```\nprint(2)\n```"
    assert extract_code(text) == "print(2)\n"
    assert extract_code("<think>```python\nbad\n```</think>```py\ngood\n```") == "good\n"
    # Unterminated fence (cut at the token budget) and bare code.
    assert extract_code("```python\nprint(3)\nprint(4)") == "print(3)\nprint(4)"
    assert extract_code("print(5)") == "print(5)\n"


def test_builtin_coding_set_and_reference_solutions_pass():
    train, test = builtin_tasks("coding", "train"), builtin_tasks("coding", "test")
    assert len(train) + len(test) == 30 and len(test) == 7
    assert not {t.task_id for t in train} & {t.task_id for t in test}
    assert {bool(t.spec["fn_name"]) for t in train} == {True, False}
    assert builtin_tasks("coding", "train", seed=3) != train
    assert sorted(t.task_id for t in builtin_tasks("coding", "train", seed=3)) == sorted(
        t.task_id for t in train
    )
    # Concurrent sandboxed runs, as parallel rollouts do them (run_sandboxed is thread-safe).
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda t: play(t, oracle_actions(t)[0]), train + test))
    for t, res in zip(train + test, results):
        assert res == (1.0, f"All {len(t.spec['tests'])} tests passed"), t.task_id


def test_stdio_rewards_and_observations():
    t = coding_task(STDIO)
    assert play(t, "a, b = map(int, input().split())\nprint(a + b)")[0] == 1.0
    # Whitespace-insensitive comparison.
    assert play(t, "a, b = map(int, input().split())\nprint(' ', a + b, '  ')")[0] == 1.0
    assert play(t, "print(5)") == (0.0, "Test 2: wrong answer: expected 6, got 5")
    reward, obs = play(t, "raise SystemExit('boom')")
    assert reward == 0.0 and obs.startswith("Test 1: runtime error: boom")
    reward, obs = play(t, "1/0")
    assert obs == "Test 1: runtime error: ZeroDivisionError: division by zero"


def test_stdio_timeout_and_float_tolerance():
    t = coding_task({**STDIO, "time_limit_s": 0.5})
    assert play(t, "while True:\n    pass") == (0.0, "Test 1: time limit exceeded")
    f = coding_task({"fn_name": None, "tests": [{"input": "", "output": "0.3333333\n"}]})
    assert play(f, "print(1/3)")[0] == 1.0
    assert play(f, "print(0.34)")[0] == 0.0


def test_function_call_tests():
    t = coding_task(CALL)
    assert play(t, "def add(a, b):\n    print('noise')\n    return a + b")[0] == 1.0
    # LeetCode style class.
    assert play(t, "class Solution:\n    def add(self, a, b):\n        return a + b")[0] == 1.0
    assert play(t, "def plus(a, b):\n    return a + b") == (0.0, "error: no function named add")
    reward, obs = play(t, "def add(a, b):\n    return a - b")
    assert reward == 0.0 and obs == "Test 1: wrong answer: expected 3, got -1"
    reward, obs = play(t, "def add(a, b):\n    raise KeyError('k')")
    assert obs == "Test 1: KeyError: 'k'"
    reward, obs = play(t, "import os\nos._exit(0)")
    assert reward == 0.0 and obs.startswith("runtime error")
    slow = coding_task({**CALL, "time_limit_s": 0.5})
    assert play(slow, "def add(a, b):\n    while True:\n        pass") == (
        0.0,
        "Test 1: TimeoutError: time limit exceeded",
    )


def test_cannot_fake_a_pass():
    # Expected outputs never enter the sandbox, and the result marker is a per-run secret.
    t = coding_task(CALL)
    forge = (
        "import sys\n"
        'print(\'@@lopd-0000000000000000@@\' + \'{"results": [{"out": 3}, {"out": [1, 2]}]}\')\n'
        "def add(a, b):\n    return None\n"
    )
    assert play(t, forge)[0] == 0.0
    peek = "import os\nprint(sorted(os.listdir('.')), open('inputs.json').read())\nadd = max\n"
    assert play(t, peek)[0] == 0.0
    s = coding_task(STDIO)
    assert play(s, "import os\nprint(os.listdir('.'))")[0] == 0.0


def test_values_match():
    assert values_match([1, 2], [1, 2]) and values_match(0.1 + 0.2, 0.3)
    assert values_match(3, [3])  # TACO wraps call outputs in a list
    assert not values_match(True, 1) and not values_match([1], [1, 2])
    assert values_match({"a": [1.0]}, {"a": [1]})


def test_coding_env_contract():
    t = builtin_tasks("coding", "test", n=1)[0]
    env = CodingEnv()
    assert env.max_steps == 1 and env.tools() == [] and env.system_prompt() == CODING_SYSTEM_PROMPT
    with pytest.raises(RuntimeError, match="before reset"):
        env.reward()
    prompt = env.reset(t)
    assert prompt.startswith(t.instruction) and "```python" in prompt
    assert env.reward() == 0.0
    env.step(oracle_actions(t)[0])
    assert env.trace[0].result.startswith("All") and env.num_tool_calls == 0
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("print(1)")
    with pytest.raises(ValueError, match="no 'tests'"):
        env.reset(coding_task({"fn_name": None, "tests": []}))
    with pytest.raises(ValueError, match="no reference 'solution'"):
        oracle_actions(coding_task(STDIO))
    with pytest.raises(ValueError, match="no 'tests'"):
        run_tests("print(1)", {"tests": []})


# --------------------------------------------------------------------------- loaders


def test_taco_rows():
    stdio = from_taco(
        {
            "question": "Sum.",
            "input_output": json.dumps(
                {"inputs": ["2 3\n", ["1", "1"]], "outputs": ["5\n", ["2"]]}
            ),
            "time_limit": "2 seconds",
        },
        "taco-1",
    )
    assert stdio.spec["tests"][1] == {"input": "1\n1", "output": "2"}
    assert stdio.spec["time_limit_s"] == 2.0
    call = from_taco(
        {
            "question": "Add.",
            "starter_code": "def add(a, b):",
            "input_output": {"fn_name": "add", "inputs": [[1, 2]], "outputs": [[3]]},
        },
        "taco-2",
    )
    assert play(call, "def add(a, b):\n    return a + b")[0] == 1.0
    with pytest.raises(TaskFormatError, match="unequal length"):
        from_taco({"question": "q", "input_output": {"inputs": [1], "outputs": []}}, "bad")


def _lcb_private(tests) -> str:
    return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(tests)))).decode()


def test_livecodebench_rows_and_safe_unpickling():
    pub = [{"input": "[1, 2]\n3", "output": "6", "testtype": "functional"}]
    priv = [{"input": "[0]\n0", "output": "0", "testtype": "functional"}]
    row = {
        "question_id": "lcb-7",
        "question_content": "Sum the list and add k.",
        "starter_code": "class Solution:\n    def f(self, xs, k):",
        "public_test_cases": json.dumps(pub),
        "private_test_cases": _lcb_private(priv),
        "metadata": json.dumps({"func_name": "f"}),
    }
    t = from_livecodebench(row)
    assert t.task_id == "lcb-7" and t.spec["fn_name"] == "f"
    assert t.spec["tests"] == [
        {"input": [[1, 2], 3], "output": 6},
        {"input": [[0], 0], "output": 0},
    ]
    ok = "class Solution:\n    def f(self, xs, k):\n        return sum(xs) + k"
    assert play(t, ok)[0] == 1.0

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    evil = dict(
        row, private_test_cases=base64.b64encode(zlib.compress(pickle.dumps(Evil()))).decode()
    )
    with pytest.raises(TaskFormatError, match=r"refusing to load builtins\.print"):
        task_from_record(evil, "row")


def test_load_jsonl_mixed_formats_and_errors(tmp_path):
    path = tmp_path / "mix.jsonl"
    native = builtin_tasks("coding", "train", n=2)
    taco = {
        "question": "Echo.",
        "input_output": {"inputs": ["x\n"], "outputs": ["x\n"]},
        "task_id": "taco-x",
    }
    lines = [json.dumps(t.to_dict()) for t in native] + ["", json.dumps(taco)]
    path.write_text("\n".join(lines) + "\n")
    tasks = load_tasks_jsonl(path)
    assert [t.task_id for t in tasks] == [native[0].task_id, native[1].task_id, "taco-x"]
    assert play(tasks[2], "print(input())")[0] == 1.0
    out = tmp_path / "sub" / "out.jsonl"
    save_tasks_jsonl(tasks, out)
    assert load_tasks_jsonl(out) == tasks and not list(out.parent.glob("*.tmp"))
    for bad, msg in [
        ("{not json", r"mix\.jsonl:1: invalid JSON"),
        ('{"foo": 1}', r"mix\.jsonl:1: unknown task format"),
        ("[1, 2]", "expected a JSON object"),
        (json.dumps(dict(native[0].to_dict(), domain="math")), "domain must be"),
        (
            json.dumps(dict(native[0].to_dict(), spec={"tests": [{"input": "1"}]})),
            "'input' and 'output'",
        ),
        ("\n".join([json.dumps(native[0].to_dict())] * 2), r"mix\.jsonl:2: duplicate task_id"),
    ]:
        path.write_text(bad + "\n")
        with pytest.raises(TaskFormatError, match=msg):
            load_tasks_jsonl(path)
