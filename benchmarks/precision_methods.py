"""Inputs and the methods measured by ``benchmarks/precision.py`` (ours and the peers').

Each dense method takes bf16 leaves ``s``, ``t`` ``[N, V]`` (and targets, divergence, beta); each
fused method a dict of bf16 leaves ``h_s``, ``W_s``, ``h_t``, ``W_t`` and targets ``y``. Each
returns ``(loss, grads)``: the per-row losses ``[N]`` (or their sum as a 0-d tensor), and the
gradients of the loss summed over rows, by input name, as the method returns them. TRL and Liger
are optional peers, imported on use; Liger can run in another interpreter (``--liger-python``:
inputs and gradients through a file) so that it never has to share an environment with lopd.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import lopd_kernels as lk

ROOT = Path(__file__).resolve().parent.parent
TOP_M = 20


# ------------------------------------------------------------------------------------- inputs


def dense_inputs(n: int, v: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 ``[n, v]`` student and teacher logits and ``[n]`` targets.

    Teacher: ``-1.5 ln(1 + rank) + N(0, 1)`` with a random frequency rank per row (Zipf-like, as
    an LM's next-token logits: a few likely tokens, a long tail around -18 at V = 151,936).
    Student: ``0.8 teacher + N(0, 0.7^2)`` (less sharp, correlated).
    """
    g = torch.Generator().manual_seed(seed)
    rank = torch.rand(n, v, generator=g).argsort(-1).to(torch.float32)
    t = rank.log1p_().mul_(-1.5).add_(torch.randn(n, v, generator=g))
    s = t.mul(0.8).add_(torch.randn(n, v, generator=g), alpha=0.7)
    return s.bfloat16(), t.bfloat16(), torch.randint(0, v, (n,), generator=g)


def fused_inputs(n: int, v: int, d: int, seed: int) -> dict[str, torch.Tensor]:
    """bf16 hidden states ``[n, d]`` and heads ``[v, d]`` giving Zipf-like logits.

    Column 0 of the head is a unigram prior ``-1.5 ln(1 + rank)`` read by a constant hidden unit
    (``h[:, 0] = 1``); the other columns are N(0, 2^2 / d) (context). Self-distillation: the
    teacher's head equals the student's (a separate, frozen tensor) and its hidden states are the
    student's plus N(0, 0.5^2) noise.
    """
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(v, d, generator=g).mul_(2.0 / math.sqrt(d))
    w[:, 0] = torch.randperm(v, generator=g).to(torch.float32).log1p_().mul_(-1.5)
    hs = torch.randn(n, d, generator=g)
    ht = hs + 0.5 * torch.randn(n, d, generator=g)
    hs[:, 0] = ht[:, 0] = 1.0
    bf = torch.bfloat16
    return {
        "h_s": hs.to(bf),
        "W_s": w.to(bf),
        "h_t": ht.to(bf),
        "W_t": w.to(bf),
        "y": torch.randint(0, v, (n,), generator=g),
    }


# ------------------------------------------------------------------------------------ methods
# Each returns (per-row losses [N] or the loss summed over rows as a 0-d tensor, {name: grad}).


def ours_dense(backend: str, top_m: int | None):
    def run(s, t, y, div, beta):
        out = lk.topk_tail_kl(s, t, y, top_m=top_m, backend=backend, **_our_div(div, beta))
        out.kl.sum().backward()
        return out.kl.detach(), {"s": s.grad, "t": t.grad}

    return run


def _our_div(div: str, beta: float) -> dict:
    return {"divergence": div} if div != "jsd" else {"divergence": "jsd", "beta": beta}


def divergence_from_logprobs(ls, lt, div, beta):
    """The obvious code: ``[R, V]`` log-probs in, per-row divergence out (TRL's formula)."""
    if div == "reverse":
        return (ls.exp() * (ls - lt)).sum(-1)
    if div == "forward":
        return (lt.exp() * (lt - ls)).sum(-1)
    lm = torch.logaddexp(ls + math.log1p(-beta), lt + math.log(beta))
    return beta * (lt.exp() * (lt - lm)).sum(-1) + (1 - beta) * (ls.exp() * (ls - lm)).sum(-1)


