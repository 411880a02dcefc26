"""Randomized ``env.step`` over every environment (each tool-use world and coding), fixed seed.

Model text is stitched from fragments a model (or an adversary calling the public API) could
produce: tags, JSON pieces, valid calls, escapes of surrogates and control characters, raw lone
surrogates, huge numbers, deep brackets, code fences and hostile programs. Every step must return
a valid-UTF-8, tokenizable observation quickly, and every reward must lie in [0, 1].
"""

from __future__ import annotations

import random
import time

import pytest
from transformers import AutoTokenizer

from lopd.envs import builtin_tasks, make_env, oracle_actions, world_names
from lopd.models import TINY_ASSET_DIR
from lopd.rollout.chat import render_observation
from lopd.types import Task
from tests.envs.fuzz_text import NOISE, random_turn

SEED = 20240613


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
            text = random_turn(rng, tools, oracle)
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
