"""Skill-SD (paper B.1): a skill-conditioned self-teacher on top of GRPO's group rollouts.

Per step (:meth:`SkillSDMethod.rollouts` -> :meth:`~SkillSDMethod.loss` ->
:meth:`~SkillSDMethod.after_step`):

1. G student rollouts of each drawn task (plain prompt; the student never sees a skill), and
   GRPO's group-normalized advantages.
2. One skill per task from the :class:`~lopd.methods.skills.SkillBank` by UCB1 (c = sqrt 2);
   a task without a candidate skill (none yet from another task of its world) is trained by
   PPO alone this step.
3. Each task's rollout group, successes and failures, is summarized into a new skill
   (:mod:`lopd.methods.skills`: the model itself, or the deterministic rule summarizer that
   stands in for models too small to write one); it joins the bank after the step, so a skill
   only guides later steps.
4. Loss per action token, token mean per trajectory, mean over the step's trajectories:

   ``PPO-clip(rho, A; eps_lo 0.2, eps_hi 0.28) + lambda_sdl rho sg(log pi_theta(y) - log pi_T(y))``

   with ``rho = pi_theta(y) / pi_old(y)`` of the sampled token ``y`` and ``pi_T`` the teacher
   conditioned on the skill text appended to its first user message
   (:data:`~lopd.methods.skills.SKILL_USER_TEMPLATE`, the paper's wording). The second term is
   the importance-weighted sampled-token reverse KL (:func:`importance_weighted_reverse_kl`):
   its value is the sampled-token estimate of KL(pi_theta || pi_T) and its gradient
   ``rho (log pi_theta - log pi_T) grad log pi_theta`` is the reverse KL's exact gradient in
   expectation over tokens sampled from pi_old. With one optimizer update per batch of
   rollouts ``pi_old = pi_theta`` (rho = 1 in value). Log-probabilities use the sampling
   temperature, as GRPO's.
5. After the optimizer step: each pull's bandit reward is recorded
   (:func:`~lopd.methods.skills.skill_agreement`: the fraction of the guided rollouts on which
   the skill-conditioned teacher's log-ratio has the sign of the verified outcome; the student
   never sees the skill, so its rollout reward itself cannot depend on the pick), the step's
   new skills join the bank, and the teacher is re-synchronized.

The teacher is the student's weights, synchronized every ``skill_sd.teacher_sync_every``
optimizer steps (1, the default: the current student itself under ``no_grad``, no copy kept;
"dynamically synchronized with the improving student"; B.1 gives no interval). Method state
(checkpointed): the skill bank with its UCB1 statistics, and the teacher copy if one is kept.
Every rollout goes through the engine (counted toward the budget); a model-written skill is a
text generation from rollouts already counted, not a rollout.

Under ``torchrun`` every rank rolls out its share of the step's groups; the skills are chosen
for the whole step's task list (every rank holds the same bank, so each computes the same
choices), and after the step every rank's new skills, bandit records and fallback counts are
gathered and applied in the one-process order: every rank keeps the same bank and UCB1
statistics, those one process would have. Under ``model.parallel=fsdp2`` a micro-batch without
a guided trajectory still runs the teacher's forward (a collective there) on a placeholder.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lopd.config import Config
from lopd.loss import segment_mean
from lopd.methods.base import MethodBase, MethodContext
from lopd.methods.ema import EMATeacher
from lopd.methods.groups import group_advantages, group_rollouts, ppo_clip_loss
from lopd.methods.rows import student_action_hidden
from lopd.methods.skills import (
    ModelSkillSummarizer,
    RuleSkillSummarizer,
    SkillBank,
    SkillText,
    skill_agreement,
)
from lopd.methods.text_teacher import (
    TextTeacherSequence,
    framed_teacher_sequence,
    text_teacher_hidden,
)
from lopd.parallel.lockstep import PADDING
from lopd.rollout.batch import ActionRows, lm_head, lm_head_logprobs
from lopd.run.seeds import Stream
from lopd.run.tasks import TaskSampler
from lopd.types import Task, Trajectory

__all__ = ["SkillSDMethod", "importance_weighted_reverse_kl", "sampled_logprobs"]


def importance_weighted_reverse_kl(
    logp: torch.Tensor, logp_old: torch.Tensor, logp_teacher: torch.Tensor
) -> torch.Tensor:
    """Per-token ``rho * sg(logp - logp_teacher)``, ``rho = exp(logp - sg(logp_old))``.

    Args:
        logp: ``[N]`` log pi_theta of the sampled tokens (with gradient).
        logp_old: ``[N]`` the same under the sampling policy (no gradient is taken).
        logp_teacher: ``[N]`` log pi_T of the same tokens (no gradient is taken).

    Returns:
        ``[N]`` losses: value ``rho (logp - logp_teacher)``, gradient
        ``rho (logp - logp_teacher) grad logp``.
    """
    if not (logp.shape == logp_old.shape == logp_teacher.shape):
        raise ValueError(
            "logp, logp_old and logp_teacher must have the same shape, got "
            f"{tuple(logp.shape)}, {tuple(logp_old.shape)} and {tuple(logp_teacher.shape)}"
        )
    ratio = torch.exp(logp - logp_old.detach())
    return ratio * (logp - logp_teacher).detach()


def sampled_logprobs(
    head: nn.Module, h: torch.Tensor, targets: torch.Tensor, tau: float
) -> torch.Tensor:
    """``log softmax(head(h) / tau)[targets]``, ``[N]`` float32 (``h``: ``[N, d]``), from the
    fused LM-head kernel: no ``[N, V]`` logits (:func:`~lopd.rollout.batch.lm_head_logprobs`)."""
    return lm_head_logprobs(head, h, targets, tau)


class SkillSDMethod(MethodBase):
    """Skill-SD: UCB1-chosen skills condition a self-teacher; PPO-clip + IW reverse KL.

    Args:
        ctx: the models, engine and sampler.
        cfg: the run config (``skill_sd`` section, ``bank.min_reward`` as the success
            criterion, ``gen.temperature``, ``train.tasks_per_step``).

    Attributes:
        bank: the :class:`~lopd.methods.skills.SkillBank`.
        teacher: the teacher copy (``None`` when ``teacher_sync_every`` is 1).
    """

    def __init__(self, ctx: MethodContext, cfg: Config) -> None:
        super().__init__(ctx, cfg.train.tasks_per_step)
        s = cfg.skill_sd
        self.settings = s
        self.success_reward = cfg.bank.min_reward
        self.tau = cfg.gen.temperature or 1.0
        self.bank = SkillBank(s.ucb_c, s.max_skills)
        student = ctx.models.student
        self.summarizer: ModelSkillSummarizer | RuleSkillSummarizer = (
            ModelSkillSummarizer(student, ctx.models.tokenizer, s.summary_max_tokens)
            if s.summarizer == "model"
            else RuleSkillSummarizer()
        )
        self.teacher = (
            EMATeacher(student, 1.0, ctx.models.sharding) if s.teacher_sync_every > 1 else None
        )
        if self.teacher is not None:
            self.teacher.get()  # the copy starts as the initial student
        self.step = 0
        self.step_fallbacks = 0
        # Filled by rollouts() / loss(), consumed by after_step() (empty at every checkpoint);
        # each entry starts with its group's index in the whole step (the one-process order).
        self.pending_skills: list[tuple[int, Task, SkillText, str]] = []
        self.records: list[tuple[int, str, int, float, float]] = []

    @classmethod
    def from_config(cls, ctx: MethodContext, cfg: Config) -> SkillSDMethod:
        return cls(ctx, cfg)

    def teacher_model(self) -> nn.Module:
        """The teacher's weights: the student itself, or the synchronized copy."""
        return self.models.student if self.teacher is None else self.teacher.get()

    # -------------------------------------------------------------- 1-3: rollouts and skills
    def rollouts(self, step: int) -> list[Trajectory]:
        """G rollouts per task with ``info["advantage"]``, ``info["skill_id"]`` and
        ``info["skill_text"]`` (the rendered skill, or ``None``); the step's new skills are
        written here and join the bank in :meth:`after_step`."""
        self.step = step
        ctx, sampler, success = self.ctx, self.ctx.sampler, self.success_reward
        trajs = group_rollouts(ctx, step, self.settings.group_size, self.tasks_per_step)
        # The whole step's tasks (every rank's share, TaskSampler order): the choices are those
        # one process makes; this rank's groups are the tasks at rank, rank + world, ...
        everyone = TaskSampler(sampler.seed).draw(
            ctx.train_tasks,
            max(1, self.tasks_per_step // self.settings.group_size),
            Stream.STEP_TASKS,
            step,
        )
        chosen = self.bank.select(everyone)[sampler.rank :: sampler.world]
        groups: dict[int, list[Trajectory]] = {}
        if trajs:
            adv = group_advantages(
                torch.tensor([t.reward for t in trajs], dtype=torch.float64),
                torch.tensor([t.info["group"] for t in trajs]),
            )
            for t, a in zip(trajs, adv.tolist()):
                t.info["advantage"] = a
                groups.setdefault(t.info["group"], []).append(t)
        members = list(groups.values())
        for k, (group, skill) in enumerate(zip(members, chosen, strict=True)):
            for t in group:
                t.info["skill_id"] = None if skill is None else skill.skill_id
                t.info["skill_text"] = None if skill is None else self.skill_text(skill.text)
                t.info["step_group"] = k * sampler.world + sampler.rank
        fallbacks = self.summarizer.fallbacks
        # A model-written skill is a rank-local generation: under FSDP2 every rank gathers the
        # weights for it (rank-local forwards are no collectives then), with or without groups.
        writes = isinstance(self.summarizer, ModelSkillSummarizer)
        with self.models.sharding.gathered() if writes else contextlib.nullcontext():
            self.pending_skills = [
                (g[0].info["step_group"], g[0].task, *self.summarizer.summarize(g, success))
                for g in members
            ]
        self.step_fallbacks = self.summarizer.fallbacks - fallbacks
        return trajs

    def skill_text(self, text: SkillText) -> str:
        """The rendered skill of the teacher prompt (its parts emptied under
        ``lopd.null_context``)."""
        return text.map(self.privileged).render()

    def teacher_sequence(self, traj: Trajectory, skill: str | None = None) -> TextTeacherSequence:
        """The teacher's input: the chosen skill (or ``skill``) after the first user message."""
        skill = traj.info["skill_text"] if skill is None else skill
        return framed_teacher_sequence(
            self.models.tokenizer, traj, skill.strip(), self.ctx.context_format, user_suffix=skill
        )

    # -------------------------------------------------------------- 4: the loss
    def loss(
        self, trajectories: Sequence[Trajectory], num_total: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        models, s = self.models, self.settings
        where = ActionRows.of(trajectories, models.device)
        h = student_action_hidden(models, trajectories, where)
        logp = sampled_logprobs(lm_head(models.student), h, where.targets, self.tau)
        logp_old = logp.detach()  # one optimizer update per batch of rollouts
        adv = torch.tensor([t.info["advantage"] for t in trajectories], device=models.device)
        per_token = ppo_clip_loss(
            logp, logp_old, adv[where.batch], s.clip_eps_low, clip_eps_high=s.clip_eps_high
        )
        b = len(trajectories)
        guided = [i for i, t in enumerate(trajectories) if t.info.get("skill_text") is not None]
        kl_traj = torch.zeros(b, device=models.device)
        teacher_lp = torch.zeros(b, device=models.device)
        if guided or models.sharding.enabled:
            # Under FSDP2 the teacher's forward is a collective: without a guided trajectory
            # it runs on a placeholder (the first trajectory, an empty skill), result unused.
            sub = [trajectories[i] for i in guided] or list(trajectories[:1])
            where_g = ActionRows.of(sub, models.device)
            teacher = self.teacher_model()
            with torch.no_grad():
                seqs = [self.teacher_sequence(t, None if guided else "") for t in sub]
                h_t = text_teacher_hidden(models, teacher, seqs, where_g)
                logp_t = sampled_logprobs(lm_head(teacher), h_t, where_g.targets, self.tau)
        if guided:
            # ActionRows lists rows trajectory by trajectory: the guided trajectories' rows of
            # ``where`` are exactly ``where_g``'s, in the same order.
            rows = torch.isin(where.batch, torch.tensor(guided, device=models.device))
            kl = importance_weighted_reverse_kl(logp[rows], logp_old[rows], logp_t)
            per_token = per_token + s.sdl_weight * torch.zeros_like(per_token).masked_scatter(
                rows, kl
            )
            with torch.no_grad():
                gi = torch.tensor(guided, device=models.device)
                kl_traj[gi] = segment_mean(kl.detach(), where_g.batch, len(sub))
                teacher_lp[gi] = segment_mean(logp_t, where_g.batch, len(sub))
                for k, t in enumerate(sub):
                    if PADDING in t.info:  # a pass that only keeps the ranks in step
                        continue
                    # Bandit data: mean log pi_T - log pi_theta of the rollout's tokens.
                    log_ratio = -float(kl_traj[gi[k]])
                    self.records.append(
                        (t.info["step_group"], t.task.task_id, t.info["skill_id"], t.reward,
                         log_ratio)
                    )  # fmt: skip
        per_traj = segment_mean(per_token, where.batch, b)
        with torch.no_grad():
            ratio = torch.exp(logp - logp_old)
            clipped = ((ratio < 1.0 - s.clip_eps_low) | (ratio > 1.0 + s.clip_eps_high)).float()
            sums = {
                "kl": float(kl_traj.sum()),
                "skill_guided": float(len(guided)),
                "teacher_logprob": float(teacher_lp.sum()),
                "advantage_abs": float(adv.abs().sum()),
                "clip_fraction": float(segment_mean(clipped, where.batch, b).sum()),
                "student_logprob": float(segment_mean(logp_old, where.batch, b).sum()),
                "action_tokens": float(where.rows.numel()),
            }
        return per_traj.sum() / num_total, sums

    # -------------------------------------------------------------- 5: after the step
    def after_step(self, means: dict[str, float]) -> dict[str, float]:
        self.gather_ranks()
        pulls: dict[tuple[str, int], tuple[list[float], list[float]]] = {}
        for _, task_id, skill_id, reward, log_ratio in self.records:
            rewards, ratios = pulls.setdefault((task_id, skill_id), ([], []))
            rewards.append(reward)
            ratios.append(log_ratio)
        bandit = []
        for (_, skill_id), (rewards, ratios) in pulls.items():
            bandit.append(skill_agreement(rewards, ratios, self.success_reward))
            self.bank.update(skill_id, bandit[-1])
        self.records = []
        by_model = sum(author == "model" for _, _, _, author in self.pending_skills)
        new = len(self.pending_skills)
        for _, task, text, author in self.pending_skills:
            self.bank.add(task, text, author, self.step)
        self.pending_skills = []
        every = self.settings.teacher_sync_every
        if self.teacher is not None and (self.step + 1) % every == 0:
            self.teacher.update()
        return {
            "skills": float(len(self.bank)),
            "skills_new": float(new),
            "skills_by_model": float(by_model),
            "skill_fallbacks": float(self.step_fallbacks),
            "skill_pulls": float(len(bandit)),
            "skill_bandit_reward": sum(bandit) / len(bandit) if bandit else 0.0,
        }

    def gather_ranks(self) -> None:
        """Every rank's new skills, bandit records and fallback count of the step, on every
        rank, in the one-process order (by the group's index in the whole step; a collective
        under ``torchrun``)."""
        dist = self.ctx.dist
        if dist is None or not dist.distributed:
            return
        shares = dist.all_gather_object((self.pending_skills, self.records, self.step_fallbacks))
        self.pending_skills = sorted((p for s in shares for p in s[0]), key=lambda p: p[0])
        self.records = sorted((r for s in shares for r in s[1]), key=lambda r: r[0])
        self.step_fallbacks = sum(s[2] for s in shares)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"skill_bank": self.bank.state_dict()}
        if self.teacher is not None:
            state.update(self.teacher.state_dict())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "skill_bank" in state:
            self.bank.load_state_dict(state["skill_bank"])
        if self.teacher is not None:
            self.teacher.load_state_dict(state)
