"""LOPD-PPO: Skill-SD's loss structure with LOPD's latent teacher in place of the skill text.

Skill-SD (:mod:`lopd.methods.skill_sd`) trains with PPO-clip on GRPO's group advantages plus a
small distillation term toward the current student reading a skill written as text. LOPD-PPO
keeps that structure and puts LOPD's teacher where the skill was: the teacher backbone
(:class:`~lopd.methods.teacher_backbone.TeacherBackbone`: the frozen base, a synced copy of the
student or its EMA) reading the student's trajectory with the latent context ``c_phi`` of the
task's retrieved experiences. So latents and skills differ only in the teacher's context.

Per step (:meth:`LOPDPPOMethod.rollouts` -> :meth:`~LOPDPPOMethod.loss` -> ``after_step``):

1. G student rollouts of each drawn task (plain prompt), GRPO's group-normalized advantages
   ``A^g_i`` (:func:`~lopd.methods.groups.group_advantages`).
2. Per action token ``n`` of trajectory ``i`` (token mean per trajectory, mean over the step's
   trajectories)::

       PPO-clip(rho_n, A^g_i; 0.2, 0.28)                        rho at the sampling temperature
     + w * D_n                                                  the distillation term
     + beta (m - Delta) + lambda ||c_phi[i] - sg c_phi0[i]||^2  LOPD's margin and anchor

   with ``D_n`` one of (``lopd_ppo.distill``):

   * ``topk``: LOPD's ``KL_topM+tail(pS || pT(c_phi))`` (eq. 9-10), its gradient reaching the
     student and, through the teacher, phi;
   * ``sampled``: Skill-SD's ``rho sg(log pS(a_n) - log pT(a_n | c_phi))`` at the sampling
     temperature (:func:`~lopd.methods.skill_sd.importance_weighted_reverse_kl`), its gradient
     reaching the student only.

   Delta is LOPD's eq. 12 (``A_i = 2 r_i - 1``, ``delta_n = log pT(a_n) - sg log pS(a_n)``);
   ``lopd_ppo.dual=false`` keeps beta at 0 and ``lopd_ppo.anchor=false`` drops the anchor.
3. After the optimizer step: dual ascent on beta (with the margin), the teacher backbone moves
   (sync or EMA), and a growing bank refreshes (``bank.grow``).

The metrics add the norms of the gradients the PPO and the distillation terms send into the
student's final hidden states at the action rows and their cosine (``grad_ppo``,
``grad_distill``, ``grad_cosine``, per micro-batch; :meth:`LOPDPPOMethod.gradient_split`): the
distillation term's share of what moves the student.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from lopd.config import Config, LOPDPPOConfig
from lopd.loss import segment_mean, segment_mean_weights
from lopd.methods.base import MethodBase, MethodContext
from lopd.methods.groups import group_advantages, group_rollouts, ppo_clip_loss
from lopd.methods.lopd import LOPDMethod, LOPDSettings
from lopd.methods.rows import distill_metric_sums, distill_rows, student_action_hidden
from lopd.methods.skill_sd import importance_weighted_reverse_kl
from lopd.parallel.fsdp import full_weight
from lopd.parallel.precision import autocast_cast
from lopd.rollout.batch import ActionRows, lm_head, lm_head_logprobs
from lopd.types import Task, Trajectory
from lopd_kernels.fused_linear_logprob import fused_linear_logprob
from lopd_kernels.fused_linear_topk_tail_kl_loss import fused_linear_topk_tail_kl_loss

__all__ = ["GradientSplit", "LOPDPPOMethod"]


class GradientSplit(NamedTuple):
    """The gradients the PPO and the distillation terms send into the student's action-row
    hidden states (one micro-batch).

    Attributes:
        ppo: the PPO term's norm.
        distill: the weighted distillation term's norm.
        cosine: the cosine between the two (0 when either is zero).
    """

    ppo: float
    distill: float
    cosine: float


class LOPDPPOMethod(LOPDMethod):
    """PPO-clip on group advantages + ``w`` x a distillation term toward LOPD's latent teacher.

    Args:
        ctx: as :class:`~lopd.methods.lopd.LOPDMethod`'s (the composer, its retrievals and
            c_phi0).
        settings: LOPD's settings (margin, lambda, eta_beta, kernel, teacher backbone).
        ppo: the ``lopd_ppo`` section.
        tasks_per_step: rollouts per step across ranks.
        sampling_temperature: ``gen.temperature`` (the PPO ratio's and the sampled form's
            log-probabilities; 0, greedy, scores at temperature 1).
    """

    def __init__(
        self,
        ctx: MethodContext,
        settings: LOPDSettings,
        ppo: LOPDPPOConfig,
        tasks_per_step: int,
        sampling_temperature: float,
    ) -> None:
        super().__init__(ctx, settings, tasks_per_step)
        self.ppo = ppo
        self.tau = sampling_temperature or 1.0

    @classmethod
    def from_config(cls, ctx: MethodContext, cfg: Config, **changes: Any) -> LOPDPPOMethod:
        """Built from ``cfg.lopd_ppo`` and ``cfg.lopd``; ``changes`` as in
        :meth:`LOPDSettings.of`."""
        settings = LOPDSettings.of(cfg, **changes)
        return cls(ctx, settings, cfg.lopd_ppo, cfg.train.tasks_per_step, cfg.gen.temperature)

    # ---------------------------------------------------------------- 1. rollouts
    def rollouts(self, step: int) -> list[Trajectory]:
        """G rollouts of each drawn task; ``info["advantage"]`` is the group-normalized one."""
        trajs = group_rollouts(self.ctx, step, self.ppo.group_size, self.tasks_per_step)
        if trajs:
            adv = group_advantages(
                torch.tensor([t.reward for t in trajs], dtype=torch.float64),
                torch.tensor([t.info["group"] for t in trajs]),
            )
            for t, a in zip(trajs, adv.tolist()):
                t.info["advantage"] = a
        self.observe(trajs)
        return trajs

    def latents(self, tasks: Sequence[Task]) -> torch.Tensor:
        """c_phi of ``tasks`` (``[B, J*K, d]``), each distinct task composed once: a group's G
        rollouts share their task's latents (and their gradient)."""
        ids = [t.task_id for t in tasks]
        first = {tid: i for i, tid in reversed(list(enumerate(ids)))}
        order = sorted(first.values())
        slot = {ids[i]: k for k, i in enumerate(order)}
        composed = super().latents([tasks[i] for i in order])
        return composed[torch.tensor([slot[tid] for tid in ids], device=composed.device)]

    # ---------------------------------------------------------------- 2. loss
    def loss(
        self, trajectories: Sequence[Trajectory], num_total: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """PPO-clip + ``w`` D + beta (m - Delta) + lambda anchor on one micro-batch (divided by
        ``num_total``) and its metric sums."""
        s, p, models = self.settings, self.ppo, self.models
        b, device = len(trajectories), models.device
        tasks = [t.task for t in trajectories]
        where = ActionRows.of(trajectories, device)
        latents = self.latents(tasks)  # c_phi  [B, J*K, d]
        latents0 = self.cached_latents0(tasks)  # sg c_phi0  [B, J*K, d]
        sequences = [self.teacher_sequence(t) for t in trajectories]
        h_t = self.teacher_hidden(sequences, latents, where)
        h_s = student_action_hidden(models, trajectories, where)
        head_s, head_t = lm_head(models.student), self.teacher_head()
        rewards = torch.tensor([t.reward for t in trajectories], device=device)
        lopd_adv = (2.0 * rewards - 1.0).float()  # eq. 12's A_i
        group_adv = torch.tensor([t.info["advantage"] for t in trajectories], device=device)
        # PPO-clip on the sampled tokens at the sampling temperature (one update per batch of
        # rollouts: rho = 1 in value, the gradient is the policy gradient).
        logp = lm_head_logprobs(head_s, h_s, where.targets, self.tau)
        ppo_tok = ppo_clip_loss(
            logp, logp.detach(), group_adv.float()[where.batch], p.clip_eps_low, p.clip_eps_high
        )
        ppo = segment_mean(ppo_tok, where.batch, b)
        # The kernel: top-M + tail KL_n (weighted in the topk form) and log pT(a_n) (weighted by
        # the privilege term's -beta A_i), gradients formed in its forward.
        beta = self.beta if p.dual else 0.0
        topk_w = p.distill_weight if p.distill == "topk" else 0.0
        w_kl = segment_mean_weights(where.batch, topk_w / num_total, b)
        w_t = segment_mean_weights(where.batch, -beta * lopd_adv / num_total, b)
        distilled = distill_rows(h_s, head_s, h_t, head_t, where.targets, s.spec, w_kl, w_t)
        out = distilled.output  # no gradient: it is in distilled.loss
        kl = segment_mean(out.kl.float(), where.batch, b)
        delta = lopd_adv * segment_mean(out.privilege.float(), where.batch, b)
        logp_t = None
        if p.distill == "sampled":
            with torch.no_grad():
                logp_t = lm_head_logprobs(head_t, h_t.detach(), where.targets, self.tau)
            iw = importance_weighted_reverse_kl(logp, logp.detach(), logp_t)
            distill = segment_mean(iw, where.batch, b)  # with its gradient
        else:
            distill = kl  # its gradient is in distilled.loss
        c = s.lopd
        if p.anchor and c.anchor_weight > 0:
            diff = latents.float() - latents0.float()
            anchor = diff.pow(2).flatten(1).mean(dim=1)
        else:
            anchor = torch.zeros(b, device=device)
        per_traj = (
            ppo + p.distill_weight * distill + beta * (c.margin - delta) + c.anchor_weight * anchor
        )
        loss = per_traj.sum() / num_total + (distilled.loss - distilled.loss.detach())
        grads = self.gradient_split(
            h_s, h_t, head_s, head_t, where, logp, group_adv, w_kl, b, num_total,
            logp_t,
        )  # fmt: skip
        with torch.no_grad():
            ratio = torch.exp(logp - logp.detach())
            clipped = ((ratio < 1.0 - p.clip_eps_low) | (ratio > 1.0 + p.clip_eps_high)).float()
            sums = {
                "kl": float(kl.sum()),
                "distill": float(distill.detach().sum()),
                "ppo": float(ppo.detach().sum()),
                "delta": float(delta.sum()),
                "anchor": float(anchor.detach().sum()),
                "advantage_abs": float(group_adv.abs().sum()),
                "clip_fraction": float(segment_mean(clipped, where.batch, b).sum()),
                "grad_ppo": grads.ppo * b,
                "grad_distill": grads.distill * b,
                "grad_cosine": grads.cosine * b,
            }
            sums.update(distill_metric_sums(out, where, b))
        return loss, sums

    def gradient_split(
        self,
        h_s: torch.Tensor,
        h_t: torch.Tensor,
        head_s: torch.nn.Module,
        head_t: torch.nn.Module,
        where: ActionRows,
        logp: torch.Tensor,
        group_adv: torch.Tensor,
        w_kl: torch.Tensor,
        b: int,
        num_total: int,
        logp_t: torch.Tensor | None,
    ) -> GradientSplit:
        """How the PPO and the weighted distillation terms push the student: the gradients each
        sends into the action rows' final hidden states ``[N, d]`` (recomputed on detached
        copies: the loss's own kernels form their gradients once, for the trainer's backward).

        Row ``n``'s hidden state feeds only token ``n``'s log-prob, so a term that is a function
        of the sampled tokens' log-probs (PPO, the sampled form) sends ``c_n grad log p(a_n)``
        with ``c_n`` its derivative in ``log p(a_n)``; the top-M + tail KL's comes from the
        kernel with the loss's row weights.
        """
        p, targets = self.ppo, where.targets
        with torch.enable_grad():
            lp = logp.detach().requires_grad_(True)
            adv = group_adv.float()[where.batch]
            ppo = ppo_clip_loss(lp, lp.detach(), adv, p.clip_eps_low, p.clip_eps_high)
            terms = [segment_mean(ppo, where.batch, b).sum() / num_total]
            if logp_t is not None:
                iw = importance_weighted_reverse_kl(lp, lp.detach(), logp_t)
                terms.append(p.distill_weight * segment_mean(iw, where.batch, b).sum() / num_total)
            coef = [torch.autograd.grad(t, lp)[0] for t in terms]
            h = h_s.detach().requires_grad_(True)
            w_s = full_weight(head_s).detach()
            hs, ws = autocast_cast(h, w_s)
            bias = getattr(head_s, "bias", None)
            lp_h = fused_linear_logprob(hs, ws, targets, bias=bias, temperature=self.tau)
            (rows,) = torch.autograd.grad(lp_h.logprob.sum(), h)  # row n: d log p(a_n) / d h_n
            g_ppo = coef[0][:, None] * rows
            if logp_t is not None:
                g_dist = coef[1][:, None] * rows
            else:
                h2 = h_s.detach().requires_grad_(True)
                hs2, ws2, ht, wt = autocast_cast(
                    h2, w_s, h_t.detach(), full_weight(head_t).detach()
                )
                spec = self.settings.spec
                kl = fused_linear_topk_tail_kl_loss(
                    hs2, ws2, ht, wt, targets, kl_weight=w_kl, top_m=spec.top_m,
                    temperature=spec.temperature, divergence=spec.divergence,
                    student_bias=getattr(head_s, "bias", None),
                    teacher_bias=getattr(head_t, "bias", None),
                )  # fmt: skip
                (g_dist,) = torch.autograd.grad(kl.loss, h2)
        # Each rank's loss is divided by total / world (lopd.parallel.lockstep): the norms of the
        # global loss's gradient on these rows are 1 / world of the rank's.
        world = self.ctx.dist.world if self.ctx.dist is not None else 1
        n_ppo, n_dist = float(g_ppo.norm()) / world, float(g_dist.norm()) / world
        dot = float((g_ppo.double() * g_dist.double()).sum()) / world**2
        cosine = dot / (n_ppo * n_dist) if n_ppo > 0 and n_dist > 0 else 0.0
        return GradientSplit(n_ppo, n_dist, cosine)

    # ---------------------------------------------------------------- 3. after the step
    def after_step(self, means: dict[str, float]) -> dict[str, float]:
        """Dual ascent on beta (``lopd_ppo.dual``), the teacher backbone's move, the bank's
        growth."""
        if self.ppo.dual:
            return super().after_step(means)
        self.teacher.after_step()
        out = {"beta": 0.0, "beta_next": 0.0, "margin": self.settings.lopd.margin}
        return {**out, **MethodBase.after_step(self, means)}
