"""Every method's privileged-context format in the tiny model's data and probe: the exact text
each method's teacher reads, drawn in equal shares, and measured per format."""

from __future__ import annotations

import collections
import json
import random

import pytest

from lopd.envs import builtin_tasks, make_env
from lopd.methods.opsd import OPSD_SYSTEM_TEMPLATE
from lopd.methods.sdft import SDFT_USER_TEMPLATE
from lopd.methods.sdpo import SDPO_USER_TEMPLATE
from lopd.methods.skills import RuleSkillSummarizer, SkillText
from lopd.methods.text_teacher import (
    build_text_teacher_sequence,
    framed_teacher_sequence,
    reference_text,
)
from lopd.models.__main__ import main
from lopd.models.loading import load_model
from lopd.rollout.chat import render_prompt
from lopd.tiny.build import build_tokenizer
from lopd.tiny.data import EpisodeSource, Mixture, oracle_play, tokenizer_corpus
from lopd.tiny.formats import FORMATS, FramedPromptEnv, frame_reference
from lopd.tiny.probe import format_formats_report, probe_formats
from lopd.types import Trajectory


@pytest.fixture(scope="module")
def train():
    return builtin_tasks("tool_use", "train")


@pytest.fixture(scope="module")
def shipped():
    return load_model()


def _teacher_suffixes(fmt: str, reference: Trajectory | None) -> tuple[str, str]:
    """(system_suffix, user_suffix) as each method's teacher builds them from ``reference``
    (``None``: under ``lopd.null_context``, where every privileged text is empty)."""
    trace = reference.trace_text() if reference else ""
    if fmt == "opsd":
        from lopd.memory.bank import BankEntry, format_experience

        gt = format_experience(BankEntry.from_trajectory(reference)) if reference else ""
        return OPSD_SYSTEM_TEMPLATE.format(gt_text=gt), ""
    if fmt == "sdft":
        return "", SDFT_USER_TEMPLATE.format(demo_text=trace)
    if fmt == "sdpo":
        return "", SDPO_USER_TEMPLATE.format(solution=trace)
    if reference is None:
        return "", SkillText("", "", "").render()
    skill = RuleSkillSummarizer().text([reference], success=1.0)
    return "", skill.render()


@pytest.mark.parametrize("fmt", ["opsd", "sdft", "sdpo", "skill-sd"])
def test_a_text_format_is_the_prompt_its_methods_teacher_reads(shipped, train, fmt):
    """The framed prompt the tiny model is trained on and probed with equals, token for token,
    the teacher input the method builds from the student's bare prompt."""
    _, tok = shipped
    task, reference = train[0], oracle_play(train[5])
    assert reference.reward == 1.0 and reference.trace
    bare = make_env(task)
    user = bare.reset(task)
    prompt = render_prompt(tok, bare.system_prompt(), user, bare.tools())
    student = Trajectory(
        task=task,
        messages=[
            {"role": "system", "content": bare.system_prompt()},
            {"role": "user", "content": user},
        ],
        input_ids=list(prompt),
        action_mask=[0] * len(prompt),
        turn_spans=[],
        prompt_len=len(prompt),
        reward=0.0,
    )
    system_suffix, user_suffix = _teacher_suffixes(fmt, reference)
    teacher = build_text_teacher_sequence(
        tok, student, system_suffix=system_suffix, user_suffix=user_suffix
    )
    framed = FramedPromptEnv(make_env(task), fmt, reference)
    framed_user = framed.reset(task)
    ids = render_prompt(tok, framed.system_prompt(), framed_user, framed.tools())
    assert ids == teacher.input_ids[: teacher.prompt_len]
    assert len(ids) > len(prompt) + 20  # the reference is in it


