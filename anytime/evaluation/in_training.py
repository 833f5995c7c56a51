"""The trainer's held-out eval, run on a rollout worker's engine: the recipe's eval settings
(`eval.*`, through `anytime.evaluation.options.recipe_options`, the same as `anytime eval --recipe`)
over its benchmarks. The trainer hands `evaluate_on_worker` to its rollout placement, which runs it
where the first worker lives (in this process or in a Ray actor)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from anytime.data.benchmarks import load_benchmark, task_split
from anytime.evaluation.evaluate import evaluate_rows
from anytime.evaluation.options import EvalOptions, recipe_options
from anytime.evaluation.records import cap_records
from anytime.rollout.runner import AnytimeRolloutRunner


# (report field, metric name) of the per-budget report (`anytime.evaluation.report`), short like acc@
METRIC_NAMES = (("completed", "completed"), ("completed_accuracy", "completed_acc"), ("cut", "cut"),
                ("summary_length", "summary_len"))


def budget_metrics(benchmark: str, result: Mapping[str, Any], budgets: Sequence[int]) -> dict[str, float]:
    """`eval/<benchmark>/<metric>@<budget>` of the per-budget report fields of `result` (an
    `evaluate_rows` result). A value with nothing to report (None: no trace completed by that budget)
    is left out rather than logged as a number that would read as 0 on a dashboard."""
    return {f"eval/{benchmark}/{metric}@{b}": result[field][j] for field, metric in METRIC_NAMES
            for j, b in enumerate(budgets) if result[field][j] is not None}


def evaluate_on_worker(worker: Any) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Held-out accuracy and per-budget report (`budget_metrics`) at every eval budget on the
    recipe's benchmarks (at `eval.temperature`), and per-sample records (`anytime.evaluation.records`,
    tagged with the benchmark), at most `eval.max_sample_records` shared fairly between the
    benchmarks. `worker` is a `anytime.rollout.workers.worker.RolloutWorker`."""
    r = worker.recipe
    ev = r.eval
    opts = EvalOptions(**recipe_options(r))
    runner = AnytimeRolloutRunner(worker.engine, worker.tokenizer, worker.scorer, opts.settings(r.trainer.seed))
    result: dict[str, float] = {}
    scores = []
    records: list[dict[str, Any]] = []
    for name in ev.benchmarks:
        rows = load_benchmark(name, data_dir=ev.data_dir, limit=ev.limit, seed=r.trainer.seed,
                              synthetic_ops=(opts.synthetic_min_ops, opts.synthetic_max_ops),
                              **task_split(name, r.data.train, r.data.task_config, r.data.task_size))
        out = evaluate_rows(runner, worker.tokenizer, rows, budgets=opts.budgets, instruction=opts.instruction,
                            max_prompt_len=opts.max_prompt_len, seed=opts.sampling_seed,
                            records=records if ev.max_sample_records else None, tags={"benchmark": name})
        for j, b in enumerate(opts.budgets):
            result[f"eval/{name}/acc@{b}"] = out["accuracy"][j]
        result.update(budget_metrics(name, out, opts.budgets))
        result[f"eval/{name}/anytime"] = out["anytime_accuracy"]
        result[f"eval/{name}/final"] = out["final_accuracy"]
        result[f"eval/{name}/think_len"] = out["avg_thinking_length"]
        scores.append(out["anytime_accuracy"])
    result["eval/anytime"] = sum(scores) / max(len(scores), 1)
    return result, cap_records(records, ev.max_sample_records)
