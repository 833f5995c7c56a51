"""BRPO vs GRPO on the CPU: the paper's claim in small.

Warm-starts one tiny model on the synthetic task (the quickstart's SFT stage), then runs RL twice
from it with the same seeds, prompts per step, traces per prompt and number of steps:
  - GRPO as in the paper's baseline: one budget (the largest), one summary, group-mean baseline;
  - AnytimeReasoner: four budgets with a uniform prior, decoupled summaries, BRPO.
Both are evaluated (greedy) at the same budgets on the same held-out problems. Writes
eval/brpo_vs_grpo/{results.json, table.md, accuracy_vs_budget.png}.

    python eval/brpo_vs_grpo.py [--steps 40] [--out eval/brpo_vs_grpo]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = str(REPO / "recipes" / "quickstart.yaml")

VARIANTS = {
    "GRPO": ["budget.budgets=[64]", "budget.prior=base", "summary.n=1", "summary.estimator=grpo",
             "algorithm.variance_reduction=v2only"],
    "AR-uniform (BRPO)": ["budget.budgets=[16,32,48,64]", "budget.prior=uniform", "summary.n=2",
                          "summary.estimator=brpo", "algorithm.variance_reduction=brpo"],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--work", default="runs/brpo_vs_grpo")
    parser.add_argument("--out", default=str(REPO / "eval" / "brpo_vs_grpo"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from anytime.config import load_recipe
    from anytime.learner.launch import launch_train, prepare_model

    work, out = Path(args.work), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = [f"trainer.seed={args.seed}", "logging.progress=false"]
    sft_path = prepare_model(load_recipe(RECIPE, base + [f"trainer.output_dir={work}/shared",
                                                          f"model.path={work}/shared/init_model"]))
    results = {}
    for name, overrides in VARIANTS.items():
        run_dir = work / name.split()[0].lower().replace("-", "_")
        common = base + [f"model.path={sft_path}", "model.tiny=false", "sft.steps=0", f"trainer.steps={args.steps}",
                         f"trainer.output_dir={run_dir}", "trainer.resume=never", "eval.budgets=[16,32,48,64]"]
        if launch_train(RECIPE, common + overrides) != 0:
            return 1
        history = json.loads((run_dir / "final_eval.json").read_text())
        results[name] = {phase: {int(k.split("@")[1]): v for k, v in history[phase].items() if "/acc@" in k}
                         for phase in ("before", "after")}
    budgets = sorted(next(iter(results.values()))["after"])
    start = next(iter(results.values()))["before"]
    lines = ["| policy | " + " | ".join(f"acc@{b}" for b in budgets) + " | anytime (mean) |",
             "|---" * (len(budgets) + 2) + "|",
             "| SFT warm start | " + " | ".join(f"{start[b]:.3f}" for b in budgets)
             + f" | {sum(start.values()) / len(start):.3f} |"]
    for name, r in results.items():
        acc = r["after"]
        lines.append(f"| {name} | " + " | ".join(f"{acc[b]:.3f}" for b in budgets)
                     + f" | {sum(acc.values()) / len(acc):.3f} |")
    table = "\n".join(lines) + "\n"
    (out / "table.md").write_text(table)
    (out / "results.json").write_text(json.dumps({"steps": args.steps, "seed": args.seed, "results": results},
                                                 indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(budgets, [start[b] for b in budgets], "k--", marker="o", label="SFT warm start")
    for name, r in results.items():
        ax.plot(budgets, [r["after"][b] for b in budgets], marker="o", label=f"{name}, {args.steps} RL steps")
    ax.set_xlabel("thinking budget (tokens)")
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("synthetic task: accuracy vs budget")
    fig.tight_layout()
    fig.savefig(out / "accuracy_vs_budget.png", dpi=120)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
