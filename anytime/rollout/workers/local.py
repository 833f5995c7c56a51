"""Rollout workers inside the learner processes (`rollout.placement: inprocess | colocated`):
one worker on learner rank 0, or one worker on every learner rank rolling out the prompts whose rows
that rank trains (see `anytime.rollout.workers.placement`; the trainer's `anytime.trainer.rows` gives each rank
its rows)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from anytime.batch.anytime_rollout import ScoredRollout
from anytime.batch.weight_snapshot import WeightSnapshot
from anytime.core.dist import broadcast_object, rank_world
from anytime.rollout.workers.devices import pin_cpus
from anytime.rollout.workers.placement import run_worker
from anytime.rollout.workers.worker import RolloutWorker

if TYPE_CHECKING:
    from anytime.config import Recipe
    from anytime.config.placement_plan import PlacementPlan

T = TypeVar("T")


class InProcessRollouts:
    """One worker on learner rank 0; every rank receives only its own rows from it."""

    def __init__(self, recipe: Recipe, plan: PlacementPlan, model_path: str, tokenizer: Any, learner: Any) -> None:
        self.recipe, self.learner = recipe, learner
        self.worker = RolloutWorker(recipe, plan, model_path, tokenizer) if rank_world()[0] == 0 else None

    def submit(self, prompts: Sequence[Sequence[int]], golds: Sequence[Any], step: int) -> list[ScoredRollout]:
        # the engine shares this process: the rollout runs now, with the weights it holds now
        if self.worker is None:
            return []
        return [run_worker(self.worker, "0", step, prompts, golds, step)]

    def collect(self, handle: list[ScoredRollout]) -> list[ScoredRollout]:
        return handle

    def sync_weights(self, weights: WeightSnapshot) -> None:
        if self.worker is not None:
            self.worker.load(weights)

    def on_first_worker(self, fn: Callable[[RolloutWorker], T]) -> T:
        return broadcast_object(self.worker.apply(fn) if self.worker is not None else None)

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

    def __init__(self, recipe: Recipe, plan: PlacementPlan, model_path: str, tokenizer: Any, learner: Any) -> None:
        rank, world = rank_world()
        self.recipe, self.learner = recipe, learner
        self.dp = learner.dp_ranks[rank]
        # the ranks of this replica (pipeline stages) split its prompts (and exchange their rows:
        # `anytime.trainer.rows.RowExchange`)
        self.peers = [r for r in range(world) if learner.dp_ranks[r] == self.dp]
        if recipe.rollout.pin_cpus and not torch.cuda.is_available():
            local = int(os.environ.get("LOCAL_RANK", rank))
            pin_cpus(local, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        self.worker = RolloutWorker(recipe, plan, model_path, tokenizer)

    def submit(self, prompts: Sequence[Sequence[int]], golds: Sequence[Any], step: int) -> list[ScoredRollout]:
        n, rank = len(prompts), rank_world()[0]
        replica = [i for i in range(n) if i % self.learner.dp_size == self.dp]
        mine = replica[self.peers.index(rank)::len(self.peers)]
        return [run_worker(self.worker, f"{rank} (on learner rank {rank})", step, [prompts[i] for i in mine],
                           [golds[i] for i in mine], step, prompt_index=mine, num_prompts=n)]

    def on_first_worker(self, fn: Callable[[RolloutWorker], T]) -> T:
        return broadcast_object(self.worker.apply(fn) if rank_world()[0] == 0 else None)
