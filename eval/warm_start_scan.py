"""Choose the anytime testbed by measuring: warm-start a model on worked solutions of candidate tasks
(`anytime sft`), then score each warm start on the held-out split at every budget (`anytime eval`),
and check what a testbed where the budget binds needs:

- `gain`: accuracy at the largest budget minus at the smallest >= 0.20 (thinking longer helps);
- `top`: accuracy at the largest budget between 0.3 and 0.8 (room to learn, reward to learn from);
- `cut_at_smallest`: the share of traces still thinking at the smallest budget > 0.5 (most traces
  need more than it).

Each candidate is the recipe with one `data.task_config`; everything else (model, warm start, budgets,
sampling, eval split) is the recipe's. Prints ``name: value`` lines per candidate and writes a markdown
table of the per-budget accuracy and cut share, with the thresholds, to `--out`/scan.md.

    python eval/warm_start_scan.py recipes/smollm2_anytime.yaml [--candidates sum-1d-4to6,sum-2d-4to6]
        [--budgets 6,12,18,24,30,36,42,48] [--limit 64] [--out runs/warm_start_scan]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# name -> reasoning-gym chain_sum config: longer chains and wider terms make the running totals longer
CANDIDATES = {
    "sum-1d-3to5": {"min_terms": 3, "max_terms": 5, "min_digits": 1, "max_digits": 1},
    "sum-1d-4to6": {"min_terms": 4, "max_terms": 6, "min_digits": 1, "max_digits": 1},
    "sum-2d-4to6": {"min_terms": 4, "max_terms": 6, "min_digits": 2, "max_digits": 2},
}
GAIN, TOP, CUT = 0.20, (0.3, 0.8), 0.5


def anytime(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "anytime.cli", *args], capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"anytime {' '.join(args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def scan_one(recipe: str, name: str, out: Path, budgets: str, limit: int) -> dict:
    """Warm start and per-budget eval of one candidate; the figures the thresholds read."""
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    config = "{" + ", ".join(f"{k}: {v}" for k, v in CANDIDATES[name].items()) + "}"
    resolved = folder / "recipe.yaml"
    resolved.write_text(anytime("config", recipe, f"data.task_config={config}", f"trainer.output_dir={folder}"))
    start = time.perf_counter()
    anytime("sft", str(resolved))
    sft_s = time.perf_counter() - start
    anytime("eval", "--recipe", str(resolved), "--model", str(folder / "sft_model"), "--budgets", budgets,
            "--limit", str(limit), "--out", str(folder / "eval"))
    per_model = json.loads((folder / "eval" / "results.json").read_text())["models"]
    result = next(iter(next(iter(per_model.values())).values()))   # the one model on the recipe's benchmark
    acc, cut = result["accuracy"], result["cut"]
    return {"budgets": result["budgets"], "accuracy": acc, "cut": cut, "gain": acc[-1] - acc[0], "top": acc[-1],
            "cut_at_smallest": cut[0], "sft_s": sft_s}


def fits(r: dict) -> bool:
    return r["gain"] >= GAIN and TOP[0] <= r["top"] <= TOP[1] and r["cut_at_smallest"] > CUT


def table(rows: dict[str, dict]) -> str:
    budgets = next(iter(rows.values()))["budgets"]
    lines = ["| candidate | " + " | ".join(f"acc@{b}" for b in budgets) + " | gain | cut at smallest | fits |",
             "|---|" + "---|" * (len(budgets) + 3)]
    for name, r in rows.items():
        lines.append(f"| {name} | " + " | ".join(f"{a:.3f}" for a in r["accuracy"])
                     + f" | {r['gain']:+.3f} | {r['cut_at_smallest']:.2f} | {'yes' if fits(r) else 'no'} |")
    lines.append("")
    lines.append(f"Fits: gain >= {GAIN}, accuracy at the largest budget in [{TOP[0]}, {TOP[1]}], "
                 f"cut share at the smallest budget > {CUT}.")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe")
    parser.add_argument("--candidates", default=",".join(CANDIDATES), help="comma-separated keys of CANDIDATES")
    parser.add_argument("--budgets", default="6,12,18,24,30,36,42,48")
    parser.add_argument("--limit", type=int, default=64, help="held-out problems per candidate")
    parser.add_argument("--out", default="runs/warm_start_scan")
    args = parser.parse_args()
    unknown = set(args.candidates.split(",")) - set(CANDIDATES)
    if unknown:
        parser.error(f"unknown candidates {sorted(unknown)}; choose from {sorted(CANDIDATES)}")
    out = Path(args.out)
    rows = {}
    for name in args.candidates.split(","):
        rows[name] = r = scan_one(args.recipe, name, out, args.budgets, args.limit)
        for key in ("gain", "top", "cut_at_smallest", "sft_s"):
            print(f"{name}_{key}: {r[key]:.3f}")
        print(f"{name}_fits: {int(fits(r))}", flush=True)
    (out / "scan.md").write_text(table(rows))
    print((out / "scan.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
