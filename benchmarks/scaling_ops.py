"""The ops and variants ``benchmarks/scaling.py`` sweeps: inputs, one forward + backward call each.

Every variant is a function ``(inputs) -> None`` running one forward and backward on inputs from
its op's ``make_inputs(N, V, d, seed)`` (float32 leaves; what requires grad is the variant's
choice, set by ``grads``). Variants:

* ``topk_tail_kl`` (logits ``[N, V]``, M = 20, reverse KL, gradients to both logits):
  ``lk.topk_tail_kl`` (C++), its PyTorch reference (plain autograd: the materialized path) and
  TRL's eager top-k loss (``compute_topk_self_distillation_loss`` with the tail bucket, the
  teacher's top-k as support);
* ``fused_linear_logprob`` (where the install has it; hidden states ``[N, d]``, a head
  ``[V, d]``, the targets' log-probs, gradients to both): ``lk.fused_linear_logprob`` (C++), its
  materialized reference and TRL's ``ChunkedLogProbFunction`` (log-probs only);
* ``fused_linear_topk_tail_kl`` (hidden states ``[N, d]``, heads ``[V, d]``, M = 20, reverse KL,
  gradients to h_s, W_s, h_t; the teacher's head frozen): ``lk.fused_linear_topk_tail_kl``
  (chunked C++ path), the materialized reference (both ``[N, V]`` logits, plain autograd) and
  TRL's ``ChunkedDivergenceFunction`` (``DistillationTrainer``'s chunked loss: full-vocabulary
  reverse KL, ``beta=1``, gradients to h_s and W_s only, as TRL differentiates the student only).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import lopd_kernels as lk

M = 20


@dataclass
class Variant:
    """One implementation: ``run(inputs)`` does a forward + backward; ``grads`` names the inputs
    that require grad; ``needs`` the optional module it imports (a peer)."""

    run: Callable[[dict], None]
    grads: tuple[str, ...]
    needs: str | None = None


@dataclass
class Op:
    """An op's inputs and variants, and its sweeps: ``{"N": (fixed, [values]), "V": ...}`` with
    the other dimensions fixed (``fixed``: dict)."""

    make_inputs: Callable[[int, int, int, int], dict]
    variants: dict[str, Variant]
    sweeps: dict[str, tuple[dict, list[int]]] = field(default_factory=dict)
    quick_sweeps: dict[str, tuple[dict, list[int]]] = field(default_factory=dict)


# ------------------------------------------------------------------------------ topk_tail_kl


def logits_inputs(n: int, v: int, d: int, seed: int) -> dict:
    """Student ``2 N(0, 1)`` and teacher ``student + N(0, 1)`` logits, built in place (no [N, V]
    temporary beyond the two inputs), and targets."""
    g = torch.Generator().manual_seed(seed)
    s = torch.empty(n, v).normal_(generator=g).mul_(2)
    t = torch.empty(n, v).normal_(generator=g).add_(s)
    return {"s": s, "t": t, "a": torch.randint(0, v, (n,), generator=g)}


def ours_dense(x: dict) -> None:
    lk.topk_tail_kl(x["s"], x["t"], x["a"], top_m=M, backend="cpu").kl.sum().backward()


def reference_dense(x: dict) -> None:
    lk.topk_tail_kl_reference(x["s"], x["t"], x["a"], top_m=M).kl.sum().backward()


def trl_eager(x: dict) -> None:
    # trl is an optional benchmark peer (heavy import): imported on use.
    from trl.experimental.sdpo.loss_utils import compute_topk_self_distillation_loss

    # The support is the first argument's top-k: the teacher first, alpha = 0 then gives
    # KL(student || teacher) over the teacher's top-k + tail (as lk.topk_tail_kl).
    compute_topk_self_distillation_loss(
        x["t"], x["s"], distillation_topk=M, distillation_alpha=0.0, distillation_add_tail=True
    ).sum().backward()


# ------------------------------------------------------------------------------ fused


def hidden_inputs(n: int, v: int, d: int, seed: int) -> dict:
    """Hidden states and heads (the teacher's head = the student's + 10% noise), in place."""
    g = torch.Generator().manual_seed(seed)
    ws = torch.empty(v, d).normal_(generator=g).mul_(d**-0.5)
    wt = torch.empty(v, d).normal_(generator=g).mul_(0.1 * d**-0.5).add_(ws)
    hs = torch.empty(n, d).normal_(generator=g).mul_(2)
    ht = torch.empty(n, d).normal_(generator=g).mul_(0.5).add_(hs)
    return {"h_s": hs, "W_s": ws, "h_t": ht, "W_t": wt, "a": torch.randint(0, v, (n,), generator=g)}


def ours_fused(x: dict) -> None:
    out = lk.fused_linear_topk_tail_kl(
        x["h_s"], x["W_s"], x["h_t"], x["W_t"], x["a"], top_m=M, backend="chunked"
    )
    out.kl.sum().backward()


def reference_fused(x: dict) -> None:
    out = lk.fused_linear_topk_tail_kl_reference(
        x["h_s"], x["W_s"], x["h_t"], x["W_t"], x["a"], top_m=M
    )
    out.kl.sum().backward()


def trl_chunked(x: dict) -> None:
    # trl is an optional benchmark peer (heavy import): imported on use.
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    kl, _entropy = ChunkedDivergenceFunction.apply(
        x["h_s"], x["W_s"], None, x["h_t"], x["W_t"], None, 1.0, 1.0
    )
    kl.sum().backward()


# ------------------------------------------------------------------------------ fused logprob


def logprob_inputs(n: int, v: int, d: int, seed: int) -> dict:
    """Hidden states and a head (the student's side of :func:`hidden_inputs`), targets."""
    x = hidden_inputs(n, v, d, seed)
    return {"h": x["h_s"], "W": x["W_s"], "a": x["a"]}


def ours_logprob(x: dict) -> None:
    lk.fused_linear_logprob(x["h"], x["W"], x["a"], backend="cpu").logprob.sum().backward()


def reference_logprob(x: dict) -> None:
    lk.fused_linear_logprob_reference(x["h"], x["W"], x["a"]).logprob.sum().backward()


def trl_chunked_logprob(x: dict) -> None:
    # trl is an optional benchmark peer (heavy import): imported on use.
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    # Log-probs only (no optional outputs), as TRL's loss path asks for them.
    lp = ChunkedLogProbFunction.apply(
        x["h"], x["W"], None, x["a"], 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, ()
    )[0]
    lp.sum().backward()


FUSED_D = 128
OPS: dict[str, Op] = {
    "topk_tail_kl": Op(
        logits_inputs,
        {
            "lk.topk_tail_kl (C++)": Variant(ours_dense, ("s", "t")),
            "PyTorch reference (materialized)": Variant(reference_dense, ("s", "t")),
            "TRL eager top-k loss": Variant(trl_eager, ("s", "t"), needs="trl"),
        },
        sweeps={
            "N": ({"V": 32_768, "d": 0}, [256, 512, 1024, 2048, 4096, 8192]),
            "V": ({"N": 512, "d": 0}, [32_768, 65_536, 131_072, 151_936, 262_144]),
        },
        quick_sweeps={
            "N": ({"V": 1024, "d": 0}, [16, 32, 64]),
            "V": ({"N": 16, "d": 0}, [512, 1024, 2048]),
        },
    ),
    "fused_linear_topk_tail_kl": Op(
        hidden_inputs,
        {
            "lk.fused_linear_topk_tail_kl (chunked C++)": Variant(
                ours_fused, ("h_s", "W_s", "h_t")
            ),
            "PyTorch reference (materialized)": Variant(reference_fused, ("h_s", "W_s", "h_t")),
            "TRL ChunkedDivergenceFunction": Variant(trl_chunked, ("h_s", "W_s"), needs="trl"),
        },
        sweeps={
            "N": ({"V": 32_768, "d": FUSED_D}, [256, 512, 1024, 2048, 4096, 8192]),
            "V": ({"N": 1024, "d": FUSED_D}, [32_768, 65_536, 131_072, 151_936, 262_144]),
        },
        quick_sweeps={
            "N": ({"V": 1024, "d": 16}, [16, 32, 64]),
            "V": ({"N": 16, "d": 16}, [512, 1024, 2048]),
        },
    ),
}
if hasattr(lk, "fused_linear_logprob"):  # an op newer than some installs
    OPS["fused_linear_logprob"] = Op(
        logprob_inputs,
        {
            "lk.fused_linear_logprob (C++)": Variant(ours_logprob, ("h", "W")),
            "PyTorch reference (materialized)": Variant(reference_logprob, ("h", "W")),
            "TRL ChunkedLogProbFunction": Variant(trl_chunked_logprob, ("h", "W"), needs="trl"),
        },
        sweeps=OPS["fused_linear_topk_tail_kl"].sweeps,
        quick_sweeps=OPS["fused_linear_topk_tail_kl"].quick_sweeps,
    )


def point_inputs(op: str, variant: str, n: int, v: int, d: int, seed: int = 0) -> dict:
    """The inputs of one point, with ``requires_grad`` set on the variant's ``grads``."""
    x = OPS[op].make_inputs(n, v, d, seed)
    for k in OPS[op].variants[variant].grads:
        x[k].requires_grad_(True)
    return x


def clear_grads(x: dict) -> int:
    """Drops the inputs' gradients; returns their bytes (what the call hands to its caller)."""
    held = 0
    for t in x.values():
        if isinstance(t, torch.Tensor) and t.grad is not None:
            held += t.grad.numel() * t.grad.element_size()
            t.grad = None
    return held
