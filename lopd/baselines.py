"""Baselines and ablations of LOPD, registered in :data:`lopd.trainer.METHODS`.

Every method runs inside the same :class:`~lopd.trainer.Trainer`: the same student, rollout
engine, optimizer, rollout-budget accounting (every generated rollout counts, bank included) and
held-out evaluation. They differ only in how a step's rollouts are drawn and in the loss
(paper B.1). ``lopd.method`` selects one:

==============  ==========================================================================
``lopd``        LOPD (:class:`~lopd.trainer.LOPDMethod`).
``grpo``        G = 4 rollouts per task, group-normalized advantages, PPO-clip 0.2, token-level
                loss on the action tokens. No teacher.
``opsd``        Teacher = the frozen base model with one retrieved successful trajectory as text
                appended to its system message (B.1 wording); forward KL over the full
                vocabulary.
``sdpo``        Teacher = an EMA shadow of the student (rate 0.05) with a successful sibling of
                the same rollout group (G = 4) as text; reverse KL over the teacher's top-M plus a
                tail bucket. Trajectories without a successful sibling get no loss.
``lopd-frozen`` LOPD with the composer fixed at phi_0 (the teacher's latents are the cached
                ``c_phi0``; no composer gradient).
``lopd-m0``     LOPD with margin m = 0 (``lopd.margin`` is ignored).
==============  ==========================================================================

"Vanilla" is no training: the trainer's ``eval_vanilla.json``.

Rollouts per step. ``lopd.tasks_per_step`` is the per-step rollout budget of every method. The
group methods draw ``max(1, tasks_per_step // G)`` distinct tasks and roll each out G times, so
at ``tasks_per_step`` divisible by G they generate exactly as many rollouts per step as LOPD.

Text privileged context. The teacher prompt is the student's rendered prompt with text inserted
into one message; the student's tokens after its prompt are appended unchanged, so student
position ``p >= prompt_len`` is teacher position ``p + offset`` with one constant offset: the same
exact student-to-teacher map of action tokens as the latent injection
(:mod:`lopd.injection`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from lopd.composer import decoder_of
from lopd.injection import pad_batch
from lopd.loss import segment_mean
from lopd.trainer import (
    ActionRows,
    LOPDMethod,
    Method,
    Trainer,
    _lm_head,
    _mix_seed,
    distill_metric_sums,
    distill_rows,
    register_method,
    student_action_hidden,
)
from lopd.types import Task, Trajectory

__all__ = [
    "OPSD_SYSTEM_TEMPLATE",
    "SDPO_USER_TEMPLATE",
    "GRPOMethod",
    "LOPDFrozenComposerMethod",
    "LOPDNoMarginMethod",
    "OPSDMethod",
    "SDPOMethod",
    "TextTeacherSequence",
    "build_text_teacher_sequence",
    "ema_update_",
    "group_advantages",
    "group_rollouts",
    "ppo_clip_loss",
    "text_teacher_hidden",
]

# Paper B.1, verbatim: appended to the teacher's system message for OPSD.
OPSD_SYSTEM_TEMPLATE = (
    "\n\nThe following is a reference plan for the upcoming task. Use it only as guidance for "
    "your own reasoning; you must still interact with the environment to complete the task."
    "\n\n{gt_text}\n\n"
    "After reading the reference solution above, make sure you truly understand the reasoning "
    "behind each step. Now, using your own words and independent reasoning, derive the same "
    "final answer."
)

# SDPO's re-prompt layout (the paper gives no B.1 text for SDPO): the successful sibling is
# shown as a correct solution after the original task, then the task is asked again.
SDPO_USER_TEMPLATE = (
    "\n\nCorrect solution:\n\n{solution}\n\nCorrectly solve the original task yourself."
)


# ------------------------------------------------------------------------------ pure pieces
def group_advantages(
    rewards: torch.Tensor, groups: torch.Tensor, eps: float = 1e-4
) -> torch.Tensor:
    """GRPO's group-normalized advantages ``(r_i - mean_g) / (std_g + eps)``.

    ``std_g`` is the unbiased sample standard deviation of the group (as in DeepSeekMath's GRPO
    and TRL). A group whose rewards are all equal, or that has a single member, gets advantage 0:
    it carries no preference between its members.

    Args:
        rewards: ``[B]`` float rewards.
        groups: ``[B]`` int64 group id of each rollout (ids need not be contiguous).
        eps: added to the standard deviation.

    Returns:
        ``[B]`` advantages, dtype of ``rewards`` (at least float32).
    """
    if rewards.dim() != 1 or rewards.shape != groups.shape:
        raise ValueError(
            f"rewards and groups must be [B] of the same shape, got {tuple(rewards.shape)} and "
            f"{tuple(groups.shape)}"
        )
    r = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    _, inverse = torch.unique(groups, return_inverse=True)
    g = int(inverse.max()) + 1 if inverse.numel() else 0
    count = torch.zeros(g, dtype=r.dtype, device=r.device).index_add(0, inverse, torch.ones_like(r))
    mean = torch.zeros(g, dtype=r.dtype, device=r.device).index_add(0, inverse, r) / count
    centered = r - mean[inverse]
    sq = torch.zeros(g, dtype=r.dtype, device=r.device).index_add(0, inverse, centered**2)
    std = torch.sqrt(sq / (count - 1).clamp_min(1))
    adv = centered / (std[inverse] + eps)
    # A singleton group has centered == 0 already; equal rewards give 0 / eps == 0 as well.
    return adv


def ppo_clip_loss(
    logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, clip_eps: float = 0.2
) -> torch.Tensor:
    """Per-token PPO-clip loss ``-min(rho A, clip(rho, 1 - eps, 1 + eps) A)``, ``rho = exp(logp -
    logp_old)``.

    With one optimizer update per batch of rollouts ``logp_old`` equals ``logp`` (detached), so
    ``rho = 1`` and the gradient is the policy gradient ``-A grad logp``; the clip only binds
    when several updates reuse the same rollouts.

    Args:
        logp: ``[N]`` log-probabilities of the sampled tokens under the current policy.
        logp_old: ``[N]`` the same under the sampling policy (no gradient is taken).
        advantages: ``[N]`` advantage of each token (its trajectory's).
        clip_eps: epsilon (``eps_lo = eps_hi``).

    Returns:
        ``[N]`` losses to average.
    """
    if not (logp.shape == logp_old.shape == advantages.shape):
        raise ValueError(
            "logp, logp_old and advantages must have the same shape, got "
            f"{tuple(logp.shape)}, {tuple(logp_old.shape)} and {tuple(advantages.shape)}"
        )
    if clip_eps <= 0:
        raise ValueError(f"clip_eps must be > 0, got {clip_eps}")
    ratio = torch.exp(logp - logp_old.detach())
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
    return -torch.minimum(unclipped, clipped)


@torch.no_grad()
def ema_update_(teacher: nn.Module, student: nn.Module, rate: float) -> None:
    """In place ``theta_T <- (1 - rate) theta_T + rate theta_S`` over matching parameters.

    Args:
        teacher: the EMA shadow (same architecture as ``student``).
        student: the trained model.
        rate: update rate in ``[0, 1]`` (SDPO: 0.05).
    """
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"rate must be in [0, 1], got {rate}")
    t_params, s_params = list(teacher.parameters()), list(student.parameters())
    if len(t_params) != len(s_params):
        raise ValueError(
            f"teacher has {len(t_params)} parameter tensors but student has {len(s_params)}"
        )
    for t, s in zip(t_params, s_params):
        t.lerp_(s.detach().to(t.dtype), rate)


@dataclasses.dataclass(frozen=True)
class TextTeacherSequence:
    """A teacher input whose privileged context is text.

    Attributes:
        input_ids: ``[L_t]`` teacher prompt followed by the student's tokens after its prompt.
        prompt_len: length of the teacher prompt.
        offset: student position ``p >= student prompt_len`` is teacher position ``p + offset``.
    """

    input_ids: list[int]
    prompt_len: int
    offset: int


def build_text_teacher_sequence(
    tokenizer: Any,
    traj: Trajectory,
    *,
    system_suffix: str = "",
    user_suffix: str = "",
) -> TextTeacherSequence:
    """The teacher input of a trajectory with text appended to its system / first user message.

    The student's rendered prompt is decoded (special tokens kept as text, so the chat-template
    structure survives re-encoding), the suffixes are inserted right after the system message and
    the first user message, the text is re-encoded, and ``traj.input_ids[prompt_len:]`` is
    appended unchanged.

    Args:
        tokenizer: the backbone's tokenizer.
        traj: the student's trajectory (``messages`` holds the system and first user message).
        system_suffix: appended to the system message.
        user_suffix: appended to the first user message.

    Returns:
        A :class:`TextTeacherSequence`.

    Raises:
        ValueError: a suffix is given for a message the trajectory does not have, or the message
            text is not found in the decoded prompt.
    """
    from lopd.chat import encode

    prompt = traj.input_ids[: traj.prompt_len]
    text = tokenizer.decode(prompt, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    # Insert the user suffix first (searching from the right: the first user message is the
    # prompt's last message), then the system suffix (from the left: the first message), so
    # neither insertion shifts the other's anchor.
    for role, suffix, find in (("user", user_suffix, text.rfind), ("system", system_suffix, None)):
        if not suffix:
            continue
        content = next((m["content"] for m in traj.messages if m["role"] == role), None)
        if content is None:
            raise ValueError(f"trajectory of task {traj.task.task_id!r} has no {role} message")
        at = (find or text.find)(content)
        if at < 0:
            raise ValueError(
                f"the {role} message of task {traj.task.task_id!r} is not in its decoded prompt"
            )
        end = at + len(content)
        text = text[:end] + suffix + text[end:]
    ids = encode(tokenizer, text)
    return TextTeacherSequence(
        input_ids=ids + list(traj.input_ids[traj.prompt_len :]),
        prompt_len=len(ids),
        offset=len(ids) - traj.prompt_len,
    )


def text_teacher_hidden(
    model: nn.Module,
    sequences: Sequence[TextTeacherSequence],
    where: ActionRows,
    pad_id: int,
) -> torch.Tensor:
    """Final hidden states of a text-conditioned teacher at the student's action rows, ``[N, d]``.

    Args:
        model: the teacher ``*ForCausalLM`` (frozen base or EMA shadow).
        sequences: B teacher sequences, one per trajectory of ``where``.
        where: the student's :class:`~lopd.trainer.ActionRows`.
        pad_id: padding id.
    """
    device = where.rows.device
    ids, mask = pad_batch([s.input_ids for s in sequences], pad_id, device)
    hidden = decoder_of(model)(input_ids=ids, attention_mask=mask).last_hidden_state
    offsets = torch.as_tensor([s.offset for s in sequences], dtype=torch.long, device=device)
    return hidden[where.batch, where.rows + offsets[where.batch]]


def group_rollouts(trainer: Trainer, step: int, group_size: int) -> list[Trajectory]:
    """This rank's rollouts of step ``step`` for a group method: G rollouts of each task.

    ``max(1, tasks_per_step // G)`` distinct training tasks are drawn (a pure function of seed and
    step, like :meth:`~lopd.trainer.Trainer.step_tasks`), whole groups are dealt to ranks, and each
    task is rolled out G times by the student in one batch. ``info["group"]`` holds the group
    index within this rank's list.
    """
    cfg = trainer.cfg.lopd
    num_groups = max(1, cfg.tasks_per_step // group_size)
    rng = np.random.default_rng(_mix_seed(trainer.cfg.seed, 5, step))
    n = len(trainer.train_tasks)
    idx = rng.choice(n, size=num_groups, replace=n < num_groups)
    tasks = [trainer.train_tasks[i] for i in idx[trainer.rank :: trainer.world]]
    reps = [task for task in tasks for _ in range(group_size)]
    trajs = trainer.generate(
        trainer.student, reps, seed=_mix_seed(trainer.cfg.seed, 6, step, trainer.rank)
    )
    for k, t in enumerate(trajs):
        t.info["group"] = k // group_size
    return trajs


def _distill_cfg(trainer: Trainer, **changes: Any) -> Any:
    return dataclasses.replace(trainer.cfg.lopd, **changes)


def _zero_loss(trainer: Trainer) -> torch.Tensor:
    # A micro-batch with nothing to distill: a graph-free zero whose backward is a no-op.
    return torch.zeros((), device=trainer.device, requires_grad=True)


# ------------------------------------------------------------------------------ GRPO
@register_method("grpo")
class GRPOMethod(Method):
    """GRPO (paper B.1): group-normalized advantages weight a PPO-clip objective.

    The loss of a trajectory is the mean over its action tokens of :func:`ppo_clip_loss`; the
    step's loss is the mean over trajectories (DeepSeekMath's normalisation). Log-probabilities
    use the sampling temperature (``gen.temperature``), the distribution the tokens were drawn
    from. No KL to a reference model (beta = 0, as in DAPO / Dr. GRPO and TRL's default).

    Attributes:
        group_size: G.
        clip_eps: PPO epsilon.
    """

    uses_composer = False
    group_size = 4
    clip_eps = 0.2

    def rollouts(self, trainer: Trainer, step: int) -> list[Trajectory]:
        trajs = group_rollouts(trainer, step, self.group_size)
        if trajs:
            adv = group_advantages(
                torch.tensor([t.reward for t in trajs], dtype=torch.float64),
                torch.tensor([t.info["group"] for t in trajs]),
            )
            for t, a in zip(trajs, adv.tolist()):
                t.info["advantage"] = a
        return trajs

    def loss(
        self, trainer: Trainer, trajectories: Sequence[Trajectory], num_total: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        device = trainer.device
        where = ActionRows.of(trajectories, device)
        h = student_action_hidden(trainer.student, trajectories, where, trainer.pad_id)
        tau = trainer.cfg.gen.temperature or 1.0  # greedy sampling: score at temperature 1
        logits = _lm_head(trainer.student)(h).float() / tau
        logp = -nn.functional.cross_entropy(logits, where.targets, reduction="none")
        adv = torch.tensor([t.info["advantage"] for t in trajectories], device=device)
        per_token = ppo_clip_loss(logp, logp.detach(), adv[where.batch], self.clip_eps)
        b = len(trajectories)
        per_traj = segment_mean(per_token, where.batch, b)
        with torch.no_grad():
            ratio = torch.exp(logp - logp.detach())
            clipped = ((ratio - 1.0).abs() > self.clip_eps).float()
            sums = {
                "advantage_abs": float(adv.abs().sum()),
                "clip_fraction": float(segment_mean(clipped, where.batch, b).sum()),
                "student_logprob": float(segment_mean(logp.detach(), where.batch, b).sum()),
                "action_tokens": float(where.rows.numel()),
            }
        return per_traj.sum() / num_total, sums


# ------------------------------------------------------------------------------ OPSD
@register_method("opsd")
class OPSDMethod(Method):
    """OPSD (paper B.1): frozen base teacher, retrieved successful trajectory as system text.

    The privileged text is the first of the task's ``composer.num_retrieved`` retrievals from the
    experience bank (successful base-model rollouts of *other* training tasks, rendered by
    :func:`~lopd.memory.format_experience`), the same bank and retriever LOPD's composer reads.
    Loss: forward KL(teacher || student) over the full vocabulary, token mean per trajectory,
    mean over trajectories.
    """

    uses_composer = False
    uses_bank = True

    def teacher_sequence(self, trainer: Trainer, traj: Trajectory) -> TextTeacherSequence:
        gt_text = trainer._retrieved[traj.task.task_id][0]
        return build_text_teacher_sequence(
            trainer.tokenizer, traj, system_suffix=OPSD_SYSTEM_TEMPLATE.format(gt_text=gt_text)
        )

    def loss(
        self, trainer: Trainer, trajectories: Sequence[Trajectory], num_total: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        where = ActionRows.of(trajectories, trainer.device)
        seqs = [self.teacher_sequence(trainer, t) for t in trajectories]
        with torch.no_grad():
            h_t = text_teacher_hidden(trainer.backbone, seqs, where, trainer.pad_id)
        return _distill_loss(
            trainer,
            trajectories,
            where,
            h_t,
            _lm_head(trainer.backbone),
            _distill_cfg(trainer, top_m=None, divergence="forward"),
            num_total,
        )


_DISTILL_METRICS = (
    "kl",
    "teacher_top_m_mass",
    "privilege",
    "student_logprob",
    "teacher_logprob",
    "action_tokens",
)


def _distill_loss(
    trainer: Trainer,
    trajectories: Sequence[Trajectory],
    where: ActionRows,
    h_t: torch.Tensor,
    head_t: nn.Module,
    cfg: Any,
    num_total: int,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean KL per trajectory (kernel of :func:`~lopd.trainer.distill_rows`), weighted,
    summed and divided by ``num_total``; metric sums as the trainer expects."""
    h_s = student_action_hidden(trainer.student, trajectories, where, trainer.pad_id)
    out = distill_rows(h_s, _lm_head(trainer.student), h_t, head_t, where.targets, cfg)
    b = len(trajectories)
    kl = segment_mean(out.kl, where.batch, b)
    if weights is not None:
        kl = kl * weights
    sums = {"kl": float(kl.detach().sum())}
    sums.update(distill_metric_sums(out, where, b))
    return kl.sum() / num_total, sums


# ------------------------------------------------------------------------------ SDPO
@register_method("sdpo")
class SDPOMethod(Method):
    """SDPO (paper B.1): EMA teacher conditioned on a successful sibling of the same group.

    Each task is rolled out G times. A rollout is *successful* when its reward reaches
    ``bank.min_reward`` (the success criterion the bank uses). Every rollout with at least one
    successful sibling (another rollout of its group) gets one of them, drawn with a seeded
    generator, as text (:data:`SDPO_USER_TEMPLATE`, its observation-lite trace) appended to the
    teacher's first user message; rollouts without one contribute no loss. The teacher is an EMA
    shadow of the student, created from the student at the first step and updated after every
    optimizer step. Loss: reverse KL over the teacher's top-M (``lopd.top_m``) plus a tail
    bucket, token mean per trajectory, mean over all the step's trajectories.

    The EMA shadow is saved in the trainer's checkpoints (:meth:`state_dict`), so a resumed run
    continues with the same teacher.

    Attributes:
        group_size: G.
        ema_rate: teacher update rate.
    """

    uses_composer = False
    group_size = 4
    ema_rate = 0.05

    def __init__(self) -> None:
        self.teacher: nn.Module | None = None

    def ensure_teacher(self, trainer: Trainer) -> nn.Module:
        """The EMA teacher, created from the student on first use."""
        if self.teacher is None:
            self.teacher = copy.deepcopy(trainer.student)
            self.teacher.requires_grad_(False)
            self.teacher.eval()
        return self.teacher

    def state_dict(self) -> dict[str, Any]:
        return {} if self.teacher is None else {"ema_teacher": self.teacher.state_dict()}

    def load_state_dict(self, trainer: Trainer, state: dict[str, Any]) -> None:
        if "ema_teacher" in state:
            self.ensure_teacher(trainer).load_state_dict(state["ema_teacher"])

    def rollouts(self, trainer: Trainer, step: int) -> list[Trajectory]:
        trajs = group_rollouts(trainer, step, self.group_size)
        rng = np.random.default_rng(_mix_seed(trainer.cfg.seed, 7, step, trainer.rank))
        threshold = trainer.cfg.bank.min_reward
        for i, t in enumerate(trajs):
            siblings = [
                s
                for j, s in enumerate(trajs)
                if j != i and s.info["group"] == t.info["group"] and s.reward >= threshold
            ]
            pick = siblings[int(rng.integers(len(siblings)))] if siblings else None
            t.info["sibling_text"] = (pick.trace_text() or "(no tool calls)") if pick else None
        return trajs

    def teacher_sequence(self, trainer: Trainer, traj: Trajectory) -> TextTeacherSequence:
        solution = SDPO_USER_TEMPLATE.format(solution=traj.info["sibling_text"])
        return build_text_teacher_sequence(trainer.tokenizer, traj, user_suffix=solution)

    def loss(
        self, trainer: Trainer, trajectories: Sequence[Trajectory], num_total: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        teacher = self.ensure_teacher(trainer)
        chosen = [t for t in trajectories if t.info.get("sibling_text") is not None]
        counts = {"distilled": float(len(chosen))}
        if not chosen:
            # Same metric keys as a distilled micro-batch: ranks reduce metrics by key.
            return _zero_loss(trainer), {**dict.fromkeys(_DISTILL_METRICS, 0.0), **counts}
        where = ActionRows.of(chosen, trainer.device)
        seqs = [self.teacher_sequence(trainer, t) for t in chosen]
        with torch.no_grad():
            h_t = text_teacher_hidden(teacher, seqs, where, trainer.pad_id)
        loss, sums = _distill_loss(
            trainer,
            chosen,
            where,
            h_t,
            _lm_head(teacher),
            _distill_cfg(trainer, divergence="reverse"),
            num_total,
        )
        return loss, {**sums, **counts}

    def after_step(self, trainer: Trainer, means: dict[str, float]) -> dict[str, float]:
        ema_update_(self.ensure_teacher(trainer), trainer.student, self.ema_rate)
        return {}


# ------------------------------------------------------------------------------ LOPD ablations
@register_method("lopd-frozen")
class LOPDFrozenComposerMethod(LOPDMethod):
    """LOPD with the composer fixed at phi_0 (paper ablation): the teacher reads the cached
    ``c_phi0``, so no gradient reaches the composer and the anchor term is 0."""

    def latents(self, trainer: Trainer, tasks: Sequence[Task]) -> torch.Tensor:
        return trainer.cached_latents0(tasks)


@register_method("lopd-m0")
class LOPDNoMarginMethod(LOPDMethod):
    """LOPD with margin m = 0 (paper ablation); ``lopd.margin`` of the config is ignored."""

    @contextlib.contextmanager
    def _no_margin(self, trainer: Trainer) -> Iterator[None]:
        # The parent reads the margin from trainer.cfg.lopd: swap in a copy with m = 0 for the
        # duration of the call (the saved config.yaml stays what the user passed).
        saved = trainer.cfg.lopd
        trainer.cfg.lopd = dataclasses.replace(saved, margin=0.0)
        try:
            yield
        finally:
            trainer.cfg.lopd = saved

    def loss(
        self, trainer: Trainer, trajectories: Sequence[Trajectory], num_total: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        with self._no_margin(trainer):
            return super().loss(trainer, trajectories, num_total)

    def after_step(self, trainer: Trainer, means: dict[str, float]) -> dict[str, float]:
        with self._no_margin(trainer):
            return super().after_step(trainer, means)
