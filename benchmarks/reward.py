"""Verifier throughput with 1 and 2 workers, what limits the scaling, and what deduplication saves
on a real rollout's summaries.

Throughput items are MATH500 golds (from $ANYTIME_MATH_DATA or ../shared/data/math) written as model
answers, half right and half another row's answer, all distinct (answer, gold) pairs, scored with
``dedupe=False`` so every item is one math-verify run; without the data folder a synthetic mix is
used. Each pool is warmed up (workers started, golds cached) before timing; pools take turns in each
round and the best round counts. Where the time goes: pool start-up, the same verification loop in
1 and 2 plain processes with no IPC (the machine's own ceiling for this work), the CPU per item in
the workers and in the parent, and one item per message (``chunk_size=1``) against the guided chunks.

Deduplication is measured on the summaries of real quickstart rollouts, committed in
benchmarks/data/quickstart_summaries.json (``--regenerate-sample`` rebuilds it: the quickstart's
tiny model and 800-step supervised warm start, then RL step 0's rollouts; several minutes).

Prints ``name: value`` lines. Run from the repository root (the worker processes import ``anytime``
from the current directory).

Usage: python benchmarks/reward.py [--items N] [--rounds R] [--regenerate-sample]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # run as a script from anywhere

import psutil  # noqa: E402

from anytime.reward.answer import normalize_gold  # noqa: E402
from anytime.reward.verifier import RewardScorer, read_answer  # noqa: E402

SAMPLE = REPO_ROOT / "benchmarks" / "data" / "quickstart_summaries.json"
SAMPLE_BATCHES = 4  # rollout batches of the quickstart (8 prompts x 8 traces x 4 budgets x 2 summaries)
# Generous per-item limit: on a loaded machine a slow item must not be killed (and its worker's CPU
# time lost) in the middle of a timed round.
TIMEOUT_S = 60.0


def load_golds() -> tuple[str, list[object]]:
    data_dir = Path(os.environ.get("ANYTIME_MATH_DATA", REPO_ROOT / ".." / "shared" / "data" / "math"))
    path = data_dir / "test_math.json"
    if path.is_file():
        with open(path, encoding="utf-8") as f:
            return "math500", [row["answer"] for row in json.load(f)]
    rng = random.Random(0)
    golds: list[object] = []
    for i in range(500):
        a, b = rng.randint(1, 99), rng.randint(2, 99)
        golds.append([str(a * b), f"\\frac{{{a}}}{{{b}}}", f"{a}x^2+{b}", f"\\sqrt{{{a}}}"][i % 4])
    return "synthetic", golds


def make_batch(golds: list[object], items: int) -> tuple[list[str], list[object]]:
    """``items`` texts: in round k over the rows, row r answers row (r + k)'s gold (k = 0: its own),
    so every (answer, gold) pair differs while items <= rows**2."""
    texts, targets = [], []
    for i in range(items):
        row, k = i % len(golds), i // len(golds)
        shown = golds[(row + k) % len(golds)]
        shown = shown[0] if isinstance(shown, list) else shown
        texts.append(f"</think>\n\n**Final Answer**\n\\boxed{{{shown}}}")
        targets.append(golds[row])
    return texts, targets


def cpu_s(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:  # a replaced worker: its time is lost, the figure is low
            continue
        total += times.user + times.system
    return total


@dataclass(frozen=True)
class Round:
    seconds: float
    items: int
    worker_cpu_s: float
    parent_cpu_s: float


class PoolContender:
    """A scorer timed on one batch; CPU time of its workers and of this (the parent) process."""

    def __init__(self, pool: RewardScorer, texts: list[str], targets: list[object]) -> None:
        self.pool, self.texts, self.targets = pool, texts, targets
        pool.score(texts, targets)  # warm-up: golds parsed and cached in every worker

    def run_round(self) -> Round:
        pids = self.pool.pids
        before, parent_before = cpu_s(pids), cpu_s([os.getpid()])
        start = time.perf_counter()
        self.pool.score(self.texts, self.targets)
        seconds = time.perf_counter() - start
        return Round(seconds, len(self.texts), cpu_s(pids) - before, cpu_s([os.getpid()]) - parent_before)


def _ceiling_process(payloads: list[tuple[str, tuple[str, ...]]], start: Any, stop: Any, out: Any) -> None:
    """The worker's verification loop in a plain process: no pool, no IPC, no time limit."""
    from anytime.reward.verifier import _worker_verifier

    verify = _worker_verifier()
    for payload in payloads:  # warm-up, as the pools get: imports, golds parsed and cached
        verify(*payload)
    while True:
        start.wait()  # all processes and the parent: the passes run at the same time
        if stop.is_set():
            return
        began, cpu = time.perf_counter(), time.process_time()
        for payload in payloads:
            verify(*payload)
        out.put((time.perf_counter() - began, time.process_time() - cpu))


