"""Rollout-worker scaling: one anytime rollout step served by 1 worker vs 2 workers, for the
colocated placement (a worker per learner process, here 2 gloo processes each pinned to its share of
the cores) and the Ray placement (Ray actors), on a random tiny model whose traces never stop early.

Prints ``name: value`` lines, the ratios next to the figures they come from:
  colocated_tokens_per_s_1_worker, colocated_tokens_per_s_2_workers, colocated_workers_2_over_1
  ray_tokens_per_s_1_worker, ray_tokens_per_s_2_workers, ray_workers_2_over_1
tokens/s = thinking + summary tokens of the step ÷ the step's rollout wall time (the slowest worker's).

Usage: python benchmarks/rollout_workers.py [--engine hf|vllm] [--placements colocated,ray] [--rounds 2]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # keep stdout to `name: value` lines

REPO = Path(__file__).resolve().parents[1]


def _recipe(args: argparse.Namespace, model: str, placement: str, workers: int):
    from anytime.config import load_recipe

    return load_recipe(REPO / "recipes" / "quickstart.yaml", [
        f"model.path={model}", "model.tiny=false", "model.dtype=float32", f"rollout.engine={args.engine}",
        f"rollout.placement={placement}", f"rollout.workers={workers}", f"rollout.n={args.traces}",
        f"rollout.prompts_per_step={args.prompts}", f"budget.budgets={args.budgets}",
        f"budget.max_thinking={args.budgets[-1]}", f"summary.n={args.summaries}", "summary.max_tokens=16",
        "data.max_prompt_len=128"])


def _prompts(model: str, n: int) -> tuple[list[list[int]], list[str]]:
    from transformers import AutoTokenizer

    from anytime.data.prompts import render_prompt

    tok = AutoTokenizer.from_pretrained(model)
    return ([render_prompt(tok, f"Start with {k % 10}. Step 1: add {k % 7 + 1}. What is the last digit?")
             for k in range(n)], [str((k % 10 + k % 7 + 1) % 10) for k in range(n)])


class _DataParallel:
    """The learner facts a placement needs: every rank its own data-parallel rank."""

    def __init__(self, world: int) -> None:
        self.dp_size, self.dp_ranks = world, list(range(world))


def _colocated_rank(rank: int, world: int, init: str, args: argparse.Namespace, model: str, out: str) -> None:
    from transformers import AutoTokenizer

    from anytime.config.placement_plan import placement_plan
    from anytime.rollout.workers.devices import pin_cpus
    from anytime.rollout.workers.placement import create_rollouts

    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    if world == 1:
        pin_cpus(0, 1)  # the lone worker gets every core (the colocated ones pin themselves to a share)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        recipe = _recipe(args, model, "colocated" if world > 1 else "inprocess", 1)
        rollouts = create_rollouts(recipe, placement_plan(recipe, world=world), model,
                                   AutoTokenizer.from_pretrained(model), _DataParallel(world))
        prompts, golds = _prompts(model, args.prompts)
        rate = _rate(rollouts, prompts, golds, args.rounds)
        rollouts.close()
        if rank == 0:
            Path(out).write_text(str(rate))
    finally:
        dist.destroy_process_group()


def _rate(rollouts, prompts, golds, rounds: int) -> float:
    """Step tokens per second of the step's rollout, over `rounds` timed steps after a warm-up."""
    from anytime.core.dist import sum_across_ranks

    rollouts.collect(rollouts.submit(prompts, golds, 0))
    tokens = seconds = 0.0
    for step in range(1, rounds + 1):
        start = time.perf_counter()
        shares = rollouts.collect(rollouts.submit(prompts, golds, step))
        tokens += sum_across_ranks([sum(s.sums.tokens for s in shares)])[0]   # waits for every rank's workers
        seconds += time.perf_counter() - start
    return tokens / seconds


def colocated(args: argparse.Namespace, model: str, workers: int, tmp: str) -> float:
    out = os.path.join(tmp, f"colocated{workers}.txt")
    init = os.path.join(tmp, f"init{workers}")
    if workers == 1:
        _colocated_rank(0, 1, init, args, model, out)
    else:
        mp.spawn(_colocated_rank, args=(workers, init, args, model, out), nprocs=workers)
    return float(Path(out).read_text())


def ray(args: argparse.Namespace, model: str, workers: int) -> float:
    from transformers import AutoTokenizer

    from anytime.config.placement_plan import placement_plan
    from anytime.rollout.workers.ray_workers import RayRollouts

    recipe = _recipe(args, model, "ray", workers)
    rollouts = RayRollouts(recipe, placement_plan(recipe), model, AutoTokenizer.from_pretrained(model),
                           _DataParallel(1))
    try:
        prompts, golds = _prompts(model, args.prompts)
        return _rate(rollouts, prompts, golds, args.rounds)
    finally:
        rollouts.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="hf", choices=["hf", "vllm"])
    parser.add_argument("--placements", default="colocated,ray")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--traces", type=int, default=4)
    parser.add_argument("--summaries", type=int, default=2)
    parser.add_argument("--budgets", type=lambda s: [int(x) for x in s.split(",")], default=[64, 128, 192, 256])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    from anytime.tasks import synthetic
    from anytime.models.tiny import build_tiny_model

    placements = [p.strip() for p in args.placements.split(",") if p.strip()]
    if "ray" in placements and importlib.util.find_spec("ray") is None:
        print("ray not installed (pip install -e '.[ray]'): skipping the ray placement", file=sys.stderr)
        placements.remove("ray")
    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_tiny_model(Path(tmp) / "model", synthetic.corpus(400), hidden_size=args.hidden,
                                     num_layers=2, seed=0))
        for placement in placements:
            one = colocated(args, model, 1, tmp) if placement == "colocated" else ray(args, model, 1)
            two = colocated(args, model, 2, tmp) if placement == "colocated" else ray(args, model, 2)
            print(f"{placement}_tokens_per_s_1_worker: {one:.1f}")
            print(f"{placement}_tokens_per_s_2_workers: {two:.1f}")
            print(f"{placement}_workers_2_over_1: {two / one:.3f}")
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
