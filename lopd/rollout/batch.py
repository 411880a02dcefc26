"""Trajectories as model inputs: padded id batches and the rows of their action tokens.

A trajectory's supervised tokens are its *action* tokens (``action_mask``). Their rows are found
once per micro-batch (:class:`ActionRows`), so the LM heads and the distillation kernels run on
those ``N`` rows alone, never on ``[B, L, V]`` logits; their log-probabilities come from the fused
LM-head kernel (:func:`lm_head_logprobs`), never from ``[N, V]`` logits either.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from lopd.parallel.distributed import is_sharded
from lopd.parallel.fsdp import full_weight
from lopd.parallel.precision import autocast_cast
from lopd.types import Trajectory
from lopd_kernels.fused_linear_logprob import fused_linear_logprob

__all__ = ["ActionRows", "action_rows", "lm_head", "lm_head_logprobs", "pad_batch"]


def pad_batch(
    sequences: Sequence[Sequence[int]], pad_id: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad id lists into ``([B, L_max] ids, [B, L_max] attention mask)``.

    Right padding keeps every real token at position ``arange(len)``, the positions it had
    unpadded, so causal logits at real positions do not depend on the batch.
    """
    longest = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), longest), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids.to(device), mask.to(device)


def action_rows(action_mask: Sequence[int]) -> torch.Tensor:
    """Student positions whose *next-token prediction* targets an action token.

    Returns:
        ``[N]`` int64 row indices ``p - 1`` for every ``p >= 1`` with ``action_mask[p] == 1``;
        the logits at row ``p - 1`` predict token ``p``.
    """
    mask = torch.as_tensor(list(action_mask), dtype=torch.bool)
    positions = torch.nonzero(mask[1:], as_tuple=False).flatten()
    return positions  # (p - 1) for p in 1..L-1 with mask[p]


@dataclasses.dataclass
class ActionRows:
    """Where the supervised tokens of a batch of trajectories are.

    Attributes:
        batch: ``[N]`` int64 trajectory index of each supervised row.
        rows: ``[N]`` int64 student position ``p - 1`` whose logits predict action token ``p``.
        targets: ``[N]`` int64 the sampled action token ``input_ids[p]``.
    """

    batch: torch.Tensor
    rows: torch.Tensor
    targets: torch.Tensor

    @classmethod
    def of(cls, trajectories: Sequence[Trajectory], device: torch.device) -> ActionRows:
        batch, rows, targets = [], [], []
        for i, traj in enumerate(trajectories):
            r = action_rows(traj.action_mask)
            ids = torch.as_tensor(traj.input_ids, dtype=torch.long)
            batch.append(torch.full_like(r, i))
            rows.append(r)
            targets.append(ids[r + 1])
        return cls(
            torch.cat(batch).to(device), torch.cat(rows).to(device), torch.cat(targets).to(device)
        )


def lm_head(model: nn.Module) -> nn.Module:
    """The output embedding (LM head) of a ``*ForCausalLM``."""
    head = model.get_output_embeddings()
    if head is None:
        raise TypeError(f"{type(model).__name__} has no output embeddings (LM head)")
    return head


def lm_head_logprobs(
    head: nn.Module, h: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """``log softmax(head(h) / temperature)[targets]``, ``[N]`` float32, without ``[N, V]``
    logits (:func:`lopd_kernels.fused_linear_logprob`; gradients reach ``h`` and the head).

    Under autocast the kernel reads the operands in the autocast dtype, as an autocast ``head(h)``
    would (autocast does not cast a custom op's inputs); a sharded frozen head is gathered first
    (:func:`full_weight`).

    Args:
        head: the LM head (``nn.Linear``-like: ``weight [V, d]``, optional ``bias``).
        h: ``[N, d]`` final hidden states.
        targets: ``[N]`` token ids (``-100``: no target, log-prob 0).
        temperature: the logits are divided by it.
    """
    weight = full_weight(head) if is_sharded(head.weight) else head.weight
    bias = getattr(head, "bias", None)
    operands = autocast_cast(h, weight) if bias is None else autocast_cast(h, weight, bias)
    return fused_linear_logprob(
        operands[0],
        operands[1],
        targets,
        bias=None if bias is None else operands[2],
        temperature=temperature,
    ).logprob
