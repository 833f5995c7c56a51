"""A real model learns: SmolLM2-135M-Instruct's held-out gain on the reasoning recipes, over seeds.

For each variant and seed, `anytime train` runs the variant's recipe with `trainer.seed=S` (skipped
when the run folder already holds its summary.json), and the script reports the held-out anytime
score before and after RL (the run's own in-training eval: the task's held-out split, scored by the
task's own scorer), the gain as mean ± 95% CI over the seeds, each run's wall time, mean step time
and peak RSS, and what the answers after training look like (from the eval's per-sample records):
the share of answers that are plain numbers and the share that restate the question's own
expression (`\\boxed{6 - 2}` for 4: the task's scorer gives them 0, so they must not be how the
score rose). Variants run on the same seeds are paired: `--pair grpo:full` reports the per-seed
difference of their gains, mean ± 95% CI.

    python eval/real_model_seeds.py --variants full,lora --seeds 0,1,2
    python eval/real_model_seeds.py --variants full,grpo --seeds 0,1,2 --pair full:grpo

Needs the model converted first (`python -m anytime.models.smollm runs/smollm2`). Writes
`results.json` and `table.md` under `--out` (default eval/real_model).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from anytime.core.stats import mean_ci  # noqa: E402

FULL = "recipes/smollm2_reasoning.yaml"
# name -> (recipe, overrides)
VARIANTS = {
    "full": (FULL, []),
    "lora": ("recipes/smollm2_reasoning_lora.yaml", []),
    # the paper's GRPO baseline on the same recipe: one budget (the largest), one summary, the group-mean
    # baseline; scored on the same eval budgets
    "grpo": (FULL, ["budget.budgets=[48]", "budget.prior=base", "summary.n=1", "summary.estimator=grpo",
                    "algorithm.variance_reduction=v2only", "eval.budgets=[16,32,48]"]),
    # the official rule for thinking models: a trace that stops on EOS scores 0 at every budget past it
    "eos-scored-0": (FULL, ["summary.eos_ends_thinking=false"]),
}
NUMBER = re.compile(r"-?\d+")


def answer_shapes(samples: Path) -> dict[str, float]:
    """Over every summary of the eval records in `samples`: the share of answers that are a plain
    integer, and the share that restate the problem's own expression."""
    answers = plain = restated = 0
    for line in samples.read_text().splitlines():
        record = json.loads(line)
        expression = _expression(record)
        for entry in record["budgets"]:
            for summary in entry["summaries"]:
                answer = (summary.get("answer") or "").strip()
                if not answer:
                    continue
                answers += 1
                plain += bool(NUMBER.fullmatch(answer.replace(" ", "")))
                restated += expression is not None and _squash(answer) == expression
    return {"answers": answers, "plain_number_share": plain / max(answers, 1),
            "restated_share": restated / max(answers, 1)}


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text).rstrip("=")


def _expression(record: dict) -> str | None:
    """The question's expression (`6 - 2` of "... problem: 6 - 2 ="), whitespace removed."""
    tail = record["problem"].rsplit(":", 1)[-1]
    return _squash(tail) or None


def train(variant: str, seed: int, work: Path, jobs: int) -> None:
    """One run, unless its folder already holds a finished one. With several jobs at a time each
    takes one thread (`trainer.num_threads=1`): two runs share the two cores."""
    recipe, overrides = VARIANTS[variant]
    run_dir = work / variant / f"seed{seed}"
    if (run_dir / "summary.json").is_file():
        return
    threads = ["trainer.num_threads=1"] if jobs > 1 else []
    run_anytime(["train", recipe, f"trainer.seed={seed}", f"trainer.output_dir={run_dir}", "trainer.resume=never",
                 *overrides, *threads], run_dir / "train.log")


def run_anytime(args: list[str], log_file: Path) -> None:
    """`anytime <args>` offline from the repository root, its output in `log_file`; fails loudly."""
    cmd = [sys.executable, "-m", "anytime.cli", *args]
    print(" ".join(cmd[2:]), flush=True)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with log_file.open("w") as log:
        subprocess.run(cmd, check=True, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=log,
                       stderr=subprocess.STDOUT)


def chosen(args: argparse.Namespace, known: dict) -> tuple[list[str], list[int]]:
    """`--variants` (each one of `known`) and `--seeds` as lists."""
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in known]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; choose from {sorted(known)}")
    return variants, [int(s) for s in args.seeds.split(",")]


