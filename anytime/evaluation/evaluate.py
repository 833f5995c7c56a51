"""Score models on math benchmarks across thinking budgets (forced summary at every cut).

`anytime eval --model M [--model M2] --benchmarks aime24,math500 --budgets 250:8000:250 --samples N
--engine hf|vllm --out DIR` writes results.json, results.csv, results.md, accuracy_vs_budget.png and
samples.jsonl (one record per model × benchmark × problem × sample, see `anytime.evaluation.records`).
`--recipe RECIPE` takes the settings of a training recipe's in-training eval; `--model` may be a
training checkpoint (exported on the fly); `anytime eval --rescore DIR` re-verifies DIR/samples.jsonl
without generating and rewrites the results. The trainer's in-training eval calls `evaluate_rows` —
the same code path.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from anytime import defaults
from anytime.data.prompts import PromptRow, encode_prompts
from anytime.evaluation.options import (
    EvalOptions,
    add_option_arguments,
    model_folder,
    model_max_len,
    resolve_options,
    summary_room,
)
from anytime.evaluation.records import (
    SAMPLES_FILE,
    Record,
    aggregate,
    dump_records,
    group_records,
    pass_at_k,
    read_samples,
    rescore_records,
    sample_records,
    write_samples,
)
from anytime.evaluation.report import REPORT_KEYS

__all__ = ["evaluate_rows", "pass_at_k", "rescore_dir", "write_results", "write_samples"]

# the per-budget columns of results.csv, each a list over the budgets in results.json
CSV_FIELDS = ("accuracy", *REPORT_KEYS)


def evaluate_rows(runner: Any, tokenizer: Any, rows: Sequence[PromptRow], *, budgets: Sequence[int],
                  instruction: str = defaults.INSTRUCTION, max_prompt_len: int = 1024, batch_prompts: int = 32,
                  seed: int = 0, probs: Sequence[float] | None = None,
                  on_batch: Callable[[int], None] | None = None,
                  limit_name: str = "data.max_prompt_len", records: list[Record] | None = None,
                  tags: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Per-budget accuracy and report (completed, completed_accuracy, cut, summary_length),
    anytime/final accuracy, AUC, thinking length, pass@k and verifier failures (`records.aggregate`)
    of `rows` under `runner` (an `AnytimeRolloutRunner`).

    When `records` is a list, the per-sample records (with each trace's text) are appended to it, each
    starting with `tags` (the CLI tags model and benchmark; the trainer may tag benchmark and step) —
    see `write_samples`.
    """
    budgets = list(budgets)
    prompts = encode_prompts(tokenizer, rows, instruction, max_prompt_len, limit_name)
    mine: list[Record] = []
    for start in range(0, len(rows), batch_prompts):
        chunk = rows[start:start + batch_prompts]
        rollout = runner.run(prompts[start:start + batch_prompts], [r.answer for r in chunk], budgets,
                             seed=seed + start)
        mine.extend(sample_records(rollout, chunk, first_index=start, tags=tags,
                                   decode=tokenizer.decode if records is not None else None))
        if on_batch is not None:
            on_batch(len(chunk))
    if records is not None:
        records.extend(mine)
    return aggregate(mine, budgets, probs)


# --- the `anytime eval` command ---------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", action="append", default=None,
                        help="model folder, hub name or training checkpoint (step_N/); repeatable")
    parser.add_argument("--out", default=None, help="output folder")
    parser.add_argument("--rescore", default=None, metavar="DIR",
                        help=f"re-verify DIR/{SAMPLES_FILE} (e.g. after a verifier fix) without generating, "
                             "and rewrite DIR's results")
    add_option_arguments(parser)
    parser.add_argument("--batch-prompts", type=int, default=32)
    parser.add_argument("--verifier-workers", type=int, default=None, help="default: all cores")


