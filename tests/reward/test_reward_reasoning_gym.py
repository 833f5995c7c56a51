"""Procedural-task golds through the verifier's worker pool: each task's own scorer judges the boxed
answer, math-verify still judges plain golds, in one batch."""

from __future__ import annotations

import json

import pytest

from anytime.data.task_splits import heldout_task_rows, train_task_rows
from anytime.reward.verifier import THINK_END, RewardScorer, Verdict, score_one

pytest.importorskip("reasoning_gym")

HEADER = f"{THINK_END}\n\n**Final Answer**\n"


def answer(content: str) -> str:
    return f"thinking\n\n{HEADER}\\boxed{{{content}}}"


@pytest.mark.integration
def test_task_golds_are_judged_by_the_task_scorer_in_the_workers(tmp_path):
    rows = train_task_rows("reasoning_gym:chain_sum", {"min_terms": 2, "max_terms": 3}, size=6, seed=0)
    rows += heldout_task_rows("reasoning_gym:countdown", {}, limit=2, seed=0, train_size=0)
    marker = tmp_path / "ran"
    hostile = {
        "code": f"__import__('pathlib').Path({str(marker)!r}).write_text('x')",
        "tower": "9^{9^{9^{9}}}", "power": "9**9**9**9", "garbage": "}{\\frac{" + "(" * 2000,
        "huge": "1" * 4000, "nul": "\x00" * 50 + "7", "words": "the answer is obviously right",
    }
    texts, golds, expected = [], [], []
    for row in rows:
        gold = json.loads(json.dumps(row.answer))   # as an eval-samples file gives it back
        entry_answer = gold["answer"]
        texts += [answer(entry_answer), answer(f"{entry_answer} "), *(answer(h) for h in hostile.values())]
        expected += [1.0, 1.0] + [0.0] * len(hostile)
        golds += [gold] * (2 + len(hostile))
        if row.answer["task"].endswith("chain_sum"):
            expression = row.problem.split(": ", 1)[1].rstrip(" =")
            texts += [answer(expression), answer(f"{expression} = {entry_answer}"), f"no thinking end {entry_answer}"]
            expected += [0.0, 0.0, 0.0]
            golds += [gold] * 3
    texts += [answer("6 - 2"), answer("6 - 2")]   # the same text against a plain gold: math-verify's verdict
    golds += ["4", {"task": "reasoning_gym:chain_sum", "config": {}, "answer": "4",
                    "entry": repr({"question": "6 - 2 =", "answer": "4", "metadata": {}})}]
    expected += [1.0, 0.0]
    with RewardScorer(num_workers=2, timeout_s=10.0) as scorer:
        verdicts = scorer.score(texts, golds)
        assert [v.score for v in verdicts] == expected
        assert not marker.exists()
        assert {v.reason for v, e in zip(verdicts, expected) if not e} <= {"wrong", "no_answer", "bad_format",
                                                                            "error", "timeout"}
        assert verdicts[-1] == Verdict(0.0, "wrong", "6 - 2") and verdicts[-2].reason == "correct"
        assert scorer.last_stats.verified < scorer.last_stats.answered   # identical (answer, gold) pairs once
        # A gold naming a refused task, or a broken entry, is an error, not a crash of the batch.
        broken = [{"task": "reasoning_gym:simple_integration", "config": {}, "entry": repr({"answer": "x"})},
                  {"task": "reasoning_gym:chain_sum", "config": {}, "entry": "{'answer': "}]
        assert [v.reason for v in scorer.score([answer("x"), answer("4")], broken)] == ["error", "error"]
        with pytest.raises(ValueError, match=r"golds\[0\]: a procedural gold needs"):
            scorer.score([answer("4")], [{"task": "reasoning_gym:chain_sum", "entry": {"answer": "4"}}])
    for i in (0, 2, len(texts) - 1):
        assert score_one(texts[i], golds[i]).score == expected[i]
