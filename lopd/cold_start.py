"""Phase 2, the composer's cold start (paper eq. 14, A.2).

phi (LoRA + QFormer) is fitted to the NLL of the bank's successful trajectories under the frozen
backbone conditioned on ``c_phi``; ``phi_0`` is saved (``phi0.pt``) and ``c_phi0`` of every train
task is cached (``latents0.pt``) for LOPD's anchor. Both are loaded, not recomputed, when the run
directory already holds them (a resumed run, or ``lopd.compare`` sharing them between methods).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from lopd.composer import LatentComposer
from lopd.config import Config
from lopd.distributed import Dist
from lopd.experience import Experience
from lopd.injection import TeacherSequence
from lopd.loss import segment_mean
from lopd.methods.latent_teacher import compose, latent_teacher_sequence, teacher_action_hidden
from lopd.methods.rows import ActionRows, lm_head
from lopd.precision import Precision
from lopd.run_dir import RunDir, atomic_torch_save
from lopd.seeds import Stream
from lopd.tasks import TaskSampler
from lopd.types import Task, Trajectory

__all__ = ["cold_start", "cold_start_loss"]


def cold_start_loss(
    composer: LatentComposer,
    retrieved: dict[str, list[str]],
    trajs: Sequence[Trajectory],
    sequences: Sequence[TeacherSequence],
    batch_size: int,
    pad_id: int,
    device: torch.device,
    checkpointed: bool = False,
) -> torch.Tensor:
    """Eq. 14 on this rank's trajectories: per-trajectory token-mean NLL of the action tokens
    under the latent-conditioned frozen backbone, summed and divided by the global batch size.

    Args:
        composer: the latent composer.
        retrieved: every task's retrieved experiences.
        trajs: this rank's share of the step's bank trajectories.
        sequences: their teacher sequences.
        batch_size: trajectories in the step across ranks.
        pad_id: padding / placeholder id.
        device: where the models live.
        checkpointed: recompute the teacher forward in the backward.
    """
    where = ActionRows.of(trajs, device)
    latents = compose(composer, retrieved, [t.task for t in trajs])
    h = teacher_action_hidden(
        composer, sequences, latents, where, pad_id, checkpointed=checkpointed
    )
    logits = lm_head(composer.backbone)(h).float()
    nll = torch.nn.functional.cross_entropy(logits, where.targets, reduction="none")
    return segment_mean(nll, where.batch, len(trajs)).sum() / batch_size


def cold_start(
    cfg: Config,
    run_dir: RunDir,
    composer: LatentComposer,
    experience: Experience,
    train_tasks: Sequence[Task],
    tokenizer: Any,
    pad_id: int,
    device: torch.device,
    dist: Dist,
    sampler: TaskSampler,
    log: Callable[[str], None],
    bar: Callable[..., Iterable[int]] = lambda it, **kw: it,
    precision: Precision | None = None,
    activations: Callable[..., Any] | None = None,
) -> dict[str, torch.Tensor]:
    """Run (or load) the cold start; returns ``task_id -> [J*K, d]`` c_phi0 of the train tasks.

    Every rank trains on its share of each step's batch; phi's gradients are averaged. Forwards
    run under ``precision``'s autocast (phi is float32; float16 scales the loss); the AdamW
    state and the last step's gradients are freed before returning. ``activations`` is the
    memory account's saved-tensor counter (:meth:`lopd.memory_account.MemoryAccount.activations`).
    """
    if run_dir.phi0.exists() and run_dir.latents0.exists():
        composer.load_phi_state_dict(torch.load(run_dir.phi0, map_location=device))
        latents0 = torch.load(run_dir.latents0, map_location="cpu")
        log("cold start: loaded phi_0 and c_phi0 from the run directory")
        return latents0
    c = cfg.cold_start
    data = experience.trajectories
    params = composer.trainable_parameters()
    num_placeholders = cfg.composer.num_latents * cfg.composer.num_retrieved
    sequences: dict[int, TeacherSequence] = {}  # bank trajectory -> its teacher input

    def sequence(i: int) -> TeacherSequence:
        if i not in sequences:
            sequences[i] = latent_teacher_sequence(tokenizer, data[i], num_placeholders, pad_id)
        return sequences[i]

    precision = precision or Precision.of(cfg.model.dtype, device)
    activations = activations or (lambda *modules: contextlib.nullcontext())
    if c.steps > 0 and data:
        opt = torch.optim.AdamW(params, lr=c.lr, weight_decay=0.0)
        scaler = precision.grad_scaler()
        for step in bar(range(c.steps), desc="cold start", unit="step"):
            mine = sampler.draw(range(len(data)), c.batch_size, Stream.COLD_START_BATCH, step)
            opt.zero_grad(set_to_none=True)
            loss = None
            if mine:
                with activations([composer]), precision.autocast():
                    loss = cold_start_loss(
                        composer,
                        experience.retrieved,
                        [data[i] for i in mine],
                        [sequence(i) for i in mine],
                        c.batch_size,
                        pad_id,
                        device,
                        checkpointed=cfg.model.gradient_checkpointing,
                    )
                scaler.scale(loss).backward()
            dist.average_gradients(params)
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, c.grad_clip)
            scaler.step(opt)
            scaler.update()
            if loss is not None and step % max(1, c.steps // 10) == 0:
                nll = loss.item() * c.batch_size / len(mine)
                log(f"cold start step {step}: nll {nll:.4f}")
        # Neither the cold start's AdamW moments nor phi's last gradients are needed again:
        # joint training builds its own optimizer (and would keep them alive otherwise).
        opt.zero_grad(set_to_none=True)
        del opt, loss
    elif not data:
        log("cold start: the bank holds no trajectory; phi_0 is the initialization")
    with torch.no_grad(), precision.autocast():
        latents0 = {}
        bs = max(1, cfg.lopd.micro_batch)
        for i in range(0, len(train_tasks), bs):
            chunk = train_tasks[i : i + bs]
            for task, lat in zip(chunk, compose(composer, experience.retrieved, chunk)):
                latents0[task.task_id] = lat.detach().cpu()
    if dist.is_main:
        atomic_torch_save(composer.phi_state_dict(), run_dir.phi0)
        atomic_torch_save(latents0, run_dir.latents0)
    dist.barrier()
    return latents0
