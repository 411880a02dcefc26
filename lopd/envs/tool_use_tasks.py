"""The built-in task sets of the tool-use worlds (:mod:`lopd.envs.tool_use`).

Each registered world's templates write tasks from seeded databases: 200 train / 40 val / 40
test per world and task-set seed, the splits on disjoint database seeds and never repeating an
earlier split's instruction (:func:`world_tasks`, :func:`tool_use_tasks`).
"""

from __future__ import annotations

import copy
import random
from typing import Any

from lopd.envs.tool_use import TemplateNotApplicable, get_world, world_names
from lopd.types import Task

SPLITS = ("train", "val", "test")
"""The built-in splits. Every choice of the embedded default is tuned on ``val``, never ``test``."""

PER_WORLD = {"train": 200, "val": 40, "test": 40}
"""Tasks per world and split of a built-in task set."""


def make_task(
    world: str,
    template: str,
    seed: int,
    task_id: str,
    split: str,
    conventions: dict[str, str] | None = None,
) -> Task:
    """Generate one task of ``world`` from ``template`` with database seed ``seed``.

    Args:
        world: registered world name.
        template: one of the world's templates.
        seed: database seed (:meth:`World.build_db`); also seeds the template's picks.
        task_id: the task's id.
        split: its split label.
        conventions: convention overrides (``None``: the world's defaults, not stored in the
            spec). The entities picked depend only on ``(world, template, seed)``, so the same
            task under other conventions differs only in its oracle and checks.
    """
    cls = get_world(world)
    w = cls(cls.build_db(seed), conventions)
    draft = w.generate(template, random.Random(f"{world}/{template}/{seed}"))
    spec: dict[str, Any] = {"seed": seed}
    if conventions:
        spec["conventions"] = dict(w.active)
    spec.update(
        {
            "template": template,
            "params": draft.params,
            "checks": draft.checks,
            "oracle": [{"name": c.name, "arguments": c.arguments} for c in draft.oracle],
        }
    )
    return Task(task_id, "tool_use", world, draft.instruction, spec, split)


def split_db_seed(rng: random.Random, split: str) -> int:
    """A database seed of ``split``: residue ``SPLITS.index(split)`` mod 3.

    The splits draw databases from disjoint seed classes, so no database of a held-out split is
    ever a database of the train split, whatever the task-set seeds of the two.
    """
    return 3 * rng.getrandbits(29) + SPLITS.index(split)


def _generate_split(world: str, split: str, count: int, seed: int, exclude: set[str]) -> list[Task]:
    cls = get_world(world)
    rng = random.Random(f"lopd-tasks/{world}/{split}/{seed}")
    tasks: list[Task] = []
    seen = set(exclude)
    i = 0
    while len(tasks) < count:
        template = cls.templates[i % len(cls.templates)]
        i += 1
        task_seed = split_db_seed(rng, split)
        try:
            t = make_task(world, template, task_seed, f"{world}-{split}-{len(tasks):05d}", split)
        except TemplateNotApplicable:
            continue
        # The instruction names every entity of the task: equal text = same entity combination.
        if t.instruction in seen:
            continue
        seen.add(t.instruction)
        tasks.append(t)
    return tasks


_CACHE: dict[tuple[str, str, int], list[Task]] = {}


def world_tasks(world: str, split: str = "train", seed: int = 0) -> list[Task]:
    """One world's tasks of a built-in task set (200 train / 40 val / 40 test), cached.

    Args:
        world: registered world name.
        split: ``"train"``, ``"val"`` or ``"test"``.
        seed: the task-set seed: every seed is another task set (other databases, entities).

    The splits use disjoint database seeds (:func:`split_db_seed`); ``val`` never repeats a train
    instruction (entity combination), ``test`` never repeats a train or val one.

    Raises:
        ValueError: unknown ``split``.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    key = (world, split, seed)
    if key not in _CACHE:
        earlier = SPLITS[: SPLITS.index(split)]
        exclude = {t.instruction for s in earlier for t in world_tasks(world, s, seed)}
        _CACHE[key] = _generate_split(world, split, PER_WORLD[split], seed, exclude)
    return [copy.deepcopy(t) for t in _CACHE[key]]


def tool_use_tasks(
    split: str = "train", n: int | None = None, seed: int = 0, worlds: list[str] | None = None
) -> list[Task]:
    """Tasks of all (or the given) worlds, interleaved round-robin so any prefix mixes worlds."""
    names = world_names() if worlds is None else list(worlds)
    per = [world_tasks(w, split, seed) for w in names]
    out = [t for group in zip(*per) for t in group]
    return out if n is None else out[:n]
