"""Gold answers through the reward: how often a gold written as the model would scores 1.

For every row of each real math benchmark, the gold (each of its alternatives) is written as a model
answer ("</think>\\n\\n**Final Answer**\\n\\boxed{gold}") and scored against the row's raw answer
field: the *self* rate should be ~1. The next row's gold (when the two differ as strings) scored
against this row's answer gives the *cross* rate, which should be ~0. Prints ``name: value`` lines.

Usage: python benchmarks/reward_golds.py [--data DIR] [--workers N] [--show-failures]
Data: $ANYTIME_MATH_DATA, else ../shared/data/math relative to the repository root.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ("aime", "amc", "math", "minerva", "olympiad_bench")

sys.path.insert(0, str(REPO_ROOT))  # run as a script from anywhere

from anytime.reward import RewardScorer, Verdict, normalize_gold  # noqa: E402


def math_data_dir() -> Path:
    """The folder with test_<benchmark>.json files ($ANYTIME_MATH_DATA overrides the default)."""
    return Path(os.environ.get("ANYTIME_MATH_DATA", REPO_ROOT / ".." / "shared" / "data" / "math"))


def as_model_answer(answer: str) -> str:
    """The text a model would produce after its thinking, with ``answer`` boxed."""
    return f"</think>\n\n**Final Answer**\n\\boxed{{{answer}}}"


def gold_rates(
    answers: list[object], scorer: RewardScorer
) -> tuple[float, float, list[tuple[str, object, Verdict]]]:
    """(self rate, cross rate, self failures) for one benchmark's raw answer fields."""
    golds = [normalize_gold(a) for a in answers]
    texts, targets, rows = [], [], []
    for row, (answer, alternatives) in enumerate(zip(answers, golds)):
        for alternative in alternatives:
            texts.append(as_model_answer(alternative))
            targets.append(answer)
            rows.append(row)
    verdicts = scorer.score(texts, targets)
    row_ok = [True] * len(answers)
    failures = []
    for row, text, verdict in zip(rows, texts, verdicts):
        if verdict.score != 1.0:
            row_ok[row] = False
            failures.append((text, answers[row], verdict))
    self_rate = sum(row_ok) / len(answers)

    cross_texts, cross_targets = [], []
    for row, answer in enumerate(answers):
        other = golds[(row + 1) % len(answers)]
        if set(other) & set(golds[row]):
            continue  # same answer as a string: a match would be right, not a false positive
        cross_texts.append(as_model_answer(other[0]))
        cross_targets.append(answer)
    cross = scorer.score(cross_texts, cross_targets)
    cross_rate = sum(v.score for v in cross) / max(1, len(cross))
    return self_rate, cross_rate, failures


def load_answers(data_dir: Path, name: str) -> list[object]:
    with open(data_dir / f"test_{name}.json", encoding="utf-8") as f:
        return [row["answer"] for row in json.load(f)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=None, help="folder with test_*.json")
    parser.add_argument("--workers", type=int, default=None, help="default: all cores")
    parser.add_argument("--show-failures", action="store_true", help="list self-check failures")
    args = parser.parse_args()
    data_dir = args.data or math_data_dir()
    if not data_dir.is_dir():
        sys.exit(f"no benchmark data at {data_dir}: set ANYTIME_MATH_DATA or pass --data")
    with RewardScorer(num_workers=args.workers, timeout_s=10.0) as scorer:
        for name in BENCHMARKS:
            self_rate, cross_rate, failures = gold_rates(load_answers(data_dir, name), scorer)
            print(f"reward_gold_self_rate_{name}: {self_rate:.4f}")
            print(f"reward_gold_cross_rate_{name}: {cross_rate:.4f}")
            if args.show_failures:
                for text, answer, verdict in failures:
                    print(f"  FAIL {name}: gold={answer!r} text={text!r} -> {verdict}", file=sys.stderr)


if __name__ == "__main__":
    main()
