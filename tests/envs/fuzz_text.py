"""Random model text for the environment fuzz tests: fragments of tool-call syntax, hostile
strings, and calls of an env's tools with random arguments (tests/envs/test_env_fuzz.py,
tests/envs/test_bfcl.py)."""

from __future__ import annotations

import json
import random

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


def random_value(rng: random.Random) -> str:
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


def random_call(rng: random.Random, tools: list[dict]) -> str:
    fn = rng.choice(tools)["function"]
    params = [*list(fn["parameters"]["properties"]), "bogus"]
    args = ", ".join(
        f"{json.dumps(p)}: {random_value(rng)}"
        for p in rng.sample(params, rng.randint(0, len(params)))
    )
    name = json.dumps(fn["name"]) if rng.random() < 0.9 else random_value(rng)
    text = f'{{"name": {name}, "arguments": {{{args}}}}}'
    if rng.random() < 0.2:
        text = text[: rng.randint(0, len(text))]
    return f"<tool_call>\n{text}\n</tool_call>" if rng.random() < 0.8 else f"<tool_call>{text}"


def random_turn(rng: random.Random, tools: list[dict], oracle: list[str]) -> str:
    parts = []
    for _ in range(rng.randint(1, 12)):
        r = rng.random()
        if r < 0.35:
            parts.append(random_call(rng, tools))
        elif r < 0.45 and oracle:
            parts.append(rng.choice(oracle))
        else:
            parts.append(rng.choice(NOISE))
    text = "".join(parts)
    if rng.random() < 0.05:
        text *= rng.randint(10, 200)
    return text
