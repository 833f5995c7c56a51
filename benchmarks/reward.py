"""Reward throughput: verifications per second with one worker and with all cores.

Items are MATH500 golds (from $ANYTIME_MATH_DATA or ../shared/data/math) written as model answers,
half of them right and half another row's answer, as an RL batch would mix them; without the data
folder a synthetic mix of integers, fractions and expressions is used. Each pool is warmed up
(workers started, golds cached) before timing; the two pools alternate, best round counts. Prints ``name: value`` lines.

Usage: python benchmarks/reward.py [--items N] [--rounds R]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # run as a script from anywhere

import psutil  # noqa: E402

from anytime.reward import RewardScorer  # noqa: E402


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
    """``items`` texts: even ones answer their own gold, odd ones the next row's gold."""
    texts, targets = [], []
    for i in range(items):
        row = i % len(golds)
        shown = golds[row if i % 2 == 0 else (row + 1) % len(golds)]
        shown = shown[0] if isinstance(shown, list) else shown
        texts.append(f"</think>\n\n**Final Answer**\n\\boxed{{{shown}}}")
        targets.append(golds[row])
    return texts, targets


def timed_rounds(
    pools: dict[str, RewardScorer], texts: list[str], targets: list[object], rounds: int
) -> dict[str, tuple[float, float]]:
    """Per pool: (best verifications/s, worker CPU ms per verification).

    The pools take turns within each round so that load from other processes hits both alike;
    the best round is the least disturbed one. Worker CPU time is independent of that load.
    """
    best = dict.fromkeys(pools, float("inf"))
    cpu = dict.fromkeys(pools, 0.0)
    for _ in range(rounds):
        for name, pool in pools.items():
            procs = [psutil.Process(pid) for pid in pool.pids]
            before = sum(p.cpu_times().user + p.cpu_times().system for p in procs)
            start = time.perf_counter()
            pool.score(texts, targets)
            best[name] = min(best[name], time.perf_counter() - start)
            cpu[name] += sum(p.cpu_times().user + p.cpu_times().system for p in procs) - before
    return {
        name: (len(texts) / best[name], 1000 * cpu[name] / (rounds * len(texts))) for name in pools
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    source, golds = load_golds()
    texts, targets = make_batch(golds, args.items)
    cores = os.cpu_count() or 1
    with RewardScorer(num_workers=1) as single, RewardScorer(num_workers=cores) as pool:
        pools = {"1_worker": single, "all_cores": pool}
        for scorer in pools.values():
            scorer.score(texts, targets)  # warm-up: workers started, golds parsed and cached
        figures = timed_rounds(pools, texts, targets, args.rounds)
    one, all_cores = figures["1_worker"][0], figures["all_cores"][0]
    print(f"reward_items: {len(texts)}")
    print(f"reward_item_source: {source}")
    print(f"reward_cores: {cores}")
    print(f"reward_verifications_per_s_1_worker: {one:.1f}")
    print(f"reward_verifications_per_s_all_cores: {all_cores:.1f}")
    print(f"reward_speedup: {all_cores / one:.2f}")
    print(f"reward_worker_cpu_ms_per_verification_1_worker: {figures['1_worker'][1]:.2f}")
    print(f"reward_worker_cpu_ms_per_verification_all_cores: {figures['all_cores'][1]:.2f}")
    print(f"reward_load_average_1min: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
