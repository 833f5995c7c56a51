"""Score models on math benchmarks across thinking budgets (forced summary at every cut).

`anytime eval --model M [--model M2] --benchmarks aime24,math500 --budgets 250:8000:250 --samples N
--engine hf|vllm --out DIR` writes results.json, results.csv, results.md and accuracy_vs_budget.png.
The trainer's in-training eval calls `evaluate_rows` — the same code path.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from anytime.budget import anytime_score, area_under_curve, parse_grid
from anytime import defaults
from anytime.data import PromptRow, encode_prompts
from anytime.rollout.anytime import AnytimeRolloutRunner, AnytimeSettings

log = logging.getLogger(__name__)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def evaluate_rows(runner: AnytimeRolloutRunner, tokenizer: Any, rows: Sequence[PromptRow], *, budgets: Sequence[int],
                  instruction: str = defaults.INSTRUCTION, max_prompt_len: int = 1024, batch_prompts: int = 32,
                  seed: int = 0, probs: Sequence[float] | None = None,
                  on_batch: Callable[[int], None] | None = None,
                  limit_name: str = "data.max_prompt_len") -> dict[str, Any]:
    """Per-budget accuracy, anytime/final accuracy, thinking length, pass@k and verifier failures."""
    budgets = list(budgets)
    prompts = encode_prompts(tokenizer, rows, instruction, max_prompt_len, limit_name)
    per_problem_correct: list[list[float]] = []     # [problem][sample] at the final budget
    budget_sum = [0.0] * len(budgets)
    lengths: list[int] = []
    failures: Counter = Counter()
    count = 0
    for start in range(0, len(rows), batch_prompts):
        chunk = rows[start:start + batch_prompts]
        rollout = runner.run(prompts[start:start + batch_prompts], [r.answer for r in chunk], budgets,
                             seed=seed + start)
        scores = rollout.scores  # [B, G, S, A]
        for j in range(len(budgets)):
            budget_sum[j] += float(scores[:, :, j].mean(-1).sum())
        count += scores.shape[0] * scores.shape[1]
        final = scores[:, :, -1].mean(-1)
        per_problem_correct.extend(final.tolist())
        lengths.extend(rollout.thinking_lengths())
        failures.update(rollout.failure_reasons())
        if on_batch is not None:
            on_batch(len(chunk))
    acc = [s / max(count, 1) for s in budget_sum]
    n = len(per_problem_correct[0]) if per_problem_correct else 0
    ks = sorted({k for k in (1, 2, 4, 8, 16, 32, 64, n) if 1 <= k <= n})
    pass_k = {f"pass@{k}": sum(pass_at_k(n, int(round(sum(c))), k) for c in per_problem_correct)
              / max(len(per_problem_correct), 1) for k in ks}
    return {
        "problems": len(rows),
        "samples": n,
        "budgets": budgets,
        "accuracy": acc,
        "anytime_accuracy": anytime_score(acc, probs),
        "area_under_curve": area_under_curve(budgets, acc),
        "final_accuracy": acc[-1],
        "avg_thinking_length": sum(lengths) / max(len(lengths), 1),
        **pass_k,
        "failures": dict(failures),
    }


# --- the `anytime eval` command ---------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", action="append", required=True, help="model folder or hub name (repeatable)")
    parser.add_argument("--benchmarks", default="aime24,amc22,math500,minerva,olympiadbench")
    parser.add_argument("--budgets", default="250:8000:250", help="START:STOP:STEP or a comma list")
    parser.add_argument("--samples", type=int, default=1, help="thinking traces per problem")
    parser.add_argument("--summaries", type=int, default=1, help="summaries per budget")
    parser.add_argument("--summary-max-tokens", type=int, default=defaults.SUMMARY_MAX_TOKENS)
    parser.add_argument("--engine", choices=["hf", "vllm"], default="vllm")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--data-dir", default=None, help="local benchmark files instead of the hub")
    parser.add_argument("--limit", type=int, default=None, help="first N problems of each benchmark")
    parser.add_argument("--temperature", type=float, default=0.6, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-prompt-len", type=int, default=1024)
    parser.add_argument("--batch-prompts", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--instruction", default=defaults.INSTRUCTION)
    parser.add_argument("--close-text", default=defaults.CLOSE_TEXT)
    parser.add_argument("--header", default=defaults.HEADER)


def _model_max_len(path: str) -> int | None:
    from transformers import AutoConfig

    try:
        return int(getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", 0)) or None
    except OSError as exc:
        raise FileNotFoundError(f"model {path!r} not found (neither a local folder nor a reachable hub name): {exc}") from None


def _summary_room(model: str, args: argparse.Namespace) -> int:
    """Tokens a summary request adds after the thinking: the inserted close and header, and the summary."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    inserted = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in (args.close_text, args.header))
    return inserted + args.summary_max_tokens


