"""Where rollouts run (`rollout.placement`), behind the one interface the trainer drives:

- `inprocess`: one `RolloutWorker` on learner rank 0 (the default with one learner process), which
  sends every learner rank its own rows;
- `colocated`: a `RolloutWorker` on every learner rank (the default with several): each rolls out
  the prompts whose rows it trains, so no batch travels (pipeline stages of one replica split the
  replica's prompts and exchange their rows); on a GPU the engine sleeps during the update;
- `ray`: `rollout.workers` Ray actors, own processes and devices (`anytime.rollout.ray_workers`).

All branches of a prompt stay on one worker (its prefix cache) and every sequence is seeded from
its index in the step, so a recipe and seed sample the same tokens in every placement and for any
number of workers.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Protocol

import torch
import torch.distributed as dist

from anytime.config import Recipe, RecipeError
from anytime.dist import (all_gather_object, all_gather_tensors, broadcast_object, local_share, max_across_ranks,
                          rank_world, scatter_tensors, sum_across_ranks)
from anytime.learner.batch import TrainBatch
from anytime.rollout.worker import RolloutWorker, add_sums, rollout_metrics


class RolloutWorkerError(RuntimeError):
    """A rollout worker failed (its engine crashed, it was killed, or it raised); the message names it."""


def _run_worker(worker: RolloutWorker, name: str, step: int, *args: Any, **kwargs: Any
                ) -> tuple[TrainBatch, dict[str, float], dict[str, float]]:
    try:
        return worker.rollout(*args, **kwargs)
    except Exception as exc:
        raise RolloutWorkerError(f"rollout worker {name} (pid {os.getpid()}) failed during the rollout of step "
                                 f"{step}: {type(exc).__name__}: {exc}") from exc


class Rollouts(Protocol):
    """Every method is collective over the learner ranks."""

    def rollout(self, prompts: Sequence[Sequence[int]], golds: Sequence[Any], step: int
                ) -> tuple[TrainBatch, dict[str, float], dict[str, float]]:
        """This rank's rows of the step, the step's metrics and the rollout's stage timings."""

    def sync_weights(self, learner: Any) -> None:
        """Bring the learner's weights to every worker."""

    def evaluate(self) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """Held-out metrics and per-sample records (at most `eval.max_sample_records`), on every rank."""

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...

    def close(self) -> None: ...


def resolve_placement(recipe: Recipe, world: int) -> str:
    placement = recipe.rollout.placement
    if placement == "auto":
        return "inprocess" if world == 1 else "colocated"
    return placement


def create_rollouts(recipe: Recipe, model_path: str, tokenizer: Any, pad_id: int, learner: Any) -> Rollouts:
    placement = resolve_placement(recipe, rank_world()[1])
    if placement == "ray":
        from anytime.rollout.ray_workers import RayRollouts

        return RayRollouts(recipe, model_path, tokenizer, pad_id, learner)
    if placement == "colocated":
        return ColocatedRollouts(recipe, model_path, tokenizer, pad_id, learner)
    return InProcessRollouts(recipe, model_path, tokenizer, pad_id, learner)


def step_metrics(per_worker: Sequence[dict[str, float]], recipe: Recipe) -> dict[str, float]:
    """The step's metrics from every worker's sums, plus each worker's tokens/s and how much longer
    the slowest worker took than the mean (1.0 = balanced). Wall-clock figures go under ``perf/``
    (like ``time/``) so that comparisons of runs can leave them out."""
    total: dict[str, float] = {}
    for sums in per_worker:
        add_sums(total, sums)
    metrics = rollout_metrics(total, recipe.budget.grid(), recipe.budget.prior_probs())
    seconds = [s["rollout_seconds"] for s in per_worker]
    for i, s in enumerate(per_worker):
        metrics[f"perf/rollout_tokens_per_s/worker{i}"] = s["tokens"] / max(s["rollout_seconds"], 1e-9)
    metrics["rollout/tokens"] = total["tokens"]
    metrics["perf/rollout_tokens_per_s"] = total["tokens"] / max(max(seconds), 1e-9)
    metrics["perf/rollout_slowest_over_mean"] = max(seconds) / max(sum(seconds) / len(seconds), 1e-9)
    return metrics


def slowest(per_worker: Sequence[dict[str, float]]) -> dict[str, float]:
    """Stage timings of a step whose workers ran side by side: the slowest worker's, per stage."""
    return {k: max(t.get(k, 0.0) for t in per_worker) for k in {k for t in per_worker for k in t}}


def shares_by_rank(batch: TrainBatch, learner: Any) -> list[dict[str, torch.Tensor]]:
    """Each learner rank's rows (those of its data-parallel rank), as tensors to scatter."""
    by_dp = {d: batch.shard(d, learner.dp_size).to_tensors() for d in set(learner.dp_ranks)}
    return [by_dp[d] for d in learner.dp_ranks]


