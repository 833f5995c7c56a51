"""Per-sample eval records: what the verifier read and decided for every (problem, sample, budget),
the aggregation that turns records into results, and re-verification of recorded texts.

One record per (model, benchmark, problem, sample), one JSON object per line of `samples.jsonl`:

    {"model": ..., "benchmark": ..., "index": 0, "problem_id": ..., "problem": ..., "gold": <raw gold>,
     "sample": 0, "thinking_length": 812, "thinking": "<the trace's text>", "natural_end": true, "eos_end": false,
     "budgets": [{"budget": 250, "cut": 250, "forced_zero": false,
                  "summaries": [{"text": ..., "answer": ..., "score": 0.0, "reason": "wrong",
                                 "tokens": 41}]}, ...]}

`text` is exactly what the verifier read (from the thinking's `</think>` to the end of the summary),
`answer` the extracted `\\boxed{}` content, `reason` one of `anytime.reward.verifier.REASONS`, `tokens`
the summary's generated length (absent from records of older versions), `thinking` the whole trace
as the tokenizer decodes it, so each cut's text is readable (absent from older records). `forced_zero`
marks a cut scored 0 without looking at the text: the trace stopped on EOS inside its thinking and
the budget reaches that end, b ≥ |z| (the rollout's rule, as in the official code); rescoring keeps
those at 0.

Results are always computed from records (`aggregate`), in `anytime eval`, in the in-training eval
and in `anytime eval --rescore`, so re-verifying unchanged records reproduces results.json exactly.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from anytime.algo.budget import anytime_score, area_under_curve
from anytime.evaluation.report import budget_report

log = logging.getLogger(__name__)

SAMPLES_FILE = "samples.jsonl"
Record = dict[str, Any]


def sample_records(rollout: Any, rows: Sequence[Any], *, first_index: int = 0,
                   tags: Mapping[str, Any] | None = None,
                   decode: Callable[[list[int]], str] | None = None) -> list[Record]:
    """The records of one rollout batch (`rows[b]` is the problem of prompt b of the rollout).

    The only place that reads an `AnytimeRollout` for eval records: its thinking lengths and ends,
    cuts, scores, verifier reasons and summary lengths ([B, G, S, A] tensors) and the texts the
    verifier read and the answers it extracted (flat lists in (b, g, j, a) order). `first_index` is the position of
    `rows[0]` in its benchmark; `tags` (e.g. model and benchmark, or the training step) lead every
    record; `decode` (a tokenizer's) writes each trace's text as `thinking`.
    """
    from anytime.batch.anytime_rollout import eos_zeroed
    from anytime.reward.verifier import REASONS

    _, traces, budgets, summaries = rollout.scores.shape
    lengths, cuts = rollout.think_len.tolist(), rollout.cut.tolist()
    scores, reasons = rollout.scores.tolist(), rollout.reasons.tolist()
    natural, eos = rollout.natural_end.tolist(), rollout.eos_end.tolist()
    summary_len = rollout.summary_len.tolist()
    records = []
    for b, row in enumerate(rows):
        for g in range(traces):
            length, eos_end = int(lengths[b][g]), bool(eos[b][g])
            per_budget = []
            for j, budget in enumerate(rollout.budgets):
                flat = ((b * traces + g) * budgets + j) * summaries
                per_budget.append({
                    "budget": budget, "cut": int(cuts[b][g][j]),
                    # the rollout scores such a cut 0 whatever the text says (EOS before the budget)
                    "forced_zero": eos_zeroed(eos_end, length, budget),
                    "summaries": [{"text": rollout.texts[flat + a], "answer": rollout.answers[flat + a],
                                   "score": float(scores[b][g][j][a]), "reason": REASONS[reasons[b][g][j][a]],
                                   "tokens": int(summary_len[b][g][j][a])}
                                  for a in range(summaries)],
                })
            record = {**(tags or {}), "index": first_index + b, "problem_id": row.id, "problem": row.problem,
                      "gold": row.answer, "sample": g, "thinking_length": length}
            if decode is not None:
                record["thinking"] = decode(rollout.think_ids[b, g, :length].tolist())
            records.append(record | {"natural_end": bool(natural[b][g]), "eos_end": eos_end, "budgets": per_budget})
    return records


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def aggregate(records: Sequence[Record], budgets: Sequence[int],
              probs: Sequence[float] | None = None) -> dict[str, Any]:
    """Per-budget accuracy (and the per-budget report of `anytime.evaluation.report`: completed,
    completed_accuracy, cut, summary_length), anytime/final accuracy, AUC, thinking length, pass@k and
    verifier failures of one benchmark's records (every sample of every problem)."""
    budgets = list(budgets)
    if not records:
        raise ValueError("no sample records to aggregate")
    budget_sum = [0.0] * len(budgets)
    per_problem: dict[int, list[float]] = {}     # problem index -> final-budget score of each sample
    lengths: list[int] = []
    failures: Counter = Counter()
    for record in records:
        per_budget = record["budgets"]
        if [p["budget"] for p in per_budget] != budgets:
            raise ValueError(f"record of problem {record.get('problem_id')!r} has budgets "
                             f"{[p['budget'] for p in per_budget]}, expected {budgets}")
        means = []
        for j, entry in enumerate(per_budget):
            scores = [s["score"] for s in entry["summaries"]]
            means.append(sum(scores) / len(scores))
            budget_sum[j] += means[-1]
            failures.update(s["reason"] for s in entry["summaries"])
        per_problem.setdefault(record["index"], []).append(means[-1])
        lengths.append(record["thinking_length"])
    acc = [s / len(records) for s in budget_sum]
    n = min(len(c) for c in per_problem.values())
    ks = sorted({k for k in (1, 2, 4, 8, 16, 32, 64, n) if 1 <= k <= n})
    pass_k = {f"pass@{k}": sum(pass_at_k(len(c), int(round(sum(c))), k) for c in per_problem.values())
              / len(per_problem) for k in ks}
    return {
        "problems": len(per_problem),
        "samples": n,
        "budgets": budgets,
        "accuracy": acc,
        **budget_report(records, budgets),
        "anytime_accuracy": anytime_score(acc, probs),
        "area_under_curve": area_under_curve(budgets, acc),
        "final_accuracy": acc[-1],
        "avg_thinking_length": sum(lengths) / len(lengths),
        **pass_k,
        "failures": dict(sorted(failures.items())),
    }


def group_records(records: Iterable[Record], keys: Sequence[str] = ("model", "benchmark")) -> dict[tuple, list[Record]]:
    """Records grouped by the values of `keys`, groups and records in file order."""
    groups: dict[tuple, list[Record]] = {}
    for record in records:
        groups.setdefault(tuple(record.get(k) for k in keys), []).append(record)
    return groups


def cap_records(records: Sequence[Record], max_records: int | None,
                keys: Sequence[str] = ("model", "benchmark")) -> list[Record]:
    """At most `max_records` records, shared fairly between the groups of `keys` (a small benchmark
    keeps all its records, the rest is split evenly), each group's first records kept in order."""
    if max_records is None or len(records) <= max_records:
        return list(records)
    groups: dict[tuple, list[int]] = {}
    for i, record in enumerate(records):
        groups.setdefault(tuple(record.get(k) for k in keys), []).append(i)
    quota, left = {}, max_records
    by_size = sorted(groups, key=lambda k: len(groups[k]))
    for done, key in enumerate(by_size):
        quota[key] = min(len(groups[key]), left // (len(by_size) - done))
        left -= quota[key]
    keep = sorted(i for key, idx in groups.items() for i in idx[:quota[key]])
    return [records[i] for i in keep]


def write_samples(records: Sequence[Record], path: str | Path, max_records: int | None = None) -> int:
    """Write records as JSON lines (atomically: a reader never sees half a file); returns how many.

    `max_records` caps the file (see `cap_records`); 0 writes no file at all. The in-training eval
    writes one file per eval step, e.g. `write_samples(records, out / "eval_samples" /
    f"step_{step}.jsonl", recipe.eval.max_sample_records)` with records from `evaluate_rows(...,
    records=records, tags={"step": step, "benchmark": name})`.
    """
    if max_records is not None and max_records < 0:
        raise ValueError(f"max_records must be >= 0 or None, got {max_records}")
    if max_records == 0:
        return 0
    kept = cap_records(records, max_records)
    if len(kept) < len(records):
        log.info("%s: kept %d of %d sample records (cap %d)", path, len(kept), len(records), max_records)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        dump_records(kept, f)
    os.replace(tmp, path)
    return len(kept)


def dump_records(records: Iterable[Record], f: IO[str]) -> None:
    """Append records to an open text file, one JSON object per line (ASCII-escaped: a decoded
    model output may hold characters that a UTF-8 file refuses, e.g. lone surrogates)."""
    for record in records:
        f.write(json.dumps(record) + "\n")


def read_samples(path: str | Path) -> list[Record]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} does not exist; `anytime eval` writes it next to results.json")
    records = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not a JSON record ({exc.msg})") from None
    return records


def rescore_records(records: Sequence[Record], scorer: Any) -> tuple[list[Record], int]:
    """Re-verify every recorded summary text against its record's gold with `scorer` (a
    `RewardScorer`); returns updated copies of the records and how many verdicts changed."""
    texts, golds = [], []
    for record in records:
        for entry in record["budgets"]:
            for s in entry["summaries"]:
                texts.append(s["text"])
                golds.append(record["gold"])
    verdicts = iter(scorer.score(texts, golds))
    out, changed = [], 0
    for record in records:
        new = copy.deepcopy(record)
        for entry in new["budgets"]:
            for s in entry["summaries"]:
                v = next(verdicts)
                score, reason = (0.0, "bad_format") if entry.get("forced_zero") else (float(v.score), v.reason)
                if (score, reason, v.parsed) != (s["score"], s["reason"], s["answer"]):
                    changed += 1
                s.update(answer=v.parsed, score=score, reason=reason)
        out.append(new)
    return out, changed
