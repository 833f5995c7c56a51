"""A variant of the quickstart against the quickstart itself, seed by seed, paired.

For each seed: the quickstart's warm start (`anytime sft`, one thread), then RL with the variant from
it; the gain is the run's own held-out anytime score after RL minus before (the quickstart's sampled
eval, in training). The quickstart's figures, against which each seed is paired, come from
`--baseline`:

- `rerun` (the default): the quickstart's RL run here from the same warm start (the same machine and
  build, so the pair differs only by the variant); `--against VARIANT` pairs with another variant's
  rerun instead (e.g. in-flight on vLLM against lock-step on vLLM, so only the mode differs);
- `ladder`: the AR-linear rung of the same seed in `eval/ablation/results.json` (same recipe, same
  eval). Its warm start is the same run only on the machine and build that made the ladder, which
  this script checks by comparing the two warm starts' scores (`quickstart` as the variant re-runs
  the rung itself, to check that it reproduces).

    python eval/variant_seeds.py lora --seeds 0,1,2,3,4        # trains what is missing, then reports
    python eval/variant_seeds.py locked-k1 --seeds 0,1,2,3,4
    python eval/variant_seeds.py inflight-k2 --seeds 0,1,2,3,4
    python eval/variant_seeds.py inflight-vllm-k2 --against vllm --seeds 0,1,2,3,4
    python eval/variant_seeds.py inflight-vllm-async-k2 --against vllm --seeds 0,1,2,3,4
    python eval/variant_seeds.py lora --seeds 0 --work runs/quick   # a quicker look (about 17 min a seed)

Writes `results.json` and `table.md` under `--out` (default eval/ablation/VARIANT).
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
# training metrics reported as each run's mean over its steps (staleness, off-policy weights, PPO's clip)
RUN_METRICS = ("rollout/version_lag", "rollout/token_version_lag", "rollout/token_version_lag_max",
               "rollout/mixed_version_traces", "train/logprob_mismatch", "update/clip_frac", "offpolicy/is_weight_mean",
               "offpolicy/is_weight_max", "offpolicy/is_clipped_frac", "offpolicy/is_ess")
# name -> (recipe, overrides) of the RL phase; the warm start is always the quickstart's
VARIANTS = {
    "quickstart": ("recipes/quickstart.yaml", []),
    "lora": ("recipes/quickstart_lora.yaml", []),
    "locked-k1": ("recipes/quickstart.yaml", ["rollout.max_staleness=1"]),
    "locked-k1-tis": ("recipes/quickstart.yaml", ["rollout.max_staleness=1", "algorithm.offpolicy_correction=tis"]),
    # in flight needs workers of their own: one Ray actor beside the learner
    "inflight-k2": ("recipes/quickstart.yaml", ["rollout.max_staleness=2", "rollout.staleness_mode=inflight",
                                                "rollout.placement=ray"]),
    # the quickstart on the vLLM engine: lock-step, and in flight (a worker process of its own beside the learner)
    "vllm": ("recipes/quickstart.yaml", ["rollout.engine=vllm"]),
    "inflight-vllm-k2": ("recipes/quickstart.yaml", ["rollout.engine=vllm", "rollout.max_staleness=2",
                                                     "rollout.staleness_mode=inflight", "rollout.placement=processes"]),
    # the same on vLLM's AsyncLLM frontend: swaps pause the running engine core wherever it is
    "inflight-vllm-async-k2": ("recipes/quickstart.yaml", ["rollout.engine=vllm", "rollout.vllm_frontend=async",
                                                           "rollout.max_staleness=2", "rollout.staleness_mode=inflight",
                                                           "rollout.placement=processes"]),
}


def run(cmd: list[str]) -> None:
    subprocess.run([sys.executable, "-m", "anytime.cli", *cmd], check=True, cwd=REPO)


def run_metrics(run_dir: Path) -> dict[str, float]:
    """The mean over the run's steps of each of RUN_METRICS it logged."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "time/step" in r]
    return {k: statistics.fmean(r[k] for r in steps) for k in RUN_METRICS if steps and all(k in r for r in steps)}