@pytest.mark.parametrize("fmt", ["opsd", "sdft", "sdpo", "skill-sd"])
def test_an_emptied_format_is_the_null_context_teachers_prompt(shipped, train, fmt):
    """``probe-formats --emptied`` shows the base model, token for token, the prompt a teacher
    reads under ``lopd.null_context``: the template, nothing of the reference."""
    _, tok = shipped
    task, reference = train[0], oracle_play(train[5])
    student = _student(tok, task)
    system_suffix, user_suffix = _teacher_suffixes(fmt, None)
    teacher = build_text_teacher_sequence(
        tok, student, system_suffix=system_suffix, user_suffix=user_suffix
    )
    framed = FramedPromptEnv(make_env(task), fmt, reference, emptied=True)
    user = framed.reset(task)  # first: it sets the system message's suffix
    ids = render_prompt(tok, framed.system_prompt(), user, framed.tools())
    assert ids == teacher.input_ids[: teacher.prompt_len]
    assert len(ids) > student.prompt_len  # the template stays
    full = FramedPromptEnv(make_env(task), fmt, reference)
    user = full.reset(task)
    full_ids = render_prompt(tok, full.system_prompt(), user, full.tools())
    assert len(full_ids) > len(ids) + 20  # the reference is gone
    lopd_text = frame_reference("lopd", "hi", task.domain, reference, emptied=True).user
    assert reference.trace_text() not in lopd_text and "hi" in lopd_text


def _student(tok, task):
    """A student trajectory that is just ``task``'s bare prompt."""
    bare = make_env(task)
    user = bare.reset(task)
    prompt = render_prompt(tok, bare.system_prompt(), user, bare.tools())
    messages = [
        {"role": "system", "content": bare.system_prompt()},
        {"role": "user", "content": user},
    ]
    return Trajectory(
        task=task,
        messages=messages,
        input_ids=list(prompt),
        action_mask=[0] * len(prompt),
        turn_spans=[],
        prompt_len=len(prompt),
        reward=0.0,
    )


def test_under_context_format_a5_a_text_teacher_reads_the_lopd_format(shipped, train):
    """``lopd.context_format=a5``: a trajectory reference, as a text teacher builds it, is token
    for token the probe's ``lopd`` format (the framing the tiny model was taught to read)."""
    _, tok = shipped
    task, reference = train[0], oracle_play(train[5])
    student = _student(tok, task)
    teacher = framed_teacher_sequence(
        tok, student, reference_text(reference, "a5"), "a5", user_suffix="ignored under a5"
    )
    framed = FramedPromptEnv(make_env(task), "lopd", reference)
    ids = render_prompt(tok, framed.system_prompt(), framed.reset(task), framed.tools())
    assert ids == teacher.input_ids[: teacher.prompt_len]
    own = framed_teacher_sequence(tok, student, "x", "own", user_suffix=" and x")
    assert tok.decode(own.input_ids[: own.prompt_len]).count(" and x") == 1
    with pytest.raises(ValueError, match="context_format must be"):
        framed_teacher_sequence(tok, student, "x", "A5")


def test_lopd_format_is_the_a5_framing_and_unknown_formats_are_refused(train):
    task, reference = train[0], oracle_play(train[5])
    framed = frame_reference("lopd", task.instruction, task.domain, reference)
    assert framed.system_suffix == "" and framed.user.endswith(task.instruction)
    assert reference.trace[0].action in framed.user
    with pytest.raises(ValueError, match="format must be one of"):
        frame_reference("grpo", task.instruction, task.domain, reference)
    with pytest.raises(ValueError, match="format must be one of"):
        FramedPromptEnv(make_env(task), "nope", reference)
    for bad in ((), ("lopd", "lopd"), ("lopd", "sft")):
        with pytest.raises(ValueError, match="formats must be"):
            Mixture(formats=bad)


