"""Hugging Face helpers: distillation outputs from causal LMs' hidden states and LM heads.

One way from a model to the kernels, used by users and by the ``lopd`` trainer alike:

* :func:`decoder_of` -- the transformer body of a ``*ForCausalLM`` (final hidden states, no
  ``[L, V]`` logits);
* :func:`lm_head_topk_tail_kl` -- hidden states + LM heads (modules or weights) of student and
  teacher -> the op's outputs, on packed action rows ``[N, d]`` or on batched ``[B, L, d]``
  states with an action mask; fused with the heads (:func:`~lopd_kernels.fused_linear_topk_tail_kl`,
  no ``[N, V]`` logits) or materialized (``head(h)`` then :func:`~lopd_kernels.topk_tail_kl`);
* :func:`causal_lm_topk_tail_kl` -- two causal LMs and a batch of trajectories.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from lopd_kernels.fused_linear_topk_tail_kl import fused_linear_topk_tail_kl
from lopd_kernels.topk_tail_kl import TopKTailKLOutput, topk_tail_kl

__all__ = ["causal_lm_topk_tail_kl", "decoder_of", "lm_head_topk_tail_kl"]


def decoder_of(model: nn.Module) -> nn.Module:
    """The transformer body of a ``*ForCausalLM`` (returns hidden states, no ``[L, V]`` logits).

    ``model.get_decoder()`` where the model has one (peft-wrapped models forward it), else
    ``model.model``.

    Raises:
        TypeError: the model exposes neither.
    """
    getter = getattr(model, "get_decoder", None)
    decoder = getter() if callable(getter) else None
    if decoder is None:
        decoder = getattr(model, "model", None)
    if decoder is None:
        raise TypeError(f"{type(model).__name__} exposes no decoder (get_decoder() or .model)")
    return decoder


#: An LM head: an ``nn.Linear``-like module, its ``[V, d]`` weight, or a ``(weight, bias)`` pair
#: (e.g. a sharded head's gathered weight and its bias).
Head = nn.Module | Tensor | tuple[Tensor, Tensor | None]


def _head_params(head: Head, name: str) -> tuple[Tensor, Tensor | None]:
    """``(weight [V, d], bias [V] | None)`` of an LM head (any form of :data:`Head`)."""
    if isinstance(head, Tensor):
        return head, None
    if isinstance(head, tuple) and len(head) == 2 and isinstance(head[0], Tensor):
        return head[0], head[1]
    weight = getattr(head, "weight", None)
    if not isinstance(weight, Tensor):
        raise TypeError(
            f"{name} must be an nn.Linear-like module, a [V, d] weight or a (weight, bias) pair"
        )
    return weight, getattr(head, "bias", None)


def _logits(hidden: Tensor, head: Head, name: str) -> Tensor:
    """``[N, V]`` logits: a module is called (hooks included), a weight / pair is applied."""
    if isinstance(head, nn.Module):
        return head(hidden)
    weight, bias = _head_params(head, name)
    return nn.functional.linear(hidden, weight, bias)


def _scatter_rows(values: Tensor, flat_rows: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Put packed per-row values back at their (flattened) positions; zeros elsewhere."""
    full = values.new_zeros((math.prod(shape), *values.shape[1:]))
    return full.index_put((flat_rows,), values).reshape(*shape, *values.shape[1:])


def _packed(
    student_hidden: Tensor,
    student_head: Head,
    teacher_hidden: Tensor,
    teacher_head: Head,
    target_ids: Tensor,
    fused: bool,
    kwargs: dict,
) -> TopKTailKLOutput:
    """The op on packed rows ``[N, d]``: fused with the heads, or on materialized logits."""
    ws, bs = _head_params(student_head, "student_head")
    wt, bt = _head_params(teacher_head, "teacher_head")
    if fused:
        return fused_linear_topk_tail_kl(
            student_hidden, ws, teacher_hidden, wt, target_ids,
            student_bias=bs, teacher_bias=bt, **kwargs,
        )  # fmt: skip
    if "chunk_size" in kwargs:
        raise ValueError("chunk_size is an option of the fused path (fused=True)")
    s = _logits(student_hidden, student_head, "student_head")
    t = _logits(teacher_hidden, teacher_head, "teacher_head")
    return topk_tail_kl(s, t, target_ids, **kwargs)


