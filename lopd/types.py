"""Data types shared by environments, rollouts, the experience bank and the trainer.

These are the contracts between ``lopd.envs``, ``lopd.rollout``, ``lopd.memory`` and
``lopd.trainer``; keep them small and JSON-serializable.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Domain = Literal["tool_use", "coding"]


@dataclass
class Task:
    """One task instance.

    Attributes:
        task_id: unique, stable id (e.g. ``"insurance-train-00042"``); the bank and the
            retriever key on it (no self-retrieval).
        domain: ``"tool_use"`` or ``"coding"``.
        world: which world/environment class runs it (e.g. ``"insurance"``, ``"coding"``).
        instruction: the natural-language task description shown to the model (the paper's x).
        spec: environment-specific, JSON-serializable payload: the initial database seed and the
            final-state checks for tool use; the tests for coding.
        split: ``"train"`` or ``"test"``.
    """

    task_id: str
    domain: Domain
    world: str
    instruction: str
    spec: dict[str, Any]
    split: str = "train"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Task:
        return cls(**d)


@dataclass
class TraceStep:
    """One action -> result pair of the observation-lite trace (paper A.3)."""

    action: str  # e.g. 'get_policy_by_policy_number(policy_number="XJ-439220")'
    result: str  # short, e.g. 'policy_id=POL-001' or 'Error: unknown tool'


@dataclass
class Trajectory:
    """One rollout of one task, tokenized exactly as the policy saw and produced it.

    Attributes:
        task: the task.
        messages: the chat, ``[{"role": "system"|"user"|"assistant"|"tool", "content": str}]``.
        input_ids: the whole rendered conversation, ``[L]``.
        action_mask: ``[L]``, 1 on tokens the policy generated (assistant turns, including their
            end-of-turn token), 0 on system, user and tool-result tokens.
        turn_spans: ``(start, end)`` token index of each assistant turn in ``input_ids``.
        prompt_len: number of tokens before the first assistant token (system + first user).
        reward: verifier reward in [0, 1].
        trace: observation-lite action -> result trace for the experience bank.
        num_steps: environment steps taken (assistant turns).
        num_tool_calls: parsed tool calls (valid or not).
        info: free-form diagnostics (errors, truncation, timings).
    """

    task: Task
    messages: list[dict[str, str]]
    input_ids: list[int]
    action_mask: list[int]
    turn_spans: list[tuple[int, int]]
    prompt_len: int
    reward: float
    trace: list[TraceStep] = field(default_factory=list)
    num_steps: int = 0
    num_tool_calls: int = 0
    info: dict[str, Any] = field(default_factory=dict)

    def trace_text(self) -> str:
        """The linearized observation-lite trace: ``1. action -> result`` per line."""
        return "\n".join(f"{i + 1}. {s.action} -> {s.result}" for i, s in enumerate(self.trace))
