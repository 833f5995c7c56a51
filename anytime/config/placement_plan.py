"""Where a run's rollouts go and how the learner's weights reach them, decided once from the recipe and the
machine (`placement_plan`): the run (trainer, placements, transports, workers), `anytime doctor` and the
recipe checks all read one `PlacementPlan` instead of deciding each rule again.

- **placement**: `rollout.placement`, `auto` resolved from the learner world (inprocess with one learner
  process, colocated with more, processes in flight);
- **engines**: one on learner rank 0, one on every learner rank, or one per worker process of its own;
  a vLLM engine core in a process of its own (the async frontend, or beside a multi-process learner)
  takes weights through vLLM's weight transfer (CUDA IPC, its CPU twin on the CPU);
- **LoRA**: vLLM serves the adapter itself only where the learner hands it over in its own process, in
  lock-step (workers apart and in-flight swaps take merged full weights); else merged;
- **weight sync**: by reference (engines in the learner processes), a /dev/shm file per sync (local worker
  processes), Ray's object store or NCCL (Ray actors; `auto`: NCCL for vLLM actors on GPUs in lock-step
  without restarts, the object store otherwise);
- **GPUs**: per worker of its own (`rollout.ray_gpus_per_worker`, else one on CUDA), and what this node needs.

Recipe-level refusals (no machine could run them) raise `RecipeError` when the recipe loads; what this
machine lacks (Ray, CUDA for NCCL; GPUs) is listed in `PlacementPlan.problems`, raised by the run's
preflight (GPUs: where they are assigned) and reported by `anytime doctor`: a GPU recipe still loads on a
CPU machine.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass
from typing import Any

from anytime.errors import RecipeError

APART = ("processes", "ray")          # placements whose workers have processes of their own
IN_LEARNERS = ("inprocess", "colocated")


@dataclass(frozen=True)
class Machine:
    """What a placement depends on beyond the recipe."""

    cuda: bool = False
    gpus: int = 0
    ray_installed: bool = True
    ray_cluster: bool = False     # RAY_ADDRESS names a cluster to join (its GPUs are its own)

    @classmethod
    def here(cls) -> Machine:
        import torch

        cuda = torch.cuda.is_available()
        return cls(cuda=cuda, gpus=torch.cuda.device_count() if cuda else 0,
                   ray_installed=importlib.util.find_spec("ray") is not None,
                   ray_cluster=bool(os.environ.get("RAY_ADDRESS")))


@dataclass(frozen=True)
class PlacementPlan:
    """Every placement-dependent decision of a run (see the module docstring)."""

    placement: str                 # inprocess | colocated | processes | ray
    learner_processes: int
    workers: int                   # rollout workers (engines) in the run
    engines: str                   # "learner rank 0" | "every learner rank" | "worker processes"
    engine_core_apart: bool        # a vLLM engine core in a process of its own (weights by vLLM's weight transfer)
    lora_weights: str | None       # None (no LoRA) | "adapter" (the engine serves it) | "merged" (full weights)
    weight_sync: str               # reference | file | object_store | nccl
    gpus_per_worker: float         # GPUs each worker of its own takes (0: the learners' devices, or the CPU)
    gpus_needed: int               # GPUs this node needs (learners + workers of their own started here)
    gpu_keys: tuple[str, ...]      # the recipe keys that set gpus_needed
    lacks: tuple[str, ...] = ()    # what this machine lacks besides GPUs (Ray, CUDA for NCCL), naming the fix
    gpu_shortage: str | None = None   # the GPUs this node lacks, naming the keys to lower

    @property
    def apart(self) -> bool:
        """Whether the workers have processes of their own (driven from learner rank 0)."""
        return self.placement in APART

    @property
    def every_rank_gathers(self) -> bool:
        """Whether every learner rank needs the full weights (an engine on each), not rank 0 alone."""
        return self.placement == "colocated"

    @property
    def problems(self) -> tuple[str, ...]:
        """Everything this machine lacks for the plan, each naming what to change."""
        return self.lacks + ((self.gpu_shortage,) if self.gpu_shortage else ())

    def require_machine(self) -> None:
        """Raise what this machine lacks for the plan besides GPUs (the run's preflight). GPUs are counted
        per node where workers are given theirs (`anytime.rollout.workers.devices.gpus_after_learners`, which
        knows the learners on this node) and by `anytime doctor`."""
        if self.lacks:
            raise ValueError("; ".join(self.lacks))

    def describe(self) -> str:
        """One line for `anytime doctor` and the run's log."""
        parts = [f"rollout.placement {self.placement}: {self.workers} engine(s) on {self.engines}",
                 f"weights by {self.weight_sync}" + (" into a vLLM engine core of its own" if self.engine_core_apart
                                                     else "")]
        if self.lora_weights is not None:
            parts.append(f"LoRA as {'the adapter' if self.lora_weights == 'adapter' else 'merged full weights'}")
        if self.gpus_per_worker:
            parts.append(f"{self.gpus_per_worker:g} GPU(s) per worker")
        return "; ".join(parts)


def resolve_placement(r: Any, world: int | None = None) -> str:
    """`rollout.placement`, `auto` resolved from the learner world (default: the learner processes the recipe
    starts, pipeline stages included)."""
    placement = r.rollout.placement
    if placement != "auto":
        return placement
    if r.rollout.staleness_mode == "inflight":   # in flight needs a worker of its own
        return "processes"
    return "inprocess" if (r.learner.processes if world is None else world) == 1 else "colocated"


def placement_plan(r: Any, machine: Machine | None = None, world: int | None = None) -> PlacementPlan:
    """The plan of recipe `r` (an `anytime.config.Recipe`) on `machine` (this one when None) for a learner world
    of `world` processes (the recipe's when None). Raises `RecipeError` for what no machine can run."""
    machine = Machine.here() if machine is None else machine
    ro, learners = r.rollout, (r.learner.processes if world is None else world)
    placement = resolve_placement(r, learners)
    apart = placement in APART
    workers = ro.workers if apart else (learners if placement == "colocated" else 1)
    engines = "worker processes" if apart else ("every learner rank" if placement == "colocated" else "learner rank 0")
    vllm = ro.engine == "vllm"
    engine_core_apart = vllm and (ro.vllm_frontend == "async" or (not apart and learners > 1))
    _refuse_weight_sync(r, placement)
    gpus_per_worker = 0.0
    if placement == "ray":
        gpus_per_worker = ro.ray_gpus_per_worker if ro.ray_gpus_per_worker is not None else float(machine.cuda)
    elif placement == "processes":
        gpus_per_worker = float(machine.cuda)
    locked = ro.staleness_mode == "locked"
    weight_sync = {"inprocess": "reference", "colocated": "reference", "processes": "file"}.get(placement, "")
    if placement == "ray":
        auto_nccl = bool(gpus_per_worker) and vllm and locked and ro.worker_restarts == 0
        weight_sync = ro.weight_sync if ro.weight_sync != "auto" else ("nccl" if auto_nccl else "object_store")
    lora_weights = None
    if r.learner.lora.rank > 0:
        serves = ro.engine == "hf" or r.learner.lora.vllm_serves_adapter(machine.cuda)
        lora_weights = "adapter" if (not apart and locked and serves) else "merged"
    gpus_needed, gpu_keys = _gpus_needed(r, placement, learners, gpus_per_worker, machine)
    lacks = _machine_lacks(placement, weight_sync, machine)
    shortage = None
    if machine.cuda and gpus_needed > machine.gpus:
        shortage = (f"the recipe needs {gpus_needed} GPUs on this node and it has {machine.gpus}: lower "
                    f"{', '.join(gpu_keys)} (or use rollout.placement: colocated, which shares the learners' GPUs)")
    return PlacementPlan(placement, learners, workers, engines, engine_core_apart, lora_weights, weight_sync,
                         gpus_per_worker, gpus_needed, gpu_keys, lacks, shortage)


def _refuse_weight_sync(r: Any, placement: str) -> None:
    ro = r.rollout
    if ro.weight_sync == "auto":
        return
    if placement != "ray":
        raise RecipeError(f"`rollout.weight_sync: {ro.weight_sync}` chooses how weights reach Ray actors; this "
                          f"recipe's placement is {placement}: set rollout.weight_sync=auto (or rollout.placement=ray)")
    if ro.weight_sync == "nccl" and ro.worker_restarts:
        raise RecipeError(f"`rollout.worker_restarts` ({ro.worker_restarts}) needs `rollout.weight_sync: "
                          "object_store` (or auto): a restarted actor cannot join the NCCL weight group")


def _gpus_needed(r: Any, placement: str, learners: int, per_worker: float, machine: Machine
                 ) -> tuple[int, tuple[str, ...]]:
    """GPUs this node needs: learner rank r takes GPU r; workers of their own started here (processes, a
    local Ray) take the GPUs after them; inprocess and colocated share the learners'."""
    lc = r.learner
    keys = ("learner.pipeline.stages" if lc.num_processes == 1 and lc.pipeline.stages > 1
            else "learner.num_processes",)
    if placement not in APART or (placement == "ray" and machine.ray_cluster):
        return learners, keys
    keys += ("rollout.workers",) + (("rollout.ray_gpus_per_worker",) if placement == "ray" else ())
    return learners + math.ceil(r.rollout.workers * (per_worker if placement == "ray" else 1.0)), keys


def _machine_lacks(placement: str, weight_sync: str, machine: Machine) -> tuple[str, ...]:
    lacks = []
    if placement == "ray" and not machine.ray_installed:
        lacks.append("rollout.placement: ray needs Ray: pip install -e '.[ray]'")
    if weight_sync == "nccl" and not machine.cuda:
        lacks.append("`rollout.weight_sync: nccl` needs CUDA GPUs: set rollout.weight_sync=object_store (or auto)")
    return tuple(lacks)