class CeilingContender:
    """``processes`` plain processes that each verify all ``payloads`` at the same time: what the
    machine gives this work with no pool around it."""

    def __init__(self, payloads: list[tuple[str, tuple[str, ...]]], processes: int) -> None:
        ctx = mp.get_context("forkserver")
        self.items = processes * len(payloads)
        self.start, self.stop, self.out = ctx.Barrier(processes + 1), ctx.Event(), ctx.Queue()
        self.procs = [ctx.Process(target=_ceiling_process, args=(payloads, self.start, self.stop, self.out))
                      for _ in range(processes)]
        for proc in self.procs:
            proc.start()

    def run_round(self) -> Round:
        self.start.wait()
        finished = [self.out.get() for _ in self.procs]
        return Round(max(wall for wall, _ in finished), self.items, sum(cpu for _, cpu in finished), 0.0)

    def close(self) -> None:
        self.stop.set()
        self.start.wait()
        for proc in self.procs:
            proc.join()


def timed_rounds(contenders: dict[str, Any], rounds: int) -> dict[str, dict[str, float]]:
    """Per contender: best items/s, and worker and parent CPU ms per item over all rounds.

    The contenders take turns within each round so that load from other processes hits all alike;
    the best round is the least disturbed one. CPU time is independent of that load.
    """
    results: dict[str, list[Round]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, contender in contenders.items():
            results[name].append(contender.run_round())
    figures = {}
    for name, done in results.items():
        items = sum(r.items for r in done)
        figures[name] = {
            "items_per_s": max(r.items / r.seconds for r in done),
            "worker_cpu_ms": 1000 * sum(r.worker_cpu_s for r in done) / items,
            "parent_cpu_ms": 1000 * sum(r.parent_cpu_s for r in done) / items,
        }
    return figures


def started_pool(**kwargs: Any) -> tuple[RewardScorer, float]:
    start = time.perf_counter()
    pool = RewardScorer(**kwargs)
    pool.wait_ready()
    return pool, time.perf_counter() - start


def throughput(texts: list[str], targets: list[object], rounds: int) -> None:
    read = [(read_answer(t), tuple(normalize_gold(g))) for t, g in zip(texts, targets)]
    # In batch order, as the pools get them: math-verify caches its last parses.
    payloads = list(dict.fromkeys((answer, gold) for answer, gold in read if isinstance(answer, str)))
    single, start_first = started_pool(num_workers=1, dedupe=False, timeout_s=TIMEOUT_S)
    pair, start_two = started_pool(num_workers=2, dedupe=False, timeout_s=TIMEOUT_S)
    per_message, _ = started_pool(num_workers=2, dedupe=False, timeout_s=TIMEOUT_S, chunk_size=1)
    plain_one, plain_two = CeilingContender(payloads, 1), CeilingContender(payloads, 2)
    try:
        with single, pair, per_message:
            figures = timed_rounds({
                "1": PoolContender(single, texts, targets),
                "2": PoolContender(pair, texts, targets),
                "2_chunk_1": PoolContender(per_message, texts, targets),
                "plain_1": plain_one,
                "plain_2": plain_two,
            }, rounds)
    finally:
        plain_one.close()
        plain_two.close()
    one, two = figures["1"]["items_per_s"], figures["2"]["items_per_s"]
    plain_1, plain_2 = figures["plain_1"]["items_per_s"], figures["plain_2"]["items_per_s"]
    print(f"verifier_items: {len(texts)}")
    print(f"verifier_items_per_s_1_worker: {one:.1f}")
    print(f"verifier_items_per_s_2_workers: {two:.1f}")
    print(f"verifier_2_over_1: {two / one:.2f}")
    print(f"verifier_items_per_s_2_workers_chunk_1: {figures['2_chunk_1']['items_per_s']:.1f}")
    print(f"verifier_ceiling_items_per_s_1_process: {plain_1:.1f}")
    print(f"verifier_ceiling_items_per_s_2_processes: {plain_2:.1f}")
    print(f"verifier_ceiling_2_over_1: {plain_2 / plain_1:.2f}")
    print(f"verifier_1_worker_over_ceiling: {one / plain_1:.2f}")
    print(f"verifier_2_workers_over_ceiling: {two / plain_2:.2f}")
    print(f"verifier_start_s_first_pool: {start_first:.2f}")
    print(f"verifier_start_s_2_workers: {start_two:.2f}")
    labels = {"1": "1_worker", "2": "2_workers", "2_chunk_1": "2_workers_chunk_1",
              "plain_1": "ceiling_1_process", "plain_2": "ceiling_2_processes"}
    for name, label in labels.items():
        print(f"verifier_worker_cpu_ms_per_item_{label}: {figures[name]['worker_cpu_ms']:.2f}")
        if not name.startswith("plain"):
            print(f"verifier_parent_cpu_ms_per_item_{label}: {figures[name]['parent_cpu_ms']:.3f}")


class _Recorder:
    """Stands in for the rollout's scorer: keeps what it is asked to score."""

    def __init__(self, scorer: RewardScorer) -> None:
        self.scorer, self.texts, self.golds = scorer, [], []

    def score(self, texts: list[str], golds: list[object]) -> list[Any]:
        self.texts += texts
        self.golds += golds
        return self.scorer.score(texts, golds)


def regenerate_sample(path: Path) -> None:
    """Quickstart: tiny model, the recipe's supervised warm start, then rollouts of RL step 0's
    policy on the first SAMPLE_BATCHES prompt batches, as the trainer draws them."""
    from transformers import AutoTokenizer

    from anytime.config import load_recipe
    from anytime.data.prompts import encode_prompts
    from anytime.data.sources import load_train_rows
    from anytime.rollout.engines.engine import create_engine
    from anytime.rollout.runner import AnytimeRolloutRunner
    from anytime.config.answer_format import AnswerFormat
    from anytime.rollout.settings import AnytimeSettings
    from anytime.trainer.launch import prepare_model

    with tempfile.TemporaryDirectory() as tmp:
        r = load_recipe(REPO_ROOT / "recipes" / "quickstart.yaml",
                        [f"model.path={tmp}/init_model", f"trainer.output_dir={tmp}"])
        model = prepare_model(r)
        tok = AutoTokenizer.from_pretrained(model)
        rows = load_train_rows(r)
        prompts = encode_prompts(tok, rows, r.data.instruction, r.data.max_prompt_len)
        max_len = r.data.max_prompt_len + r.budget.max_thinking + r.summary.max_tokens + 64
        settings = AnytimeSettings(
            tuple(r.budget.grid()), r.rollout.n, r.summary.n, AnswerFormat.from_recipe(r),
            temperature=r.rollout.temperature, top_p=r.rollout.top_p,
            summary_temperature=r.summary.temperature, seed=r.trainer.seed)
        with create_engine("hf", model, max_model_len=max_len, max_prompt_len=r.data.max_prompt_len,
                           seed=r.trainer.seed) as engine, RewardScorer(num_workers=1) as scorer:
            recorder = _Recorder(scorer)
            runner = AnytimeRolloutRunner(engine, tok, recorder, settings)  # type: ignore[arg-type]
            n = r.rollout.prompts_per_step
            for step in range(SAMPLE_BATCHES):
                idx = [(step * n + i) % len(rows) for i in range(n)]
                runner.run([prompts[i] for i in idx], [rows[i].answer for i in idx],
                           seed=r.trainer.seed * 1_000_003 + step)
    path.parent.mkdir(parents=True, exist_ok=True)
    origin = (f"benchmarks/reward.py --regenerate-sample: recipes/quickstart.yaml (seed {r.trainer.seed}, "
              f"{r.sft.steps} SFT steps), {SAMPLE_BATCHES} rollout batches of the warm-started policy "
              f"({n} prompts x {r.rollout.n} traces x {len(settings.budgets)} budgets x {r.summary.n} summaries); "
              "the texts the verifier was given")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"origin": origin, "texts": recorder.texts, "golds": recorder.golds}, f, indent=0)
        f.write("\n")


