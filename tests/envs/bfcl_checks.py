"""Helpers of the BFCL tests: playing an entry, and our verdict beside bfcl-eval's own
``multi_turn_checker`` for the same model behaviour (tests/envs/test_bfcl.py,
tests/envs/test_bfcl_limits.py)."""

from __future__ import annotations

import copy
import uuid

from lopd.envs import make_env
from lopd.envs.base import ToolCall
from lopd.envs.bfcl import BACKEND_CLASSES
from lopd.envs.tool_use import format_tool_call


def by_id(tasks, entry_id):
    return next(t for t in tasks if t.spec["bfcl_id"] == entry_id)


def play(task, actions):
    env = make_env(task)
    first = env.reset(task)
    obs = []
    for a in actions:
        o, done = env.step(a)
        obs.append((o, env.observation_role))
        if done:
            break
    return env, first, obs


def python_call(call: ToolCall) -> str:
    return f"{call.name}(" + ", ".join(f"{k}={v!r}" for k, v in call.arguments.items()) + ")"


MALFORMED = '<tool_call>\n{"name": "cd", "arguments": {"folder": \n</tool_call>'


def both_verdicts(task, steps_per_turn):
    """Our verdict and bfcl-eval's, for the same model behaviour.

    ``steps_per_turn``: per user turn, a list of steps, each a list of calls or ``MALFORMED``
    (undecodable: BFCL drops the step and ends the turn). Official side: the decoded steps fed
    to ``multi_turn_checker``, after the eval runner's force-termination check.
    """
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker

    env = make_env(task)
    env.reset(task)
    decoded = []
    for turn in steps_per_turn:
        steps = []
        for step in turn:
            if step == MALFORMED:
                env.step(MALFORMED)
                break
            env.step("\n".join(format_tool_call(c) for c in step))
            steps.append([python_call(c) for c in step])
            if env.done:
                break
        else:
            env.step("I am done with this request.")
        decoded.append(steps)
        if env.done:
            break
    gt = task.spec["ground_truth"]
    if len(decoded) != len(gt):
        official = {"valid": False, "error_type": "multi_turn:force_terminated"}
    else:
        entry = {k: task.spec[k] for k in ("initial_config", "involved_classes")}
        entry["id"] = task.spec["bfcl_id"]
        # A fresh model name (bfcl-eval caches backend instances in module globals by name; the
        # name must be an identifier prefix: it becomes part of the code bfcl-eval evals). Its
        # instances share module-level long-context records (which a call may change), so
        # they are restored afterwards: each official verdict starts from the pristine data.
        saved = _backend_module_data()
        try:
            official = multi_turn_checker(
                decoded, gt, entry, task.spec["category"], f"lopd_{uuid.uuid4().hex}"
            )
        finally:
            _restore(saved)
    return env, official


def _backend_module_data():
    import importlib

    from bfcl_eval.constants.executable_backend_config import CLASS_FILE_PATH_MAPPING

    names = [CLASS_FILE_PATH_MAPPING[c] for c in BACKEND_CLASSES]
    names.append("bfcl_eval.eval_checker.multi_turn_eval.func_source_code.long_context")
    saved = []
    for name in names:
        module = importlib.import_module(name)
        for key, value in vars(module).items():
            if key.isupper() and isinstance(value, (dict, list)):
                saved.append((module, key, copy.deepcopy(value)))
    return saved


def _restore(saved):
    for module, key, value in saved:
        setattr(module, key, copy.deepcopy(value))
