"""Run configuration: the config, its validation, presets, YAML files and ``key=value`` overrides.

The sections (``model``, ``data``, ``gen``, ``bank``, ``composer``, ``cold_start``, ``lopd``,
``grpo``, ``opsd``, ``sdpo``, ``sdft``, ``skill_sd``, ``eval``) are dataclasses in
:mod:`lopd.config_sections`, importable from here.

One :class:`Config` object describes a whole run and is saved as ``config.yaml`` in the run
directory. It is built in three layers, later ones winning:

1. a preset (``default``, ``smoke``, ``paper``, ``compare`` or ``compare-quick``, see
   :data:`PRESETS`; written once here, ``lopd/configs/<name>.yaml`` are generated from them),
2. an optional YAML file (``--config``) with the same nested layout as :class:`Config`,
3. ``section.field=value`` overrides from the command line (values parsed as YAML scalars and
   type-checked against the field).

:meth:`Config.validate` runs at start-up and names the offending field (or tasks-file line), so a
bad value stops the run before any model is loaded.

Example:
    >>> cfg = load_config(preset="smoke", overrides=["lopd.margin=0.1", "seed=3"])
    >>> cfg.lopd.margin
    0.1
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lopd.config_sections import (
    BankConfig,
    ColdStartConfig,
    ComposerConfig,
    DataConfig,
    EvalConfig,
    GenConfig,
    GRPOConfig,
    LOPDConfig,
    ModelConfig,
    OPSDConfig,
    SDFTConfig,
    SDPOConfig,
    SkillSDConfig,
)
from lopd.memory.embedders import DOCUMENT_STYLES
from lopd_kernels import DIVERGENCES

ENGINES = ("hf", "vllm")
"""The rollout engines ``gen.engine`` names (:mod:`lopd.rollout`, :mod:`lopd.vllm_engine`)."""

__all__ = [
    "COMPARE_BUDGETS",
    "PRESETS",
    "BankConfig",
    "BankTooSmallError",
    "ColdStartConfig",
    "ComposerConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "GRPOConfig",
    "GenConfig",
    "LOPDConfig",
    "ModelConfig",
    "OPSDConfig",
    "SDFTConfig",
    "SDPOConfig",
    "SkillSDConfig",
    "load_config",
    "preset_yaml",
]


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field (or file line)."""


class BankTooSmallError(ConfigError):
    """The experience bank cannot serve ``composer.num_retrieved`` experiences per task.

    Attributes:
        bank_size: entries in the bank (0: the base model had no rollout with reward >=
            ``bank.min_reward``).
    """

    def __init__(self, message: str, bank_size: int) -> None:
        super().__init__(message)
        self.bank_size = bank_size


