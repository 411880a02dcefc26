"""The sections of a run configuration (:class:`lopd.config.Config` holds one of each).

Each dataclass is one YAML section (``model:``, ``lopd:``, ...); its attributes document what every
field means. Validation and presets are in :mod:`lopd.config`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "BankConfig",
    "ColdStartConfig",
    "ComposerConfig",
    "DataConfig",
    "EvalConfig",
    "GRPOConfig",
    "GenConfig",
    "LOPDConfig",
    "ModelConfig",
    "OPSDConfig",
    "SDFTConfig",
    "SDPOConfig",
    "SkillSDConfig",
]


@dataclass
class ModelConfig:
    """The backbone shared by student, teacher and composer encoder.

    Attributes:
        path: a local Hugging Face checkpoint directory (Qwen3, Olmo, ...); ``None`` loads the
            tiny Qwen3 model shipped in ``lopd/assets/tiny-qwen3``.
        dtype: parameter dtype, ``float32``, ``bfloat16`` or ``float16``.
        device: ``cpu``, ``cuda`` or ``auto`` (CUDA when available; under ``torchrun`` each rank
            takes ``cuda:LOCAL_RANK``).
        gradient_checkpointing: recompute transformer-layer activations in the backward of the
            student and teacher forwards (less memory, about one more forward of compute).
        parallel: how ``torchrun`` ranks share the models. ``ddp``: every rank holds them
            whole and gradients are averaged (data parallel). ``fsdp2``: student, teacher and
            encoder backbone are sharded across ranks with FSDP2 (:mod:`lopd.fsdp`). Without
            ``torchrun`` both are a single process.
        attn_implementation: the transformers attention backend of every model: ``eager``,
            ``sdpa``, ``flash_attention_2`` (CUDA, 16-bit ``dtype``, ``pip install
            'lopd[gpu]'``) or ``auto``: ``flash_attention_2`` on CUDA with a 16-bit dtype when
            flash-attn is installed, else ``sdpa``.
    """

    path: str | None = None
    dtype: str = "float32"
    device: str = "auto"
    gradient_checkpointing: bool = False
    parallel: str = "ddp"
    attn_implementation: str = "auto"


@dataclass
class DataConfig:
    """Where tasks come from.

    Attributes:
        domain: ``tool_use`` or ``coding`` (built-in task generators of ``lopd.envs``).
        tasks_path: a JSONL file of tasks (one ``Task`` dict per line, with ``split`` ``train``,
            ``val`` or ``test``); ``None`` uses the built-in generator.
        task_seed: task-set seed of the built-in generator (its databases, entities and values;
            ``None``: the run seed, the earlier behaviour), so a comparison can be rerun on task
            sets the defaults were not tuned on.
        eval_split: the held-out split evaluated: ``test`` (reported figures) or ``val`` (what
            every choice of a default is tuned on).
        n_train: number of training tasks: the first ``n_train`` of the source; a source with
            fewer is a start-up error naming both numbers.
        n_test: number of held-out evaluation tasks of ``eval_split`` (the same rule).
    """

    domain: str = "tool_use"
    tasks_path: str | None = None
    task_seed: int | None = None
    eval_split: str = "test"
    n_train: int = 48
    n_test: int = 32


@dataclass
class GenConfig:
    """Multi-turn sampling of the student (paper Table 4) and its token budgets.

    The budgets are checked against the model's context length and every task's prompt at
    start-up (:mod:`lopd.budget`).

    Attributes:
        max_new_tokens: token budget of one assistant turn.
        max_steps: environment steps (assistant turns) per episode.
        temperature, top_p, top_k: sampling for training rollouts and the bank.
        max_total_tokens: token budget of a whole trajectory (prompt, turns, observations);
            the episode ends when the next turn or observation would not fit.
        max_prompt_tokens: token budget of a rendered prompt (system message, tool schemas,
            first user message); ``null`` = ``max_total_tokens - max_new_tokens``.
        prompt_overflow: a task whose prompt exceeds its budget: ``error`` (stop at start-up,
            naming the count and the longest) or ``drop`` (skip it, counted in the log and
            ``summary.json``).
        rollout_batch_size: episodes generated together (rows of one forward).
        engine: what generates the rollouts: ``hf`` (the built-in Hugging Face / torch decode
            of :mod:`lopd.rollout`) or ``vllm`` (:mod:`lopd.vllm_engine`: the student's and
            the base + composer evaluation's turns through a vLLM engine, weights synced after
            every optimizer step; ``pip install 'lopd[vllm]'``). The losses' forwards and the
            experience bank's base-model rollouts stay on the torch path either way.
        vllm_gpu_memory_utilization: with ``engine=vllm`` on CUDA, the fraction of the GPU the
            engine may take (the torch models share it).
        vllm_kv_cache_gib: with ``engine=vllm``, the engine's KV cache size in GiB; ``null``
            keeps vLLM's default (on CPU, ``VLLM_CPU_KVCACHE_SPACE`` or 4 GiB).
    """

    max_new_tokens: int = 48
    max_steps: int = 6
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 20
    max_total_tokens: int = 2048
    max_prompt_tokens: int | None = None
    prompt_overflow: str = "error"
    rollout_batch_size: int = 32
    engine: str = "hf"
    vllm_gpu_memory_utilization: float = 0.3
    vllm_kv_cache_gib: float | None = None


@dataclass
class BankConfig:
    """The experience bank: successful training rollouts of the base model (paper A.3).

    Attributes:
        rollouts_per_task: base-model rollouts sampled per training task to fill the bank.
        min_reward: a rollout enters the bank when its reward is at least this.
        embed_batch_size: texts per forward of the retrieval embedder (the frozen backbone's
            mean-pooled hidden states, :class:`lopd.memory.HiddenStateEmbedder`).
        embed_max_length: the embedder truncates documents and queries to this many tokens.
        index_batch_size: bank entries (or tasks) handed to the embedder per call while the
            retriever indexes the bank and precomputes query embeddings; the embedder splits
            each call into ``embed_batch_size`` forwards, so this bounds the host memory of the
            pending texts and embeddings, not the model's activations.
        document_style: what of a stored trajectory the retriever embeds: ``"task"`` (its task
            text, like the query) or ``"task_trace"`` (task and trace, paper eq. 15); see
            :class:`lopd.memory.HiddenStateEmbedder` for the measured difference.
    """

    rollouts_per_task: int = 2
    min_reward: float = 1.0
    embed_batch_size: int = 16
    embed_max_length: int = 512
    index_batch_size: int = 256
    document_style: str = "task"


@dataclass
class ComposerConfig:
    """The latent composer (paper 3.2, A.1).

    Attributes:
        num_latents: K, latent tokens per retrieved experience.
        num_retrieved: J, experiences retrieved per task; the teacher sees ``J * K`` latents.
        qformer_layers: cross-attention layers of the QFormer (weights shared across layers).
        ffn_mult: QFormer feed-forward width multiplier.
        lora_r, lora_alpha, lora_dropout: the encoder's LoRA adapter (q, k, v, o, gate, up, down).
        max_encoder_tokens: "Task to solve / Reference past trajectory" inputs are truncated to
            this many tokens.
    """

    num_latents: int = 32
    num_retrieved: int = 3
    qformer_layers: int = 8
    ffn_mult: int = 4
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    max_encoder_tokens: int = 384


@dataclass
class ColdStartConfig:
    """Composer cold start (paper eq. 14, A.2): NLL of bank trajectories given ``c_phi``.

    Attributes:
        steps: optimizer steps (0 skips the cold start: phi_0 is the random initialization).
        batch_size: bank trajectories per step.
        lr: AdamW learning rate of LoRA + QFormer.
        grad_clip: global gradient-norm clip.
    """

    steps: int = 100
    batch_size: int = 8
    lr: float = 1e-5
    grad_clip: float = 3.0


@dataclass
class LOPDConfig:
    """Joint training (paper 3.3, Algorithm 1, eq. 10-13).

    Attributes:
        method: the training objective, a name in :data:`lopd.methods.METHODS` (``lopd``,
            its ablations and the baselines; their own settings are the ``grpo``, ``opsd``,
            ``sdpo``, ``sdft`` and ``skill_sd`` sections).
        steps: training iterations.
        tasks_per_step: training tasks sampled per iteration (one rollout each): the rollout
            budget per step, across all data-parallel ranks.
        micro_batch: trajectories per forward/backward (gradient accumulation inside a step).
        lr: AdamW learning rate of the student theta.
        composer_lr: AdamW learning rate of the composer phi.
        weight_decay: AdamW weight decay for both.
        grad_clip: global gradient-norm clip (student and composer separately).
        top_m: M, teacher top-M support plus a tail bucket; ``None`` = full vocabulary.
        temperature: distillation temperature applied to both logits.
        divergence: ``reverse`` (paper) or ``forward`` KL.
        margin: m, the privileged margin.
        anchor_weight: lambda, weight of ``||c_phi - sg c_phi0||^2``.
        dual_lr: eta_beta, step size of the dual ascent on beta.
        beta_init: initial beta.
        fused_linear: compute the KL from final hidden states and ``lm_head`` with
            ``fused_linear_topk_tail_kl`` (no ``[N, V]`` logits) instead of ``topk_tail_kl``.
    """

    method: str = "lopd"
    steps: int = 30
    tasks_per_step: int = 8
    micro_batch: int = 4
    lr: float = 1e-5
    composer_lr: float = 1e-5
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    top_m: int | None = 20
    temperature: float = 1.0
    divergence: str = "reverse"
    margin: float = 0.05
    anchor_weight: float = 0.2
    dual_lr: float = 0.5
    beta_init: float = 0.0
    fused_linear: bool = False


@dataclass
class GRPOConfig:
    """GRPO (paper B.1; ``lopd.method=grpo``).

    Attributes:
        group_size: G, rollouts per task; a step draws ``max(1, lopd.tasks_per_step // G)``
            tasks.
        clip_eps: PPO clip epsilon.
    """

    group_size: int = 4
    clip_eps: float = 0.2


@dataclass
class OPSDConfig:
    """OPSD (paper B.1; ``lopd.method=opsd``): the distillation kernel of its frozen teacher.

    Attributes:
        top_m: teacher top-M support plus a tail bucket; ``None`` = the full vocabulary.
        divergence: ``forward`` (paper) or ``reverse`` KL. Temperature and ``fused_linear`` are
            the ``lopd`` section's.
    """

    top_m: int | None = None
    divergence: str = "forward"


@dataclass
class SDPOConfig:
    """SDPO (paper B.1; ``lopd.method=sdpo``).

    Attributes:
        group_size: G, rollouts per task (a success is distilled into its siblings).
        ema_rate: the EMA teacher's update rate per optimizer step.
        divergence: ``reverse`` (paper) or ``forward`` KL over the teacher's top-M
            (``lopd.top_m``) plus a tail bucket.
    """

    group_size: int = 4
    ema_rate: float = 0.05
    divergence: str = "reverse"


@dataclass
class SDFTConfig:
    """SDFT (paper B.1; ``lopd.method=sdft``): an EMA teacher with a demonstration as text.

    Attributes:
        ema_rate: alpha, the EMA teacher's update rate, applied after every optimizer step.
        top_m: teacher top-M support plus a tail bucket; ``None`` = the full vocabulary (paper).
        divergence: ``forward`` (paper) or ``reverse`` KL. Temperature and ``fused_linear`` are
            the ``lopd`` section's.
    """

    ema_rate: float = 0.01
    top_m: int | None = None
    divergence: str = "forward"


@dataclass
class SkillSDConfig:
    """Skill-SD (paper B.1; ``lopd.method=skill-sd``): a skill-conditioned self-teacher.

    Attributes:
        group_size: G, rollouts per task (group-normalized advantages, as GRPO); a step draws
            ``max(1, lopd.tasks_per_step // G)`` tasks.
        clip_eps_low, clip_eps_high: the PPO-clip range ``[1 - low, 1 + high]``.
        sdl_weight: lambda_sdl, weight of the importance-weighted sampled-token reverse KL.
        ucb_c: c of the UCB1 skill choice (paper: sqrt 2).
        teacher_sync_every: the teacher is the student's weights copied every this many
            optimizer steps (1: the current student itself, no copy is kept).
        summarizer: who writes a skill from a task's rollouts: ``model`` (the student itself,
            greedy; a text missing one of the three sections falls back to the rule summary)
            or ``rule`` (the deterministic summarizer of :mod:`lopd.methods.skills`, the
            stand-in for models too small to write one, such as the tiny default).
        summary_max_tokens: token budget of a model-written skill.
        max_skills: bank capacity; the oldest skill leaves when a new one would exceed it.
    """

    group_size: int = 4
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    sdl_weight: float = 0.001
    ucb_c: float = math.sqrt(2.0)
    teacher_sync_every: int = 1
    summarizer: str = "model"
    summary_max_tokens: int = 256
    max_skills: int = 256


@dataclass
class EvalConfig:
    """Held-out evaluation (paper Table 3 metrics).

    Attributes:
        temperature: decoding temperature at evaluation (0 = greedy).
        every: evaluate the student every this many training steps (0 = only at the end).
        with_composer: also evaluate "base + composer": the frozen base model generating with
            retrieved latent context.
    """

    temperature: float = 0.0
    every: int = 0
    with_composer: bool = True