def lm_head_topk_tail_kl(
    student_hidden: Tensor,
    student_head: Head,
    teacher_hidden: Tensor,
    teacher_head: Head,
    target_ids: Tensor,
    action_mask: Tensor | None = None,
    *,
    teacher_action_mask: Tensor | None = None,
    fused: bool = True,
    **kwargs,
) -> TopKTailKLOutput:
    """Distillation outputs of the action rows from final hidden states and LM heads.

    Two layouts:

    * packed (``action_mask=None``): ``student_hidden [N, d_s]``, ``teacher_hidden [N, d_t]`` and
      ``target_ids [N]`` are already the action rows (what the ``lopd`` trainer gathers);
      outputs are ``[N]`` (``topk_ids`` ``[N, M]``);
    * batched: ``[B, L, d]`` hidden states with an ``action_mask [B, L]``; only the masked rows
      are packed and sent to the op (nothing else is multiplied by the LM head), and the outputs
      come back laid out like ``action_mask`` (zero off the mask). The teacher's sequences may be
      longer (privileged context, latent slots): ``teacher_action_mask`` marks its rows for the
      same actions, in the same order.

    Args:
        student_hidden: the student's final hidden states (after the final norm), ``[N, d_s]``
            or ``[B, L, d_s]``.
        student_head: the student's LM head (``nn.Linear``, e.g. ``get_output_embeddings()``),
            its ``[V, d_s]`` weight, or a ``(weight, bias)`` pair.
        teacher_hidden: the teacher's final hidden states, ``[N, d_t]`` or ``[B, L_t, d_t]``.
        teacher_head: the teacher's LM head, weight or pair (may be the student's: a shared head).
        target_ids: ``[N]`` or ``[B, L]`` the token each student position predicts (shifted).
        action_mask: ``[B, L]`` bool, the student positions to distill; ``None`` for packed rows.
        teacher_action_mask: ``[B, L_t]`` bool with, per sequence, as many True entries as
            ``action_mask``; defaults to ``action_mask`` (needs ``L_t == L``).
        fused: ``True``: :func:`~lopd_kernels.fused_linear_topk_tail_kl` (no ``[N, V]``
            logits); ``False``: the heads' logits, then :func:`~lopd_kernels.topk_tail_kl`.
        **kwargs: ``top_m``, ``temperature``, ``divergence``, ``ignore_index``, ``backend``
            (and, fused, ``chunk_size``), as in those functions.

    Returns:
        :class:`~lopd_kernels.TopKTailKLOutput` in the layout of the inputs (above).
    """
    if action_mask is None:
        if teacher_action_mask is not None:
            raise ValueError("teacher_action_mask needs action_mask (packed rows take neither)")
        for name, x in (("student_hidden", student_hidden), ("teacher_hidden", teacher_hidden)):
            if not isinstance(x, Tensor) or x.dim() != 2:
                raise ValueError(f"{name} must be packed [N, d] rows when action_mask is None")
        return _packed(
            student_hidden, student_head, teacher_hidden, teacher_head, target_ids, fused, kwargs
        )
    if teacher_action_mask is None:
        teacher_action_mask = action_mask
    masks = {"action_mask": action_mask, "teacher_action_mask": teacher_action_mask}
    for name, mask in masks.items():
        if not isinstance(mask, Tensor) or mask.dim() != 2:
            raise ValueError(f"{name} must be a 2-D [B, L] tensor")
    if student_hidden.dim() != 3 or student_hidden.shape[:2] != action_mask.shape:
        raise ValueError(
            f"student_hidden must be [B, L, d] with [B, L] = action_mask's "
            f"{tuple(action_mask.shape)}, got {tuple(student_hidden.shape)}"
        )
    if teacher_hidden.dim() != 3 or teacher_hidden.shape[:2] != teacher_action_mask.shape:
        raise ValueError(
            f"teacher_hidden must be [B, L_t, d] with [B, L_t] = teacher_action_mask's "
            f"{tuple(teacher_action_mask.shape)}, got {tuple(teacher_hidden.shape)}"
        )
    if target_ids.shape != action_mask.shape:
        raise ValueError(
            f"target_ids must have action_mask's shape {tuple(action_mask.shape)}, "
            f"got {tuple(target_ids.shape)}"
        )
    action_mask, teacher_action_mask = action_mask.bool(), teacher_action_mask.bool()
    if not torch.equal(action_mask.sum(1), teacher_action_mask.sum(1)):
        raise ValueError(
            "teacher_action_mask must mark as many rows per sequence as action_mask, got "
            f"{teacher_action_mask.sum(1).tolist()} vs {action_mask.sum(1).tolist()}"
        )
    rows = action_mask.flatten().nonzero().squeeze(-1)
    t_rows = teacher_action_mask.flatten().nonzero().squeeze(-1)
    out = _packed(
        student_hidden.flatten(0, 1).index_select(0, rows),
        student_head,
        teacher_hidden.flatten(0, 1).index_select(0, t_rows),
        teacher_head,
        target_ids.flatten().index_select(0, rows),
        fused,
        kwargs,
    )
    shape = tuple(action_mask.shape)
    return TopKTailKLOutput(*(_scatter_rows(x, rows, shape) for x in out))


