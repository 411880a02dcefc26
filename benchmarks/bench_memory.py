"""Experience-bank insert and retrieval throughput at bank scale (default 100k entries).

Everything goes through the real code paths: entries are appended by ``ExperienceBank`` (JSONL,
one ``write`` + ``fsync`` per batch under ``flock``), random unit-norm 256-d embeddings go into
the real FAISS ``IndexFlatIP`` through ``Retriever.add``, and queries go through
``Retriever.search`` / ``retrieve_batch`` with self-task exclusion and cached query embeddings.
Embedding cost is excluded on purpose (it depends only on the embedder model).

    python -m benchmarks.bench_memory                # 100k entries, d=256, 1 thread
    python -m benchmarks.bench_memory --n 10000 --threads 2

Results are appended to ``benchmarks/results/memory_*.json`` via ``benchmarks.common.record``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import peak_rss_bytes, record
from lopd.memory import BankEntry, ExperienceBank, Retriever, make_entry_id
from lopd.types import Task


def _entries(n: int, per_task: int) -> list[BankEntry]:
    out = []
    for i in range(n):
        tid = f"shop-train-{i // per_task:06d}"
        trace = (
            f'1. find_order(order_number="O-{i}") -> order_id=ORD-{i}\n'
            f'2. cancel_order(order_id="ORD-{i}") -> Success\n'
            f'3. refund_payment(order_id="ORD-{i}", amount={i % 997}.00) -> refund_id=R-{i}'
        )
        out.append(
            BankEntry(
                make_entry_id(tid, trace),
                tid,
                "shop",
                f"Cancel order O-{i} for customer C-{i % 1000} and refund it to the card.",
                trace,
                1.0,
                {"split": "train"},
            )
        )
    return out


def _unit(rng: np.random.Generator, n: int, d: int) -> np.ndarray:
    z = rng.standard_normal((n, d), dtype=np.float32)
    z /= np.linalg.norm(z, axis=1, keepdims=True)
    return z


def _median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=100_000, help="bank entries")
    ap.add_argument("--d", type=int, default=256, help="embedding width")
    ap.add_argument("--k", type=int, default=3, help="neighbours per query (paper: J=3)")
    ap.add_argument("--per-task", type=int, default=4, help="bank entries per task")
    ap.add_argument("--batch", type=int, default=256, help="records per durable bank batch")
    ap.add_argument("--single", type=int, default=1000, help="records for the batch=1 run")
    ap.add_argument("--threads", type=int, default=1, help="FAISS OpenMP threads")
    ap.add_argument("--no-rss", action="store_true", help="skip the peak-RSS subprocess")
    args = ap.parse_args()

    import faiss

    faiss.omp_set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    entries = _entries(args.n, args.per_task)
    # The load average goes with every record: this CPU may be shared, and timings under load
    # are not comparable with timings on an idle machine.
    common = {
        "threads": args.threads,
        "faiss": faiss.__version__,
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }

    with tempfile.TemporaryDirectory() as tmp:
        # --- bank insert: one fsync per record, then batched --------------------------------
        single = ExperienceBank(Path(tmp) / "single")
        t0 = time.perf_counter()
        for e in entries[: args.single]:
            single.add_entry(e)
        dt = time.perf_counter() - t0
        rec = record(
            "memory_bank_insert",
            "jsonl-fsync",
            {"n": args.single, "batch": 1},
            dt / args.single,
            records_per_s=args.single / dt,
            **common,
        )
        print(f"bank insert batch=1:   {rec['records_per_s']:>10.0f} records/s")

        bank = ExperienceBank(Path(tmp) / "bank")
        t0 = time.perf_counter()
        for s in range(0, args.n, args.batch):
            bank.add_entries(entries[s : s + args.batch])
        dt = time.perf_counter() - t0
        size = bank.file.stat().st_size
        rec = record(
            "memory_bank_insert",
            "jsonl-fsync",
            {"n": args.n, "batch": args.batch},
            dt / args.n,
            records_per_s=args.n / dt,
            total_s=dt,
            file_bytes=size,
            **common,
        )
        print(
            f"bank insert batch={args.batch}: {rec['records_per_s']:>10.0f} records/s "
            f"({args.n} in {dt:.2f} s, {size / 2**20:.1f} MiB)"
        )

        dt = _median_time(lambda: ExperienceBank(bank.dir), 3)
        rec = record(
            "memory_bank_load",
            "jsonl",
            {"n": args.n},
            dt,
            records_per_s=args.n / dt,
            **common,
        )
        print(f"bank load:             {rec['records_per_s']:>10.0f} records/s ({dt:.2f} s)")

        # --- index build --------------------------------------------------------------------
        docs = _unit(rng, args.n, args.d)
        retriever = Retriever(bank, index="cpu", build=False)
        t0 = time.perf_counter()
        retriever.add(bank.entries(), docs)
        dt = time.perf_counter() - t0
        rec = record(
            "memory_index_add",
            "faiss-cpu-flatip",
            {"n": args.n, "d": args.d},
            dt,
            vectors_per_s=args.n / dt,
            **common,
        )
        print(f"index add:             {rec['vectors_per_s']:>10.0f} vectors/s ({dt:.2f} s)")

        # --- queries -------------------------------------------------------------------------
        n_tasks = args.n // args.per_task
        tasks = [
            Task(f"shop-train-{i:06d}", "tool_use", "shop", f"task {i}", {})
            for i in rng.choice(n_tasks, size=min(512, n_tasks), replace=False)
        ]
        retriever.set_query_embeddings(tasks, _unit(rng, len(tasks), args.d))
        for batch in (1, 64):
            chunks = [tasks[s : s + batch] for s in range(0, min(len(tasks), 8 * batch), batch)]
            # One warm-up pass, then time whole passes over the chunks.
            for c in chunks:
                retriever.retrieve_batch(c, k=args.k)
            n_q = sum(len(c) for c in chunks)
            reps = 5 if batch == 1 else 3
            dt = _median_time(
                lambda chunks=chunks: [retriever.retrieve_batch(c, args.k) for c in chunks], reps
            )
            rec = record(
                "memory_retrieve",
                "faiss-cpu-flatip",
                {"n": args.n, "d": args.d, "k": args.k, "batch": batch},
                dt / n_q,
                queries_per_s=n_q / dt,
                **common,
            )
            print(
                f"retrieve batch={batch:<3d}:    {rec['queries_per_s']:>10.0f} queries/s "
                f"({1e3 * dt / n_q:.2f} ms/query, k={args.k}, no self-retrieval)"
            )

        # --- persistence ---------------------------------------------------------------------
        dt_save = _median_time(retriever.save, 3)
        dt_load = _median_time(lambda: Retriever.load(bank, index="cpu"), 3)
        record(
            "memory_index_persist",
            "faiss-cpu-flatip",
            {"n": args.n, "d": args.d, "io": "save"},
            dt_save,
            **common,
        )
        record(
            "memory_index_persist",
            "faiss-cpu-flatip",
            {"n": args.n, "d": args.d, "io": "load"},
            dt_load,
            **common,
        )
        print(f"index save / load:     {dt_save:.2f} s / {dt_load:.2f} s (incl. bank reload)")

        # --- memory of a loaded retriever (fresh process) -----------------------------------
        if not args.no_rss:
            before, peak = peak_rss_bytes(
                setup=f"""
                from lopd.memory import ExperienceBank, Retriever
                import faiss
                faiss.omp_set_num_threads({args.threads})
                """,
                run=f"""
                r = Retriever.load(ExperienceBank({str(bank.dir)!r}), index="cpu")
                assert len(r) == {args.n}
                """,
            )
            record(
                "memory_index_persist",
                "faiss-cpu-flatip",
                {"n": args.n, "d": args.d, "io": "load-rss"},
                dt_load,
                peak_mem_bytes=peak - before,
                **common,
            )
            print(f"loaded retriever RSS:  {(peak - before) / 2**20:.0f} MiB above imports")


if __name__ == "__main__":
    main()
