"""Experience bank durability, embedders and FAISS retrieval (lopd.memory)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from lopd.memory import (
    BankCorruptionError,
    BankEntry,
    ExperienceBank,
    HiddenStateEmbedder,
    Retriever,
    document_prefix,
    document_text,
    format_experience,
    format_query,
    make_entry_id,
)
from lopd.memory.bank import BANK_FILE
from lopd.types import Task, TraceStep, Trajectory

REPO = Path(__file__).resolve().parents[2]


def make_task(i: int, world: str = "shop") -> Task:
    return Task(
        task_id=f"{world}-train-{i:05d}",
        domain="tool_use",
        world=world,
        instruction=f"In {world}, cancel order O-{i} for customer C-{i % 7}, refund card {i % 3}.",
        spec={},
    )


def make_traj(task: Task, reward: float = 1.0, variant: int = 0) -> Trajectory:
    steps = [
        TraceStep(f'find_order(order_number="O-{task.task_id[-5:]}")', "order_id=ORD-1"),
        TraceStep('cancel_order(order_id="ORD-1")', "Success"),
    ]
    steps += [TraceStep(f"noop(k={v})", "ok") for v in range(variant)]
    return Trajectory(
        task=task,
        messages=[],
        input_ids=[],
        action_mask=[],
        turn_spans=[],
        prompt_len=0,
        reward=reward,
        trace=steps,
        num_steps=len(steps),
        num_tool_calls=len(steps),
    )


def make_entry(task_id: str, k: int, world: str = "shop") -> BankEntry:
    trace = f"1. step(k={k}) -> ok"
    return BankEntry(make_entry_id(task_id, trace), task_id, world, f"task {task_id}", trace, 1.0)


# --------------------------------------------------------------------------------- bank
def test_format_experience_matches_paper_layout():
    task = make_task(3)
    e = BankEntry.from_trajectory(make_traj(task))
    assert format_experience(e) == (
        f"Task: {task.instruction}\n"
        "Example steps (from a different task, NOT yet executed):\n"
        '1. find_order(order_number="O-00003") -> order_id=ORD-1\n'
        '2. cancel_order(order_id="ORD-1") -> Success'
    )
    assert document_text(e).startswith(f"Task: {task.instruction}\nTrajectory:\n1. find_order")
    assert e.meta["domain"] == "tool_use" and e.meta["num_steps"] == 2
    assert e.entry_id == make_entry_id(task.task_id, e.trace_text)


def test_bank_threshold_dedup_and_persistence(tmp_path):
    bank = ExperienceBank(tmp_path / "bank", min_reward=0.8)
    tasks = [make_task(i) for i in range(5)]
    added = bank.add_many([make_traj(t, reward=0.5 + 0.1 * i) for i, t in enumerate(tasks)])
    # rewards 0.5 .. 0.9: only 0.8 and 0.9 clear the threshold (0.5 + 0.1 * 3 rounds below 0.8)
    assert [e.task_id for e in added] == [t.task_id for t in tasks if t.task_id in bank.task_ids()]
    assert all(e.reward >= 0.8 for e in bank)
    assert bank.add(make_traj(tasks[0], reward=0.79)) is None
    # Same trace of the same task: stored once. Another successful trace of it: stored.
    n = len(bank)
    assert bank.add(make_traj(tasks[4], reward=1.0)) is None
    assert bank.add(make_traj(tasks[4], reward=1.0, variant=1)) is not None
    assert len(bank) == n + 1

    again = ExperienceBank(tmp_path / "bank")
    assert again.entries() == bank.entries()
    lines = (tmp_path / "bank" / BANK_FILE).read_text().splitlines()
    assert [json.loads(x)["v"] for x in lines] == [1] * len(bank)


def test_bank_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="min_reward"):
        ExperienceBank(tmp_path / "b", min_reward=1.5)
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="path must be a directory"):
        ExperienceBank(tmp_path / "f")
    with pytest.raises(TypeError, match="BankEntry"):
        ExperienceBank(tmp_path / "b").add_entries([{"task_id": "x"}])


def test_reload_skips_every_possible_torn_last_record(tmp_path):
    """Cut the file at every byte inside the last record: reload keeps exactly the others."""
    src = ExperienceBank(tmp_path / "src")
    for i in range(3):
        src.add(make_traj(make_task(i)))
    data = src.file.read_bytes()
    start_last = data.rstrip(b"\n").rfind(b"\n") + 1
    first_two = src.entries()[:2]
    for cut in range(start_last, len(data)):
        d = tmp_path / f"cut{cut}"
        d.mkdir()
        (d / BANK_FILE).write_bytes(data[:cut])
        complete = cut == len(data) - 1  # only the final newline is missing
        torn = not complete and cut > start_last
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            bank = ExperienceBank(d)
            assert bank.entries() == (src.entries() if complete else first_two)
            assert [str(x.message).split(": ")[1][:23] for x in w] == (
                ["skipping truncated last"] if torn else []
            ), cut
            # The next append starts on a clean line (cutting the torn bytes, with a warning).
            bank.add(make_traj(make_task(9)))
            assert len(w) == 2 * torn
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            reloaded = ExperienceBank(d)
        assert [e.task_id for e in reloaded] == [e.task_id for e in bank]
        assert reloaded[-1].task_id == make_task(9).task_id


def test_corrupt_last_complete_line_is_skipped_then_repaired(tmp_path):
    bank = ExperienceBank(tmp_path)
    bank.add(make_traj(make_task(0)))
    with open(bank.file, "ab") as f:
        f.write(b'{"v":1,"entry_id": garbage}\n')
    with pytest.warns(RuntimeWarning, match="corrupt last record"):
        bank = ExperienceBank(tmp_path)
    with pytest.warns(RuntimeWarning, match="corrupt last record"):
        other = ExperienceBank(tmp_path)
    assert len(bank) == len(other) == 1
    with pytest.warns(RuntimeWarning, match="removing a torn last record"):
        bank.add(make_traj(make_task(1)))
    assert len(ExperienceBank(tmp_path)) == 2
    # The other view skipped the bad bytes without consuming them, so after the repair it
    # reads the new record from the right offset.
    assert other.refresh() == 1 and other.entries() == bank.entries()


def test_corruption_before_the_last_line_raises(tmp_path):
    bank = ExperienceBank(tmp_path)
    bank.add(make_traj(make_task(0)))
    with open(bank.file, "ab") as f:
        f.write(b"not json\n")
    with pytest.warns(RuntimeWarning, match="torn last record"):
        bank.add_entry(make_entry("x", 1))  # the repair cuts the bad line: still consistent
    with open(bank.file, "ab") as f:
        f.write(b"not json\n" + bank.file.read_bytes().splitlines(keepends=True)[0])
    with pytest.raises(BankCorruptionError, match="line 3"):
        ExperienceBank(tmp_path)


_WRITER = textwrap.dedent(
    """
    import sys
    from lopd.memory import BankEntry, ExperienceBank, make_entry_id
    path, wid, batches = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    bank = ExperienceBank(path)
    for b in range(batches):
        batch = []
        for r in range(3):
            tid = f"w{wid}-b{b}"
            trace = f"1. step(writer={wid}, batch={b}, rec={r}) -> " + "x" * (50 * r)
            batch.append(BankEntry(make_entry_id(tid, trace), tid, "w", "i", trace, 1.0))
        assert len(bank.add_entries(batch)) == 3
    """
)


def test_concurrent_appends_from_processes_stay_whole_and_contiguous(tmp_path):
    """Four real processes append 3-record batches at once: nothing lost, torn or interleaved."""
    reader = ExperienceBank(tmp_path)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(tmp_path), str(w), "40"],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        for w in range(4)
    ]
    # A live reader meanwhile: never a torn record (no warning), whole batches only.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        while any(p.poll() is None for p in procs):
            reader.refresh()
            assert len(reader) % 3 == 0
    assert [p.wait(timeout=120) for p in procs] == [0] * 4
    reader.refresh()
    assert len(reader) == 4 * 40 * 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bank = ExperienceBank(tmp_path)
    assert len(bank) == 4 * 40 * 3
    task_ids = [e.task_id for e in bank]
    # Each batch is one contiguous run of 3 lines, in record order.
    for s in range(0, len(task_ids), 3):
        assert len(set(task_ids[s : s + 3])) == 1
        assert [e.trace_text.split("rec=")[1][0] for e in bank.entries()[s : s + 3]] == list("012")


def test_concurrent_appends_from_threads_sharing_and_not_sharing_a_bank(tmp_path):
    import threading

    shared, own = ExperienceBank(tmp_path), [ExperienceBank(tmp_path) for _ in range(2)]
    banks = [shared, shared, *own]

    def work(w: int) -> None:
        for b in range(25):
            banks[w].add_entries([make_entry(f"t{w}-{b}", r) for r in range(2)])

    threads = [threading.Thread(target=work, args=(w,)) for w in range(len(banks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        entries = ExperienceBank(tmp_path).entries()
    assert len(entries) == 4 * 25 * 2
    assert all(entries[i].task_id == entries[i + 1].task_id for i in range(0, len(entries), 2))
    # Every view catches up on refresh, in file order.
    for b in (shared, *own):
        b.refresh()
        assert b.entries() == entries


def test_refresh_sees_other_writers_and_dedups_across_them(tmp_path):
    a, b = ExperienceBank(tmp_path), ExperienceBank(tmp_path)
    a.add_entry(make_entry("t1", 1))
    assert len(b) == 0 and b.refresh() == 1 and b[0] == a[0]
    # b has not refreshed a's second record, yet adding the same content dedups under the lock.
    a.add_entry(make_entry("t1", 2))
    assert b.add_entry(make_entry("t1", 2)) is False
    assert len(ExperienceBank(tmp_path)) == 2


# ------------------------------------------------------------------------ retrieval, FAISS
def _random_bank(tmp_path, n_tasks=40, per_task=(1, 5), d=32, seed=0):
    rng = np.random.default_rng(seed)
    bank = ExperienceBank(tmp_path)
    entries = [
        make_entry(f"t{t}", j)
        for t in range(n_tasks)
        for j in range(int(rng.integers(per_task[0], per_task[1] + 1)))
    ]
    bank.add_entries(entries)
    z = rng.standard_normal((len(entries), d)).astype(np.float32)
    z /= np.linalg.norm(z, axis=1, keepdims=True)
    return bank, entries, z, rng


def test_search_equals_bruteforce_cosine_without_self(tmp_path):
    bank, entries, z, rng = _random_bank(tmp_path)
    r = Retriever(bank, index="cpu", build=False)
    assert r.add(entries, z) == len(entries)
    q = rng.standard_normal((25, z.shape[1])).astype(np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    exclude = [f"t{i}" for i in rng.integers(0, 40, size=25)]
    exclude[0] = None  # no exclusion for one query
    k = 7
    scores, rows = r.search(q, k, exclude)
    own = np.array([[e.task_id == t for e in entries] for t in exclude])
    ref = np.where(own, -np.inf, q @ z.T)  # [25, n]: cosine, own task masked out
    ref_rows = np.argsort(-ref, axis=1, kind="stable")[:, :k]
    np.testing.assert_array_equal(rows, ref_rows)
    np.testing.assert_allclose(scores, np.take_along_axis(ref, ref_rows, 1), rtol=0, atol=1e-5)
    for i, t in enumerate(exclude):
        assert t is None or all(entries[j].task_id != t for j in rows[i])


def test_no_self_retrieval_even_when_own_entries_are_nearest(tmp_path):
    """A task with more own entries than k, all closer than anything else, still gets k others."""
    bank = ExperienceBank(tmp_path)
    own = [make_entry("me", j) for j in range(10)]
    others = [make_entry(f"o{j}", 0) for j in range(4)]
    bank.add_entries(own + others)
    q = np.eye(8, dtype=np.float32)[:1]
    z_own = np.tile(q, (10, 1))
    z_oth = np.eye(8, dtype=np.float32)[1:5] * 0.6 + q * 0.8
    r = Retriever(bank, index="cpu", build=False)
    r.add(own + others, np.concatenate([z_own, z_oth]))
    scores, rows = r.search(q, 3, ["me"])
    assert all(r.entries[j].task_id.startswith("o") for j in rows[0])
    np.testing.assert_allclose(scores[0], 0.8, atol=1e-6)
    # Asking for more than exists returns what exists, padded with -1 / -inf.
    scores, rows = r.search(q, 6, ["me"])
    assert list(rows[0, 4:]) == [-1, -1] and np.isneginf(scores[0, 4:]).all()


def test_add_and_search_validate_inputs(tmp_path):
    bank, entries, z, _ = _random_bank(tmp_path, n_tasks=3)
    r = Retriever(bank, index="cpu", build=False)
    with pytest.raises(ValueError, match="unit-norm"):
        r.add(entries, z * 2)
    with pytest.raises(ValueError, match="rows but entries"):
        r.add(entries[:1], z)
    r.add(entries, z)
    assert r.add(entries, z) == 0  # already indexed
    with pytest.raises(ValueError, match="d=32"):
        r.search(np.ones((1, 8), np.float32) / np.sqrt(8), 1)
    with pytest.raises(ValueError, match="k must be"):
        r.search(z[:1], 0)
    with pytest.raises(ValueError, match="index must be"):
        Retriever(bank, index="tpu")


# ------------------------------------------------------------------ embedders (real model)
@pytest.fixture(scope="module")
def tiny_lm():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny forwards: extra threads only contend on a busy CI machine
    yield build_tiny_lm()
    torch.set_num_threads(threads)


def build_tiny_lm():
    """A real (randomly initialized) tiny Qwen3 causal LM and a BPE tokenizer built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [make_task(i, w).instruction for i in range(30) for w in ("shop", "ins")]
    corpus += [format_query("x"), "find_order cancel_order Success order_id -> Trajectory"]
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<pad>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>")
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=tok.get_vocab_size(),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
    )
    return Qwen3ForCausalLM(cfg), tokenizer