def causal_lm_topk_tail_kl(
    student: nn.Module,
    teacher: nn.Module,
    input_ids: Tensor,
    action_mask: Tensor,
    *,
    attention_mask: Tensor | None = None,
    teacher_inputs: dict | None = None,
    teacher_action_mask: Tensor | None = None,
    **kwargs,
) -> TopKTailKLOutput:
    """Distillation outputs of two HF causal LMs on a batch of trajectories, logits never formed.

    Runs each model's decoder (:func:`decoder_of`) for its final hidden states and feeds them
    with its ``get_output_embeddings()`` head to :func:`lm_head_topk_tail_kl`. Position ``j`` of
    the result belongs to token ``j`` (predicted from position ``j - 1``).

    Args:
        student, teacher: ``transformers`` causal LMs (peft-wrapped ones too); may be the same
            model (self-distillation: pass the privileged context in ``teacher_inputs``).
        input_ids: ``[B, L]`` the student's trajectories.
        action_mask: ``[B, L]`` bool, True on the tokens the student generated (the ones to
            distill).
        attention_mask: ``[B, L]`` the student's attention mask.
        teacher_inputs: keyword arguments of the teacher's decoder (``input_ids`` or
            ``inputs_embeds``, ``attention_mask``, ...); default: the student's inputs.
        teacher_action_mask: ``[B, L_t]`` True on the same action tokens in the teacher's
            sequence; default ``action_mask`` (teacher sequence aligned with the student's).
        **kwargs: as :func:`lm_head_topk_tail_kl` (``top_m``, ``temperature``, ``fused``, ...).

    Returns:
        :class:`~lopd_kernels.TopKTailKLOutput` with ``[B, L]`` tensors (``[B, L, M]`` ids),
        zero off the action tokens.
    """
    student_inputs = {"input_ids": input_ids}
    if attention_mask is not None:
        student_inputs["attention_mask"] = attention_mask
    if teacher_inputs is None:
        teacher_inputs = student_inputs
    if teacher_action_mask is None:
        teacher_action_mask = action_mask
    hs = decoder_of(student)(**student_inputs, use_cache=False).last_hidden_state
    ht = decoder_of(teacher)(**teacher_inputs, use_cache=False).last_hidden_state
    # Hidden state i predicts token i + 1: drop the last position and the first mask column.
    out = lm_head_topk_tail_kl(
        hs[:, :-1],
        student.get_output_embeddings(),
        ht[:, :-1],
        teacher.get_output_embeddings(),
        input_ids[:, 1:],
        action_mask[:, 1:].bool(),
        teacher_action_mask=teacher_action_mask[:, 1:].bool(),
        **kwargs,
    )
    pad = [torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (1, 0)) for x in out]
    return TopKTailKLOutput(*pad)
