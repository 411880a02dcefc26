"""Token budgets, checked against the model's context length before anything is generated.

Three budgets bound every rollout (``gen`` section, :class:`~lopd.config.GenConfig`):

* ``gen.max_new_tokens``: one assistant turn;
* ``gen.max_total_tokens``: the whole trajectory (prompt, turns and observations);
* ``gen.max_prompt_tokens``: the rendered prompt (system, tool schemas, first user message);
  ``null`` = ``max_total_tokens - max_new_tokens``, room for at least one full turn.

:func:`check_token_budgets` runs at start-up, after the model and the tasks are loaded, so a
prompt that does not fit never surfaces as a crash in the middle of a run. It checks:

1. ``max_total_tokens`` against the model's context length (``max_position_embeddings``);
   with a composer, the teacher reads a trajectory plus the framing text and ``J*K`` latent
   placeholders, so that longer sequence must fit too; the encoder's
   ``composer.max_encoder_tokens`` and the embedder's ``bank.embed_max_length`` as well;
2. every task's rendered prompt against the prompt budget, and (with a composer and
   ``eval.with_composer``) every held-out task's framed "base + composer" prompt against the
   trajectory budget. Tasks over budget are a start-up error naming the count, the longest and
   the fix (``gen.prompt_overflow=error``, the default), or are dropped from their split with a
   logged count (``gen.prompt_overflow=drop``), recorded in ``summary.json``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from lopd.config import Config, ConfigError
from lopd.envs import make_env
from lopd.rollout.chat import render_prompt
from lopd.types import Task

__all__ = [
    "BudgetReport",
    "TeacherFraming",
    "check_token_budgets",
    "context_length",
    "prompt_budget",
]


def prompt_budget(cfg: Config) -> int:
    """``gen.max_prompt_tokens``, or ``max_total_tokens - max_new_tokens`` when unset."""
    g = cfg.gen
    if g.max_prompt_tokens is not None:
        return g.max_prompt_tokens
    return g.max_total_tokens - g.max_new_tokens


def context_length(model_config: Any) -> int | None:
    """The longest sequence the model is configured for (``max_position_embeddings``)."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(model_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


@dataclass
class BudgetReport:
    """What the start-up check measured (``summary.json["token_budget"]``).

    Attributes:
        context_length: the model's context length (``None`` when its config has none).
        max_new_tokens, max_total_tokens, max_prompt_tokens: the budgets in force.
        teacher_overhead: the most tokens the latent teacher's framing and placeholders add to
            a trajectory (0 without a composer).
        longest_prompt: the longest rendered prompt over both splits, in tokens.
        dropped_train, dropped_test: task ids dropped by ``gen.prompt_overflow=drop``.
    """

    context_length: int | None
    max_new_tokens: int
    max_total_tokens: int
    max_prompt_tokens: int
    teacher_overhead: int = 0
    longest_prompt: int = 0
    dropped_train: list[str] = field(default_factory=list)
    dropped_test: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["dropped_train"] = len(self.dropped_train)
        d["dropped_test"] = len(self.dropped_test)
        return d


def _prompt_ids(tokenizer: Any, task: Task, enable_thinking: bool) -> list[int]:
    """The rendered prompt of ``task`` as the rollout renders it."""
    env = make_env(task)
    user = env.reset(task)
    return render_prompt(
        tokenizer, env.system_prompt(), user, env.tools(), enable_thinking=enable_thinking
    )


class TeacherFraming(Protocol):
    """What a latent teacher adds to a prompt (:class:`lopd.latent.conditioned.LatentFraming`)."""

    def framed_prompt(self, tokenizer: Any, task: Task, enable_thinking: bool) -> list[int]:
        """The "base + composer" prompt of ``task``: framing text and ``J*K`` placeholders."""
        ...

    def teacher_overhead(self, tokenizer: Any, task: Task, prompt: list[int]) -> int:
        """Tokens the teacher's input adds to a trajectory of ``task`` that starts with
        ``prompt``."""
        ...