@dataclass
class Config:
    """One run. Field docs are on the section classes.

    Attributes:
        seed: seeds tasks, rollouts, initialization and data order.
        run_dir: output directory (config, metrics.jsonl, TensorBoard, checkpoints, summary).
        checkpoint_every: save a checkpoint every this many LOPD steps (0 = only at the end).
        checkpoint_keep: how many of the newest checkpoints to keep (older ones are deleted).
        checkpoint_final_optimizer: the final step's checkpoint holds the optimizer states too
            (``false``: student, phi and the method's state only, about a quarter of the size
            under mixed precision; a run resumed from it to train further restarts AdamW).
        profile_memory: log a memory account per phase (weights, gradients, optimizer state,
            activations, allocator; :mod:`lopd.memory_account`) to ``memory.jsonl``.
        log_every: print a progress line every this many steps.
        threads: torch CPU threads per process; 0 = 1 on CPU. One thread is the default because
            small models gain little from intra-op threads while OpenMP spin-waiting on a shared
            or oversubscribed CPU slows them by an order of magnitude (measured: 4 tiny-model
            rollouts 2.5 s with 1 thread, 34 s with 2, on a loaded 2-core machine).
    """

    seed: int = 0
    run_dir: str = "runs/lopd"
    checkpoint_every: int = 10
    checkpoint_keep: int = 2
    checkpoint_final_optimizer: bool = True
    profile_memory: bool = False
    log_every: int = 1
    threads: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    gen: GenConfig = field(default_factory=GenConfig)
    bank: BankConfig = field(default_factory=BankConfig)
    composer: ComposerConfig = field(default_factory=ComposerConfig)
    cold_start: ColdStartConfig = field(default_factory=ColdStartConfig)
    lopd: LOPDConfig = field(default_factory=LOPDConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    opsd: OPSDConfig = field(default_factory=OPSDConfig)
    sdpo: SDPOConfig = field(default_factory=SDPOConfig)
    sdft: SDFTConfig = field(default_factory=SDFTConfig)
    skill_sd: SkillSDConfig = field(default_factory=SkillSDConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    # ------------------------------------------------------------------ (de)serialization
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_yaml())

    def update(self, mapping: dict[str, Any], source: str = "config") -> None:
        """Apply a nested mapping (as in a YAML file) with type checks.

        Raises:
            ConfigError: unknown key or a value of the wrong type; names ``section.field``.
        """
        _apply_mapping(self, mapping, prefix="", source=source)

    def set(self, dotted: str, value: Any, source: str = "override") -> None:
        """Set ``section.field`` (or a top-level field) to ``value`` with a type check."""
        obj: Any = self
        parts = dotted.split(".")
        for i, part in enumerate(parts[:-1]):
            sub = getattr(obj, part, None) if _has_field(obj, part) else None
            if not dataclasses.is_dataclass(sub):
                raise ConfigError(f"{source}: unknown config section {'.'.join(parts[: i + 1])!r}")
            obj = sub
        _set_field(obj, parts[-1], value, dotted, source)

    # ------------------------------------------------------------------ validation
    def validate(self, check_paths: bool = True) -> None:
        """Check values before anything is loaded.

        Args:
            check_paths: also check that ``model.path`` exists and that every line of
                ``data.tasks_path`` is a valid task.

        Raises:
            ConfigError: naming the field (or the tasks-file line) at fault.
        """

        # Every number finite first: NaN passes every "< 0" / "<= 0" check below and would train
        # on a NaN loss (or crash seconds later with a traceback).
        def numbers(obj: Any, prefix: str) -> typing.Iterator[tuple[str, float]]:
            for f in dataclasses.fields(obj):
                value = getattr(obj, f.name)
                if dataclasses.is_dataclass(value):
                    yield from numbers(value, f"{prefix}{f.name}.")
                elif isinstance(value, float):
                    yield f"{prefix}{f.name}", value

        for name, value in numbers(self, ""):
            if not float("-inf") < value < float("inf"):
                raise ConfigError(f"{name} must be a finite number, got {value}")
        positive = {
            "composer.num_latents": self.composer.num_latents,
            "composer.num_retrieved": self.composer.num_retrieved,
            "composer.qformer_layers": self.composer.qformer_layers,
            "composer.ffn_mult": self.composer.ffn_mult,
            "composer.lora_r": self.composer.lora_r,
            "composer.max_encoder_tokens": self.composer.max_encoder_tokens,
            "lopd.tasks_per_step": self.lopd.tasks_per_step,
            "lopd.micro_batch": self.lopd.micro_batch,
            "cold_start.batch_size": self.cold_start.batch_size,
            "gen.max_new_tokens": self.gen.max_new_tokens,
            "gen.max_steps": self.gen.max_steps,
            "data.n_train": self.data.n_train,
            "data.n_test": self.data.n_test,
            "bank.rollouts_per_task": self.bank.rollouts_per_task,
        }
        for name, value in positive.items():
            if value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
        non_negative = {
            "lopd.margin": self.lopd.margin,
            "lopd.anchor_weight": self.lopd.anchor_weight,
            "lopd.dual_lr": self.lopd.dual_lr,
            "lopd.beta_init": self.lopd.beta_init,
            "lopd.lr": self.lopd.lr,
            "lopd.composer_lr": self.lopd.composer_lr,
            "lopd.weight_decay": self.lopd.weight_decay,
            "lopd.steps": self.lopd.steps,
            "cold_start.steps": self.cold_start.steps,
            "cold_start.lr": self.cold_start.lr,
            "composer.lora_dropout": self.composer.lora_dropout,
            "gen.temperature": self.gen.temperature,
            "eval.temperature": self.eval.temperature,
            "eval.every": self.eval.every,
            "checkpoint_every": self.checkpoint_every,
            "threads": self.threads,
        }
        for name, value in non_negative.items():
            if value < 0:
                raise ConfigError(f"{name} must be >= 0, got {value}")
        for name, value in {
            "lopd.grad_clip": self.lopd.grad_clip,
            "cold_start.grad_clip": self.cold_start.grad_clip,
            "lopd.temperature": self.lopd.temperature,
            "log_every": self.log_every,
        }.items():
            if value <= 0:
                raise ConfigError(f"{name} must be > 0, got {value}")
        if (
            self.data.eval_split == "val"
            and self.data.domain == "coding"
            and not self.data.tasks_path
        ):
            raise ConfigError("data.eval_split 'val': the built-in coding tasks have no val split")
        if self.data.task_seed is not None and self.data.task_seed < 0:
            raise ConfigError(f"data.task_seed must be >= 0 or null, got {self.data.task_seed}")
        if self.lopd.top_m is not None and self.lopd.top_m < 1:
            raise ConfigError(f"lopd.top_m must be >= 1 or null, got {self.lopd.top_m}")
        if not 0.0 < self.gen.top_p <= 1.0:
            raise ConfigError(f"gen.top_p must be in (0, 1], got {self.gen.top_p}")
        if self.gen.top_k < 0:
            raise ConfigError(f"gen.top_k must be >= 0 (0 disables it), got {self.gen.top_k}")
        if not 0.0 <= self.bank.min_reward <= 1.0:
            raise ConfigError(f"bank.min_reward must be in [0, 1], got {self.bank.min_reward}")
        choices = {
            "lopd.divergence": (self.lopd.divergence, DIVERGENCES),
            "data.domain": (self.data.domain, ("tool_use", "coding")),
            "data.eval_split": (self.data.eval_split, ("test", "val")),
            "model.dtype": (self.model.dtype, ("float32", "bfloat16", "float16")),
            "bank.document_style": (self.bank.document_style, DOCUMENT_STYLES),
        }
        for name, (value, allowed) in choices.items():
            if value not in allowed:
                raise ConfigError(f"{name} must be one of {allowed}, got {value!r}")
        if not (
            self.model.device in ("auto", "cpu", "cuda") or self.model.device.startswith("cuda:")
        ):
            raise ConfigError(
                f"model.device must be auto, cpu or cuda[:N], got {self.model.device!r}"
            )
        self._validate_sections()
        self._validate_budgets_and_precision()
        if not check_paths:
            return
        if self.model.path is not None:
            path = Path(self.model.path)
            if not path.is_dir() or not (path / "config.json").is_file():
                raise ConfigError(
                    f"model.path {self.model.path!r} is not a Hugging Face checkpoint directory "
                    "(missing directory or config.json)"
                )
        if self.data.tasks_path is not None:
            check_tasks_file(self.data.tasks_path)

    def _validate_sections(self) -> None:
        """The parallelism choice and the baselines' sections."""
        if self.model.parallel not in ("ddp", "fsdp2"):
            raise ConfigError(
                f"model.parallel must be one of ('ddp', 'fsdp2'), got {self.model.parallel!r}"
            )
        for name, value in {
            "grpo.group_size": self.grpo.group_size,
            "sdpo.group_size": self.sdpo.group_size,
            "skill_sd.group_size": self.skill_sd.group_size,
            "skill_sd.teacher_sync_every": self.skill_sd.teacher_sync_every,
            "skill_sd.summary_max_tokens": self.skill_sd.summary_max_tokens,
            "skill_sd.max_skills": self.skill_sd.max_skills,
        }.items():
            if value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
        if not self.grpo.clip_eps > 0:
            raise ConfigError(f"grpo.clip_eps must be > 0, got {self.grpo.clip_eps}")
        if not 0.0 <= self.sdpo.ema_rate <= 1.0:
            raise ConfigError(f"sdpo.ema_rate must be in [0, 1], got {self.sdpo.ema_rate}")
        if not 0.0 <= self.sdft.ema_rate <= 1.0:
            raise ConfigError(f"sdft.ema_rate must be in [0, 1], got {self.sdft.ema_rate}")
        for name, value in {
            "skill_sd.clip_eps_low": self.skill_sd.clip_eps_low,
            "skill_sd.clip_eps_high": self.skill_sd.clip_eps_high,
        }.items():
            if not value > 0:
                raise ConfigError(f"{name} must be > 0, got {value}")
        for name, value in {
            "skill_sd.sdl_weight": self.skill_sd.sdl_weight,
            "skill_sd.ucb_c": self.skill_sd.ucb_c,
        }.items():
            if value < 0:
                raise ConfigError(f"{name} must be >= 0, got {value}")
        if self.skill_sd.summarizer not in ("model", "rule"):
            raise ConfigError(
                f"skill_sd.summarizer must be one of ('model', 'rule'), got "
                f"{self.skill_sd.summarizer!r}"
            )
        for name, value in (("opsd.top_m", self.opsd.top_m), ("sdft.top_m", self.sdft.top_m)):
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1 or null, got {value}")
        for name, value in (
            ("opsd.divergence", self.opsd.divergence),
            ("sdpo.divergence", self.sdpo.divergence),
            ("sdft.divergence", self.sdft.divergence),
        ):
            if value not in DIVERGENCES:
                raise ConfigError(f"{name} must be one of {DIVERGENCES}, got {value!r}")

    def _validate_budgets_and_precision(self) -> None:
        """Token budgets (:mod:`lopd.budget` checks them against the model at start-up), fixed
        batch sizes, checkpoints, the attention backend and the precision."""
        g = self.gen
        for name, value in {
            "gen.rollout_batch_size": g.rollout_batch_size,
            "bank.embed_batch_size": self.bank.embed_batch_size,
            "bank.embed_max_length": self.bank.embed_max_length,
            "bank.index_batch_size": self.bank.index_batch_size,
            "checkpoint_keep": self.checkpoint_keep,
        }.items():
            if value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
        if g.max_new_tokens >= g.max_total_tokens:
            raise ConfigError(
                f"gen.max_new_tokens={g.max_new_tokens} must be below gen.max_total_tokens="
                f"{g.max_total_tokens} (the trajectory holds the prompt too)"
            )
        if g.max_prompt_tokens is not None and not (
            1 <= g.max_prompt_tokens <= g.max_total_tokens - 2
        ):
            raise ConfigError(
                f"gen.max_prompt_tokens must be null or in [1, gen.max_total_tokens - 2 = "
                f"{g.max_total_tokens - 2}] (room for a generated token and the end of turn), "
                f"got {g.max_prompt_tokens}"
            )
        for name, value, allowed in (
            ("gen.prompt_overflow", g.prompt_overflow, ("error", "drop")),
            (
                "model.attn_implementation",
                self.model.attn_implementation,
                ("auto", "eager", "sdpa", "flash_attention_2"),
            ),
        ):
            if value not in allowed:
                raise ConfigError(f"{name} must be one of {allowed}, got {value!r}")
        if self.model.attn_implementation == "flash_attention_2":
            if self.model.dtype == "float32":
                raise ConfigError(
                    "model.attn_implementation=flash_attention_2 needs model.dtype bfloat16 or "
                    "float16 (flash-attn has no float32 kernels)"
                )
            if self.model.device == "cpu":
                raise ConfigError(
                    "model.attn_implementation=flash_attention_2 needs a CUDA device, got "
                    "model.device=cpu"
                )
        self._validate_engine()
        if self.model.dtype == "float16" and self.model.parallel == "fsdp2":
            raise ConfigError(
                "model.dtype=float16 with model.parallel=fsdp2 is not supported (the loss "
                "scaler does not unscale sharded gradients); use bfloat16"
            )

    def _validate_engine(self) -> None:
        """``gen.engine`` and the combinations the vLLM engine does not support."""
        g = self.gen
        if g.engine not in ENGINES:
            raise ConfigError(f"gen.engine must be one of {ENGINES}, got {g.engine!r}")
        if g.engine != "vllm":
            return
        if not 0.0 < g.vllm_gpu_memory_utilization <= 1.0:
            raise ConfigError(
                "gen.vllm_gpu_memory_utilization must be in (0, 1], got "
                f"{g.vllm_gpu_memory_utilization}"
            )
        if g.vllm_kv_cache_gib is not None and not g.vllm_kv_cache_gib > 0:
            raise ConfigError(
                f"gen.vllm_kv_cache_gib must be null or > 0, got {g.vllm_kv_cache_gib}"
            )
        if self.model.parallel == "fsdp2":
            raise ConfigError(
                "gen.engine=vllm with model.parallel=fsdp2 is not supported (the engine needs "
                "the full student on every rank); use model.parallel=ddp or gen.engine=hf"
            )
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            from lopd.vllm_engine import INSTALL_HINT

            raise ConfigError(f"gen.engine=vllm needs vLLM, which is not installed: {INSTALL_HINT}")

    def check_bank_size(self, bank_size: int) -> None:
        """J must not exceed what the retriever can return (the bank minus the task itself).

        Raises:
            BankTooSmallError: naming ``composer.num_retrieved``.
        """
        if self.composer.num_retrieved > bank_size - 1:
            raise BankTooSmallError(
                f"composer.num_retrieved={self.composer.num_retrieved} is larger than the "
                f"experience bank allows ({bank_size} entries; a task never retrieves itself, so "
                f"at most {max(bank_size - 1, 0)}): lower composer.num_retrieved or collect a "
                "larger bank (bank.rollouts_per_task, data.n_train)",
                bank_size,
            )


def check_tasks_file(path: str | Path) -> None:
    """Check that every non-empty line of a tasks JSONL file is a loadable task.

    Lines are parsed by :func:`lopd.envs.load_tasks_jsonl` (the native ``Task`` format, TACO and
    LiveCodeBench rows), so a file that passes here loads in the trainer.

    Raises:
        ConfigError: ``data.tasks_path <file> line N: <what is wrong>``.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"data.tasks_path {str(path)!r} does not exist")
    n = 0
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ConfigError(
                    f"data.tasks_path {str(path)!r} line {lineno}: not valid UTF-8 ({err.reason} "
                    f"at byte {err.start})"
                ) from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(
                    f"data.tasks_path {str(path)!r} line {lineno}: not valid JSON ({err.msg})"
                ) from None
            if not isinstance(obj, dict):
                raise ConfigError(
                    f"data.tasks_path {str(path)!r} line {lineno}: expected a JSON object, got "
                    f"{type(obj).__name__}"
                )
            n += 1
    if n == 0:
        raise ConfigError(f"data.tasks_path {str(path)!r} holds no tasks")
    from lopd.envs import load_tasks_jsonl

    try:
        load_tasks_jsonl(path)
    except ValueError as err:
        # The loader's message starts with "<path>:<line>:"; say "line N" like the checks above.
        msg = str(err)
        prefix = f"{path}:"
        if msg.startswith(prefix):
            lineno, _, rest = msg[len(prefix) :].partition(":")
            msg = f"line {lineno}:{rest}"
        raise ConfigError(f"data.tasks_path {str(path)!r} {msg}") from None


# ---------------------------------------------------------------------------------- presets
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
    cfg.lopd.steps, cfg.lopd.tasks_per_step, cfg.lopd.micro_batch = 30, 8, 4
    cfg.lopd.lr, cfg.lopd.composer_lr = 1e-4, 3e-4
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
    cfg.lopd.steps, cfg.lopd.tasks_per_step, cfg.lopd.micro_batch = 3, 2, 2
    cfg.checkpoint_every = 2
    return cfg


def _paper() -> Config:
    """The paper's setting for real checkpoints (Qwen3-4B/8B): pass ``--model PATH`` and
    ``--tasks FILE`` (2349 train / 200 test tasks; the built-in generator has 600 / 120).

    bf16 compute over float32 master weights (:mod:`lopd.precision`), checkpoints every 20
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
    cfg.lopd.steps, cfg.lopd.tasks_per_step, cfg.lopd.micro_batch = 200, 32, 1
    cfg.lopd.lr = cfg.lopd.composer_lr = 1e-5
    cfg.lopd.grad_clip = 1.0
    cfg.lopd.top_m, cfg.lopd.margin, cfg.lopd.anchor_weight, cfg.lopd.dual_lr = 20, 0.05, 0.2, 0.5
    cfg.lopd.fused_linear = True
    cfg.eval.every = 20
    cfg.checkpoint_every = 20
    cfg.checkpoint_final_optimizer = False
    return cfg


def _compare() -> Config:
    """One run of the default comparison (``python -m lopd.compare``, 8 methods x 3 seeds).

    The paper's budget shape in miniature: :data:`COMPARE_BUDGETS` (640) generated rollouts per
    run, bank included, learning curves on 64 held-out tasks (greedy, every 17 steps), 48 train
    tasks, 6 environment steps of <= 48 tokens, two bank rollouts per train task, the default's
    300 cold-start steps (chosen on val), 8 rollouts per step (``lopd.steps`` is set per method
    from the budget). Measured: 52.3 minutes on 2 CPU cores (``--jobs 3``, 2026-12-02).
    """
    cfg = _default()
    cfg.run_dir = "runs/compare"
    # The default's 48-token turns and 6 steps (a house-rule episode takes up to 5 calls of up
    # to ~40 tokens) and 96 bank rollouts: the shipped tiny model fully solves 4-12% of train
    # tasks, and LOPD, OPSD and SDFT need num_retrieved + 1 = 3 entries (with 32 x 4 and 24
    # rollouts the bank held 1, with 48 rollouts 2 for one seed).
    cfg.data.n_train, cfg.data.n_test = 48, 64
    cfg.bank.rollouts_per_task = 2
    cfg.lopd.tasks_per_step, cfg.lopd.micro_batch = 8, 8
    cfg.eval.with_composer = False
    cfg.eval.every = 17
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
    cfg.lopd.tasks_per_step, cfg.lopd.micro_batch = 4, 4
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
"""Named base configurations. ``lopd/configs/<name>.yaml`` are generated from them
(:func:`preset_yaml`; ``python -m lopd.config --write-presets``)."""

COMPARE_BUDGETS: dict[str, int] = {"compare": 640, "compare-quick": 16}
"""Generated rollouts per run (bank included) of ``python -m lopd.compare`` for its presets:
LOPD trains ``(budget - bank) / tasks_per_step`` steps (compare: 68), bank-free methods
``budget / tasks_per_step`` (compare: 80)."""

PRESET_DIR = Path(__file__).resolve().parent / "configs"
"""Where the generated preset YAML files live."""


def preset_yaml(name: str) -> str:
    """The text of ``lopd/configs/<name>.yaml``: the preset's values with its docstring's
    first paragraph as a header comment."""
    make = PRESETS[name]
    summary = (make.__doc__ or name).strip().split("\n\n")[0]
    header = [f"# {line.strip()}".rstrip() for line in summary.splitlines()]
    header += [
        f"# Generated from lopd.config.PRESETS[{name!r}]; do not edit: change the preset and run",
        "# `python -m lopd.config --write-presets` (tests check that this file is current).",
    ]
    return "\n".join(header) + "\n" + make().to_yaml()


def main(argv: list[str] | None = None) -> int:
    """``python -m lopd.config --write-presets``: regenerate ``lopd/configs/*.yaml``;
    ``--check``: exit 1 if any of them is out of date."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m lopd.config")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--write-presets", action="store_true", help="regenerate the YAML files")
    group.add_argument("--check", action="store_true", help="fail if a YAML file is stale")
    args = p.parse_args(argv)
    stale = []
    for name in PRESETS:
        path = PRESET_DIR / f"{name}.yaml"
        text = preset_yaml(name)
        if args.write_presets:
            path.write_text(text)
            print(f"wrote {path}")
        elif not path.exists() or path.read_text() != text:
            stale.append(str(path))
    if stale:
        print("stale (run python -m lopd.config --write-presets): " + ", ".join(stale))
        return 1
    return 0


def load_config(
    preset: str = "default",
    yaml_path: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
) -> Config:
    """Build a config: preset, then the YAML file, then ``key=value`` overrides.

    Args:
        preset: a name in :data:`PRESETS`.
        yaml_path: a YAML file with the nested layout of :class:`Config` (any subset).
        overrides: ``section.field=value`` strings; values are parsed as YAML scalars
            (``null``, ``true``, ``1e-4``) and type-checked.

    Returns:
        The config (not yet validated: call :meth:`Config.validate`).

    Raises:
        ConfigError: unknown preset, key or section, malformed override, wrong type.
    """
    if preset not in PRESETS:
        raise ConfigError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    cfg = PRESETS[preset]()
    if yaml_path is not None:
        try:
            mapping = yaml.safe_load(Path(yaml_path).read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"--config {str(yaml_path)!r} is not valid YAML: {err}") from None
        except OSError as err:
            raise ConfigError(f"--config {str(yaml_path)!r} cannot be read: {err}") from None
        if not isinstance(mapping, dict):
            raise ConfigError(f"--config {str(yaml_path)!r} must hold a mapping at the top level")
        cfg.update(mapping, source=f"--config {yaml_path}")
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form section.field=value")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        cfg.set(key.strip(), value, source=f"override {item!r}")
    return cfg


# ---------------------------------------------------------------------------------- helpers
def _has_field(obj: Any, name: str) -> bool:
    return any(f.name == name for f in dataclasses.fields(obj))


def _apply_mapping(obj: Any, mapping: dict[str, Any], prefix: str, source: str) -> None:
    for key, value in mapping.items():
        dotted = f"{prefix}{key}"
        if not _has_field(obj, key):
            raise ConfigError(f"{source}: unknown config key {dotted!r}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: {dotted!r} is a section and needs a mapping")
            _apply_mapping(current, value, prefix=f"{dotted}.", source=source)
        else:
            _set_field(obj, key, value, dotted, source)


def _set_field(obj: Any, name: str, value: Any, dotted: str, source: str) -> None:
    if not _has_field(obj, name):
        raise ConfigError(f"{source}: unknown config key {dotted!r}")
    hint = typing.get_type_hints(type(obj))[name]
    if dataclasses.is_dataclass(hint):
        raise ConfigError(f"{source}: {dotted!r} is a section; set one of its fields")
    setattr(obj, name, _coerce(value, hint, dotted, source))


def _coerce(value: Any, hint: Any, dotted: str, source: str) -> Any:
    """Return ``value`` as type ``hint`` (int -> float allowed), else raise ConfigError."""
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, dotted, source)
            except ConfigError:
                continue
        raise ConfigError(f"{source}: {dotted} expects {_type_name(hint)}, got {value!r}")
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            # PyYAML (YAML 1.1) reads "1e-3" as a string; accept any float literal.
            try:
                return float(value)
            except ValueError:
                pass
    elif hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    raise ConfigError(f"{source}: {dotted} expects {_type_name(hint)}, got {value!r}")


def _type_name(hint: Any) -> str:
    args = typing.get_args(hint)
    if args:
        return " or ".join("null" if a is type(None) else a.__name__ for a in args)
    return getattr(hint, "__name__", str(hint))


if __name__ == "__main__":
    raise SystemExit(main())