def dedupe_figures(rounds: int) -> None:
    with open(SAMPLE, encoding="utf-8") as f:
        sample = json.load(f)
    texts, golds = sample["texts"], sample["golds"]
    with RewardScorer(num_workers=2, timeout_s=TIMEOUT_S) as dedupe, \
            RewardScorer(num_workers=2, timeout_s=TIMEOUT_S, dedupe=False) as plain:
        figures = timed_rounds({"dedupe": PoolContender(dedupe, texts, golds),
                                "plain": PoolContender(plain, texts, golds)}, rounds)
        stats, plain_stats = dedupe.last_stats, plain.last_stats
    assert plain_stats.verified == stats.answered
    print(f"dedupe_items: {stats.items}")
    print(f"dedupe_answered: {stats.answered}")
    print(f"dedupe_verified: {stats.verified}")
    print(f"dedupe_fraction_saved: {stats.fraction_saved:.3f}")
    print(f"dedupe_items_per_s_2_workers: {figures['dedupe']['items_per_s']:.1f}")
    print(f"dedupe_off_items_per_s_2_workers: {figures['plain']['items_per_s']:.1f}")
    print(f"dedupe_speedup: {figures['dedupe']['items_per_s'] / figures['plain']['items_per_s']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--regenerate-sample", action="store_true",
                        help=f"rebuild {SAMPLE.relative_to(REPO_ROOT)} from fresh quickstart rollouts")
    args = parser.parse_args()
    if args.regenerate_sample:
        regenerate_sample(SAMPLE)
    print(f"machine_cores: {os.cpu_count()}")
    print(f"machine_load_1min_before: {os.getloadavg()[0]:.2f}")
    source, golds = load_golds()
    print(f"verifier_item_source: {source}")
    texts, targets = make_batch(golds, args.items)
    throughput(texts, targets, args.rounds)
    dedupe_figures(args.rounds)
    print(f"machine_load_1min_after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