def run(args: argparse.Namespace) -> int:
    if args.rescore is not None:
        if args.model:
            raise ValueError("--rescore DIR re-verifies the samples already in DIR; drop --model")
        rescore_dir(args.rescore, num_workers=args.verifier_workers)
        print((Path(args.rescore) / "results.md").read_text())
        return 0
    if not args.model or not args.out:
        raise ValueError("give --model M (repeatable) and --out DIR, or --rescore DIR")
    if len(set(args.model)) < len(args.model):
        raise ValueError(f"--model given twice with the same value: {args.model}; results are keyed by model")
    from tqdm.auto import tqdm

    from anytime.data.benchmarks import load_benchmark, task_split
    from anytime.reward.verifier import RewardScorer

    opts = resolve_options(args)
    budgets = list(opts.budgets)
    out = Path(args.out)
    data = {name: load_benchmark(name, data_dir=opts.data_dir, limit=opts.limit, seed=opts.seed,
                                 synthetic_ops=(opts.synthetic_min_ops, opts.synthetic_max_ops),
                                 **task_split(name, opts.train_task, dict(opts.task_config), opts.task_size))
            for name in opts.benchmarks}
    limits = {model: model_max_len(model) for model in args.model}  # fail before any generation
    rooms = {model: summary_room(model, opts) for model in args.model}
    for model, limit in limits.items():
        extra = rooms[model]
        if limit is not None and budgets[-1] + extra > limit:
            raise ValueError(f"largest budget {budgets[-1]} (+{extra} summary tokens) exceeds model {model!r}'s "
                             f"max length {limit}; lower --budgets")
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"budgets": budgets, "samples": opts.samples, "temperature": opts.temperature,
                               "seed": opts.seed, "sample_seed": opts.sampling_seed,
                               "settings": {**dataclasses.asdict(opts), "recipe": args.recipe},
                               "models": {}}
    total = len(args.model) * sum(len(r) for r in data.values())
    samples_tmp = out / (SAMPLES_FILE + ".tmp")
    try:
        answer_format = opts.answer_format()
        with RewardScorer(num_workers=args.verifier_workers, header=answer_format.verifier_header,
                          think_end=answer_format.think_end) as scorer, \
                tqdm(total=total, desc="eval", unit="problem") as bar, samples_tmp.open("w", encoding="utf-8") as f:
            for model in args.model:
                max_len = opts.max_prompt_len + budgets[-1] + rooms[model]
                max_len = min(max_len, limits[model]) if limits[model] else max_len
                with model_folder(model, out) as folder:
                    results["models"][model] = _evaluate_model(model, folder, max_len, opts, data, scorer, args,
                                                               bar.update, f)
        os.replace(samples_tmp, out / SAMPLES_FILE)
    finally:
        samples_tmp.unlink(missing_ok=True)  # no half-written samples file left behind
    write_results(results, out)
    print((out / "results.md").read_text())
    return 0


def _evaluate_model(model: str, folder: str, max_len: int, opts: EvalOptions, data: Mapping[str, Sequence[PromptRow]],
                    scorer: Any, args: argparse.Namespace, on_batch: Callable[[int], None],
                    samples: IO[str]) -> dict[str, Any]:
    """One model on every benchmark: results per benchmark; its records are appended to `samples`
    as they come (a paper-size eval holds ~10^5 of them)."""
    from transformers import AutoTokenizer

    from anytime.rollout.engines.engine import create_engine
    from anytime.rollout.runner import AnytimeRolloutRunner

    tokenizer = AutoTokenizer.from_pretrained(folder)
    sample_seed = opts.sampling_seed
    per_bench = {}
    with create_engine(opts.engine, folder, max_model_len=max_len, max_prompt_len=opts.max_prompt_len,
                       dtype=opts.dtype, seed=sample_seed, **opts.engine_kwargs()) as engine:
        runner = AnytimeRolloutRunner(engine, tokenizer, scorer, opts.settings(sample_seed))
        for name, rows in data.items():
            start = time.perf_counter()
            records: list[Record] = []
            per_bench[name] = evaluate_rows(runner, tokenizer, rows, budgets=opts.budgets,
                                            instruction=opts.instruction, max_prompt_len=opts.max_prompt_len,
                                            batch_prompts=args.batch_prompts, seed=sample_seed, on_batch=on_batch,
                                            limit_name="--max-prompt-len", records=records,
                                            tags={"model": model, "benchmark": name})
            per_bench[name]["seconds"] = time.perf_counter() - start
            dump_records(records, samples)
    return per_bench


