"""Exact cosine retrieval over the experience bank with FAISS (paper A.3, eq. 16).

Document embeddings are unit-norm, so inner product equals cosine and a FAISS ``IndexFlatIP``
(exact, brute-force) gives the paper's top-``n_ret`` retrieval. ``faiss-cpu`` is the default; with
``faiss-gpu`` installed and CUDA available, ``index="auto"`` moves the index to the GPU.

Two guarantees the trainer relies on:

* **No self-retrieval.** A query for task ``t`` never returns an entry whose ``task_id`` is ``t``.
  The search over-fetches ``k + (number of indexed entries of t)`` neighbours, which is exactly
  enough to still return ``k`` results after dropping ``t``'s own entries.
* **Cached queries.** Query embeddings are cached per ``task_id`` (keyed also by a hash of the
  instruction, so an edited task is re-embedded). :meth:`Retriever.save` persists the index and
  the cache next to the bank; :meth:`Retriever.load` restores them without an embedder, so a
  training run whose queries were precomputed by ``python -m lopd.collect`` never loads one.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import warnings
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import faiss
import numpy as np

from lopd.atomic import atomic_write_bytes
from lopd.memory.bank import BankEntry, ExperienceBank, document_text
from lopd.memory.embedders import Embedder

INDEX_FILE = "retriever.faiss"
META_FILE = "retriever.json"
QUERY_CACHE_FILE = "query_cache.npz"
_META_VERSION = 1


class _TaskLike(Protocol):
    task_id: str
    instruction: str


def faiss_gpu_available() -> bool:
    """True when the installed FAISS has GPU support and a CUDA device is visible."""
    if not hasattr(faiss, "StandardGpuResources"):
        return False
    try:
        return faiss.get_num_gpus() > 0
    except (AttributeError, RuntimeError):
        return False


def _instruction_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _check_unit_rows(x: np.ndarray, arg: str, dim: int | None) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"{arg} must be 2-D [n, d], got shape {tuple(x.shape)}")
    if dim is not None and x.shape[1] != dim:
        raise ValueError(f"{arg} must have d={dim} columns, got shape {tuple(x.shape)}")
    if x.shape[0]:
        norms = np.linalg.norm(x, axis=1)
        if not np.all(np.isfinite(norms)) or np.max(np.abs(norms - 1.0)) > 1e-3:
            raise ValueError(
                f"{arg} rows must be unit-norm (cosine = inner product); "
                f"got norms in [{norms.min():.4g}, {norms.max():.4g}]"
            )
    return x


class Retriever:
    """Top-k cosine retrieval of bank entries for tasks, excluding the task's own entries.

    Args:
        bank: the experience bank whose entries are indexed.
        embedder: embeds documents and queries; may be ``None`` for a retriever restored with
            :meth:`load` whose query cache already covers every task it will be asked about.
        index: ``"auto"`` (GPU when faiss-gpu and CUDA are available, else CPU), ``"cpu"`` or
            ``"gpu"``.
        gpu_device: CUDA device ordinal for ``index="gpu"``.
        build: embed and index all current bank entries now (:meth:`sync`).
        doc_batch_size: documents per ``embed_documents`` call while indexing.

    Example:
        >>> retriever = Retriever(bank, HiddenStateEmbedder(model, tokenizer))
        >>> hits = retriever.retrieve(task, k=3)  # list[BankEntry], none of task.task_id
        >>> retriever.save()  # index + query cache into the bank directory
    """

    def __init__(
        self,
        bank: ExperienceBank,
        embedder: Embedder | None = None,
        index: str = "auto",
        gpu_device: int = 0,
        build: bool = True,
        doc_batch_size: int = 256,
    ):
        if index not in ("auto", "cpu", "gpu"):
            raise ValueError(f"index must be 'auto', 'cpu' or 'gpu', got {index!r}")
        if index == "gpu" and not faiss_gpu_available():
            raise ValueError("index='gpu' needs faiss-gpu and a visible CUDA device")
        self._checked_batch_size("doc_batch_size", doc_batch_size)
        self.bank = bank
        self.embedder = embedder
        self.on_gpu = index == "gpu" or (index == "auto" and faiss_gpu_available())
        self.gpu_device = gpu_device
        self.doc_batch_size = doc_batch_size
        self.dim: int | None = int(embedder.dim) if embedder is not None else None
        self.embedder_name: str | None = embedder.name if embedder is not None else None
        self._index: Any = None
        self._gpu_res: Any = None
        self._rows: list[BankEntry] = []  # FAISS row i -> entry
        self._row_ids: set[str] = set()
        self._task_rows: Counter[str] = Counter()  # task_id -> number of indexed rows
        self._qcache: dict[str, tuple[str, np.ndarray]] = {}  # task_id -> (instr hash, [d])
        self.cache_hits = 0
        self.cache_misses = 0
        if build and embedder is not None:
            self.sync()

    # --------------------------------------------------------------------------- indexing
    def __len__(self) -> int:
        return len(self._rows)

    @property
    def entries(self) -> list[BankEntry]:
        """Indexed entries in FAISS row order."""
        return list(self._rows)

    def _ensure_index(self, dim: int) -> None:
        if self._index is not None:
            return
        index = faiss.IndexFlatIP(dim)
        if self.on_gpu:
            self._gpu_res = faiss.StandardGpuResources()
            index = faiss.index_cpu_to_gpu(self._gpu_res, self.gpu_device, index)
        self._index = index
        self.dim = dim

    def sync(self) -> int:
        """Embed and index bank entries not indexed yet (after ``bank.refresh()``).

        Returns:
            The number of entries added.
        """
        self.bank.refresh()
        new = [e for e in self.bank if e.entry_id not in self._row_ids]
        if not new:
            return 0
        if self.embedder is None:
            raise RuntimeError(
                f"{len(new)} bank entries are not indexed and this retriever has no embedder; "
                "pass embedder= to embed them"
            )
        added = 0
        for s in range(0, len(new), self.doc_batch_size):
            chunk = new[s : s + self.doc_batch_size]
            z = self.embedder.embed_documents([document_text(e) for e in chunk])
            added += self.add(chunk, z)
        return added

    def add(self, entries: Sequence[BankEntry], embeddings: np.ndarray) -> int:
        """Index ``entries`` with precomputed document embeddings.

        Args:
            entries: ``n`` bank entries (already indexed ids are skipped).
            embeddings: ``[n, d]`` float32, unit-norm rows, aligned with ``entries``.

        Returns:
            The number of entries added.
        """
        entries = list(entries)
        z = _check_unit_rows(embeddings, "embeddings", self.dim)
        if z.shape[0] != len(entries):
            raise ValueError(
                f"embeddings has {z.shape[0]} rows but entries has {len(entries)} items"
            )
        keep, seen = [], set()
        for i, e in enumerate(entries):
            if e.entry_id not in self._row_ids and e.entry_id not in seen:
                keep.append(i)
                seen.add(e.entry_id)
        if not keep:
            return 0
        self._ensure_index(z.shape[1])
        if len(keep) != len(entries):
            z = np.ascontiguousarray(z[keep])
        self._index.add(z)
        for i in keep:
            e = entries[i]
            self._rows.append(e)
            self._row_ids.add(e.entry_id)
            self._task_rows[e.task_id] += 1
        return len(keep)

    # ---------------------------------------------------------------------------- queries
    def query_embeddings(self, tasks: Sequence[_TaskLike]) -> np.ndarray:
        """Query embeddings of ``tasks``, ``[n, d]`` float32, from the cache or the embedder.

        Misses are embedded in one batch and cached.

        Raises:
            RuntimeError: a task is not cached and there is no embedder.
        """
        tasks = list(tasks)
        keys = [(t.task_id, _instruction_hash(t.instruction)) for t in tasks]
        miss = [i for i, (tid, h) in enumerate(keys) if self._qcache.get(tid, ("",))[0] != h]
        self.cache_hits += len(tasks) - len(miss)
        self.cache_misses += len(miss)
        if miss:
            if self.embedder is None:
                ids = [tasks[i].task_id for i in miss[:5]]
                raise RuntimeError(
                    f"no cached query embedding for {len(miss)} task(s) (e.g. {ids}) and no "
                    "embedder; precompute them with precompute_queries() or pass embedder="
                )
            # Embed each distinct task once even if it repeats in the batch.
            uniq: dict[str, int] = {}
            for i in miss:
                uniq.setdefault(tasks[i].task_id, i)
            z = self.embedder.embed_queries([tasks[i].instruction for i in uniq.values()])
            z = _check_unit_rows(z, "embed_queries output", self.dim)
            for row, i in enumerate(uniq.values()):
                self._qcache[tasks[i].task_id] = (keys[i][1], z[row].copy())
        if self.dim is None:
            self.dim = int(next(iter(self._qcache.values()))[1].shape[0])
        out = np.empty((len(tasks), self.dim), dtype=np.float32)
        for i, t in enumerate(tasks):
            out[i] = self._qcache[t.task_id][1]
        return out

    def set_query_embeddings(self, tasks: Sequence[_TaskLike], embeddings: np.ndarray) -> None:
        """Put externally computed query embeddings into the cache.

        Args:
            tasks: ``n`` tasks.
            embeddings: ``[n, d]`` float32 unit-norm rows (queries already prompted, e.g. by an
                offline GPU embedding job with the same model as the documents).
        """
        tasks = list(tasks)
        z = _check_unit_rows(embeddings, "embeddings", self.dim)
        if z.shape[0] != len(tasks):
            raise ValueError(f"embeddings has {z.shape[0]} rows but tasks has {len(tasks)} items")
        if self.dim is None:
            self.dim = int(z.shape[1])
        for t, row in zip(tasks, z):
            self._qcache[t.task_id] = (_instruction_hash(t.instruction), row.copy())

    @staticmethod
    def _checked_batch_size(name: str, value: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        return value

    def precompute_queries(self, tasks: Iterable[_TaskLike], batch_size: int = 256) -> int:
        """Embed and cache the queries of ``tasks`` (e.g. the whole train split).

        Args:
            tasks: the tasks whose queries to embed.
            batch_size: tasks handed to the embedder per call.

        Returns:
            The number of tasks newly embedded.
        """
        self._checked_batch_size("batch_size", batch_size)
        tasks = list(tasks)
        before = self.cache_misses
        for s in range(0, len(tasks), batch_size):
            self.query_embeddings(tasks[s : s + batch_size])
        # Precomputing is not a lookup: do not let it skew the hit-rate counters.
        newly = self.cache_misses - before
        self.cache_hits -= len(tasks) - newly
        self.cache_misses = before
        return newly

    def search(
        self,
        queries: np.ndarray,
        k: int,
        exclude_task_ids: Sequence[str | None] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Exact top-``k`` inner-product search with per-query task exclusion.

        Args:
            queries: ``[n, d]`` float32 unit-norm query embeddings.
            k: neighbours per query (``>= 1``).
            exclude_task_ids: ``n`` task ids (or ``None``); entries of query ``i``'s id are
                never returned for query ``i``.

        Returns:
            ``(scores, rows)``: ``[n, k]`` float32 cosine similarities (descending) and ``[n, k]``
            int64 row indices into :attr:`entries`; rows past the available neighbours are
            ``-1`` with score ``-inf``.
        """
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        q = _check_unit_rows(queries, "queries", self.dim)
        n = q.shape[0]
        if exclude_task_ids is None:
            exclude_task_ids = [None] * n
        if len(exclude_task_ids) != n:
            raise ValueError(f"exclude_task_ids has {len(exclude_task_ids)} items for {n} queries")
        scores = np.full((n, k), -np.inf, dtype=np.float32)
        rows = np.full((n, k), -1, dtype=np.int64)
        if n == 0 or not self._rows:
            return scores, rows
        own = [self._task_rows.get(t, 0) if t is not None else 0 for t in exclude_task_ids]
        # One FAISS call for the batch: over-fetch by the largest own-entry count in it.
        fetch = min(len(self._rows), k + max(own))
        d, idx = self._index.search(q, fetch)
        for i in range(n):
            tid = exclude_task_ids[i]
            j = 0
            for score, row in zip(d[i], idx[i]):
                if row < 0:
                    break
                if tid is not None and self._rows[row].task_id == tid:
                    continue
                scores[i, j], rows[i, j] = score, row
                j += 1
                if j == k:
                    break
        return scores, rows

    def retrieve(self, task: _TaskLike, k: int = 3) -> list[BankEntry]:
        """The ``k`` most similar entries of *other* tasks, most similar first."""
        return self.retrieve_batch([task], k)[0]

    def retrieve_batch(
        self, tasks: Sequence[_TaskLike], k: int = 3, with_scores: bool = False
    ) -> list[list[Any]]:
        """:meth:`retrieve` for many tasks with one FAISS search.

        Returns:
            Per task, up to ``k`` entries (fewer only if the bank holds fewer entries of other
            tasks), or ``(entry, cosine)`` pairs with ``with_scores=True``.
        """
        tasks = list(tasks)
        if not tasks:
            return []
        q = self.query_embeddings(tasks)
        scores, rows = self.search(q, k, [t.task_id for t in tasks])
        out: list[list[Any]] = []
        for s_row, r_row in zip(scores, rows):
            hits = [(self._rows[r], float(s)) for s, r in zip(s_row, r_row) if r >= 0]
            out.append(hits if with_scores else [e for e, _ in hits])
        return out

    # ------------------------------------------------------------------------ persistence
    def save(self, directory: str | os.PathLike[str] | None = None) -> Path:
        """Write the index, its row -> entry map and the query cache (default: bank directory).

        Each file is written to a temporary name and renamed into place, so a reader never sees
        a half-written file.
        """
        out = Path(directory) if directory is not None else self.bank.dir
        out.mkdir(parents=True, exist_ok=True)
        if self._index is not None:
            cpu_index = faiss.index_gpu_to_cpu(self._index) if self.on_gpu else self._index
            atomic_write_bytes(out / INDEX_FILE, faiss.serialize_index(cpu_index).tobytes())
        meta = {
            "version": _META_VERSION,
            "embedder": self.embedder_name,
            "dim": self.dim,
            "entry_ids": [e.entry_id for e in self._rows],
        }
        atomic_write_bytes(out / META_FILE, json.dumps(meta).encode())
        tids = sorted(self._qcache)
        vecs = (
            np.stack([self._qcache[t][1] for t in tids])
            if tids
            else np.zeros((0, self.dim or 0), dtype=np.float32)
        )
        buf = io.BytesIO()
        np.savez(
            buf,
            task_ids=np.array(tids, dtype=str),
            hashes=np.array([self._qcache[t][0] for t in tids], dtype=str),
            vectors=vecs.astype(np.float32),
        )
        atomic_write_bytes(out / QUERY_CACHE_FILE, buf.getvalue())
        return out

    @classmethod
    def exists(cls, directory: str | os.PathLike[str]) -> bool:
        """Whether ``directory`` holds a saved retriever."""
        return (Path(directory) / META_FILE).is_file()

    @classmethod
    def load(
        cls,
        bank: ExperienceBank,
        directory: str | os.PathLike[str] | None = None,
        embedder: Embedder | None = None,
        index: str = "auto",
        gpu_device: int = 0,
    ) -> Retriever:
        """Restore a retriever saved by :meth:`save` (default: from the bank directory).

        With an ``embedder``, bank entries appended after the save are indexed too; without
        one they are left out with a warning.

        Raises:
            FileNotFoundError: nothing saved there.
            ValueError: the saved index was built with a different embedder, or references
                entries the bank does not hold.
        """
        src = Path(directory) if directory is not None else bank.dir
        if not cls.exists(src):
            raise FileNotFoundError(f"no saved retriever in {src} ({META_FILE} missing)")
        meta = json.loads((src / META_FILE).read_text())
        if meta.get("version") != _META_VERSION:
            raise ValueError(f"{src / META_FILE}: unsupported version {meta.get('version')}")
        if embedder is not None and meta["embedder"] not in (None, embedder.name):
            raise ValueError(
                f"saved index in {src} was built with embedder {meta['embedder']!r}, "
                f"not {embedder.name!r}; rebuild it (mixing embedding spaces breaks retrieval)"
            )
        self = cls(bank, embedder, index=index, gpu_device=gpu_device, build=False)
        # An index filled through add() with outside embeddings has no embedder name.
        self.embedder_name = meta["embedder"] or self.embedder_name
        self.dim = meta["dim"]
        if (src / INDEX_FILE).is_file():
            raw = np.frombuffer((src / INDEX_FILE).read_bytes(), dtype=np.uint8)
            cpu_index = faiss.deserialize_index(raw)
            if cpu_index.ntotal != len(meta["entry_ids"]):
                raise ValueError(
                    f"{src}: index has {cpu_index.ntotal} rows but the row map has "
                    f"{len(meta['entry_ids'])}"
                )
            if self.on_gpu:
                self._gpu_res = faiss.StandardGpuResources()
                cpu_index = faiss.index_cpu_to_gpu(self._gpu_res, gpu_device, cpu_index)
            self._index = cpu_index
            bank.refresh()
            missing = [i for i in meta["entry_ids"] if i not in bank]
            if missing:
                raise ValueError(
                    f"saved index in {src} references {len(missing)} entries absent from the "
                    f"bank {bank.dir} (e.g. {missing[:3]}); rebuild the index"
                )
            for eid in meta["entry_ids"]:
                e = bank.get(eid)
                self._rows.append(e)
                self._row_ids.add(eid)
                self._task_rows[e.task_id] += 1
        if (src / QUERY_CACHE_FILE).is_file():
            with np.load(src / QUERY_CACHE_FILE) as z:
                for tid, h, v in zip(z["task_ids"], z["hashes"], z["vectors"]):
                    self._qcache[str(tid)] = (str(h), np.asarray(v, dtype=np.float32))
        unindexed = len(bank) - len(self._rows)
        if unindexed > 0:
            if embedder is not None:
                self.sync()
            else:
                warnings.warn(
                    f"{unindexed} bank entries were appended after the index was saved and "
                    "are not searchable; load with embedder= to index them",
                    RuntimeWarning,
                    stacklevel=2,
                )
        return self

    @classmethod
    def load_or_build(
        cls,
        bank: ExperienceBank,
        embedder: Embedder | None = None,
        index: str = "auto",
        save: bool = True,
        doc_batch_size: int = 256,
    ) -> Retriever:
        """:meth:`load` from the bank directory if saved there, else build (and save).

        ``doc_batch_size`` is the new retriever's (see :class:`Retriever`); a loaded one keeps
        the default.
        """
        if cls.exists(bank.dir):
            r = cls.load(bank, embedder=embedder, index=index)
            r.doc_batch_size = cls._checked_batch_size("doc_batch_size", doc_batch_size)
            return r
        if embedder is None:
            raise ValueError(f"no saved retriever in {bank.dir}: pass embedder= to build one")
        r = cls(bank, embedder, index=index, doc_batch_size=doc_batch_size)
        if save:
            r.save()
        return r

    def __repr__(self) -> str:
        where = "gpu" if self.on_gpu else "cpu"
        return (
            f"Retriever(entries={len(self)}, dim={self.dim}, embedder={self.embedder_name!r}, "
            f"index={where}, cached_queries={len(self._qcache)})"
        )
