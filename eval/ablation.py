"""The paper's ablation ladder (Table 3) in small, over seeds: GRPO → + linear prior (dense budget
rewards) → + decoupled summaries → + variance reduction (BRPO = AR-linear) → AR-uniform.

For every seed one tiny model is built and warm-started (the quickstart's SFT stage, that seed), then
every variant trains from it with the same prompts per step, traces per prompt and steps. The warm start
and every variant's final checkpoint are then scored by `anytime eval` at the same budgets on the same
held-out problems under two protocols: the recipe's own eval, which for the quickstart samples as the
paper validates (temperature 0.6, top-p 0.95, 8 traces per problem), and greedy (one trace per
problem), which hides the filler lines the task rewards dropping (eval/heldout/README.md). Reported
over seeds, per protocol: the
mean ± 95% CI (Student t) of the anytime score (mean accuracy over the budgets), of its gain over the
warm start and of the accuracy at every budget, and each variant's paired difference from GRPO. The
"+vr (AR-linear)" variant is the quickstart recipe itself, so its gains are the quickstart's over seeds.

    python eval/ablation.py --seeds 0,1,2,3,4 [--steps N] [--work runs/ablation] [--out eval/ablation]
                            [--extend-from runs/shorter_sweep] [key=value ...]

Runs already finished under --work are reused, so an interrupted sweep continues where it stopped, and
two processes given different seeds (the same --work, and `trainer.num_threads=1` so that they do not
oversubscribe the cores) split a sweep over two cores; a last call with every seed then only gathers.
`--extend-from OLD` makes a longer sweep from a shorter one: every run resumes from OLD's last
checkpoint (warm starts are linked, not rebuilt). With the constant learning rate and no warmup this
requires, and the exact resume (tests/trainer/test_trainer.py), that is the same run as one trained from scratch
for --steps. Scores are cached per seed (`eval_<protocol>.json` under --work) until a run of that seed
is newer. Writes results.json, table.md, ablation.png (sampled), ablation_greedy.png and sft_loss.png
(every seed's warm-start loss curve) to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from anytime.config import load_recipe
from anytime.core.stats import mean_ci

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = str(REPO / "recipes" / "quickstart.yaml")


def ladder(budgets: list[int]) -> dict[str, list[str]]:
    """The rungs as recipe overrides for a budget grid: each changes one factor of the one above it (the
    paper's n_summary / summary_method / budgets / prior / variance_reduction). GRPO is rewarded at the
    largest budget only."""
    dense = [f"budget.budgets=[{','.join(map(str, budgets))}]"]
    return {
        "GRPO": [f"budget.budgets=[{budgets[-1]}]", "budget.prior=base", "summary.n=1", "summary.estimator=grpo",
                 "algorithm.variance_reduction=v2only"],
        "+linear": [*dense, "budget.prior=linear", "summary.n=1", "summary.estimator=grpo",
                    "algorithm.variance_reduction=v2only"],
        "+decouple": [*dense, "budget.prior=linear", "summary.n=2", "summary.estimator=brpo",
                      "algorithm.variance_reduction=v2only"],
        "+vr (AR-linear)": [*dense, "budget.prior=linear", "summary.n=2", "summary.estimator=brpo",
                            "algorithm.variance_reduction=brpo"],
        "AR-uniform": [*dense, "budget.prior=uniform", "summary.n=2", "summary.estimator=brpo",
                       "algorithm.variance_reduction=brpo"],
    }


LADDER = ladder([16, 32, 48, 64])   # the quickstart's grid: the names, and what results.json records for it

WARM = "warm start"


@dataclass(frozen=True)
class Sweep:
    """What every run of a sweep shares: its recipe file and that recipe's budget grid, which the rungs follow."""

    recipe: str
    budgets: list[int]

    @property
    def rungs(self) -> dict[str, list[str]]:
        return ladder(self.budgets)


@dataclass(frozen=True)
class Protocol:
    """How policies are scored: `anytime eval` flags over the sweep's recipe (which gives the summaries,
    the problems and the sampling seed)."""

    name: str
    title: str
    flags: tuple[str, ...]


def protocols(recipe: Any) -> list[Protocol]:
    """The recipe's own eval (the quickstart's samples as the paper validates) and greedy decoding."""
    ev = recipe.eval
    return [Protocol("sampled", f"sampled as the paper validates (temperature {ev.temperature}, top-p {ev.top_p}, "
                                f"{ev.samples} traces per problem)",
                     ("--temperature", str(ev.temperature), "--top-p", str(ev.top_p), "--samples", str(ev.samples))),
            Protocol("greedy", "greedy (one trace per problem)", ("--temperature", "0", "--samples", "1"))]


def run_name(variant: str) -> str:
    return variant.split()[0].strip("+").lower().replace("-", "_")


def continue_from(old: Path, run: Path, steps: int) -> float:
    """Copy a shorter sweep's finished run to `run`, to be resumed from its last checkpoint; its wall
    seconds so far."""
    from anytime.learner.checkpoint import list_checkpoints

    saved = list_checkpoints(old / "checkpoints")
    if not (old / "final_eval.json").is_file() or not saved:
        raise FileNotFoundError(f"--extend-from: {old} is not a finished run with a checkpoint; finish that sweep first")
    if int(saved[-1].name.removeprefix("step_")) >= steps:
        raise ValueError(f"--extend-from: {saved[-1]} is not shorter than --steps {steps}")
    if not run.exists():
        shutil.copytree(old, run, ignore=shutil.ignore_patterns("final_eval.json"))
    return float((old / "ablation_seconds.txt").read_text())


def run_seed(sweep: Sweep, seed: int, steps: int, work: Path, variants: list[str], overrides: list[str],
             scoring: list[Protocol], extend_from: Path | None = None,
             warm_from: Path | None = None) -> dict[str, dict]:
    """Warm start for one seed, then every variant from it; the wall seconds of each run (RL plus its
    two in-training evals; an extended run's include the shorter run's) and, under `_eval`, every
    policy's held-out accuracy per budget under each protocol. The warm start is linked from
    `extend_from`, or from `warm_from` (another sweep's --work) where that holds a finished one, else built."""
    from anytime.trainer.launch import launch_train, prepare_model

    base = [f"trainer.seed={seed}", "logging.progress=false", "logging.tensorboard=false", *overrides]
    shared = work / f"seed{seed}" / "warm_start"
    source = None
    if extend_from is not None:
        source = extend_from / f"seed{seed}" / "warm_start"
    elif warm_from is not None and (warm_from / f"seed{seed}" / "warm_start" / "sft_model" / "sft_done.txt").is_file():
        source = warm_from / f"seed{seed}" / "warm_start"   # a seed --warm-starts-from lacks builds its own
    if source is not None and not shared.exists():
        shared.parent.mkdir(parents=True, exist_ok=True)
        shared.symlink_to(source.resolve(), target_is_directory=True)
    sft = prepare_model(load_recipe(sweep.recipe, base + [f"trainer.output_dir={shared}", f"model.path={shared}/init"]))
    curve = json.loads((Path(sft) / "sft_loss.json").read_text())
    out: dict[str, dict] = {"_warm_start": {"path": str(sft), "sft_seconds": curve["seconds"],
                                            "sft_loss": [round(x, 4) for x in curve["loss"]]}}
    for name in variants:
        run = work / f"seed{seed}" / run_name(name)
        done, timing = run / "final_eval.json", run / "ablation_seconds.txt"
        if not done.is_file():
            earlier = 0.0
            if extend_from is not None:
                earlier = continue_from(extend_from / f"seed{seed}" / run_name(name), run, steps)
            common = base + [f"model.path={sft}", "model.tiny=false", "sft.steps=0", f"trainer.steps={steps}",
                             f"trainer.output_dir={run}", f"eval.budgets={sweep.budgets}",
                             f"trainer.save_every={steps}",
                             "trainer.resume=never" if extend_from is None else "trainer.resume=auto"]
            start = time.perf_counter()
            if launch_train(sweep.recipe, common + sweep.rungs[name]) != 0:
                raise RuntimeError(f"seed {seed}, {name}: training failed (see {run})")
            timing.write_text(f"{earlier + time.perf_counter() - start:.1f}\n")
        out[name] = {"seconds": float(timing.read_text()) if timing.is_file() else None}
    models = {WARM: Path(sft), **{name: final_checkpoint(work / f"seed{seed}" / run_name(name)) for name in variants}}
    out["_eval"] = {protocol.name: score(sweep, models, work / f"seed{seed}", protocol, base) for protocol in scoring}
    return out


def final_checkpoint(run: Path) -> Path:
    from anytime.learner.checkpoint import list_checkpoints

    saved = list_checkpoints(run / "checkpoints")
    if not saved:
        raise FileNotFoundError(f"{run} has no checkpoint to evaluate; delete its final_eval.json to train it again")
    return saved[-1]


def score(sweep: Sweep, models: dict[str, Path], folder: Path, protocol: Protocol,
          overrides: list[str]) -> dict[str, list[float]]:
    """Accuracy at every budget of each model, by one `anytime eval` under `protocol` with the sweep's
    recipe; cached in `folder/eval_<protocol>.json` while no model is newer than the cache."""
    cache = folder / f"eval_{protocol.name}.json"
    paths = {name: str(path) for name, path in models.items()}
    if cache.is_file() and max(p.stat().st_mtime for p in models.values()) < cache.stat().st_mtime:
        cached = json.loads(cache.read_text())
        if cached["models"] == paths and cached["flags"] == list(protocol.flags):
            return cached["accuracy"]
    recipe = load_recipe(sweep.recipe, overrides)   # trainer.seed among them: the seed's held-out problems
    recipe_file, out = folder / "eval_recipe.yaml", folder / f"eval_{protocol.name}"
    recipe_file.write_text(recipe.to_yaml())
    cmd = [sys.executable, "-m", "anytime.cli", "eval", "--recipe", str(recipe_file),
           "--budgets", ",".join(map(str, sweep.budgets)), "--out", str(out), *protocol.flags,
           *(arg for path in paths.values() for arg in ("--model", path))]
    # the thread count of the training runs, so that two sweeps side by side do not oversubscribe the cores
    env = {**os.environ, "OMP_NUM_THREADS": str(recipe.trainer.num_threads)}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    results = json.loads((out / "results.json").read_text())["models"]
    accuracy = {name: results[path]["synthetic"]["accuracy"] for name, path in paths.items()}
    cache.write_text(json.dumps({"models": paths, "flags": list(protocol.flags), "accuracy": accuracy}, indent=1))
    return accuracy


def summarise(raw: dict[int, dict[str, dict]], variants: list[str], protocol: str) -> dict[str, dict]:
    seeds = sorted(raw)
    n_budgets = len(raw[seeds[0]]["_eval"][protocol][WARM])
    acc = {s: raw[s]["_eval"][protocol] for s in seeds}   # {seed: {policy: accuracy at every budget}}
    stats: dict[str, dict] = {}
    warm = [statistics.fmean(acc[s][WARM]) for s in seeds]
    stats[WARM] = {"anytime": mean_ci(warm), "acc": [mean_ci([acc[s][WARM][j] for s in seeds]) for j in range(n_budgets)]}
    for name in variants:
        after = [statistics.fmean(acc[s][name]) for s in seeds]
        stats[name] = {
            "anytime": mean_ci(after),
            "gain": mean_ci([a - w for a, w in zip(after, warm)]),
            "gain_per_seed": [a - w for a, w in zip(after, warm)],
            "seconds": [raw[s][name].get("seconds") for s in seeds],
            "acc": [mean_ci([acc[s][name][j] for s in seeds]) for j in range(n_budgets)],
            "vs_grpo": mean_ci([a - statistics.fmean(acc[s]["GRPO"]) for a, s in zip(after, seeds)])
            if "GRPO" in variants else None,
            "acc_vs_grpo": [mean_ci([acc[s][name][j] - acc[s]["GRPO"][j] for s in seeds])
                            for j in range(n_budgets)] if "GRPO" in variants else None,
        }
    return stats


def table(stats: dict[str, dict], seeds: list[int], steps: int, protocol: Protocol, budgets: list[int]) -> str:
    def fmt(m: tuple[float, float]) -> str:
        return f"{m[0]:.3f} ± {m[1]:.3f}"

    head = ["policy", "anytime score", "gain over warm start", "vs GRPO (paired)", *(f"acc@{b}" for b in budgets)]
    lines = [f"## Scored {protocol.title}", "",
             f"Seeds {', '.join(map(str, seeds))}; {steps} RL steps; mean ± 95% CI over seeds.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, s in stats.items():
        row = [name, fmt(s["anytime"]), fmt(s["gain"]) if "gain" in s else "—",
               fmt(s["vs_grpo"]) if s.get("vs_grpo") and name != "GRPO" else "—", *(fmt(a) for a in s["acc"])]
        lines.append("| " + " | ".join(row) + " |")
    paired = [(name, s["acc_vs_grpo"]) for name, s in stats.items() if s.get("acc_vs_grpo") and name != "GRPO"]
    if paired:
        lines += ["", "Paired differences from GRPO at every budget:", "",
                  "| policy | " + " | ".join(f"acc@{b}" for b in budgets) + " |", "|---" * (len(budgets) + 1) + "|"]
        lines += [f"| {name} | " + " | ".join(f"{m:+.3f} ± {h:.3f}" for m, h in diffs) + " |" for name, diffs in paired]
    lines += ["", "Gain in anytime score over each seed's warm start, and the wall time of each run (RL and its two "
              "evals; runs of different seeds may have shared the machine):", "",
              "| policy | " + " | ".join(f"seed {x}" for x in seeds) + " | worst | mean s per run |",
              "|---" * (len(seeds) + 3) + "|"]
    for name, s in stats.items():
        if "gain_per_seed" in s:
            secs = [x for x in s["seconds"] if x is not None]
            lines.append(f"| {name} | " + " | ".join(f"{g:+.3f}" for g in s["gain_per_seed"])
                         + f" | {min(s['gain_per_seed']):+.3f} | {statistics.fmean(secs) if secs else float('nan'):.0f} |")
    return "\n".join(lines) + "\n\n"


def plot(stats: dict[str, dict], path: Path, protocol: Protocol, budgets: list[int], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    colours = {name: "grey" if name == "warm start" else f"C{k}" for k, name in enumerate(stats)}  # one per policy, both panels
    for k, (name, s) in enumerate(stats.items()):
        offset = (k - len(stats) / 2) * 0.6
        left.errorbar([b + offset for b in budgets], [m for m, _ in s["acc"]], yerr=[h for _, h in s["acc"]],
                      marker="o", capsize=3, label=name, color=colours[name],
                      linestyle="--" if name == "warm start" else "-")
    left.set_xlabel("thinking budget (tokens)")
    left.set_ylabel(f"held-out accuracy ({protocol.name})")
    left.set_ylim(0, 1)
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    names = list(stats)
    right.bar(names, [stats[n]["anytime"][0] for n in names], yerr=[stats[n]["anytime"][1] for n in names],
              capsize=4, color=[colours[n] for n in names])
    right.set_ylabel("anytime score (mean over budgets)")
    right.tick_params(axis="x", rotation=25)
    right.grid(alpha=0.3, axis="y")
    fig.suptitle(f"ablation ladder on {title}, scored {protocol.title}\n"
                 "(mean ± 95% CI over seeds)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def warm_start_table(raw: dict[int, dict[str, dict]], recipe: Any, budgets: list[int]) -> str:
    """Each seed's warm start: its SFT loss, per-skill losses (which skill a failed one lacks) and held-out
    scores under both protocols."""
    from warm_start_seeds import skill_losses  # a sibling script in eval/

    lines = ["## Warm starts", "", "The quickstart's SFT stage, one per seed; loss curves in sft_loss.png. Skill losses: "
             "cross-entropy in nats of the digit a trace line asks for, on held-out traces (log 10 = 2.303 is a "
             "uniform guess):", "",
             "| seed | SFT loss (last 50 steps) | SFT s | copy | operand | sum | anytime, sampled | anytime, greedy | "
             + " | ".join(f"acc@{b}, sampled" for b in budgets) + " |", "|---" * (len(budgets) + 8) + "|"]
    for s in sorted(raw):
        w, sampled, greedy = raw[s]["_warm_start"], raw[s]["_eval"]["sampled"][WARM], raw[s]["_eval"]["greedy"][WARM]
        skills = skill_losses(recipe, w["path"])
        lines.append(f"| {s} | {statistics.fmean(w['sft_loss'][-50:]):.4f} | {w['sft_seconds']:.0f} | "
                     + " | ".join(f"{skills.get(k, float('nan')):.3f}" for k in ("copy", "operand", "sum"))
                     + f" | {statistics.fmean(sampled):.3f} | {statistics.fmean(greedy):.3f} | "
                     + " | ".join(f"{a:.3f}" for a in sampled) + " |")
    return "\n".join(lines) + "\n"


def plot_warm_starts(raw: dict[int, dict[str, dict]], path: Path, recipe: Any) -> None:
    """Every seed's SFT loss curve (10-step means) against the task's loss floors, labelled with the
    warm start's held-out anytime score (sampled): a failed warm start shows as a curve stuck on a floor."""
    from warm_start_seeds import loss_floors, plot_losses  # a sibling script in eval/

    seeds = sorted(raw)
    runs = [{"seed": s, "anytime": statistics.fmean(raw[s]["_eval"]["sampled"][WARM]),
             "loss": raw[s]["_warm_start"]["sft_loss"]} for s in seeds]
    init = str(Path(raw[seeds[0]]["_warm_start"]["path"]).parent / "init")  # any seed's tokenizer: they are the same
    floors = loss_floors(recipe, init)
    plot_losses({"arms": {"quickstart warm start, every seed": {"seeds": runs}}, "loss_floors": floors}, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--recipe", default=QUICKSTART, help="the recipe every rung overrides (default: quickstart)")
    parser.add_argument("--steps", type=int, default=None, help="RL steps per variant (default: the quickstart's)")
    parser.add_argument("--variants", default=",".join(LADDER), help="a comma list of: " + ", ".join(LADDER))
    parser.add_argument("--work", default="runs/ablation")
    parser.add_argument("--out", default=str(REPO / "eval" / "ablation"))
    parser.add_argument("--extend-from", type=Path, default=None,
                        help="a shorter sweep's --work: resume every run from its last checkpoint")
    parser.add_argument("--warm-starts-from", type=Path, default=None,
                        help="another sweep's --work whose warm starts this sweep shares (the same model, data and "
                             "sft sections): a seed's finished warm start there is linked, not rebuilt")
    parser.add_argument("overrides", nargs="*", help="recipe overrides for every run, warm start included (key.path=value)")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    recipe = load_recipe(args.recipe, args.overrides)
    sweep = Sweep(args.recipe, recipe.budget.grid())
    if args.steps is None:  # AR-uniform is then the quickstart run itself
        args.steps = recipe.trainer.steps
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in sweep.rungs]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(sweep.rungs)}")
    if recipe.eval.temperature <= 0:
        parser.error("the sampled protocol is the recipe's eval: give eval.temperature > 0 (greedy is scored too)")
    if args.extend_from is not None and (recipe.learner.lr_schedule != "constant" or recipe.learner.warmup_steps):
        parser.error("--extend-from needs learner.lr_schedule=constant and learner.warmup_steps=0: with a schedule "
                     "a longer run's learning rates differ from the shorter run's; run the sweep from scratch")
    scoring = protocols(recipe)
    raw = {seed: run_seed(sweep, seed, args.steps, Path(args.work), variants, args.overrides, scoring, args.extend_from,
                          args.warm_starts_from) for seed in seeds}
    stats = {p.name: summarise(raw, variants, p.name) for p in scoring}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"seeds": seeds, "steps": args.steps, "recipe": args.recipe,
                                                  "budgets": sweep.budgets, "ladder": sweep.rungs, "protocols": {p.name: p.flags for p in scoring}, "overrides": args.overrides,
                                                  "per_seed": raw, "summary": stats}, indent=1))
    text = "".join(table(stats[p.name], seeds, args.steps, p, sweep.budgets) for p in scoring)
    text += warm_start_table(raw, recipe, sweep.budgets)
    title = "the synthetic task" if args.recipe == QUICKSTART else f"{Path(args.recipe).stem} (synthetic task)"
    (out / "table.md").write_text(text)
    for p in scoring:
        plot(stats[p.name], out / ("ablation.png" if p.name == "sampled" else f"ablation_{p.name}.png"), p,
             sweep.budgets, title)
    plot_warm_starts(raw, out / "sft_loss.png", recipe)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
