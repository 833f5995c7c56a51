"""Each learner rank's rows of a step (the step's `scatter` stage): where the rows were built depends on
the placement (`anytime.config.placement_plan`), who trains them on the learner's mesh.

- Workers apart from the learners, or one worker on learner rank 0: rank 0 built every row and sends
  each rank the rows of its data-parallel rank; every rank gets the workers' sums and timings.
- Colocated workers: each rank built the rows of the prompts it rolled out, which are its data-parallel
  rank's; the pipeline stages of one replica split its prompts, so they exchange their rows, and the
  step's per-prompt counts (summed over ranks) are the same everywhere, as one worker would count them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from anytime.batch.step_sums import StepSums
from anytime.batch.train_batch import PROMPT_COUNT_FIELDS, TrainBatch
from anytime.core.dist import (all_gather_object, all_gather_tensors, broadcast_object, max_across_ranks,
                               rank_world, scatter_tensors, sum_across_ranks)
from anytime.config.placement_plan import PlacementPlan

Rows = tuple[TrainBatch, list[StepSums], list[dict[str, float]]]


def shares_by_rank(batch: TrainBatch, learner: Any) -> list[dict[str, torch.Tensor]]:
    """Each learner rank's rows (those of its data-parallel rank), as tensors to scatter."""
    by_dp = {d: batch.shard(d, learner.dp_size).to_tensors() for d in set(learner.dp_ranks)}
    return [by_dp[d] for d in learner.dp_ranks]


class RowExchange:
    """The step's rows to the learner ranks that train them (see the module docstring). Built once per run
    on every rank, collectively: a colocated pipeline makes its replicas' groups here, in one order."""

    def __init__(self, plan: PlacementPlan, learner: Any) -> None:
        self.learner, self.colocated = learner, plan.placement == "colocated"
        rank, world = rank_world()
        self.group = None
        if self.colocated and world > 1:
            dp = learner.dp_ranks
            peers = [r for r in range(world) if dp[r] == dp[rank]]
            if len(peers) > 1:   # pipeline stages of one replica: every rank creates every group, in one order
                for d in sorted(set(dp)):
                    group = dist.new_group([r for r in range(world) if dp[r] == d])
                    if d == dp[rank]:
                        self.group = group

    def __call__(self, rows: TrainBatch | None, sums: list[StepSums], timings: list[dict[str, float]]) -> Rows:
        if rank_world()[1] == 1:
            if rows is None:
                raise ValueError("no rollout worker returned rows for this step")
            return rows, sums, timings
        return self._colocated(rows, sums, timings) if self.colocated else self._scatter(rows, sums, timings)

    def _scatter(self, rows: TrainBatch | None, sums: list[StepSums], timings: list[dict[str, float]]) -> Rows:
        """Collective: rank 0's rows to every rank (its own), and the workers' sums and timings."""
        driver = rank_world()[0] == 0
        shares = shares_by_rank(rows, self.learner) if driver else None
        sums, timings = broadcast_object((sums, timings) if driver else None)
        return TrainBatch.from_tensors(scatter_tensors(shares)), sums, timings

    def _colocated(self, rows: TrainBatch | None, sums: list[StepSums], timings: list[dict[str, float]]) -> Rows:
        """Collective: this rank's rows are its own worker's (and its pipeline peers'); the per-prompt
        counts are summed in one collective; every rank gets every worker's sums and timings."""
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
