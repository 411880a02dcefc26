"""The named base configurations (``--preset``) and the YAML files generated from them.

``lopd/config/yaml/<name>.yaml`` are generated from :data:`PRESETS` (:func:`preset_yaml`;
``python -m lopd.config --write-presets``; a test checks they are current).
"""

from __future__ import annotations

import typing
from pathlib import Path

from lopd.config.config import Config

__all__ = ["COMPARE_BUDGETS", "PRESETS", "PRESET_DIR", "preset_yaml"]


def _default() -> Config:
    """The tiny default: the shipped tiny Qwen3 on built-in tool-use tasks, <= 15 min on 2 CPUs.

    Hyper-parameters tuned for the tiny randomly-pretrained model (not the paper's values):
    - K=8, J=2, 2 QFormer layers: the tiny model's contexts are short and its width small; 32x3
      latents would dominate its attention and cost time without adding information.
    - lr 1e-4 (student) and 3e-4 (composer), 300 cold-start steps at 1e-3: a 1e-5 step barely
      moves a tiny model within the few dozen steps the time budget allows. 300 cold-start
      steps, chosen on the val split (one sampling seed, 32 tasks): base + composer 0.354 vs
      0.307 with 60 steps, base alone 0.182.
    - margin 0.05, lambda 0.2, eta_beta 0.5, M 20: the paper's values, which are scale-free.
    - Skill-SD's skills come from the deterministic rule summarizer: the 1M-parameter tiny model
      cannot write a skill summary (a stand-in, see :mod:`lopd.methods.skills`).
    """
    cfg = Config(run_dir="runs/default")
    cfg.data.n_train, cfg.data.n_test = 48, 32
    cfg.gen.max_new_tokens, cfg.gen.max_steps = 48, 6
    cfg.bank.rollouts_per_task = 2
    cfg.composer.num_latents, cfg.composer.num_retrieved = 8, 2
    cfg.composer.qformer_layers = 2
    cfg.composer.max_encoder_tokens = 256
    cfg.cold_start.steps, cfg.cold_start.batch_size, cfg.cold_start.lr = 300, 4, 1e-3
    cfg.train.steps, cfg.train.tasks_per_step, cfg.train.micro_batch = 30, 8, 4
    cfg.train.lr, cfg.train.composer_lr = 1e-4, 3e-4
    cfg.skill_sd.summarizer = "rule"
    cfg.checkpoint_every = 10
    return cfg


def _smoke() -> Config:
    """A seconds-long end-to-end run used by the tests: every phase runs, nothing converges."""
    cfg = _default()
    cfg.run_dir = "runs/smoke"
    cfg.data.n_train, cfg.data.n_test = 6, 4
    cfg.gen.max_new_tokens, cfg.gen.max_steps = 16, 2
    cfg.bank.rollouts_per_task = 1
    cfg.bank.min_reward = 0.0  # keep the bank non-empty whatever the tiny model does
    cfg.composer.num_latents, cfg.composer.num_retrieved = 4, 2
    cfg.composer.qformer_layers = 1
    cfg.composer.max_encoder_tokens = 128
    cfg.cold_start.steps, cfg.cold_start.batch_size = 2, 2
    cfg.train.steps, cfg.train.tasks_per_step, cfg.train.micro_batch = 3, 2, 2
    cfg.checkpoint_every = 2
    return cfg


def _paper() -> Config:
    """The paper's setting for real checkpoints (Qwen3-4B/8B): pass ``--model PATH`` and
    ``--tasks FILE`` (2349 train / 200 test tasks; the built-in generator has 600 / 120).

    bf16 compute over float32 master weights (:mod:`lopd.parallel.precision`), checkpoints every 20
    steps, the last one without optimizer state (the deployable student and phi are saved
    separately).
    """
    cfg = Config(run_dir="runs/paper")
    cfg.model.dtype = "bfloat16"
    cfg.model.gradient_checkpointing = True
    cfg.data.n_train, cfg.data.n_test = 2349, 200
    cfg.gen.max_new_tokens, cfg.gen.max_steps = 2048, 30
    # Qwen3's 40,960-token context (the paper's budget) less 512 for the latent teacher's
    # framing text and J*K=96 placeholders, which it reads on top of a whole trajectory.
    cfg.gen.max_total_tokens = 40_960 - 512
    cfg.gen.temperature, cfg.gen.top_p, cfg.gen.top_k = 0.7, 0.95, 20
    cfg.bank.rollouts_per_task, cfg.bank.min_reward = 4, 1.0
    cfg.composer.num_latents, cfg.composer.num_retrieved = 32, 3
    cfg.composer.qformer_layers, cfg.composer.ffn_mult = 8, 4
    cfg.composer.max_encoder_tokens = 2048
    cfg.cold_start.steps, cfg.cold_start.batch_size = 500, 8
    cfg.cold_start.lr, cfg.cold_start.grad_clip = 1e-5, 3.0
    cfg.train.steps, cfg.train.tasks_per_step, cfg.train.micro_batch = 200, 32, 1
    cfg.train.lr = cfg.train.composer_lr = 1e-5
    cfg.train.grad_clip = 1.0
    cfg.lopd.top_m, cfg.lopd.margin, cfg.lopd.anchor_weight, cfg.lopd.dual_lr = 20, 0.05, 0.2, 0.5
    cfg.eval.every = 20
    cfg.checkpoint_every = 20
    cfg.checkpoint_final_optimizer = False
    return cfg


