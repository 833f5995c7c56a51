"""Procedural tasks from reasoning-gym (`anytime.tasks.reasoning_gym`): names, knobs, golds and the
task's own scorer, in this process."""

from __future__ import annotations

import inspect
import json
import re
import sys

import pytest

from anytime.tasks.reasoning_gym import (EVALUATING_SCORERS, TaskError, TaskGold, TaskScorer, as_task_gold, check_task,
                                      decode_entry, encode_entry, entries, make_dataset, make_gold, task_name)

pytestmark = pytest.mark.unit
reasoning_gym = pytest.importorskip("reasoning_gym")

# A chain_sum entry as the generator writes one (its scorer reads `answer`).
SIX_MINUS_TWO = {"question": "State the final answer to the following arithmetic problem: 6 - 2 =", "answer": "4",
                 "metadata": {"source_dataset": "chain_sum", "source_index": 0, "num_terms": 2, "num_digits": 1,
                              "expression": "6 - 2", "difficulty": {"num_terms": (2, 6), "num_digits": (1, 4)}}}


def _gold(name, entry, config=None):
    return as_task_gold(json.loads(json.dumps(make_gold(name, config or {}, entry))))   # as read back from a file


def _chain_value(expression):
    """`"12 - 5 + 3"` -> 10."""
    tokens = expression.split()
    return int(tokens[0]) + sum(int(x) if op == "+" else -int(x) for op, x in zip(tokens[1::2], tokens[2::2]))


def test_task_names_are_read_from_the_source_string():
    assert task_name("reasoning_gym:chain_sum") == "chain_sum"
    assert task_name("synthetic") is None and task_name("data/train.jsonl") is None and task_name("aime24") is None


def test_an_unknown_task_names_the_key_and_the_closest_tasks():
    with pytest.raises(TaskError, match=r"`data.train`: 'reasoning_gym:chain_summ' is not a reasoning-gym task "
                                        r"\(did you mean 'reasoning_gym:chain_sum'"):
        check_task("chain_summ", "data.train")
    with pytest.raises(TaskError, match="`eval.benchmarks`"):
        check_task("no_such_task_at_all", "eval.benchmarks")


def test_a_missing_package_says_which_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)   # `import reasoning_gym` now raises ImportError
    with pytest.raises(TaskError, match=r"`data.train`: .*pip install 'anytime\[reasoning-gym\]'"):
        check_task("chain_sum", "data.train")


def test_bad_knobs_name_the_key_and_the_task_knobs():
    with pytest.raises(TaskError, match=r"`data.task_config` of reasoning_gym:chain_sum: .*max_termz.*min_terms, "
                                        r"max_terms"):
        make_dataset("chain_sum", {"max_termz": 3}, seed=0, size=1)
    with pytest.raises(TaskError, match="not valid: max_terms must be >= min_terms"):
        make_dataset("chain_sum", {"min_terms": 5, "max_terms": 2}, seed=0, size=1)
    with pytest.raises(TaskError, match=r"sets \['seed'\]"):
        make_dataset("chain_sum", {"seed": 3}, seed=0, size=1)


def test_entries_are_deterministic_by_seed_and_follow_the_knobs():
    config = {"min_terms": 3, "max_terms": 3, "min_digits": 2, "max_digits": 2}
    first = list(entries("chain_sum", config, seed=7, size=5))
    assert first == list(entries("chain_sum", config, seed=7, size=5))
    assert [q for _, q, _ in first] != [q for _, q, _ in entries("chain_sum", config, seed=8, size=5)]
    for _, question, gold in first:
        entry = decode_entry(gold["entry"])
        assert entry["question"] == question and entry["metadata"]["num_terms"] == 3
        assert gold["task"] == "reasoning_gym:chain_sum" and gold["config"] == config
        assert gold["answer"] == str(_chain_value(entry["metadata"]["expression"]))   # the sum itself


