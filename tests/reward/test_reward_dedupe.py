"""Deduplicated verification: answers are read in the parent (bounded string work, also on hostile
text), each distinct (answer, gold) pair is verified once, and every output gets exactly the
verdict that verifying it alone would give."""

from __future__ import annotations

import time

import pytest

from anytime.reward.answer import MAX_PARAGRAPH_CHARS
from anytime.reward.verifier import THINK_END, BatchStats, RewardScorer, Verdict, read_answer, score_one

HEADER = "**Final Answer**"


def answer(content: str, before: str = "") -> str:
    return f"{before}{THINK_END}\n\n{HEADER}\n\\boxed{{{content}}}"


@pytest.mark.unit
def test_read_answer_reasons() -> None:
    assert read_answer(answer("1/2")) == "1/2"
    assert read_answer("no marker") == Verdict(0.0, "bad_format", None)
    assert read_answer(answer("1") + THINK_END) == Verdict(0.0, "bad_format", None)
    assert read_answer(f"{THINK_END}\n\nno header") == Verdict(0.0, "no_answer", None)
    assert read_answer(answer("")) == Verdict(0.0, "no_answer", "")
    assert read_answer("<e>\n\nA: \\boxed{7}", header="A:", think_end="<e>") == "7"


@pytest.mark.unit
def test_read_answer_is_bounded_on_hostile_text() -> None:
    """The parent reads untrusted text: every case is a few linear passes (a generous bound, far
    below what a quadratic scan of these sizes would take)."""
    mb = 1_000_000
    box = f"{THINK_END}\n\n{HEADER}\n"
    hostile = {
        "blank_lines": THINK_END + "\n\n" * (5 * mb),
        "headers": THINK_END + f"\n\n{HEADER}" * mb,
        "openers": box + "\\boxed{" * mb,
        "braces": box + "{" * (5 * mb),
        "closers": box + "}" * (5 * mb) + "\\boxed{1}",
        "box_spaces": box + "\\boxed" + " " * (5 * mb),
        "escapes": box + "\\{" * (2 * mb),
        "think_ends": THINK_END * mb,
        "one_paragraph": box + "x" * (10 * mb) + "\\boxed{2}",
        "long_box": box + "\\boxed{" + "9" * (5 * mb) + "}",
        "nul_surrogates": box + "\x00\ud800" * mb + "\\boxed{3}",
        "text_before": "y" * (10 * mb) + answer("4"),
    }
    start = time.perf_counter()
    read = {name: read_answer(text) for name, text in hostile.items()}
    assert time.perf_counter() - start < 60.0
    assert read["think_ends"].reason == "bad_format"
    for name in ("blank_lines", "headers", "openers", "braces", "box_spaces", "escapes", "long_box"):
        assert read[name] in (Verdict(0.0, "no_answer", None), Verdict(0.0, "no_answer", "")), name
    assert read["closers"] == "1" and read["text_before"] == "4" and read["nul_surrogates"] == "3"
    # Only the tail of an over-long header paragraph is searched; the box at its end is found.
    assert len(hostile["one_paragraph"]) > MAX_PARAGRAPH_CHARS and read["one_paragraph"] == "2"


@pytest.fixture(scope="module")
def scorers():
    with RewardScorer(num_workers=2, timeout_s=20.0) as dedupe, \
            RewardScorer(num_workers=1, timeout_s=20.0, dedupe=False) as plain:
        yield dedupe, plain


@pytest.mark.integration
def test_duplicates_get_the_verdict_verifying_them_would_give(scorers) -> None:
    dedupe, plain = scorers
    texts, golds = [], []
    for k in range(40):  # one late-budget batch: few distinct answers in many wrappings
        texts.append(answer(["12", "\\frac{1}{2}", "0.5", "13"][k % 4], before="thinking " * (k % 3)))
        golds.append(["12", "1/2", 0.5, 12][k % 4])
    texts += ["no marker", f"{THINK_END}\n\nno header", answer(""), answer("12") + THINK_END]
    golds += [12, 12, 12, 12]
    verdicts = dedupe.score(texts, golds)
    assert verdicts == plain.score(texts, golds)
    assert verdicts == [score_one(t, g) for t, g in zip(texts, golds)]
    assert [v.reason for v in verdicts[-4:]] == ["bad_format", "no_answer", "no_answer", "bad_format"]
    # Distinct (answer, normalised gold) pairs: ("12", 12), ("\frac{1}{2}", "1/2"), ("0.5", 0.5),
    # ("13", 12): 4 verifications for 40 answered outputs.
    assert dedupe.last_stats == BatchStats(items=44, answered=40, verified=4)
    assert plain.last_stats == BatchStats(items=44, answered=40, verified=40)
    assert dedupe.last_stats.fraction_saved == pytest.approx(36 / 40)
    assert plain.last_stats.fraction_saved == 0.0


@pytest.mark.integration
def test_the_same_answer_against_other_golds_is_verified_again(scorers) -> None:
    dedupe, _ = scorers
    verdicts = dedupe.score([answer("5")] * 4, [5, "5", 6, [6, 5]])
    assert [v.reason for v in verdicts] == ["correct", "correct", "wrong", "correct"]
    assert dedupe.last_stats.verified == 3  # 5 and "5" normalise to the same gold


@pytest.mark.integration
def test_a_duplicated_overrun_costs_one_timeout() -> None:
    with RewardScorer(num_workers=1, timeout_s=1.0) as pool:
        first = pool.pids[0]
        texts = [answer("9^{9^{9}}", before=f"try {k} ") for k in range(5)] + [answer("2"), answer("3")]
        verdicts = pool.score(texts, [42] * 5 + [2, 3])
        assert verdicts[:5] == [Verdict(0.0, "timeout", None)] * 5
        assert [v.reason for v in verdicts[5:]] == ["correct", "correct"]
        assert pool.last_stats.verified == 3
        assert pool.pids[0] != first  # exactly one worker was killed and replaced