def _compare() -> Config:
    """One run of the default comparison (``python -m lopd.compare``, 12 runs x 3 seeds).

    The paper's budget shape in miniature: :data:`COMPARE_BUDGETS` (640) generated rollouts per
    run, bank included, learning curves on 64 held-out tasks (greedy, every 8 steps), 48 train
    tasks, 6 environment steps of <= 48 tokens, two bank rollouts per train task, the default's
    300 cold-start steps (chosen on val), 8 rollouts per step (``train.steps`` is set per method
    from the budget). Wall time on 2 CPU cores (``--jobs 3``): 52.3 minutes for the eight methods
    evaluated every 17 steps (2026-12-02); the twelve runs evaluated every 8 steps take about
    2.5 hours (from the per-run wall times of docs/results.md, 2026-12-06).
    """
    cfg = _default()
    cfg.run_dir = "runs/compare"
    # The default's 48-token turns and 6 steps (a house-rule episode takes up to 5 calls of up
    # to ~40 tokens) and 96 bank rollouts: the shipped tiny model fully solves 4-12% of train
    # tasks, and LOPD, OPSD and SDFT need num_retrieved + 1 = 3 entries (with 32 x 4 and 24
    # rollouts the bank held 1, with 48 rollouts 2 for one seed).
    cfg.data.n_train, cfg.data.n_test = 48, 64
    cfg.bank.rollouts_per_task = 2
    cfg.train.tasks_per_step, cfg.train.micro_batch = 8, 8
    cfg.eval.with_composer = False
    cfg.eval.every = 8
    cfg.checkpoint_every = 0
    cfg.log_every = 1000
    return cfg


def _compare_quick() -> Config:
    """One run of ``python -m lopd.compare --quick``: seconds-scale plumbing, nothing converges.

    The smoke preset with 8 train / 4 held-out tasks and 4 rollouts per step.
    """
    cfg = _smoke()
    cfg.run_dir = "runs/compare-quick"
    cfg.data.n_train, cfg.data.n_test = 8, 4
    cfg.train.tasks_per_step, cfg.train.micro_batch = 4, 4
    cfg.eval.with_composer = False
    cfg.eval.every = 2
    cfg.checkpoint_every = 0
    cfg.log_every = 1000
    return cfg


PRESETS: dict[str, typing.Callable[[], Config]] = {
    "default": _default,
    "smoke": _smoke,
    "paper": _paper,
    "compare": _compare,
    "compare-quick": _compare_quick,
}
"""Named base configurations. ``lopd/config/yaml/<name>.yaml`` are generated from them
(:func:`preset_yaml`; ``python -m lopd.config --write-presets``)."""

COMPARE_BUDGETS: dict[str, int] = {"compare": 640, "compare-quick": 16}
"""Generated rollouts per run (bank included) of ``python -m lopd.compare`` for its presets:
LOPD trains ``(budget - bank) / tasks_per_step`` steps (compare: 68), bank-free methods
``budget / tasks_per_step`` (compare: 80)."""

PRESET_DIR = Path(__file__).resolve().parent / "yaml"
"""Where the generated preset YAML files live."""


def preset_yaml(name: str) -> str:
    """The text of ``lopd/config/yaml/<name>.yaml``: the preset's values with its docstring's
    first paragraph as a header comment."""
    make = PRESETS[name]
    summary = (make.__doc__ or name).strip().split("\n\n")[0]
    header = [f"# {line.strip()}".rstrip() for line in summary.splitlines()]
    header += [
        f"# Generated from lopd.config.presets.PRESETS[{name!r}]; do not edit: change the preset",
        "# and run `python -m lopd.config --write-presets` (tests check this file is current).",
    ]
    return "\n".join(header) + "\n" + make().to_yaml()
