"""verl plugin: the top-M + tail distillation loss for verl's server-side-teacher distillation.

Installed as the ``verl.plugins`` entry point ``lopd`` (``pip install "lopd[verl]"``), so
``import verl`` imports this module, which registers two distillation loss modes:

- ``lopd_topk_tail``: reverse KL(student || teacher) over the teacher's top-M buckets plus one
  tail bucket (the paper's, eq. 9-11);
- ``lopd_topk_tail_forward``: the same buckets, forward KL(teacher || student).

Select one with ``distillation.distillation_loss.loss_mode=lopd_topk_tail`` and
``distillation.distillation_loss.topk=M`` (the number of log-probs the teacher server returns).
Unlike verl's ``forward_kl_topk`` (forward KL over the top-k only, renormalization ignored, then
clamped at 0), the tail bucket makes this a true divergence between two distributions: it is >= 0
without clamping and 0 only when the student matches the teacher on every bucket.

How it hooks in (verl 0.9.1): a ``use_topk`` loss is computed in two stages. The actor's logits
processor calls ``verl.trainer.distillation.losses.compute_topk_loss`` with the student logits
and the nested ``teacher_logprobs`` / ``teacher_ids``; verl hard-wires that function to its own
forward-KL kernel for every loss mode, so this module wraps it: for the two modes above it
computes :func:`lopd.integrations.teacher_topk.topk_tail_kl_from_teacher_topk` instead, for any
other mode it calls verl's. The registered loss function then turns the per-token values into
verl's padded ``[bsz, response_len]`` losses and metrics (verl aggregates them with its
``loss_agg_mode``). Supported strategies: ``fsdp``, ``fsdp2``, ``veomni`` (whole-vocabulary
student logits) and ``megatron``: there verl hands the logits processor this tensor-parallel
rank's shard of the vocabulary-parallel logits, and the loss runs
:func:`lopd_kernels.vocab_parallel.sparse_teacher_topk_tail_kl` over Megatron-core's
tensor-parallel group (the teacher's top-M split over context-parallel ranks by verl's own
``preprocess_thd_engine`` / ``preprocess_bshd_engine``, as its ``forward_kl_topk`` does).
verl's ``log_prob_min_clamp`` is not applied (the tail bucket needs none); ``loss_max_clamp`` is,
by verl, as for every loss.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from lopd.integrations.teacher_topk import topk_tail_kl_from_teacher_topk

# What a user without (the right) verl is told; the verl this plugin was written on is 0.9.1.
VERL_INSTALL_HINT = (
    "pip install 'lopd[verl]' (verl 0.9.1 pins transformers < 5.11: install it in an "
    "environment of its own)"
)

try:  # optional dependency: the [verl] extra
    from verl.trainer.distillation import losses as verl_losses
    from verl.utils.metric import AggregationType, Metric
    from verl.utils.ulysses import get_ulysses_sequence_parallel_world_size, slice_input_tensor
    from verl.workers.utils.padding import no_padding_2_padding
except ModuleNotFoundError as err:
    if not (err.name or "").startswith("verl"):
        raise  # a dependency of verl is missing: its own error says which
    if importlib.util.find_spec("verl") is None:
        raise ImportError(
            f"lopd.integrations.verl needs verl, which is not installed: {VERL_INSTALL_HINT}",
            name="verl",
        ) from None
    raise ImportError(
        f"lopd.integrations.verl needs verl >= 0.9.1 (the installed verl has no {err.name}): "
        f"{VERL_INSTALL_HINT}",
        name="verl",
    ) from err

__all__ = [
    "LOSS_MODES",
    "VERL_INSTALL_HINT",
    "compute_lopd_topk_tail",
    "compute_lopd_topk_tail_megatron",
    "lopd_topk_tail_loss",
]

# loss_mode -> divergence of the top-M + tail buckets.
LOSS_MODES = {"lopd_topk_tail": "reverse", "lopd_topk_tail_forward": "forward"}
_STRATEGIES = ("fsdp", "fsdp2", "veomni", "megatron")


def _outputs(out) -> dict[str, torch.Tensor]:
    """verl's keys of the logits-processor outputs (and ``lopd_invalid``)."""
    return {
        "distillation_losses": out.kl,
        "student_mass": out.student_mass,
        "teacher_mass": out.teacher_mass,
        "lopd_invalid": out.invalid.float(),
    }


def compute_lopd_topk_tail(
    student_logits: torch.Tensor,
    teacher_topk_log_probs: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    divergence: str,
) -> dict[str, torch.Tensor]:
    """The logits-processor stage: per-token top-M + tail KL for verl's packed micro-batch.

    Args:
        student_logits: ``(1, total_nnz / sp_size, V)`` temperature-scaled student logits.
        teacher_topk_log_probs: nested ``(bsz, seqlen_i, M)`` teacher top-M log-probs.
        teacher_topk_ids: nested ``(bsz, seqlen_i, M)`` their ids.
        divergence: ``"reverse"`` or ``"forward"``.

    Returns:
        ``(1, total_nnz / sp_size)`` tensors: ``distillation_losses``, ``student_mass``,
        ``teacher_mass`` (verl's keys) and ``lopd_invalid`` (1.0 at rows whose teacher top-M was
        inconsistent, e.g. padding; their loss and gradient are 0).
    """
    if not (teacher_topk_log_probs.is_nested and teacher_topk_ids.is_nested):
        raise ValueError("teacher_logprobs and teacher_ids must be nested (jagged) tensors")
    log_probs = teacher_topk_log_probs.values().unsqueeze(0)  # (1, total_nnz, M)
    ids = teacher_topk_ids.values().unsqueeze(0)
    if get_ulysses_sequence_parallel_world_size() > 1:  # this rank's sequence slice, as verl's
        log_probs = slice_input_tensor(log_probs, dim=1)
        ids = slice_input_tensor(ids, dim=1)
    out = topk_tail_kl_from_teacher_topk(
        student_logits, log_probs, ids, divergence=divergence, on_invalid="ignore"
    )
    return _outputs(out)