def test_hidden_state_embedder_unit_norm_deterministic_batch_invariant(tiny_lm):
    model, tokenizer = tiny_lm
    model.train()  # the embedder must switch dropout off and restore the mode
    texts = [make_task(i).instruction * (1 + i % 3) for i in range(7)] + [""]
    e1 = HiddenStateEmbedder(model, tokenizer, batch_size=3)
    a = e1.embed_documents(texts)
    assert model.training
    assert a.shape == (8, 32) and a.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(a, axis=1), 1.0, atol=1e-5)
    np.testing.assert_array_equal(a, e1.embed_documents(texts))
    # Padding must not leak into real tokens: batch size 1 (no padding) gives the same rows.
    b = HiddenStateEmbedder(model, tokenizer, batch_size=1).embed_documents(texts)
    np.testing.assert_allclose(a, b, atol=1e-5)
    # Queries are rendered (as a document opening, or with the instruction prompt), so they
    # differ from the same text embedded as a document.
    qd = e1.embed_queries(texts[:1])
    assert not np.allclose(qd, a[:1], atol=1e-3)
    np.testing.assert_allclose(qd, e1.embed_documents([document_prefix(texts[0])]), atol=1e-6)
    e2 = HiddenStateEmbedder(model, tokenizer, query_style="instruct")
    qi = e2.embed_queries(texts[:1])
    np.testing.assert_allclose(qi, e1.embed_documents([format_query(texts[0])]), atol=1e-6)
    assert e1.name.endswith(":document:task-docs") and e2.name.endswith(":instruct:task-docs")
    assert e1.embed_queries([]).shape == (0, 32)
    with pytest.raises(TypeError, match="single str"):
        e1.embed_documents("one text")


