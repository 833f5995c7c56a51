"""Rollout workers apart from the learners (`rollout.placement: processes | ray`), driven by learner
rank 0: the one implementation of what such a placement does, whatever carries its messages.

The pool hands each worker whole prompts (all branches of a prompt on one worker, for its prefix
cache), collects their scored rollouts in submission order, and brings them the learner's weights:
queued behind the rollouts submitted before (locked staleness: a worker runs its calls in order, so
batch t is generated with the weights of step t − k exactly) or offered at once, for the engine to
take between two decoding steps (`rollout.staleness_mode: inflight`). A worker that fails, fails the
step by name. The trainer then sends every learner rank its own rows (`anytime.trainer.rows`).

A `Transport` starts the workers and moves messages: a call and its reply, a version of the weights,
an in-flight offer. `anytime.rollout.workers.processes` carries them over pipes and /dev/shm files between
local processes, `anytime.rollout.workers.ray_workers` through Ray actors and its object store (or NCCL),
and restarts a dead actor where the recipe allows. On the worker's side every transport drives
the same `WorkerEndpoint`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch

from anytime.batch.anytime_rollout import ScoredRollout
from anytime.core.dist import broadcast_object, local_share, rank_world
from anytime.batch.weight_snapshot import WeightSnapshot
from anytime.rollout.workers.wire import scored_from_worker, to_numpy_tree

if TYPE_CHECKING:
    from anytime.config import Recipe
    from anytime.config.placement_plan import PlacementPlan
    from anytime.rollout.workers.worker import RolloutWorker

T = TypeVar("T")


class WorkerEndpoint:
    """A rollout worker as a transport's far end sees it: its calls take and return plain data
    (lists, numbers, numpy arrays), so that they cross a pipe or Ray's object store unchanged."""

    def __init__(self, recipe: Recipe, plan: PlacementPlan, model_path: str) -> None:
        from transformers import AutoTokenizer

        from anytime.rollout.workers.worker import RolloutWorker

        tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=recipe.model.trust_remote_code)
        self.worker: RolloutWorker = RolloutWorker(recipe, plan, model_path, tokenizer)

    def rollout(self, prompts: list[list[int]], golds: list[Any], step: int, index: list[int], num_prompts: int,
                min_version: int = 0) -> dict[str, Any]:
        return to_numpy_tree(self.worker.rollout(prompts, golds, step, index, num_prompts, min_version).to_state())

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        self.worker.update_weights(named_tensors, version)

    def offer_weights(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.worker.offer_weights(version, named_tensors)

    def apply(self, fn: Callable[[Any], Any], min_version: int = 0) -> Any:
        self.worker.wait_for_version(min_version)
        return self.worker.apply(fn)

    def sleep(self) -> None:
        self.worker.sleep()

    def wake_up(self) -> None:
        self.worker.wake_up()

    def close(self) -> None:
        self.worker.close()


class Transport(Protocol):
    """How learner rank 0 reaches its workers. A pending reply is the transport's own token."""

    size: int

    def call(self, i: int, method: str, *args: Any) -> Any:
        """Queue `method(*args)` on worker i's endpoint, behind its earlier calls; its pending reply."""

    def reply(self, i: int, pending: Any, what: str) -> Any:
        """The reply to a call of worker i; a failure raises `RolloutWorkerError` naming the worker
        and `what` it was doing (a transport may instead restart the worker and call again)."""

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> list[Any]:
        """Queue the weights (weight version `version`) on every worker, behind its earlier calls; the
        pending replies."""

    def offer_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """In flight: hand the weights to every worker at once (its engine takes them at its next
        decoding step); a failed offer raises at a later `settle`."""

    def settle(self) -> None:
        """Without waiting: raise, by name, for an in-flight offer that failed, and read the replies
        of calls the transport made of its own accord (the weights of a restarted worker)."""

    def close(self) -> None: ...


@dataclass
class Submitted:
    step: int
    pending: list[Any]          # one reply per worker
    syncs_before: int           # the weight syncs queued ahead of it


class WorkerPool:
    """Rollout workers driven by learner rank 0 through a transport (other ranks receive their rows).
    A placement names its transport's class; the class is built with (recipe, plan, model_path)."""

    transport_type: Callable[[Recipe, PlacementPlan, str], Transport]

    def __init__(self, recipe: Recipe, plan: PlacementPlan, model_path: str, tokenizer: Any, learner: Any) -> None:
        self.recipe, self.learner = recipe, learner
        on_rank_zero = rank_world()[0] == 0
        self.transport: Transport | None = (type(self).transport_type(recipe, plan, model_path) if on_rank_zero
                                            else None)
        self._offered = 0                          # in flight: the newest version offered
        self._syncs: list[tuple[int, list[Any]]] = []   # (sync number, pending replies) not yet read
        self._sync_count = 0

    @property
    def size(self) -> int:
        return self.transport.size if self.transport is not None else 0

    def submit(self, prompts: Sequence[Sequence[int]], golds: Sequence[Any], step: int) -> Submitted | None:
        """The step's prompts handed to the workers, which start on them once their earlier calls are
        done; in flight, no worker starts before it holds the version offered last (step − k)."""
        if self.transport is None:
            return None
        n, pending = len(prompts), []
        for i in range(self.size):
            chunk = local_share(range(n), i, self.size)
            pending.append(self.transport.call(i, "rollout", [list(prompts[j]) for j in chunk],
                                               [golds[j] for j in chunk], step, chunk, n, self._offered))
        return Submitted(step, pending, self._sync_count)

    def collect(self, handle: Submitted | None) -> list[ScoredRollout]:
        if self.transport is None:
            return []
        self._read_syncs(up_to=handle.syncs_before)
        self.transport.settle()
        what = f"the rollout of step {handle.step}"
        return [scored_from_worker(self.transport.reply(i, p, what)) for i, p in enumerate(handle.pending)]

    def sync_weights(self, weights: WeightSnapshot) -> None:
        """The learner's weights (full, or LoRA-merged: workers apart take no adapter) to every worker:
        queued behind the rollouts in flight (locked), or offered at once (in flight); at
        `rollout.max_staleness` 0 the call returns when every worker has them."""
        if self.transport is None:
            return
        if self.recipe.rollout.staleness_mode == "inflight":
            self.transport.offer_weights(weights.state, weights.version)
            self._offered = weights.version
            return
        self._sync_count += 1
        self._syncs.append((self._sync_count, self.transport.load_weights(weights.state, weights.version)))
        if self.recipe.rollout.max_staleness == 0:
            self._read_syncs(up_to=self._sync_count)

    def _read_syncs(self, up_to: int) -> None:
        """Read the replies of the weight syncs numbered up to `up_to` (those queued ahead of a call)."""
        while self._syncs and self._syncs[0][0] <= up_to:
            _, pending = self._syncs.pop(0)
            for i, p in enumerate(pending):
                self.transport.reply(i, p, "the weight sync")

    def on_first_worker(self, fn: Callable[[RolloutWorker], T]) -> T:
        value = None
        if self.transport is not None:
            self._read_syncs(up_to=self._sync_count)
            self.transport.settle()
            value = self.transport.reply(0, self.transport.call(0, "apply", fn, self._offered),
                                         getattr(fn, "__name__", "a call"))
        return broadcast_object(value)

    def _everyone(self, method: str, what: str) -> None:
        if self.transport is not None:
            pending = [self.transport.call(i, method) for i in range(self.size)]
            for i, p in enumerate(pending):
                self.transport.reply(i, p, what)

    def sleep(self) -> None:
        self._everyone("sleep", "sleep")

    def wake_up(self) -> None:
        self._everyone("wake_up", "wake-up")

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        self._syncs = []

