"""One run's configuration: :class:`Config`, one of each section plus the run-wide fields.

One :class:`Config` describes a whole run and is saved as ``config.yaml`` in the run directory.
It is built from a preset (:mod:`lopd.config.presets`), an optional YAML file and
``section.field=value`` overrides (:func:`lopd.config.loading.load_config`).
:meth:`Config.validate` runs at start-up and names the offending field (or tasks-file line), so a
bad value stops the run before any model is loaded: each section checks its own fields
(``validate`` beside them in :mod:`lopd.config.sections` and :mod:`lopd.config.method_sections`),
this module the run-wide fields and the combinations across sections.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lopd.atomic import atomic_write_text
from lopd.config.checks import (
    BankTooSmallError,
    ConfigError,
    MissingDependencyError,
    at_least,
    checkpoint_dir_problem,
    greater_than,
)
from lopd.config.fields import apply_mapping, has_field, set_field
from lopd.config.method_sections import (
    GRPOConfig,
    LOPDConfig,
    LOPDPPOConfig,
    OPSDConfig,
    SDFTConfig,
    SDPOConfig,
    SkillSDConfig,
)
from lopd.config.sections import (
    VLLM_INSTALL_HINT,
    BankConfig,
    ColdStartConfig,
    ComposerConfig,
    DataConfig,
    EvalConfig,
    GenConfig,
    ModelConfig,
    TrainConfig,
)
from lopd.envs import load_task_file, load_tasks_jsonl, missing_requirement
from lopd.envs.acebench.data import is_acebench_path
from lopd.envs.envscaler_release import is_release_file
from lopd.envs.loaders import read_lines, regular_file_problem

__all__ = ["IDENTITY_KEY", "Config", "check_tasks_file"]

IDENTITY_KEY = "identity"
"""The top-level key of a run's ``config.yaml`` that records which run it is (config hash, seed,
model; :mod:`lopd.run.claim`); not a field: loading a saved config skips it."""


@dataclass
class Config:
    """One run. Field docs are on the section classes.

    Attributes:
        seed: seeds tasks, rollouts, initialization and data order.
        run_dir: output directory (config, metrics.jsonl, TensorBoard, checkpoints, summary).
        checkpoint_every: save a checkpoint every this many training steps (0 = only at the end).
        checkpoint_keep: how many of the newest checkpoints to keep (older ones are deleted).
        checkpoint_final_optimizer: the final step's checkpoint holds the optimizer states too
            (``false``: student, phi and the method's state only, about a quarter of the size
            under mixed precision; a run resumed from it to train further restarts AdamW).
        profile_memory: log a memory account per phase (weights, gradients, optimizer state,
            activations, allocator; :mod:`lopd.run.memory_account`) to ``memory.jsonl``.
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
    train: TrainConfig = field(default_factory=TrainConfig)
    lopd: LOPDConfig = field(default_factory=LOPDConfig)
    lopd_ppo: LOPDPPOConfig = field(default_factory=LOPDPPOConfig)
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

    def save(self, path: str | Path, identity: dict[str, Any] | None = None) -> None:
        """Write ``config.yaml`` atomically (a killed run never leaves half a config).

        Args:
            path: the file.
            identity: written first, under :data:`IDENTITY_KEY` (a run directory's record of
                its run); ``None``: the fields only.
        """
        text = self.to_yaml()
        if identity is not None:
            text = yaml.safe_dump({IDENTITY_KEY: identity}, sort_keys=False) + text
        atomic_write_text(path, text)

    def update(self, mapping: dict[str, Any], source: str = "config") -> None:
        """Apply a nested mapping (as in a YAML file) with type checks.

        Raises:
            ConfigError: unknown key or a value of the wrong type; names ``section.field``.
        """
        apply_mapping(self, mapping, prefix="", source=source)

    def set(self, dotted: str, value: Any, source: str = "override") -> None:
        """Set ``section.field`` (or a top-level field) to ``value`` with a type check."""
        obj: Any = self
        parts = dotted.split(".")
        for i, part in enumerate(parts[:-1]):
            sub = getattr(obj, part, None) if has_field(obj, part) else None
            if not dataclasses.is_dataclass(sub):
                raise ConfigError(f"{source}: unknown config section {'.'.join(parts[: i + 1])!r}")
            obj = sub
        set_field(obj, parts[-1], value, dotted, source)

    # ------------------------------------------------------------------ validation
    def sections(self) -> list[Any]:
        """The section objects, in field order."""
        return [
            getattr(self, f.name)
            for f in dataclasses.fields(self)
            if dataclasses.is_dataclass(getattr(self, f.name))
        ]

    def validate(self, check_paths: bool = True) -> None:
        """Check values before anything is loaded: every number finite, each section's own
        fields (its ``validate``), the run-wide fields and the combinations across sections.

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
        for section in self.sections():
            section.validate()
        at_least(0, checkpoint_every=self.checkpoint_every, threads=self.threads)
        at_least(1, checkpoint_keep=self.checkpoint_keep)
        greater_than(0, log_every=self.log_every)
        if self.gen.engine == "vllm" and self.model.parallel == "fsdp2":
            raise ConfigError(
                "gen.engine=vllm with model.parallel=fsdp2 is not supported (the engine needs "
                "the full student on every rank); use model.parallel=ddp or gen.engine=hf"
            )
        # A growing bank embeds its new entries with the (then sharded) backbone on one rank.
        if self.model.parallel == "fsdp2" and self.bank.grow:
            raise ConfigError(
                "bank.grow=true with model.parallel=fsdp2 is not supported; use "
                "model.parallel=ddp in one process"
            )
        if self.gen.engine == "vllm" and importlib.util.find_spec("vllm") is None:
            raise MissingDependencyError(
                f"gen.engine=vllm needs vLLM, which is not installed: {VLLM_INSTALL_HINT}",
                name="vllm",
            )
        if not check_paths:
            return
        if self.model.path is not None:
            problem = checkpoint_dir_problem(self.model.path)
            if problem is not None:
                raise ConfigError(f"model.path {self.model.path!r} {problem}")
        if self.data.tasks_path is not None:
            check_tasks_file(self.data.tasks_path)

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
    LiveCodeBench rows), so a file that passes here loads in the trainer. EnvScaler's and
    ACEBench's release files and directories are read by :func:`lopd.envs.load_task_file`.

    Raises:
        ConfigError: ``data.tasks_path <file> line N: <what is wrong>``, or a task that cannot
            run in training (an ACEBench multi-turn task without a user model).
    """
    path = Path(path)
    if path.exists() and (path.is_dir() or is_acebench_path(path) or is_release_file(path)):
        try:
            tasks = load_task_file(path)
        except (ValueError, OSError) as err:
            raise ConfigError(f"data.tasks_path {str(path)!r}: {err}") from None
    else:
        tasks = _check_jsonl(path)
    for task in tasks:
        problem = missing_requirement(task)
        if problem is not None:
            raise ConfigError(f"data.tasks_path {str(path)!r}: {problem}")