def test_document_style_embeds_the_task_part_or_the_whole_document(tiny_lm):
    from lopd.memory import task_part

    model, tokenizer = tiny_lm
    task = make_task(3)
    entry_doc = document_text(BankEntry.from_trajectory(make_traj(task)))
    prefix = document_prefix(task.instruction)
    assert entry_doc.startswith(prefix) and len(entry_doc) > len(prefix)
    assert task_part(entry_doc) == prefix
    assert task_part("free text\nTrajectory:\nx") == "free text\nTrajectory:\nx"  # not the layout
    by_task = HiddenStateEmbedder(model, tokenizer)  # default: "task"
    whole = HiddenStateEmbedder(model, tokenizer, document_style="task_trace")
    # Task-only documents embed exactly like the task's query; whole documents do not.
    q = by_task.embed_queries([task.instruction])
    np.testing.assert_allclose(by_task.embed_documents([entry_doc]), q, atol=1e-6)
    assert not np.allclose(whole.embed_documents([entry_doc]), q, atol=1e-3)
    np.testing.assert_allclose(whole.embed_documents([prefix]), q, atol=1e-6)
    assert by_task.name != whole.name and whole.name.endswith(":document")
    with pytest.raises(ValueError, match="document_style"):
        HiddenStateEmbedder(model, tokenizer, document_style="trace")


