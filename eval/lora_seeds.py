"""LoRA against full fine-tuning on the quickstart, seed by seed.

For each seed: the quickstart's warm start (`anytime sft`, full fine-tuning, one thread), then RL with
`recipes/quickstart_lora.yaml` from it; the gain is the run's own held-out anytime score after RL minus
before (the quickstart's sampled eval, in training). Full fine-tuning's figures are the ladder's
AR-linear rung of the same seed (`eval/ablation/results.json`, same recipe, same eval): its warm start
is the same run, which this script checks by comparing the two warm starts' scores.

    python eval/lora_seeds.py --seeds 0,1,2,3,4                     # trains what is missing, then reports
    python eval/lora_seeds.py --seeds 0,1 --work runs/lora_quick     # a quicker look (about 14 min a seed)

Writes `results.json` and `table.md` under `--out` (default eval/ablation/lora).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from anytime.core.stats import mean_ci

REPO = Path(__file__).resolve().parents[1]
FULL_RUNG = "+vr (AR-linear)"      # the quickstart's rung of eval/ablation.py


def run(cmd: list[str]) -> None:
    subprocess.run([sys.executable, "-m", "anytime.cli", *cmd], check=True, cwd=REPO)


def lora_seed(seed: int, work: Path) -> dict:
    """Warm start and LoRA RL of one seed (each skipped when already done): its final_eval.json."""
    warm, lora = work / f"s{seed}", work / f"s{seed}_lora"
    common = [f"trainer.seed={seed}", "trainer.num_threads=1", "logging.progress=false"]
    if not (warm / "sft_model" / "config.json").is_file():
        run(["sft", "recipes/quickstart.yaml", *common, f"trainer.output_dir={warm}", f"model.path={warm}/init_model"])
    if not (lora / "final_eval.json").is_file():
        run(["train", "recipes/quickstart_lora.yaml", *common, f"model.path={warm}/sft_model", "model.tiny=false",
             "sft.steps=0", f"trainer.output_dir={lora}", "trainer.resume=never"])
    return json.loads((lora / "final_eval.json").read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "lora_seeds")
    parser.add_argument("--ablation", type=Path, default=REPO / "eval" / "ablation" / "results.json",
                        help="the ladder's results, for full fine-tuning's figures of the same seeds")
    parser.add_argument("--out", type=Path, default=REPO / "eval" / "ablation" / "lora")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    ladder = json.loads(args.ablation.read_text())["per_seed"]
    missing = [s for s in seeds if str(s) not in ladder]
    if missing:
        parser.error(f"seeds {missing} are not in {args.ablation}; run eval/ablation.py on them first")
    rows = []
    for seed in seeds:
        ev = lora_seed(seed, args.work)
        sampled = ladder[str(seed)]["_eval"]["sampled"]
        rows.append({"seed": seed, "lora_before": ev["before"]["eval/anytime"], "lora_after": ev["after"]["eval/anytime"],
                     "full_before": statistics.fmean(sampled["warm start"]),
                     "full_after": statistics.fmean(sampled[FULL_RUNG])})
    for r in rows:
        r["lora_gain"], r["full_gain"] = r["lora_after"] - r["lora_before"], r["full_after"] - r["full_before"]
        r["same_warm_start"] = abs(r["lora_before"] - r["full_before"]) < 1e-9
    summary = {k: mean_ci([r[k] for r in rows]) for k in ("lora_gain", "full_gain")}
    summary["lora_minus_full"] = mean_ci([r["lora_gain"] - r["full_gain"] for r in rows])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"seeds": seeds, "per_seed": rows, "summary": summary}, indent=1))
    lines = ["| seed | warm start | LoRA after | LoRA gain | full FT after | full FT gain | LoRA − full |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        mark = "" if r["same_warm_start"] else " (warm starts differ!)"
        lines.append(f"| {r['seed']} | {r['lora_before']:.3f}{mark} | {r['lora_after']:.3f} | {r['lora_gain']:+.3f} | "
                     f"{r['full_after']:.3f} | {r['full_gain']:+.3f} | {r['lora_gain'] - r['full_gain']:+.3f} |")
    fmt = {k: f"{m:+.3f} ± {h:.3f}" for k, (m, h) in summary.items()}
    lines.append(f"| mean ± 95% CI | | | {fmt['lora_gain']} | | {fmt['full_gain']} | {fmt['lora_minus_full']} |")
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
