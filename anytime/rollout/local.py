"""Rollout workers inside the learner processes (`rollout.placement: inprocess | colocated`):
one worker on learner rank 0 that sends every rank its own rows, or one worker on every learner
rank rolling out the prompts whose rows that rank trains (see `anytime.rollout.placement`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from anytime.batch.anytime_rollout import ScoredRollout
from anytime.batch.train_batch import PROMPT_COUNT_FIELDS, TrainBatch
from anytime.core.dist import (
    all_gather_object,
    all_gather_tensors,
    broadcast_object,
    max_across_ranks,
    rank_world,
    sum_across_ranks,
)
from anytime.rollout.placement import pin_cpus, run_worker, scatter_rows
from anytime.rollout.worker import RolloutWorker, adapter_of

if TYPE_CHECKING:
    from anytime.config import Recipe

T = TypeVar("T")


class InProcessRollouts:
    """One worker on learner rank 0; every rank receives only its own rows from it."""

    def __init__(self, recipe: Recipe, model_path: str, tokenizer: Any, learner: Any) -> None:
        self.recipe, self.learner = recipe, learner
        self.worker = RolloutWorker(recipe, model_path, tokenizer) if rank_world()[0] == 0 else None

    def submit(self, prompts: Sequence[Sequence[int]], golds: Sequence[Any], step: int) -> list[ScoredRollout]:
        # the engine shares this process: the rollout runs now, with the weights it holds now
        if self.worker is None:
            return []
        return [run_worker(self.worker, "0", step, prompts, golds, step)]

    def collect(self, handle: list[ScoredRollout]) -> list[ScoredRollout]:
        return handle

    def distribute(self, rows: TrainBatch | None, sums: list[dict[str, float]], timings: list[dict[str, float]]
                   ) -> tuple[TrainBatch, list[dict[str, float]], list[dict[str, float]]]:
        return scatter_rows(rows, sums, timings, self.learner)

    def sync_weights(self, learner: Any, version: int = 0) -> None:
        update = adapter_of(learner)
        if update is not None:  # LoRA: adapter-sized where the engine merges it
            if self.worker is not None:
                self.worker.sync_adapter(learner, update)
            return
        state = learner.full_state_dict()  # collective; complete on rank 0
        if self.worker is not None:
            self.worker.update_weights(state.items())

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

    def __init__(self, recipe: Recipe, model_path: str, tokenizer: Any, learner: Any) -> None:
        rank, world = rank_world()
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
        self.worker = RolloutWorker(recipe, model_path, tokenizer)

    def submit(self, prompts: Sequence[Sequence[int]], golds: Sequence[Any], step: int) -> list[ScoredRollout]:
        n, rank = len(prompts), rank_world()[0]
        replica = [i for i in range(n) if i % self.learner.dp_size == self.dp]
        mine = replica[self.peers.index(rank)::len(self.peers)]
        return [run_worker(self.worker, f"{rank} (on learner rank {rank})", step, [prompts[i] for i in mine],
                           [golds[i] for i in mine], step, prompt_index=mine, num_prompts=n)]

    def distribute(self, rows: TrainBatch | None, sums: list[dict[str, float]], timings: list[dict[str, float]]
                   ) -> tuple[TrainBatch, list[dict[str, float]], list[dict[str, float]]]:
        """This rank's rows are its own worker's (and its pipeline peers'); the step's per-prompt
        counts, the same on every rank (as one worker would have counted them), are summed in one
        collective."""
        n = len(rows.tokens_per_prompt)
        mine_counts = [getattr(rows, name) for name in PROMPT_COUNT_FIELDS]
        summed = sum_across_ranks([v for t in mine_counts for v in t.tolist()])
        counts = {name: torch.tensor(summed[i * n:(i + 1) * n], dtype=t.dtype)
                  for i, (name, t) in enumerate(zip(PROMPT_COUNT_FIELDS, mine_counts))}
        max_len = max_across_ranks(rows.max_len)
        if self.group is not None:
            rows = TrainBatch.concat([TrainBatch.from_tensors(t) for t in
                                      all_gather_tensors(rows.to_tensors(), self.group)])
        per_rank = all_gather_object((sums, timings))
        return (replace(rows, **counts, max_len=max_len), [s for mine, _ in per_rank for s in mine],
                [t for _, mine in per_rank for t in mine])

    def sync_weights(self, learner: Any, version: int = 0) -> None:
        update = adapter_of(learner)
        if update is not None:
            self.worker.sync_adapter(learner, update)
            return
        self.worker.update_weights(learner.full_state_dict(all_ranks=True).items())

    def on_first_worker(self, fn: Callable[[RolloutWorker], T]) -> T:
        return broadcast_object(self.worker.apply(fn) if rank_world()[0] == 0 else None)
