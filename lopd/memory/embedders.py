"""Text embedders for experience retrieval (paper A.3, eq. 15).

Any object with ``embed_documents`` / ``embed_queries`` returning unit-norm float32 rows works as
an :class:`Embedder`. Retrieval is asymmetric: documents are ``task + trajectory`` text embedded
as-is, queries are the bare task. Instruction-tuned embedders (Qwen3-Embedding, through
:class:`SentenceTransformerEmbedder`) get the task wrapped in the paper's instruction prompt
(:func:`format_query`); :class:`HiddenStateEmbedder` by default renders it as the opening of a
document instead (see its ``query_style``).

Two implementations ship:

* :class:`HiddenStateEmbedder`: mean-pooled final hidden states of a frozen Hugging Face model
  (the default uses the tiny base policy, so everything runs offline on a CPU).
* :class:`SentenceTransformerEmbedder`: any ``sentence-transformers`` model, e.g.
  ``Qwen/Qwen3-Embedding-8B`` on a GPU as in the paper (``pip install sentence-transformers``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from lopd.memory.bank import document_prefix, task_part

QUERY_INSTRUCTION = "Given a task, retrieve a solved trajectory for a similar task"
"""Default retrieval instruction for the query side."""
DOCUMENT_STYLES = ("task", "task_trace")
"""What :class:`HiddenStateEmbedder` embeds of a bank document: its task part, or all of it."""


def format_query(task_text: str, instruction: str = QUERY_INSTRUCTION) -> str:
    """Wrap a task description in the instruction-aware query prompt (Qwen3-Embedding style).

    >>> format_query("Cancel order O-1", instruction="Find a similar solved task")
    'Instruct: Find a similar solved task\\nQuery: Cancel order O-1'
    """
    return f"{query_prefix(instruction)}{task_text}"


def query_prefix(instruction: str = QUERY_INSTRUCTION) -> str:
    """The text that precedes the task in a query: ``"Instruct: ...\\nQuery: "``."""
    return f"Instruct: {instruction}\nQuery: "


@runtime_checkable
class Embedder(Protocol):
    """What the retriever needs from an embedder.

    Attributes:
        name: identifies the embedding space; a saved index only reloads with an embedder of
            the same name (mixing spaces would silently return garbage neighbours).
        dim: embedding width ``d``.
    """

    name: str
    dim: int

    def embed_documents(self, texts: Sequence[str]) -> np.ndarray:
        """Embed bank documents (task + trace). Returns ``[n, d]`` float32, unit-norm rows."""
        ...

    def embed_queries(self, texts: Sequence[str]) -> np.ndarray:
        """Embed bare task descriptions as queries (the embedder adds the instruction prompt).

        Returns ``[n, d]`` float32, unit-norm rows.
        """
        ...


def l2_normalize(x: np.ndarray, eps: float = 1e-12) -> np.ndarray:
    """Row-normalize ``x`` ``[n, d]`` to unit L2 norm in float32 (zero rows stay zero)."""
    x = np.asarray(x, dtype=np.float32)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return (x / np.maximum(norms, eps)).astype(np.float32, copy=False)


def _space_suffix(document_style: str) -> str:
    """The embedding-space name's part for a document style (validated): an index built from
    whole documents must never be reused for task-only ones."""
    if document_style not in DOCUMENT_STYLES:
        raise ValueError(f"document_style must be one of {DOCUMENT_STYLES}, got {document_style!r}")
    return ":task-docs" if document_style == "task" else ""


def _check_texts(texts: Sequence[str], arg: str) -> list[str]:
    if isinstance(texts, str):
        raise TypeError(f"{arg} must be a sequence of strings, got a single str")
    out = list(texts)
    for i, t in enumerate(out):
        if not isinstance(t, str):
            raise TypeError(f"{arg}[{i}] must be str, got {type(t).__name__}")
    return out


class HiddenStateEmbedder:
    """Mean-pooled final hidden states of a frozen Hugging Face model.

    The model runs in eval mode under ``torch.inference_mode``; only its backbone is called
    (``model.base_model``), so a causal LM never computes its vocabulary projection. Texts are
    right-padded by hand: with causal attention the real tokens then never see padding, so an
    embedding does not depend on what else shares its batch (determinism across batch sizes).
    Batches are formed from length-sorted texts to keep padding small.

    Args:
        model: a ``transformers`` model (e.g. the tiny ``Qwen3ForCausalLM``); it is not modified
            except being put in eval mode. Pass the frozen base, not a model being trained:
            the bank's embeddings are only comparable while the weights stay fixed.
        tokenizer: its tokenizer (a ``PreTrainedTokenizerBase``).
        batch_size: texts per forward pass.
        max_length: texts are truncated to this many tokens (keeping the start: the task and
            the first steps carry most of the signal).
        query_style: how a task becomes a query. ``"document"`` (default): the task rendered
            as the opening of a document, :func:`~lopd.memory.bank.document_prefix` (query =
            task, document = task + trajectory). ``"instruct"``: the paper's instruction prompt
            (:func:`format_query`), made for instruction-tuned embedders. Mean-pooled hidden
            states of a policy LM are not one: the prompt's tokens, identical in every query,
            dominate the mean. On the built-in tool-use tasks with the tiny model (held-out
            queries, oracle bank, ``python -m benchmarks.bench_experience_bank --quality``)
            the share of top-3 neighbours from the query's own task template measured 0.53 with
            ``"document"`` and 0.08, chance level (0.07), with ``"instruct"``.
        query_instruction: the instruction of the ``"instruct"`` style.
        document_style: what of a bank document is embedded. ``"task"`` (default): only its
            task part (:func:`~lopd.memory.bank.document_prefix`), so query and document are
            embedded alike and the trajectory's tokens (tool names of whatever the model did,
            ids) do not pull the mean. ``"task_trace"``: the whole document, task and trace, as
            in the paper's eq. 15. With the shipped tiny model on the built-in tasks (oracle
            bank of the 600 train tasks, 64 val queries, top-1): the share of neighbours from
            the query's own template is 1.00 with ``"task"`` and 0.47 with ``"task_trace"``
            (own world: 1.00 / 0.72), and a reference from another world's task hurts.
        name: embedding-space id; defaults to
            ``"hidden:<model name or class>:<hidden size>:<query_style>"``, plus
            ``":task-docs"`` for ``document_style="task"``.

    Example:
        >>> emb = HiddenStateEmbedder(model, tokenizer)
        >>> z = emb.embed_queries(["Cancel order O-1"])  # [1, hidden_size], unit norm
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        batch_size: int = 16,
        max_length: int = 512,
        query_style: str = "document",
        query_instruction: str = QUERY_INSTRUCTION,
        document_style: str = "task",
        name: str | None = None,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        if query_style not in ("document", "instruct"):
            raise ValueError(f"query_style must be 'document' or 'instruct', got {query_style!r}")
        suffix = _space_suffix(document_style)
        self.query_style = query_style
        self.document_style = document_style
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = int(batch_size)
        self.max_length = int(max_length)
        self.query_instruction = query_instruction
        cfg = model.config
        self.dim = int(cfg.hidden_size)
        model_name = getattr(cfg, "_name_or_path", "") or type(model).__name__
        # The query style is part of the space: cached queries of one style are meaningless
        # next to the other (the document style's part: :func:`_space_suffix`).
        self.name = name or f"hidden:{model_name}:{self.dim}:{query_style}{suffix}"
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is None:
            pad = getattr(tokenizer, "eos_token_id", None)
        # Any id works: padded positions are masked out of attention and pooling.
        self._pad_id = int(pad) if pad is not None else 0

    def _backbone(self) -> Any:
        # ``base_model`` is the bare transformer for a *ForCausalLM (no lm_head) and the model
        # itself for a bare ``*Model``.
        return getattr(self.model, "base_model", self.model)

    def _device(self) -> torch.device:
        try:
            return next(self.model.parameters()).device
        except StopIteration:
            return torch.device("cpu")

    def embed_documents(self, texts: Sequence[str]) -> np.ndarray:
        """Embed documents (see ``document_style``). Returns ``[n, hidden_size]`` float32,
        unit-norm rows."""
        texts = _check_texts(texts, "texts")
        if self.document_style == "task":
            texts = [task_part(t) for t in texts]
        return self._embed(texts)

    def embed_queries(self, texts: Sequence[str]) -> np.ndarray:
        """Embed tasks as queries (see ``query_style``). Returns ``[n, hidden_size]`` float32."""
        texts = _check_texts(texts, "texts")
        if self.query_style == "instruct":
            return self._embed([format_query(t, self.query_instruction) for t in texts])
        return self._embed([document_prefix(t) for t in texts])

    def _embed(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        ids = [self._encode(t) for t in texts]
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        out = np.empty((len(ids), self.dim), dtype=np.float32)
        backbone = self._backbone()
        device = self._device()
        # torch is imported where it is used so that bank-only users (e.g. writer processes)
        # do not pay for importing it.

        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                for s in range(0, len(order), self.batch_size):
                    rows = order[s : s + self.batch_size]
                    out[rows] = self._pool(backbone, [ids[i] for i in rows], device)
        finally:
            self.model.train(was_training)
        return l2_normalize(out)

    def _encode(self, text: str) -> list[int]:
        enc = self.tokenizer(text, truncation=True, max_length=self.max_length)
        ids = list(enc["input_ids"])
        if not ids:
            # An empty text still needs one position to pool over.
            ids = [self._pad_id]
        return ids

    def _pool(self, backbone: Any, batch: list[list[int]], device: torch.device) -> np.ndarray:
        n, width = len(batch), max(len(x) for x in batch)
        input_ids = torch.full((n, width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, x in enumerate(batch):
            input_ids[i, : len(x)] = torch.tensor(x, dtype=torch.long)
            mask[i, : len(x)] = 1
        input_ids, mask = input_ids.to(device), mask.to(device)
        out = backbone(input_ids=input_ids, attention_mask=mask)
        hidden = getattr(out, "last_hidden_state", None)
        if hidden is None:
            # Wrappers (e.g. a peft model) whose ``base_model`` still returns logits.
            out = self.model(input_ids=input_ids, attention_mask=mask, output_hidden_states=True)
            hidden = out.hidden_states[-1]
        # hidden: [n, L, d]
        m = mask.unsqueeze(-1).to(torch.float32)
        # Pool in float32 whatever the model dtype: a bf16 sum over long documents loses bits.
        pooled = (hidden.float() * m).sum(dim=1) / m.sum(dim=1).clamp_min(1.0)  # [n, d]
        return pooled.cpu().numpy()


class SentenceTransformerEmbedder:
    """Any ``sentence-transformers`` model, e.g. Qwen3-Embedding (the paper's retriever).

    Queries are encoded with the instruction prompt ``"Instruct: ...\\nQuery: "`` prepended (as
    Qwen3-Embedding expects); documents without a prompt. Output rows are L2-normalized.

    Args:
        model: a model name or local path (loaded with ``SentenceTransformer``) or an already
            constructed ``SentenceTransformer``.
        device: device for a model loaded by name (``None``: CUDA when available).
        batch_size: encode batch size.
        query_instruction: the retrieval instruction of the query prompt.
        document_style: what of a bank document is embedded: ``"task_trace"`` (default, the
            paper's eq. 15: the whole document, for an instruction-tuned embedder that reads
            a trajectory) or ``"task"`` (its task part only, as
            :class:`HiddenStateEmbedder` does by default).
        name: embedding-space id; defaults to ``"st:<name_or_path>"``, plus ``":task-docs"``
            for ``document_style="task"``.
        **model_kwargs: forwarded to ``SentenceTransformer(...)`` (e.g. ``model_kwargs``,
            ``tokenizer_kwargs={"padding_side": "left"}`` as Qwen3-Embedding recommends).

    Raises:
        ImportError: ``sentence-transformers`` is not installed.
        ValueError: ``batch_size`` < 1 or an unknown ``document_style``.
    """

    def __init__(
        self,
        model: Any = "Qwen/Qwen3-Embedding-0.6B",
        device: str | None = None,
        batch_size: int = 32,
        query_instruction: str = QUERY_INSTRUCTION,
        document_style: str = "task_trace",
        name: str | None = None,
        **model_kwargs: Any,
    ):
        try:  # optional heavy dependency: the [embed] extra
            from sentence_transformers import SentenceTransformer
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError(
                "SentenceTransformerEmbedder needs sentence-transformers: "
                "pip install 'lopd[embed]' (or pip install sentence-transformers)"
            ) from e
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        suffix = _space_suffix(document_style)
        self.document_style = document_style
        if isinstance(model, (str, bytes)) or hasattr(model, "__fspath__"):
            path = str(model)
            if device is None:
                device = "cuda" if torch.cuda.is_available() else "cpu"
            self.model = SentenceTransformer(path, device=device, **model_kwargs)
            default_name = f"st:{path}"
        else:
            self.model = model
            default_name = f"st:{type(model).__name__}"
        self.batch_size = int(batch_size)
        self.query_instruction = query_instruction
        # Newer sentence-transformers renamed the method (the old name warns).
        get_dim = getattr(self.model, "get_embedding_dimension", None) or getattr(
            self.model, "get_sentence_embedding_dimension", None
        )
        dim = get_dim() if get_dim is not None else None
        if dim is None:
            dim = int(self.encode_raw(["x"], prompt=None).shape[1])
        self.dim = int(dim)
        self.name = name or default_name + suffix

    def encode_raw(self, texts: list[str], prompt: str | None) -> np.ndarray:
        """``SentenceTransformer.encode`` with our settings; returns ``[n, d]`` float32."""
        if not texts:
            return np.zeros((0, getattr(self, "dim", 0)), dtype=np.float32)
        z = self.model.encode(
            texts,
            prompt=prompt,
            batch_size=self.batch_size,
            convert_to_numpy=True,
            normalize_embeddings=True,
            show_progress_bar=False,
        )
        return l2_normalize(np.asarray(z, dtype=np.float32))

    def embed_documents(self, texts: Sequence[str]) -> np.ndarray:
        """Embed documents (no prompt; see ``document_style``). Returns ``[n, d]`` float32,
        unit-norm rows."""
        texts = _check_texts(texts, "texts")
        if self.document_style == "task":
            texts = [task_part(t) for t in texts]
        return self.encode_raw(texts, prompt=None)

    def embed_queries(self, texts: Sequence[str]) -> np.ndarray:
        """Embed tasks with the instruction prompt. Returns ``[n, d]`` float32, unit-norm rows."""
        prompt = query_prefix(self.query_instruction)
        return self.encode_raw(_check_texts(texts, "texts"), prompt=prompt)
