"""The per-budget report beyond accuracy: at each budget, which traces had already ended on their own
and how well those answered, and how long the forced summaries ran.

Accuracy alone mixes two skills: answering well once the thinking is done, and answering well when
the thinking is cut short. `completed` / `cut` say how many traces are in each case at a budget and
`completed_accuracy` scores the first case alone (the cut case follows from the two). A summary that
keeps reasoning after the forced close instead of answering shows up as a long `summary_length`.

Everything here is computed from per-sample records (`anytime.evaluation.records`) only, so
`anytime eval --rescore` reproduces it; records written before summaries carried their token count
(`"tokens"`) still report, with `summary_length` None at the budgets they leave uncounted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

REPORT_KEYS = ("completed", "completed_accuracy", "cut", "summary_length")


def ended_by(record: Mapping[str, Any], budget: int) -> bool:
    """Whether the record's trace ended on its own (closed its thinking, or stopped on EOS) within
    `budget` thinking tokens. `thinking_length` counts the ending token, so a trace that ended at
    length L is complete at every budget b >= L and cut at every b < L; a trace that ran into the
    largest budget without ending is cut everywhere."""
    return bool(record["natural_end"] or record["eos_end"]) and record["thinking_length"] <= budget


def budget_report(records: Sequence[Mapping[str, Any]], budgets: Sequence[int]) -> dict[str, list[float | None]]:
    """Per budget (lists aligned with `budgets`): `completed`, the share of traces that ended on their
    own by the budget; `cut`, the share that did not (completed + cut = 1); `completed_accuracy`, the
    mean summary score of the completed traces (None where none completed); `summary_length`, the
    mean summary length in generated tokens (None where some summary has no recorded length).

    `records` must hold `budgets` in order (as `records.aggregate` checks)."""
    if not records:
        raise ValueError("no sample records to report on")
    n, width = len(records), len(budgets)
    done, done_score = [0] * width, [0.0] * width
    tokens, summaries, uncounted = [0] * width, [0] * width, [False] * width
    for record in records:
        for j, (budget, entry) in enumerate(zip(budgets, record["budgets"])):
            scores = [s["score"] for s in entry["summaries"]]
            if ended_by(record, budget):
                done[j] += 1
                done_score[j] += sum(scores) / len(scores)
            for s in entry["summaries"]:
                if "tokens" in s:
                    tokens[j] += s["tokens"]
                else:
                    uncounted[j] = True   # an older record: a mean over part of the summaries would mislead
            summaries[j] += len(scores)
    return {
        "completed": [d / n for d in done],
        "completed_accuracy": [s / d if d else None for s, d in zip(done_score, done)],
        "cut": [(n - d) / n for d in done],
        "summary_length": [None if u else t / k for t, k, u in zip(tokens, summaries, uncounted)],
    }
