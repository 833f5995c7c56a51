"""eval/warm_start_scan.py: what makes a candidate task a testbed where the budget binds."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "eval"))

from warm_start_scan import CANDIDATES, fits, table  # noqa: E402

from anytime.tasks.reasoning_gym import make_dataset  # noqa: E402

pytestmark = pytest.mark.unit


def result(accuracy: list[float], cut_at_smallest: float) -> dict:
    return {"budgets": [6, 48], "accuracy": accuracy, "cut": [cut_at_smallest, 0.0],
            "gain": accuracy[-1] - accuracy[0], "top": accuracy[-1], "cut_at_smallest": cut_at_smallest}


def test_a_testbed_needs_gain_room_and_traces_longer_than_the_smallest_budget():
    assert fits(result([0.05, 0.30], 0.9))
    assert not fits(result([0.15, 0.30], 0.9))     # thinking longer helps too little
    assert not fits(result([0.05, 0.90], 0.9))     # no room left to learn
    assert not fits(result([0.05, 0.30], 0.4))     # most traces end before the smallest budget
    rows = table({"a": result([0.05, 0.30], 0.9), "b": result([0.05, 0.90], 0.9)}).splitlines()
    assert rows[2].endswith("| yes |") and rows[3].endswith("| no |")


def test_every_candidate_is_a_valid_chain_sum_config():
    for config in CANDIDATES.values():
        make_dataset("chain_sum", config, seed=0, size=2)
