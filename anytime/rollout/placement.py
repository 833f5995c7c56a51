"""Where rollouts run (`rollout.placement`), behind the one interface the trainer drives:

- `inprocess`: one `RolloutWorker` on learner rank 0 (the default with one learner process), which
  sends every learner rank its own rows;
- `colocated`: a `RolloutWorker` on every learner rank (the default with several): each rolls out
  the prompts whose rows it trains, so no batch travels (pipeline stages of one replica split the
  replica's prompts and exchange their rows); on a GPU the engine sleeps during the update;
- `ray`: `rollout.workers` Ray actors, own processes and devices (`anytime.rollout.ray_workers`);
- `processes`: `rollout.workers` local processes of their own on one node, without Ray
  (`anytime.rollout.processes`).

The placements are registered in `anytime.components.PLACEMENTS`; the first two live in
`anytime.rollout.local`. This module holds what they share.

All branches of a prompt stay on one worker (its prefix cache) and every sequence is seeded from
its index in the step, so a recipe and seed sample the same tokens in every placement and for any
number of workers.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np
import torch

from anytime.batch.anytime_rollout import ScoredRollout
from anytime.batch.train_batch import TrainBatch
from anytime.components import PLACEMENTS
from anytime.core.dist import broadcast_object, local_share, rank_world, scatter_tensors
from anytime.recipe_checks import resolve_placement
from anytime.rollout.worker import RolloutWorker

if TYPE_CHECKING:
    from anytime.config import Recipe

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

    def distribute(self, rows: TrainBatch | None, sums: list[dict[str, float]], timings: list[dict[str, float]]
                   ) -> tuple[TrainBatch, list[dict[str, float]], list[dict[str, float]]]:
        """This rank's training rows of the step, from the rows built of what `collect` returned
        here (None where it returned nothing), and every worker's metric sums and timings."""

    def sync_weights(self, learner: Any, version: int = 0) -> None:
        """Bring the learner's weights (`version`: the updates in them) to every worker."""

    def on_first_worker(self, fn: Callable[[RolloutWorker], T]) -> T:
        """`fn(worker)` on the first rollout worker (wherever it lives), its result on every rank;
        `fn` must be a module-level function (it may travel to a Ray actor)."""

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...

    def close(self) -> None: ...


def create_rollouts(recipe: Recipe, model_path: str, tokenizer: Any, learner: Any) -> Rollouts:
    """The placement the recipe names (`rollout.placement`, registered in `anytime.components.PLACEMENTS`)."""
    placement = PLACEMENTS.get(resolve_placement(recipe, rank_world()[1]))
    return placement(recipe, model_path, tokenizer, learner)


def shares_by_rank(batch: TrainBatch, learner: Any) -> list[dict[str, torch.Tensor]]:
    """Each learner rank's rows (those of its data-parallel rank), as tensors to scatter."""
    by_dp = {d: batch.shard(d, learner.dp_size).to_tensors() for d in set(learner.dp_ranks)}
    return [by_dp[d] for d in learner.dp_ranks]


def gpus_after_learners(learners: int, workers: int, per_worker: float = 1.0) -> list[int]:
    """This machine's GPU ordinals for rollout workers of their own: the learners hold the first `learners`
    (learner rank r on GPU r, as `anytime.core.dist.init_from_env` sets it), the workers take the rest.
    Raises, naming the keys, when `workers` workers of `per_worker` GPUs each do not fit there."""
    free = list(range(learners, torch.cuda.device_count()))
    if workers * per_worker > len(free):
        raise ValueError(f"{workers} rollout workers with {per_worker:g} GPU each need {workers * per_worker:g} GPUs "
                         f"after the {learners} of the learner processes, and this machine has "
                         f"{torch.cuda.device_count()} in all: lower rollout.workers (or rollout.ray_gpus_per_worker), "
                         "learner.num_processes, or use rollout.placement: colocated (lock-step only)")
    return free


def visible_ids(ordinals: Sequence[int]) -> str:
    """A CUDA_VISIBLE_DEVICES value naming these GPU ordinals of this process (ordinals count within the
    process's own CUDA_VISIBLE_DEVICES, when it has one)."""
    current = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [i.strip() for i in current.split(",")] if current else [str(i) for i in range(torch.cuda.device_count())]
    return ",".join(ids[i] for i in ordinals)


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


def _array_of(t: torch.Tensor) -> tuple[np.ndarray, str]:
    """A tensor as a numpy array and its dtype name (bfloat16 travels as its bits)."""
    t = t.detach().cpu().contiguous()
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    return raw.numpy(), str(t.dtype).removeprefix("torch.")


def _tensor_of(array: np.ndarray, dtype: str) -> torch.Tensor:
    t = torch.from_numpy(np.array(array))  # a copy: object-store arrays are read-only
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


def to_numpy(state: dict[str, torch.Tensor]) -> dict[str, tuple[np.ndarray, str]]:
    """Tensors as numpy arrays with their dtype names, to send to or from a worker process (plain
    pickles: no shared-memory tensor handles to outlive a process)."""
    return {name: _array_of(t) for name, t in state.items()}


def from_numpy(arrays: dict[str, tuple[np.ndarray, str]]) -> dict[str, torch.Tensor]:
    return {name: _tensor_of(a, dtype) for name, (a, dtype) in arrays.items()}


def to_numpy_tree(value: Any) -> Any:
    """`value` (dicts, lists and plain values around tensors) with every tensor as numpy, as
    `to_numpy` sends it, to send a `ScoredRollout.to_state()` from a worker process;
    `from_numpy_tree` inverts it."""
    if isinstance(value, torch.Tensor):
        return _NumpyTensor(*_array_of(value))
    if isinstance(value, dict):
        return {k: to_numpy_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_numpy_tree(v) for v in value]
    return value


def from_numpy_tree(value: Any) -> Any:
    if isinstance(value, _NumpyTensor):
        return _tensor_of(value.array, value.dtype)
    if isinstance(value, dict):
        return {k: from_numpy_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_numpy_tree(v) for v in value]
    return value


@dataclass
class _NumpyTensor:
    array: np.ndarray
    dtype: str


def scored_from_worker(sent: Any) -> ScoredRollout:
    """A worker process's `to_numpy_tree(scored.to_state())` back as a `ScoredRollout`."""
    return ScoredRollout.from_state(from_numpy_tree(sent))


def scatter_rows(rows: TrainBatch | None, sums: list[dict[str, float]], timings: list[dict[str, float]],
                 learner: Any) -> tuple[TrainBatch, list[dict[str, float]], list[dict[str, float]]]:
    """Collective, for workers apart from the learners: the step's rows (on learner rank 0, None
    elsewhere) sent to every rank as its own (those of its data-parallel rank), and the workers'
    sums and timings to every rank."""
    driver = rank_world()[0] == 0
    shares = shares_by_rank(rows, learner) if driver else None
    sums, timings = broadcast_object((sums, timings) if driver else None)
    return TrainBatch.from_tensors(scatter_tensors(shares)), sums, timings