def test_every_format_gets_an_equal_share_and_one_format_draws_nothing(train, shipped):
    _, tok = shipped
    source = EpisodeSource(train, Mixture(bare=0.2, formats=FORMATS))
    rng = random.Random(0)
    counts = collections.Counter()
    for i in range(1000):
        episode = source.episode(rng, source.worlds[i % 3])
        counts[episode.format if episode.reference else "bare"] += 1
        if i < 25 and episode.reference is not None:
            demo = source.demonstration(tok, episode)
            system, user = demo.messages[0]["content"], demo.messages[1]["content"]
            step = oracle_play(episode.reference).trace[0].action
            # The reference sits where its format puts it, and nowhere else.
            assert (step in system) == (episode.format == "opsd")
            if episode.format not in ("opsd", "skill-sd"):
                assert step in user
            assert demo.reward == 1.0 and episode.target.instruction in user
    assert 150 <= counts["bare"] <= 250
    for fmt in FORMATS:
        assert 120 <= counts[fmt] <= 200, counts
    # A one-format mixture draws no format: its stream of tasks is the same for every format,
    # so the one-format recipe (the shipped build) keeps its exact data.
    streams = []
    for fmt in ("lopd", "sdpo"):
        one = EpisodeSource(train, Mixture(formats=(fmt,)))
        rng = random.Random(7)
        episodes = [one.episode(rng, one.worlds[i % 3]) for i in range(60)]
        assert {e.format for e in episodes if e.reference} == {fmt}
        streams.append([(e.target.task_id, e.reference and e.reference.task_id) for e in episodes])
    assert streams[0] == streams[1]


def test_the_corpus_covers_every_formats_wording(train):
    texts = tokenizer_corpus(train[:60], FORMATS)
    assert texts[: len(tokenizer_corpus(train[:60]))] == tokenizer_corpus(train[:60])
    tok = build_tokenizer(texts)
    for template in (SDFT_USER_TEMPLATE, SDPO_USER_TEMPLATE):
        words = template.replace("{demo_text}", "").replace("{solution}", "").split()
        # About a token per word: the wording is in the vocabulary, not spelled out.
        assert len(tok(" ".join(words))["input_ids"]) <= 1.5 * len(words)


def test_probe_formats_reports_every_format_against_bare(shipped, train, tmp_path):
    model, tok = shipped
    val = builtin_tasks("tool_use", "val", n=4)
    report = probe_formats(
        model, tok, train, val, formats=("lopd", "opsd"), seeds=(0, 1), log=print
    )
    conditions = report["conditions"]
    assert list(conditions) == ["bare", "lopd", "opsd"] and report["n_tasks"] == 4
    for c in ("lopd", "opsd"):
        r = conditions[c]
        assert len(r["per_seed"]) == 2 and 0.0 <= r["mean"] <= 1.0
        assert r["minus_bare"]["mean"] == pytest.approx(r["mean"] - conditions["bare"]["mean"])
    table = format_formats_report(report)
    assert table.count("\n") == 4 and "| opsd |" in table
    out = tmp_path / "formats.json"
    argv = ["probe-formats", "--n", "2", "--seeds", "0", "--formats", "sdpo", "--out", str(out)]
    assert main(argv) == 0
    assert list(json.loads(out.read_text())["conditions"]) == ["bare", "sdpo"]
    assert main([*argv, "--emptied"]) == 0
    assert json.loads(out.read_text())["reference"].startswith("none: each format's template")


def test_reference_excerpts_hold_the_reference_between_instruction_and_call(train, shipped):
    """``excerpt_references``: the curricula's excerpts keep a format's reference in the user
    turn, so the first call must be copied from the instruction across it."""
    from lopd.tiny.sft import excerpt_batches

    _, tok = shipped
    source = EpisodeSource(train, Mixture(bare=0.0, formats=("sdpo",)))
    batches = {
        refs: next(excerpt_batches(source, tok, 4, seed=0, first_only=True, with_references=refs))
        for refs in (False, True)
    }
    for refs, (ids, _attn, _labels, _w) in batches.items():
        texts = [tok.decode(row) for row in ids.tolist()]
        assert all(("Correct solution:" in t) == refs for t in texts)