def test_hidden_state_embedder_validates_arguments(tiny_lm):
    model, tokenizer = tiny_lm
    with pytest.raises(ValueError, match="batch_size"):
        HiddenStateEmbedder(model, tokenizer, batch_size=0)
    with pytest.raises(ValueError, match="max_length"):
        HiddenStateEmbedder(model, tokenizer, max_length=0)
    with pytest.raises(ValueError, match="query_style"):
        HiddenStateEmbedder(model, tokenizer, query_style="plain")


def _bank_of_tasks(path, tasks):
    bank = ExperienceBank(path)
    for i, t in enumerate(tasks):
        bank.add_many([make_traj(t, variant=v) for v in range(1 + i % 2)])
    return bank


def test_retrieve_with_real_embedder_matches_bruteforce_and_caches(tiny_lm, tmp_path):
    model, tokenizer = tiny_lm
    # Whole documents: two trajectories of one task then embed differently, so the brute-force
    # order has no ties (task-only documents tie, and FAISS may order ties either way).
    emb = HiddenStateEmbedder(model, tokenizer, document_style="task_trace")
    tasks = [make_task(i, w) for i in range(8) for w in ("shop", "ins")]
    bank = _bank_of_tasks(tmp_path, tasks)
    r = Retriever(bank, emb, index="cpu")
    assert len(r) == len(bank)
    docs = emb.embed_documents([document_text(e) for e in r.entries])  # [n, d]
    queries = tasks[:5]
    qz = emb.embed_queries([t.instruction for t in queries])
    got = r.retrieve_batch(queries, k=4, with_scores=True)
    assert (r.cache_hits, r.cache_misses) == (0, 5)
    for t, z, hits in zip(queries, qz, got):
        sims = docs @ z
        order = [i for i in np.argsort(-sims) if r.entries[i].task_id != t.task_id][:4]
        assert [e.entry_id for e, _ in hits] == [r.entries[i].entry_id for i in order]
        np.testing.assert_allclose([s for _, s in hits], sims[order], atol=1e-5)
        assert all(e.task_id != t.task_id for e, _ in hits)
    # Cached: a second lookup embeds nothing; an edited instruction is re-embedded.
    assert [e.entry_id for e in r.retrieve(queries[0], k=4)] == [e.entry_id for e, _ in got[0]]
    assert (r.cache_hits, r.cache_misses) == (1, 5)
    edited = Task(**{**queries[0].to_dict(), "instruction": "Something else entirely."})
    r.retrieve(edited, k=1)
    assert r.cache_misses == 6


