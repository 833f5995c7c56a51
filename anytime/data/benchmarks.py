"""The benchmark registry: names → where their rows live (hub or a local file), from
`anytime/data/benchmarks.yaml` (shipped in the package). `synthetic` is built in (held-out problems of the quickstart task), and so is
every `reasoning_gym:<task>` (a held-out split of a procedural task, `anytime.data.task_splits`);
`anytime.data.sources.source_kind` tells them apart, for training too."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from anytime import defaults
from anytime.data.prompts import SYNTHETIC_EVAL_SEED, DataError, PromptRow, load_rows, synthetic_rows
from anytime.data.sources import SYNTHETIC, TASK, source_kind
from anytime.data.task_splits import heldout_task_rows
from anytime.tasks.reasoning_gym import PREFIX

REGISTRY_ENV = "ANYTIME_BENCHMARKS"


@dataclass(frozen=True)
class Benchmark:
    name: str
    hub: str | None = None
    config: str | None = None
    split: str = "test"
    problem_key: str = "problem"
    answer_key: str = "answer"
    local: str | None = None
    local_problem_key: str | None = None
    local_answer_key: str | None = None


def registry_path() -> Path:
    env = os.environ.get(REGISTRY_ENV)
    return Path(env) if env else Path(__file__).with_name("benchmarks.yaml")


def load_registry(path: Path | None = None) -> dict[str, Benchmark]:
    path = path or registry_path()
    if not path.is_file():
        raise DataError(f"benchmark registry {str(path)!r} not found; set {REGISTRY_ENV} to your benchmarks.yaml")
    data = yaml.safe_load(path.read_text()) or {}
    out = {SYNTHETIC: Benchmark(SYNTHETIC)}
    for name, entry in data.items():
        try:
            out[name] = Benchmark(name=name, **entry)
        except TypeError as exc:
            raise DataError(f"{path}: benchmark {name!r} has a bad field ({exc})") from None
    return out


def task_split(name: str, train_source: str | None, task_config: Mapping[str, Any],
               task_size: int) -> dict[str, Any]:
    """`load_benchmark`'s task knobs for benchmark `name` in a run that trains on `train_source`
    (`data.train`, `data.task_config`, `data.task_size`): the training task's held-out split keeps its
    knobs and stays disjoint from the training split; any other benchmark has no training split to avoid."""
    if name != train_source:
        return {"task_config": None, "train_size": 0}
    return {"task_config": dict(task_config), "train_size": task_size}


def load_benchmark(name: str, *, data_dir: str | Path | None = None, limit: int | None = None,
                   seed: int = 0, synthetic_ops: tuple[int, int] = (3, 6), task_config: Mapping[str, Any] | None = None,
                   train_size: int = defaults.TASK_SIZE) -> list[PromptRow]:
    """Rows of a registered benchmark, from `data_dir` when given, else from the hub. `synthetic`
    draws `limit` (default 200) held-out problems with `synthetic_ops` (min, max) operations;
    `reasoning_gym:<task>` draws them from the task with `task_config`, none of them in the training
    split of `train_size` problems (the recipe's data.task_config / data.task_size; 0: no check)."""
    kind = source_kind(name)
    if kind == TASK:
        return heldout_task_rows(name, task_config or {}, limit=limit, seed=seed, train_size=train_size)
    if kind == SYNTHETIC:
        return synthetic_rows(limit or 200, SYNTHETIC_EVAL_SEED + seed, *synthetic_ops)
    registry = load_registry()
    if name not in registry:
        raise DataError(f"unknown benchmark {name!r}; available: {', '.join(sorted(registry))}, or "
                        f"{PREFIX}<task> (a held-out split of a reasoning-gym task)")
    b = registry[name]
    if data_dir is not None:
        if b.local is None:
            raise DataError(f"benchmark {name!r} has no local file name in {registry_path()}; add `local:`")
        path = Path(data_dir) / b.local
        if not path.is_file():
            raise DataError(f"benchmark {name!r}: local file {str(path)!r} does not exist")
        return load_rows(str(path), problem_key=b.local_problem_key or b.problem_key,
                         answer_key=b.local_answer_key or b.answer_key, limit=limit)
    if b.hub is None:
        raise DataError(f"benchmark {name!r} has no hub dataset; pass --data-dir with {b.local!r}")
    source = b.hub if b.config is None else f"{b.hub}:{b.config}"
    return load_rows(source, split=b.split, problem_key=b.problem_key, answer_key=b.answer_key, limit=limit)
