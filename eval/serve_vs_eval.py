"""Served accuracy vs `anytime eval`'s, per budget, with sampling: the same problems, the same sampling
settings, scored by the same verifier.

    python eval/serve_vs_eval.py --model DIR --recipe RUN/recipe.yaml --out OUT [--limit 200 --samples 8]

1. `anytime eval --recipe R --model DIR --limit N --samples K` (the recipe's engine and sampling) writes
   per-sample records;
2. `anytime serve DIR` answers every (problem, sample) of those records at every budget, one request per
   budget (`thinking_token_budget` from the folder's protocol, the eval's temperature and top-p);
3. the served texts (from the thinking's end marker on, what the eval's verifier reads) are scored by the
   eval's verifier against the records' golds.

Prints `name: value` lines and writes OUT/table.md: accuracy ± 95% CI per budget, served and evaluated,
their difference and whether the two intervals overlap. The served traces are drawn afresh for every
budget, while the eval cuts one trace at every budget: each budget's accuracy has the same expectation.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import logging
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from anytime.core.stats import mean_ci  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="an exported folder (anytime export)")
    p.add_argument("--recipe", required=True, help="the run's recipe.yaml: the eval's benchmark and sampling")
    p.add_argument("--out", required=True)
    p.add_argument("--limit", type=int, default=200, help="problems")
    p.add_argument("--samples", type=int, default=8, help="samples per problem and budget")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight")
    return p.parse_args(argv)


def run_eval(args: argparse.Namespace, out: Path) -> list[dict]:
    from anytime.cli import main
    from anytime.evaluation.records import read_samples

    code = main(["eval", "--recipe", args.recipe, "--model", args.model, "--limit", str(args.limit),
                 "--samples", str(args.samples), "--out", str(out)])
    if code != 0:
        raise SystemExit(f"anytime eval failed ({code})")
    return read_samples(out / "samples.jsonl")


@contextlib.contextmanager
def server(model: str, max_model_len: int, log_path: Path):
    import openai

    from anytime.serving.serve import running_server

    flags = ["--max-model-len", str(max_model_len), "--served-model-name", "model"]
    if not _has_cuda():
        flags += ["--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", str(1 << 30)]
    with running_server(model, flags, log_path) as url:
        yield openai.OpenAI(base_url=url, api_key="-", max_retries=2, timeout=600)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def served_scores(args: argparse.Namespace, records: list[dict], out: Path) -> dict[int, list[float]]:
    """Score of every (record, budget) served once: {budget: [score, ...]}."""
    from transformers import AutoTokenizer

    from anytime.config import load_recipe
    from anytime.data.prompts import render_prompt
    from anytime.reward.verifier import RewardScorer
    from anytime.serving.protocol import AnswerProtocol

    protocol = AnswerProtocol.read(args.model)
    if protocol is None:
        raise SystemExit(f"{args.model} holds no anytime_protocol.json: export it with `anytime export`")
    recipe = load_recipe(args.recipe)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    budgets, answer_format = protocol.budgets, protocol.format
    jobs = [(i, b) for i in range(len(records)) for b in budgets]
    prompts = [render_prompt(tokenizer, r["problem"], recipe.data.instruction) for r in records]
    with server(args.model, args.max_model_len, out / "serve.log") as client:
        def ask(job: tuple[int, int]) -> str:
            i, b = job
            reply = client.completions.create(
                model="model", prompt=prompts[i], temperature=protocol.temperature, top_p=protocol.top_p,
                max_tokens=protocol.request_budget(b) + 16 + answer_format.summary_max_tokens,
                extra_body={"thinking_token_budget": protocol.request_budget(b), "skip_special_tokens": False})
            text = reply.choices[0].text
            at = text.find(answer_format.think_end)
            return text[at:] if at >= 0 else ""   # no end marker: the trace stopped on EOS (scored 0)

        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            texts = list(pool.map(ask, jobs))
        print(f"served_requests: {len(jobs)}")
        print(f"served_seconds: {time.perf_counter() - start:.1f}")
    with RewardScorer(header=answer_format.verifier_header, think_end=answer_format.think_end) as scorer:
        verdicts = scorer.score([t for t in texts], [records[i]["gold"] for i, _ in jobs])
    scores: dict[int, list[float]] = {b: [] for b in budgets}
    for (i, b), text, verdict in zip(jobs, texts, verdicts):
        scores[b].append(float(verdict.score) if text else 0.0)
    return scores


def evaluated_scores(records: list[dict]) -> dict[int, list[float]]:
    scores: dict[int, list[float]] = {}
    for r in records:
        for entry in r["budgets"]:
            scores.setdefault(entry["budget"], []).extend(s["score"] for s in entry["summaries"])
    return scores


def table(served: dict[int, list[float]], evaluated: dict[int, list[float]]) -> tuple[str, int]:
    lines = ["| budget | served accuracy | `anytime eval` accuracy | served − eval | 95% CIs overlap |",
             "|---:|---:|---:|---:|:---:|"]
    overlapping = 0
    for b in sorted(served):
        (ms, cs), (me, ce) = mean_ci(served[b]), mean_ci(evaluated[b])
        overlap = abs(ms - me) <= cs + ce
        overlapping += overlap
        lines.append(f"| {b} | {ms:.3f} ± {cs:.3f} | {me:.3f} ± {ce:.3f} | {ms - me:+.3f} | {'yes' if overlap else 'no'} |")
        print(f"served_acc@{b}: {ms:.4f} ± {cs:.4f}")
        print(f"eval_acc@{b}: {me:.4f} ± {ce:.4f}")
    return "\n".join(lines), overlapping


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.getLogger("httpx2").setLevel(logging.WARNING)   # one line per request otherwise
    logging.getLogger("httpx").setLevel(logging.WARNING)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = run_eval(args, out / "eval")
    served = served_scores(args, records, out)
    text, overlapping = table(served, evaluated_scores(records))
    print(f"budgets_with_overlapping_cis: {overlapping}/{len(served)}")
    command = "python eval/serve_vs_eval.py " + " ".join(sys.argv[1:] if argv is None else argv)
    (out / "table.md").write_text(f"`{command}`\n\n{text}\n")
    (out / "served_scores.json").write_text(json.dumps({str(b): s for b, s in served.items()}))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
