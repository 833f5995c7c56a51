"""Where rollouts run (`rollout.placement`), behind the one interface the trainer drives:

- `inprocess`: one `RolloutWorker` on learner rank 0 (the default with one learner process);
- `colocated`: a `RolloutWorker` on every learner rank (the default with several): each rolls out
  the prompts whose rows it trains, so no batch travels (pipeline stages of one replica split the
  replica's prompts); on a GPU the engine sleeps during the update;
- `ray`: `rollout.workers` Ray actors, own processes and devices (`anytime.rollout.workers.ray_workers`);
- `processes`: `rollout.workers` local processes of their own on one node, without Ray
  (`anytime.rollout.workers.processes`).

The placements are registered in `anytime.components.PLACEMENTS`; the first two live in
`anytime.rollout.workers.local`. This module holds what they share. Which rows each learner rank then trains
is the trainer's (`anytime.trainer.rows`), as are the weights it hands back (`WeightSnapshot`).

All branches of a prompt stay on one worker (its prefix cache) and every sequence is seeded from
its index in the step, so a recipe and seed sample the same tokens in every placement and for any
number of workers.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from anytime.batch.anytime_rollout import ScoredRollout
from anytime.batch.weight_snapshot import WeightSnapshot
from anytime.components import PLACEMENTS
from anytime.rollout.workers.worker import RolloutWorker

if TYPE_CHECKING:
    from anytime.config import Recipe
    from anytime.config.placement_plan import PlacementPlan

T = TypeVar("T")


class RolloutWorkerError(RuntimeError):
    """A rollout worker failed (its engine crashed, it was killed, or it raised); the message names it."""


def run_worker(worker: RolloutWorker, name: str, step: int, *args: Any, **kwargs: Any) -> ScoredRollout:
    try:
        return worker.rollout(*args, **kwargs)
    except Exception as exc:
        raise RolloutWorkerError(f"rollout worker {name} (pid {os.getpid()}) failed during the rollout of step "
                                 f"{step}: {type(exc).__name__}: {exc}") from exc


class Rollouts(Protocol):
    """Every method is collective over the learner ranks."""

    def submit(self, prompts: Sequence[Sequence[int]], golds: Sequence[Any], step: int) -> Any:
        """Start the step's rollout with the workers' current weights and return a handle for
        `collect`: in the background where workers have processes of their own, else at once.
        A weight sync issued later reaches the workers only after the rollouts submitted before it."""

    def collect(self, handle: Any) -> list[ScoredRollout]:
        """The scored rollouts of a submitted step that this rank holds, one per worker (handles are
        collected in submission order): every worker's on learner rank 0 where workers are apart
        from the learners, this rank's own where they are colocated, none on the other ranks."""

    def sync_weights(self, weights: WeightSnapshot) -> None:
        """Bring the learner's weights to every worker."""

    def on_first_worker(self, fn: Callable[[RolloutWorker], T]) -> T:
        """`fn(worker)` on the first rollout worker (wherever it lives), its result on every rank;
        `fn` must be a module-level function (it may travel to a Ray actor)."""

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...

    def close(self) -> None: ...


def create_rollouts(recipe: Recipe, plan: PlacementPlan, model_path: str, tokenizer: Any, learner: Any) -> Rollouts:
    """The placement of the run's plan (`rollout.placement` resolved, registered in `anytime.components.PLACEMENTS`)."""
    return PLACEMENTS.get(plan.placement)(recipe, plan, model_path, tokenizer, learner)
