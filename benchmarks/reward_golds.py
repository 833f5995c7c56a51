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
import re
import sys
from decimal import Decimal
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ("aime", "amc", "math", "minerva", "olympiad_bench")

sys.path.insert(0, str(REPO_ROOT))  # run as a script from anywhere

from anytime.reward.verifier import RewardScorer, Verdict, normalize_gold  # noqa: E402


def math_data_dir() -> Path:
    """The folder with test_<benchmark>.json files ($ANYTIME_MATH_DATA overrides the default)."""
    return Path(os.environ.get("ANYTIME_MATH_DATA", REPO_ROOT / ".." / "shared" / "data" / "math"))


# A gold that is one number in scientific notation: "8.7 \\times 10^{8}", "4.4e7".
_SCIENTIFIC = re.compile(r"(\d+(?:\.\d+)?)(?:\s*\\(?:times|cdot)\s*10\^\{?|e)\+?(\d+)\}?")
_DEGREE = re.compile(r"\^\s*(?:\{\s*\\circ\s*\}|\\circ)")


def model_variants(gold: str) -> list[str]:
    """Ways of writing ``gold`` that mean the same, as models write them (white space does not
    count in math mode); built independently of the verifier's normalisation, which they test."""
    variants = []
    number = _SCIENTIFIC.fullmatch(gold)
    if number:  # exact decimal arithmetic: 8.7 x 10^8 -> 870000000
        mantissa, exponent = number.groups()
        variants += [format(Decimal(mantissa).scaleb(int(exponent)), "f"), f"{mantissa}e{exponent}"]
    if _DEGREE.search(gold):
        variants.append(_DEGREE.sub("°", gold))
    variants.append(re.sub(r"\s*,\s*", ", ", gold))
    variants.append(re.sub(r"\s+\}", "}", re.sub(r"\s*([,=])\s*", r"\1", gold)))
    return [v for v in dict.fromkeys(variants) if v != gold]


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


def variant_rates(
    answers: list[object], scorer: RewardScorer
) -> tuple[int, float, float, list[tuple[str, object, Verdict]]]:
    """(variants, rate scoring 1 against their row, rate scoring 1 against the next row, failures)."""
    golds = [normalize_gold(a) for a in answers]
    texts, targets, cross_targets = [], [], []
    for row, alternatives in enumerate(golds):
        variants = [v for gold in alternatives for v in model_variants(gold)]
        # Cross-checked only where the next row's gold differs from this one and its variants.
        same = set(golds[(row + 1) % len(answers)]) & (set(alternatives) | set(variants))
        for variant in variants:
            texts.append(as_model_answer(variant))
            targets.append(answers[row])
            cross_targets.append(None if same else answers[(row + 1) % len(answers)])
    verdicts = scorer.score(texts, targets)
    failures = [(t, a, v) for t, a, v in zip(texts, targets, verdicts) if v.score != 1.0]
    cross = [(t, a) for t, a in zip(texts, cross_targets) if a is not None]
    cross_verdicts = scorer.score([t for t, _ in cross], [a for _, a in cross])
    rate = 1 - len(failures) / max(1, len(texts))
    cross_rate = sum(v.score for v in cross_verdicts) / max(1, len(cross))
    return len(texts), rate, cross_rate, failures


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
            answers = load_answers(data_dir, name)
            self_rate, cross_rate, failures = gold_rates(answers, scorer)
            variants, variant_rate, variant_cross, variant_failures = variant_rates(answers, scorer)
            print(f"reward_gold_self_rate_{name}: {self_rate:.4f}")
            print(f"reward_gold_cross_rate_{name}: {cross_rate:.4f}")
            print(f"reward_gold_variants_{name}: {variants}")
            print(f"reward_gold_variant_rate_{name}: {variant_rate:.4f}")
            print(f"reward_gold_variant_cross_rate_{name}: {variant_cross:.4f}")
            if args.show_failures:
                for text, answer, verdict in failures + variant_failures:
                    print(f"  FAIL {name}: gold={answer!r} text={text!r} -> {verdict}", file=sys.stderr)


if __name__ == "__main__":
    main()