def collect(variant: str, seed: int, work: Path) -> dict:
    run_dir = work / variant / f"seed{seed}"
    result = json.loads((run_dir / "summary.json").read_text())
    recipe = yaml.safe_load((run_dir / "recipe.yaml").read_text())
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [m for m in steps if "time/step" in m]
    last = max(int(p.stem.split("_")[1]) for p in (run_dir / "eval_samples").glob("step_*.jsonl"))
    return {
        "seed": seed,
        "before": result["anytime_before"],
        "after": result["anytime_after"],
        "gain": result["anytime_after"] - result["anytime_before"],
        "wall_min": result["wall_seconds"] / 60,
        "s_per_step": statistics.fmean(m["time/step"] for m in timed),
        "peak_rss_gb": result.get("peak_rss_gb"),
        "threads": recipe["trainer"]["num_threads"],
        "train_score": [m.get("train/anytime_score") for m in timed],
        "think_len": [m.get("train/think_len") for m in timed],
        "answers_before": answer_shapes(run_dir / "eval_samples" / "step_0.jsonl"),
        "answers_after": answer_shapes(run_dir / "eval_samples" / f"step_{last}.jsonl"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="full")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--pair", action="append", default=[], metavar="A:B",
                        help="report the per-seed difference of the gains of A and B (repeatable)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs at a time (each then on one thread); 1 = one after another, as a user runs the recipe")
    parser.add_argument("--work", default="runs/real_model")
    parser.add_argument("--out", default="eval/real_model")
    args = parser.parse_args()
    variants, seeds = chosen(args, VARIANTS)
    out, work = REPO / args.out, REPO / args.work
    out.mkdir(parents=True, exist_ok=True)
    results_file = out / "results.json"
    results = json.loads(results_file.read_text()) if results_file.is_file() else {"runs": {}, "pairs": {}}
    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(lambda vs: train(*vs, work, args.jobs), [(v, s) for v in variants for s in seeds]))
    for variant in variants:
        runs = {str(r["seed"]): r for r in results["runs"].get(variant, [])}
        for seed in seeds:
            runs[str(seed)] = collect(variant, seed, work)
        results["runs"][variant] = sorted(runs.values(), key=lambda r: r["seed"])
    for pair in args.pair:
        a, b = pair.split(":")
        ga = {r["seed"]: r["gain"] for r in results["runs"][a]}
        gb = {r["seed"]: r["gain"] for r in results["runs"][b]}
        both = sorted(set(ga) & set(gb))
        diffs = [ga[s] - gb[s] for s in both]
        mean, half = mean_ci(diffs)
        results["pairs"][pair] = {"seeds": both, "diffs": diffs, "mean": mean, "ci95": half}
    results_file.write_text(json.dumps(results, indent=1))
    lines = ["| variant | seeds | before | after | gain (mean ± 95% CI) | per seed | min/run | s/step | threads "
             "| peak RSS GB | plain-number answers before → after | restated after |", "|---" * 12 + "|"]
    for variant, runs in results["runs"].items():
        gain, half = mean_ci([r["gain"] for r in runs])
        per_seed = ", ".join(f"{r['gain']:+.3f}" for r in runs)
        lines.append(
            f"| {variant} | {','.join(str(r['seed']) for r in runs)} "
            f"| {statistics.fmean(r['before'] for r in runs):.3f} | {statistics.fmean(r['after'] for r in runs):.3f} "
            f"| {gain:+.3f} ± {half:.3f} | {per_seed} "
            f"| {statistics.fmean(r['wall_min'] for r in runs):.1f} | {statistics.fmean(r['s_per_step'] for r in runs):.1f} "
            f"| {','.join(sorted({str(r['threads']) for r in runs}))} | {max(r['peak_rss_gb'] or 0 for r in runs):.1f} "
            f"| {statistics.fmean(r['answers_before']['plain_number_share'] for r in runs):.2f} → "
            f"{statistics.fmean(r['answers_after']['plain_number_share'] for r in runs):.2f} "
            f"| {statistics.fmean(r['answers_after']['restated_share'] for r in runs):.3f} |")
    for pair, p in results["pairs"].items():
        a, b = pair.split(":")
        lines.append(f"\nPaired over seeds {p['seeds']}: gain({a}) − gain({b}) = {p['mean']:+.3f} ± {p['ci95']:.3f} "
                     f"(per seed {', '.join(f'{d:+.3f}' for d in p['diffs'])})")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
