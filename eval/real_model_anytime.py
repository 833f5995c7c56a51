"""The anytime claim on a real model where thinking longer helps: BRPO against GRPO per budget, over seeds.

Every variant trains `recipes/smollm2_anytime.yaml` (SmolLM2-135M-Instruct warm-started on worked
chain sums, then RL on vLLM) from the *same* warm start: the script makes it once (`anytime train`'s
`sft` phase via `anytime sft`, in `<work>/warm_start`) and hard-links it into each run folder as `sft_model`, where
`anytime train` finds it done and goes straight to RL. Runs whose folder holds a summary.json are
kept. For each variant it reports the held-out accuracy at each budget after RL (mean ± 95% CI over
the seeds), the paired per-seed difference against GRPO at each budget, the eval report (completed
share, cut share, summary length) and the thinking length over training.

    python eval/real_model_anytime.py --variants brpo,grpo --seeds 0,1,2,3,4
    python eval/real_model_anytime.py --variants ar-uniform,no-decoupled --seeds 0,1,2

Needs the model converted first (`python -m anytime.models.smollm runs/smollm2`). Writes
`anytime_results.json` and `anytime_table.md` under `--out` (default eval/real_model).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from anytime.core.stats import mean_ci  # noqa: E402

sys.path.insert(0, str(REPO / "eval"))
from real_model_seeds import chosen, run_anytime  # noqa: E402  (a sibling script: one way to run and pick)

RECIPE = "recipes/smollm2_anytime.yaml"
BUDGETS = (8, 16, 24, 32)
BENCH = "eval/reasoning_gym:chain_sum"
# name -> overrides of the recipe (which is BRPO: AR-linear prior, decoupled summary policy)
VARIANTS = {
    "brpo": [],
    # the paper's GRPO baseline: one budget (the largest), one summary there, the group-mean baseline;
    # scored on the same eval budgets
    "grpo": ["budget.budgets=[32]", "budget.prior=base", "summary.n=1", "summary.estimator=grpo",
             "algorithm.variance_reduction=v2only", "eval.budgets=[8,16,24,32]"],
    "ar-uniform": ["budget.prior=uniform"],
    # the summaries trained as GRPO trains them: only the last budget's summary, against its group mean
    "no-decoupled": ["summary.estimator=grpo"],
}
BASELINE = "grpo"


def warm_start(work: Path) -> Path:
    """The shared warm start: the recipe's `sft` phase alone (`anytime sft`, seed 0), made once."""
    folder = work / "warm_start"
    if not (folder / "sft_model" / "sft_done.txt").is_file():
        run_anytime(["sft", RECIPE, f"trainer.output_dir={folder}"], folder / "sft.log")
    return folder / "sft_model"


def train(variant: str, seed: int, work: Path, sft_model: Path) -> None:
    run_dir = work / variant / f"seed{seed}"
    if (run_dir / "summary.json").is_file():
        return
    if not (run_dir / "sft_model").is_dir():
        shutil.copytree(sft_model, run_dir / "sft_model", copy_function=os.link)  # read only: links, not copies
    run_anytime(["train", RECIPE, f"trainer.seed={seed}", f"trainer.output_dir={run_dir}", "trainer.resume=never",
              *VARIANTS[variant]], run_dir / "train.log")


