"""What a source of rows is, decided in one place for training (`data.train`) and evaluation
(`eval.benchmarks`, `anytime eval --benchmarks`): the built-in synthetic task, a procedural task
(`reasoning_gym:<task>`, `anytime.data.task_splits`), or rows to read (training: a hub dataset or a
local json/jsonl/parquet file, `anytime.data.prompts.load_rows`; evaluation: a benchmark of the
registry, `anytime.data.benchmarks`). `source_kind` decides; `load_train_rows` loads a recipe's
training rows by it, `anytime.data.benchmarks.load_benchmark` a benchmark's held-out rows."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Literal

from anytime.data.prompts import SYNTHETIC_TRAIN_SEED, PromptRow, load_rows, synthetic_rows
from anytime.data.task_splits import train_task_rows
from anytime.tasks.reasoning_gym import task_name

if TYPE_CHECKING:
    from anytime.config import Recipe

SYNTHETIC, TASK, DATASET = "synthetic", "task", "dataset"
SourceKind = Literal["synthetic", "task", "dataset"]


def source_kind(source: str) -> SourceKind:
    """`SYNTHETIC` for the synthetic task, `TASK` for `reasoning_gym:<task>`, else `DATASET` (a
    hub dataset or local file to train on; a registered benchmark to evaluate on)."""
    if source == SYNTHETIC:
        return SYNTHETIC
    if task_name(source) is not None:
        return TASK
    return DATASET


def load_train_rows(recipe: Recipe) -> list[PromptRow]:
    """The training rows of a recipe (`data.*`), in training order: the synthetic task's (always
    shuffled by `trainer.seed`), a procedural task's training split (generated from the seed, shuffled
    like a file), or a dataset's (shuffled by `trainer.seed` when `data.shuffle`); the first
    `data.limit` of them."""
    d, seed = recipe.data, recipe.trainer.seed
    kind = source_kind(d.train)
    if kind == SYNTHETIC:
        rows = synthetic_rows(d.synthetic_size, SYNTHETIC_TRAIN_SEED + seed, d.synthetic_min_ops, d.synthetic_max_ops)
        random.Random(seed).shuffle(rows)
        return rows[: d.limit] if d.limit else rows
    if kind == TASK:
        rows = train_task_rows(d.train, d.task_config, d.task_size, seed)
        if d.shuffle:
            random.Random(seed).shuffle(rows)
        return rows[: d.limit] if d.limit else rows
    return load_rows(d.train, split=d.split, problem_key=d.problem_key, answer_key=d.answer_key, limit=d.limit,
                     shuffle_seed=seed if d.shuffle else None)
