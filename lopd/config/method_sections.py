"""The training methods' sections of a run's configuration (one YAML section each).

``lopd`` (LOPD's joint training, and the distillation settings other teachers borrow),
``lopd_ppo``, ``grpo``, ``opsd``, ``sdpo``, ``sdft`` and ``skill_sd``: each dataclass's attributes
document its fields and its ``validate`` checks them. Which method runs, how long and with which
optimizer settings is the ``train`` section's (:class:`lopd.config.sections.TrainConfig`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lopd.config.checks import at_least, greater_than, in_unit_interval, one_of, optional_at_least
from lopd_kernels import KL_DIVERGENCES

# ``lopd.context_format``: each text teacher's own wording, or LOPD's A.5 framing for all.
CONTEXT_FORMATS = ("own", "a5")
# ``lopd.teacher_backbone``: whose weights the latent teacher runs on.
TEACHER_BACKBONES = ("base", "sync", "ema")
# ``lopd_ppo.distill``: the form of LOPD-PPO's distillation term.
PPO_DISTILL_FORMS = ("topk", "sampled")

__all__ = [
    "CONTEXT_FORMATS",
    "PPO_DISTILL_FORMS",
    "TEACHER_BACKBONES",
    "GRPOConfig",
    "LOPDConfig",
    "LOPDPPOConfig",
    "OPSDConfig",
    "SDFTConfig",
    "SDPOConfig",
    "SkillSDConfig",
]


@dataclass
class LOPDConfig:
    """Joint training (paper 3.3, Algorithm 1, eq. 10-13) of ``train.method=lopd``, its ablations
    and ``lopd-ppo``; the other methods' teachers read its kernel settings (where their own
    section has none), ``null_context`` and ``context_format`` too.

    Attributes:
        top_m: M, teacher top-M support plus a tail bucket; ``None`` = full vocabulary.
        temperature: distillation temperature applied to both logits.
        divergence: ``reverse`` (paper) or ``forward`` KL.
        margin: m, the privileged margin.
        anchor_weight: lambda, weight of ``||c_phi - sg c_phi0||^2``.
        dual_lr: eta_beta, step size of the dual ascent on beta.
        beta_init: initial beta.
        fused_linear: compute the KL from final hidden states and ``lm_head`` with
            ``fused_linear_topk_tail_kl`` (no ``[N, V]`` logits; the default) instead of
            ``topk_tail_kl`` on the heads' ``[N, V]`` logits of the action rows (``false``).
        null_context: the null-context control: the teacher's privileged context is emptied
            (the same template with no demonstration, sibling or skill in it; LOPD's teacher
            reads zero latents, and so does the base model of ``eval.with_composer``), so a
            method whose loss leaves the policy alone without information should end where
            vanilla is. Every method with a teacher; not GRPO.
        context_format: the wording a text-conditioned teacher (OPSD, SDFT, SDPO, Skill-SD)
            reads its privileged context in: ``own`` (each method's paper wording and place:
            OPSD's system template, SDFT's and SDPO's user templates with the trajectory's
            trace, Skill-SD's skill block) or ``a5`` (every one of them in LOPD's A.5 framing
            of the first user message, a trajectory as the bank's A.3 experience text: the
            wording LOPD's latents and the embedded tiny model's references use, so every
            teacher has the same reader). LOPD's teacher reads A.5 either way; GRPO has none.
        teacher_backbone: whose weights LOPD's latent teacher runs on (``lopd`` and
            ``lopd-ppo``): ``base`` (the frozen base model, the paper's), ``sync`` (a copy of
            the student refreshed every ``teacher_sync_every`` optimizer steps, Skill-SD's
            teacher) or ``ema`` (an exponential moving average of the student, rate
            ``teacher_ema_rate`` per step, SDPO's). The composer's encoder stays the frozen base
            with its LoRA either way; a moved teacher carries no LoRA.
        teacher_sync_every: ``sync``: optimizer steps between copies (1: the student as it was
            before the step).
        teacher_ema_rate: ``ema``: the update rate per optimizer step.
    """

    top_m: int | None = 20
    temperature: float = 1.0
    divergence: str = "reverse"
    margin: float = 0.05
    anchor_weight: float = 0.2
    dual_lr: float = 0.5
    beta_init: float = 0.0
    fused_linear: bool = True
    null_context: bool = False
    context_format: str = "own"
    teacher_backbone: str = "base"
    teacher_sync_every: int = 1
    teacher_ema_rate: float = 0.05

    def validate(self) -> None:
        one_of(CONTEXT_FORMATS, lopd__context_format=self.context_format)
        one_of(TEACHER_BACKBONES, lopd__teacher_backbone=self.teacher_backbone)
        at_least(1, lopd__teacher_sync_every=self.teacher_sync_every)
        in_unit_interval(lopd__teacher_ema_rate=self.teacher_ema_rate)
        at_least(
            0,
            lopd__margin=self.margin,
            lopd__anchor_weight=self.anchor_weight,
            lopd__dual_lr=self.dual_lr,
            lopd__beta_init=self.beta_init,
        )
        greater_than(0, lopd__temperature=self.temperature)
        optional_at_least(1, lopd__top_m=self.top_m)
        one_of(KL_DIVERGENCES, lopd__divergence=self.divergence)


@dataclass
class LOPDPPOConfig:
    """LOPD-PPO (``train.method=lopd-ppo``): Skill-SD's loss with LOPD's latent teacher.

    PPO-clip on GRPO's group-normalized advantages plus ``distill_weight`` times a distillation
    term toward the latent-conditioned teacher (:mod:`lopd.methods.lopd_ppo`). The teacher, its
    backbone, the margin m, lambda, eta_beta, M and the kernel settings are the ``lopd``
    section's.

    Attributes:
        group_size: G, rollouts per task; a step draws ``max(1, train.tasks_per_step // G)``
            tasks.
        clip_eps_low, clip_eps_high: the PPO-clip range ``[1 - low, 1 + high]`` (Skill-SD's).
        distill: the distillation term: ``topk`` (LOPD's reverse KL over the teacher's top-M
            plus a tail bucket, gradient to the student and through the teacher to phi) or
            ``sampled`` (Skill-SD's importance-weighted sampled-token reverse KL at the sampling
            temperature, gradient to the student only).
        distill_weight: its weight beside the PPO term.
        dual: keep LOPD's privileged margin, ``beta (m - Delta)`` with dual ascent on beta
            (``false``: beta stays 0).
        anchor: keep LOPD's latent anchor ``lambda ||c_phi - sg c_phi0||^2``.
    """

    group_size: int = 4
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    distill: str = "topk"
    distill_weight: float = 0.1
    dual: bool = True
    anchor: bool = True

    def validate(self) -> None:
        at_least(1, lopd_ppo__group_size=self.group_size)
        greater_than(
            0, lopd_ppo__clip_eps_low=self.clip_eps_low, lopd_ppo__clip_eps_high=self.clip_eps_high
        )
        at_least(0, lopd_ppo__distill_weight=self.distill_weight)
        one_of(PPO_DISTILL_FORMS, lopd_ppo__distill=self.distill)


@dataclass
class GRPOConfig:
    """GRPO (paper B.1; ``train.method=grpo``).

    Attributes:
        group_size: G, rollouts per task; a step draws ``max(1, train.tasks_per_step // G)``
            tasks.
        clip_eps: PPO clip epsilon.
    """

    group_size: int = 4
    clip_eps: float = 0.2

    def validate(self) -> None:
        at_least(1, grpo__group_size=self.group_size)
        greater_than(0, grpo__clip_eps=self.clip_eps)


@dataclass
class OPSDConfig:
    """OPSD (paper B.1; ``train.method=opsd``): the distillation kernel of its frozen teacher.

    Attributes:
        top_m: teacher top-M support plus a tail bucket; ``None`` = the full vocabulary.
        divergence: ``forward`` (paper) or ``reverse`` KL. Temperature and ``fused_linear`` are
            the ``lopd`` section's.
    """

    top_m: int | None = None
    divergence: str = "forward"

    def validate(self) -> None:
        optional_at_least(1, opsd__top_m=self.top_m)
        one_of(KL_DIVERGENCES, opsd__divergence=self.divergence)


@dataclass
class SDPOConfig:
    """SDPO (paper B.1; ``train.method=sdpo``).

    Attributes:
        group_size: G, rollouts per task (a success is distilled into its siblings).
        ema_rate: the EMA teacher's update rate per optimizer step.
        divergence: ``reverse`` (paper) or ``forward`` KL over the teacher's top-M
            (``lopd.top_m``) plus a tail bucket.
    """

    group_size: int = 4
    ema_rate: float = 0.05
    divergence: str = "reverse"

    def validate(self) -> None:
        at_least(1, sdpo__group_size=self.group_size)
        in_unit_interval(sdpo__ema_rate=self.ema_rate)
        one_of(KL_DIVERGENCES, sdpo__divergence=self.divergence)


@dataclass
class SDFTConfig:
    """SDFT (paper B.1; ``train.method=sdft``): an EMA teacher with a demonstration as text.

    Attributes:
        ema_rate: alpha, the EMA teacher's update rate, applied after every optimizer step.
        top_m: teacher top-M support plus a tail bucket; ``None`` = the full vocabulary (paper).
        divergence: ``forward`` (paper) or ``reverse`` KL. Temperature and ``fused_linear`` are
            the ``lopd`` section's.
    """

    ema_rate: float = 0.01
    top_m: int | None = None
    divergence: str = "forward"

    def validate(self) -> None:
        in_unit_interval(sdft__ema_rate=self.ema_rate)
        optional_at_least(1, sdft__top_m=self.top_m)
        one_of(KL_DIVERGENCES, sdft__divergence=self.divergence)


@dataclass
class SkillSDConfig:
    """Skill-SD (paper B.1; ``train.method=skill-sd``): a skill-conditioned self-teacher.

    Attributes:
        group_size: G, rollouts per task (group-normalized advantages, as GRPO); a step draws
            ``max(1, train.tasks_per_step // G)`` tasks.
        clip_eps_low, clip_eps_high: the PPO-clip range ``[1 - low, 1 + high]``.
        sdl_weight: lambda_sdl, weight of the importance-weighted sampled-token reverse KL.
        ucb_c: c of the UCB1 skill choice (paper: sqrt 2).
        teacher_sync_every: the teacher is the student's weights copied every this many
            optimizer steps (1: the current student itself, no copy is kept).
        summarizer: who writes a skill from a task's rollouts: ``model`` (the student itself,
            greedy; a text missing one of the three sections falls back to the rule summary)
            or ``rule`` (the deterministic summarizer of :mod:`lopd.methods.skills`, the
            stand-in for models too small to write one, such as the tiny default).
        summary_max_tokens: token budget of a model-written skill.
        max_skills: bank capacity; the oldest skill leaves when a new one would exceed it.
    """

    group_size: int = 4
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    sdl_weight: float = 0.001
    ucb_c: float = math.sqrt(2.0)
    teacher_sync_every: int = 1
    summarizer: str = "model"
    summary_max_tokens: int = 256
    max_skills: int = 256

    def validate(self) -> None:
        at_least(
            1,
            skill_sd__group_size=self.group_size,
            skill_sd__teacher_sync_every=self.teacher_sync_every,
            skill_sd__summary_max_tokens=self.summary_max_tokens,
            skill_sd__max_skills=self.max_skills,
        )
        greater_than(
            0, skill_sd__clip_eps_low=self.clip_eps_low, skill_sd__clip_eps_high=self.clip_eps_high
        )
        at_least(0, skill_sd__sdl_weight=self.sdl_weight, skill_sd__ucb_c=self.ucb_c)
        one_of(("model", "rule"), skill_sd__summarizer=self.summarizer)
