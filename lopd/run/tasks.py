"""The run's tasks and the one seeded sampler every phase draws from.

:func:`load_tasks` gives the train and held-out splits (a task file or release directory,
:func:`lopd.envs.load_task_file`, or the built-in generator). :class:`TaskSampler` draws a
step's items (training tasks, rollout groups, cold-start trajectories): the draw is a pure
function of ``(seed, stream, step)``, identical on every rank, and each rank keeps its share
``draw[rank::world]``, so the data position of a resumed run is the step number alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import numpy as np

from lopd.config import Config, ConfigError
from lopd.envs import builtin_tasks, load_task_file, missing_requirement
from lopd.run.seeds import Stream, seed_of
from lopd.types import Task

__all__ = ["TaskSampler", "load_tasks"]

T = TypeVar("T")


def load_tasks(cfg: Config) -> tuple[list[Task], list[Task]]:
    """The ``(train, held-out)`` tasks of ``cfg.data``.

    The held-out tasks are those of ``data.eval_split``; the built-in generator uses task-set
    seed ``data.task_seed`` (the run seed when ``None``).

    Raises:
        ConfigError: the tasks file has no task of one of the splits, a task it keeps cannot run
            here (an ACEBench multi-turn task without a user model), or the source has fewer
            tasks than ``data.n_train`` / ``data.n_test`` request (naming both numbers).
    """
    d = cfg.data
    if d.tasks_path is not None:
        tasks = load_task_file(d.tasks_path)
        train = [t for t in tasks if t.split == "train"]
        heldout = [t for t in tasks if t.split == d.eval_split]
        if not train:
            raise ConfigError(f"data.tasks_path {d.tasks_path!r} holds no split='train' task")
        if not heldout:
            raise ConfigError(
                f"data.tasks_path {d.tasks_path!r} holds no split={d.eval_split!r} task"
            )
        source = f"data.tasks_path {d.tasks_path!r}"
    else:
        seed = cfg.seed if d.task_seed is None else d.task_seed
        train = builtin_tasks(d.domain, "train", seed=seed)
        heldout = builtin_tasks(d.domain, d.eval_split, seed=seed)
        source = f"the built-in {d.domain} generator"
    for name, want, have, split in (
        ("data.n_train", d.n_train, len(train), "train"),
        ("data.n_test", d.n_test, len(heldout), d.eval_split),
    ):
        if want > have:
            raise ConfigError(
                f"{name}={want} but {source} has only {have} {split} tasks: set {name}={have} "
                "or less (or pass more tasks with --tasks)"
            )
    train, heldout = train[: d.n_train], heldout[: d.n_test]
    for task in train + heldout:
        problem = missing_requirement(task)
        if problem is not None:
            raise ConfigError(f"data.tasks_path {d.tasks_path!r}: {problem}")
    return train, heldout


class TaskSampler:
    """Seeded draws of a step's items, split across data-parallel ranks.

    Args:
        seed: the run seed.
        rank: this process's rank.
        world: the number of ranks.
    """

    def __init__(self, seed: int, rank: int = 0, world: int = 1) -> None:
        self.seed, self.rank, self.world = seed, rank, world

    def draw(self, population: Sequence[T], size: int, stream: Stream, step: int) -> list[T]:
        """This rank's share of ``size`` items drawn from ``population`` at ``step``.

        The draw is without replacement unless the population is smaller than ``size``.
        """
        rng = np.random.default_rng(seed_of(self.seed, stream, step))
        n = len(population)
        idx = rng.choice(n, size=size, replace=n < size)
        return [population[i] for i in idx[self.rank :: self.world]]