def torch_fp32(s, t, y, div, beta):
    """``log_softmax`` in float32 after the cast (what a user writes first)."""
    rows = divergence_from_logprobs(
        F.log_softmax(s.float(), -1), F.log_softmax(t.float(), -1), div, beta
    )
    rows.sum().backward()
    return rows.detach(), {"s": s.grad, "t": t.grad}


def trl_gkd(s, t, y, div, beta):
    """TRL's ``GKDTrainer.generalized_jsd_loss`` on the logits as given (bf16)."""
    # trl is an optional benchmark peer (heavy import): imported on use.
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    rows = GKDTrainer.generalized_jsd_loss(s, t, beta=_beta(div, beta), reduction="none").sum(-1)
    rows.sum().backward()
    return rows.detach().float(), {"s": s.grad, "t": t.grad}


def _beta(div: str, beta: float) -> float:
    return {"reverse": 1.0, "forward": 0.0}.get(div, beta)


def ours_fused(top_m: int | None):
    def run(x, div, beta):
        out = lk.fused_linear_topk_tail_kl(
            x["h_s"],
            x["W_s"],
            x["h_t"],
            x["W_t"],
            x["y"],
            top_m=top_m,
            backend="chunked",
            **_our_div(div, beta),
        )
        out.kl.sum().backward()
        return out.kl.detach(), _fused_grads(x)

    return run


def _fused_grads(x) -> dict:
    return {k: x[k].grad for k in ("h_s", "W_s", "h_t") if x[k].requires_grad}


def torch_fused_bf16_head(x, div, beta):
    """``nn.Linear`` in bf16 (bf16 logits), then ``log_softmax`` in float32."""
    s, t = x["h_s"] @ x["W_s"].T, x["h_t"] @ x["W_t"].T
    rows = divergence_from_logprobs(
        F.log_softmax(s.float(), -1), F.log_softmax(t.float(), -1), div, beta
    )
    rows.sum().backward()
    return rows.detach(), _fused_grads(x)


def trl_chunked(x, div, beta):
    """TRL's ``ChunkedDivergenceFunction`` (student gradients only)."""
    # trl is an optional benchmark peer (heavy import): imported on use.
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    x["h_t"].requires_grad_(False)
    rows, _entropy = ChunkedDivergenceFunction.apply(
        x["h_s"], x["W_s"], None, x["h_t"], x["W_t"], None, _beta(div, beta), 1.0
    )
    rows.sum().backward()
    return rows.detach(), _fused_grads(x)


def liger(compiled: bool, python: str | None):
    def run(x, div, beta):
        if python is None:
            return _liger_in_process(x, _beta(div, beta), compiled)
        return _liger_subprocess(python, x, _beta(div, beta), compiled)

    return run


def _liger_in_process(x, beta, compiled):
    # liger_kernel is an optional benchmark peer: imported on use.
    from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

    x["h_t"].requires_grad_(False)
    n = x["y"].numel()
    loss = LigerFusedLinearJSDLoss(
        weight_hard_loss=0.0, weight_soft_loss=1.0, beta=beta, compiled=compiled
    )(x["h_s"], x["W_s"], x["h_t"], x["W_t"], x["y"])
    (loss * n).backward()  # Liger's loss is the mean over tokens: back to the sum
    return (loss.detach() * n), _fused_grads(x)


def _liger_subprocess(python, x, beta, compiled):
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp, "in.pt"), Path(tmp, "out.pt")
        torch.save(
            {k: v.detach() for k, v in x.items()} | {"beta": beta, "compiled": compiled}, src
        )
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        cmd = [
            python,
            str(ROOT / "benchmarks" / "precision.py"),
            "--liger-worker",
            str(src),
            str(dst),
        ]
        subprocess.run(cmd, check=True, env=env, capture_output=True, text=True)
        out = torch.load(dst)
    return out["loss"], {"h_s": out["h_s"], "W_s": out["W_s"]}


