"""What the answers at each cut are, and how far RL moved the policy, on the anytime testbed's runs.

For every run folder of `eval/real_model_anytime.py` (`<work>/<variant>/seed<S>`) it reads the held-out
eval's per-sample records before RL (`step_0.jsonl`) and after (the last step) and reports, per
variant and budget:

- what each forced summary answers: the final result (correct), one of the trace's own running totals
  before the last (`3 + 5 - 1 - 2`: 8 or 7: the partial work a cut trace holds, stated as if final),
  or anything else (a miscounted total, an empty box);
- the most common answer at each budget and its share: a summary policy that learned one guess for
  cuts that hold no result shows here;
- the share of eval samples whose thinking length changed between before and after. Both evals draw
  with the same seeds, so a policy that did not move samples the same traces: this share measures
  how far the thinking policy moved where it is scored;
- the relative change of the trained weights, ||W_after − W_warm|| / ||W_warm|| over the parameters
  RL changed (the checkpoint against the warm start).

    python eval/anytime_cuts.py --work runs/real_model_anytime --variants brpo,grpo
    # and the text at each cut, from an `anytime eval` of the warm start and of checkpoints after RL
    python eval/anytime_cuts.py --examples runs/cuts/samples.jsonl --label <warm start>=warm --label <ckpt>=brpo

Writes `anytime_cuts.md` under `--out` (default eval/real_model).
"""

from __future__ import annotations

import argparse
import ast
import statistics
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from anytime.core.stats import mean_ci  # noqa: E402
from anytime.evaluation.records import read_samples  # noqa: E402
from anytime.tasks.worked import running_totals  # noqa: E402  (the worked trace's totals)

KINDS = ("final", "running", "other")


def answer_kind(answer: str | None, totals: list[int]) -> str:
    try:
        value = int((answer or "").replace(" ", ""))
    except ValueError:
        return "other"
    if value == totals[-1]:
        return "final"
    return "running" if value in totals[:-1] else "other"


def cut_kinds(samples: list[dict]) -> tuple[dict[int, Counter], dict[int, Counter]]:
    """budget -> Counter of answer kinds, and budget -> Counter of the answers themselves, over every
    summary at that budget."""
    kinds: dict[int, Counter] = {}
    answers: dict[int, Counter] = {}
    for record in samples:
        totals = running_totals(_expression(record["gold"]))
        for entry in record["budgets"]:
            for summary in entry["summaries"]:
                answer = (summary.get("answer") or "").strip()
                kinds.setdefault(entry["budget"], Counter())[answer_kind(answer, totals)] += 1
                answers.setdefault(entry["budget"], Counter())[answer] += 1
    return kinds, answers


def _expression(gold: dict) -> str:
    """The entry's expression (`3 + 5 - 1 - 2`): the eval record keeps reasoning-gym's entry as its repr."""
    return ast.literal_eval(gold["entry"])["metadata"]["expression"]


def changed_share(before: list[dict], after: list[dict]) -> float:
    lengths = {(r["problem_id"], r["sample"]): r["thinking_length"] for r in before}
    pairs = [(lengths[(r["problem_id"], r["sample"])], r["thinking_length"]) for r in after
             if (r["problem_id"], r["sample"]) in lengths]
    return sum(a != b for a, b in pairs) / max(len(pairs), 1)


def weight_change(run_dir: Path) -> float | None:
    """||W_after − W_warm|| / ||W_warm|| over the tensors that changed (the trainable layers)."""
    from safetensors import safe_open

    checkpoints = sorted((run_dir / "checkpoints").glob("*/model/model.safetensors"))
    warm = run_dir / "sft_model" / "model.safetensors"
    if not checkpoints or not warm.is_file():
        return None
    delta = base = 0.0
    with safe_open(str(warm), "pt") as w, safe_open(str(checkpoints[-1]), "pt") as a:
        for name in w.keys():
            before, after = w.get_tensor(name).double(), a.get_tensor(name).double()
            diff = (after - before).norm().item() ** 2
            if diff > 0:
                delta += diff
                base += before.norm().item() ** 2
    return (delta / base) ** 0.5 if base else 0.0


def analyse(run_dir: Path) -> dict:
    steps = sorted((run_dir / "eval_samples").glob("step_*.jsonl"), key=lambda p: int(p.stem.split("_")[1]))
    before, after = read_samples(steps[0]), read_samples(steps[-1])
    (kinds_before, answers_before), (kinds_after, answers_after) = cut_kinds(before), cut_kinds(after)
    return {"before": kinds_before, "after": kinds_after, "answers_before": answers_before,
            "answers_after": answers_after, "changed": changed_share(before, after),
            "weight_change": weight_change(run_dir)}


def most_common(results: list[dict], when: str, budget: int) -> str:
    """The most common summary answer at `budget` over all runs, with its share (a collapse to one guess)."""
    pooled = sum((r[when][budget] for r in results), Counter())
    answer, count = pooled.most_common(1)[0]
    return f"`{answer or '(empty)'}` {count / sum(pooled.values()):.2f}"


