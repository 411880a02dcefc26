"""The run directory: every file a run writes, named once (the trainer and ``lopd.compare``).

Layout::

    config.yaml          the run's configuration (a resumed run reads it back)
    metrics.jsonl        one JSON line per training step
    tensorboard/         the same metrics as TensorBoard events
    reward_curve.png     training reward per step and held-out rewards
    checkpoints/         step_NNNNNN.pt (one process) or step_NNNNNN/ (FSDP2, DCP)
    bank/                experience bank (DONE marks it complete), trajectories.jsonl
    retrieval.json       the J retrieved experiences of every task (text)
    bank_grown.jsonl     the student's successes that joined the bank in training (bank.grow)
    phi0.pt, latents0.pt the composer after the cold start and c_phi0 of every train task
    eval_vanilla.json    held-out evaluation before training
    eval_base_composer0.json  held-out "base + composer" with phi_0 (before training)
    summary.json         held-out results, rollouts, wall time
    student/             the trained student (Hugging Face checkpoint, safetensors, model.dtype)
    composer.pt          the trained composer phi
    memory.jsonl         memory account per phase (--profile-memory)
    .lock                held (flock) by the run using the directory (lopd.run.claim)

Writes that a killed run could leave half-done go through :func:`atomic_write_text` and
:func:`atomic_torch_save` (write a temporary file, then rename).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["RunDir", "RunDirError"]


class RunDirError(Exception):
    """A run directory that cannot be used as asked (in use, holding another run, not a
    directory, read-only, nothing loadable to resume); the message is one line saying why."""


class RunDir:
    """Paths inside one run directory (see the module docstring for what each holds).

    Args:
        root: the directory (``cfg.run_dir``).
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def reward_curve(self) -> Path:
        return self.root / "reward_curve.png"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def bank(self) -> Path:
        return self.root / "bank"

    @property
    def bank_done(self) -> Path:
        return self.root / "bank" / "DONE"

    @property
    def bank_trajectories(self) -> Path:
        return self.root / "bank" / "trajectories.jsonl"

    @property
    def bank_grown(self) -> Path:
        return self.root / "bank_grown.jsonl"

    @property
    def retrieval(self) -> Path:
        return self.root / "retrieval.json"

    @property
    def phi0(self) -> Path:
        return self.root / "phi0.pt"

    @property
    def latents0(self) -> Path:
        return self.root / "latents0.pt"

    @property
    def eval_vanilla(self) -> Path:
        return self.root / "eval_vanilla.json"

    @property
    def eval_base_composer0(self) -> Path:
        return self.root / "eval_base_composer0.json"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def student(self) -> Path:
        return self.root / "student"

    @property
    def composer(self) -> Path:
        return self.root / "composer.pt"

    @property
    def memory(self) -> Path:
        """The per-phase memory account (``--profile-memory``)."""
        return self.root / "memory.jsonl"

    def entry_names(self) -> set[str]:
        """The names a run writes at the top of its directory (every property above)."""
        props = [n for n, v in vars(RunDir).items() if isinstance(v, property)]
        return {getattr(self, n).relative_to(self.root).parts[0] for n in props}

    def shared_phases(self, builds_bank: bool, uses_composer: bool) -> list[Path]:
        """What runs of one seed compute identically (``lopd.compare`` copies them between run
        directories): the vanilla evaluation, and the bank and cold start where the method
        builds them."""
        paths = [self.eval_vanilla]
        if builds_bank:
            paths.append(self.bank)
        if uses_composer:
            paths += [self.phi0, self.latents0]
        return paths

    def is_complete(self, path: Path) -> bool:
        """Whether a shared phase exists in full (the bank only once its DONE marker does)."""
        return (path / "DONE").exists() if path == self.bank else path.exists()
