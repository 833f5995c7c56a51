"""How much room the quickstart task leaves above a warm start: the anytime score of the reference
policy without filler lines.

That policy writes the reference trace ("1: 3+6=9", one line per step) with no filler, so a cut at
budget b leaves it the answer when the whole trace fits in b tokens; otherwise its summary guesses one
digit in ten. It is about the ceiling of the trace format the warm start learns: a summary after a cut
can do a little better than a blind guess (it may add the last line's operands itself), and a policy
that invented a shorter format could pass it further; none here does. For each seed's held-out eval
set (the trainer's own: 200 problems, the recipe's budgets) this prints its accuracy per budget and
anytime score, and with `--ablation results.json` the warm start's and each variant's score against it
under each of the ablation's eval protocols.

    python eval/headroom.py [--seeds 0,1,2,3,4] [--ablation eval/ablation/results.json] [--recipe R.yaml]

Prints `name: value` lines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = str(REPO / "recipes" / "quickstart.yaml")
GUESS = 0.1  # one digit in ten


def format_ceiling(rows: list[Any], tokenizer: Any, budgets: list[int], ops: tuple[int, int]) -> dict[int, float]:
    """Accuracy per budget of the no-filler reference policy on `rows` (synthetic PromptRows)."""
    from anytime.tasks.synthetic import make_problems

    # ids are `synthetic-<draw seed>-<index>` (anytime.data.prompts.synthetic_rows): redraw the same problems
    keys = [(int(seed), int(i)) for seed, i in (row.id.split("-")[1:] for row in rows)]
    draws = {seed: make_problems(max(i for s, i in keys if s == seed) + 1, seed, *ops) for seed, _ in keys}
    lengths = []
    for row, (seed, i) in zip(rows, keys):
        problem = draws[seed][i]
        if problem.problem != row.problem:
            raise ValueError(f"row {row.id} is not the synthetic problem its id names")
        trace = problem.thinking(None, 0.0, whole_sums=True).rstrip("\n")
        lengths.append(len(tokenizer(trace, add_special_tokens=False)["input_ids"]))
    return {b: statistics.fmean(1.0 if n <= b else GUESS for n in lengths) for b in budgets}


def quickstart_tokenizer() -> Any:
    """The quickstart's tokenizer (trained on the fixed synthetic corpus: the same for every seed)."""
    from transformers import AutoTokenizer

    from anytime.tasks import synthetic
    from anytime.models.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:  # the builder writes a (here tiny) model beside it
        return AutoTokenizer.from_pretrained(build_tiny_model(tmp, synthetic.corpus(), hidden_size=16,
                                                              num_layers=1, num_heads=1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--recipe", default=QUICKSTART, help="a synthetic-task recipe (default: quickstart)")
    parser.add_argument("--ablation", type=Path, default=None, help="an eval/ablation.py results.json to set against it")
    args = parser.parse_args()
    from anytime.config import load_recipe
    from anytime.config.answer_format import eval_budgets
    from anytime.data.benchmarks import load_benchmark

    recipe = load_recipe(args.recipe)
    budgets = eval_budgets(recipe)
    ops = (recipe.data.synthetic_min_ops, recipe.data.synthetic_max_ops)
    ablation = json.loads(args.ablation.read_text()) if args.ablation else None
    tokenizer = quickstart_tokenizer()
    for seed in [int(s) for s in args.seeds.split(",")]:
        rows = load_benchmark("synthetic", limit=recipe.eval.limit, seed=seed, synthetic_ops=ops)
        acc = format_ceiling(rows, tokenizer, budgets, ops)
        ceiling = statistics.fmean(acc.values())
        for b, a in acc.items():
            print(f"seed{seed}_ceiling_acc@{b}: {a:.3f}")
        print(f"seed{seed}_ceiling_anytime: {ceiling:.3f}")
        scored = (ablation or {}).get("per_seed", {}).get(str(seed), {}).get("_eval", {})
        for protocol, accuracy in scored.items():   # {protocol: {policy: accuracy at every budget}}
            warm = statistics.fmean(accuracy["warm start"])
            print(f"seed{seed}_{protocol}_warm_start_anytime: {warm:.3f}")
            print(f"seed{seed}_{protocol}_headroom: {ceiling - warm:.3f}")
            for name, acc_after in accuracy.items():
                if name != "warm start":
                    after = statistics.fmean(acc_after)
                    print(f"seed{seed}_{protocol}_{name.split()[0]}_anytime: {after:.3f} ({after / ceiling:.0%} of the ceiling)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
