"""Loss and gradient accuracy of distillation losses on bf16 inputs, against float64.

    python benchmarks/precision.py            # ~60 min on 1 thread; records + markdown tables
    python benchmarks/precision.py --report   # the tables again, from the saved records
    python benchmarks/precision.py --quick    # seconds, tiny shapes (test_bench_scripts.py)

**Table 1, bf16 accuracy.** The inputs are rounded to bfloat16 once: student / teacher logits
``[N, V]`` (dense ops), or hidden states ``[N, d]`` and LM heads ``[V, d]`` (fused ops). The truth
is a float64 computation on *those same rounded values* (logits ``h @ W^T`` formed in float64),
so what is measured is each implementation's own arithmetic, not the rounding of its inputs.
Every method's loss is the per-token divergence summed over the N tokens (a mean-reduced loss is
scaled back by N), its gradients those of that sum. Errors:

* ``loss``: ``|sum_r L_r - sum_r L64_r| / |sum_r L64_r|`` (the batch loss);
* ``loss worst row``: ``max_r |L_r - L64_r| / |L64_r|`` (where the method returns per-token
  losses);
* ``grad x``: ``||g - g64||_F / ||g64||_F`` over the whole gradient tensor of input ``x``, ``g``
  as the method returns it (bf16 for bf16 inputs), in float64; ``grad_worst_row`` (JSON): the
  largest per-row ratio.

Row ``float64 truth rounded to bf16`` is the floor: the error of the exact gradient once stored in
bf16, which no method returning a bf16 gradient can beat. Methods at the full vocabulary
(``top_m=None``), for the reverse KL, the forward KL and the generalized JSD with beta = 0.5
(TRL's convention: beta = 1 is KL(student || teacher), 0 is KL(teacher || student), else
``beta KL(T || M) + (1 - beta) KL(S || M)`` with ``M = (1 - beta) S + beta T``; a divergence our
install does not support is reported as such, not dropped):

* dense: ``lk.topk_tail_kl`` (``backend="cpu"`` and ``"torch"``); the obvious PyTorch code
  (``log_softmax`` of the logits cast to float32, the divergence in float32); TRL's
  ``GKDTrainer.generalized_jsd_loss`` on the bf16 logits as ``GKDTrainer`` passes them;
* fused: ``lk.fused_linear_topk_tail_kl`` (``backend="chunked"``); the obvious PyTorch code on a
  bf16 LM head (``h @ W.T`` in bf16, as ``nn.Linear`` gives it, then the float32 code above); TRL's
  ``ChunkedDivergenceFunction`` (``DistillationTrainer``'s chunked loss); Liger's
  ``LigerFusedLinearJSDLoss`` (``weight_hard_loss=0, weight_soft_loss=1``; eager and
  ``compiled=True``), run in-process when ``liger_kernel`` imports, else by ``--liger-python``
  (an interpreter that has it; inputs and gradients go through a file). TRL's and Liger's
  fused losses differentiate the student only: their teacher columns are ``n/a``.

Our ops also at ``top_m=20`` against the float64 top-M + exact-tail truth.

**Table 2, the tail.** Teachers whose top-M (M = 20) holds a chosen mass (0.99, 0.9999,
1 - 1e-7, and 1 - 1e-9 below the clamp's floor; logits built in float64, then rounded to float32
or bf16, the achieved mass recorded) and two students (32 rows each at V = 151,936): ``near``
(the teacher plus N(0, 0.5^2) noise) and ``broad`` (the same with its tail raised until the
student puts 0.9 on the teacher's top-M). Every method computes in float32 from the rounded
logits over the teacher's top-M; KL and gradient errors against the float64 exact-tail bucket KL:

* ``exact tail``: ``lk.topk_tail_kl`` (the log-sum-exp of the complement);
* ``clamped 1 - sum``: TRL's ``add_tail_bucket`` (``trl/experimental/sdpo/loss_utils.py``; the same
  code as ``_add_tail_bucket`` in ``trl/experimental/server_distillation/``), i.e.
  ``log(-expm1(clamp(logsumexp(topk_logprobs), max=-1e-7)))``, then TRL's ``compute_divergence``;
* ``renormalized``: top-M log-probs renormalized over the top-M (axolotl's KD loss; TRL's
  ``distillation_add_tail=False``);
* ``truncated``: the top-M terms of the KL without a tail, then ``clamp_min(0)`` (verl's
  ``compute_forward_kl_topk``, ``verl/trainer/distillation/fsdp/losses.py``).

Records: ``benchmarks/results/precision.json`` and ``precision_tail.json`` (``--results DIR``
elsewhere); ``--quick`` writes only with ``--results``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import RESULTS_DIR, record, torch_threads
from benchmarks.precision_methods import (
    TOP_M,
    dense_inputs,
    dense_methods,
    fused_inputs,
    fused_methods,
    liger_worker,
)
from benchmarks.precision_tail import tail_markdown, tail_table
from benchmarks.precision_truth import (
    DIVERGENCES,
    dw_err,
    logits64,
    loss_errors,
    matmul64,
    rel_err,
    truth_dense,
    worst_row_err,
)

FULL = {"N": 256, "V": 151_936, "d": 1024, "tail_N": 32}
QUICK = {"N": 16, "V": 4096, "d": 64, "tail_N": 16}


def _metrics(loss, grads, truth, names) -> dict:
    rows64, g64 = truth
    out = loss_errors(loss, rows64)
    for k in names:
        g = grads.get(k)
        if g is None:
            out[f"grad_{k}_rel_err"] = out[f"grad_{k}_worst_row"] = None
            continue
        out[f"grad_{k}_rel_err"] = rel_err(g, g64[k])
        out[f"grad_{k}_worst_row"] = worst_row_err(g, g64[k]) if k != "W_s" else None
    return out


def _floor(truth, names) -> dict:
    _rows64, g64 = truth
    out = {"loss_rel_err": None, "loss_worst_row_rel_err": None}
    for k in names:
        out[f"grad_{k}_rel_err"] = rel_err(g64[k].bfloat16(), g64[k])
        out[f"grad_{k}_worst_row"] = (
            worst_row_err(g64[k].bfloat16(), g64[k]) if k != "W_s" else None
        )
    return out


def run_dense(size, args, emit) -> None:
    s0, t0, y = dense_inputs(size["N"], size["V"], args.seed)
    for div, beta in args.divergences:
        truths = {m: truth_dense(s0, t0, div, beta, m) for m in (None, TOP_M)}
        truths = {m: (r, {"s": gs, "t": gt}) for m, (r, gs, gt) in truths.items()}
        emit("dense", "float64 truth rounded to bf16", div, beta, None, _floor(truths[None], "st"))
        for name, top_m, fn, probe in dense_methods(not args.no_peers):
            why = probe(div, beta) if probe else None
            if why:
                emit("dense", name, div, beta, top_m, {"unsupported": why})
                continue
            s, t = s0.clone().requires_grad_(True), t0.clone().requires_grad_(True)
            c0 = time.perf_counter()
            loss, grads = fn(s, t, y, div, beta)
            secs = time.perf_counter() - c0
            emit("dense", name, div, beta, top_m, _metrics(loss, grads, truths[top_m], "st"), secs)
            del s, t, loss, grads


def run_fused(size, args, emit) -> None:
    x0 = fused_inputs(size["N"], size["V"], size["d"], args.seed)
    names = ("h_s", "W_s", "h_t")
    # Float64 logits of the rounded inputs, formed one vocabulary slab at a time.
    s64 = logits64(x0["h_s"], x0["W_s"])
    t64 = logits64(x0["h_t"], x0["W_t"])
    for div, beta in args.divergences:
        for top_m in (None, TOP_M):
            rows64, gs64, gt64 = truth_dense(s64, t64, div, beta, top_m)
            g64 = {
                "h_s": matmul64(gs64, x0["W_s"]),
                "h_t": matmul64(gt64, x0["W_t"]),
                "W_s": (gs64, x0["h_s"].double()),
            }
            truth = (rows64, g64)
            if top_m is None:
                emit("fused", "float64 truth rounded to bf16", div, beta, None, _fused_floor(truth))
            for name, m, fn, probe in fused_methods(not args.no_peers, args.liger_python):
                if m != top_m:
                    continue
                why = probe(div, beta) if probe else None
                if why:
                    emit("fused", name, div, beta, m, {"unsupported": why})
                    continue
                x = {k: v.clone() for k, v in x0.items()}
                for k in names:
                    x[k].requires_grad_(True)
                c0 = time.perf_counter()
                loss, grads = fn(x, div, beta)
                secs = time.perf_counter() - c0
                emit("fused", name, div, beta, m, _fused_metrics(loss, grads, truth), secs)
                del x, loss, grads
            del gs64, gt64, g64, truth


def _fused_metrics(loss, grads, truth) -> dict:
    rows64, g64 = truth
    out = _metrics(
        loss, {k: v for k, v in grads.items() if k != "W_s"}, (rows64, g64), ("h_s", "h_t")
    )
    out["grad_W_s_rel_err"] = dw_err(grads.get("W_s"), *g64["W_s"])
    out["grad_W_s_worst_row"] = None
    return out


def _fused_floor(truth) -> dict:
    rows64, g64 = truth
    out = _floor((rows64, {k: g64[k] for k in ("h_s", "h_t")}), ("h_s", "h_t"))
    gs64, h64 = g64["W_s"]
    out["grad_W_s_rel_err"] = dw_err(None, gs64, h64, floor=True)
    out["grad_W_s_worst_row"] = None
    return {
        k: out[k]
        for k in (
            "loss_rel_err",
            "loss_worst_row_rel_err",
            "grad_h_s_rel_err",
            "grad_h_s_worst_row",
            "grad_W_s_rel_err",
            "grad_W_s_worst_row",
            "grad_h_t_rel_err",
            "grad_h_t_worst_row",
        )
    }


# ------------------------------------------------------------------------------------ output


def _fmt(v) -> str:
    if v is None:
        return "n/a"
    return f"{v:.1e}"


def markdown(rows: list[dict]) -> str:
    """Table 1 as markdown: one table per kind (dense, fused), a row per measured (method,
    top_m, divergence); what could not run is listed under its table with the reason."""
    out = []
    for table, grads in (("dense", ("s", "t")), ("fused", ("h_s", "W_s", "h_t"))):
        sel = [r for r in rows if r["shapes"]["table"] == table]
        if not sel:
            continue
        dims = ", ".join(f"{k}={v}" for k, v in sel[0]["shapes"].items() if k in "NVd")
        head = ["method", "top_m", "divergence", "loss", "loss worst row"]
        head += [f"grad {g}" for g in grads]
        out += [f"\n{table} ({dims}, bf16 inputs)", "", "| " + " | ".join(head) + " |"]
        out.append("|" + "---|" * len(head))
        missing: dict[str, list[str]] = {}
        for r in sel:
            sh = r["shapes"]
            div = sh["divergence"] + (f" {sh['beta']}" if sh["divergence"] == "jsd" else "")
            where = f"{r['backend']} (top_m={sh['top_m'] or 'full'}, {div})"
            if "unsupported" in r:
                missing.setdefault(r["unsupported"], []).append(where)
                continue
            cells = [r["backend"], str(sh["top_m"] or "full"), div]
            cells += [_fmt(r["loss_rel_err"]), _fmt(r["loss_worst_row_rel_err"])]
            cells += [_fmt(r[f"grad_{g}_rel_err"]) for g in grads]
            out.append("| " + " | ".join(cells) + " |")
        for why, where in missing.items():
            out.append(f"\nNot run ({why}): " + "; ".join(where) + ".")
    return "\n".join(out)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="tiny shapes (seconds); writes only with --results"
    )
    p.add_argument(
        "--results", type=Path, default=None, help="records folder (default benchmarks/results)"
    )
    p.add_argument(
        "--divergences",
        default="reverse,forward,jsd",
        help="comma list of reverse, forward, jsd (JSD at --beta)",
    )
    p.add_argument("--beta", type=float, default=0.5, help="the JSD's beta (TRL's convention)")
    p.add_argument("--tables", default="dense,fused,tail", help="comma list of dense, fused, tail")
    p.add_argument(
        "--liger-python",
        default=os.environ.get("LOPD_LIGER_PYTHON"),
        help="a Python with liger-kernel installed (when this one has none)",
    )
    p.add_argument("--no-peers", action="store_true", help="skip TRL and Liger")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report", action="store_true", help="print the tables of the saved records")
    p.add_argument("--liger-worker", nargs=2, metavar=("IN", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    names = [d.strip() for d in args.divergences.split(",") if d.strip()]
    bad = [d for d in names if d not in DIVERGENCES]
    if bad or not 0 < args.beta < 1:
        p.error(f"--divergences takes {DIVERGENCES} (got {bad}); --beta in (0, 1)")
    args.divergences = [(d, args.beta if d == "jsd" else None) for d in names]
    args.tables = {t.strip() for t in args.tables.split(",")}
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.liger_worker:
        liger_worker(*args.liger_worker)
        return []
    if args.report:
        folder = args.results or RESULTS_DIR
        records = json.loads((folder / "precision.json").read_text())
        tail = json.loads((folder / "precision_tail.json").read_text())
        print(markdown(records))
        print(tail_markdown(tail))
        return records + tail
    size = QUICK if args.quick else FULL
    write = args.results is not None or not args.quick
    records: list[dict] = []

    def emit(table, method, div, beta, top_m, metrics, secs=None):
        shapes = {
            "table": table,
            "N": size["N"],
            "V": size["V"],
            "dtype": "bfloat16",
            "divergence": div,
            "beta": beta,
            "top_m": top_m,
        }
        if table == "fused":
            shapes["d"] = size["d"]
        fields = {"threads": torch.get_num_threads(), **metrics}
        rec = (
            record("precision", method, shapes, secs, None, results_dir=args.results, **fields)
            if write
            else {"backend": method, "shapes": shapes, "median_s": secs, **fields}
        )
        records.append(rec)
        print(
            f"{table:5} {method:40} top_m={top_m} {div:7} "
            + " ".join(
                f"{k}={_fmt(v) if isinstance(v, float) or v is None else v}"
                for k, v in metrics.items()
                if k.endswith("rel_err") or k == "unsupported"
            ),
            flush=True,
        )

    with torch_threads(args.threads), torch.no_grad(), torch.enable_grad():
        if "dense" in args.tables:
            run_dense(size, args, emit)
        if "fused" in args.tables:
            run_fused(size, args, emit)
        print(markdown(records))
        if "tail" in args.tables:
            tail = tail_table(
                size["tail_N"], size["V"], TOP_M, args.seed, args.results, write, not args.no_peers
            )
            records += tail
    return records


if __name__ == "__main__":
    main()
