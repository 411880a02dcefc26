"""Checkpoints: everything a killed run needs to continue exactly where it stopped.

A checkpoint holds (this module is the one place that lists it): the student's weights, the
composer's phi, both optimizers' states (and the float16 loss scaler's), the method's own state
(LOPD's beta, SDPO's EMA teacher), the global rollout count, the wall time of earlier sessions,
the RNG states and the data position (the step: a step's data is a pure function of seed and
step, :mod:`lopd.run.tasks`). The newest ``keep`` checkpoints are kept (``checkpoint_keep``).

Sizes: the student and phi are float32 master weights, AdamW holds two float32 moments per
trained parameter, so a checkpoint is about 12 bytes per student parameter (4 for the weights,
8 for AdamW), ~48 GB for a 4B student. ``checkpoint_final_optimizer=false`` writes the final
step's checkpoint without optimizer states (4 bytes per parameter); a run resumed from it to
train further restarts AdamW (and says so). The deployable student is written separately in
the compute dtype as safetensors (``run_dir/student``, 2 bytes per parameter in bf16).

Two formats, chosen by ``model.parallel``:

* one process or ``ddp``: ``checkpoints/step_NNNNNN.pt``, one ``torch.save`` file written by
  rank 0 (every rank holds the same weights);
* ``fsdp2``: ``checkpoints/step_NNNNNN/``, a ``torch.distributed.checkpoint`` directory in which
  every rank writes its shards of the weights and optimizer states, plus ``meta.pt`` (the rest)
  from rank 0. The directory is written under a temporary name and renamed once complete.

Resuming takes the newest checkpoint that loads. One that does not (truncated, random bytes,
empty, weights of other shapes, missing entries; under FSDP2 an unreadable ``meta.pt``) is
skipped with a warning naming it and why, before anything of it reaches the live objects, and
the one before it is tried; when none loads the resume stops with one line
(:class:`~lopd.run.run_dir.RunDirError`).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from lopd.atomic import atomic_torch_save, atomic_write_text
from lopd.parallel.distributed import Dist
from lopd.run.context import RunContext
from lopd.run.metrics import plot_rewards
from lopd.run.optim import Optimizers
from lopd.run.run_dir import RunDirError

__all__ = ["Checkpoints", "Resumed", "TrainState", "save_deployable", "save_run_outputs"]


class Stateful(Protocol):
    """What a checkpoint needs of the training method (:class:`lopd.methods.base.Method`)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class TrainState:
    """The live objects a checkpoint saves and restores.

    Attributes:
        student: the student model.
        composer: the latent composer (only its phi is saved), or ``None``.
        optimizers: both optimizers.
        method: the training method (its ``state_dict``).
    """

    student: nn.Module
    composer: nn.Module | None
    optimizers: Optimizers
    method: Stateful


@dataclass
class Resumed:
    """What a loaded checkpoint tells the trainer.

    Attributes:
        step: finished training steps.
        rollouts: this rank's share of the rollout count (the global count on rank 0, else 0).
        wall_seconds: wall time of the earlier sessions of the run.
        name: the checkpoint's file or directory name.
        optimizer_restored: the checkpoint held optimizer states (``False``: AdamW restarts).
    """

    step: int
    rollouts: int
    wall_seconds: float
    name: str
    optimizer_restored: bool = True


def _rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def _set_rng_state(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"].cpu())
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in rng["cuda"]])


