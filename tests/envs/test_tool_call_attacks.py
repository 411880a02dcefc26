"""Tool-call parsing and ``ToolUseEnv.step`` against hostile model text.

Whatever a model writes, ``step`` returns an observation (``Error: ...`` for anything malformed)
that is valid UTF-8 and that the tiny model's tokenizer encodes; it never raises, and it takes
time linear in the text.
"""

from __future__ import annotations

import contextlib
import time

import pytest
from transformers import AutoTokenizer

from lopd.envs import ToolCallParseError, builtin_tasks, make_env, oracle_actions, parse_tool_calls
from lopd.envs.base import (
    MAX_JSON_DEPTH,
    MAX_OBSERVATION_CHARS,
    MAX_TOOL_CALLS,
    clean_text,
    strip_thinking,
)
from lopd.models import TINY_ASSET_DIR
from lopd.rollout.chat import render_observation


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_ASSET_DIR)


def shop_task():
    return next(t for t in builtin_tasks("tool_use", "train") if t.world == "shop")


def step(text: str, tokenizer) -> str:
    task = shop_task()
    env = make_env(task)
    env.reset(task)
    obs, done = env.step(text)
    assert not done
    obs.encode("utf-8")  # raises on a lone surrogate
    assert render_observation(tokenizer, obs)
    for s in env.trace:
        s.action.encode("utf-8")
        s.result.encode("utf-8")
    # The episode goes on and can still be solved.
    for a in oracle_actions(task):
        env.step(a)
    assert env.done and env.reward() == 1.0
    return obs


def body(json_text: str) -> str:
    return f"<tool_call>\n{json_text}\n</tool_call>"


DEEP = "[" * 1000 + "]" * 1000


@pytest.mark.parametrize(
    "text, fragment",
    [
        (body("[" * 1000), "nested deeper than 32"),  # 4 KB, was RecursionError
        (body(DEEP), "nested deeper than 32"),
        (body('{"name": "find_customer", "arguments": {"name": ' + DEEP + "}}"), "nested deeper"),
        (body("[" * 100_000), "100002 characters long (at most 65536)"),
        (body('{"name": "find_customer", "arguments": {"n": ' + "9" * 5000 + "}}"), "number"),
        (body('{"name": "find_customer", "arguments": {"n": 1e999}}'), "out of range"),
        (body('{"name": "find_customer", "arguments": {"n": NaN}}'), "NaN is not valid JSON"),
        (body('{"name": "find_customer", "arguments": {"n": -Infinity}}'), "not valid JSON"),
        (body('{"name": "\\ud800", "arguments": {}}'), "lone surrogate (U+D800)"),
        (body('{"name": "find_customer", "arguments": {"name": "\\udc00x"}}'), "lone surrogate"),
        (body('{"name": "find_customer", "arguments": {"\\udfff": "x"}}'), "lone surrogate"),
        (body('{"name": "find_customer", "arguments": "{\\"name\\": \\"\\\\ud83d\\"}"}'), "lone"),
        (body('{"name": "find\\u0000\\u001b[31m", "arguments": {}}'), "control character"),
        (body('{"name": "find_customer", "arguments": {"name": "\\u009b2J"}}'), "(U+009B)"),
        (body('{"name": "find\x1b", "arguments": {}}'), "not valid JSON"),  # raw: JSON refuses
        (body('{"name": "' + "a" * 200 + '", "arguments": {}}'), "'name' is 200 characters"),
        (body('{"name": "find_customer", "arguments": {"name": "' + "x" * 70_000 + '"}}'), "long"),
        ("<tool_call>" * 9000, "characters long"),  # 100 KB of tags, was 49 s
        (body('{"name": "get_orders", "arguments": {}}') * 40, "40 tool calls in one turn"),
    ],
)
def test_hostile_tool_calls_give_error_observations(text, fragment, tokenizer):
    obs = step(text, tokenizer)
    assert obs.startswith("Error: ") and fragment in obs, obs


def test_valid_json_escapes_still_work(tokenizer):
    # A surrogate *pair* is one valid character; tabs and newlines in strings are fine.
    calls = parse_tool_calls(body('{"name": "a", "arguments": {"s": "\\ud83d\\ude00\\t\\n"}}'))
    assert calls[0].arguments == {"s": "\U0001f600\t\n"}
    depth_ok = '{"name": "a", "arguments": {"x": ' + "[" * (MAX_JSON_DEPTH - 2)
    depth_ok += "]" * (MAX_JSON_DEPTH - 2) + "}}"
    assert parse_tool_calls(body(depth_ok))[0].name == "a"
    with pytest.raises(ToolCallParseError, match="nested deeper"):
        parse_tool_calls(body(depth_ok.replace("[", "[[", 1).replace("]", "]]", 1)))
    assert len(parse_tool_calls(body('{"name": "a"}') * MAX_TOOL_CALLS)) == MAX_TOOL_CALLS
    # An echoed argument is cut and cleaned in the observation.
    obs = step(
        body('{"name": "find_customer", "arguments": {"name": "' + "y" * 60_000 + '"}}'), tokenizer
    )
    assert obs.startswith("Error: no customer named") and len(obs) < MAX_OBSERVATION_CHARS + 100


def _timed(fn, text: str) -> float:
    t0 = time.perf_counter()
    fn(text)
    return time.perf_counter() - t0


@pytest.mark.parametrize(
    "unit",
    [
        "<tool_call>",
        "<tool_call></tool_call>",
        "</tool_call><tool_call>",
        "<think>",
        "<think><tool_call>",
        "<tool_call>{",
        "```python\n",
        "```\n<tool_call>",
    ],
)
def test_tag_parsing_is_linear_time(unit, tokenizer):
    """100 KB vs 400 KB of repeated tags: a quadratic parser takes 16x as long, linear 4x."""
    from lopd.envs.coding import extract_code

    def parse(text):
        with contextlib.suppress(ToolCallParseError):
            parse_tool_calls(text)
        extract_code(text)
        strip_thinking(text)

    small, big = unit * (100_000 // len(unit)), unit * (400_000 // len(unit))
    t_small = min(_timed(parse, small) for _ in range(3))
    t_big = min(_timed(parse, big) for _ in range(3))
    assert t_big < 1.0 and t_big < 10 * t_small + 0.05, (t_small, t_big)
    assert step(small, tokenizer).startswith("Error: ")


def test_clean_text():
    assert clean_text("a\tb\nc\r") == "a\tb\nc\r"
    assert clean_text("\ud800x\x00\x1b\x9b") == "\ufffdx\ufffd\ufffd\ufffd"
    assert clean_text("x" * 50, limit=10) == "x" * 10 + "... [cut: 50 characters]"