def variant_seed(variant: str, seed: int, work: Path) -> tuple[dict, dict[str, float]]:
    """Warm start and the variant's RL of one seed (each skipped when already done): its final_eval.json
    and its training metrics."""
    recipe, overrides = VARIANTS[variant]
    warm, run_dir = work / f"s{seed}", work / f"s{seed}_{variant.replace('-', '_')}"
    common = [f"trainer.seed={seed}", "trainer.num_threads=1", "logging.progress=false"]
    if not (warm / "sft_model" / "config.json").is_file():
        run(["sft", "recipes/quickstart.yaml", *common, f"trainer.output_dir={warm}", f"model.path={warm}/init_model"])
    if not (run_dir / "final_eval.json").is_file():
        run(["train", recipe, *common, f"model.path={warm}/sft_model", "model.tiny=false", "sft.steps=0",
             f"trainer.output_dir={run_dir}", "trainer.resume=never", *overrides])
    return json.loads((run_dir / "final_eval.json").read_text()), run_metrics(run_dir)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variant", choices=sorted(VARIANTS))
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "variant_seeds")
    parser.add_argument("--baseline", choices=("rerun", "ladder"), default="rerun")
    parser.add_argument("--against", choices=sorted(VARIANTS), default="quickstart",
                        help="with --baseline rerun: the variant each seed is paired with (default the quickstart)")
    parser.add_argument("--ablation", type=Path, default=REPO / "eval" / "ablation" / "results.json",
                        help="the ladder's results, for full fine-tuning's figures of the same seeds")
    parser.add_argument("--out", type=Path, default=None, help="default eval/ablation/VARIANT")
    args = parser.parse_args()
    out = args.out or REPO / "eval" / "ablation" / args.variant
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.baseline == "rerun" and args.variant == args.against:
        parser.error(f"{args.variant} against its own rerun is no comparison: pick another --against "
                     "(or --baseline ladder for the quickstart)")
    ladder = json.loads(args.ablation.read_text())["per_seed"] if args.baseline == "ladder" else {}
    missing = [s for s in seeds if args.baseline == "ladder" and str(s) not in ladder]
    if missing:
        parser.error(f"seeds {missing} are not in {args.ablation}; run eval/ablation.py on them first")
    rows = []
    for seed in seeds:
        ev, metrics = variant_seed(args.variant, seed, args.work)
        if args.baseline == "ladder":
            sampled = ladder[str(seed)]["_eval"]["sampled"]
            full_before, full_after = statistics.fmean(sampled["warm start"]), statistics.fmean(sampled[FULL_RUNG])
        else:
            base, _ = variant_seed(args.against, seed, args.work)
            full_before, full_after = base["before"]["eval/anytime"], base["after"]["eval/anytime"]
        rows.append({"seed": seed, "variant_before": ev["before"]["eval/anytime"],
                     "variant_after": ev["after"]["eval/anytime"], "full_before": full_before,
                     "full_after": full_after, "run_metrics": metrics})
    for r in rows:
        r["variant_gain"], r["full_gain"] = r["variant_after"] - r["variant_before"], r["full_after"] - r["full_before"]
        r["same_warm_start"] = abs(r["variant_before"] - r["full_before"]) < 1e-9
        r["paired"] = r["variant_gain"] - r["full_gain"]
    summary = {k: mean_ci([r[k] for r in rows]) for k in ("variant_gain", "full_gain", "paired")}
    out.mkdir(parents=True, exist_ok=True)
    against = args.against if args.baseline == "rerun" else "quickstart (ladder)"
    (out / "results.json").write_text(json.dumps({"variant": args.variant, "baseline": args.baseline, "against": against,
                                                  "recipe": VARIANTS[args.variant],
                                                  "seeds": seeds, "per_seed": rows, "summary": summary}, indent=1))
    v = args.variant
    a = args.against if args.baseline == "rerun" else "quickstart"
    lines = [f"| seed | warm start | {v} after | {v} gain | {a} after | {a} gain | {v} − {a} |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        mark = "" if r["same_warm_start"] else " (warm starts differ!)"
        lines.append(f"| {r['seed']} | {r['variant_before']:.3f}{mark} | {r['variant_after']:.3f} | "
                     f"{r['variant_gain']:+.3f} | {r['full_after']:.3f} | {r['full_gain']:+.3f} | {r['paired']:+.3f} |")
    fmt = {k: f"{m:+.3f} ± {h:.3f}" for k, (m, h) in summary.items()}
    lines.append(f"| mean ± 95% CI | | | {fmt['variant_gain']} | | {fmt['full_gain']} | {fmt['paired']} |")
    keys = [k for k in RUN_METRICS if all(k in r["run_metrics"] for r in rows)]
    if keys:   # the runs' own training metrics, mean over steps then over seeds
        lines += ["", "| training metric (mean over steps) | mean ± 95% CI over seeds |", "|---|---|"]
        for k in keys:
            m, h = mean_ci([r["run_metrics"][k] for r in rows])
            lines.append(f"| `{k}` | {m:.4g} ± {h:.2g} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