def save_deployable(
    model: nn.Module,
    directory: Path,
    dtype: torch.dtype,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> None:
    """The deployable student: a Hugging Face directory with ``model.safetensors`` (sharded
    above 50 GB), ``config.json``, in ``dtype`` (``model.dtype``: the float32 master weights are
    rounded to the compute dtype a real checkpoint ships in; float32 runs save float32).

    Args:
        model: the student (``*ForCausalLM``).
        directory: ``run_dir/student``.
        dtype: the dtype to save in.
        state_dict: the full state dict (FSDP2 gathers it); ``None``: ``model.state_dict()``.
    """
    if dtype != torch.float32:
        sd = state_dict if state_dict is not None else model.state_dict()
        state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
    model.save_pretrained(directory, state_dict=state_dict)
    if dtype != torch.float32:
        # save_pretrained writes the in-memory (float32) dtype into config.json; say what the
        # file holds, so from_pretrained(dtype=None) loads it as saved.
        config = directory / "config.json"
        data = json.loads(config.read_text())
        data["dtype"] = str(dtype).removeprefix("torch.")
        atomic_write_text(config, json.dumps(data, indent=2, sort_keys=True) + "\n")


def save_run_outputs(ctx: RunContext, summary: dict[str, Any]) -> None:
    """What a finished run leaves: ``summary.json``, the deployable student, phi, and the reward
    plot (rank 0 writes; under FSDP2 every rank takes part in gathering the weights)."""
    models, run_dir = ctx.models, ctx.run_dir
    ctx.dist.enter("checkpoint")
    sharded = models.sharding.enabled
    student_sd = models.sharding.full_state_dict(models.student) if sharded else None
    phi = None
    if models.composer is not None:
        phi = (
            models.sharding.full_state_dict(models.composer, trainable_only=True)
            if sharded
            else models.composer.phi_state_dict()
        )
    if not ctx.dist.is_main:
        return
    atomic_write_text(run_dir.summary, json.dumps(summary, indent=2))
    save_deployable(models.student, run_dir.student, ctx.precision.compute, student_sd)
    models.tokenizer.save_pretrained(run_dir.student)
    if phi is not None:
        atomic_torch_save(phi, run_dir.composer)
    plot_rewards(run_dir.metrics, run_dir.reward_curve, summary)


class Checkpoints:
    """Saves and restores checkpoints in one directory.

    Args:
        directory: ``run_dir/checkpoints``.
        dist: rank facts and collectives.
        sharded: ``model.parallel=fsdp2`` (``torch.distributed.checkpoint`` directories).
        keep: how many of the newest checkpoints to keep.
    """

    def __init__(self, directory: Path, dist: Dist, sharded: bool = False, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = directory
        self.dist = dist
        self.sharded = sharded
        self.keep = keep

    # ------------------------------------------------------------------ contents
    @staticmethod
    def _meta(step: int, state: TrainState, rollouts: int, wall_seconds: float) -> dict[str, Any]:
        """Everything but the (possibly sharded) weights and optimizer states."""
        return {
            "step": step,
            "method": state.method.state_dict(),
            "rollouts": rollouts,  # global count; restored on rank 0
            "wall_seconds": wall_seconds,
            "rng": _rng_state(),
            "data_position": step,  # a step's data is a pure function of (seed, step)
        }

    @staticmethod
    def _weights(state: TrainState, optimizer: bool) -> dict[str, Any]:
        """Student, phi and (``optimizer``) both optimizers, unsharded (one-process format)."""
        return {
            "student": state.student.state_dict(),
            "composer": state.composer.phi_state_dict() if state.composer is not None else None,
            **(state.optimizers.state_dict() if optimizer else {}),
        }

    def _restore(
        self, state: TrainState, meta: dict[str, Any], name: str, optimizer: bool = True
    ) -> Resumed:
        method_state = dict(meta.get("method") or {})
        if "beta" in meta:  # checkpoints written before the method owned beta
            method_state.setdefault("beta", meta["beta"])
        state.method.load_state_dict(method_state)
        _set_rng_state(meta["rng"])
        rollouts = int(meta["rollouts"]) if self.dist.is_main else 0
        return Resumed(int(meta["step"]), rollouts, float(meta["wall_seconds"]), name, optimizer)

    # ------------------------------------------------------------------ save / load
    def save(
        self,
        step: int,
        state: TrainState,
        rollouts: int,
        wall_seconds: float,
        optimizer: bool = True,
    ) -> None:
        """Write the checkpoint of ``step`` finished steps (every rank calls it).

        Args:
            step: finished training steps.
            state: the live objects.
            rollouts: the global rollout count.
            wall_seconds: wall time of the run so far.
            optimizer: include the optimizer states (needed to continue training exactly).
        """
        self.dist.enter("checkpoint", step)
        meta = {**self._meta(step, state, rollouts, wall_seconds), "has_optimizer": optimizer}
        if self.sharded:
            self._save_dcp(step, state, meta, optimizer)
        elif self.dist.is_main:
            atomic_torch_save({**meta, **self._weights(state, optimizer)}, self._path(step))
        if self.dist.is_main:
            for old in self._existing()[: -self.keep]:
                shutil.rmtree(old) if old.is_dir() else old.unlink()
        self.dist.barrier()

    def load_latest(self, state: TrainState) -> Resumed | None:
        """Restore the newest loadable checkpoint into ``state``; ``None`` when there is none.

        A checkpoint that does not load is skipped with a ``RuntimeWarning`` (module docstring).

        Raises:
            RunDirError: checkpoints exist but none of them loads.
        """
        existing = self._existing()
        if not existing:
            return None
        self.dist.enter("checkpoint")
        device = next(state.student.parameters()).device
        reasons = []
        for path in reversed(existing):
            try:
                if self.sharded:
                    meta = _read(path / "meta.pt", "cpu")
                    return self._load_dcp(path, state, meta)
                ckpt = _read(path, device)
                _check_fits(ckpt, state)
            except _Unloadable as why:
                reasons.append(f"{path.name}: {why}")
                warnings.warn(
                    f"checkpoint {path.name} cannot be loaded ({why}); trying the one before it",
                    RuntimeWarning,
                    stacklevel=2,
                )
                continue
            state.student.load_state_dict(ckpt["student"])
            if ckpt["composer"] is not None:
                state.composer.load_phi_state_dict(ckpt["composer"])
            has_optimizer = "opt_student" in ckpt
            if has_optimizer:
                state.optimizers.load_state_dict(ckpt)
            return self._restore(state, ckpt, path.name, has_optimizer)
        raise RunDirError(
            f"--resume: no checkpoint in {self.directory} can be loaded ({reasons[0]}"
            f"{'; and the older ones' if len(reasons) > 1 else ''})"
        )

    def _path(self, step: int) -> Path:
        return self.directory / (f"step_{step:06d}" if self.sharded else f"step_{step:06d}.pt")

    def _existing(self) -> list[Path]:
        if self.sharded:
            return sorted(p for p in self.directory.glob("step_*") if (p / "meta.pt").exists())
        return sorted(self.directory.glob("step_*.pt"))

    # ------------------------------------------------------------------ FSDP2
    def _dcp_state(self, state: TrainState, optimizer: bool = True) -> dict[str, Any]:
        # Optional: FSDP2/DCP exist only in torch builds with distributed support.
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        opts = state.optimizers
        model_sd, optim_sd = get_state_dict(state.student, opts.student)
        out = {"student": model_sd, "opt_student": optim_sd}
        if state.composer is not None and opts.composer is not None:
            phi_sd, phi_optim_sd = get_state_dict(
                state.composer, opts.composer, options=StateDictOptions(ignore_frozen_params=True)
            )
            # phi only (a tied frozen weight survives ignore_frozen_params).
            phi = {n for n, p in state.composer.named_parameters() if p.requires_grad}
            phi_sd = {k: v for k, v in phi_sd.items() if k in phi}
            out.update(composer=phi_sd, opt_composer=phi_optim_sd)
        if not optimizer:
            out = {k: v for k, v in out.items() if not k.startswith("opt_")}
        return out

    def _save_dcp(
        self, step: int, state: TrainState, meta: dict[str, Any], optimizer: bool = True
    ) -> None:
        # Optional: FSDP2/DCP exist only in torch builds with distributed support.
        import torch.distributed.checkpoint as dcp

        final = self._path(step)
        tmp = final.with_name(final.name + ".tmp")
        if self.dist.is_main and tmp.exists():
            shutil.rmtree(tmp)
        self.dist.barrier()
        dcp.save(self._dcp_state(state, optimizer), checkpoint_id=str(tmp))
        self.dist.barrier()
        if self.dist.is_main:
            torch.save(meta, tmp / "meta.pt")
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)

    def _load_dcp(self, path: Path, state: TrainState, meta: dict[str, Any]) -> Resumed:
        # Optional: FSDP2/DCP exist only in torch builds with distributed support.
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_state_dict,
        )

        has_optimizer = bool(meta.get("has_optimizer", True))
        sd = self._dcp_state(state, has_optimizer)
        _drop_unsaved_optimizer_states(sd, str(path))
        dcp.load(sd, checkpoint_id=str(path))
        opts = state.optimizers
        phi_options = StateDictOptions(ignore_frozen_params=True, strict=False)
        if has_optimizer:
            set_state_dict(
                state.student, opts.student, model_state_dict=sd["student"],
                optim_state_dict=sd["opt_student"],
            )  # fmt: skip
        else:
            set_model_state_dict(state.student, sd["student"])
        if "composer" in sd:
            if has_optimizer:
                set_state_dict(
                    state.composer, opts.composer, model_state_dict=sd["composer"],
                    optim_state_dict=sd["opt_composer"], options=phi_options,
                )  # fmt: skip
            else:
                set_model_state_dict(state.composer, sd["composer"], options=phi_options)
        return self._restore(state, meta, path.name, has_optimizer)