def run(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    from anytime.benchmarks import load_benchmark
    from anytime.reward import RewardScorer
    from anytime.rollout.engine import create_engine

    budgets = parse_grid(args.budgets)
    out = Path(args.out)
    names = [b.strip() for b in args.benchmarks.split(",") if b.strip()]
    data = {name: load_benchmark(name, data_dir=args.data_dir, limit=args.limit, seed=args.seed) for name in names}
    for model in args.model:  # fail before any generation
        limit = _model_max_len(model)
        extra = _summary_room(model, args)
        if limit is not None and budgets[-1] + extra > limit:
            raise ValueError(f"largest budget {budgets[-1]} (+{extra} summary tokens) exceeds model {model!r}'s "
                             f"max length {limit}; lower --budgets")
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"budgets": budgets, "samples": args.samples, "temperature": args.temperature,
                               "seed": args.seed, "models": {}}
    total = len(args.model) * sum(len(r) for r in data.values())
    with RewardScorer(header=args.header.strip()) as scorer, tqdm(total=total, desc="eval", unit="problem") as bar:
        for model in args.model:
            tokenizer = AutoTokenizer.from_pretrained(model)
            limit = _model_max_len(model)
            max_len_needed = args.max_prompt_len + budgets[-1] + _summary_room(model, args)
            engine_len = min(max_len_needed, limit) if limit else max_len_needed
            settings = AnytimeSettings(tuple(budgets), args.samples, args.summaries, args.summary_max_tokens,
                                       close_text=args.close_text, header=args.header, temperature=args.temperature,
                                       top_p=args.top_p, summary_temperature=args.temperature, seed=args.seed)
            with create_engine(args.engine, model, max_model_len=engine_len, max_prompt_len=args.max_prompt_len,
                               dtype=args.dtype, seed=args.seed) as engine:
                runner = AnytimeRolloutRunner(engine, tokenizer, scorer, settings)
                per_bench = {}
                for name, rows in data.items():
                    start = time.perf_counter()
                    per_bench[name] = evaluate_rows(runner, tokenizer, rows, budgets=budgets,
                                                    instruction=args.instruction, max_prompt_len=args.max_prompt_len,
                                                    batch_prompts=args.batch_prompts, seed=args.seed,
                                                    on_batch=bar.update, limit_name="--max-prompt-len")
                    per_bench[name]["seconds"] = time.perf_counter() - start
            results["models"][model] = per_bench
    write_results(results, out)
    print((out / "results.md").read_text())
    return 0


def write_results(results: dict[str, Any], out: Path) -> None:
    """results.json, results.csv (one row per model × benchmark × budget), results.md, the PNG."""
    (out / "results.json").write_text(json.dumps(results, indent=2))
    budgets = results["budgets"]
    with (out / "results.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["model", "benchmark", "budget", "accuracy"])
        for model, per_bench in results["models"].items():
            for name, r in per_bench.items():
                for b, a in zip(budgets, r["accuracy"]):
                    writer.writerow([model, name, b, f"{a:.6f}"])
    lines = ["| model | benchmark | anytime acc | final acc | avg think len | pass@1 | failures |",
             "|---|---|---|---|---|---|---|"]
    for model, per_bench in results["models"].items():
        for name, r in per_bench.items():
            fails = ", ".join(f"{k}: {v}" for k, v in sorted(r["failures"].items()) if k != "correct")
            lines.append(f"| {Path(model).name or model} | {name} | {r['anytime_accuracy']:.3f} | "
                         f"{r['final_accuracy']:.3f} | {r['avg_thinking_length']:.1f} | {r.get('pass@1', 0):.3f} | "
                         f"{fails} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    plot_accuracy(results, out / "accuracy_vs_budget.png")


def plot_accuracy(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for model, per_bench in results["models"].items():
        for name, r in per_bench.items():
            ax.plot(results["budgets"], r["accuracy"], marker="o", ms=3,
                    label=f"{Path(model).name or model} · {name} (anytime {r['anytime_accuracy']:.3f})")
    ax.set_xlabel("thinking budget (tokens)")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("accuracy vs thinking budget")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
