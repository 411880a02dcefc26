"""Single-turn coding environment: extract the program, run the task's tests in the sandbox.

A coding :class:`~lopd.types.Task` has the problem statement as ``instruction`` and its tests in
``spec`` (TACO / LiveCodeBench style, see :mod:`lopd.envs.loaders` for converters)::

    {
      "fn_name": null | "two_sum",    # null: stdin/stdout program; else a function-call test
      "starter_code": null | "...",   # optional, shown to the model for function-call tasks
      "tests": [{"input": ..., "output": ...}, ...],
      "time_limit_s": 4.0,            # per test (optional)
      "memory_mb": 1024,              # optional
      "solution": "..."               # optional reference solution (oracle; never shown)
    }

* stdin/stdout tests: ``input``/``output`` are strings; the program runs once per test with the
  input on stdin; outputs compare token by token (whitespace-insensitive), numbers within 1e-6.
* function-call tests: ``input`` is the list of positional arguments, ``output`` the expected
  return value (JSON). The function is a top-level ``def fn_name`` or a LeetCode-style
  ``Solution().fn_name``. All tests run in one sandboxed process under a per-call timer; only the
  inputs enter the sandbox (expected outputs are compared outside it, so printing or patching
  cannot fake a pass).

Reward: 1.0 if every test passes, else 0.0.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from dataclasses import dataclass
from typing import Any

from lopd.envs.base import CODING_SYSTEM_PROMPT, Env, strip_thinking
from lopd.envs.sandbox import SandboxLimits, run_sandboxed
from lopd.types import Task, TraceStep

STDIO_FORMAT = (
    "Read the input from standard input and write the answer to standard output. "
    "Put your complete program in one code block:\n```python\n# your code\n```"
)
CALL_FORMAT = (
    "Implement the function `{fn_name}`. Put your complete solution in one code block, "
    "starting from this code:\n```python\n{starter}\n```"
)

_FENCE_RE = re.compile(r"```([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_OPEN_FENCE_RE = re.compile(r"```(?:python|py|python3)?[^\n]*\n(.*)\Z", re.DOTALL)

_STDIO_HARNESS = r"""
import json, os, signal, subprocess, sys

mark, per_test, n = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
results = []
for i in range(n):
    with open(f"in{i}.txt", "rb") as fin, open(f"out{i}.txt", "wb") as fout:
        p = subprocess.Popen(
            [sys.executable, "-I", "-B", "solution.py"],
            stdin=fin, stdout=fout, stderr=subprocess.PIPE, start_new_session=True,
        )
        try:
            _, err = p.communicate(timeout=per_test)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
            results.append({"timeout": True})
            break
    with open(f"out{i}.txt", "rb") as f:
        out = f.read().decode("utf-8", errors="replace")
    results.append({"rc": p.returncode, "out": out, "err": err.decode(errors="replace")[-300:]})
    if p.returncode != 0:
        break
sys.stdout.write("\n" + mark + json.dumps(results) + "\n")
"""

_CALL_HARNESS = r"""
import contextlib, copy, io, json, signal, sys

mark, per_call, fn_name = sys.argv[1], float(sys.argv[2]), sys.argv[3]
real_stdout = sys.stdout
sink = io.StringIO()


def emit(obj):
    real_stdout.write("\n" + mark + json.dumps(obj, default=repr) + "\n")
    real_stdout.flush()


def on_alarm(signum, frame):
    raise TimeoutError("time limit exceeded")


signal.signal(signal.SIGALRM, on_alarm)
with open("inputs.json") as f:
    inputs = json.load(f)
ns = {"__name__": "solution"}
fn, error = None, None
try:
    with open("solution.py") as f:
        src = f.read()
    with contextlib.redirect_stdout(sink):
        signal.setitimer(signal.ITIMER_REAL, per_call)
        exec(compile(src, "solution.py", "exec"), ns)
        signal.setitimer(signal.ITIMER_REAL, 0)
    if isinstance(ns.get("Solution"), type) and hasattr(ns["Solution"], fn_name):
        fn = getattr(ns["Solution"](), fn_name)
    elif callable(ns.get(fn_name)):
        fn = ns[fn_name]
    else:
        error = "no function named " + fn_name
except BaseException as e:
    signal.setitimer(signal.ITIMER_REAL, 0)
    error = type(e).__name__ + ": " + str(e)[:200]
