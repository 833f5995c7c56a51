"""Worked solutions of procedural tasks: a step-by-step reference trace for a reasoning-gym entry, the
thinking a supervised warm start teaches (`sft.steps` with `data.train: reasoning_gym:<task>`).

A trace is written so that a cut anywhere in it holds the work done so far: each line is one step
with its partial result, so thinking longer gets further and a summary at a cut can build on it.

- `chain_sum`: running totals, one operation a line (`4 - 1 = 3`, `3 - 7 = -4`, ...).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from anytime.tasks.reasoning_gym import PREFIX, TaskError


def running_totals(expression: str) -> list[int]:
    """The totals after each operation of `a op b op c ...`, left to right (`+` and `-` only)."""
    tokens = expression.split()
    if len(tokens) < 3 or len(tokens) % 2 == 0 or any(op not in "+-" for op in tokens[1::2]):
        raise TaskError(f"{PREFIX}chain_sum: cannot write running totals of {expression!r}")
    total, totals = int(tokens[0]), []
    for op, term in zip(tokens[1::2], tokens[2::2]):
        total = total + int(term) if op == "+" else total - int(term)
        totals.append(total)
    return totals


def chain_sum_running_totals(entry: Mapping[str, Any]) -> str:
    """`a op b = r` per line, from left to right, over the entry's expression (`+` and `-` only)."""
    expression = str(entry["metadata"]["expression"])
    tokens, totals = expression.split(), running_totals(expression)
    if str(totals[-1]) != str(entry["answer"]):
        raise TaskError(f"{PREFIX}chain_sum: running totals give {totals[-1]}, the entry's answer is {entry['answer']}")
    starts = [int(tokens[0]), *totals[:-1]]
    lines = [f"{a} {op} {term} = {r}" for a, op, term, r in zip(starts, tokens[1::2], tokens[2::2], totals)]
    return "\n".join(lines) + "\n"


WORKED: dict[str, Callable[[Mapping[str, Any]], str]] = {"chain_sum": chain_sum_running_totals}


def worked_solution(task: str, entry: Mapping[str, Any]) -> str:
    """The reference thinking of one entry of reasoning-gym task `task`."""
    if task not in WORKED:
        raise TaskError(f"the supervised warm start has worked solutions for {sorted(WORKED)} only, not {task!r}: "
                        "set sft.steps: 0, or train on one of those")
    return WORKED[task](entry)


def warm_start_completion(thinking: str, answer: str, think_end: str, header: str) -> str:
    """The assistant text after the generation prompt: thinking, its end marker, the answer header and
    the boxed answer (the header may open the box itself)."""
    boxed = f"{answer}}}" if header.endswith("\\boxed{") else f"\\boxed{{{answer}}}"
    return f"{thinking}{think_end}{header}{boxed}"