def rescore_dir(folder: str | Path, *, num_workers: int | None = None) -> dict[str, Any]:
    """Re-verify every summary text of `folder/samples.jsonl` with the current verifier (same header
    and thinking marker as the run), recompute each model × benchmark's aggregates from the records
    and rewrite samples.jsonl and the results. Unchanged verdicts reproduce results.json exactly."""
    from anytime.reward.verifier import RewardScorer

    folder = Path(folder)
    results_path = folder / "results.json"
    if not results_path.is_file():
        raise FileNotFoundError(f"{str(results_path)!r} does not exist; --rescore takes the --out folder of an "
                                "`anytime eval` run")
    results = json.loads(results_path.read_text())
    records = read_samples(folder / SAMPLES_FILE)
    groups = group_records(records)
    expected = {(m, b) for m, per_bench in results["models"].items() for b in per_bench}
    if set(groups) != expected:
        raise ValueError(f"{folder / SAMPLES_FILE} holds records of {sorted(map(str, groups))} but results.json "
                         f"has {sorted(map(str, expected))}; rescoring needs every sample of every benchmark")
    settings = results.get("settings", {})
    fallback = EvalOptions()
    # the header and marker the run was verified with, not a whole format: a run's close text need not
    # pass today's rules for its summaries to be re-verified (the scorer keys on the stripped header)
    with RewardScorer(num_workers=num_workers, header=settings.get("header", fallback.header),
                      think_end=settings.get("think_end", fallback.think_end)) as scorer:
        rescored, changed = rescore_records(records, scorer)
    for (model, bench), group in group_records(rescored).items():
        results["models"][model][bench].update(aggregate(group, results["budgets"]))
    write_samples(rescored, folder / SAMPLES_FILE)
    write_results(results, folder)
    total = sum(len(e["summaries"]) for r in records for e in r["budgets"])
    print(f"re-verified {total} summaries of {len(records)} samples in {folder}: {changed} verdicts changed")
    return results


# --- outputs -----------------------------------------------------------------------------------

def table_budgets(budgets: Sequence[int], at_most: int = 4) -> list[int]:
    """A few budgets for the table: all when there are at most `at_most`, else those nearest to a
    quarter, half, three quarters and all of the largest budget."""
    budgets = list(budgets)
    if len(budgets) <= at_most:
        return budgets
    picked = [min(budgets, key=lambda b: abs(b - budgets[-1] * (q + 1) / at_most)) for q in range(at_most)]
    return sorted(set(picked))


def short_names(models: Sequence[str]) -> dict[str, str]:
    """Each model's display name: the fewest trailing path parts that no other model shares
    (`sft_model`, `a/checkpoints/step_20` and `b/checkpoints/step_20`, not `step_20` twice)."""
    parts = {m: Path(m).parts or (m,) for m in models}

    def tail(m: str, k: int) -> tuple[str, ...]:
        return parts[m][-k:]

    names = {}
    for m in models:
        k = 1
        while k < len(parts[m]) and any(tail(o, k) == tail(m, k) for o in models if o != m):
            k += 1
        names[m] = "/".join(tail(m, k))
    return names