def _drop_unsaved_optimizer_states(sd: dict[str, Any], checkpoint_id: str) -> None:
    """Drop from ``sd`` the optimizer states of parameters the saved optimizer held none for.

    A fresh optimizer's DCP state dict holds a state for every parameter (DCP initializes them),
    the saved one only for parameters that had a gradient before the save (``lopd-frozen``'s
    composer, LoRA weights no loss reached): loading the first from the second would ask for
    keys that were never written. Such a parameter resumes without a state, as in the run that
    saved it.
    """
    # Optional: DCP exists only in torch builds with distributed support.
    from torch.distributed.checkpoint import FileSystemReader

    saved = set(FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata)
    for name in ("opt_student", "opt_composer"):
        states = (sd.get(name) or {}).get("state", {})
        for fqn in list(states):
            if not any(f"{name}.state.{fqn}.{key}" in saved for key in states[fqn]):
                del states[fqn]


class _Unloadable(Exception):
    """A checkpoint that cannot be restored (the message says why, in one line)."""


_KEYS = ("step", "student", "composer", "rng", "rollouts", "wall_seconds")


def _read(path: Path, device: torch.device | str) -> dict[str, Any]:
    """``torch.load`` of a checkpoint file, any failure (truncated, not a checkpoint, empty) as
    :class:`_Unloadable`."""
    try:
        ckpt = torch.load(path, map_location=device, weights_only=False)
    except Exception as err:  # a damaged file fails in many ways (zip, pickle, EOF, ...)
        text = str(err).strip().splitlines()
        raise _Unloadable(
            f"{type(err).__name__}: {text[0][:160] if text else 'unreadable'}"
        ) from None
    if not isinstance(ckpt, dict) or not {"step", "rng", "rollouts", "wall_seconds"} <= set(ckpt):
        raise _Unloadable("not a lopd checkpoint")
    return ckpt


def _check_fits(ckpt: dict[str, Any], state: TrainState) -> None:
    """Raise :class:`_Unloadable` unless every tensor of ``ckpt`` fits ``state`` (checked before
    anything is copied: ``load_state_dict`` would copy the tensors that fit, then raise)."""
    missing = [k for k in _KEYS if k not in ckpt]
    if missing:
        raise _Unloadable(f"missing {', '.join(missing)}")
    live = {"student": state.student.state_dict()}
    if state.composer is not None:
        live["composer"] = state.composer.phi_state_dict()
    for name, want in live.items():
        got = ckpt[name]
        if not isinstance(got, dict):
            raise _Unloadable(f"holds no {name} weights")
        if set(got) != set(want):
            raise _Unloadable(f"the {name}'s parameter names differ from this model's")
        for key, tensor in want.items():
            if not isinstance(got[key], torch.Tensor) or got[key].shape != tensor.shape:
                shape = getattr(got[key], "shape", None)
                raise _Unloadable(
                    f"{name} {key} has shape {tuple(shape) if shape is not None else None}, this "
                    f"model's is {tuple(tensor.shape)}"
                )
    if state.composer is None and ckpt["composer"] is not None:
        raise _Unloadable("holds a composer, this run has none")
