"""Experience-bank insert and retrieval throughput at bank scale (default 100k entries).

Everything goes through the real code paths: entries are appended by ``ExperienceBank`` (JSONL,
one ``write`` + ``fsync`` per batch under ``flock``), random unit-norm 256-d embeddings go into
the real FAISS ``IndexFlatIP`` through ``Retriever.add``, and queries go through
``Retriever.search`` / ``retrieve_batch`` with self-task exclusion and cached query embeddings.
Embedding cost is excluded on purpose (it depends only on the embedder model).

    python -m benchmarks.bench_experience_bank            # 100k entries, d=256, 1 thread
    python -m benchmarks.bench_experience_bank --n 10000 --threads 2
    python -m benchmarks.bench_experience_bank --quality  # the default embedder's retrieval quality

Results are appended to ``benchmarks/results/memory_*.json`` via ``benchmarks.common.record``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import record
from lopd.memory import BankEntry, ExperienceBank, Retriever, document_text, make_entry_id
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


def retrieval_quality(model_path: str | None, k: int) -> None:
    """How often the default embedder retrieves experience of the same task template.

    The bank holds one oracle trajectory per built-in tool-use train task (played in its
    environment, so traces carry real tool results); queries are the held-out test tasks. A
    retrieved entry is "relevant" when it comes from the same task template (same tool sequence),
    the case where its steps transfer. Reported for both query styles of
    :class:`HiddenStateEmbedder`, against chance (the template's share of the bank).
    """
    import torch

    from lopd.envs import builtin_tasks, make_env, oracle_actions
    from lopd.memory import HiddenStateEmbedder
    from lopd.models.loading import load_model
    from lopd.types import Trajectory

    torch.set_num_threads(1)
    model, tokenizer = load_model(model_path)
    train = builtin_tasks("tool_use", "train")
    test = builtin_tasks("tool_use", "test")
    template = {t.task_id: (t.world, t.spec["template"]) for t in train + test}
    with tempfile.TemporaryDirectory() as tmp:
        bank = ExperienceBank(tmp)
        trajs = []
        for t in train:
            env = make_env(t)
            env.reset(t)
            for action in oracle_actions(t):
                if env.step(action)[1]:
                    break
            trajs.append(Trajectory(t, [], [], [], [], 0, env.reward(), trace=list(env.trace)))
        bank.add_many(trajs)
        share: dict[tuple[str, str], float] = {}
        for e in bank:
            share[template[e.task_id]] = share.get(template[e.task_id], 0.0) + 1 / len(bank)
        chance = float(np.mean([share.get(template[q.task_id], 0.0) for q in test]))
        docs = None
        for style in ("document", "instruct"):
            emb = HiddenStateEmbedder(model, tokenizer, batch_size=32, query_style=style)
            retriever = Retriever(bank, emb, index="cpu", build=False)
            t0 = time.perf_counter()
            if docs is None:  # documents do not depend on the query style: embed them once
                docs = emb.embed_documents([document_text(e) for e in bank])
            embed_s = time.perf_counter() - t0
            retriever.add(bank.entries(), docs)
            hits = retriever.retrieve_batch(test, k=k)
            same = [
                [template[e.task_id] == template[q.task_id] for e in h] for q, h in zip(test, hits)
            ]
            world = [[e.world == q.world for e in h] for q, h in zip(test, hits)]
            rec = record(
                "memory_retrieval_quality",
                f"hidden-state/{style}" + ("" if model_path is None else f"/{model_path}"),
                {"bank": len(bank), "queries": len(test), "k": k, "d": emb.dim},
                embed_s / len(bank),
                same_template_at_k=round(float(np.mean(same)), 4),
                same_world_at_k=round(float(np.mean(world)), 4),
                chance_template=round(chance, 4),
                load_avg_1m=round(os.getloadavg()[0], 2),
            )
            print(
                f"query_style={style:<8s}: same template among top-{k} "
                f"{rec['same_template_at_k']:.3f} (chance {chance:.3f}), same world "
                f"{rec['same_world_at_k']:.3f} ({len(bank)} oracle entries, {len(test)} "
                "held-out queries)"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=100_000, help="bank entries")
    ap.add_argument("--d", type=int, default=256, help="embedding width")
    ap.add_argument("--k", type=int, default=3, help="neighbours per query (paper: J=3)")
    ap.add_argument("--per-task", type=int, default=4, help="bank entries per task")
    ap.add_argument("--batch", type=int, default=256, help="records per durable bank batch")
    ap.add_argument("--single", type=int, default=1000, help="records for the batch=1 run")
    ap.add_argument("--threads", type=int, default=1, help="FAISS OpenMP threads")
    ap.add_argument("--no-rss", action="store_true", help="skip the resident-memory subprocess")
    ap.add_argument(
        "--quality",
        action="store_true",
        help="instead: retrieval quality of the default embedder on the built-in tasks",
    )
    ap.add_argument("--model", default=None, help="--quality: checkpoint (default: tiny model)")
    args = ap.parse_args()
    if args.quality:
        retrieval_quality(args.model, args.k)
        return

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
        print(
            f"index save / load:     {dt_save:.2f} s / {dt_load:.2f} s (index, rows, query cache)"
        )

        # --- memory of a loaded bank + retriever (fresh process) ----------------------------
        if not args.no_rss:
            rss = _resident_delta(
                setup="from lopd.memory import ExperienceBank, Retriever",
                run=(
                    f"r = Retriever.load(ExperienceBank({str(bank.dir)!r}), index='cpu')\n"
                    f"assert len(r) == {args.n}"
                ),
            )
            record(
                "memory_index_persist",
                "faiss-cpu-flatip",
                {"n": args.n, "d": args.d, "io": "load-rss"},
                dt_load,
                peak_mem_bytes=rss,
                **common,
            )
            print(
                f"loaded bank + index:   {rss / 2**20:.0f} MiB resident (index alone "
                f"{args.n * args.d * 4 / 2**20:.0f} MiB)"
            )


def _resident_delta(setup: str, run: str) -> int:
    """Resident-set growth (bytes) of ``run`` after ``setup`` in a fresh Python process.

    Current RSS (``VmRSS``), not the ``ru_maxrss`` high-water mark: importing torch and faiss
    peaks higher than what a loaded bank adds, which would hide it under a high-water reading.
    """
    code = (
        "def _rss():\n"
        "    for ln in open('/proc/self/status'):\n"
        "        if ln.startswith('VmRSS:'):\n"
        "            return int(ln.split()[1]) * 1024\n"
        f"{setup}\n_b = _rss()\n{run}\nprint('LOPD_RSS', _rss() - _b)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    return int(next(ln for ln in out.stdout.splitlines() if ln.startswith("LOPD_RSS")).split()[1])


if __name__ == "__main__":
    main()
