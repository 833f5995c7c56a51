"""The per-budget report (completed, completed_accuracy, cut, summary_length) from hand-built records:
exact values, the budget at which a trace counts as completed, records of older versions without
summary lengths (aggregated, written and rescored), the records' lengths taken from a rollout, and
the in-training eval's metric names."""

import csv
import json

import pytest
import torch

from anytime.evaluation.evaluate import rescore_dir, results_table, write_results
from anytime.evaluation.records import aggregate, read_samples, sample_records, write_samples
from anytime.evaluation.report import budget_report, ended_by

ANSWER = "</think>\n\n**Final Answer**\n\\boxed{{{}}}"
BUDGETS = [10, 20, 30]


def _record(index, scores, tokens, *, length, natural=False, eos=False, gold="7"):
    """A record with one entry per budget of BUDGETS; `scores[j]` and `tokens[j]` are the lists of
    its summaries' scores and lengths at budget j (`tokens=None`: a record of an older version)."""
    budgets = []
    for j, b in enumerate(BUDGETS):
        forced_zero = eos and b >= length   # EOS inside the thinking: 0 from its end on, as the rollout scores
        summaries = []
        for a, s in enumerate(scores[j]):
            summary = {"text": ANSWER.format(gold if s else "0"), "answer": gold if s else "0", "score": float(s),
                       "reason": "bad_format" if forced_zero else "correct" if s else "wrong"}
            if tokens is not None:
                summary["tokens"] = tokens[j][a]
            summaries.append(summary)
        budgets.append({"budget": b, "cut": min(b, length), "forced_zero": forced_zero, "summaries": summaries})
    return {"model": "m", "benchmark": "b", "index": index, "problem_id": f"p{index}", "problem": "?", "gold": gold,
            "sample": 0, "thinking_length": length, "natural_end": natural, "eos_end": eos, "budgets": budgets}


def _records(with_tokens=True):
    """Four traces: closed at 15, EOS at 20 (scored 0 from there), never ended (ran into 30), closed at 30."""
    def t(*per_budget):
        return [list(x) for x in per_budget] if with_tokens else None

    return [_record(0, [[0], [1], [1]], t([4], [5], [6]), length=15, natural=True),
            _record(1, [[1], [0], [0]], t([3], [3], [3]), length=20, eos=True),
            _record(2, [[0], [0], [1]], t([8], [8], [8]), length=30),
            _record(3, [[1], [1], [1]], t([5], [7], [9]), length=30, natural=True)]


@pytest.mark.unit
def test_report_values_per_budget():
    r = aggregate(_records(), BUDGETS)
    assert r["accuracy"] == [0.5, 0.5, 0.75]
    # budget 10: nothing ended; 20: the closed-at-15 and the EOS-at-20 traces; 30: those and the closed-at-30 one
    assert r["completed"] == [0.0, 0.5, 0.75]
    assert r["cut"] == [1.0, 0.5, 0.25]
    assert [c + k for c, k in zip(r["completed"], r["cut"])] == [1.0, 1.0, 1.0]
    assert r["completed_accuracy"] == [None, 0.5, 2 / 3]   # the EOS trace's summaries score 0 past its end
    assert r["summary_length"] == [5.0, 5.75, 6.5]
    assert budget_report(_records(), BUDGETS) == {k: r[k] for k in ("completed", "completed_accuracy", "cut",
                                                                     "summary_length")}
    with pytest.raises(ValueError, match="no sample records"):
        budget_report([], BUDGETS)


@pytest.mark.unit
def test_completed_accuracy_and_summary_length_count_every_summary():
    records = [_record(0, [[1, 0], [1, 1], [1, 1]], [[2, 4], [1, 1], [1, 3]], length=10, natural=True),
               _record(1, [[0, 0], [0, 1], [1, 1]], [[9, 9], [6, 2], [2, 2]], length=25, natural=True)]
    r = budget_report(records, BUDGETS)
    assert r["completed"] == [0.5, 0.5, 1.0]
    assert r["completed_accuracy"] == [0.5, 1.0, 1.0]
    assert r["summary_length"] == [6.0, 2.5, 2.0]