def test_entries_round_trip_exactly_through_a_json_file():
    """ARC boards are tuples: as JSON they come back as lists and the task's `==` rejects its own
    answer; the gold's literal keeps them."""
    _, _, gold = next(entries("arc_agi", {}, seed=0, size=1))
    dataset = reasoning_gym.create_dataset("arc_agi", seed=0, size=1)
    entry = dataset[0]
    assert dataset.score_answer(entry["answer"], json.loads(json.dumps(entry))) < 1
    assert decode_entry(json.loads(json.dumps(gold))["entry"]) == entry
    assert TaskScorer()(entry["answer"], as_task_gold(json.loads(json.dumps(gold)))) == 1.0
    with pytest.raises(TaskError, match="cannot be written as plain literals"):
        encode_entry({"question": "q", "answer": "1", "metadata": {"x": float("nan")}}, "chain_sum")
    with pytest.raises(TaskError, match="cannot be written as plain literals"):
        encode_entry({"question": "q", "answer": "1", "metadata": {"x": object()}}, "chain_sum")


def test_task_golds_are_hashable_and_other_golds_are_left_alone():
    gold = _gold("chain_sum", SIX_MINUS_TWO)
    assert isinstance(gold, TaskGold) and gold == _gold("chain_sum", SIX_MINUS_TWO) and hash(gold) == hash(gold)
    assert as_task_gold("4") is None and as_task_gold(["1", "2"]) is None and as_task_gold({"answer": "4"}) is None
    with pytest.raises(ValueError, match="needs a `config` mapping and an `entry` literal"):
        as_task_gold({"task": "reasoning_gym:chain_sum", "entry": {"answer": "4"}})


def test_the_task_scorer_pays_the_value_not_the_restated_question():
    scorer, gold = TaskScorer(), _gold("chain_sum", SIX_MINUS_TWO)
    assert scorer("4", gold) == 1.0
    assert scorer("6 - 2", gold) == 0.0          # math-verify would evaluate it to 4 and pay it
    assert 0 < scorer("6 - 2 = 4", gold) < 1     # reasoning-gym's partial credit: the verifier pays only full credit


def test_a_product_is_scored_as_the_task_scores_it():
    dataset = reasoning_gym.create_dataset("products", seed=0, size=1)
    entry = {**dataset[0], "question": "Solve the following multiplication: 6 * 2. Give only the result as your "
                                       "final answer.", "answer": "12"}
    scorer, gold = TaskScorer(), _gold("products", entry)
    for answer in ("12", "6 * 2", "6 * 2 = 12", "12.0", "twelve"):
        assert scorer(answer, gold) == dataset.score_answer(answer, entry)
    assert scorer("12", gold) == 1.0 and scorer("6 * 2", gold) == 0.0 and 0 < scorer("6 * 2 = 12", gold) < 1


def test_an_answer_that_is_code_never_runs(tmp_path):
    """countdown's scorer hands the answer to sympy.parse_expr, i.e. to eval: the guard lets only
    arithmetic through, so the task is usable and its right answers still score."""
    marker = tmp_path / "ran"
    payload = f"__import__('pathlib').Path({str(marker)!r}).write_text('x')"
    dataset = reasoning_gym.create_dataset("countdown", seed=0, size=1)
    entry = dataset[0]
    dataset.score_answer(payload, entry)
    assert marker.exists()   # what the scorer does with such an answer on its own
    marker.unlink()
    scorer, gold = TaskScorer(), _gold("countdown", entry)
    assert scorer(payload, gold) == 0.0 and not marker.exists()
    assert scorer(entry["answer"], gold) == 1.0 and scorer("9**9**9", gold) == 0.0
    with pytest.raises(TaskError, match=r"`data.train`: the scorer of reasoning_gym:simple_integration runs the "
                                        r"model's answer as Python code"):
        check_task("simple_integration", "data.train")


def test_every_scorer_that_evaluates_text_is_listed():
    """Read each task's `score_answer` for eval and its sympy forms: a reasoning-gym version with a
    new one fails here until it is guarded or refused. number_sorting evals its own gold only."""
    code = re.compile(r"(?<![\w.])(eval|exec|parse_expr|sympify|simplify)\s*\(|\b(sp|sympy)\.(parse_expr|sympify)\(")
    evaluating = {name for name, (cls, _) in reasoning_gym.factory.DATASETS.items()
                  if code.search(inspect.getsource(cls.score_answer))}
    assert "countdown" in evaluating and evaluating - {"number_sorting"} <= set(EVALUATING_SCORERS)
