"""The devices and cores a rollout worker of its own takes on this machine: GPUs after every learner
process's (`gpus_after_learners`, named to a child by `visible_ids`), or a share of the cores
(`pin_cpus`)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from anytime.core.dist import local_share


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
