"""Training methods: LOPD, its ablations and the baselines, one module each.

Every method runs inside the same :class:`~lopd.trainer.Trainer`: the same student, rollout
engine, optimizer, rollout-budget accounting (every generated rollout counts, bank included) and
held-out evaluation. They differ only in how a step's rollouts are drawn and in the loss
(paper B.1). ``train.method`` selects one of :data:`METHODS`:

==============  ==========================================================================
``lopd``        LOPD (:mod:`lopd.methods.lopd`).
``lopd-ppo``    Skill-SD's loss with LOPD's latent teacher: G rollouts per task, PPO-clip on
                group advantages plus a distillation term toward the latent-conditioned teacher
                (top-M + tail reverse KL or the sampled-token form), LOPD's margin and anchor
                (:mod:`lopd.methods.lopd_ppo`, ``lopd_ppo`` section).
``grpo``        G rollouts per task, group-normalized advantages, PPO-clip, token-level loss on
                the action tokens. No teacher (:mod:`lopd.methods.grpo`, ``grpo`` section).
``opsd``        Teacher = the frozen base model with one retrieved successful trajectory as text
                appended to its system message (B.1 wording); forward KL over the full
                vocabulary (:mod:`lopd.methods.opsd`, ``opsd`` section).
``sdpo``        Teacher = an EMA shadow of the student with a successful sibling of the same
                rollout group as text; reverse KL over the teacher's top-M plus a tail bucket.
                Trajectories without a successful sibling get no loss
                (:mod:`lopd.methods.sdpo`, ``sdpo`` section).
``sdft``        Teacher = an EMA shadow of the student (alpha 0.01) with a verified-successful
                trajectory of the shared pool as a demonstration appended to its first user
                message (B.1 wording); forward KL over the full vocabulary
                (:mod:`lopd.methods.sdft`, ``sdft`` section).
``skill-sd``    G rollouts per task; a skill (what works / what to avoid / suggested workflow)
                written from earlier rollout groups, chosen per task by UCB1, in the teacher's
                first user message (B.1 wording); PPO-clip (0.2 / 0.28) plus an
                importance-weighted sampled-token reverse KL (lambda_sdl 0.001)
                (:mod:`lopd.methods.skill_sd`, :mod:`lopd.methods.skills`, ``skill_sd`` section).
``lopd-frozen`` LOPD with the composer fixed at phi_0 (the teacher's latents are the cached
                ``c_phi0``; no composer gradient).
``lopd-m0``     LOPD with margin m = 0 (``lopd.margin`` is ignored).
==============  ==========================================================================

"Vanilla" is no training: the trainer's ``eval_vanilla.json``.

Adding a method: write a module with a class that follows :class:`~lopd.methods.base.Method`
(usually a :class:`~lopd.methods.base.MethodBase` subclass with a ``from_config``), reuse the
helpers (:mod:`~lopd.methods.rows`, :mod:`~lopd.methods.text_teacher`,
:mod:`~lopd.methods.groups`, :mod:`~lopd.methods.ema`), put its settings in a config section,
and add a :class:`~lopd.methods.base.MethodSpec` to :data:`METHODS` below.
"""

from __future__ import annotations

from lopd.methods.base import Method, MethodBase, MethodContext, MethodSpec
from lopd.methods.grpo import GRPOMethod
from lopd.methods.lopd import LOPDMethod
from lopd.methods.lopd_ppo import LOPDPPOMethod
from lopd.methods.opsd import OPSDMethod
from lopd.methods.sdft import SDFTMethod
from lopd.methods.sdpo import SDPOMethod
from lopd.methods.skill_sd import SkillSDMethod
from lopd.run.context import Models

__all__ = [
    "METHODS",
    "GRPOMethod",
    "LOPDMethod",
    "LOPDPPOMethod",
    "Method",
    "MethodBase",
    "MethodContext",
    "MethodSpec",
    "Models",
    "OPSDMethod",
    "SDFTMethod",
    "SDPOMethod",
    "SkillSDMethod",
]

METHODS: dict[str, MethodSpec] = {
    spec.name: spec
    for spec in (
        MethodSpec(
            "lopd",
            LOPDMethod.from_config,
            "LOPD: latent-conditioned teacher, top-M + tail KL, privileged margin, anchor",
            uses_composer=True,
            reward_term=False,
        ),
        MethodSpec(
            "lopd-ppo",
            LOPDPPOMethod.from_config,
            "LOPD-PPO: PPO-clip on group advantages + distillation toward LOPD's latent teacher",
            uses_composer=True,
            group_size=lambda cfg: cfg.lopd_ppo.group_size,
        ),
        MethodSpec(
            "grpo",
            GRPOMethod.from_config,
            "GRPO: group-normalized advantages, PPO-clip; no teacher",
            group_size=lambda cfg: cfg.grpo.group_size,
            has_teacher=False,
        ),
        MethodSpec(
            "opsd",
            OPSDMethod.from_config,
            "OPSD: frozen base teacher with a retrieved trajectory as text, forward KL",
            uses_bank=True,
            reward_term=False,
        ),
        MethodSpec(
            "sdpo",
            SDPOMethod.from_config,
            "SDPO: EMA teacher with a successful sibling as text, reverse top-M + tail KL",
            group_size=lambda cfg: cfg.sdpo.group_size,
            reward_term=False,
        ),
        MethodSpec(
            "sdft",
            SDFTMethod.from_config,
            "SDFT: EMA teacher with a pool demonstration in the first user message, forward KL",
            uses_bank=True,
            reward_term=False,
        ),
        MethodSpec(
            "skill-sd",
            SkillSDMethod.from_config,
            "Skill-SD: UCB1-chosen skill in the teacher prompt, PPO-clip + IW reverse KL",
            group_size=lambda cfg: cfg.skill_sd.group_size,
        ),
        MethodSpec(
            "lopd-frozen",
            lambda ctx, cfg: LOPDMethod.from_config(ctx, cfg, frozen_composer=True),
            "LOPD with the composer fixed at phi_0 (ablation)",
            uses_composer=True,
            reward_term=False,
        ),
        MethodSpec(
            "lopd-m0",
            lambda ctx, cfg: LOPDMethod.from_config(ctx, cfg, margin=0.0),
            "LOPD with margin m = 0 (ablation)",
            uses_composer=True,
            reward_term=False,
        ),
    )
}
"""Every training method, ``train.method`` name -> :class:`~lopd.methods.base.MethodSpec`, in
the order reports list them."""
