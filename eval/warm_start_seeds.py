"""Does the quickstart's supervised warm start succeed for every seed?

For each seed, builds the tiny model and runs the warm start exactly as `anytime train
recipes/quickstart.yaml trainer.seed=S` does (`prepare_model`), then scores the warm-started model
with the trainer's own held-out eval (`Trainer.evaluate`: greedy, the recipe's budgets, 200 synthetic
problems) — the "before RL" score of the quickstart. Each run is an *arm* (a label plus recipe
overrides); results of several arms are kept side by side. Writes eval/warm_start_seeds/
{results.json, table.md, sft_loss.png}.

    python eval/warm_start_seeds.py --arm fixed --seeds 0,1,2,3,4 [key.path=value ...]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from anytime.core.stats import mean_ci

REPO = Path(__file__).resolve().parents[1]
RECIPE = str(REPO / "recipes" / "quickstart.yaml")


def loss_floors(recipe: Any, model_path: str, size: int = 2000) -> dict[str, float]:
    """Token-mean SFT loss of two reference models on the recipe's data: one that knows everything but
    the random filler choices (the floor), and one that also guesses every line's result digit
    uniformly (log 10 per line). A curve that flattens at the second has learned the format, the step
    numbers and the operand lookup, but not the additions."""
    from transformers import AutoTokenizer

    from anytime.tasks.synthetic import FILLER_LINES, make_problems
    from anytime.trainer.sft import synthetic_sft_pairs

    d = recipe.data
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokens = sum(len(c) for _, c in synthetic_sft_pairs(recipe, tokenizer, size, 0))
    lines = sum(len(p.operands) for p in make_problems(size, 0, d.synthetic_min_ops, d.synthetic_max_ops))
    f = d.synthetic_filler
    per_line = -sum(q * math.log(q) for q in [1 - f] + [f / len(FILLER_LINES)] * len(FILLER_LINES) if q > 0)
    return {"filler_only": lines * per_line / tokens, "sums_unknown": lines * (per_line + math.log(10)) / tokens}


# The skills a warm start must learn, by the digit a trace line "k: v+x=n" asks for next (the token before it).
SKILLS = {"Ġ": "copy", "+": "operand", "=": "sum"}


def skill_losses(recipe: Any, model_path: str, size: int = 300) -> dict[str, float]:
    """Mean cross-entropy (nats) of a warm-started model on held-out reference traces, per skill: `copy`
    (v, the previous line's last digit), `operand` (x, looked up as "Step k: add x" in the prompt) and
    `sum` (the first digit of n, the one that needs both). log 10 = 2.303 is a uniform guess over digits: the
    skill is not learned at all. A failed warm start shows which one it failed. `operand@k` splits the
    operand loss by the trace line's step number k: a lookup that only works for the first step has not
    learnt to match "Step k"."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from anytime.trainer.sft import synthetic_sft_pairs

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    sums: dict[str, list[float]] = {k: [] for k in SKILLS.values()}
    for prompt, completion in synthetic_sft_pairs(recipe, tokenizer, size, seed=10_007):  # not a training seed's data
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            nll = torch.nn.functional.cross_entropy(model(ids).logits[0, :-1].float(), ids[0, 1:], reduction="none")
        tokens = tokenizer.convert_ids_to_tokens(prompt + completion)
        step = ""  # the step number k of the trace line being read
        for i in range(len(prompt), len(tokens)):
            if i == len(prompt) or tokens[i - 1] == "Ċ":  # a line starts: "k:" or a filler line
                step = "".join(itertools.takewhile(str.isdigit, tokens[i:i + 3])) or step
            skill = SKILLS.get(tokens[i - 1])
            if skill and tokens[i].isdigit():
                sums[skill].append(float(nll[i - 1]))
                if skill == "operand" and step:
                    sums.setdefault(f"operand@{step}", []).append(float(nll[i - 1]))
    return {k: statistics.fmean(v) for k, v in sums.items() if v}


def _commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + ("+dirty" if git("status", "--porcelain", "--", "anytime", "recipes") else "")


def seed_recipe(seed: int, work: Path, overrides: list[str]) -> Any:
    from anytime.config import load_recipe

    run_dir = work / f"seed_{seed}"
    return load_recipe(RECIPE, [f"trainer.seed={seed}", f"trainer.output_dir={run_dir}",
                                f"model.path={run_dir}/init_model", "logging.progress=false", *overrides])


def run_seed(seed: int, work: Path, overrides: list[str]) -> dict[str, Any]:
    """Warm-start one seed (skipped when its folder already holds a finished model) and evaluate it."""
    from anytime.config.answer_format import eval_budgets
    from anytime.trainer.launch import prepare_model
    from anytime.trainer.trainer import Trainer

    recipe = seed_recipe(seed, work, overrides)
    path = prepare_model(recipe)
    curve = json.loads((Path(path) / "sft_loss.json").read_text())
    start = time.perf_counter()
    trainer = Trainer(recipe, path)
    try:
        ev = trainer.evaluate(0)  # step 0: its per-sample records go to eval_samples/step_0.jsonl
    finally:
        trainer.close()
    budgets = eval_budgets(recipe)  # what the rollout worker evaluates at
    loss = curve["loss"]
    return {
        "seed": seed,
        "anytime": ev["eval/anytime"],
        "final": ev["eval/synthetic/final"],
        "accuracy": {str(b): ev[f"eval/synthetic/acc@{b}"] for b in budgets},
        "think_len": ev["eval/synthetic/think_len"],
        "skills": skill_losses(recipe, path),  # which skill a weak warm start lacks
        "sft_seconds": curve["seconds"],
        "sft_cpu_seconds": curve.get("cpu_seconds"),
        "eval_seconds": time.perf_counter() - start,
        "final_loss": statistics.fmean(loss[-50:]),  # mean of the last 50 steps: one batch is noisy
        "loss": [round(x, 4) for x in loss],
    }


def write_table(results: dict[str, Any], out: Path) -> str:
    lines = []
    for label, arm in results["arms"].items():
        runs = arm["seeds"]
        budgets = list(runs[0]["accuracy"]) if runs else []
        lines += [f"### {label}", "", f"commit `{arm['commit']}`, overrides: `{' '.join(arm['overrides']) or '(none)'}`", "",
                  "| seed | " + " | ".join(f"acc@{b}" for b in budgets)
                  + " | anytime | final | think len | copy | operand | sum | SFT loss (last 50) | SFT s (wall / CPU) |",
                  "|---" * (len(budgets) + 9) + "|"]
        for r in sorted(runs, key=lambda r: r["seed"]):
            lines.append(f"| {r['seed']} | " + " | ".join(f"{r['accuracy'][b]:.3f}" for b in budgets)
                         + f" | {r['anytime']:.3f} | {r['final']:.3f} | {r['think_len']:.1f} | "
                         + " | ".join(f"{r.get('skills', {}).get(k, float('nan')):.3f}" for k in SKILLS.values())
                         + f" | {r['final_loss']:.4f}"
                         f" | {r['sft_seconds']:.0f} / {r.get('sft_cpu_seconds') or float('nan'):.0f} |")
        if runs:
            (ma, ca), (mf, cf) = mean_ci([r["anytime"] for r in runs]), mean_ci([r["final"] for r in runs])
            lines += ["", f"anytime {ma:.3f} ± {ca:.3f}, final {mf:.3f} ± {cf:.3f} (mean ± 95% CI over "
                      f"{len(runs)} seeds); worst anytime {min(r['anytime'] for r in runs):.3f}; "
                      f"SFT time mean {statistics.fmean(r['sft_seconds'] for r in runs):.0f} s", ""]
    table = "\n".join(lines) + "\n"
    (out / "table.md").write_text(table)
    return table


def plot_losses(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = results["arms"]
    fig, axes = plt.subplots(1, len(arms), figsize=(5.5 * len(arms), 4), sharey=True, squeeze=False)
    for ax, (label, arm) in zip(axes[0], arms.items()):
        for r in arm["seeds"]:
            loss, k = r["loss"], 10  # a 10-step moving average: single batches hide the trend
            smooth = [statistics.fmean(loss[max(0, i - k + 1): i + 1]) for i in range(len(loss))]
            ax.plot(range(1, len(loss) + 1), smooth, lw=1, label=f"seed {r['seed']} (anytime {r['anytime']:.3f})")
        if "loss_floors" in results:
            floors = results["loss_floors"]
            ax.axhline(floors["sums_unknown"], color="gray", ls="--", lw=0.8, label="every sum digit unknown")
            ax.axhline(floors["filler_only"], color="k", ls=":", lw=0.8, label="floor: filler choices only")
        ax.set_yscale("log")
        ax.set_xlabel("SFT step")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("SFT loss (10-step mean)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arm", default="current", help="label of this run in results.json (replaces an earlier one)")
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--work", default="runs/warm_start_seeds", help="scratch folder for models")
    parser.add_argument("--out", default=str(REPO / "eval" / "warm_start_seeds"))
    parser.add_argument("--replot", action="store_true",
                        help="run nothing: recompute the loss floors (from the arm's first seed's model), table and plot")
    parser.add_argument("overrides", nargs="*", help="recipe overrides for every seed (key.path=value)")
    args = parser.parse_args()
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {"arms": {}}
    arm = {"commit": _commit(), "overrides": args.overrides, "seeds": []}
    seeds = [int(s) for s in args.seeds.split(",")]
    work = Path(args.work) / args.arm
    for seed in [] if args.replot else seeds:
        r = run_seed(seed, work, args.overrides)
        print(f"arm {args.arm} seed {seed}: anytime {r['anytime']:.3f} final {r['final']:.3f} "
              f"sft_loss_last50 {r['final_loss']:.4f} sft_seconds {r['sft_seconds']:.0f}", flush=True)
        arm["seeds"].append(r)
        results["arms"][args.arm] = arm
        results_path.write_text(json.dumps(results, indent=1))  # after every seed: a long run can be read midway
    recipe = seed_recipe(seeds[0], work, args.overrides)
    results["loss_floors"] = loss_floors(recipe, recipe.model.path)  # the tokenizer is the same for every seed
    print("loss floors: " + ", ".join(f"{k} {v:.4f}" for k, v in results["loss_floors"].items()))
    results_path.write_text(json.dumps(results, indent=1))
    print(write_table(results, out))
    plot_losses(results, out / "sft_loss.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
