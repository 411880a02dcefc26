"""TRL trainers whose distillation loss is lopd's top-M + tail KL (paper eq. 9-11).

TRL (>= 1.16, ``pip install "lopd[trl]"``) has no loss hook, so these are subclasses that
override the loss methods only; generation, batching, logging and DDP/FSDP/DeepSpeed wrapping
stay TRL's:

- :class:`LopdDistillationTrainer` (``trl.DistillationTrainer``): overrides ``compute_loss`` /
  ``_compute_loss``. The student and teacher backbones run as in TRL (the student inside
  ``_forward_redirection`` so DDP/FSDP hooks fire, the teacher under ``no_grad`` through its own
  redirection); their final hidden states and LM heads go to
  :func:`lopd_kernels.fused_linear_topk_tail_kl`, which never holds the ``[N, V]`` logits.
  FSDP2 heads (``DTensor``) are gathered once with ``.full_tensor()`` (one all-gather, whose
  backward reduce-scatters the head gradient), as TRL's own chunked loss does.
- :class:`LopdGKDTrainer` (``trl.experimental.gkd.GKDTrainer``): overrides
  ``generalized_jsd_loss`` on the logits TRL's ``compute_loss`` already materializes, with
  :func:`lopd_kernels.topk_tail_kl`.

Options mirrored from the TRL config: ``beta`` selects the divergence exactly as in TRL
(``1.0``: reverse KL(student || teacher), the paper's; ``0.0``: forward KL; in between TRL's
generalized JSD with mixture ``(1 - beta) P_student + beta P_teacher``, the kernels'
``divergence="jsd"``; docs/math.md, 1b), ``temperature`` is the loss temperature exactly where
TRL applies one, ``num_items_in_batch`` gives TRL's gradient-accumulation-correct reduction. New
fields: ``top_m`` (M top ids kept as buckets, the rest one tail bucket; ``None``: the
full-vocabulary divergence, numerically TRL's own loss at every ``beta``), ``lopd_support``
(whose top-M: ``"teacher"``, ``"student"`` or ``"union"``), ``lopd_backend`` and
``lopd_chunk_size`` (the kernels' ``backend`` / ``chunk_size``).

Example (the README's "Use the kernels in your trainer" runs this)::

    config = LopdDistillationConfig(output_dir="out", top_m=20, max_completion_length=64)
    trainer = LopdDistillationTrainer(
        model=student, teacher_model=teacher, args=config,
        train_dataset=prompts, processing_class=tokenizer,
    )
    trainer.train()
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import trl
from packaging.version import Version
from torch import Tensor

# The override points (DistillationTrainer._compute_loss / _get_last_hidden_state /
# _forward_redirection, GKDTrainer.generalized_jsd_loss) were read from TRL 1.16; in 1.8 the
# DistillationTrainer is still experimental and shaped differently.
MIN_TRL = "1.16"
if Version(trl.__version__) < Version(MIN_TRL):
    raise ImportError(f"lopd.integrations.trl needs trl>={MIN_TRL}, found {trl.__version__}")

from trl import DistillationConfig, DistillationTrainer  # noqa: E402
from trl.experimental.gkd import GKDConfig, GKDTrainer  # noqa: E402

import lopd_kernels as lk  # noqa: E402
from lopd_kernels.fused_linear_topk_tail_kl import BACKENDS as FUSED_LINEAR  # noqa: E402
from lopd_kernels.topk_tail_kl import BACKENDS as TOPK_TAIL_KL  # noqa: E402

__all__ = [
    "LopdDistillationConfig",
    "LopdDistillationTrainer",
    "LopdGKDConfig",
    "LopdGKDTrainer",
    "divergence_from_beta",
    "divergence_kwargs",
    "plain_head_tensor",
]

_IGNORE = -100
# The backend words of the op each trainer runs: the fused op (LopdDistillationTrainer) and the
# per-row op on logits (LopdGKDTrainer).
_FUSED_BACKENDS = ("auto", "torch", *FUSED_LINEAR.impls)
_LOGITS_BACKENDS = ("auto", "torch", *TOPK_TAIL_KL.impls)


def divergence_from_beta(beta: float) -> str:
    """Maps TRL's ``beta`` to the kernels' ``divergence``: 1 -> ``"reverse"``, 0 ->
    ``"forward"``, anything in between -> ``"jsd"`` (TRL's generalized JSD at that ``beta``).

    Raises:
        ValueError: ``beta`` outside [0, 1] (or not a number).
    """
    if (
        isinstance(beta, bool)
        or not isinstance(beta, (int, float))
        or not math.isfinite(beta)
        or not 0.0 <= beta <= 1.0
    ):
        raise ValueError(f"beta must be a number in [0, 1] (TRL's convention), got {beta!r}")
    if beta == 1.0:
        return "reverse"
    if beta == 0.0:
        return "forward"
    return "jsd"


def divergence_kwargs(beta: float) -> dict:
    """The kernels' ``divergence`` (and ``beta`` for the JSD) for TRL's ``beta``."""
    divergence = divergence_from_beta(beta)
    return (
        {"divergence": divergence, "beta": float(beta)}
        if divergence == "jsd"
        else {"divergence": divergence}
    )


def _check_lopd_fields(
    top_m: int | None,
    backend: str,
    chunk_size: int | None,
    support: str = "teacher",
    backends: tuple[str, ...] = _FUSED_BACKENDS,
) -> None:
    if top_m is not None and (isinstance(top_m, bool) or not isinstance(top_m, int) or top_m < 1):
        raise ValueError(f"top_m must be an int >= 1 or None (full vocabulary), got {top_m!r}")
    if support not in lk.SUPPORTS:
        raise ValueError(f"lopd_support must be one of {lk.SUPPORTS}, got {support!r}")
    if backend not in backends:
        raise ValueError(f"lopd_backend must be one of {backends}, got {backend!r}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"lopd_chunk_size must be an int >= 1 or None, got {chunk_size!r}")


def plain_head_tensor(tensor: Tensor | None, dtype: torch.dtype | None = None) -> Tensor | None:
    """An LM-head weight or bias as a plain tensor: a ``DTensor`` (FSDP2) is gathered once.

    ``full_tensor()`` is differentiable (its backward reduce-scatters into the sharded gradient),
    so the student's head still trains. ``dtype`` casts after the gather (under mixed precision the
    gathered weight is the float32 master copy).

    Args:
        tensor: ``[V, d]`` weight or ``[V]`` bias, plain or ``DTensor``; None passes through.
        dtype: target dtype, or None to keep it.
    """
    if tensor is None:
        return None
    if isinstance(tensor, torch.distributed.tensor.DTensor):
        tensor = tensor.full_tensor()
    return tensor if dtype is None else tensor.to(dtype)


def _logit_multiplier(config) -> float:
    """The constant some architectures multiply their logits by (1.0 for most, e.g. Qwen, Llama).

    Folded into the hidden states and bias before the kernel: ``c * (h W^T + b) = (c h) W^T + c b``.
    """
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        value = getattr(config, name, None)
        if value is not None:
            return float(value)
    scaling = getattr(config, "logits_scaling", None)
    if scaling is None:
        return 1.0
    # Granite / MiniCPM3 divide by logits_scaling; HyperCLOVA X multiplies by it.
    return float(scaling) if config.model_type == "hyperclovax" else 1.0 / float(scaling)


def _check_no_softcap(config, role: str) -> None:
    if getattr(config, "final_logit_softcapping", None) is not None:
        raise ValueError(
            f"the {role} model uses final_logit_softcapping (tanh-capped logits), which the lopd "
            "fused kernel does not apply; use TRL's own DistillationTrainer for this model"
        )


@dataclass
class LopdDistillationConfig(DistillationConfig):
    """``trl.DistillationConfig`` plus the top-M + tail options (see the module docstring).

    ``beta`` is TRL's: 1.0 (default) reverse KL, 0.0 forward KL, in between the generalized JSD.
    """

    top_m: int | None = field(
        default=20,
        metadata={"help": "Top ids kept as buckets (rest: one tail); None: full vocabulary."},
    )
    lopd_support: str = field(
        default="teacher",
        metadata={"help": "Whose top-M ids are buckets: teacher, student or union."},
    )
    lopd_backend: str = field(
        default="auto",
        metadata={"help": f"lopd_kernels backend: {', '.join(_FUSED_BACKENDS)}."},
    )
    lopd_chunk_size: int | None = field(
        default=None, metadata={"help": "Token rows per chunk of the fused op; None: from memory."}
    )

    def __post_init__(self):
        super().__post_init__()
        divergence_from_beta(self.beta)
        _check_lopd_fields(self.top_m, self.lopd_backend, self.lopd_chunk_size, self.lopd_support)


class LopdDistillationTrainer(DistillationTrainer):
    """``trl.DistillationTrainer`` with the loss of :func:`lopd_kernels.fused_linear_topk_tail_kl`
    (as :func:`lopd_kernels.fused_linear_topk_tail_kl_loss`).

    Takes a :class:`LopdDistillationConfig`. Logs ``teacher_topk_mass`` (mean teacher mass on the
    support's ids: how much of the teacher the buckets resolve, paper A.2) where TRL logs the
    student entropy, which the kernel does not compute. The divergence follows ``self.beta``
    (TRL's attribute) at every step.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, LopdDistillationConfig):
            raise TypeError(
                f"args must be a LopdDistillationConfig, got {type(self.args).__name__}"
            )

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # As TRL: the token count over the generated completions (not the dataloader's), divided
        # by the process count so the per-process loss compensates for DDP gradient averaging.
        if self.model.training and inputs.get("num_items_in_batch") is not None:
            num_items_in_batch = (
                inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            )
        unwrapped_student = self.accelerator.unwrap_model(model)
        # Through the wrapper's forward, so DDP's prepare_for_backward fires and FSDP keeps the
        # student's shards (head included) gathered for the fused projection.
        loss, mass_sum, num_valid = self._forward_redirection(
            model,
            unwrapped_student,
            self._compute_loss,
            unwrapped_student,
            inputs,
            num_items_in_batch,
        )
        # Metric collectives after the redirected forward returns, never inside it.
        mode = "train" if self.model.training else "eval"
        num_valid = self.accelerator.gather_for_metrics(num_valid).sum()
        mass_sum = self.accelerator.gather_for_metrics(mass_sum).sum()
        mass = (mass_sum / num_valid).item() if num_valid > 0 else 0.0
        self._metrics[mode]["teacher_topk_mass"].append(mass)
        return (loss, None) if return_outputs else loss

    def _compute_loss(self, unwrapped_student, inputs, num_items_in_batch):
        """Returns ``(loss, teacher top-M mass summed over valid tokens, valid token count)``."""
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        loss_mask = inputs["completion_mask"]
        if "tool_mask" in inputs:  # multi-turn: tool outputs are not the student's tokens
            loss_mask = loss_mask * inputs["tool_mask"]
        completion_ids = inputs["completion_ids"]
        n_keep = completion_ids.size(1)
        extra = {k: v for k, v in inputs.items() if k in _MULTIMODAL_KEYS}

        # [B, K, d]: position k predicts completion token k.
        h_student = self._get_last_hidden_state(
            unwrapped_student, input_ids, attention_mask, n_keep, **extra
        )
        self.teacher_model.eval()
        unwrapped_teacher = self.accelerator.unwrap_model(self.teacher_model)
        with torch.no_grad():
            h_teacher = self._forward_redirection(
                self.teacher_model, unwrapped_teacher, self._get_last_hidden_state,
                unwrapped_teacher, input_ids, attention_mask, n_keep, **extra,
            )  # fmt: skip

        head_s = unwrapped_student.get_output_embeddings()
        head_t = unwrapped_teacher.get_output_embeddings()
        cfg_s = unwrapped_student.config.get_text_config()
        cfg_t = unwrapped_teacher.config.get_text_config()
        _check_no_softcap(cfg_s, "student")
        _check_no_softcap(cfg_t, "teacher")
        device = head_s.weight.device
        h_student, h_teacher = h_student.to(device), h_teacher.to(device)
        w_s = plain_head_tensor(head_s.weight, h_student.dtype)
        b_s = plain_head_tensor(head_s.bias, h_student.dtype)
        # The teacher gets no gradient: detached, so the kernel skips its weight gradient.
        w_t = plain_head_tensor(head_t.weight, h_teacher.dtype).detach().to(device)
        b_t = plain_head_tensor(head_t.bias, h_teacher.dtype)
        b_t = None if b_t is None else b_t.detach().to(device)
        c_s, c_t = _logit_multiplier(cfg_s), _logit_multiplier(cfg_t)
        if c_s != 1.0:
            h_student, b_s = h_student * c_s, None if b_s is None else b_s * c_s
        if c_t != 1.0:
            h_teacher, b_t = h_teacher * c_t, None if b_t is None else b_t * c_t

        target = completion_ids.to(device).masked_fill(loss_mask.to(device) == 0, _IGNORE)
        num_valid = (target != _IGNORE).sum()
        # TRL's reduction is a fixed weight per token: the kernel forms the gradients in its
        # forward (fused_linear_topk_tail_kl_loss), no logit recompute in the backward.
        kl_weight = _reduce_sum(torch.ones((), device=device), num_valid, num_items_in_batch)
        res = lk.fused_linear_topk_tail_kl_loss(
            h_student.reshape(-1, h_student.size(-1)), w_s,
            h_teacher.reshape(-1, h_teacher.size(-1)), w_t,
            target.reshape(-1), kl_weight=kl_weight.detach(),
            student_bias=b_s, teacher_bias=b_t, top_m=self.args.top_m,
            temperature=self.temperature, support=self.args.lopd_support, ignore_index=_IGNORE,
            backend=self.args.lopd_backend, chunk_size=self.args.lopd_chunk_size,
            **divergence_kwargs(self.beta),
        )  # fmt: skip
        return res.loss, res.output.teacher_topk_mass.sum(), num_valid


# The multimodal fields TRL's DistillationTrainer forwards to the backbone (VLM students).
_MULTIMODAL_KEYS = (
    "pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "image_sizes",
    "token_type_ids", "mm_token_type_ids", "image_position_ids",
)  # fmt: skip


def _reduce_sum(total: Tensor, num_valid: Tensor, num_items_in_batch) -> Tensor:
    """TRL's reduction: ``sum / num_items_in_batch`` when given, else the mean over valid tokens
    (0, never NaN, when none is valid)."""
    if num_items_in_batch is None:
        return total / num_valid.clamp(min=1)
    if isinstance(num_items_in_batch, Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


@dataclass
class LopdGKDConfig(GKDConfig):
    """``trl.experimental.gkd.GKDConfig`` plus ``top_m`` / ``lopd_support`` / ``lopd_backend``.

    ``beta`` is TRL's GKD one, default 0.5 (the JSD): 1.0 reverse KL, 0.0 forward KL, in between
    the generalized JSD, all on the top-M + tail buckets (``top_m=None``: TRL's own loss).
    """

    top_m: int | None = field(
        default=20, metadata={"help": "Top ids kept as buckets; None: full vocabulary."}
    )
    lopd_support: str = field(
        default="teacher",
        metadata={"help": "Whose top-M ids are buckets: teacher, student or union."},
    )
    lopd_backend: str = field(
        default="auto",
        metadata={"help": f"lopd_kernels backend: {', '.join(_LOGITS_BACKENDS)}."},
    )

    def __post_init__(self):
        super().__post_init__()
        divergence_from_beta(self.beta)
        _check_lopd_fields(self.top_m, self.lopd_backend, None, self.lopd_support,
                           _LOGITS_BACKENDS)  # fmt: skip


class LopdGKDTrainer(GKDTrainer):
    """``trl.experimental.gkd.GKDTrainer`` with the loss of :func:`lopd_kernels.topk_tail_kl`.

    TRL's ``compute_loss`` (student and teacher logits, causal shift, ``labels`` with -100) is
    kept; it calls :meth:`generalized_jsd_loss`, overridden here. Takes a :class:`LopdGKDConfig`.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, LopdGKDConfig):
            raise TypeError(f"args must be a LopdGKDConfig, got {type(self.args).__name__}")

    def generalized_jsd_loss(
        self,
        student_logits: Tensor,
        teacher_logits: Tensor,
        labels: Tensor | None = None,
        beta: float = 0.5,
        temperature: float = 1.0,
        reduction: str = "batchmean",
        num_items_in_batch=None,
    ) -> Tensor:
        """Top-M + tail divergence with TRL's ``generalized_jsd_loss`` arguments and reductions.

        Args:
            student_logits, teacher_logits: ``[B, L, V]``.
            labels: ``[B, L]`` token ids, -100 at positions without loss; None: every position.
            beta: TRL's (default 0.5, TRL's GKD's): 1.0 reverse KL, 0.0 forward KL, in between
                the generalized JSD (:func:`divergence_from_beta`).
            temperature: loss temperature (TRL's GKD ``compute_loss`` passes none: 1.0).
            reduction: ``"batchmean"`` (mean over valid tokens), ``"sum"``, ``"mean"`` (same as
                batchmean here: one value per token) or ``"none"`` (``[n_valid]`` per token;
                TRL's is per vocabulary entry).
            num_items_in_batch: when given, ``sum / num_items_in_batch`` (overrides reduction).

        Returns:
            A scalar, or ``[n_valid]`` for ``reduction="none"``.
        """
        if labels is None:
            # Any valid id: the target only feeds the sampled-token log-probs, not the KL.
            labels = torch.zeros(student_logits.shape[:-1], dtype=torch.long)
            labels = labels.to(student_logits.device)
        out = lk.topk_tail_kl(
            student_logits, teacher_logits, labels, top_m=self.args.top_m,
            temperature=temperature, support=self.args.lopd_support, ignore_index=_IGNORE,
            backend=self.args.lopd_backend, **divergence_kwargs(beta),
        )  # fmt: skip
        valid = labels != _IGNORE
        if num_items_in_batch is not None:
            return _reduce_sum(out.kl.sum(), valid.sum(), num_items_in_batch)
        if reduction in ("batchmean", "mean"):
            return _reduce_sum(out.kl.sum(), valid.sum(), None)
        if reduction == "sum":
            return out.kl.sum()
        if reduction == "none":
            return out.kl[valid]
        raise ValueError(f"reduction must be batchmean, mean, sum or none, got {reduction!r}")
