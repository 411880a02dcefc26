"""Randomized ``env.step`` over every environment (each tool-use world and coding), fixed seed.

Model text is stitched from fragments a model (or an adversary calling the public API) could
produce: tags, JSON pieces, valid calls, escapes of surrogates and control characters, raw lone
surrogates, huge numbers, deep brackets, code fences and hostile programs. Every step must return
a valid-UTF-8, tokenizable observation quickly, and every reward must lie in [0, 1].
"""

from __future__ import annotations

import json
import random
import time

import pytest
from transformers import AutoTokenizer

from lopd.envs import builtin_tasks, make_env, oracle_actions, world_names
from lopd.models import TINY_ASSET_DIR
from lopd.rollout.chat import render_observation
from lopd.types import Task

SEED = 20240613

NOISE = [
    "<tool_call>",
    "</tool_call>",
    "<think>",
    "</think>",
    "{",
    "}",
    "[",
    "]",
    '"',
    ":",
    ",",
    "\n",
    " ",
    '"name"',
    '"arguments"',
    "null",
    "true",
    "NaN",
    "-Infinity",
    "1e999",
    "9" * 5000,
    "[" * 1000,
    '"\\ud800"',
    '"\\udfff\\ud800"',
    '"\\u0000"',
    '"\\u001b[31m"',
    "\ud800",
    "\x00",
    "\x1b[2J",
    "\u202e",
    "\U0001f600",
    "Task Completed",
    "task completed.",
    "```python\n",
    "```",
    "\\",
    "<tool_call>" * 50,
]


def _value(rng: random.Random) -> str:
    return rng.choice(
        [
            json.dumps(rng.choice(["Lena Park", "C-1", "O-1", "", "x" * 300])),
            str(rng.randint(-(10**6), 10**6)),
            "1.5",
            "true",
            "null",
            '"\\ud800"',
            '"\\u0007"',
            "[" * rng.randint(1, 40) + "]" * rng.randint(0, 40),
            '{"$ne": ""}',
        ]
    )


def _call(rng: random.Random, tools: list[dict]) -> str:
    fn = rng.choice(tools)["function"]
    params = [*list(fn["parameters"]["properties"]), "bogus"]
    args = ", ".join(
        f"{json.dumps(p)}: {_value(rng)}" for p in rng.sample(params, rng.randint(0, len(params)))
    )
    name = json.dumps(fn["name"]) if rng.random() < 0.9 else _value(rng)
    text = f'{{"name": {name}, "arguments": {{{args}}}}}'
    if rng.random() < 0.2:
        text = text[: rng.randint(0, len(text))]
    return f"<tool_call>\n{text}\n</tool_call>" if rng.random() < 0.8 else f"<tool_call>{text}"


def _turn(rng: random.Random, tools: list[dict], oracle: list[str]) -> str:
    parts = []
    for _ in range(rng.randint(1, 12)):
        r = rng.random()
        if r < 0.35:
            parts.append(_call(rng, tools))
        elif r < 0.45 and oracle:
            parts.append(rng.choice(oracle))
        else:
            parts.append(rng.choice(NOISE))
    text = "".join(parts)
    if rng.random() < 0.05:
        text *= rng.randint(10, 200)
    return text


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_ASSET_DIR)


def _check_observation(obs: str, done: bool, tokenizer) -> None:
    assert isinstance(obs, str)
    obs.encode("utf-8")
    if not done:
        assert render_observation(tokenizer, obs)


@pytest.mark.parametrize("world", world_names())
def test_fuzz_tool_use_world(world, tokenizer):
    rng = random.Random(f"{SEED}/{world}")
    tasks = [t for t in builtin_tasks("tool_use", "train") if t.world == world][:8]
    slowest = 0.0
    for episode in range(40):
        task = tasks[episode % len(tasks)]
        env = make_env(task, max_steps=rng.randint(1, 8))
        env.reset(task)
        tools, oracle = env.tools(), oracle_actions(task)
        done = False
        while not done:
            text = _turn(rng, tools, oracle)
            t0 = time.perf_counter()
            obs, done = env.step(text)
            slowest = max(slowest, time.perf_counter() - t0)
            _check_observation(obs, done, tokenizer)
        assert 0.0 <= env.reward() <= 1.0
        for s in env.trace:
            s.action.encode("utf-8")
            s.result.encode("utf-8")
        assert set(env.stats()) == {"num_steps", "num_tool_calls", "repeated_tool_calls"}
    assert slowest < 2.0


PROGRAMS = [
    "print(input())",
    "import sys\nsys.stdout.write(sys.stdin.read())",
    "while True:\n    pass",
    "import os\nos._exit(0)",
    "import os\nos.kill(os.getppid(), 9)",
    "import sys\nsys.stdout.write('\\x00\\ud800' * 1000)",
    "import sys\nsys.stdout.write('x' * (20 << 20))",
    "raise SystemExit('\\x1b[31mboom\\udcff')",
    "def f(*a):\n    return [[[[]]]]\n",
    "def f(*a):\n    return {1, 2}\n",
    "def f(*a):\n    return 10 ** 5000\n",
    "def f(*a):\n    return '\\ud800'\n",
    "class Solution:\n    def f(self, *a):\n        return a\n",
    "import os\nfor fd in range(32):\n    try:\n        os.write(fd, b'{\"test\": 0}\\n')\n"
    "    except OSError:\n        pass\ndef f(*a):\n    return 1\n",
]


def test_fuzz_coding(tokenizer):
    rng = random.Random(f"{SEED}/coding")
    stdio = Task(
        "fz-stdio",
        "coding",
        "coding",
        "Echo.",
        {"fn_name": None, "tests": [{"input": "a\n", "output": "a"}], "time_limit_s": 0.5},
        "train",
    )
    call = Task(
        "fz-call",
        "coding",
        "coding",
        "f",
        {"fn_name": "f", "tests": [{"input": [1], "output": [1]}] * 2, "time_limit_s": 0.5},
        "train",
    )
    for _ in range(16):
        task = rng.choice([stdio, call])
        pieces = [rng.choice(NOISE) for _ in range(rng.randint(0, 4))]
        program = rng.choice(PROGRAMS)
        fence = rng.choice(["```python\n{}\n```", "```\n{}\n```", "```py\n{}", "{}"])
        pieces.insert(rng.randint(0, len(pieces)), fence.format(program))
        env = make_env(task)
        env.reset(task)
        obs, done = env.step("".join(pieces))
        assert done and obs.isprintable()
        _check_observation(obs, False, tokenizer)
        assert env.reward() in (0.0, 1.0)
        env.trace[0].action.encode("utf-8")
