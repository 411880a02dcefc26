"""The latent-conditioned teacher of LOPD (paper 3.2, A.4): c_phi and the teacher's forward.

The composer turns a task and its J retrieved experiences into ``c_phi`` (``[J*K, d]``,
:class:`TaskLatents`). The teacher is the frozen backbone (encoder adapter off) reading the
student's trajectory with the task's first user message framed and ``J*K`` placeholder ids where the
latents go (:func:`latent_teacher_sequence`); the placeholder embeddings are replaced by c_phi by
concatenation, so the gradient reaches phi (:func:`teacher_action_hidden`). Used by LOPD's loss and
by the composer's cold start.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence

import torch
from torch.utils.checkpoint import checkpoint

from lopd.latent.checkpointing import checkpoint_each_layer, decoder_layers
from lopd.latent.composer import LatentComposer
from lopd.latent.injection import TeacherSequence, build_teacher_sequence, inject_latents
from lopd.rollout.batch import ActionRows, pad_batch
from lopd.types import Task, Trajectory
from lopd_kernels.hf import decoder_of

__all__ = ["TaskLatents", "latent_teacher_sequence", "teacher_action_hidden"]


@dataclasses.dataclass
class TaskLatents:
    """c_phi of any task: the composer over the task and its J retrieved experiences.

    The one place latents are composed: LOPD's teacher, the cold start and the "base + composer"
    evaluation all call the same object.

    Attributes:
        composer: the latent composer.
        retrieved: ``task_id -> `` the J formatted experiences of the task
            (:attr:`lopd.latent.experience.Experience.retrieved`).
    """

    composer: LatentComposer
    retrieved: dict[str, list[str]]

    def __call__(self, tasks: Sequence[Task]) -> torch.Tensor:
        """``[B, J*K, d]`` latents of B ``tasks`` (differentiable in phi)."""
        return self.composer(
            [t.instruction for t in tasks], [self.retrieved[t.task_id] for t in tasks]
        )


def latent_teacher_sequence(
    tokenizer: object, traj: Trajectory, num_placeholders: int, pad_id: int
) -> TeacherSequence:
    """The teacher input of a trajectory (A.4): framed prompt + placeholders + continuation.

    Args:
        tokenizer: the backbone's tokenizer.
        traj: the student's trajectory.
        num_placeholders: ``J*K``.
        pad_id: the placeholder id.
    """
    user = next(m["content"] for m in traj.messages if m["role"] == "user")
    return build_teacher_sequence(
        tokenizer,
        traj.input_ids,
        traj.prompt_len,
        user,
        traj.task.domain,
        num_placeholders,
        placeholder_id=pad_id,
    )


@contextlib.contextmanager
def _teacher_mode(composer: LatentComposer) -> Iterator[torch.nn.Module]:
    """``composer.teacher_mode()`` that gives phi back its ``requires_grad`` on exit.

    peft's adapter toggle sets ``requires_grad`` on the parameter objects registered when it is
    entered and again on those registered when it exits. A checkpointed teacher re-enters it in
    the backward, where FSDP2 swaps in gathered copies between the two, so the shards would stay
    marked frozen and their gradients be dropped. Without FSDP2 this changes nothing.
    """
    phi = [p for p in composer.parameters() if p.requires_grad]
    try:
        with composer.teacher_mode() as backbone:
            yield backbone
    finally:
        for p in phi:
            p.requires_grad_(True)


def teacher_action_hidden(
    composer: LatentComposer,
    sequences: Sequence[TeacherSequence],
    latents: torch.Tensor,
    where: ActionRows,
    pad_id: int,
    checkpointed: bool = False,
    model: torch.nn.Module | None = None,
) -> torch.Tensor:
    """Latent-teacher final hidden states at the student's action rows, ``[N, d]``.

    The placeholder embeddings are replaced by ``latents`` (concatenation: gradient reaches phi),
    the backbone runs with the encoder adapter disabled, and row ``p - 1`` of the student is row
    ``p - 1 + offset`` of the teacher (:class:`~lopd.latent.injection.TeacherSequence`).

    Args:
        composer: owns the frozen backbone.
        sequences: B teacher sequences.
        latents: ``[B, J*K, d]`` c_phi.
        where: the student's :class:`~lopd.rollout.batch.ActionRows`.
        pad_id: padding id.
        checkpointed: recompute the teacher per decoder layer in the backward: the forward keeps
            each layer's input (``[B, L, d]``) and the backward holds one layer's activations at
            a time; each recompute re-enters ``teacher_mode`` (the encoder adapter must be off
            there too). A decoder without a ``layers`` list is recomputed as a whole.
        model: the teacher's weights when they are not the frozen base (a copy of the student,
            :mod:`lopd.methods.teacher_backbone`): it runs as it is, with no adapter to turn
            off; ``None``: the composer's backbone in ``teacher_mode``.
    """
    device = where.rows.device
    ids, mask = pad_batch([s.input_ids for s in sequences], pad_id, device)

    def mode() -> contextlib.AbstractContextManager[torch.nn.Module]:
        return _teacher_mode(composer) if model is None else contextlib.nullcontext(model)

    def run(lat: torch.Tensor) -> torch.Tensor:
        with mode() as backbone:
            embeds = backbone.get_input_embeddings()(ids)
            embeds = torch.stack(
                [inject_latents(embeds[i], lat[i], s.latent_start) for i, s in enumerate(sequences)]
            )
            # No KV cache: nothing reads it, and a layer's recompute would write it twice.
            decoder = decoder_of(backbone)
            return decoder(
                inputs_embeds=embeds, attention_mask=mask, use_cache=False
            ).last_hidden_state

    if not checkpointed:
        hidden = run(latents)
    else:
        layers = decoder_layers(composer.backbone if model is None else model)
        if layers is not None:
            with checkpoint_each_layer(layers, mode):
                hidden = run(latents)
        else:  # a decoder without a layer list: the whole forward as one checkpoint
            hidden = checkpoint(run, latents, use_reentrant=False)
    offsets = torch.as_tensor([s.offset for s in sequences], dtype=torch.long, device=device)
    return hidden[where.batch, where.rows + offsets[where.batch]]