def check_token_budgets(
    cfg: Config,
    model_config: Any,
    tokenizer: Any,
    train: Sequence[Task],
    test: Sequence[Task],
    framing: TeacherFraming | None,
    log: Callable[[str], None] = print,
    enable_thinking: bool = False,
) -> tuple[list[Task], list[Task], BudgetReport]:
    """Check the budgets against the context and every task's prompt (module docstring).

    Args:
        cfg: the run config (``gen``, ``composer``, ``bank``, ``eval`` sections).
        model_config: the backbone's Hugging Face config.
        tokenizer: its tokenizer (with the chat template).
        train, test: the loaded splits.
        framing: the latent teacher's framing and placeholders (``None``: no composer).
        log: where the drop count is reported.
        enable_thinking: the rollouts' chat-template switch (prompts are rendered with it).

    Returns:
        ``(train, test, report)``: the splits (minus dropped tasks) and what was measured.

    Raises:
        ConfigError: a budget exceeds the context length, or (``gen.prompt_overflow=error``)
            a prompt exceeds its budget; the message names the field, the numbers and the fix.
    """
    g = cfg.gen
    ctx = context_length(model_config)
    report = BudgetReport(ctx, g.max_new_tokens, g.max_total_tokens, prompt_budget(cfg))
    if ctx is not None:
        encoder = cfg.composer.max_encoder_tokens if framing is not None else 0
        for name, value in (
            ("gen.max_total_tokens", g.max_total_tokens),
            ("composer.max_encoder_tokens", encoder),
            ("bank.embed_max_length", cfg.bank.embed_max_length),
        ):
            if value > ctx:
                raise ConfigError(
                    f"{name}={value} exceeds the model's context length {ctx} "
                    "(max_position_embeddings of model.path's config)"
                )
    prompts = {t.task_id: _prompt_ids(tokenizer, t, enable_thinking) for t in [*train, *test]}
    report.longest_prompt = max((len(p) for p in prompts.values()), default=0)
    if framing is not None:
        report.teacher_overhead = max(
            (framing.teacher_overhead(tokenizer, t, prompts[t.task_id]) for t in [*train, *test]),
            default=0,
        )
        if ctx is not None and g.max_total_tokens + report.teacher_overhead > ctx:
            raise ConfigError(
                f"gen.max_total_tokens={g.max_total_tokens} plus the latent teacher's framing "
                f"text and J*K placeholders ({report.teacher_overhead} tokens) exceed the "
                f"model's context length {ctx}: set gen.max_total_tokens <= "
                f"{ctx - report.teacher_overhead}"
            )
    over_train = [t for t in train if len(prompts[t.task_id]) > report.max_prompt_tokens]
    over_test = [t for t in test if len(prompts[t.task_id]) > report.max_prompt_tokens]
    what = f"gen.max_prompt_tokens={report.max_prompt_tokens}"
    if framing is not None and cfg.eval.with_composer:
        # "Base + composer" generates from the framed prompt within the trajectory budget.
        room = g.max_total_tokens - 2  # one generated token and the closing end-of-turn
        framed_over = [
            t
            for t in test
            if t not in over_test
            and len(framing.framed_prompt(tokenizer, t, enable_thinking)) > room
        ]
        if framed_over:
            over_test += framed_over
            what += f" (or framed base + composer prompts over gen.max_total_tokens - 2 = {room})"
    over = over_train + over_test
    if over:
        worst = max(over, key=lambda t: len(prompts[t.task_id]))
        detail = (
            f"{len(over_train)} of {len(train)} train and {len(over_test)} of {len(test)} test "
            f"tasks have prompts over {what}; the longest, {worst.task_id!r}, is "
            f"{len(prompts[worst.task_id])} tokens"
        )
        if g.prompt_overflow == "error":
            raise ConfigError(
                f"{detail}: raise gen.max_prompt_tokens / gen.max_total_tokens (context length "
                f"{ctx}) or set gen.prompt_overflow=drop to skip those tasks"
            )
        dropped = {t.task_id for t in over}
        report.dropped_train = [t.task_id for t in over_train]
        report.dropped_test = [t.task_id for t in over_test]
        train = [t for t in train if t.task_id not in dropped]
        test = [t for t in test if t.task_id not in dropped]
        log(f"token budget: dropped {len(over)} tasks (gen.prompt_overflow=drop): {detail}")
        if not train or not test:
            raise ConfigError(f"{detail}: no {'train' if not train else 'test'} task is left")
    return list(train), list(test), report
