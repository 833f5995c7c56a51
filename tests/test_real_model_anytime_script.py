"""eval/real_model_anytime.py and eval/anytime_cuts.py: the testbed's tables read what the runs wrote."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "eval"))

from anytime_cuts import answer_kind, changed_share, running_totals  # noqa: E402
from real_model_anytime import BUDGETS, VARIANTS, table  # noqa: E402

pytestmark = pytest.mark.unit


def run(seed: int, acc_after: list[float], anytime_after: float) -> dict:
    report = {"completed": [0.0, 0.0, 0.4, 0.7], "cut": [1.0, 1.0, 0.6, 0.3], "summary_len": [4.0] * 4,
              "think_len": 25.0}
    return {"seed": seed, "before": report | {"acc": [0.05, 0.2, 0.3, 0.4], "anytime": 0.25},
            "after": report | {"acc": acc_after, "anytime": anytime_after},
            "train_think_len": [25.0] * 20, "train_score": [0.3] * 20, "wall_min": 9.0, "s_per_step": 24.0, "peak_rss_gb": 9.4,
            "train_acc": {str(b): [0.1] * 10 + [0.3] * 10 for b in BUDGETS}}


def test_paired_differences_are_per_seed_and_per_budget():
    results = {"grpo": [run(0, [0.0, 0.1, 0.3, 0.4], 0.2), run(1, [0.1, 0.2, 0.3, 0.4], 0.3)],
               "brpo": [run(0, [0.1, 0.2, 0.3, 0.4], 0.3), run(1, [0.2, 0.3, 0.3, 0.4], 0.4)]}
    lines = table(results)
    section = lines[next(i for i, line in enumerate(lines) if line.startswith("### Paired differences")):]
    paired = next(line for line in section if line.startswith("| brpo | 0,1 |"))
    cells = [c.strip() for c in paired.strip("|").split("|")]
    # brpo beats grpo by 0.1 at 8 and 16 on both seeds (no spread), ties at 24 and 32
    assert cells[2:] == ["+0.100 ± 0.000", "+0.100 ± 0.000", "+0.000 ± 0.000", "+0.000 ± 0.000", "+0.100 ± 0.000"]
    assert lines[-1] == "| brpo | 0.10 → 0.30 | 0.10 → 0.30 | 0.10 → 0.30 | 0.10 → 0.30 |"
    assert len(BUDGETS) == 4 and {"brpo", "grpo", "ar-uniform", "no-decoupled"} <= set(VARIANTS)


def test_a_summary_answer_is_the_result_a_running_total_or_neither():
    totals = running_totals("3 + 5 - 1 - 2")
    assert totals == [8, 7, 5]
    assert [answer_kind(a, totals) for a in ("5", "8", "7", "6", "", None, "5 + 1")] == [
        "final", "running", "running", "other", "other", "other", "other"]
    assert running_totals("4 - 7") == [-3] and answer_kind("-3", [-3]) == "final"


def test_changed_share_pairs_samples_by_problem_and_draw():
    before = [{"problem_id": "a", "sample": 0, "thinking_length": 25},
              {"problem_id": "a", "sample": 1, "thinking_length": 17}]
    after = [{"problem_id": "a", "sample": 1, "thinking_length": 17},
             {"problem_id": "a", "sample": 0, "thinking_length": 24}]
    assert changed_share(before, after) == 0.5
