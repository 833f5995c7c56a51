"""Pick a procedural task by measuring: a model's base accuracy under the project's own reward on
several reasoning-gym tasks, difficulties and rollout temperatures, across the recipe's budgets.

For each task setting, the held-out problems the recipe's eval would use (`heldout_task_rows`, the
training split of `--task-size` problems dropped) are rolled out on one engine exactly as training
does: G traces per problem at each temperature (0 = greedy, one trace), cut at every budget, one
summary per cut after the recipe's close text and header, scored by the task's own scorer in the
verifier pool. Per setting it prints the accuracy at each budget, the anytime score (uniform mean
over the budgets) and the share of problems whose G traces disagree at the largest budget (a mixed
group: the only kind that carries a GRPO/BRPO learning signal), and writes a markdown table.

A setting fits RL when the sampled accuracy at the largest budget is between ~15% and 60%: room to
learn, and reward to learn from.

    python eval/task_scan.py --model runs/smollm2 [--problems 64] [--traces 4] [--temperatures 0,0.7,1.0]
        [--out eval/task_scan]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere

# key (task-digits-terms) -> (reasoning-gym task, its config): small, fast generators at difficulties a 135M model may solve
SETTINGS = {
    "sum-1d-2": ("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}),
    "sum-1d-3": ("chain_sum", {"min_terms": 3, "max_terms": 3, "min_digits": 1, "max_digits": 1}),
    "sum-2d-2": ("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2}),
    "product-1d-2": ("products", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}),
    "product-1d2d-2": ("products", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}),
}
# SmolLM2 has no thinking format: the paper's close text against a bare end-of-thinking marker (the
# verifier reads the answer after the marker, so every close carries one); the header opens the box,
# without which SmolLM2 almost never writes one
FORMATS = {
    "paper close": {"close_text": "...\n\n...\n\n</think>", "header": "\n\n**Final Answer**\n\\boxed{"},
    "short close": {"close_text": "\n</think>", "header": "\n\n**Final Answer**\n\\boxed{"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a local Hugging Face model folder")
    parser.add_argument("--problems", type=int, default=64)
    parser.add_argument("--traces", type=int, default=4, help="traces per problem when sampling (G)")
    parser.add_argument("--temperatures", default="0,0.7,1.0")
    parser.add_argument("--budgets", default="16,32,48")
    parser.add_argument("--summary-tokens", type=int, default=12)
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated keys of SETTINGS")
    parser.add_argument("--formats", default="paper close,short close")
    parser.add_argument("--task-size", type=int, default=256, help="the training split the held-out rows avoid")
    parser.add_argument("--eos-ends-thinking", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--engine", default="vllm")
    parser.add_argument("--out", default="eval/task_scan")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from anytime.data.task_splits import heldout_task_rows
    from anytime.evaluation.evaluate import evaluate_rows
    from anytime.reward.verifier import RewardScorer
    from anytime.rollout.engines.engine import create_engine
    from anytime.rollout.runner import AnytimeRolloutRunner
    from anytime.config.answer_format import AnswerFormat
    from anytime.rollout.settings import AnytimeSettings

    budgets = tuple(int(b) for b in args.budgets.split(","))
    temperatures = [float(t) for t in args.temperatures.split(",")]
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    rows_of = {key: heldout_task_rows(f"reasoning_gym:{SETTINGS[key][0]}", SETTINGS[key][1], limit=args.problems,
                                      train_size=args.task_size)
               for key in args.settings.split(",")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    max_len = 192 + budgets[-1] + args.summary_tokens + 32
    with create_engine(args.engine, args.model, max_model_len=max_len, max_prompt_len=192) as engine, \
            RewardScorer(num_workers=1, header=FORMATS["paper close"]["header"].strip()) as scorer:
        for fmt in args.formats.split(","):
            for key, rows in rows_of.items():
                for temperature in temperatures:
                    traces = 1 if temperature == 0 else args.traces
                    answer_format = AnswerFormat(think_end="</think>", summary_max_tokens=args.summary_tokens,
                                                 eos_ends_thinking=args.eos_ends_thinking, **FORMATS[fmt])
                    settings = AnytimeSettings(budgets, traces, 1, answer_format, temperature=temperature, top_p=1.0,
                                               summary_temperature=temperature)
                    runner = AnytimeRolloutRunner(engine, tokenizer, scorer, settings)
                    start = time.perf_counter()
                    records: list = []
                    report = evaluate_rows(runner, tokenizer, rows, budgets=budgets, max_prompt_len=192,
                                           records=records)
                    last = {}
                    for record in records:
                        last.setdefault(record["index"], []).append(record["budgets"][-1]["summaries"][0]["score"])
                    mixed = sum(0 < sum(s) < len(s) for s in last.values()) / len(last)
                    result = {"format": fmt, "setting": key, "temperature": temperature, "traces": traces,
                              "accuracy": report["accuracy"], "anytime": report["anytime_accuracy"],
                              "mixed_groups": mixed if traces > 1 else None,
                              "thinking_length": report["avg_thinking_length"],
                              "seconds": time.perf_counter() - start}
                    results.append(result)
                    print(json.dumps(result), flush=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    lines = ["| format | task | temperature | " + " | ".join(f"acc@{b}" for b in budgets)
             + " | anytime | mixed groups | thinking length |",
             "|---" * (6 + len(budgets)) + "|"]
    for r in results:
        mixed = "–" if r["mixed_groups"] is None else f"{r['mixed_groups']:.2f}"
        lines.append(f"| {r['format']} | {r['setting']} | {r['temperature']:g} | "
                     + " | ".join(f"{a:.3f}" for a in r["accuracy"])
                     + f" | {r['anytime']:.3f} | {mixed} | {r['thinking_length']:.1f} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
