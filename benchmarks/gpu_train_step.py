"""One LOPD training step of a random-initialized Qwen3-0.6B-shaped model, bf16, one GPU.

    python benchmarks/gpu_train_step.py --variant fused_linear     # or --variant materialized

What one step of ``lopd`` does on a batch of trajectories, through the public APIs (transformers,
``lopd_kernels``, ``lopd.loss``), timed part by part with CUDA events:

* ``forward``: the student's decoder on B x L tokens, and the frozen teacher's (a copy of the
  initial student) on the same tokens with J*K = 96 latent rows in front (``c_phi``, a trained
  ``[B, 96, d]`` tensor standing in for the composer's output: the gradient of the privilege term
  reaches it through the frozen teacher, as in LOPD);
* ``loss``: the top-M + tail KL on the action rows (the second half of each sequence) and
  ``lopd.loss.lopd_loss`` (KL + beta (m - Delta) + lambda * anchor). ``--variant fused_linear``
  calls ``lk.fused_linear_topk_tail_kl`` on the final hidden states (no [N, V] logits;
  ``lopd.fused_linear=true``), ``materialized`` forms both heads' logits and calls
  ``lk.topk_tail_kl``;
* ``backward``: ``loss.backward()`` into the student (its tied head included) and ``c_phi``;
* ``optimizer``: AdamW on the student and ``c_phi``.

Records (op ``lopd_train_step``): the median step and each part (``shapes["part"]``); the step's
record has ``tokens_per_s`` (student tokens per second) and ``peak_mem_bytes``, the allocator's
peak during the timed steps above the memory held between steps (weights, optimizer state).
The model is only Qwen3-0.6B-*shaped* (its config, random weights): a stand-in for speed and
memory, no loss value of it means anything.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as gc

VARIANTS = ("fused_linear", "materialized")
# size -> (Qwen3Config kwargs, batch B, length L, latent rows J*K)
QWEN3_0_6B = dict(
    vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40_960,
    rms_norm_eps=1e-6, tie_word_embeddings=True,
)  # fmt: skip
TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    tie_word_embeddings=True,
)  # fmt: skip
SIZES = {"full": (QWEN3_0_6B, 4, 2048, 96), "tiny": (TINY, 2, 32, 4)}
TOP_M, MARGIN, ANCHOR, BETA = 20, 0.05, 0.2, 1.0


def build(args, device: torch.device, dtype: torch.dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg_kwargs, batch, length, n_lat = SIZES[args.size]
    cfg = Qwen3Config(**cfg_kwargs)
    torch.manual_seed(0)
    with torch.device(device):
        student = Qwen3ForCausalLM(cfg).to(dtype)
    teacher = copy.deepcopy(student).requires_grad_(False).eval()
    g = torch.Generator(device=device).manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (batch, length), generator=g, device=device)
    d = cfg.hidden_size
    latents = torch.randn(batch, n_lat, d, generator=g, device=device).mul_(0.02).to(dtype)
    latents0 = (latents + 0.001 * torch.randn_like(latents)).detach()
    latents.requires_grad_(True)
    # Action rows: the second half of every sequence; row p - 1 predicts token p.
    pos = torch.arange(length // 2, length - 1, device=device)
    seg = torch.arange(batch, device=device).repeat_interleave(pos.numel())
    rows = pos.repeat(batch)
    targets = ids[seg, rows + 1]
    rewards = torch.rand(batch, generator=g, device=device)
    return cfg, student, teacher, ids, latents, latents0, seg, rows, targets, rewards


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", required=True, choices=VARIANTS)
    args, device = gc.parse_args(parser, argv, reps=3)
    if device is None:
        return 0
    import lopd_kernels as lk
    from lopd.loss import advantages_from_rewards, lopd_loss

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    _cfg, student, teacher, ids, latents, latents0, seg, rows, targets, rewards = build(
        args, device, dtype
    )
    batch, length = ids.shape
    n_lat = latents.shape[1]
    params = [*student.parameters(), latents]
    opt = torch.optim.AdamW(params, lr=1e-5)
    w_s, w_t = student.get_output_embeddings().weight, teacher.get_output_embeddings().weight

    def forward():
        h_s = student.get_decoder()(input_ids=ids).last_hidden_state
        embeds = teacher.get_input_embeddings()(ids)
        t_in = torch.cat([latents, embeds], dim=1)
        h_t = teacher.get_decoder()(inputs_embeds=t_in).last_hidden_state
        return h_s[seg, rows], h_t[seg, rows + n_lat]

    def loss_of(h_s, h_t):
        if args.variant == "fused_linear":
            out = lk.fused_linear_topk_tail_kl(h_s, w_s, h_t, w_t, targets, top_m=TOP_M)
        else:
            out = lk.topk_tail_kl(h_s @ w_s.T, h_t @ w_t.T, targets, top_m=TOP_M)
        terms = lopd_loss(
            out.kl, out.privilege, seg, advantages_from_rewards(rewards), latents, latents0,
            beta=BETA, margin=MARGIN, anchor_weight=ANCHOR,
        )  # fmt: skip
        return terms.loss

    def step(sw: gc.Stopwatch | None) -> None:
        mark = sw.mark if sw is not None else (lambda: None)
        mark()
        h_s, h_t = forward()
        mark()
        loss = loss_of(h_s, h_t)
        mark()
        loss.backward()
        mark()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mark()

    for _ in range(args.warmup):  # kernels compiled, optimizer state allocated
        step(None)
    gc.sync(device)
    base = peak = None
    if device.type == "cuda":
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    parts = {"forward": [], "loss": [], "backward": [], "optimizer": [], "step": []}
    for _ in range(args.reps):
        sw = gc.Stopwatch(device)
        step(sw)
        d = sw.deltas()
        for name, x in zip(("forward", "loss", "backward", "optimizer"), d):
            parts[name].append(x)
        parts["step"].append(sum(d))
    if base is not None:
        gc.sync(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    shapes = {"model": "Qwen3-0.6B-shaped" if args.size == "full" else "tiny-Qwen3",
              "B": batch, "L": length, "action_rows": int(rows.numel()), "latent_rows": n_lat,
              "M": TOP_M, "dtype": str(dtype).removeprefix("torch.")}  # fmt: skip
    rec = gc.Recorder(args.records, device)
    step_s = gc.median(parts["step"])
    total = None if base is None else torch.cuda.max_memory_allocated(device)
    rec.add("lopd_train_step", args.variant, {**shapes, "part": "step"}, step_s, peak,
            tokens_per_s=batch * length / step_s, peak_allocated_total_bytes=total,
            params=sum(p.numel() for p in student.parameters()))  # fmt: skip
    for name in ("forward", "loss", "backward", "optimizer"):
        med = gc.median(parts[name])
        rec.add("lopd_train_step", args.variant, {**shapes, "part": name}, med,
                fraction_of_step=med / step_s)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