def _check_jsonl(path: Path) -> list:
    """The tasks of a JSONL file, each problem a ``ConfigError`` naming the line."""
    problem = regular_file_problem(path)
    if problem is not None:
        raise ConfigError(f"data.tasks_path {str(path)!r} {problem}")
    try:
        n = 0
        for lineno, line in read_lines(path):
            try:
                obj = json.loads(line)
            except (json.JSONDecodeError, RecursionError) as err:
                why = getattr(err, "msg", "nested too deeply")
                raise ConfigError(
                    f"data.tasks_path {str(path)!r} line {lineno}: not valid JSON ({why})"
                ) from None
            if not isinstance(obj, dict):
                raise ConfigError(
                    f"data.tasks_path {str(path)!r} line {lineno}: expected a JSON object, got "
                    f"{type(obj).__name__}"
                )
            n += 1
        if n == 0:
            raise ConfigError(f"data.tasks_path {str(path)!r} holds no tasks")
        return load_tasks_jsonl(path)
    except ConfigError:
        raise
    except (ValueError, OSError) as err:
        # The loader's message starts with "<path>:<line>:"; say "line N" like the checks above.
        msg = str(err)
        prefix = f"{path}:"
        if msg.startswith(prefix):
            lineno, _, rest = msg[len(prefix) :].partition(":")
            msg = f"line {lineno}:{rest}" if lineno.isdigit() else rest.strip()
        raise ConfigError(f"data.tasks_path {str(path)!r} {msg}") from None
