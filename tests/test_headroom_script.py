"""eval/headroom.py: the no-filler reference policy's accuracy per budget on the trainer's held-out
synthetic set (the ceiling the README sets the quickstart's gains against)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "eval"))

from headroom import GUESS, format_ceiling, quickstart_tokenizer  # noqa: E402

from anytime.data.benchmarks import load_benchmark  # noqa: E402

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokenizer():
    return quickstart_tokenizer()


def test_the_ceiling_is_a_guess_below_every_trace_and_certain_above(tokenizer):
    rows = load_benchmark("synthetic", limit=50, seed=0, synthetic_ops=(3, 6))
    acc = format_ceiling(rows, tokenizer, [0, 16, 32, 48, 10_000], (3, 6))
    assert acc[0] == pytest.approx(GUESS) and acc[10_000] == 1.0
    # a 3-step trace ("1: 3+6=9" a line) needs more than 16 tokens; longer budgets fit more of them
    assert acc[16] == pytest.approx(GUESS) and GUESS < acc[32] <= acc[48] < 1.0


def test_a_row_that_is_not_its_ids_problem_is_refused(tokenizer):
    rows = load_benchmark("synthetic", limit=3, seed=0, synthetic_ops=(3, 6))
    bad = [rows[0].__class__(rows[0].id, rows[1].problem, rows[1].answer)]
    with pytest.raises(ValueError, match="not the synthetic problem"):
        format_ceiling(bad, tokenizer, [64], (3, 6))


def test_an_ablation_is_set_against_the_ceiling_under_each_protocol(tmp_path, monkeypatch, capsys):
    import json

    import headroom

    results = tmp_path / "results.json"
    results.write_text(json.dumps({"per_seed": {"0": {"_eval": {
        "sampled": {"warm start": [0.0, 0.1, 0.3, 0.6], "GRPO": [0.1, 0.3, 0.7, 1.0]},
        "greedy": {"warm start": [0.1, 0.3, 0.6, 1.0], "GRPO": [0.1, 0.3, 0.7, 1.0]}}}}}))
    monkeypatch.setattr(sys, "argv", ["headroom.py", "--seeds", "0", "--ablation", str(results)])
    assert headroom.main() == 0
    lines = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines())
    ceiling = float(lines["seed0_ceiling_anytime"])
    assert float(lines["seed0_sampled_warm_start_anytime"]) == 0.25 and float(lines["seed0_greedy_warm_start_anytime"]) == 0.5
    assert float(lines["seed0_sampled_headroom"]) == pytest.approx(ceiling - 0.25, abs=1e-3)
    assert lines["seed0_greedy_GRPO_anytime"].startswith("0.525 (")
