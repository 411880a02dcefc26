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

* stdin/stdout tests: ``input``/``output`` are strings; the program runs once per test
  (``python solution.py`` with the input on stdin, a fresh process each time, one sandbox
  supervisor for all); outputs compare token by token (whitespace-insensitive), numbers within
  1e-6.
* function-call tests: ``input`` is the list of positional arguments (or a string holding a
  Python literal tuple of them, for arguments JSON cannot carry, e.g. dicts with int keys),
  ``output`` the expected return value (JSON). The function is a top-level ``def fn_name`` or a
  LeetCode-style ``Solution().fn_name``. All tests run in one sandboxed process under a per-call
  timer. By default values match with :func:`lopd.envs.coding_match.values_match` (float
  tolerance 1e-6, TACO's one-element-list unwrap); ``"compare": "exact"`` in the spec gives
  Python ``==`` on the JSON values instead (HumanEval). A test may also ask for ``"abs_tol": t``
  (``abs(value - output) < t``), ``"truthy": true|false`` (``bool(value)``), ``"identical":
  true`` (``value is output`` for ``true``/``false``/``null``), or a ``"judge"``: a Python
  expression over the returned value ``__out__`` and the names in the test's ``"judge_env"``,
  evaluated after ``spec["judge_code"]`` (trusted task code) in a second sandboxed process that
  never runs the solution and receives the returned values as JSON data (a property check, e.g.
  "the returned root is a root").

Why a program cannot forge a pass: nothing inside the sandbox is trusted or holds a secret. The
expected outputs never enter it, and the verdict is computed here, outside it, from what the
program produced: its captured stdout per test, or the JSON records the runner
(``_CALL_RUNNER``, which shares a process with the solution) writes on its stdout, one per
test. Those records are checked strictly: a load record, then tests 1, 2, ... exactly once and
in order; a missing, duplicated, out-of-order, unparsable or oversized report is reward 0 with
the reason (``malformed result channel: test 1 reported twice``, ``Test 2: no result ...``).
A program's only influence on the verdict is thus the values it produces, which is what is
being graded (a judge, too, sees nothing of the program but its returned values, as JSON data).
Outputs over :data:`MAX_OUTPUT_BYTES` fail cleanly (``output over the 16 MiB cap``); messages
are one printable line with short previews, never whole outputs. A failing sandbox supervisor
is a failed test (``sandbox error: ...``), not an exception.

Reward: 1.0 if every test passes, else 0.0.
"""

from __future__ import annotations

import json
import math
import re
import signal
from dataclasses import dataclass
from typing import Any

from lopd.envs.base import CODING_SYSTEM_PROMPT, Env, clean_text, strip_thinking
from lopd.envs.coding_match import tokens_match, value_passes
from lopd.envs.sandbox import SandboxLimits, SandboxResult, run_sequence
from lopd.types import Task, TraceStep

STDIO_FORMAT = (
    "Read the input from standard input and write the answer to standard output. "
    "Put your complete program in one code block:\n```python\n# your code\n```"
)
CALL_FORMAT = (
    "Implement the function `{fn_name}`. Put your complete solution in one code block, "
    "starting from this code:\n```python\n{starter}\n```"
)

MAX_OUTPUT_BYTES = 16 << 20
"""Cap on what a program may hand to the verifier: its stdout in one stdin/stdout test, or the
JSON text of all its return values together in a function-call task. Over it, the test fails
with ``output over the 16 MiB cap`` / ``return value over the 16 MiB cap``."""

_LANG_RE = re.compile(r"[A-Za-z0-9_+-]*")
_PYTHON_TAGS = ("", "python", "py", "python3")

# Runs as the sandboxed program in function-call tasks: it loads the solution and calls it on
# each input. It is as untrusted as the solution it shares a process with, and knows no secret:
# all it can send is one JSON record per line on its stdout, which the verifier parses with
# limits and checks (one record per test, in order, nothing else) before comparing the values
# with the expected outputs, which never enter the sandbox. What the solution prints goes to
# /dev/null.
_CALL_RUNNER = r"""
import ast, copy, json, os, signal, sys

per_call, fn_name, cap = float(sys.argv[1]), sys.argv[2], int(sys.argv[3])
channel = os.fdopen(os.dup(1), "w")
null = os.open(os.devnull, os.O_WRONLY)
os.dup2(null, 1)
os.close(null)
written = 0


def emit(line):
    global written
    written += len(line) + 1
    channel.write(line + "\n")
    channel.flush()


def describe(e):
    try:
        text = str(e)
    except BaseException:
        text = "?"
    return type(e).__name__ + ": " + text[:200]


def on_alarm(signum, frame):
    raise TimeoutError("time limit exceeded")


signal.signal(signal.SIGALRM, on_alarm)
with open("inputs.json") as f:
    inputs = json.load(f)
ns = {"__name__": "solution"}
fn, error = None, None
try:
    with open("solution.py", "rb") as f:
        src = f.read()
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
    error = describe(e)
if fn is None:
    emit(json.dumps({"load_error": error}))
    sys.exit(0)
emit('{"loaded": true}')
for i, args in enumerate(inputs):
    try:
        if isinstance(args, str):
            args = ast.literal_eval(args)
        signal.setitimer(signal.ITIMER_REAL, per_call)
        out = fn(*copy.deepcopy(args))
        signal.setitimer(signal.ITIMER_REAL, 0)
    except BaseException as e:
        signal.setitimer(signal.ITIMER_REAL, 0)
        emit(json.dumps({"test": i, "error": describe(e)}))
        break
    try:
        text = json.dumps(out, default=sorted)  # sets come back sorted, tuples as lists
    except BaseException as e:
        why = "return value is not JSON data (" + describe(e) + ")"
        emit(json.dumps({"test": i, "error": why}))
        break
    if written + len(text) + 32 > cap:
        emit(json.dumps({"test": i, "error": "return value over the %d MiB cap" % (cap >> 20)}))
        break
    emit('{"test": %d, "value": %s}' % (i, text))
"""


# Runs in a sandbox of its own: trusted task code (spec["judge_code"]) and the judges of the
# spec, applied to the returned values as JSON data; the solution never runs here.
_JUDGE_RUNNER = r"""
import json, signal, sys


def on_alarm(signum, frame):
    raise TimeoutError("time limit exceeded")


signal.signal(signal.SIGALRM, on_alarm)
ns = {"__name__": "judge"}
with open("judge_code.py", "rb") as f:
    exec(compile(f.read(), "judge_code.py", "exec"), ns)
with open("cases.json") as f:
    cases = json.load(f)
verdicts = []
for judge, env, value in cases:
    scope = dict(ns)
    scope.update(env)
    scope["__out__"] = value
    try:
        signal.setitimer(signal.ITIMER_REAL, float(sys.argv[1]))
        ok = bool(eval(compile(judge, "judge", "eval"), scope))
    except BaseException:
        ok = False
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    verdicts.append(ok)
print(json.dumps(verdicts))
"""


def extract_code(text: str) -> str:
    """The program in a model answer.

    The last fenced block tagged python/py/python3 or untagged; else an unterminated final
    python fence (generation cut at the token budget); else the whole text, think-stripped.
    Linear time in the text.
    """
    text = strip_thinking(text)
    blocks = []
    pos = 0
    while True:
        start = text.find("```", pos)
        if start < 0:
            break
        lang_end = _LANG_RE.match(text, start + 3).end()
        newline = text.find("\n", lang_end)
        close = -1 if newline < 0 else text.find("```", newline + 1)
        if close < 0:
            break  # no later fence can close either
        if text[start + 3 : lang_end].lower() in _PYTHON_TAGS:
            blocks.append(text[newline + 1 : close])
        pos = close + 3
    if blocks:
        return blocks[-1]
    start = text.find("```")
    newline = -1 if start < 0 else text.find("\n", start + 3)
    if newline >= 0:
        return text[newline + 1 :]
    return text.strip() + "\n"


@dataclass
class TestReport:
    """Result of running a program against a task's tests.

    Attributes:
        passed: tests passed before the first failure (tests stop at the first failure).
        total: number of tests.
        message: a short one-line summary, e.g. ``All 5 tests passed`` or the first failure
            (printable, valid UTF-8: it is stored in the trace and tokenized later).
    """

    passed: int
    total: int
    message: str

    @property
    def all_passed(self) -> bool:
        return self.total > 0 and self.passed == self.total


def _preview(x: Any, n: int = 80) -> str:
    """At most ``n`` printable characters of a value or text (control characters escaped)."""
    if isinstance(x, str):
        s = x
    else:
        try:
            s = json.dumps(x)
        except (ValueError, TypeError, RecursionError):
            s = f"<{type(x).__name__}>"
    s = s.strip()[: n * 4]
    s = "".join(c if c.isprintable() else repr(c)[1:-1] for c in s)
    return s if len(s) <= n else s[: n - 3] + "..."


def _last_line(stderr: str, returncode: int) -> str:
    lines = stderr.strip().splitlines()[-1:]
    return _preview(lines[0]) if lines else f"exit code {returncode}"


def _limits(spec: dict[str, Any], wall_s: float, cpu_s: int | None = None) -> SandboxLimits:
    return SandboxLimits(
        wall_time_s=wall_s,
        cpu_time_s=cpu_s or max(1, math.ceil(wall_s)),
        memory_bytes=int(spec.get("memory_mb", 1024)) << 20,
        # One byte over the cap: a program that reaches it is over (see stdout_truncated).
        file_size_bytes=MAX_OUTPUT_BYTES + 1,
        max_processes=16,
    )


def run_tests(code: str, spec: dict[str, Any]) -> TestReport:
    """Run ``code`` against ``spec["tests"]`` in the sandbox (see the module docstring).

    Never raises for any program: a sandbox failure is a failed test (``sandbox error: ...``).

    Raises:
        ValueError: the spec has no tests.
    """
    tests = spec.get("tests") or []
    if not tests:
        raise ValueError("coding spec has no 'tests'")
    per = float(spec.get("time_limit_s", 4.0))
    try:
        if spec.get("fn_name"):
            return _run_calls(code, tests, spec, per)
        return _run_stdio(code, tests, spec, per)
    except (RuntimeError, OSError) as e:
        return TestReport(0, len(tests), f"sandbox error: {_preview(str(e))}")


def _run_stdio(
    code: str, tests: list[dict[str, Any]], spec: dict[str, Any], per: float
) -> TestReport:
    # One supervisor for all tests; each test is a fresh `python solution.py < input` whose stdout
    # the supervisor captures (the program holds no channel but its own output), compared here.
    n = len(tests)
    verdicts: list[str | None] = []

    def judge(i: int, r: SandboxResult) -> bool:
        verdicts.append(_stdio_verdict(i, r, tests[i]["output"]))
        r.stdout = r.stderr = ""  # up to 16 MiB each: not kept for the remaining tests
        return verdicts[-1] is None

    runs = [(["solution.py"], t["input"]) for t in tests]
    limits = _limits(spec, per, cpu_s=math.ceil(per) + 1)
    run_sequence(runs, {"solution.py": code}, limits, keep_going=judge)
    for i, verdict in enumerate(verdicts):
        if verdict is not None:
            return TestReport(i, n, verdict)
    if len(verdicts) != n:
        return TestReport(len(verdicts), n, f"Test {len(verdicts) + 1}: no result")
    return TestReport(n, n, f"All {n} tests passed")


def _stdio_verdict(i: int, r: SandboxResult, expected: str) -> str | None:
    """Why test ``i`` failed, or None if it passed."""
    if r.timed_out or r.returncode == -signal.SIGXCPU:
        return f"Test {i + 1}: time limit exceeded"
    if r.stdout_truncated:
        return f"Test {i + 1}: output over the {MAX_OUTPUT_BYTES >> 20} MiB cap"
    if r.returncode != 0:
        return f"Test {i + 1}: runtime error: {_last_line(r.stderr, r.returncode)}"
    if not tokens_match(r.stdout, expected):
        return (
            f"Test {i + 1}: wrong answer: expected {_preview(expected)}, got {_preview(r.stdout)}"
        )
    return None


def _run_calls(
    code: str, tests: list[dict[str, Any]], spec: dict[str, Any], per: float
) -> TestReport:
    n = len(tests)
    files = {
        "main.py": _CALL_RUNNER,
        "solution.py": code,
        "inputs.json": json.dumps([t["input"] for t in tests]),
    }
    argv = ["main.py", str(per), str(spec["fn_name"]), str(MAX_OUTPUT_BYTES)]
    r = run_sequence([(argv, "")], files, _limits(spec, per * (n + 1) + 2.0))[0]
    if r.stdout_truncated:
        return TestReport(
            0, n, f"malformed result channel: over the {MAX_OUTPUT_BYTES >> 20} MiB cap"
        )
    try:
        loaded, records = _read_call_channel(r.stdout, n)
    except ValueError as e:
        return TestReport(0, n, f"malformed result channel: {e}")
    if loaded is None:
        if r.timed_out:
            return TestReport(0, n, "time limit exceeded")
        return TestReport(0, n, f"runtime error: {_last_line(r.stderr, r.returncode)}")
    if loaded is not True:
        return TestReport(0, n, f"error: {_preview(loaded)}")
    judged = _judge(tests, records, spec, per)
    for i, t in enumerate(tests):
        if i == len(records):
            if r.timed_out:
                return TestReport(i, n, f"Test {i + 1}: time limit exceeded")
            why = _last_line(r.stderr, r.returncode) if r.returncode else "exit code 0"
            return TestReport(i, n, f"Test {i + 1}: no result ({why})")
        rec = records[i]
        if "error" in rec:
            return TestReport(i, n, f"Test {i + 1}: {_preview(rec['error'])}")
        if "judge" in t:
            if not judged.get(i, False):
                return TestReport(
                    i, n, f"Test {i + 1}: wrong answer: {_preview(rec['value'])} fails the check"
                )
            continue
        if not value_passes(rec["value"], t, spec):
            return TestReport(
                i,
                n,
                f"Test {i + 1}: wrong answer: expected {_preview(t['output'])}, "
                f"got {_preview(rec['value'])}",
            )
    return TestReport(n, n, f"All {n} tests passed")


def _judge(
    tests: list[dict[str, Any]], records: list[dict[str, Any]], spec: dict[str, Any], per: float
) -> dict[int, bool]:
    """Verdicts of the judge tests that returned a value, from their own sandboxed run."""
    idx = [i for i, t in enumerate(tests[: len(records)]) if "judge" in t and "value" in records[i]]
    if not idx:
        return {}
    cases = [[tests[i]["judge"], tests[i].get("judge_env", {}), records[i]["value"]] for i in idx]
    files = {
        "main.py": _JUDGE_RUNNER,
        "judge_code.py": spec.get("judge_code", ""),
        "cases.json": json.dumps(cases),
    }
    r = run_sequence([(["main.py", str(per)], "")], files, _limits(spec, per * len(idx) + 2.0))[0]
    try:
        verdicts = json.loads(r.stdout.strip().splitlines()[-1]) if r.ok else None
    except (ValueError, IndexError):
        verdicts = None
    if not isinstance(verdicts, list) or len(verdicts) != len(idx):
        return {}  # a failing judge fails its tests
    return {i: v is True for i, v in zip(idx, verdicts)}


def _read_call_channel(text: str, n: int) -> tuple[Any, list[dict[str, Any]]]:
    """Check the runner's records: a load record, then test 0, 1, ... once each, in order.

    A record after a failed test, a duplicate, a gap, an unknown key or a line that is not JSON
    makes the whole channel malformed. A last line without its newline (the program died while
    writing) is ignored.

    Returns:
        ``(loaded, records)``: ``None`` (no load record), ``True`` or the load error text; the
        test records in order.

    Raises:
        ValueError: the channel is malformed (message: why).
    """
    lines = text.split("\n")[:-1]  # complete lines only
    loaded: Any = None
    records: list[dict[str, Any]] = []
    for k, line in enumerate(lines, 1):
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            raise ValueError(f"line {k} is not a JSON record") from None
        if not isinstance(rec, dict):
            raise ValueError(f"line {k} is not a JSON object")
        if loaded is None:
            if rec == {"loaded": True}:
                loaded = True
                continue
            if set(rec) == {"load_error"} and isinstance(rec["load_error"], str):
                loaded = rec["load_error"]
                continue
            raise ValueError(f"line {k} is not a load record")
        if loaded is not True or (records and "error" in records[-1]):
            raise ValueError(f"line {k}: a record after the run ended")
        test = rec.get("test")
        keys = set(rec) - {"test"}
        if (
            not isinstance(test, int)
            or isinstance(test, bool)
            or keys not in ({"value"}, {"error"})
        ):
            raise ValueError(f"line {k} is not a test record")
        if test != len(records):
            if 0 <= test < len(records):
                raise ValueError(f"test {test + 1} reported twice")
            raise ValueError(f"test {test + 1} reported out of order")
        if test >= n:
            raise ValueError(f"a record for test {test + 1} of {n}")
        if "error" in rec and not isinstance(rec["error"], str):
            raise ValueError(f"line {k} is not a test record")
        records.append(rec)
    return loaded, records


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
        # The program runs as written; the trace (bank text, tokenized later) must be valid UTF-8.
        self.trace.append(TraceStep(action=clean_text(code), result=self.report.message))
        self.done = True
        return self.report.message, True

    def reward(self) -> float:
        if self.task is None:
            raise RuntimeError("reward() called before reset(task)")
        return 1.0 if self.report is not None and self.report.all_passed else 0.0
