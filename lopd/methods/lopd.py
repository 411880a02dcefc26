"""LOPD (paper 3.3, Algorithm 1): one training step, top to bottom.

Per step the student rolls out without latents; the teacher (the frozen base model) reads the
same tokens with the latent context ``c_phi`` of the task's retrieved experiences; both score the
student's action tokens, and eq. 13 trains the student theta and the composer phi together:

    KL_n      = KL_topM+tail(pS(.|s_n) || pT(.|s_n, c_phi))        per action token (eq. 9-10)
    delta_n   = log pT(a_n | c_phi) - sg log pS(a_n)               privilege (eq. 11)
    Delta     = mean_i A_i mean_{n in i} delta_n,  A_i = 2 r_i - 1 (eq. 12)
    loss      = mean_i mean_{n in i} KL_n + beta (m - Delta)
                + lambda mean_i ||c_phi[i] - sg c_phi0[i]||^2      (eq. 13)
    beta     <- max(0, beta + eta_beta (m - Delta))                 after the optimizer step

The teacher's weights are the frozen base model by default; ``lopd.teacher_backbone`` makes
them a copy of the student synced every k steps or its EMA
(:class:`~lopd.methods.teacher_backbone.TeacherBackbone`), the encoder's LoRA off either way.

The method owns its state: the dual variable beta (in :meth:`LOPDMethod.state_dict`, so a
resumed run continues with it), a moved teacher's weights, and the anchor's c_phi0 (computed once
by the cold start and kept in ``latents0.pt`` of the run directory; a growing bank refreshes it,
:mod:`lopd.latent.growth`). The ablations are the same class:
``lopd-frozen`` keeps the composer at phi_0 (the teacher reads c_phi0, no gradient reaches phi),
``lopd-m0`` uses m = 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from lopd.config import Config, LOPDConfig
from lopd.latent.injection import TeacherSequence
from lopd.latent.teacher import latent_teacher_sequence, teacher_action_hidden
from lopd.loss import advantages_from_rewards, dual_update, lopd_loss, lopd_row_weights
from lopd.methods.base import DistillSpec, MethodBase, MethodContext
from lopd.methods.rows import distill_metric_sums, distill_rows, student_action_hidden
from lopd.methods.teacher_backbone import TeacherBackbone
from lopd.rollout.batch import ActionRows, lm_head
from lopd.types import Task, Trajectory

__all__ = ["LOPDMethod", "LOPDSettings"]


@dataclasses.dataclass(frozen=True)
class LOPDSettings:
    """LOPD's hyper-parameters: the ``lopd`` config section itself, and what the run adds.

    The section's fields (margin m, lambda, eta_beta, beta's start, the kernel, the teacher's
    backbone) are read from :attr:`lopd`, never copied: ``settings.lopd.margin``.

    Attributes:
        lopd: the ``lopd`` section (a copy, with an ablation's changes such as ``margin=0.0``).
        frozen_composer: the teacher reads the cached c_phi0 (ablation ``lopd-frozen``).
        checkpointed_teacher: recompute the teacher forward in the backward
            (``model.gradient_checkpointing``).
        num_placeholders: J*K latent positions in the teacher prompt.
    """

    lopd: LOPDConfig
    frozen_composer: bool = False
    checkpointed_teacher: bool = False
    num_placeholders: int = 1

    @property
    def spec(self) -> DistillSpec:
        """The distillation kernel settings of the section."""
        return DistillSpec.of(self.lopd)

    @classmethod
    def of(cls, cfg: Config, frozen_composer: bool = False, **changes: Any) -> LOPDSettings:
        """The settings of ``cfg``; ``changes`` override fields of the ``lopd`` section (e.g.
        ``margin=0.0``), in a copy (``cfg`` is left as it is)."""
        return cls(
            lopd=dataclasses.replace(cfg.lopd, **changes),
            frozen_composer=frozen_composer,
            checkpointed_teacher=cfg.model.gradient_checkpointing,
            num_placeholders=cfg.composer.num_latents * cfg.composer.num_retrieved,
        )


class LOPDMethod(MethodBase):
    """Eq. 13: top-M + tail reverse KL on action tokens + beta (m - Delta) + latent anchor.

    Args:
        ctx: needs ``latents`` (the composer over the bank's retrievals) and ``latents0``.
        settings: the hyper-parameters.
        tasks_per_step: rollouts per step across ranks.

    Attributes:
        beta: the dual variable of the privilege constraint ``Delta >= m``.
        teacher: the teacher's weights (the frozen base, or a copy that follows the student).
    """

    def __init__(self, ctx: MethodContext, settings: LOPDSettings, tasks_per_step: int) -> None:
        super().__init__(ctx, tasks_per_step)
        if ctx.latents is None or ctx.latents0 is None:
            raise ValueError("LOPD needs the composer, the bank's retrievals and c_phi0")
        self.settings = settings
        self.task_latents = ctx.latents
        self.composer = ctx.latents.composer
        self.latents0 = ctx.latents0
        self.beta = settings.lopd.beta_init
        self.teacher = TeacherBackbone(
            ctx.models.student,
            settings.lopd.teacher_backbone,
            settings.lopd.teacher_sync_every,
            settings.lopd.teacher_ema_rate,
            ctx.models.sharding,
        )

    @classmethod
    def from_config(cls, ctx: MethodContext, cfg: Config, **changes: Any) -> LOPDMethod:
        """Built from ``cfg.lopd`` (and the composer's J*K); ``changes`` as in
        :meth:`LOPDSettings.of`."""
        return cls(ctx, LOPDSettings.of(cfg, **changes), cfg.train.tasks_per_step)

    # ---------------------------------------------------------------- 1. rollouts
    def rollouts(self, step: int) -> list[Trajectory]:
        """Algorithm 1, line 4: one student rollout (no latents) per drawn training task; each
        trajectory carries its reward r_i in [0, 1]."""
        return super().rollouts(step)

    # ---------------------------------------------------------------- 2. loss
    def loss(
        self, trajectories: Sequence[Trajectory], num_total: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Eq. 13 on one micro-batch (divided by ``num_total``) and its metric sums."""
        s, models = self.settings, self.models
        tasks = [t.task for t in trajectories]
        where = ActionRows.of(trajectories, models.device)  # the N action tokens a_n
        latents = self.latents(tasks)  # c_phi  [B, J*K, d]
        latents0 = self.cached_latents0(tasks)  # sg c_phi0  [B, J*K, d]
        sequences = [self.teacher_sequence(t) for t in trajectories]
        # Teacher pT(.|s_n, c_phi) and student pS(.|s_n) at the same tokens, as hidden states.
        h_t = self.teacher_hidden(sequences, latents, where)
        h_s = student_action_hidden(models, trajectories, where)
        head_s, head_t = lm_head(models.student), self.teacher_head()
        rewards = torch.tensor([t.reward for t in trajectories], device=models.device)
        advantages = advantages_from_rewards(rewards)  # A_i = 2 r_i - 1
        # KL_n (eq. 9-10) and delta_n (eq. 11) from the LM heads, on the N rows only. Eq. 13 is
        # linear in both with weights known now (beta is a constant within the step), so the
        # kernel forms their gradients while each chunk's logits are in memory.
        w_kl, w_t = lopd_row_weights(where.batch, advantages, self.beta, num_total)
        distilled = distill_rows(h_s, head_s, h_t, head_t, where.targets, s.spec, w_kl, w_t)
        out = distilled.output  # no gradient: it is in distilled.loss
        terms = lopd_loss(  # eq. 12-13: the logged Lagrangian, gradient through the anchor
            out.kl,
            out.privilege,
            where.batch,
            advantages,
            latents,
            latents0,
            beta=self.beta,
            margin=s.lopd.margin,
            anchor_weight=s.lopd.anchor_weight,
            num_total=num_total,
        )
        # The value of terms.loss, the gradients of the distillation and privilege terms too.
        loss = terms.loss + (distilled.loss - distilled.loss.detach())
        with torch.no_grad():
            b = len(trajectories)
            kl, delta, anchor = torch.stack(
                [terms.distill.sum(), terms.delta.sum(), terms.anchor.sum()]
            ).tolist()
            sums = {"kl": kl, "delta": delta, "anchor": anchor}
            sums.update(distill_metric_sums(out, where, b))
        return loss, sums

    def teacher_hidden(
        self, sequences: Sequence[TeacherSequence], latents: torch.Tensor, where: ActionRows
    ) -> torch.Tensor:
        """The latent teacher's final hidden states at the action rows, ``[N, d]`` (its
        backbone, :attr:`teacher`; differentiable in ``latents``)."""
        return teacher_action_hidden(
            self.composer,
            sequences,
            latents,
            where,
            self.models.pad_id,
            checkpointed=self.settings.checkpointed_teacher,
            model=self.teacher.model(),
        )

    def teacher_head(self) -> torch.nn.Module:
        """The latent teacher's LM head."""
        model = self.teacher.model()
        return lm_head(self.composer.backbone if model is None else model)

    def teacher_model(self) -> torch.nn.Module | None:
        """The teacher's weights when they moved (a copy of the student), else ``None`` (the
        frozen base)."""
        return self.teacher.model()

    def latents(self, tasks: Sequence[Task]) -> torch.Tensor:
        """The teacher's latent context, ``[B, J*K, d]``: c_phi, c_phi0 for ``lopd-frozen``, or
        zeros under ``lopd.null_context`` (no gradient reaches phi then)."""
        if self.settings.frozen_composer or self.ctx.null_context:
            return self.cached_latents0(tasks)
        return self.task_latents(tasks)

    def cached_latents0(self, tasks: Sequence[Task]) -> torch.Tensor:
        """c_phi0 of ``tasks`` from the cold start's cache, ``[B, J*K, d]`` (zeros under
        ``lopd.null_context``: the anchor is then zero too)."""
        latents0 = torch.stack([self.latents0[t.task_id] for t in tasks]).to(self.models.device)
        return torch.zeros_like(latents0) if self.ctx.null_context else latents0

    def teacher_sequence(self, traj: Trajectory) -> TeacherSequence:
        """The teacher's input for a trajectory (A.4): framing, J*K placeholders, continuation."""
        models = self.models
        return latent_teacher_sequence(
            models.tokenizer, traj, self.settings.num_placeholders, models.pad_id
        )

    # ---------------------------------------------------------------- 3. after the step
    def after_step(self, means: dict[str, float]) -> dict[str, float]:
        """Dual ascent on beta with the step's global Delta (every rank gets the same value)."""
        s = self.settings
        before = self.beta
        self.beta = dual_update(before, s.lopd.margin, means["delta"], s.lopd.dual_lr)
        self.teacher.after_step()
        # The margin too, so a finished run's metrics say which m its dual ascent used.
        out = {"beta": before, "beta_next": self.beta, "margin": s.lopd.margin}
        return {**out, **super().after_step(means)}

    def state_dict(self) -> dict[str, Any]:
        state = {"beta": self.beta, **super().state_dict()}
        if self.teacher.moved:
            state.update(self.teacher.state_dict())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.beta = float(state["beta"])
        self.teacher.load_state_dict(state)
        super().load_state_dict(state)