def pin_cpus(index: int, count: int) -> list[int]:
    """Give this process the `index`-th of `count` shares of the cores it may use and as many torch
    threads, so `count` workers on one machine do not oversubscribe it (vLLM on the CPU ignores its
    own binding in an in-process engine). Returns the cores."""
    cores = local_share(sorted(os.sched_getaffinity(0)), index, count)
    if cores:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))
        os.environ["OMP_NUM_THREADS"] = str(len(cores))
        # read by a vLLM engine that runs in its own process
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
    return cores


class InProcessRollouts:
    """One worker on learner rank 0; every rank receives only its own rows from it."""

    def __init__(self, recipe: Recipe, model_path: str, tokenizer: Any, pad_id: int, learner: Any) -> None:
        self.recipe, self.learner = recipe, learner
        self.worker = RolloutWorker(recipe, model_path, tokenizer, pad_id) if rank_world()[0] == 0 else None

    def rollout(self, prompts: Sequence[Sequence[int]], golds: Sequence[Any], step: int
                ) -> tuple[TrainBatch, dict[str, float], dict[str, float]]:
        shares, metrics, timings = None, None, {}
        if self.worker is not None:
            batch, sums, timings = _run_worker(self.worker, "0", step, prompts, golds, step)
            shares, metrics = shares_by_rank(batch, self.learner), step_metrics([sums], self.recipe)
        mine = TrainBatch.from_tensors(scatter_tensors(shares))
        return mine, broadcast_object(metrics), timings

    def sync_weights(self, learner: Any) -> None:
        state = learner.full_state_dict()  # collective; complete on rank 0
        if self.worker is not None:
            self.worker.update_weights(state.items())

    def evaluate(self) -> tuple[dict[str, float], list[dict[str, Any]]]:
        return broadcast_object(self.worker.evaluate() if self.worker is not None else None)

    def sleep(self) -> None:
        if self.worker is not None:
            self.worker.sleep()

    def wake_up(self) -> None:
        if self.worker is not None:
            self.worker.wake_up()

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


class ColocatedRollouts(InProcessRollouts):
    """A worker on every learner rank, rolling out the prompts whose rows that rank trains."""

    def __init__(self, recipe: Recipe, model_path: str, tokenizer: Any, pad_id: int, learner: Any) -> None:
        rank, world = rank_world()
        if recipe.rollout.prompts_per_step < world:
            raise RecipeError(f"`rollout.placement: colocated` gives each of the {world} learner processes a share of "
                              f"`rollout.prompts_per_step` ({recipe.rollout.prompts_per_step}); raise it to >= {world}")
        self.recipe, self.learner = recipe, learner
        self.dp = learner.dp_ranks[rank]
        # the ranks of this replica (pipeline stages) split its prompts and exchange their rows
        self.peers = [r for r in range(world) if learner.dp_ranks[r] == self.dp]
        self.group = None
        if len(self.peers) > 1:
            for d in sorted(set(learner.dp_ranks)):  # every rank creates every group, in one order
                group = dist.new_group([r for r in range(world) if learner.dp_ranks[r] == d])
                if d == self.dp:
                    self.group = group
        if recipe.rollout.pin_cpus and not torch.cuda.is_available():
            local = int(os.environ.get("LOCAL_RANK", rank))
            pin_cpus(local, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        self.worker = RolloutWorker(recipe, model_path, tokenizer, pad_id)

    def rollout(self, prompts: Sequence[Sequence[int]], golds: Sequence[Any], step: int
                ) -> tuple[TrainBatch, dict[str, float], dict[str, float]]:
        n, rank = len(prompts), rank_world()[0]
        replica = [i for i in range(n) if i % self.learner.dp_size == self.dp]
        mine = replica[self.peers.index(rank)::len(self.peers)]
        batch, sums, timings = _run_worker(self.worker, f"{rank} (on learner rank {rank})", step,
                                           [prompts[i] for i in mine], [golds[i] for i in mine], step,
                                           prompt_index=mine, num_prompts=n)
        # the step's per-prompt facts, the same on every rank (as one worker would have counted them)
        tokens = torch.tensor(sum_across_ranks(batch.tokens_per_prompt.tolist()), dtype=batch.tokens_per_prompt.dtype)
        max_len = max_across_ranks(batch.max_len)
        if self.group is not None:
            batch = TrainBatch.concat([TrainBatch.from_tensors(t) for t in
                                       all_gather_tensors(batch.to_tensors(), self.group)])
        batch = replace(batch, tokens_per_prompt=tokens, max_len=max_len)
        per_worker = all_gather_object((sums, timings))
        return batch, step_metrics([s for s, _ in per_worker], self.recipe), slowest([t for _, t in per_worker])

    def sync_weights(self, learner: Any) -> None:
        self.worker.update_weights(learner.full_state_dict(all_ranks=True).items())

    def evaluate(self) -> tuple[dict[str, float], list[dict[str, Any]]]:
        return broadcast_object(self.worker.evaluate() if rank_world()[0] == 0 else None)