def results_table(results: dict[str, Any]) -> str:
    """The markdown tables: per model × benchmark, anytime accuracy, AUC, accuracy at a few budgets,
    pass@1, length and failures; then, per model × benchmark × those budgets, the per-budget report
    (`anytime.evaluation.report`)."""
    budgets = results["budgets"]
    shown = table_budgets(budgets)
    head = ["model", "benchmark", "anytime acc", "AUC", *(f"acc@{b}" for b in shown), "pass@1", "avg think len",
            "failures"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    names = short_names(list(results["models"]))
    for model, per_bench in results["models"].items():
        for name, r in per_bench.items():
            fails = ", ".join(f"{k}: {v}" for k, v in sorted(r["failures"].items()) if k != "correct")
            cells = [names[model], name, f"{r['anytime_accuracy']:.3f}", f"{r['area_under_curve']:.3f}",
                     *(f"{r['accuracy'][budgets.index(b)]:.3f}" for b in shown), f"{r.get('pass@1', 0):.3f}",
                     f"{r['avg_thinking_length']:.1f}", fails]
            lines.append("| " + " | ".join(cells) + " |")
    # a table of its own: one column per budget and report field would not fit a screen
    head = ["model", "benchmark", "budget", "acc", "completed", "completed acc", "cut", "summary len"]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for model, per_bench in results["models"].items():
        for name, r in per_bench.items():
            for b in shown:
                j = budgets.index(b)
                cells = [names[model], name, str(b), _cell(r["accuracy"][j]), _cell(r["completed"][j]),
                         _cell(r["completed_accuracy"][j]), _cell(r["cut"][j]), _cell(r["summary_length"][j], ".1f")]
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cell(value: float | None, spec: str = ".3f") -> str:
    """A table cell; "–" where there is nothing to report (no completed trace, no recorded length)."""
    return "–" if value is None else format(value, spec)


def write_results(results: dict[str, Any], out: Path) -> None:
    """results.json, results.csv (one row per model × benchmark × budget), results.md, the PNG."""
    (out / "results.json").write_text(json.dumps(results, indent=2))
    budgets = results["budgets"]
    with (out / "results.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["model", "benchmark", "budget", *CSV_FIELDS])
        for model, per_bench in results["models"].items():
            for name, r in per_bench.items():
                for j, b in enumerate(budgets):
                    # an empty cell where there is nothing to report (as `None` is in results.json)
                    writer.writerow([model, name, b,
                                     *("" if r[k][j] is None else f"{r[k][j]:.6f}" for k in CSV_FIELDS)])
    (out / "results.md").write_text(results_table(results))
    plot_accuracy(results, out / "accuracy_vs_budget.png")


def plot_accuracy(results: dict[str, Any], path: Path) -> None:
    """Two panels over the budgets: accuracy of all traces (solid) and of the traces that had ended
    on their own by the budget (dashed, same colour); the share of those completed traces."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def nan(values: Sequence[float | None]) -> list[float]:   # matplotlib leaves a gap at NaN
        return [float("nan") if v is None else v for v in values]

    fig, (acc_ax, done_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    budgets = results["budgets"]
    names = short_names(list(results["models"]))
    for model, per_bench in results["models"].items():
        for name, r in per_bench.items():
            line, = acc_ax.plot(budgets, r["accuracy"], marker="o", ms=3,
                                label=f"{names[model]} · {name} (anytime {r['anytime_accuracy']:.3f})")
            acc_ax.plot(budgets, nan(r["completed_accuracy"]), ls="--", color=line.get_color())
            done_ax.plot(budgets, r["completed"], marker="o", ms=3, color=line.get_color())
    acc_ax.set_ylabel("accuracy (dashed: completed traces only)")
    acc_ax.set_title("accuracy vs thinking budget")
    acc_ax.legend(fontsize=8)
    done_ax.set_ylabel("share of traces ended on their own")
    done_ax.set_title("completed traces vs thinking budget")
    for ax in (acc_ax, done_ax):
        ax.set_xlabel("thinking budget (tokens)")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
