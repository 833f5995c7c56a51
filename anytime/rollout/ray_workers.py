"""Rollout workers as Ray actors (`rollout.placement: ray`): `rollout.workers` actors in one placement
group, each a process of its own with its own engine, verifier and device, driven by learner rank 0.
Rank 0 hands each actor whole prompts (all branches of a prompt on one actor), joins their rows and
sends every learner rank its own. Runs on a local Ray (started here, on this machine's resources)
or on a cluster (`ray start` on every node, then `ray job submit -- anytime train ...`).

Weights reach the actors through Ray's object store as numpy arrays (one `ray.put`, every actor reads
it), or on GPUs by NCCL broadcast from learner rank 0 (`rollout.weight_sync`).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from anytime.batch.train_batch import TrainBatch
from anytime.core.dist import broadcast_object, local_share, rank_world, scatter_tensors
from anytime.rollout.placement import RolloutWorkerError, pin_cpus, shares_by_rank, slowest, step_metrics

if TYPE_CHECKING:
    from anytime.config import Recipe

T = TypeVar("T")

log = logging.getLogger(__name__)


def to_numpy(state: dict[str, torch.Tensor]) -> dict[str, tuple[np.ndarray, str]]:
    """Tensors as numpy arrays with their dtype names (bfloat16 travels as its bits)."""
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


class RolloutActor:
    """One rollout worker in a Ray actor. Methods return plain data (numpy, floats)."""

    def __init__(self, recipe: Recipe, model_path: str, pad_id: int) -> None:
        from transformers import AutoTokenizer

        from anytime.rollout.worker import RolloutWorker

        self.worker = RolloutWorker(recipe, model_path, AutoTokenizer.from_pretrained(model_path), pad_id)

    def where(self) -> tuple[str, int]:
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()

    def pin(self, index: int, count: int) -> list[int]:
        return pin_cpus(index, count)

    def rollout(self, prompts: list[list[int]], golds: list[Any], step: int, index: list[int], num_prompts: int
                ) -> tuple[dict[str, tuple[np.ndarray, str]], dict[str, float], dict[str, float]]:
        batch, sums, timings = self.worker.rollout(prompts, golds, step, index, num_prompts)
        return to_numpy(batch.to_tensors()), sums, timings

    def update_weights(self, arrays: dict[str, tuple[np.ndarray, str]]) -> None:
        self.worker.update_weights(from_numpy(arrays).items())

    def init_weight_group(self, host: str, port: int, rank: int, world_size: int) -> None:
        self.worker.engine.init_weight_group(host, port, rank, world_size)

    def receive_weights(self, layout: list[tuple[str, tuple[int, ...], str]]) -> None:
        self.worker.engine.receive_weights(layout)

    def apply(self, fn: Callable[[Any], Any]) -> Any:
        return self.worker.apply(fn)

    def sleep(self) -> None:
        self.worker.sleep()

    def wake_up(self) -> None:
        self.worker.wake_up()

    def close(self) -> None:
        self.worker.close()


class RayRollouts:
    """`rollout.workers` Ray actors driven by learner rank 0 (other ranks only receive their rows)."""

    def __init__(self, recipe: Recipe, model_path: str, tokenizer: Any, pad_id: int, learner: Any) -> None:
        self.recipe, self.learner = recipe, learner
        self.actors: list[Any] = []
        self.pids: list[int] = []
        self._pg = self._sender = None
        self._syncs: list[Any] = []   # weight syncs handed to the actors and not yet confirmed
        self._started_ray = False
        if rank_world()[0] == 0:
            self._start(recipe, model_path, pad_id)

    def _start(self, recipe: Recipe, model_path: str, pad_id: int) -> None:
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError:
            raise ValueError("rollout.placement: ray needs Ray: pip install -e '.[ray]'") from None
        r = recipe.rollout
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS")
            from anytime.core.watchdog import children, watch

            before = children()
            ray.init(address=address or None, include_dashboard=False, log_to_driver=False)
            self._started_ray = not address
            if self._started_ray:  # a local cluster: it must not outlive this process
                watch(children() - before)
        gpus = r.ray_gpus_per_worker if r.ray_gpus_per_worker is not None else float(torch.cuda.is_available())
        bundle = {"CPU": r.ray_cpus_per_worker, **({"GPU": gpus} if gpus else {})}
        self._pg = placement_group([bundle] * r.workers, strategy="PACK")
        ray.get(self._pg.ready(), timeout=600)
        actor = ray.remote(RolloutActor)
        self.actors = [actor.options(num_cpus=r.ray_cpus_per_worker, num_gpus=gpus, max_restarts=0,
                                     scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, i)
                                     ).remote(recipe, model_path, pad_id) for i in range(r.workers)]
        where = self._get([a.where.remote() for a in self.actors], "start-up")
        self.pids = [pid for _, pid in where]
        if r.pin_cpus and not gpus:  # actors of one node share its cores
            for node in {n for n, _ in where}:
                mine = [i for i, (n, _) in enumerate(where) if n == node]
                self._get([self.actors[i].pin.remote(k, len(mine)) for k, i in enumerate(mine)], "start-up")
        sync = r.weight_sync if r.weight_sync != "auto" else ("nccl" if gpus and r.engine == "vllm" else "object_store")
        if sync == "nccl":
            self._start_nccl()

    def _start_nccl(self) -> None:
        """A NCCL group of learner rank 0 (rank 0) and the actors' engines (ranks 1..N) for weights."""
        from anytime.rollout.vllm import NcclWeightSender

        host = socket.gethostbyname(socket.gethostname())
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        world = 1 + len(self.actors)
        refs = [a.init_weight_group.remote(host, port, 1 + i, world) for i, a in enumerate(self.actors)]
        self._sender = NcclWeightSender(host, port, world)
        self._get(refs, "the NCCL weight-group set-up")

    def _get(self, refs: Sequence[Any], what: str) -> list[Any]:
        """Results of one call per actor; a failure names the actor and its error (the others are
        left to `close`), and nothing partial is returned."""
        import ray

        try:
            return ray.get(list(refs))
        except Exception:
            for i, ref in enumerate(refs):
                try:
                    ray.get(ref)
                except Exception as exc:
                    pid = self.pids[i] if i < len(self.pids) else "?"
                    last = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
                    raise RolloutWorkerError(f"rollout worker {i} (Ray actor, pid {pid}) failed during {what}: "
                                             f"{type(exc).__name__}: {last}") from None
            raise

    def rollout(self, prompts: Sequence[Sequence[int]], golds: Sequence[Any], step: int
                ) -> tuple[TrainBatch, dict[str, float], dict[str, float]]:
        return self.collect(self.submit(prompts, golds, step))

    def submit(self, prompts: Sequence[Sequence[int]], golds: Sequence[Any], step: int
               ) -> tuple[int, list[Any]]:
        """The step's prompts handed to the actors, which start at once (an actor runs its calls in
        order, so a weight sync issued after this reaches it after this rollout)."""
        if not self.actors:
            return step, []
        n = len(prompts)
        chunks = [local_share(range(n), i, len(self.actors)) for i in range(len(self.actors))]
        return step, [a.rollout.remote([list(prompts[j]) for j in c], [golds[j] for j in c], step, c, n)
                      for a, c in zip(self.actors, chunks)]

    def collect(self, handle: tuple[int, list[Any]]) -> tuple[TrainBatch, dict[str, float], dict[str, float]]:
        step, refs = handle
        shares, metrics, timings = None, None, {}
        if self.actors:
            self._wait_for_syncs()
            results = self._get(refs, f"the rollout of step {step}")
            batch = TrainBatch.concat([TrainBatch.from_tensors(from_numpy(b)) for b, _, _ in results])
            shares = shares_by_rank(batch, self.learner)
            metrics = step_metrics([s for _, s, _ in results], self.recipe)
            timings = slowest([t for _, _, t in results])
        mine = TrainBatch.from_tensors(scatter_tensors(shares))
        return mine, broadcast_object(metrics), timings

    def _wait_for_syncs(self) -> None:
        refs, self._syncs = self._syncs, []
        if refs:
            self._get(refs, "the weight sync")

    def sync_weights(self, learner: Any) -> None:
        """The learner's weights to every actor. With `rollout.max_staleness` > 0 the call returns once
        the weights are handed over (the actors take them after their rollouts in flight; a failure
        surfaces at the next `collect`); at 0 it returns when every actor has them."""
        import ray

        state = learner.full_state_dict()  # collective; complete on rank 0
        if not self.actors:
            return
        if self._sender is not None:
            # NCCL is a collective with the actors: it waits for their rollouts in flight
            layout = [(k, tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in state.items()]
            refs = [a.receive_weights.remote(layout) for a in self.actors]
            self._sender.send(state)
        else:
            ref = ray.put(to_numpy(state))  # once; every actor reads it from the object store
            refs = [a.update_weights.remote(ref) for a in self.actors]
        self._syncs.extend(refs)
        if self.recipe.rollout.max_staleness == 0:
            self._wait_for_syncs()

    def on_first_worker(self, fn: Callable[[Any], T]) -> T:
        if self.actors:
            self._wait_for_syncs()
        return broadcast_object(self._get([self.actors[0].apply.remote(fn)], getattr(fn, "__name__", "a call"))[0]
                                if self.actors else None)

    def sleep(self) -> None:
        if self.actors:
            self._get([a.sleep.remote() for a in self.actors], "sleep")

    def wake_up(self) -> None:
        if self.actors:
            self._get([a.wake_up.remote() for a in self.actors], "wake-up")

    def close(self) -> None:
        if not self.actors and self._pg is None:
            return
        import ray

        for actor in self.actors:
            try:
                ray.get(actor.close.remote(), timeout=30)
            except Exception:  # already dead: killing it below is all that is left
                pass
            ray.kill(actor)
        self.actors = []
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._pg)
            self._pg = None
        if self._started_ray:
            ray.shutdown()