def liger_worker(src: str, dst: str) -> None:
    """``--liger-worker IN OUT``: Liger's loss and gradients on the inputs in IN, saved to OUT."""
    x = torch.load(src)
    beta, compiled = x.pop("beta"), x.pop("compiled")
    x["h_s"].requires_grad_(True)
    x["W_s"].requires_grad_(True)
    loss, grads = _liger_in_process(x, beta, compiled)
    torch.save({"loss": loss, **grads}, dst)


# ------------------------------------------------------------------------------------ table 1


def _supported(fn: Callable[[], object]) -> str | None:
    """None when ``fn()`` runs, else the one-line reason it refused (an option not supported)."""
    try:
        fn()
    except (TypeError, ValueError, RuntimeError, NotImplementedError) as err:
        return f"{type(err).__name__}: {str(err).splitlines()[0]}"[:200]
    return None


def _probe_dense(backend, div, beta):
    s, t = torch.randn(2, 64), torch.randn(2, 64)
    y = torch.zeros(2, dtype=torch.long)
    return _supported(
        lambda: lk.topk_tail_kl(s, t, y, top_m=4, backend=backend, **_our_div(div, beta))
    )


def _probe_fused(div, beta):
    h, w = torch.randn(2, 8), torch.randn(64, 8)
    y = torch.zeros(2, dtype=torch.long)
    return _supported(
        lambda: lk.fused_linear_topk_tail_kl(
            h, w, h, w, y, top_m=4, backend="chunked", **_our_div(div, beta)
        )
    )


def _peer_missing(module: str) -> str | None:
    """Why an optional peer (trl, liger_kernel) cannot run here, or None."""
    return None if importlib.util.find_spec(module) else f"{module} is not installed"


def dense_methods(peers: bool):
    rows = [
        (
            "lk.topk_tail_kl cpu",
            None,
            ours_dense("cpu", None),
            lambda d, b: _probe_dense("cpu", d, b),
        ),
        (
            "lk.topk_tail_kl torch",
            None,
            ours_dense("torch", None),
            lambda d, b: _probe_dense("torch", d, b),
        ),
        ("PyTorch log_softmax(fp32)", None, torch_fp32, None),
        (
            "lk.topk_tail_kl cpu",
            TOP_M,
            ours_dense("cpu", TOP_M),
            lambda d, b: _probe_dense("cpu", d, b),
        ),
        (
            "lk.topk_tail_kl torch",
            TOP_M,
            ours_dense("torch", TOP_M),
            lambda d, b: _probe_dense("torch", d, b),
        ),
    ]
    if peers:
        missing = _peer_missing("trl")
        rows.insert(
            3,
            (
                "TRL GKD generalized_jsd_loss (bf16)",
                None,
                trl_gkd,
                (lambda d, b: missing) if missing else None,
            ),
        )
    return rows


def fused_methods(peers: bool, liger_python: str | None):
    probe = _probe_fused
    rows = [
        ("lk.fused_linear_topk_tail_kl cpu", None, ours_fused(None), probe),
        ("PyTorch bf16 head + log_softmax(fp32)", None, torch_fused_bf16_head, None),
    ]
    if peers:
        trl_missing = _peer_missing("trl")
        rows.append(
            (
                "TRL ChunkedDivergenceFunction",
                None,
                trl_chunked,
                (lambda d, b: trl_missing) if trl_missing else None,
            )
        )
        lig_missing = None if liger_python else _peer_missing("liger_kernel")
        for compiled in (False, True):
            name = "Liger LigerFusedLinearJSDLoss" + (" compiled" if compiled else " eager")
            rows.append(
                (
                    name,
                    None,
                    liger(compiled, liger_python),
                    (lambda d, b, m=lig_missing: m) if lig_missing else None,
                )
            )
    rows.append(("lk.fused_linear_topk_tail_kl cpu", TOP_M, ours_fused(TOP_M), probe))
    return rows
