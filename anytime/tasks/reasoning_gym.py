"""Procedural tasks with their own verifiers, from the reasoning-gym library (an optional extra:
`pip install 'anytime[reasoning-gym]'`).

A recipe names one as `data.train: reasoning_gym:<task>` (e.g. `reasoning_gym:chain_sum`); the
task's generator makes problems from a seed, and the task's own `score_answer` judges an answer.
This module is the only place that touches the library, and it imports it lazily.

Scoring needs the dataset entry the problem came from (question, answer, metadata), so the gold
of a task row is a small JSON-able mapping (`make_gold`): the task name, its config, and the entry
written as a Python literal. A literal, not JSON: entries hold tuples (ARC boards) that JSON would
turn into lists, and the scorers compare with `==`; `ast.literal_eval` reads literals back exactly
and runs no code, so a gold read back from an eval-samples file is safe to decode. The verifier
(`anytime.reward.verifier`) turns such a gold into a hashable `TaskGold` in the parent and scores
it with a `TaskScorer` inside its killable worker processes, since the scorers parse model text.

Model text is untrusted, and some reasoning-gym scorers run the answer as Python (`eval`, or
`sympy.parse_expr`, which calls it): `EVALUATING_SCORERS` lists them. Those whose answers are plain
arithmetic get a guard (an answer with anything else scores 0 before the scorer sees it: without
names there is no call to make); the rest are refused by name.

A score counts only at full credit: reasoning-gym's default scorer pays `len(gold)/len(answer)`
when the gold is a substring of the answer, which rewards restating the question with its result
(`6 - 2 = 4` gets 1/9) and padding; the anytime objective verifies a summary as right or wrong.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import json
import numbers
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

PREFIX = "reasoning_gym:"
EXTRA = "reasoning-gym"
INSTALL_HINT = f"pip install 'anytime[{EXTRA}]' (or pip install reasoning-gym==0.1.25)"
# A reasoning-gym score at or above this is a correct answer (scorers return exactly 1.0 for one).
FULL_CREDIT = 1.0 - 1e-9
# Keys of `create_dataset` that the split sets itself (seed: trainer.seed; size: data.task_size).
_SPLIT_KEYS = ("seed", "size")
_CACHE_SIZE = 4096
# Digits, + - * / and parentheses, no `**` (9**9**9 is a denial of service, if a killable one).
_ARITHMETIC = re.compile(r"(?!.*\*\*)[0-9\s+\-*/().]+", re.DOTALL)
# The scorers of reasoning-gym 0.1.25 that evaluate the model's answer as Python, found by reading
# the package and confirmed by scoring an answer that writes a file against every task (a test
# reads each scorer's source for eval and friends, so that a new one cannot slip past): the task
# -> the pattern an answer must match before its scorer sees it, or None where no pattern keeps
# the scorer's input harmless (integrals and polynomials take names; the list tasks eval to give
# partial credit, which the verifier does not pay anyway), which refuses the task.
EVALUATING_SCORERS: Mapping[str, re.Pattern[str] | None] = MappingProxyType({
    "countdown": _ARITHMETIC, "puzzle24": _ARITHMETIC,
    "binary_matrix": None, "intermediate_integration": None, "n_queens": None, "polynomial_multiplication": None,
    "simple_integration": None, "spiral_matrix": None, "string_insertion": None,
})


class TaskError(ValueError):
    """A procedural task that cannot be used as given; the message names the key to change."""


def task_name(source: str) -> str | None:
    """`"reasoning_gym:chain_sum"` -> `"chain_sum"`; None for any other data source or benchmark."""
    return source[len(PREFIX):] if isinstance(source, str) and source.startswith(PREFIX) else None


def _library() -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise TaskError(f"procedural tasks ({PREFIX}<task>) need the reasoning-gym package: {INSTALL_HINT}") from None
    return reasoning_gym


def task_names() -> list[str]:
    """Every task reasoning-gym registers, sorted."""
    return sorted(_library().factory.DATASETS)


def check_task(name: str, key: str) -> None:
    """An error naming `key` (e.g. `data.train`), with the closest task names, unless `name` is a task."""
    try:
        names = task_names()
    except TaskError as exc:
        raise TaskError(f"`{key}`: {exc}") from None
    if name in names:
        if name in EVALUATING_SCORERS and EVALUATING_SCORERS[name] is None:
            raise TaskError(f"`{key}`: the scorer of {PREFIX}{name} runs the model's answer as Python code (eval or "
                            "sympy.parse_expr); model output is untrusted, so this task is not supported")
        return
    close = difflib.get_close_matches(name, names, n=3)
    hint = f" (did you mean {', '.join(repr(PREFIX + c) for c in close)}?)" if close else ""
    raise TaskError(f"`{key}`: {PREFIX + name!r} is not a reasoning-gym task{hint}; the tasks are "
                    f"{', '.join(names)}")


def config_fields(name: str) -> list[str]:
    """The difficulty knobs of a task (its config dataclass' fields, less seed and size)."""
    config_cls = _library().factory.DATASETS[name][1]
    return [f.name for f in dataclasses.fields(config_cls) if f.name not in _SPLIT_KEYS]


def make_dataset(name: str, config: Mapping[str, Any], seed: int, size: int, key: str = "data.train") -> Any:
    """The task's generator with `config` (its knobs), drawing `size` problems from `seed`; errors
    name `key` for an unknown task and `data.task_config` for bad knobs."""
    check_task(name, key)
    clash = [k for k in _SPLIT_KEYS if k in config]
    if clash:
        raise TaskError(f"`data.task_config` sets {clash}: the split sets the seed (from trainer.seed) and the "
                        "size (data.task_size, eval.limit) itself; drop them")
    try:
        return _library().create_dataset(name, seed=seed, size=size, **config)
    except TypeError as exc:
        raise TaskError(f"`data.task_config` of {PREFIX}{name}: {exc}; the task's knobs are "
                        f"{', '.join(config_fields(name))}") from None
    except (AssertionError, ValueError) as exc:   # the config's own validate()
        raise TaskError(f"`data.task_config` of {PREFIX}{name} is not valid: {exc or type(exc).__name__}") from None


# ----------------------------------------------------------------------------- golds


def _plain(value: Any) -> Any:
    """`value` in builtin types only (numpy strings and numbers are subclasses of str/int/float), so
    that its repr is a literal."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return str(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, set):   # an empty one has no literal: `encode_entry` then refuses the entry
        return {_plain(v) for v in value}
    raise TypeError(f"{type(value).__name__} value {value!r:.60}")


def encode_entry(entry: Mapping[str, Any], task: str) -> str:
    """A dataset entry as a Python literal that `decode_entry` reads back equal to it."""
    try:
        plain = _plain(entry)
        text = repr(plain)
        exact = ast.literal_eval(text) == plain
    except (TypeError, ValueError, SyntaxError) as exc:
        exact, text = False, f"{type(exc).__name__}: {exc}"
    if not exact:
        raise TaskError(f"{PREFIX}{task}: a generated entry holds values that cannot be written as plain literals "
                        f"({text:.120}); this task is not supported")
    return text


def decode_entry(text: str) -> dict[str, Any]:
    entry = ast.literal_eval(text)
    if not isinstance(entry, dict):
        raise ValueError(f"a procedural gold's entry must be a mapping, got {type(entry).__name__}")
    return entry


def make_gold(name: str, config: Mapping[str, Any], entry: Mapping[str, Any]) -> dict[str, Any]:
    """The gold of a task row: what the task's scorer needs, JSON-able (eval-samples files keep
    it); `answer` is there for people reading those files, the scorer reads the entry."""
    return {"task": PREFIX + name, "config": dict(config), "entry": encode_entry(entry, name),
            "answer": None if entry.get("answer") is None else str(entry["answer"])}


@dataclass(frozen=True)
class TaskGold:
    """A procedural gold as it travels to the verifier's workers: hashable, so identical answers
    to one problem are verified once."""

    task: str     # the reasoning-gym name, e.g. "chain_sum"
    config: str   # the config as canonical JSON
    entry: str    # the entry as a Python literal (`encode_entry`)


def as_task_gold(gold: object) -> TaskGold | None:
    """The `TaskGold` of a procedural gold (a mapping tagged with `task: reasoning_gym:<name>`),
    None for any other gold; a malformed procedural gold is a ValueError."""
    if not isinstance(gold, Mapping) or task_name(gold.get("task")) is None:   # type: ignore[arg-type]
        return None
    config, entry = gold.get("config", {}), gold.get("entry")
    if not isinstance(config, Mapping) or not isinstance(entry, str):
        raise ValueError(f"a procedural gold needs a `config` mapping and an `entry` literal, got {gold!r:.120}")
    return TaskGold(task_name(gold["task"]), json.dumps(config, sort_keys=True), entry)   # type: ignore[arg-type]


def is_full_credit(score: float) -> bool:
    return score >= FULL_CREDIT


class TaskScorer:
    """Scores answers against `TaskGold`s with each task's own `score_answer`. Keeps one dataset per
    (task, config) and the decoded entries; built once per verifier worker."""

    def __init__(self) -> None:
        self._datasets: dict[tuple[str, str], Any] = {}
        self._entries: dict[str, dict[str, Any]] = {}

    def __call__(self, answer: str, gold: TaskGold) -> float:
        guard = EVALUATING_SCORERS.get(gold.task)
        if guard is not None and not guard.fullmatch(answer):
            return 0.0   # not plain arithmetic: this task's scorer would run it as code
        key = (gold.task, gold.config)
        if key not in self._datasets:
            self._datasets[key] = make_dataset(gold.task, json.loads(gold.config), seed=0, size=1)
        if gold.entry not in self._entries:
            if len(self._entries) >= _CACHE_SIZE:
                self._entries.clear()
            self._entries[gold.entry] = decode_entry(gold.entry)
        return float(self._datasets[key].score_answer(answer, self._entries[gold.entry]))


def entries(name: str, config: Mapping[str, Any], seed: int, size: int,
            key: str = "data.train") -> Iterator[tuple[int, str, dict[str, Any]]]:
    """`(index, question, gold)` of the first `size` problems the task draws from `seed`. Each
    gold is checked once here: the task's scorer must give the entry's own answer full credit after
    the gold's round trip (else the gold could never be earned)."""
    dataset = make_dataset(name, config, seed, size, key)
    for index in range(size):
        entry = dataset[index]
        question = entry.get("question")
        if not isinstance(question, str) or not question.strip():
            raise TaskError(f"{PREFIX}{name}: entry {index} of seed {seed} has no question text")
        gold = make_gold(name, config, entry)
        if entry.get("answer") is not None:
            decoded = decode_entry(gold["entry"])
            if not is_full_credit(float(dataset.score_answer(decoded["answer"], decoded))):
                raise TaskError(f"{PREFIX}{name}: the task's scorer rejects its own answer {entry['answer']!r:.60} "
                                f"(entry {index} of seed {seed}); this task is not supported")
        yield index, question, gold
