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
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np
import torch

from anytime.batch.train_batch import TrainBatch
from anytime.components import PLACEMENTS
from anytime.core.dist import broadcast_object, local_share, rank_world, scatter_tensors
from anytime.core.stats import add_sums
from anytime.recipe_checks import resolve_placement
from anytime.rollout.worker import RolloutWorker, rollout_metrics

if TYPE_CHECKING:
    from anytime.config import Recipe

T = TypeVar("T")


class RolloutWorkerError(RuntimeError):
    """A rollout worker failed (its engine crashed, it was killed, or it raised); the message names it."""


def run_worker(worker: RolloutWorker, name: str, step: int, *args: Any, **kwargs: Any
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

    def submit(self, prompts: Sequence[Sequence[int]], golds: Sequence[Any], step: int) -> Any:
        """Start the step's rollout with the workers' current weights and return a handle for
        `collect`: in the background where workers have processes of their own (Ray), else at once.
        A weight sync issued later reaches the workers only after the rollouts submitted before it."""

    def collect(self, handle: Any) -> tuple[TrainBatch, dict[str, float], dict[str, float]]:
        """What `rollout` returns, for a submitted rollout (handles are collected in submission order)."""

    def sync_weights(self, learner: Any, version: int = 0) -> None:
        """Bring the learner's weights (`version`: the updates in them) to every worker."""

    def on_first_worker(self, fn: Callable[[RolloutWorker], T]) -> T:
        """`fn(worker)` on the first rollout worker (wherever it lives), its result on every rank;
        `fn` must be a module-level function (it may travel to a Ray actor)."""

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...

    def close(self) -> None: ...


def create_rollouts(recipe: Recipe, model_path: str, tokenizer: Any, pad_id: int, learner: Any) -> Rollouts:
    """The placement the recipe names (`rollout.placement`, registered in `anytime.components.PLACEMENTS`)."""
    placement = PLACEMENTS.get(resolve_placement(recipe, rank_world()[1]))
    return placement(recipe, model_path, tokenizer, pad_id, learner)


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


def to_numpy(state: dict[str, torch.Tensor]) -> dict[str, tuple[np.ndarray, str]]:
    """Tensors as numpy arrays with their dtype names (bfloat16 travels as its bits), to send to or
    from a worker process (plain pickles: no shared-memory tensor handles to outlive a process)."""
    out = {}
    for name, t in state.items():
        t = t.detach().cpu().contiguous()
        raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
        out[name] = (raw.numpy(), str(t.dtype).removeprefix("torch."))
    return out


def from_numpy(arrays: dict[str, tuple[np.ndarray, str]]) -> dict[str, torch.Tensor]:
    out = {}
    for name, (a, dtype) in arrays.items():
        t = torch.from_numpy(np.array(a))  # a copy: object-store arrays are read-only
        out[name] = t.view(torch.bfloat16) if dtype == "bfloat16" else t
    return out


def scatter_results(results: Sequence[tuple[Any, dict[str, float], dict[str, float]]] | None, recipe: Recipe,
                    learner: Any) -> tuple[TrainBatch, dict[str, float], dict[str, float]]:
    """Collective: the workers' results of one rollout (rows as `to_numpy` arrays, metric sums, stage
    timings; on learner rank 0, None elsewhere) joined, and this rank's rows, the step's metrics and
    the slowest worker's timings."""
    shares, metrics, timings = None, None, {}
    if results is not None:
        batch = TrainBatch.concat([TrainBatch.from_tensors(from_numpy(b)) for b, _, _ in results])
        shares = shares_by_rank(batch, learner)
        metrics = step_metrics([s for _, s, _ in results], recipe)
        timings = slowest([t for _, _, t in results])
    return TrainBatch.from_tensors(scatter_tensors(shares)), broadcast_object(metrics), timings
