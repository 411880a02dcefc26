"""Per-step metrics: ``metrics.jsonl``, TensorBoard events and the reward plot.

Only rank 0 writes. A resumed run first drops the lines of steps after its checkpoint (a killed
run may have logged them; the resumed run recomputes them), and TensorBoard purges the same steps.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from torch.utils.tensorboard import SummaryWriter

from lopd.atomic import atomic_write_text
from lopd.run.run_dir import RunDir

__all__ = ["MetricsLog", "plot_rewards"]


class MetricsLog:
    """Appends one JSON line and one TensorBoard scalar per metric per step.

    Args:
        run_dir: the run directory.
        start_step: steps already finished (a resumed run's checkpoint step); later lines are
            dropped.
        enabled: write at all (rank 0).
    """

    def __init__(self, run_dir: RunDir, start_step: int, enabled: bool) -> None:
        self.path = run_dir.metrics
        self.writer = None
        if enabled:
            _truncate_metrics(self.path, start_step)
            self.path.touch()  # a run of train.steps=0 has a metrics file too, an empty one

            self.writer = SummaryWriter(str(run_dir.tensorboard), purge_step=start_step)

    def write(self, metrics: dict[str, Any]) -> None:
        """Log one step's metrics (``metrics["step"]`` is the step)."""
        if self.writer is None:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(metrics) + "\n")
        for k, v in metrics.items():
            if k != "step" and isinstance(v, (int, float)):
                self.writer.add_scalar(k, v, metrics["step"])
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _truncate_metrics(path: Path, steps_done: int) -> None:
    """Keep the metrics of finished (checkpointed) steps only: a killed run may have logged
    steps after its last checkpoint, which the resumed run recomputes.

    A run killed mid-write leaves a torn last line (always of a step after the last
    checkpoint): it is dropped with a warning, as the experience bank does. An unreadable line
    before the last one is not a crash artifact and stops the resume.

    Raises:
        RuntimeError: an unreadable line followed by further lines.
    """
    if not path.exists():
        return
    lines = [ln for ln in path.read_bytes().decode(errors="replace").splitlines() if ln.strip()]
    kept = []
    for i, line in enumerate(lines):
        try:
            step = json.loads(line)["step"]
            if not isinstance(step, int):
                raise TypeError("step is not an integer")
        except (ValueError, KeyError, TypeError, IndexError):
            if i + 1 < len(lines):
                raise RuntimeError(
                    f"{path}: unreadable line {i + 1} followed by further lines; only the last "
                    "line can be torn by a crash"
                ) from None
            warnings.warn(
                f"{path}: dropping a torn last line ({len(line)} characters)",
                RuntimeWarning,
                stacklevel=2,
            )
            break
        if step < steps_done:
            kept.append(line)
    atomic_write_text(path, "".join(line + "\n" for line in kept))


def plot_rewards(metrics_file: Path, out: Path, summary: dict[str, Any] | None = None) -> None:
    """Training reward per step (and the held-out rewards as horizontal lines) to a PNG."""
    rows = [json.loads(x) for x in metrics_file.read_text().splitlines() if x.strip()]
    fig = Figure(figsize=(6, 3.5))
    ax = fig.subplots()
    if rows:
        steps = [r["step"] for r in rows]
        ax.plot(steps, [r["reward_mean"] for r in rows], label="train rollouts", alpha=0.6)
        w = max(1, len(rows) // 10)
        smooth = np.convolve([r["reward_mean"] for r in rows], np.ones(w) / w, mode="valid")
        ax.plot(steps[w - 1 :], smooth, label=f"train (moving avg {w})")
    for key, style in (("vanilla", "--"), ("lopd", "-")):
        if summary and summary.get(key):
            ax.axhline(
                summary[key]["reward_mean"], ls=style, color="k", lw=1, label=f"held-out {key}"
            )
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