def test_save_load_without_embedder_and_incremental_sync(tiny_lm, tmp_path):
    model, tokenizer = tiny_lm
    emb = HiddenStateEmbedder(model, tokenizer)
    tasks = [make_task(i) for i in range(6)]
    bank = _bank_of_tasks(tmp_path, tasks)
    r = Retriever.load_or_build(bank, emb, index="cpu")
    assert r.precompute_queries(tasks) == 6 and (r.cache_hits, r.cache_misses) == (0, 0)
    want = r.retrieve_batch(tasks, k=3, with_scores=True)
    r.save()

    # Training-time load: no embedder, same results from the cached queries, all cache hits.
    r2 = Retriever.load(ExperienceBank(tmp_path), index="cpu")
    got = r2.retrieve_batch(tasks, k=3, with_scores=True)
    assert [[(e.entry_id, round(s, 5)) for e, s in h] for h in got] == [
        [(e.entry_id, round(s, 5)) for e, s in h] for h in want
    ]
    assert (r2.cache_hits, r2.cache_misses) == (6, 0)
    with pytest.raises(RuntimeError, match="no cached query embedding"):
        r2.retrieve(make_task(99), k=1)

    # Entries appended after the save: left out (warning) without an embedder, indexed with one.
    bank.add(make_traj(make_task(50)))
    with pytest.warns(RuntimeWarning, match="not searchable"):
        assert len(Retriever.load(ExperienceBank(tmp_path), index="cpu")) == len(bank) - 1
    r3 = Retriever.load_or_build(ExperienceBank(tmp_path), emb, index="cpu")
    assert len(r3) == len(bank)
    assert r3.retrieve(make_task(0), k=1)[0].task_id != make_task(0).task_id

    class Other(HiddenStateEmbedder):
        pass

    with pytest.raises(ValueError, match="built with embedder"):
        Retriever.load(bank, embedder=Other(model, tokenizer, name="other"), index="cpu")