def collect(variant: str, seed: int, work: Path) -> dict:
    run_dir = work / variant / f"seed{seed}"
    final = json.loads((run_dir / "final_eval.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [m for m in steps if "time/step" in m]

    def report(evaluation: dict) -> dict:
        return {key: [evaluation[f"{BENCH}/{key}@{b}"] for b in BUDGETS]
                for key in ("acc", "completed", "cut", "summary_len")} | {
            "anytime": evaluation[f"{BENCH}/anytime"], "think_len": evaluation[f"{BENCH}/think_len"]}

    return {"seed": seed, "before": report(final["before"]), "after": report(final["after"]),
            "train_think_len": [m.get("train/think_len") for m in timed],
            "train_score": [m.get("train/anytime_score") for m in timed],
            "train_acc": {str(b): [m.get(f"train/acc@{b}") for m in timed] for b in BUDGETS},
            "s_per_step": statistics.fmean(m["time/step"] for m in timed),
            "wall_min": summary["wall_seconds"] / 60, "peak_rss_gb": summary.get("peak_rss_gb")}


def _ci(values: list[float]) -> str:
    mean, half = mean_ci(values)
    return f"{mean:.3f} ± {half:.3f}"


def _pm(values: list[float]) -> str:
    mean, half = mean_ci(values)
    return f"{mean:+.3f} ± {half:.3f}"


def table(results: dict[str, list[dict]]) -> list[str]:
    heads = " | ".join(f"@{b}" for b in BUDGETS)
    lines = ["### Held-out accuracy per thinking budget after RL (mean ± 95% CI over seeds)", "",
             f"| variant | seeds | {heads} | anytime (AR-linear weights) | gain over the warm start |",
             "|---" * (len(BUDGETS) + 4) + "|"]
    # one warm start: every variant's run of a seed scores it on the same problems and sampling seeds
    before = {r["seed"]: r["before"] for runs in results.values() for r in runs}
    lines.append(f"| warm start (before RL) | {','.join(map(str, sorted(before)))} | "
                 + " | ".join(_ci([b["acc"][i] for b in before.values()]) for i in range(len(BUDGETS)))
                 + f" | {_ci([b['anytime'] for b in before.values()])} | — |")
    for variant, runs in results.items():
        lines.append(f"| {variant} | {','.join(str(r['seed']) for r in runs)} | "
                     + " | ".join(_ci([r["after"]["acc"][i] for r in runs]) for i in range(len(BUDGETS)))
                     + f" | {_ci([r['after']['anytime'] for r in runs])} "
                     f"| {_pm([r['after']['anytime'] - r['before']['anytime'] for r in runs])} |")
    lines += ["", "### Change from the warm start at each budget (after − before, paired by seed)", "",
              f"| variant | seeds | {heads} |", "|---" * (len(BUDGETS) + 2) + "|"]
    for variant, runs in results.items():
        lines.append(f"| {variant} | {','.join(str(r['seed']) for r in runs)} | "
                     + " | ".join(_pm([r["after"]["acc"][i] - r["before"]["acc"][i] for r in runs])
                                  for i in range(len(BUDGETS))) + " |")
    if BASELINE in results:
        base = {r["seed"]: r for r in results[BASELINE]}
        lines += ["", f"### Paired differences against {BASELINE} (same seed: same eval problems and sampling seeds)",
                  "", f"| variant − {BASELINE} | seeds | {heads} | anytime |", "|---" * (len(BUDGETS) + 3) + "|"]
        for variant, runs in results.items():
            if variant == BASELINE:
                continue
            pairs = [(r, base[r["seed"]]) for r in runs if r["seed"] in base]
            if len(pairs) < 2:
                continue
            lines.append(f"| {variant} | {','.join(str(a['seed']) for a, _ in pairs)} | "
                         + " | ".join(_pm([a["after"]["acc"][i] - b["after"]["acc"][i] for a, b in pairs])
                                      for i in range(len(BUDGETS)))
                         + f" | {_pm([a['after']['anytime'] - b['after']['anytime'] for a, b in pairs])} |")
    lines += ["", "### Eval report after RL (means over seeds; per budget " + ", ".join(map(str, BUDGETS)) + ")", "",
              "| variant | completed share | cut share | summary length (tokens) | thinking length |",
              "|---|---|---|---|---|"]
    warm = [{"before": b} for b in before.values()]
    for name, runs, when in [("warm start", warm, "before")] + [(v, runs, "after") for v, runs in results.items()]:
        cells = [" / ".join(f"{statistics.fmean(r[when][key][i] for r in runs):.2f}" for i in range(len(BUDGETS)))
                 for key in ("completed", "cut", "summary_len")]
        lines.append(f"| {name} | {' | '.join(cells)} | {statistics.fmean(r[when]['think_len'] for r in runs):.1f} |")
    lines += ["", "### Thinking length (tokens) of the training rollouts over training (mean over seeds)", "",
              "| variant | steps 1-5 | 6-10 | 11-15 | 16-20 | s per step | min per run | peak RSS GB |",
              "|---|---|---|---|---|---|---|---|"]
    for variant, runs in results.items():
        n = min(len(r["train_think_len"]) for r in runs)
        quarters = [statistics.fmean(r["train_think_len"][i] for r in runs for i in range(k, min(k + 5, n)))
                    for k in range(0, n, 5)]
        lines.append(f"| {variant} | {' | '.join(f'{q:.1f}' for q in quarters)} "
                     f"| {statistics.fmean(r['s_per_step'] for r in runs):.1f} "
                     f"| {statistics.fmean(r['wall_min'] for r in runs):.1f} | {max(r['peak_rss_gb'] or 0 for r in runs):.1f} |")
    lines += ["", "### Training accuracy per budget, first five steps → last five (mean over seeds; "
              "GRPO trains at 32 only)", "", f"| variant | {heads} |", "|---" * (len(BUDGETS) + 1) + "|"]
    for variant, runs in results.items():
        cells = []
        for b in BUDGETS:
            series = [r["train_acc"][str(b)] for r in runs]
            if any(v is None for s in series for v in s):
                cells.append("—")
                continue
            early = statistics.fmean(v for s in series for v in s[:5])
            late = statistics.fmean(v for s in series for v in s[-5:])
            cells.append(f"{early:.2f} → {late:.2f}")
        lines.append(f"| {variant} | {' | '.join(cells)} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="brpo,grpo")
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--work", default="runs/real_model_anytime")
    parser.add_argument("--out", default="eval/real_model")
    parser.add_argument("--report-only", action="store_true", help="tabulate the finished runs, train nothing")
    args = parser.parse_args()
    variants, seeds = chosen(args, VARIANTS)
    out, work = REPO / args.out, REPO / args.work
    if not args.report_only:
        sft_model = warm_start(work)
        for seed in seeds:  # seed-major: an interrupted sweep leaves every variant with the same seeds
            for variant in variants:
                train(variant, seed, work, sft_model)
    results = {v: [collect(v, s, work) for s in seeds if (work / v / f"seed{s}" / "summary.json").is_file()]
               for v in VARIANTS}
    results = {v: runs for v, runs in results.items() if runs}
    out.mkdir(parents=True, exist_ok=True)
    (out / "anytime_results.json").write_text(json.dumps(results, indent=1))
    lines = table(results)
    by_seeds: dict[str, list[str]] = {}
    for variant, runs in results.items():
        by_seeds.setdefault(",".join(str(r["seed"]) for r in runs), []).append(variant)
    made_by = " and ".join(f"`python eval/real_model_anytime.py --variants {','.join(vs)} --seeds {seeds}`"
                           for seeds, vs in by_seeds.items())
    header = [f"Made by {made_by}, from one warm start; runs in `{args.work}`.", ""]
    (out / "anytime_table.md").write_text("\n".join(header + lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