if fn is None:
    emit({"error": error})
    sys.exit(0)
results = []
for args in inputs:
    try:
        with contextlib.redirect_stdout(sink):
            signal.setitimer(signal.ITIMER_REAL, per_call)
            out = fn(*copy.deepcopy(args))
            signal.setitimer(signal.ITIMER_REAL, 0)
        results.append({"out": json.loads(json.dumps(out, default=sorted))})
    except BaseException as e:
        signal.setitimer(signal.ITIMER_REAL, 0)
        results.append({"error": type(e).__name__ + ": " + str(e)[:200]})
        break
emit({"results": results})
"""


def extract_code(text: str) -> str:
    """The program in a model answer.

    The last fenced block tagged python/py/python3 or untagged; else an unterminated final
    python fence (generation cut at the token budget); else the whole text, think-stripped.
    """
    text = strip_thinking(text)
    blocks = [
        body
        for lang, body in _FENCE_RE.findall(text)
        if lang.lower() in ("", "python", "py", "python3")
    ]
    if blocks:
        return blocks[-1]
    tail = _OPEN_FENCE_RE.search(text)
    if tail is not None:
        return tail.group(1)
    return text.strip() + "\n"


def _tokens_match(got: str, expected: str) -> bool:
    a, b = got.split(), expected.split()
    if a == b:
        return True
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x == y:
            continue
        try:
            fx, fy = float(x), float(y)
        except ValueError:
            return False
        if not math.isclose(fx, fy, rel_tol=1e-6, abs_tol=1e-6):
            return False
    return True


def values_match(got: Any, expected: Any) -> bool:
    """Equality of JSON values with float tolerance 1e-6; tuples are lists after JSON.

    A one-element list ``expected`` also matches its element (TACO wraps call outputs in a list).
    """

    def eq(a: Any, b: Any) -> bool:
        if isinstance(a, bool) or isinstance(b, bool):
            return a is b
        if isinstance(a, (int, float)) and isinstance(b, (int, float)):
            return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)
        if isinstance(a, list) and isinstance(b, list):
            return len(a) == len(b) and all(eq(x, y) for x, y in zip(a, b))
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(eq(a[k], b[k]) for k in a)
        return a == b

    if eq(got, expected):
        return True
    return isinstance(expected, list) and len(expected) == 1 and eq(got, expected[0])


@dataclass
class TestReport:
    """Result of running a program against a task's tests.

    Attributes:
        passed: tests passed before the first failure (tests stop at the first failure).
        total: number of tests.
        message: a short summary, e.g. ``All 5 tests passed`` or the first failure.
    """

    passed: int
    total: int
    message: str

    @property
    def all_passed(self) -> bool:
        return self.total > 0 and self.passed == self.total


def _short(x: Any, n: int = 80) -> str:
    s = x if isinstance(x, str) else json.dumps(x)
    s = s.strip().replace("\n", "\\n")
    return s if len(s) <= n else s[: n - 3] + "..."


def _limits(spec: dict[str, Any], wall_s: float, cpu_s: int | None = None) -> SandboxLimits:
    return SandboxLimits(
        wall_time_s=wall_s,
        cpu_time_s=cpu_s or max(1, math.ceil(wall_s)),
        memory_bytes=int(spec.get("memory_mb", 1024)) << 20,
        max_processes=16,
    )


def run_tests(code: str, spec: dict[str, Any]) -> TestReport:
    """Run ``code`` against ``spec["tests"]`` in the sandbox (see the module docstring).

    Raises:
        ValueError: the spec has no tests.
    """
    tests = spec.get("tests") or []
    if not tests:
        raise ValueError("coding spec has no 'tests'")
    per = float(spec.get("time_limit_s", 4.0))
    n = len(tests)
    fn_name = spec.get("fn_name")
    mark = "@@lopd-" + secrets.token_hex(8) + "@@"
    if not fn_name:
        return _run_stdio(code, tests, spec, per, mark)
    files = {
        "main.py": _CALL_HARNESS,
        "solution.py": code,
        "inputs.json": json.dumps([t["input"] for t in tests]),
    }
    r = run_sandboxed(
        ["main.py", mark, str(per), fn_name], files, "", _limits(spec, per * (n + 1) + 2.0)
    )
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(mark)]
    if r.timed_out:
        return TestReport(0, n, "time limit exceeded")
    if not lines:
        err = r.stderr.strip().splitlines()[-1:] or [f"exit code {r.returncode}"]
        return TestReport(0, n, f"runtime error: {_short(err[0])}")
    payload = json.loads(lines[-1][len(mark) :])
    if "error" in payload:
        return TestReport(0, n, f"error: {_short(payload['error'])}")
    for i, (res, t) in enumerate(zip(payload["results"], tests)):
        if "error" in res:
            return TestReport(i, n, f"Test {i + 1}: {_short(res['error'])}")
        if not values_match(res["out"], t["output"]):
            return TestReport(
                i,
                n,
                f"Test {i + 1}: wrong answer: expected {_short(t['output'])}, "
                f"got {_short(res['out'])}",
            )
    return TestReport(n, n, f"All {n} tests passed")


def _run_stdio(
    code: str, tests: list[dict[str, Any]], spec: dict[str, Any], per: float, mark: str
) -> TestReport:
    # One sandbox for all tests: a harness starts a fresh interpreter per test (the program runs
    # exactly as `python solution.py < input`), saving the supervisor's start-up per test.
    n = len(tests)
    files: dict[str, str | bytes] = {"main.py": _STDIO_HARNESS, "solution.py": code}
    for i, t in enumerate(tests):
        files[f"in{i}.txt"] = t["input"]
    limits = _limits(spec, per * n + 2.0, cpu_s=math.ceil(per) + 1)
    r = run_sandboxed(["main.py", mark, str(per), str(n)], files, "", limits)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(mark)]
    if not lines:
        why = "time limit exceeded" if r.timed_out else f"harness failed (exit {r.returncode})"
        return TestReport(0, n, why)
    results = json.loads(lines[-1][len(mark) :])
    for i, (res, t) in enumerate(zip(results, tests)):
        if res.get("timeout"):
            return TestReport(i, n, f"Test {i + 1}: time limit exceeded")
        if res["rc"] != 0:
            err = res["err"].strip().splitlines()[-1:] or [f"exit code {res['rc']}"]
            return TestReport(i, n, f"Test {i + 1}: runtime error: {_short(err[0])}")
        if not _tokens_match(res["out"], t["output"]):
            return TestReport(
                i,
                n,
                f"Test {i + 1}: wrong answer: expected {_short(t['output'])}, "
                f"got {_short(res['out'])}",
            )
    return TestReport(n, n, f"All {n} tests passed")


def coding_prompt(task: Task) -> str:
    """The first user message: the problem statement plus the answer-format instruction."""
    spec = task.spec
    fn_name = spec.get("fn_name")
    if fn_name:
        starter = spec.get("starter_code") or f"def {fn_name}(...):\n    ..."
        fmt = CALL_FORMAT.format(fn_name=fn_name, starter=starter.rstrip())
    else:
        fmt = STDIO_FORMAT
    return f"{task.instruction.rstrip()}\n\n{fmt}"


class CodingEnv(Env):
    """One-turn coding episode: the answer's code is run against the tests; reward 1 iff all pass.

    The observation (unused by single-turn rollouts) and the trace result are the test summary;
    the trace action is the extracted program, which is what the experience bank stores.
    """

    max_steps = 1

    def __init__(self) -> None:
        super().__init__()
        self.report: TestReport | None = None

    def system_prompt(self) -> str:
        return CODING_SYSTEM_PROMPT

    def tools(self) -> list[dict[str, Any]]:
        return []

    def reset(self, task: Task) -> str:
        self._reset_stats(task)
        if task.domain != "coding":
            raise ValueError(f"task {task.task_id} has domain {task.domain!r}, not 'coding'")
        if not task.spec.get("tests"):
            raise ValueError(f"task {task.task_id}: coding spec has no 'tests'")
        self.report = None
        return coding_prompt(task)

    def step(self, model_text: str) -> tuple[str, bool]:
        self._check_can_step()
        assert self.task is not None
        self.num_steps += 1
        code = extract_code(model_text)
        self.report = run_tests(code, self.task.spec)
        self.trace.append(TraceStep(action=code, result=self.report.message))
        self.done = True
        return self.report.message, True

    def reward(self) -> float:
        if self.task is None:
            raise RuntimeError("reward() called before reset(task)")
        return 1.0 if self.report is not None and self.report.all_passed else 0.0
