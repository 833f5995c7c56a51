"""How long each rung of an ablation sweep thinks: the paper's claim that dense rewards shorten thinking.

Reads the held-out samples `eval/ablation.py` scored (`<work>/seed<N>/eval_<protocol>/samples.jsonl`, with
the policy of each model path from `eval_<protocol>.json`) and reports, per policy, the mean thinking
length in tokens (capped at the sweep's largest budget, where generation stops) and the share of traces
that end on their own within it; mean ± 95% CI over seeds, and each rung's paired difference from GRPO.

    python eval/thinking_lengths.py --work runs/binding --seeds 0,1,2,3,4,5,6,7,8,9 [--protocol sampled]
                                    [--out eval/ablation/binding/lengths.md]

Prints `name: value` lines; with --out also writes them as a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from ablation import run_name  # a sibling script in eval/: the rungs' short names

from anytime.core.stats import mean_ci

BASELINE = "GRPO"


def seed_lengths(folder: Path, protocol: str) -> dict[str, tuple[float, float]]:
    """{policy: (mean thinking tokens, share ending on their own)} over one seed's scored samples."""
    named = json.loads((folder / f"eval_{protocol}.json").read_text())["models"]   # {policy: model path}
    policies = {path: name for name, path in named.items()}
    lengths: dict[str, list[int]] = defaultdict(list)
    ended: dict[str, list[bool]] = defaultdict(list)
    with open(folder / f"eval_{protocol}" / "samples.jsonl") as rows:
        for line in rows:
            row = json.loads(line)
            name = policies.get(row["model"])
            if name is None:
                raise ValueError(f"{folder}: sample of {row['model']!r}, which eval_{protocol}.json does not name")
            lengths[name].append(row["thinking_length"])
            ended[name].append(bool(row["natural_end"]))
    return {name: (statistics.fmean(lengths[name]), statistics.fmean(ended[name])) for name in lengths}


def summarise(per_seed: dict[int, dict[str, tuple[float, float]]]) -> dict[str, dict[str, tuple[float, float]]]:
    seeds = sorted(per_seed)
    names = list(per_seed[seeds[0]])
    stats = {}
    for name in names:
        length = [per_seed[s][name][0] for s in seeds]
        share = [per_seed[s][name][1] for s in seeds]
        stats[name] = {"length": mean_ci(length), "ended": mean_ci(share)}
        if BASELINE in names and name != BASELINE:
            stats[name]["length_vs_grpo"] = mean_ci([x - per_seed[s][BASELINE][0] for x, s in zip(length, seeds)])
            stats[name]["ended_vs_grpo"] = mean_ci([x - per_seed[s][BASELINE][1] for x, s in zip(share, seeds)])
    return stats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="the sweep's --work")
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--protocol", default="sampled")
    parser.add_argument("--out", type=Path, default=None, help="a markdown file to write the table to")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    stats = summarise({s: seed_lengths(args.work / f"seed{s}", args.protocol) for s in seeds})

    def fmt(m: tuple[float, float], digits: int) -> str:
        return f"{m[0]:.{digits}f} ± {m[1]:.{digits}f}"

    def signed(m: tuple[float, float] | None, digits: int) -> str:
        return "—" if m is None else f"{m[0]:+.{digits}f} ± {m[1]:.{digits}f}"

    lines = [f"Thinking lengths on held-out problems ({args.protocol}), seeds {args.seeds}; mean ± 95% CI over seeds.",
             "", "| policy | thinking tokens | vs GRPO (paired) | ends on its own | vs GRPO (paired) |",
             "|---|---|---|---|---|"]
    for name, s in stats.items():
        key = run_name(name)
        print(f"{key}_thinking_tokens: {s['length'][0]:.2f} ± {s['length'][1]:.2f}")
        print(f"{key}_ends_on_its_own: {s['ended'][0]:.3f} ± {s['ended'][1]:.3f}")
        lines.append(f"| {name} | {fmt(s['length'], 1)} | {signed(s.get('length_vs_grpo'), 1)} | "
                     f"{fmt(s['ended'], 3)} | {signed(s.get('ended_vs_grpo'), 3)} |")
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
