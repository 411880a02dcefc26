"""Shared pieces of the built-in tool-use worlds: entity pools and task-assembly helpers.

The worlds themselves live in :mod:`lopd.envs.shop`, :mod:`lopd.envs.insurance` and
:mod:`lopd.envs.logistics`; :mod:`lopd.envs.worlds` registers all three.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from lopd.envs.base import ToolCall
from lopd.envs.tool_use import Db, Draft, ToolError

FIRST_NAMES = (
    "Lena", "Omar", "Alice", "Ravi", "Mia", "Jonas", "Sara", "Kenji", "Nora", "Diego",
    "Hana", "Felix", "Zoe", "Ivan", "Leila", "Marco", "Chloe", "Tariq", "Emma", "Yusuf",
    "Ana", "Bruno", "Ines", "Liam", "Maya", "Noah", "Olga", "Pablo", "Rosa", "Sven",
)  # fmt: skip
LAST_NAMES = (
    "Park", "Diaz", "Chan", "Patel", "Novak", "Berg", "Costa", "Ito", "Haddad", "Kim",
    "Lopez", "Moreau", "Okafor", "Rossi", "Silva", "Tanaka", "Weber", "Young", "Fischer", "Gray",
)  # fmt: skip
STREETS = ("Oak St", "Pine Ave", "Elm Rd", "Lake Dr", "Hill St", "Main St", "River Rd", "Bay Ave")
CITIES = (
    "Denver", "Boston", "Austin", "Chicago", "Seattle", "Miami", "Dallas", "Phoenix",
    "Atlanta", "Portland",
)  # fmt: skip
PRODUCTS = (
    "Desk Lamp", "Coffee Mug", "Yoga Mat", "Backpack", "Headphones", "Notebook",
    "Water Bottle", "Phone Case", "Wall Clock", "Sunglasses",
)  # fmt: skip
COVERAGES = {
    "health": ("ER", "Dental", "Vision", "Psychiatric", "Maternity"),
    "auto": ("Collision", "Liability", "Theft", "Glass", "Towing"),
    "home": ("Fire", "Flood", "Theft", "Water", "Storm"),
}

# Every number a task shows is below 1000: the tiny model's tokenizer has one token per number
# below 1000. The keys a task names (order, policy and tracking numbers) have two digits, so the
# 90 of them each occur in many train-split tasks: a number token that no training episode
# contains keeps its initial embedding, and the tiny model cannot copy it (measured: 3-digit keys,
# of which 58 of the 89 val keys never occur in a train instruction, left it copying the key of
# the first call right 0.35 of the time after 800 steps; 2-digit keys 0.97 after 300). Amounts
# and limits are three-digit multiples of 10 or 50. Every value an agent copies starts with a
# frequent token (a word, or a prefix: "#48", "PN-48", "TRK-48", "$450", "Elm Rd 60", "O-7"),
# written the same way in the instruction, the tool results and the tool calls, so copying it is
# matching that first token and continuing from there.
NUMBER_RANGE = range(10, 100)


def dollars(value: str, what: str) -> int:
    """Parse a dollar amount written ``"$450"`` (how tasks and tools write money).

    Raises:
        ToolError: not ``$`` followed by digits, or outside 1..100000.
    """
    if not (value.startswith("$") and value[1:].isdigit()):
        raise ToolError(f"{what} must be written like '$500', got '{value}'")
    amount = int(value[1:])
    if not 0 < amount <= 100_000:
        raise ToolError(f"{what} must be between $1 and $100000")
    return amount


def random_names(rng: random.Random, k: int) -> list[str]:
    pairs = rng.sample([(f, la) for f in FIRST_NAMES for la in LAST_NAMES], k)
    return [f"{f} {la}" for f, la in pairs]


def random_address(rng: random.Random) -> str:
    return f"{rng.choice(STREETS)} {rng.randint(2, 98)}"


def find_id(table: dict[str, dict[str, Any]], field: str, value: Any) -> str | None:
    for rid, rec in table.items():
        if rec.get(field) == value:
            return rid
    return None


def get_record(db: Db, table: str, rid: str, what: str) -> dict[str, Any]:
    rec = db[table].get(rid)
    if rec is None:
        raise ToolError(f"no {what} with id '{rid}'")
    return rec


def eq(table: str, rid: str, path: str, value: Any) -> dict[str, Any]:
    return {"op": "equals", "table": table, "id": rid, "path": path, "value": value}


STR = "string"
INT = "integer"


@dataclass
class Step:
    """One modifying call of an oracle with the checks it must leave true and the fields it may
    change (``{table: {record_id: [field, ...]}}``)."""

    call: ToolCall
    checks: list[dict[str, Any]]
    allow: dict[str, dict[str, list[str]]]


def draft(
    instruction: str,
    params: dict[str, Any],
    lookups: list[ToolCall],
    main: list[Step],
    rules: list[tuple[str, Step]],
    new: dict[str, int] | None = None,
) -> Draft:
    """Assemble a task: lookups, ``"pre"`` rule steps, the main steps, ``"post"`` rule steps.

    The checks are every step's checks plus one ``unchanged`` gate that allows exactly the fields
    the steps change (and ``new`` records per table).
    """
    pre = [s for kind, s in rules if kind == "pre"]
    post = [s for kind, s in rules if kind == "post"]
    steps = pre + main + post
    allow: dict[str, dict[str, list[str]]] = {}
    for s in steps:
        for table, recs in s.allow.items():
            for rid, fields in recs.items():
                have = allow.setdefault(table, {}).setdefault(rid, [])
                have += [f for f in fields if f not in have]
    checks = [c for s in steps for c in s.checks]
    checks.append({"op": "unchanged", "allow": allow, "new": new or {}, "gate": True})
    return Draft(instruction, params, checks, lookups + [s.call for s in steps])


def lexicon() -> list[str]:
    """Texts naming every entity word the worlds can generate (for the tiny model's tokenizer).

    Written the way tool calls and results show them (JSON string values), so a tokenizer built
    from them covers every name, city, street, product and coverage of any task set.
    """
    texts = [
        f'{{"name": "{f} {LAST_NAMES[i % len(LAST_NAMES)]}"}}' for i, f in enumerate(FIRST_NAMES)
    ]
    texts += [f'{{"name": "{FIRST_NAMES[0]} {la}"}}' for la in LAST_NAMES]
    texts += [f'{{"email": "{f.lower()}.{LAST_NAMES[0].lower()}@mail.com"}}' for f in FIRST_NAMES]
    texts += [f'{{"address": "12 {s}"}}' for s in STREETS]
    texts += [f'{{"city": "{c}"}}' for c in CITIES]
    texts += [f'{{"name": "{p}"}}' for p in PRODUCTS]
    texts += [f'{{"coverage": "{c}"}}' for covs in COVERAGES.values() for c in covs]
    texts += [f'{{"type": "{t}"}}' for t in COVERAGES]
    return texts * 2
