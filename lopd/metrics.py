"""Per-step metrics: ``metrics.jsonl``, TensorBoard events and the reward plot.

Only rank 0 writes. A resumed run first drops the lines of steps after its checkpoint (a killed
run may have logged them; the resumed run recomputes them), and TensorBoard purges the same steps.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from lopd.run_dir import RunDir, atomic_write_text

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
            from torch.utils.tensorboard import SummaryWriter

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
    steps after its last checkpoint, which the resumed run recomputes."""
    if not path.exists():
        return
    kept = [
        line
        for line in path.read_text().splitlines()
        if line.strip() and json.loads(line)["step"] < steps_done
    ]
    atomic_write_text(path, "".join(line + "\n" for line in kept))


def plot_rewards(metrics_file: Path, out: Path, summary: dict[str, Any] | None = None) -> None:
    """Training reward per step (and the held-out rewards as horizontal lines) to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(x) for x in metrics_file.read_text().splitlines() if x.strip()]
    fig, ax = plt.subplots(figsize=(6, 3.5))
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
    plt.close(fig)
