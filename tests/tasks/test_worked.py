"""Worked solutions: every line of a trace is one right step, the last result is the task's answer,
and the warm start's pairs are the training split's problems with those traces."""

from __future__ import annotations

import re

import pytest

from anytime.tasks.reasoning_gym import TaskError, decode_entry, entries
from anytime.tasks.worked import chain_sum_running_totals, warm_start_completion, worked_solution

pytestmark = pytest.mark.unit

CONFIG = {"min_terms": 4, "max_terms": 6, "min_digits": 1, "max_digits": 2}


def test_running_totals_are_right_step_by_step_and_end_on_the_answer():
    for _, _, gold in entries("chain_sum", CONFIG, seed=3, size=50):
        entry = decode_entry(gold["entry"])
        lines = chain_sum_running_totals(entry).splitlines()
        assert len(lines) == entry["metadata"]["num_terms"] - 1
        total = None
        for line in lines:
            a, op, b, result = re.fullmatch(r"(-?\d+) ([+-]) (\d+) = (-?\d+)", line).groups()
            assert total is None or int(a) == total          # each step starts from the last result
            assert int(result) == (int(a) + int(b) if op == "+" else int(a) - int(b))
            total = int(result)
        assert str(total) == str(entry["answer"])


def test_a_wrong_answer_or_an_unknown_task_is_refused_by_name():
    entry = {"answer": "5", "metadata": {"expression": "1 + 2 + 3"}}
    with pytest.raises(TaskError, match="running totals give 6, the entry's answer is 5"):
        chain_sum_running_totals(entry)
    with pytest.raises(TaskError, match="worked solutions for \\['chain_sum'\\] only, not 'products'"):
        worked_solution("products", entry)


def test_the_completion_closes_the_thinking_and_boxes_the_answer_once():
    header = "\n\n**Final Answer**\n\\boxed{"
    assert warm_start_completion("1 + 2 = 3\n", "3", "</think>", header) == "1 + 2 = 3\n</think>" + header + "3}"
    assert warm_start_completion("t\n", "3", "</think>", "\n\nAnswer: ") == "t\n</think>\n\nAnswer: \\boxed{3}"


def test_the_warm_start_trains_on_the_training_split_with_worked_solutions(tiny_model_dir):
    from transformers import AutoTokenizer

    from anytime.config import load_recipe
    from anytime.data.task_splits import train_task_rows
    from anytime.trainer.sft import sft_pairs
    from tests.helpers import QUICKSTART

    recipe = load_recipe(QUICKSTART, ["data.train=reasoning_gym:chain_sum", f"data.task_config={CONFIG}",
                                      "data.task_size=6", "data.max_prompt_len=256"])
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    pairs = sft_pairs(recipe, tok)
    rows = train_task_rows("reasoning_gym:chain_sum", CONFIG, 6, recipe.trainer.seed)
    assert len(pairs) == len(rows) == 6
    s = recipe.summary
    for (prompt, completion), row in zip(pairs, rows):
        entry = decode_entry(row.answer["entry"])
        assert completion[-1] == tok.eos_token_id
        assert tok.decode(completion[:-1]) == warm_start_completion(chain_sum_running_totals(entry),
                                                                    str(entry["answer"]), s.think_end, s.header)
        assert row.problem in tok.decode(prompt)
