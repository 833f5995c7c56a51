"""Rows of a procedural task (`anytime.data.task_splits`): the training split a recipe names, and the
held-out split of the eval, disjoint from it."""

from __future__ import annotations

import json

import pytest

from anytime.config import load_recipe
from anytime.data.benchmarks import load_benchmark
from anytime.data.prompts import DataError, PromptRow
from anytime.data.sources import load_train_rows
from anytime.data.task_splits import TASK_EVAL_SEED, heldout_task_rows, train_task_rows
from anytime.tasks.reasoning_gym import as_task_gold, entries

pytestmark = pytest.mark.unit
pytest.importorskip("reasoning_gym")

CHAIN = "reasoning_gym:chain_sum"
# Two one-digit terms: 200 distinct problems, so any two splits share some.
SMALL = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def test_training_rows_are_generated_deterministically_by_seed():
    rows = train_task_rows(CHAIN, {}, size=20, seed=0)
    assert len(rows) == 20 and rows == train_task_rows(CHAIN, {}, size=20, seed=0)
    assert [r.problem for r in rows] != [r.problem for r in train_task_rows(CHAIN, {}, size=20, seed=1)]
    assert rows[0].id == "chain_sum-1000-0" and rows[0].problem.startswith("State the final answer")
    assert all(as_task_gold(json.loads(json.dumps(r.answer))) is not None for r in rows)   # JSON-able task golds


def test_the_held_out_split_drops_training_problems_and_repeats():
    train = {r.problem for r in train_task_rows(CHAIN, SMALL, size=60, seed=0)}
    drawn = [q for _, q, _ in entries("chain_sum", SMALL, TASK_EVAL_SEED, 50)]
    assert set(drawn) & train and len(set(drawn)) < len(drawn)   # the same 50 draws, unchecked, would overlap
    held = heldout_task_rows(CHAIN, SMALL, limit=50, seed=0, train_size=60)
    problems = [r.problem for r in held]
    assert len(held) == 50 and not set(problems) & train and len(set(problems)) == 50
    assert held == heldout_task_rows(CHAIN, SMALL, limit=50, seed=0, train_size=60)


def test_a_held_out_split_with_nothing_left_is_an_error():
    with pytest.raises(DataError, match="every held-out problem drawn is in the training split"):
        heldout_task_rows(CHAIN, {**SMALL, "max_digits": 1, "min_digits": 1}, limit=5, seed=0, train_size=3000)


def test_a_benchmark_named_after_the_task_is_its_held_out_split():
    rows = load_benchmark(CHAIN, limit=5, seed=2, task_config=SMALL, train_size=60)
    assert rows == heldout_task_rows(CHAIN, SMALL, limit=5, seed=2, train_size=60)
    assert all(r.id.startswith(f"chain_sum-{TASK_EVAL_SEED + 2}-") for r in rows)
    with pytest.raises(DataError, match="or reasoning_gym:<task>"):
        load_benchmark("aime2O24")


def test_a_training_recipe_naming_a_task_loads_its_rows():
    recipe = load_recipe(None, [f"data.train={CHAIN}", "data.task_size=32", "data.task_config={max_terms: 3}",
                                "eval.benchmarks=[reasoning_gym:chain_sum]"])
    rows = load_train_rows(recipe)
    assert len(rows) == 32 and sorted(rows, key=lambda r: r.id) == sorted(
        train_task_rows(CHAIN, {"max_terms": 3}, 32, 0), key=lambda r: r.id)
    assert rows != train_task_rows(CHAIN, {"max_terms": 3}, 32, 0)   # shuffled by trainer.seed
    assert all(r.answer["config"] == {"max_terms": 3} for r in rows)


def test_a_jsonl_recipe_still_loads_its_file(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps({"problem": f"what is {i}?", "answer": str(i)}) for i in range(4)))
    rows = load_train_rows(load_recipe(None, [f"data.train={path}", "data.shuffle=false"]))
    assert rows == [PromptRow(str(i), f"what is {i}?", str(i)) for i in range(4)]