def test_sentence_transformer_embedder_matches_hidden_state_pooling(tiny_lm, tmp_path):
    """A local sentence-transformers model (mean pooling) over the same backbone gives the same
    embeddings as HiddenStateEmbedder: two independent implementations of eq. 15 agree."""
    pytest.importorskip("sentence_transformers", reason="optional: pip install 'lopd[embed]'")
    from lopd.memory import SentenceTransformerEmbedder

    model, tokenizer = tiny_lm
    model.model.save_pretrained(tmp_path)  # the bare Qwen3Model + tokenizer: an ST text model
    tokenizer.save_pretrained(tmp_path)
    st = SentenceTransformerEmbedder(tmp_path, device="cpu", batch_size=2)
    ref = HiddenStateEmbedder(model, tokenizer, query_style="instruct")
    texts = [make_task(i).instruction * (1 + i) for i in range(3)]
    assert (st.dim, st.name) == (32, f"st:{tmp_path}")
    np.testing.assert_allclose(st.embed_documents(texts), ref.embed_documents(texts), atol=1e-5)
    np.testing.assert_allclose(st.embed_queries(texts), ref.embed_queries(texts), atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(st.embed_queries(texts), axis=1), 1.0, atol=1e-5)
    # Plugged into the retriever like any embedder.
    bank = _bank_of_tasks(tmp_path / "bank", [make_task(i) for i in range(4)])
    r = Retriever(bank, st, index="cpu")
    assert [e.task_id != make_task(0).task_id for e in r.retrieve(make_task(0), k=3)] == [True] * 3


def test_sentence_transformer_embedder_honours_the_document_style(tiny_lm, tmp_path):
    """Default: the paper's whole documents; ``document_style="task"``: the task part only,
    under another space name (an index of one style is never reused for the other)."""
    pytest.importorskip("sentence_transformers", reason="optional: pip install 'lopd[embed]'")
    from lopd.memory import SentenceTransformerEmbedder

    model, tokenizer = tiny_lm
    model.model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    whole = SentenceTransformerEmbedder(tmp_path, device="cpu")
    by_task = SentenceTransformerEmbedder(tmp_path, device="cpu", document_style="task")
    assert whole.document_style == "task_trace" and whole.name == f"st:{tmp_path}"
    assert by_task.name == f"st:{tmp_path}:task-docs"
    task = make_task(2)
    doc = document_text(BankEntry.from_trajectory(make_traj(task)))
    prefix = document_prefix(task.instruction)
    np.testing.assert_allclose(
        by_task.embed_documents([doc]), whole.embed_documents([prefix]), atol=1e-6
    )
    assert not np.allclose(whole.embed_documents([doc]), whole.embed_documents([prefix]), atol=1e-3)
    with pytest.raises(ValueError, match="document_style"):
        SentenceTransformerEmbedder(tmp_path, device="cpu", document_style="trace")


def test_empty_bank_round_trips_and_retrieves_nothing(tiny_lm, tmp_path):
    model, tokenizer = tiny_lm
    r = Retriever(ExperienceBank(tmp_path), HiddenStateEmbedder(model, tokenizer), index="cpu")
    r.precompute_queries([make_task(0)])
    r.save()
    loaded = Retriever.load(ExperienceBank(tmp_path), index="cpu")
    assert len(loaded) == 0 and loaded.retrieve(make_task(0), k=3) == []


def test_index_batch_size_bounds_every_embedder_call(tiny_lm, tmp_path):
    """``bank.index_batch_size`` reaches the retriever: indexing and query precomputation hand
    the embedder at most that many texts per call, with the same index as one big call."""
    from lopd.config import Config, ConfigError

    model, tokenizer = tiny_lm
    calls: list[int] = []

    class Counting(HiddenStateEmbedder):
        def embed_documents(self, texts):
            calls.append(len(texts))
            return super().embed_documents(texts)

        def embed_queries(self, texts):
            calls.append(len(texts))
            return super().embed_queries(texts)

    tasks = [make_task(i) for i in range(7)]
    bank = _bank_of_tasks(tmp_path / "a", tasks)
    r = Retriever.load_or_build(bank, Counting(model, tokenizer), index="cpu", doc_batch_size=3)
    assert calls == [3, 3, 3, 1]  # 10 entries
    calls.clear()
    assert r.precompute_queries(tasks, batch_size=2) == 7 and calls == [2, 2, 2, 1]
    whole = Retriever(_bank_of_tasks(tmp_path / "b", tasks), HiddenStateEmbedder(model, tokenizer))
    got = [e.entry_id for e in r.retrieve(tasks[0], k=3)]
    assert got == [e.entry_id for e in whole.retrieve(tasks[0], k=3)]

    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="doc_batch_size must be an integer >= 1"):
            Retriever(bank, HiddenStateEmbedder(model, tokenizer), doc_batch_size=bad)
        with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
            r.precompute_queries(tasks, batch_size=bad)
    cfg = Config()
    assert cfg.bank.index_batch_size == 256
    cfg.bank.index_batch_size = 0
    with pytest.raises(ConfigError, match=r"bank\.index_batch_size must be >= 1"):
        cfg.validate()