@pytest.mark.unit
def test_a_trace_counts_as_completed_from_its_own_end_on():
    budgets = [10, 19, 20, 21, 40]
    closed = {"thinking_length": 20, "natural_end": True, "eos_end": False}
    eos = {"thinking_length": 20, "natural_end": False, "eos_end": True}
    running = {"thinking_length": 40, "natural_end": False, "eos_end": False}   # stopped by the largest budget
    assert [ended_by(closed, b) for b in budgets] == [False, False, True, True, True]
    assert [ended_by(eos, b) for b in budgets] == [False, False, True, True, True]
    assert [ended_by(running, b) for b in budgets] == [False] * 5
    entries = [{"budget": b, "summaries": [{"score": 1.0, "tokens": 3}]} for b in budgets]
    for trace, done in ((closed, [0.0, 0.0, 1.0, 1.0, 1.0]), (running, [0.0] * 5)):
        r = budget_report([{**trace, "budgets": entries}], budgets)
        assert r["completed"] == done and r["cut"] == [1.0 - d for d in done]
        assert r["completed_accuracy"] == [1.0 if d else None for d in done]


@pytest.mark.unit
def test_records_without_summary_lengths_still_aggregate(tmp_path):
    old = _records(with_tokens=False)
    r = aggregate(old, BUDGETS)
    new = aggregate(_records(), BUDGETS)
    assert r["summary_length"] == [None, None, None]
    assert {k: v for k, v in r.items() if k != "summary_length"} == {k: v for k, v in new.items()
                                                                    if k != "summary_length"}
    # one older record among newer ones leaves its budgets uncounted rather than averaging a part
    assert aggregate(_records()[:3] + old[3:], BUDGETS)["summary_length"] == [None, None, None]
    results = {"budgets": BUDGETS, "models": {"m": {"b": r}}}
    write_results(results, tmp_path)
    with (tmp_path / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [row["summary_length"] for row in rows] == ["", "", ""]
    assert [row["completed_accuracy"] for row in rows] == ["", "0.500000", "0.666667"]
    assert [float(row["cut"]) for row in rows] == [1.0, 0.5, 0.25]
    table = (tmp_path / "results.md").read_text()
    assert "| m | b | 10 | 0.500 | 0.000 | – | 1.000 | – |" in table
    assert "| m | b | 30 | 0.750 | 0.750 | 0.667 | 0.250 | – |" in table
    assert json.loads((tmp_path / "results.json").read_text())["models"]["m"]["b"]["completed_accuracy"][0] is None
    assert (tmp_path / "accuracy_vs_budget.png").stat().st_size > 5000
    assert "| m | b | 20 | 0.500 | 0.500 | 0.500 | 0.500 | 5.8 |" in results_table(
        {"budgets": BUDGETS, "models": {"m": {"b": new}}})


@pytest.mark.integration
def test_samples_of_an_older_version_rescore(tmp_path):
    """A folder written before summaries carried their length: --rescore re-verifies it and adds the
    report, summary_length None."""
    old = _records(with_tokens=False)
    before = aggregate(old, BUDGETS)
    for key in ("completed", "completed_accuracy", "cut", "summary_length"):   # results.json of that version
        del before[key]
    (tmp_path / "results.json").write_text(json.dumps({"budgets": BUDGETS, "settings": {},
                                                        "models": {"m": {"b": {**before, "seconds": 1.5}}}}))
    write_samples(old, tmp_path / "samples.jsonl")
    results = rescore_dir(tmp_path, num_workers=1)
    r = results["models"]["m"]["b"]
    assert r["accuracy"] == [0.5, 0.5, 0.75] and r["seconds"] == 1.5
    assert (r["completed"], r["completed_accuracy"], r["summary_length"]) == \
        ([0.0, 0.5, 0.75], [None, 0.5, 2 / 3], [None, None, None])
    assert json.loads((tmp_path / "results.json").read_text())["models"]["m"]["b"] == r
    assert read_samples(tmp_path / "samples.jsonl") == old   # unchanged verdicts, no lengths made up


def _rollout():
    """One prompt, two traces (closed at 3 tokens; cut at both budgets), budgets {2, 4}, one summary each."""
    from anytime.batch.anytime_rollout import AnytimeRollout, padded
    from anytime.reward.verifier import REASONS

    summaries = [[50, 51, 2], [52], [53, 54, 55, 56], [57, 58]]
    return AnytimeRollout(
        budgets=[2, 4], golds=["1"], prompt_ids=torch.tensor([[1, 2]]), prompt_len=torch.tensor([2]),
        think_ids=torch.tensor([[[10, 11, 14, 0], [10, 11, 12, 13]]]), think_logprobs=torch.zeros(1, 2, 4),
        think_len=torch.tensor([[3, 4]]), natural_end=torch.tensor([[True, False]]),
        eos_end=torch.tensor([[False, False]]), cut=torch.tensor([[[2, 3], [2, 4]]]),
        forced_close=torch.tensor([[[True, False], [True, True]]]), prefix_group=torch.tensor([[[0, 1], [0, 1]]]),
        summary_ids=padded(summaries, torch.long, (1, 2, 2, 1)),
        summary_logprobs=padded([[0.0] * len(s) for s in summaries], torch.float32, (1, 2, 2, 1)),
        summary_len=torch.tensor([[[[3], [1]], [[4], [2]]]]),
        scores=torch.tensor([[[[0.0], [1.0]], [[1.0], [0.0]]]]),
        reasons=torch.tensor([[[[REASONS.index("wrong")], [REASONS.index("correct")]],
                               [[REASONS.index("correct")], [REASONS.index("wrong")]]]]),
        answers=["0", "1", "1", "0"], texts=["a", "b", "c", "d"], close_ids=(14,), header_ids=(90,))


@pytest.mark.unit
def test_records_carry_the_rollouts_summary_lengths():
    from anytime.data.prompts import PromptRow

    records = sample_records(_rollout(), [PromptRow(id="p0", problem="?", answer="1")])
    assert [[s["tokens"] for e in r["budgets"] for s in e["summaries"]] for r in records] == [[3, 1], [4, 2]]
    r = aggregate(records, [2, 4])
    assert r["summary_length"] == [3.5, 1.5]
    assert r["completed"] == [0.0, 0.5] and r["cut"] == [1.0, 0.5] and r["completed_accuracy"] == [None, 1.0]
    assert "thinking" not in records[0]
    # with a tokenizer's decode, each record holds its trace's text: its own length, not the padding
    decoded = sample_records(_rollout(), [PromptRow(id="p0", problem="?", answer="1")],
                             decode=lambda ids: ",".join(map(str, ids)))
    assert [r["thinking"] for r in decoded] == ["10,11,14", "10,11,12,13"]
    assert [{k: v for k, v in r.items() if k != "thinking"} for r in decoded] == records


@pytest.mark.unit
def test_in_training_metrics_name_every_budget():
    from anytime.evaluation.in_training import budget_metrics

    metrics = budget_metrics("synthetic", aggregate(_records(), BUDGETS), BUDGETS)
    assert metrics["eval/synthetic/completed@20"] == 0.5 and metrics["eval/synthetic/cut@10"] == 1.0
    assert metrics["eval/synthetic/completed_acc@30"] == 2 / 3 and metrics["eval/synthetic/summary_len@30"] == 6.5
    assert "eval/synthetic/completed_acc@10" not in metrics   # nothing completed by 10: no value, not a 0
    assert len(metrics) == 4 * 3 - 1


@pytest.mark.unit
def test_report_names_tell_two_checkpoints_of_one_step_apart():
    from anytime.evaluation.evaluate import short_names

    names = short_names(["runs/a/sft_model", "runs/a/checkpoints/step_20", "runs/b/checkpoints/step_20",
                         "HuggingFaceTB/SmolLM2-135M"])
    assert list(names.values()) == ["sft_model", "a/checkpoints/step_20", "b/checkpoints/step_20", "SmolLM2-135M"]