def examples(samples: Path, tokenizer_path: str, labels: dict[str, str], problems: int,
             think_end: str = "</think>") -> list[str]:
    """Each cut's text next to the summary it got, model by model, for the first `problems` problems of an
    `anytime eval` samples.jsonl (records with the trace's `thinking` text; every model on the same
    problems and sampling seeds). The cut text is the trace re-tokenized and cut at the recorded cut."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    by_model: dict[str, dict] = {}
    for record in read_samples(samples):
        if record["sample"] == 0:
            by_model.setdefault(record["model"], {})[record["problem_id"]] = record
    models = [m for m in labels if m in by_model] or list(by_model)
    lines = ["### Samples at each cut (the same problem and sampling seed for every model)", ""]
    for problem_id in list(by_model[models[0]])[:problems]:
        first = by_model[models[0]][problem_id]
        gold = first["gold"]["answer"] if isinstance(first["gold"], dict) else first["gold"]
        lines += [f"**{first['problem'].rsplit(':', 1)[-1].strip()}** (answer {gold})", "",
                  "| model | budget | the trace up to the cut (its last line) | summary answer | score |",
                  "|---|---|---|---|---|"]
        for model in models:
            record = by_model[model].get(problem_id)
            if record is None or "thinking" not in record:
                continue
            ids = tokenizer(record["thinking"], add_special_tokens=False)["input_ids"]
            for entry in record["budgets"]:
                text = tokenizer.decode(ids[:entry["cut"]])
                closed = think_end in text
                seen = [line for line in text.split(think_end)[0].splitlines() if line.strip()] or [""]
                summary = entry["summaries"][0]
                lines.append(f"| {labels.get(model, model)} | {entry['budget']} | `{seen[-1].strip() or ' '}` "
                             f"({len(seen)} line{'s' if len(seen) > 1 else ''}{', closed' if closed else ''}) "
                             f"| `{summary.get('answer') or ''}` | {summary['score']:.0f} |")
        lines.append("")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="runs/real_model_anytime")
    parser.add_argument("--variants", default="brpo,grpo,ar-uniform,no-decoupled")
    parser.add_argument("--out", default="eval/real_model")
    parser.add_argument("--examples", metavar="SAMPLES_JSONL",
                        help="also show each cut's text and summary from this `anytime eval` samples.jsonl")
    parser.add_argument("--label", action="append", default=[], metavar="MODEL=NAME",
                        help="a short name for a model of --examples, in the order to show (repeatable)")
    parser.add_argument("--tokenizer", default="runs/smollm2")
    parser.add_argument("--problems", type=int, default=3)
    args = parser.parse_args()
    work = REPO / args.work
    lines = ["### What the summary at each cut answers (shares of all summaries; before RL → after RL)", "",
             "final = the correct result; running = one of the trace's own earlier running totals; "
             "other = a wrong number or no number; the most common answer pooled over the seeds, with its share.", "",
             "| variant | seeds | budget | final | running | other | most common answer | thinking length changed "
             "| weight change |", "|---|---|---|---|---|---|---|---|---|"]
    for variant in args.variants.split(","):
        runs = sorted(p for p in (work / variant).glob("seed*") if (p / "summary.json").is_file())
        if not runs:
            continue
        results = [analyse(run) for run in runs]
        changed = mean_ci([r["changed"] for r in results])
        moved = [r["weight_change"] for r in results if r["weight_change"] is not None]
        seeds = ",".join(p.name.removeprefix("seed") for p in runs)
        for i, budget in enumerate(sorted(results[0]["before"])):
            shares = []
            for kind in KINDS:
                def share(when: str) -> float:
                    return statistics.fmean(r[when][budget][kind] / sum(r[when][budget].values()) for r in results)
                shares.append(f"{share('before'):.2f} → {share('after'):.2f}")
            tail = (f"{changed[0]:.2f} ± {changed[1]:.2f} | "
                    + (f"{statistics.fmean(moved):.2e}" if moved else "—")) if i == 0 else " | "
            lines.append(f"| {variant if i == 0 else ''} | {seeds if i == 0 else ''} | {budget} | "
                         f"{' | '.join(shares)} | {most_common(results, 'answers_before', budget)} → "
                         f"{most_common(results, 'answers_after', budget)} | {tail} |")
    if args.examples:
        labels = dict(label.split("=", 1) for label in args.label)
        lines += [""] + examples(Path(args.examples), args.tokenizer, labels, args.problems)
    command = f"python eval/anytime_cuts.py --work {args.work} --variants {args.variants}"
    if args.examples:
        command += f" --examples {args.examples} " + " ".join(f"--label {label}" for label in args.label)
        command += f" --problems {args.problems}"
    lines = [f"Made by `{command}`.", ""] + lines
    out = REPO / args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "anytime_cuts.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
