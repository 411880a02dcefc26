"""``model.parallel=fsdp2``: student, teacher and encoder backbone sharded with FSDP2.

Each model is sharded with ``fully_shard`` per decoder layer plus one root over the whole model
(the root holds the embedding, final norm and LM head, tied or not). Every rank then holds a
``1 / world`` slice of every parameter, gradient and AdamW state of the student and of the
composer's LoRA; gradients are averaged by FSDP's reduce-scatter (float32 on GPU with 16-bit
parameters, :func:`lopd.parallel.precision.fsdp_mixed_precision`). What each use of a model needs:

* **Training forwards of the student** go through the root (:meth:`Sharding.hidden_states`), so
  FSDP gathers the root's parameters before the forward and keeps them gathered until the
  backward has reduce-scattered their gradients. The distillation kernels read the student's
  full ``lm_head`` weight in that window (a plain tensor then); see :func:`full_weight`.
* **The frozen backbone** (teacher with the adapter off, composer encoder with it on, OPSD's
  teacher) is called by the composer and the teacher helpers through its decoder directly. Its
  root's parameters (embedding, norm, head: frozen, no gradient to reduce) stay gathered on every
  rank (:meth:`Sharding.gather_frozen_roots`); its decoder layers, LoRA included, stay sharded.
* **Generation** is rank-local (each rank rolls out its own tasks, rank 0 alone evaluates) while
  a sharded forward is a collective, so rollouts run inside :meth:`Sharding.gathered`: all ranks
  gather the full weights once, generate without collectives, and reshard. Leaving it resets
  FSDP2's record of the forwards (:meth:`Sharding.forget_forwards`): the rank-local forwards
  differ between ranks, and the backward's prefetch would otherwise read them.

Models are loaded whole on every rank and sharded afterwards (the student right after it is
copied, the backbone after the bank and the cold start, which read it unsharded), so the peak
memory of the setup is that of the unsharded models.

Every sharded forward and backward is a collective, so every rank must run the same ones in the
same order whatever its data: the trainer runs the same passes on every rank
(:mod:`lopd.parallel.lockstep`), each pass's loss reaches every sharded output
(:meth:`Sharding.outputs_reached`), and rank-local forwards leave no record
(:meth:`Sharding.forget_forwards`). EMA teachers are sharded copies of the student
(:meth:`Sharding.frozen_copy`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from lopd.parallel.distributed import Dist, is_sharded
from lopd_kernels.hf import decoder_of

__all__ = ["DecoderRoot", "Sharding", "full_weight", "reach"]


class DecoderRoot(nn.Module):
    """The FSDP root over a causal LM; its forward returns final hidden states ``[B, L, d]``
    (the decoder's, no ``[B, L, V]`` logits).

    Args:
        lm: a Hugging Face ``*ForCausalLM`` (kept as the submodule ``lm``).
    """

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, **kwargs: Any) -> torch.Tensor:
        return decoder_of(self.lm)(**kwargs).last_hidden_state


def reach(outputs: list[torch.Tensor]) -> torch.Tensor:
    """A zero with a gradient path to every tensor of ``outputs`` (each receives a zero
    gradient), built from empty slices: no value enters it, so an inf or NaN activation cannot
    turn it into NaN."""
    zero = torch.zeros(())
    for t in outputs:
        zero = zero.to(t.device) + t.reshape(-1)[:0].sum()
    return zero


def full_weight(head: nn.Module) -> torch.Tensor:
    """The full ``[V, d]`` weight of an LM head for the kernels.

    A gathered (unsharded) weight is returned as is. A sharded weight is gathered with
    ``DTensor.full_tensor()``, which is only right for a frozen head: a trainable head must be
    used inside its root's forward-backward window, where FSDP has gathered it.

    Raises:
        RuntimeError: a trainable head is still sharded.
    """
    w = head.weight
    if not is_sharded(w):
        return w
    if w.requires_grad:
        raise RuntimeError(
            "the student's LM head is sharded: use it after a forward through its FSDP root "
            "(Sharding.hidden_states), which gathers it until the backward"
        )
    return w.full_tensor()


class Sharding:
    """FSDP2 sharding of the run's models (every method is a no-op when disabled).

    Args:
        enabled: ``model.parallel == "fsdp2"``.
        dist: the process group facts.
        mp_policy: FSDP2 ``MixedPrecisionPolicy`` or ``None``.
        pad_id: a valid token id (the warm-up forward through each root).
    """

    def __init__(self, enabled: bool, dist: Dist, mp_policy: Any = None, pad_id: int = 0) -> None:
        self.enabled = enabled
        self.dist = dist
        self.mp_policy = mp_policy
        self.pad_id = pad_id
        self._roots: list[tuple[nn.Module, DecoderRoot, bool]] = []  # (model, root, trainable)
        self._gather_depth = 0
        self._outputs: list[torch.Tensor] | None = None  # collected by outputs_reached()
        self._not_generating: set[int] = set()  # ids of the roots gathered() leaves sharded

    def shard(self, model: nn.Module, trainable: bool) -> None:
        """``fully_shard`` every decoder layer of ``model``, then its root.

        Args:
            model: a ``*ForCausalLM`` (peft adapters already injected, if any).
            trainable: the student (training forwards go through the root) or a frozen model
                (its root's parameters stay gathered).
        """
        if not self.enabled:
            return
        # Optional: FSDP2/DCP exist only in torch builds with distributed support.
        from torch.distributed.fsdp import fully_shard

        kwargs = {"mp_policy": self.mp_policy} if self.mp_policy is not None else {}
        layers = getattr(decoder_of(model), "layers", None)
        if layers is None:
            raise TypeError(f"{type(model).__name__} has no decoder .layers to shard")
        for layer in layers:
            fully_shard(layer, **kwargs)
        root = DecoderRoot(model)
        fully_shard(root, **kwargs)
        # FSDP picks its root at the first forward: run one through the root on every rank
        # now, before any rank-local call could reach a layer first.
        device = next(model.parameters()).device
        with torch.no_grad():
            root(input_ids=torch.tensor([[self.pad_id]], device=device))
        if trainable:
            root.reshard()
        else:
            # The warm-up left the root's parameters gathered; a backward through the layers
            # would reshard them in FSDP's end-of-backward callback: keep them gathered.
            root.set_reshard_after_backward(False, recurse=False)
        self._roots.append((model, root, trainable))
        for module in (*layers, root):
            module.register_forward_hook(self._note_output)

    def _note_output(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._outputs is None or not torch.is_grad_enabled():
            return
        parts = output if isinstance(output, (tuple, list)) else (output,)
        self._outputs.extend(t for t in parts if isinstance(t, torch.Tensor) and t.requires_grad)

    @contextlib.contextmanager
    def outputs_reached(self) -> Iterator[list[torch.Tensor]]:
        """Collects the differentiable outputs of every sharded module's forward in the block;
        :func:`reach` of them, added to the loss, gives each a gradient on every rank.

        FSDP2 gathers a module's parameters for its backward, and reduce-scatters its gradients,
        when the gradient of its output arrives: a loss that does not depend on an output on one
        rank (no action token to score, a term that vanishes) would skip those collectives there
        and nowhere else. An empty list outside FSDP2.
        """
        outer, self._outputs = self._outputs, [] if self.enabled else None
        try:
            yield self._outputs if self._outputs is not None else []
        finally:
            self._outputs = outer

    def gather_frozen_roots(self) -> None:
        """Gather the frozen models' root parameters (embedding, norm, head) if anything
        resharded them (``state_dict()`` does, for a checkpoint). Every rank calls it; a no-op
        without communication when they are gathered already. The trainer calls it before every
        step."""
        for _, root, trainable in self._roots:
            if not trainable:
                root.unshard()

    def forget_forwards(self) -> None:
        """Reset FSDP2's record of the forwards run so far, on every rank (every rank calls it,
        with the same sharded models); frozen roots are gathered again.

        FSDP2 appends every forward through a sharded module to a per-root list that only the
        end of a backward clears, and a backward prefetches (all-gathers) the module that list
        names before the one whose gradient it computes. Forwards a rank runs alone (its
        rollouts, rank 0's evaluation) therefore make the first backward after them prefetch
        different modules on different ranks: one rank all-gathers while another
        reduce-scatters, and both wait for ever. After this call the next backward reads only
        the forwards that every rank ran since. Reshards every sharded parameter (a no-op for
        the layers outside a forward-backward window).
        """
        for _, root, trainable in self._roots:
            root.reset_iter_state()
            if not trainable:
                root.unshard()

    def is_sharded(self, model: nn.Module) -> bool:
        return any(m is model for m, _, _ in self._roots)

    def hidden_states(self, model: nn.Module, **kwargs: Any) -> torch.Tensor:
        """Final hidden states of ``model``'s decoder, ``[B, L, d]``: through the FSDP root for
        the sharded student, straight through the decoder otherwise."""
        for m, root, trainable in self._roots:
            if m is model and trainable:
                return root(**kwargs)
        return decoder_of(model)(**kwargs).last_hidden_state

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """All sharded models with full weights on every rank, and no collective per forward,
        for rank-local generation. Every rank must enter it (it all-gathers); re-entrant."""
        if not self._roots or self._gather_depth:
            self._gather_depth += 1
            try:
                yield
            finally:
                self._gather_depth -= 1
            return
        # Optional: FSDP2/DCP exist only in torch builds with distributed support.
        from torch.distributed.fsdp import FSDPModule

        roots = [root for _, root, _ in self._roots if id(root) not in self._not_generating]
        modules = [(m, root) for root in roots for m in root.modules() if isinstance(m, FSDPModule)]
        self._gather_depth += 1
        try:
            for root in roots:
                root.set_reshard_after_forward(False)
            for m, _ in modules:
                m.unshard()
            yield
        finally:
            self._gather_depth -= 1
            for m, root in modules:
                if m is not root:
                    m.set_reshard_after_forward(True, recurse=False)
            self.forget_forwards()

    def frozen_copy(self, model: nn.Module) -> nn.Module:
        """A frozen copy of the sharded ``model`` with its current weights, sharded like it (an
        EMA teacher). FSDP modules cannot be deep-copied: the same architecture is built on the
        meta device, sharded, and each rank copies its own shards (and the buffers) into it.
        Every rank calls it. :meth:`gathered` leaves the copy sharded (it never generates).
        """
        with torch.device("meta"):
            fresh = type(model)(model.config)
        source = next(model.parameters())
        fresh.to_empty(device=source.device).to(source.dtype)
        fresh.tie_weights()  # to_empty() unties a tied head from the embedding
        fresh.requires_grad_(False)
        fresh.eval()
        for name, buf in model.named_buffers():
            fresh.get_buffer(name).copy_(buf)
        self.shard(fresh, trainable=False)
        root = self._roots[-1][1]
        self._not_generating.add(id(root))
        with torch.no_grad(), self.local_shards(fresh) as dst, self.local_shards(model) as src:
            for d, s in zip(dst, src, strict=True):
                d.copy_(s)
        return fresh

    @contextlib.contextmanager
    def local_shards(self, model: nn.Module) -> Iterator[list[torch.Tensor]]:
        """Every parameter of ``model`` as this rank's shard of it (the parameter itself when it
        is not sharded), for in-place updates. A frozen root is resharded for the block and
        gathered again after it (collectives: every rank enters it). Outside a forward-backward
        window (the trainable root is sharded then)."""
        frozen = [root for m, root, trainable in self._roots if m is model and not trainable]
        for root in frozen:
            root.reshard()
        try:
            yield [p.to_local() if is_sharded(p) else p for p in model.parameters()]
        finally:
            for root in frozen:
                root.unshard()

    def load_full_state_dict(self, model: nn.Module, state: dict) -> None:
        """Load a full (unsharded) state dict, as :meth:`full_state_dict` gives, into
        ``model``: each rank keeps its shards of it. Every rank calls it with the whole dict."""
        if not self.is_sharded(model):
            model.load_state_dict(state)
            return
        # Optional: FSDP2/DCP exist only in torch builds with distributed support.
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        with self.local_shards(model):
            set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))

    def full_state_dict(self, module: nn.Module, trainable_only: bool = False) -> dict:
        """The full (unsharded) state dict of ``module`` on rank 0, on the CPU; ``{}`` on the
        other ranks. A collective when sharded; ``module.state_dict()`` otherwise.

        Args:
            module: a model, or a module holding sharded ones (the composer).
            trainable_only: only parameters with ``requires_grad`` (the composer's phi).
        """
        names = {n for n, p in module.named_parameters() if p.requires_grad}
        if not self.enabled:
            sd = module.state_dict()
        else:
            # Optional: FSDP2/DCP exist only in torch builds with distributed support.
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            options = StateDictOptions(
                full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only
            )
            sd = get_model_state_dict(module, options=options)
        # (A tied frozen weight can survive ignore_frozen_params: filter by name.)
        return {k: v for k, v in sd.items() if k in names} if trainable_only else sd
