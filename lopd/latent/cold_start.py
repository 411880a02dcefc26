"""Phase 2, the composer's cold start (paper eq. 14, A.2).

phi (LoRA + QFormer) is fitted to the NLL of the bank's successful trajectories under the frozen
backbone conditioned on ``c_phi``; ``phi_0`` is saved (``phi0.pt``) and ``c_phi0`` of every train
task is cached (``latents0.pt``) for LOPD's anchor. Both are loaded, not recomputed, when the run
directory already holds them (a resumed run, or ``lopd.compare`` sharing them between methods).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lopd.atomic import atomic_torch_save
from lopd.latent.composer import LatentComposer
from lopd.latent.experience import Experience
from lopd.latent.injection import TeacherSequence
from lopd.latent.teacher import TaskLatents, latent_teacher_sequence, teacher_action_hidden
from lopd.loss import segment_mean
from lopd.rollout.batch import ActionRows, lm_head, lm_head_logprobs
from lopd.run.context import RunContext
from lopd.run.seeds import Stream, seed_of
from lopd.types import Trajectory

__all__ = ["build_composer", "cold_start", "cold_start_loss"]


def build_composer(ctx: RunContext) -> LatentComposer:
    """phi_init: the composer over the run's backbone (peft injects its LoRA there), seeded by
    ``Stream.COMPOSER_INIT``, in float32 whatever ``model.dtype`` computes in, identical on
    every rank."""
    c = ctx.cfg.composer
    torch.manual_seed(seed_of(ctx.cfg.seed, Stream.COMPOSER_INIT))
    composer = LatentComposer(
        ctx.models.backbone,
        ctx.models.tokenizer,
        num_latents=c.num_latents,
        num_retrieved=c.num_retrieved,
        qformer_layers=c.qformer_layers,
        ffn_mult=c.ffn_mult,
        lora_r=c.lora_r,
        lora_alpha=c.lora_alpha,
        lora_dropout=c.lora_dropout,
        max_encoder_tokens=c.max_encoder_tokens,
        checkpoint_layers=ctx.cfg.model.gradient_checkpointing,
    )
    # phi trains in float32 (the LoRA already is: peft keeps adapters of a 16-bit base in
    # float32; the QFormer follows the backbone).
    ctx.precision.to_master(composer)
    # No dropout anywhere in the composer/teacher: eval mode keeps them deterministic.
    composer.eval()
    ctx.dist.broadcast_parameters(composer)
    return composer


def cold_start_loss(
    latents: TaskLatents,
    trajs: Sequence[Trajectory],
    sequences: Sequence[TeacherSequence],
    batch_size: int,
    world: int,
    pad_id: int,
    device: torch.device,
    checkpointed: bool = False,
) -> torch.Tensor:
    """Eq. 14 on this rank's trajectories: per-trajectory token-mean NLL of the action tokens
    under the latent-conditioned frozen backbone, summed and divided by ``batch_size / world`` (from
    the hidden states and the head by the fused kernel: no ``[N, V]`` logits).

    Args:
        latents: c_phi of the trajectories' tasks (the composer over their retrievals).
        trajs: this rank's share of the step's bank trajectories.
        sequences: their teacher sequences.
        batch_size: trajectories in the step across ranks.
        world: the number of ranks. Dividing by ``batch_size / world`` makes the average of the
            ranks' gradients the gradient of the mean over the whole step, as in one process
            (the trainer's losses follow the same rule, :mod:`lopd.parallel.lockstep`).
        pad_id: padding / placeholder id.
        device: where the models live.
        checkpointed: recompute the teacher forward in the backward.
    """
    where = ActionRows.of(trajs, device)
    composer = latents.composer
    c_phi = latents([t.task for t in trajs])
    h = teacher_action_hidden(composer, sequences, c_phi, where, pad_id, checkpointed=checkpointed)
    # The fused LM-head kernel: no [N, V] logits (the frozen head takes its gradient projection,
    # so the backward reaches h without recomputing the logits).
    nll = -lm_head_logprobs(lm_head(composer.backbone), h, where.targets)
    return segment_mean(nll, where.batch, len(trajs)).sum() * world / batch_size


def cold_start(
    ctx: RunContext, experience: Experience, latents: TaskLatents
) -> dict[str, torch.Tensor]:
    """Run (or load) the cold start; returns ``task_id -> [J*K, d]`` c_phi0 of the train tasks.

    Every rank trains on its share of each step's batch; phi's gradients are averaged. Forwards
    run under the run's autocast (phi is float32; float16 scales the loss); the AdamW state and
    the last step's gradients are freed before returning. Saved activations are counted by the
    run's memory account.

    Args:
        ctx: the run (its config, directory, sampler, precision, memory account).
        experience: the bank phase's trajectories (the data).
        latents: c_phi of any task (the composer being fitted).
    """
    cfg, run_dir, dist, precision = ctx.cfg, ctx.run_dir, ctx.dist, ctx.precision
    composer, tokenizer, pad_id = latents.composer, ctx.models.tokenizer, ctx.models.pad_id
    device, log = ctx.device, ctx.log
    dist.enter("cold_start")
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

    if c.steps > 0 and data:
        opt = torch.optim.AdamW(params, lr=c.lr, weight_decay=0.0)
        scaler = precision.grad_scaler()
        for step in ctx.bar(range(c.steps), desc="cold start", unit="step"):
            mine = ctx.sampler.draw(range(len(data)), c.batch_size, Stream.COLD_START_BATCH, step)
            opt.zero_grad(set_to_none=True)
            loss = None
            if mine:
                with ctx.memory.activations([composer]), precision.autocast():
                    loss = cold_start_loss(
                        latents,
                        [data[i] for i in mine],
                        [sequence(i) for i in mine],
                        c.batch_size,
                        dist.world,
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
                nll = loss.item() * c.batch_size / dist.world / len(mine)
                log(f"cold start step {step}: nll {nll:.4f}")
        # Neither the cold start's AdamW moments nor phi's last gradients are needed again:
        # joint training builds its own optimizer (and would keep them alive otherwise).
        opt.zero_grad(set_to_none=True)
        del opt, loss
    elif not data:
        log("cold start: the bank holds no trajectory; phi_0 is the initialization")
    with torch.no_grad(), precision.autocast():
        latents0 = {}
        bs = max(1, cfg.train.micro_batch)
        for i in range(0, len(ctx.train_tasks), bs):
            chunk = ctx.train_tasks[i : i + bs]
            for task, lat in zip(chunk, latents(chunk)):
                latents0[task.task_id] = lat.detach().cpu()
    if dist.is_main:
        atomic_torch_save(composer.phi_state_dict(), run_dir.phi0)
        atomic_torch_save(latents0, run_dir.latents0)
    dist.barrier()
    return latents0