def compute_lopd_topk_tail_megatron(
    student_logits: torch.Tensor,
    teacher_topk_log_probs: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    divergence: str,
    data_format: str,
) -> dict[str, torch.Tensor]:
    """The logits-processor stage of verl's Megatron actor: vocabulary-parallel logits.

    Args:
        student_logits: ``(bsz, seqlen / cp_size, V / tp_size)`` this rank's shard of the
            temperature-scaled vocabulary-parallel student logits (``bsz`` 1 for ``"thd"``).
        teacher_topk_log_probs, teacher_topk_ids: nested ``(bsz, seqlen_i, M)``, global ids.
        divergence: ``"reverse"`` or ``"forward"``.
        data_format: ``"thd"`` (packed) or ``"bshd"``, as verl's Megatron engine passes it.

    Returns:
        ``(bsz, seqlen / cp_size)`` tensors under the keys of :func:`compute_lopd_topk_tail`,
        the same on every tensor-parallel rank.
    """
    if not (teacher_topk_log_probs.is_nested and teacher_topk_ids.is_nested):
        raise ValueError("teacher_logprobs and teacher_ids must be nested (jagged) tensors")
    # Optional dependencies (verl's Megatron extras: megatron-core): only this strategy needs them.
    from megatron.core import parallel_state
    from verl.models.mcore.util import preprocess_bshd_engine, preprocess_thd_engine

    # This context-parallel rank's rows, padded as the student's (verl's own split).
    split = preprocess_thd_engine if data_format == "thd" else preprocess_bshd_engine
    log_probs, *_ = split(teacher_topk_log_probs, pre_process=True)
    ids, *_ = split(teacher_topk_ids, pre_process=True)
    # The engine then takes the policy's log-probs from the same tensor with Megatron-core's
    # vocab_parallel_cross_entropy, which overwrites float32 logits in place (lower precisions
    # it upcasts into a new tensor): the loss's backward reads a copy of float32 logits.
    logits = student_logits.clone() if student_logits.dtype == torch.float32 else student_logits
    out = topk_tail_kl_from_teacher_topk(
        logits, log_probs, ids, divergence=divergence, on_invalid="ignore",
        tensor_parallel_group=parallel_state.get_tensor_model_parallel_group(),
    )  # fmt: skip
    return _outputs(out)


_verl_compute_topk_loss = verl_losses.compute_topk_loss


def _compute_topk_loss(config, distillation_config, data, student_logits, data_format):
    """Drop-in for verl's ``compute_topk_loss``: ours for :data:`LOSS_MODES`, verl's otherwise."""
    divergence = LOSS_MODES.get(distillation_config.distillation_loss.loss_mode)
    if divergence is None:
        return _verl_compute_topk_loss(
            config, distillation_config, data, student_logits, data_format
        )
    if config.strategy not in _STRATEGIES:
        raise NotImplementedError(
            f"loss_mode={distillation_config.distillation_loss.loss_mode!r} supports actor "
            f"strategies {_STRATEGIES}, got {config.strategy!r}"
        )
    if config.strategy == "megatron":
        return compute_lopd_topk_tail_megatron(
            student_logits, data["teacher_logprobs"], data["teacher_ids"], divergence, data_format
        )
    return compute_lopd_topk_tail(
        student_logits, data["teacher_logprobs"], data["teacher_ids"], divergence
    )


def lopd_topk_tail_loss(config, distillation_config, model_output: dict, data) -> tuple:
    """The registered loss: padded ``(bsz, response_len)`` per-token losses and metrics.

    Args:
        config: verl ``ActorConfig`` (unused; part of verl's loss signature).
        distillation_config: verl ``DistillationConfig`` (unused; idem).
        model_output: the logits-processor outputs of :func:`compute_lopd_topk_tail`, nested.
        data: the micro-batch ``TensorDict`` (``response_mask`` and the padding layout).

    Returns:
        ``(distillation_losses [bsz, response_len], metrics)``.
    """
    del config, distillation_config
    losses = no_padding_2_padding(model_output["distillation_losses"], data)
    student_mass = no_padding_2_padding(model_output["student_mass"], data)
    teacher_mass = no_padding_2_padding(model_output["teacher_mass"], data)
    invalid = no_padding_2_padding(model_output["lopd_invalid"], data)
    mask = data["response_mask"]
    mask = (mask.to_padded_tensor(False) if mask.is_nested else mask).bool()
    if not mask.any():
        return losses, {}
    metrics: dict[str, Any] = {
        "distillation/student_mass": student_mass[mask].mean().item(),
        "distillation/teacher_mass": teacher_mass[mask].mean().item(),
        "distillation/teacher_mass_min": Metric(AggregationType.MIN, teacher_mass[mask].min()),
        # Response tokens whose teacher top-M was inconsistent (they train nothing): should be 0.
        "distillation/lopd_invalid_fraction": invalid[mask].mean().item(),
    }
    return losses, metrics


def _register() -> None:
    if "lopd_topk_tail" in verl_losses.DISTILLATION_LOSS_REGISTRY:
        return  # already registered (the entry point and an explicit import both ran)
    settings = verl_losses.DistillationLossSettings(names=list(LOSS_MODES), use_topk=True)
    verl_losses.register_distillation_loss(settings)(lopd_topk_tail_loss)
    verl_losses.compute_topk_loss = _compute_topk_loss


_register()
