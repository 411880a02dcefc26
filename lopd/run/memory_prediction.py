"""Predicted per-GPU peak memory of a LOPD run, per phase, from the model's shape and the config.

    python -m lopd.run.memory_prediction                      # the paper preset, Qwen3-0.6B/4B/8B
    python -m lopd.run.memory_prediction --tokens 8192 --models qwen3-4b

The same account as :mod:`lopd.run.memory_account` (weights, gradients, AdamW, saved
activations, the LM-head kernels' working set), counted from shapes instead of measured, for
the phases of a run on one GPU (``world=1``; DDP replicas hold the same) or per rank of
``model.parallel=fsdp2`` over ``world`` GPUs. All sizes in bytes.

What is counted (the code paths as they are, ``lopd/models/loading.py``,
``lopd/latent/teacher.py``, ``lopd/latent/composer.py``, ``lopd/methods/lopd.py``,
``lopd/parallel/fsdp.py``):

* **Weights.** ``model.dtype=bfloat16`` (the paper preset): the student is float32 master
  weights (4 B/parameter), the frozen backbone (teacher, encoder base, embedder: one copy) bf16
  (2 B), phi (the encoder's LoRA on the seven projections of every layer, and the QFormer,
  layers shared) float32. ``float32`` (CPU stand-ins): 4 B everywhere.
* **Gradients and AdamW.** During a step the student's float32 gradients (4 B) and AdamW's two
  moments (8 B) per parameter, and the same for phi; the cold start trains phi alone with its
  own AdamW (freed with it).
* **FSDP2** over ``world`` GPUs: the student's master weights, gradients and AdamW, and the
  backbone's decoder layers, are ``1/world`` per rank; the backbone's root (embedding, norm,
  head) stays gathered in bf16 on every rank; during the student's forward-backward its root
  is gathered in bf16 (``MixedPrecisionPolicy``), and at any time two decoder layers are
  gathered in bf16 (the current one and the prefetched one) plus one layer's unsharded float32
  gradient before its reduce-scatter. Models are loaded whole on every rank and the backbone is
  sharded only after the cold start, so ``load`` and ``cold start`` hold the unsharded backbone.
  phi is counted replicated (its LoRA is in fact sharded: a small overestimate).
* **Saved activations.** Per token per decoder layer, counted tensor by tensor
  (:meth:`ModelShape.trained_layer_bytes`, :meth:`ModelShape.frozen_layer_bytes`): a trained
  layer under bf16 autocast saves its RMSNorm outputs in float32 (the residual stream of float32
  master weights stays float32), the bf16 casts of its projections' inputs, the float32 q/k
  norms, attention's q, k, v, output and log-sum-exp, and the MLP's gate, activation, up and
  product; a frozen layer (gradient to its input only) saves no projection inputs.
  Both counts equal what autograd saves in a Hugging Face Qwen3 layer (SDPA, CPU; the tests).
  ``model.gradient_checkpointing`` recomputes the **student** per layer: it keeps one float32
  ``[tokens, d]`` boundary per layer (its input; the first is the embedding output) plus the
  final hidden states, and one layer's activations while recomputing. The **teacher** is
  recomputed per layer too (``teacher_action_hidden(checkpointed=True)``): its forward keeps
  each layer's input in the compute dtype, its backward one frozen layer's activations at a
  time; ``teacher_layer_checkpointing=False`` predicts a teacher checkpointed as one block,
  whose recompute saves every layer's activations at once (the gradient reaches phi through
  all of them). The **encoder** (``J`` retrieved experiences of ``max_encoder_tokens``, padded, per
  task, LoRA trained) is recomputed per layer under ``model.gradient_checkpointing`` (a boundary
  per layer kept; one layer's activations in its backward, which comes after the teacher's and
  is counted in the same term as the larger of the two); without it, its activations stay saved
  until the backward.
* **LM-head kernels.** The cold start's :func:`lopd_kernels.fused_linear_logprob` (frozen head,
  hidden states need the gradient): :func:`lopd.run.memory_account.lm_head_bytes` on CUDA.
  The step's fused top-M op on CUDA (chunked path): its ``[C, V]`` float32 blocks capped at
  512 MiB (the GPU cap of ``auto_chunk_rows``, reached when a quarter of the free memory exceeds
  it), the float32 ``[V, d]`` weight-gradient accumulator of the student's head, the float32
  ``[N, d]`` hidden-state gradients of both models, and (without FSDP2) the bf16 copies of the
  student's head and hidden states that the kernels read.
* **Autocast.** Without FSDP2, autocast caches the bf16 copy of every student weight it casts
  until the forward's autocast region ends (2 B/parameter during the forward); under FSDP2 the
  gathered parameters are bf16 already.
* **Rollouts** (HF engine) need a KV cache of ``layers * 2 * kv_heads * head_dim * 2`` bytes per
  token of every sequence generated together; :meth:`Prediction.rollout_sequences` is how many
  full-length sequences fit beside the step's persistent state (FSDP2 generation gathers the
  whole student in bf16 first). vLLM instead takes ``gen.vllm_gpu_memory_utilization`` of the GPU.

Assumptions: every trajectory is ``tokens`` long (student and teacher sequences alike; the
paper preset caps trajectories at ``gen.max_total_tokens`` = 40,448 so that the framed teacher
sequence fits 40,960), every token of it is scored (``action_tokens = tokens``, an upper
bound), micro-batches of ``train.micro_batch`` trajectories, ``cold_start.batch_size / world``
trajectories per rank in one cold-start forward, flash/SDPA attention (no ``[L, L]`` scores),
the student's backward and the teacher's recompute not overlapping but the student's
checkpoint boundaries alive during the teacher's recompute (the order autograd picks can only
lower the peak). Not counted: the CUDA context, NCCL and cuBLAS workspaces (``fits`` keeps
:data:`CONTEXT_BYTES` for them), allocator fragmentation, the bank's embedding index (CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from dataclasses import dataclass, field

import torch

from lopd.config import Config
from lopd.config.presets import PRESETS
from lopd.run.memory_account import lm_head_bytes
from lopd.run.model_shape import MODELS, ModelShape
from lopd_kernels.qformer import QFormerCompressor

__all__ = [
    "CONTEXT_BYTES",
    "GPUS",
    "MODELS",
    "ModelShape",
    "Prediction",
    "RunSetting",
    "fits",
    "markdown_table",
    "predict",
]

GIB = 2**30
#: Top-M chunk blocks on a GPU: ``_CHUNK_BUDGET_CAP["cuda"]`` of the chunked path.
TOPM_BLOCK_BYTES = 512 << 20
#: Kept free for what PyTorch's allocator does not see: CUDA context, NCCL, cuBLAS workspaces.
CONTEXT_BYTES = 2 * GIB
#: GPU memory as ``nvidia-smi`` reports it: H100 80GB 81,559 MiB, H200 143,771 MiB.
GPUS: dict[str, int] = {"80 GB": 81_559 << 20, "141 GB": 143_771 << 20}


@dataclass(frozen=True)
class RunSetting:
    """The config knobs the memory depends on (:meth:`of` reads them from a preset).

    Attributes:
        tokens: tokens per trajectory; action_tokens: rows scored per trajectory (``None``:
            all of them).
        world: GPUs; fsdp: ``model.parallel=fsdp2`` (else every GPU holds the whole run).
        mixed: bf16 compute over float32 master weights (``model.dtype=bfloat16``).
        checkpointing: ``model.gradient_checkpointing``.
        teacher_layer_checkpointing: under ``checkpointing``, the teacher recomputed per layer
            (the trainer's way); ``False``: recomputed as one block.
        micro_batch, cold_start_batch: ``train.micro_batch``, ``cold_start.batch_size``.
        num_latents, num_retrieved, qformer_layers, ffn_mult, lora_r, max_encoder_tokens: the
            composer.
        rollout_batch_size: ``gen.rollout_batch_size``.
    """

    tokens: int = 40_960
    action_tokens: int | None = None
    world: int = 1
    fsdp: bool = False
    mixed: bool = True
    checkpointing: bool = True
    teacher_layer_checkpointing: bool = True
    micro_batch: int = 1
    cold_start_batch: int = 8
    num_latents: int = 32
    num_retrieved: int = 3
    qformer_layers: int = 8
    ffn_mult: int = 4
    lora_r: int = 8
    max_encoder_tokens: int = 2048
    rollout_batch_size: int = 32

    @classmethod
    def of(cls, cfg: Config, **changes: object) -> RunSetting:
        """The setting of ``cfg`` (``changes`` override fields, e.g. ``tokens``, ``world``)."""
        c = cfg.composer
        setting = cls(
            tokens=cfg.gen.max_total_tokens,
            fsdp=cfg.model.parallel == "fsdp2",
            mixed=cfg.model.dtype in ("bfloat16", "float16"),
            checkpointing=cfg.model.gradient_checkpointing,
            micro_batch=max(1, cfg.train.micro_batch),
            cold_start_batch=cfg.cold_start.batch_size,
            num_latents=c.num_latents,
            num_retrieved=c.num_retrieved,
            qformer_layers=c.qformer_layers,
            ffn_mult=c.ffn_mult,
            lora_r=c.lora_r,
            max_encoder_tokens=c.max_encoder_tokens,
            rollout_batch_size=cfg.gen.rollout_batch_size,
        )
        return dataclasses.replace(setting, **changes)


def qformer_params(shape: ModelShape, setting: RunSetting) -> int:
    """Parameters of the composer's QFormer, counted on the meta device (the real module)."""
    with torch.device("meta"):
        q = QFormerCompressor(
            shape.hidden,
            shape.heads,
            shape.kv_heads,
            num_queries=setting.num_latents,
            num_layers=setting.qformer_layers,
            ffn_mult=setting.ffn_mult,
            share_layers=True,
        )
    return sum(p.numel() for p in q.parameters())


@dataclass
class Prediction:
    """Per-phase bytes (each phase a dict of named terms) and the peak.

    Attributes:
        phases: ``{phase: {term: bytes}}``; the phase's peak is the sum of its terms.
        rollout_state: bytes held while rolling out (everything but the KV cache).
        kv_per_sequence: KV cache of one ``tokens``-long sequence.
    """

    phases: dict[str, dict[str, int]] = field(default_factory=dict)
    rollout_state: int = 0
    kv_per_sequence: int = 0

    def totals(self) -> dict[str, int]:
        return {name: sum(terms.values()) for name, terms in self.phases.items()}

    @property
    def peak(self) -> int:
        return max(self.totals().values())

    @property
    def peak_phase(self) -> str:
        totals = self.totals()
        return max(totals, key=totals.__getitem__)

    def rollout_sequences(self, capacity: int) -> int:
        """Full-length sequences whose KV cache fits beside the rollout state on ``capacity``."""
        free = capacity - CONTEXT_BYTES - self.rollout_state
        return max(0, free // max(1, self.kv_per_sequence))


def predict(shape: ModelShape, setting: RunSetting) -> Prediction:
    """Per-rank bytes of each phase: ``load``, ``cold start``, and the LOPD step's
    ``step forward``, ``step LM head``, ``step teacher backward``, ``step student backward``
    (the module docstring says what each term counts)."""
    s = setting
    w = s.world if s.fsdp else 1
    b = 2 if s.mixed else 4  # compute / frozen-copy bytes
    d, v, n_layers = shape.hidden, shape.vocab, shape.layers
    p, p_layer, p_root = shape.params(), shape.layer_params(), shape.root_params()
    phi = shape.lora_params(s.lora_r) + qformer_params(shape, s)
    tokens = s.tokens
    rows = s.action_tokens if s.action_tokens is not None else tokens
    pred = Prediction(kv_per_sequence=tokens * shape.kv_cache_bytes_per_token())

    student_master = 4 * p
    backbone_whole = b * p
    backbone_sharded = b * (n_layers * p_layer // w + p_root) if s.fsdp else backbone_whole
    pred.phases["load"] = {"student weights": student_master, "backbone weights": backbone_whole}

    # Cold start: phi and its AdamW; the backbone still whole; B trajectories per rank at once.
    batch = max(1, math.ceil(s.cold_start_batch / w))
    encoder_tokens = s.num_retrieved * s.max_encoder_tokens
    encoder_layer = encoder_tokens * shape.encoder_layer_bytes(s.mixed, s.lora_r)
    if s.checkpointing:
        # Recomputed per layer: one compute-dtype boundary per layer and the final hidden
        # states are kept; one layer's activations while its backward runs, after the teacher's
        # recompute has freed its own (the latents' gradient comes first).
        encoder = (n_layers + 1) * encoder_tokens * d * b
    else:
        encoder = n_layers * encoder_layer
        encoder_layer = 0
    encoder += shape.forward_bytes(encoder_tokens, False, s.mixed) - encoder_tokens * (
        n_layers * shape.frozen_layer_bytes(s.mixed)
    )  # final norm, rotary tables
    teacher_recompute = _teacher_recompute(shape, s, b)
    head = lm_head_bytes(
        batch * rows,
        v,
        d,
        torch.bfloat16 if s.mixed else torch.float32,
        "cuda",
        head_grad=False,
        hidden_grad=True,
    )
    pred.phases["cold start"] = {
        "student weights": student_master // w,
        "backbone weights": backbone_whole,
        "phi weights + grads + AdamW": 16 * phi,
        "encoder activations": batch * encoder,
        "teacher recompute": batch * max(teacher_recompute, encoder_layer),
        "LM head kernel": head,
    }

    # The LOPD step: state, then what each stage adds on top of it.
    m = s.micro_batch
    state = {
        "student weights": student_master // w,
        "student grads + AdamW": 12 * p // w,
        "backbone weights": backbone_sharded,
        "phi weights + grads + AdamW": 16 * phi,
    }
    if s.fsdp:
        # Gathered root (bf16) for the forward-backward window, two gathered layers (bf16),
        # one layer's unsharded float32 gradient before its reduce-scatter.
        state["FSDP gathered root + layers"] = 2 * p_root + 2 * 2 * p_layer + 4 * p_layer
    if s.checkpointing:
        # One float32 (mixed: the residual stream of float32 weights) boundary per layer and the
        # final hidden states; recomputing a layer adds what it saves bar its input (a boundary).
        student_saved = m * (n_layers + 1) * tokens * d * 4
        student_layer = m * tokens * (shape.trained_layer_bytes(s.mixed) - 4 * d)
    else:
        student_saved = m * shape.forward_bytes(tokens, True, s.mixed)
        student_layer = 0
    saved = {"encoder activations": m * encoder, "student saved activations": student_saved}
    autocast_cache = 2 * p if (s.mixed and not s.fsdp) else 0
    n = m * rows
    kernel = TOPM_BLOCK_BYTES + 4 * v * d + 2 * 4 * n * d
    if s.mixed and not s.fsdp:
        kernel += 2 * v * d + 2 * 2 * n * d  # bf16 copies of the student head, both hidden states
    one_frozen_layer = m * tokens * shape.frozen_layer_bytes(s.mixed)
    pred.phases["step forward"] = {
        **state,
        **saved,
        "autocast bf16 weight cache": autocast_cache,
        "one layer's transients": max(student_layer, one_frozen_layer),
    }
    pred.phases["step LM head"] = {
        **state,
        **saved,
        "autocast bf16 weight cache": autocast_cache,
        # The teacher's forward (after the student's) keeps what its backward needs.
        "teacher saved activations": m * _teacher_boundaries(shape, s, b),
        "top-M kernel": kernel,
    }
    pred.phases["step teacher backward"] = {
        **state,
        **saved,
        "hidden-state gradients": 4 * n * d,
        "teacher recompute": m * max(teacher_recompute, encoder_layer),
    }
    layer_weights = 0 if s.fsdp else (2 * p_layer if s.mixed else 0)
    pred.phases["step student backward"] = {
        **state,
        **saved,
        "student layer recompute": student_layer + layer_weights,
    }
    rollout = dict(state)
    rollout.pop("FSDP gathered root + layers", None)
    pred.rollout_state = sum(rollout.values()) + (2 * p if s.fsdp else 0)
    return pred


def _teacher_boundaries(shape: ModelShape, s: RunSetting, b: int) -> int:
    """Bytes the teacher keeps from its forward until its backward, one trajectory: every
    layer's activations when not checkpointed; a boundary per layer in the compute dtype and the
    final hidden states when recomputed per layer; none when recomputed as one block."""
    if not s.checkpointing:
        return shape.forward_bytes(s.tokens, False, s.mixed)
    if s.teacher_layer_checkpointing:
        return (shape.layers + 1) * s.tokens * shape.hidden * b
    return 0


def _teacher_recompute(shape: ModelShape, s: RunSetting, b: int) -> int:
    """Bytes the teacher holds in its backward, one trajectory: its saved activations (not
    checkpointed), the whole forward's again (one block), or its boundaries plus one layer's."""
    if s.checkpointing and s.teacher_layer_checkpointing:
        layer = s.tokens * shape.frozen_layer_bytes(s.mixed)
        return _teacher_boundaries(shape, s, b) + layer
    return shape.forward_bytes(s.tokens, False, s.mixed)


def fits(peak: int, capacity: int) -> str:
    """``yes`` (with 10% to spare), ``tight`` or ``no`` once :data:`CONTEXT_BYTES` is kept."""
    usable = capacity - CONTEXT_BYTES
    if peak <= 0.9 * usable:
        return "yes"
    return "tight" if peak <= usable else "no"


def step_peak(pred: Prediction) -> int:
    """The largest of the LOPD step's phases (without load and cold start)."""
    return max(v for k, v in pred.totals().items() if k.startswith("step"))


def markdown_table(models: list[str], setting: RunSetting, world: int = 8) -> str:
    """One row per model x GPU x FSDP2 (off: one GPU or DDP replicas; on: ``world`` ranks)."""
    lines = [
        f"| model | GPU | FSDP2 x{world} | peak / GPU (phase) | fits | LOPD step alone | "
        f"{setting.tokens:,}-token rollouts beside it |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in models:
        shape = MODELS[name]
        for fsdp in (False, True):
            pred = predict(
                shape, dataclasses.replace(setting, fsdp=fsdp, world=world if fsdp else 1)
            )
            for gpu, capacity in GPUS.items():
                step = step_peak(pred)
                lines.append(
                    f"| {name} | {gpu} | {'on' if fsdp else 'off'} | "
                    f"{pred.peak / GIB:.1f} GiB ({pred.peak_phase}) | "
                    f"{fits(pred.peak, capacity)} | {step / GIB:.1f} GiB, {fits(step, capacity)} | "
                    f"{pred.rollout_sequences(capacity)} |"
                )
    return "\n".join(lines)


STANDIN_RUNS = {
    "standin-218m": {"checkpointing": False, "micro_batch": 2},
    "qwen3-0.6b": {"checkpointing": True, "micro_batch": 1},
}
"""The measured stand-in runs of ``docs/trainer.md`` (``benchmarks/bench_standin_memory.py``: smoke
preset, float32 on CPU, ``data.n_train=4 data.n_test=2 train.steps=2``)."""


def standin_predictions(
    tokens: int = 2048, action_tokens: int = 32, one_at_a_time: bool = False
) -> dict[str, Prediction]:
    """The stand-in runs predicted at the smoke preset's caps (``gen.max_total_tokens`` 2,048,
    ``max_steps * max_new_tokens`` = 32 action tokens per trajectory): what the prediction is
    calibrated against (the measured runs did not record their token counts).

    ``one_at_a_time``: the ``--trajectory-tokens`` runs instead (one trajectory per cold-start
    step and per micro-batch, every trajectory ``tokens`` long)."""
    smoke = PRESETS["smoke"]()
    budget = {"cold_start_batch": 1, "micro_batch": 1} if one_at_a_time else {}
    return {
        name: predict(
            MODELS[name],
            RunSetting.of(
                smoke, tokens=tokens, action_tokens=action_tokens, **{**changes, **budget}
            ),
        )
        for name, changes in STANDIN_RUNS.items()
    }


def breakdown(shape: ModelShape, setting: RunSetting) -> str:
    """Every phase's terms in GiB."""
    out = []
    for phase, terms in predict(shape, setting).phases.items():
        parts = ", ".join(f"{k} {val / GIB:.2f}" for k, val in terms.items() if val)
        out.append(f"{phase}: {sum(terms.values()) / GIB:.2f} GiB = {parts}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lopd.run.memory_prediction",
        description="Predicted per-GPU peak memory of a preset's LOPD run (see the module doc).",
    )
    parser.add_argument("--preset", default="paper", choices=sorted(PRESETS))
    parser.add_argument("--models", nargs="+", default=["qwen3-0.6b", "qwen3-4b", "qwen3-8b"])
    parser.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="tokens per trajectory (default 40,960); with --standins: the stand-ins' "
        "--trajectory-tokens run at this length (default: the smoke caps, 2,048)",
    )
    parser.add_argument(
        "--action-tokens",
        type=int,
        default=None,
        help="with --standins: scored tokens per trajectory (default 32: the smoke caps)",
    )
    parser.add_argument("--world", type=int, default=8, help="GPUs under FSDP2")
    parser.add_argument("--breakdown", action="store_true", help="every phase's terms")
    parser.add_argument(
        "--standins", action="store_true", help="the CPU stand-in runs of docs/trainer.md"
    )
    args = parser.parse_args(argv)
    unknown = [m for m in args.models if m not in MODELS]
    if args.tokens is not None:
        tokens = args.tokens
    else:
        tokens = 2048 if args.standins else 40_960
    action_tokens = 32 if args.action_tokens is None else args.action_tokens
    if unknown or tokens < 1 or args.world < 1 or not 0 < action_tokens <= tokens:
        print(
            f"error: models must be among {sorted(MODELS)}, --tokens and --world positive, "
            f"--action-tokens in [1, tokens] (got {unknown or ''} tokens={tokens} "
            f"world={args.world} action_tokens={action_tokens})",
            file=sys.stderr,
        )
        return 2
    if args.standins:
        at_length = args.tokens is not None
        for name, pred in standin_predictions(tokens, action_tokens, at_length).items():
            what = f"{tokens:,} tokens, {action_tokens:,} action tokens"
            print(f"{name} (smoke preset, float32, {what}):")
            for phase, total in pred.totals().items():
                print(f"  {phase}: {total / GIB:.2f} GiB")
        return 0
    setting = RunSetting.of(PRESETS[args.preset](), tokens=tokens)
    print(markdown_table(args.models, setting, args.world))
    if args.breakdown:
        for name in args.models:
            for fsdp in (False, True):
                s = dataclasses.replace(setting, fsdp=fsdp, world=args.world if fsdp else 1)
                print(f"\n{name}, FSDP2 {'on x' + str(args.world) if fsdp else 'off'}:")
                print(breakdown(MODELS[name], s))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
