"""Experience memory for LOPD: the bank of successful trajectories, embedders, FAISS retrieval.

``python -m lopd.collect`` fills a bank from base-model rollouts and saves the index and the
precomputed query embeddings next to it; the trainer then only needs :meth:`Retriever.load`::

    from lopd.memory import ExperienceBank, HiddenStateEmbedder, Retriever, format_experience

    bank = ExperienceBank("runs/bank", min_reward=1.0)   # directory; bank.jsonl inside
    bank.add_many(trajectories)                          # successes only, one durable batch
    retriever = Retriever(bank, HiddenStateEmbedder(model, tokenizer))
    retriever.precompute_queries(train_tasks)
    retriever.save()                                     # index + query cache, next to the bank

    retriever = Retriever.load(ExperienceBank("runs/bank"))   # later: no embedder needed
    texts = [format_experience(e) for e in retriever.retrieve(task, k=3)]  # never task's own
"""

from lopd.memory.bank import (
    BankCorruptionError,
    BankEntry,
    ExperienceBank,
    document_prefix,
    document_text,
    format_experience,
    make_entry_id,
    task_part,
)
from lopd.memory.embedders import (
    DOCUMENT_STYLES,
    QUERY_INSTRUCTION,
    Embedder,
    HiddenStateEmbedder,
    SentenceTransformerEmbedder,
    format_query,
    l2_normalize,
)
from lopd.memory.retriever import Retriever, faiss_gpu_available

__all__ = [
    "DOCUMENT_STYLES",
    "QUERY_INSTRUCTION",
    "BankCorruptionError",
    "BankEntry",
    "Embedder",
    "ExperienceBank",
    "HiddenStateEmbedder",
    "Retriever",
    "SentenceTransformerEmbedder",
    "document_prefix",
    "document_text",
    "faiss_gpu_available",
    "format_experience",
    "format_query",
    "l2_normalize",
    "make_entry_id",
    "task_part",
]
