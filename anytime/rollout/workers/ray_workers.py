"""Rollout workers as Ray actors (`rollout.placement: ray`): `rollout.workers` actors in one placement
group, each a process of its own with its own engine, verifier and device. `anytime.rollout.workers.pool.
WorkerPool` drives them from learner rank 0; this transport carries its calls as actor methods.
Runs on a local Ray (started here, on this machine's resources) or on a cluster (`ray start` on
every node, then `ray job submit -- anytime train ...`).

Weights reach the actors through Ray's object store as numpy arrays (one `ray.put`, every actor reads
it), or on GPUs by NCCL broadcast from learner rank 0 (`rollout.weight_sync`).

An actor that dies fails the step that collects its rollout, by name; with `rollout.worker_restarts`
it is started again in its place and its prompts of every rollout in flight are regenerated with
the weights they were first given. Sequences are seeded from their index in the step, so the
regenerated rows equal the lost ones and a locked run stays exact.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from anytime.rollout.workers.devices import gpus_after_learners, pin_cpus, visible_ids
from anytime.rollout.workers.placement import RolloutWorkerError
from anytime.rollout.workers.wire import from_numpy, to_numpy
from anytime.rollout.workers.pool import WorkerEndpoint, WorkerPool

if TYPE_CHECKING:
    from anytime.config import Recipe
    from anytime.config.placement_plan import PlacementPlan

log = logging.getLogger(__name__)


class RolloutActor(WorkerEndpoint):
    """The endpoint in a Ray actor: weights arrive as numpy arrays (or by NCCL), and it says where it runs."""

    def where(self) -> tuple[str, int]:
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()

    def pin(self, index: int, count: int) -> list[int]:
        return pin_cpus(index, count)

    def update_weights(self, arrays: dict[str, tuple[np.ndarray, str]], version: int) -> None:  # type: ignore[override]
        super().update_weights(from_numpy(arrays).items(), version)

    def offer_arrays(self, version: int, arrays: dict[str, tuple[np.ndarray, str]]) -> None:
        """In-flight weights (called in the `weights` concurrency group, beside a rollout in progress):
        converted here, taken by the engine at its next decoding step."""
        self.offer_weights(version, from_numpy(arrays).items())

    def init_weight_group(self, host: str, port: int, rank: int, world_size: int, timeout_s: float) -> None:
        self.worker.engine.init_weight_group(host, port, rank, world_size, timeout_s)

    def receive_weights(self, layout: list[tuple[str, tuple[int, ...], str]], version: int) -> None:
        self.worker.engine.receive_weights(layout)
        self.worker.engine.took_version(version)

    def exit(self) -> None:
        """End this actor's process the way Python exits, so that its exit handlers run (multiprocessing
        removes its temporary folders); `ray.kill` would leave them behind."""
        import ray

        ray.actor.exit_actor()


def local_ray_env(recipe: Recipe, plan: PlacementPlan) -> dict[str, str]:
    """The environment a local Ray cluster starts in: on CUDA, only the GPUs after the learner processes'
    are visible to it, so its actors never land on a learner's GPU (Ray gives its own GPUs from 0)."""
    if not torch.cuda.is_available():
        return {}
    learners = int(os.environ.get("LOCAL_WORLD_SIZE", plan.learner_processes))
    free = gpus_after_learners(learners, recipe.rollout.workers, plan.gpus_per_worker)
    return {"CUDA_VISIBLE_DEVICES": visible_ids(free)}


@contextlib.contextmanager
def environment(variables: dict[str, str]) -> Iterator[None]:
    """`variables` set in this process's environment inside the block (for the processes it starts)."""
    saved = {k: os.environ.get(k) for k in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def weight_group_host() -> str:
    """The address of learner rank 0 that the actors' engines dial for the NCCL weight group: the one Ray
    advertises for this node to the others (the host name can resolve to a loopback address such as
    Debian's 127.0.1.1, which no other node reaches)."""
    import ray

    return ray.util.get_node_ip_address()


@dataclass
class _Call:
    """A call on actor i, with what calls it again on an actor put in its place (the weights the
    actor held when it was made: None = those it started with)."""

    actor: Any
    ref: Any
    method: str
    args: tuple
    weights: Any


class RayTransport:
    """`rollout.workers` Ray actors in one placement group."""

    def __init__(self, recipe: Recipe, plan: PlacementPlan, model_path: str) -> None:
        self.recipe, self.plan = recipe, plan
        self.actors: list[Any] = []
        self.pids: list[int] = []
        self.nodes: list[str] = []
        self._pg = self._sender = None
        self._started_ray = False
        self._catch_up: list[tuple[int, _Call]] = []   # weights sent to a restarted actor, not yet confirmed
        self._offers: list[tuple[int, Any]] = []       # (index, ref) of in-flight offers not yet seen through
        self._weights: Any = None   # (object-store ref, version) of the latest weights, while restarts may need them
        self._holds: list[Any] = []   # the (ref, version) each actor holds (None = those it started with)
        self._restarts: list[int] = []
        self._spawn_args: tuple[Any, ...] = ()
        self._pins: dict[int, tuple[int, int]] = {}   # actor -> (its share, shares on its node) of the cores
        self._start(recipe, model_path)

    @property
    def size(self) -> int:
        return len(self.actors)

    def _start(self, recipe: Recipe, model_path: str) -> None:
        self.plan.require_machine()   # Ray installed, CUDA for NCCL (GPUs: local_ray_env)
        import ray
        from ray.util.placement_group import placement_group

        r, gpus = recipe.rollout, self.plan.gpus_per_worker
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS")
            from anytime.core.watchdog import children, watch

            before = children()
            if address:
                log.info("joining the Ray cluster at %s: its GPUs must leave out those of the learner processes "
                         "(start Ray on their node with CUDA_VISIBLE_DEVICES naming the others)", address)
            with environment(local_ray_env(recipe, self.plan) if not address else {}):
                ray.init(address=address or None, include_dashboard=False, log_to_driver=False)
            self._started_ray = not address
            if self._started_ray:  # a local cluster: it must not outlive this process
                watch(children() - before)
        bundle = {"CPU": r.ray_cpus_per_worker, **({"GPU": gpus} if gpus else {})}
        self._pg = placement_group([bundle] * r.workers, strategy="PACK")
        ray.get(self._pg.ready(), timeout=600)
        # in-flight weights arrive on a thread of their own while the default one generates
        actor_class = ray.remote(concurrency_groups={"weights": 1})(RolloutActor)
        self._spawn_args = (actor_class, recipe, self.plan, model_path, gpus)
        self.actors = [self._spawn(i) for i in range(r.workers)]
        self._holds, self._restarts = [None] * r.workers, [0] * r.workers
        where = self._get([a.where.remote() for a in self.actors], "start-up")
        self.nodes, self.pids = [node for node, _ in where], [pid for _, pid in where]
        self._pins = {i: (0, 1) for i in range(r.workers)}
        if r.pin_cpus and not gpus:  # actors of one node share its cores
            for node in {n for n, _ in where}:
                mine = [i for i, (n, _) in enumerate(where) if n == node]
                self._pins.update({i: (k, len(mine)) for k, i in enumerate(mine)})
            self._get([a.pin.remote(*self._pins[i]) for i, a in enumerate(self.actors)], "start-up")
        if self.plan.weight_sync == "nccl":
            self._start_nccl()

    def _spawn(self, i: int) -> Any:
        """Actor i, in bundle i of the placement group, with the weights at `model_path`."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cls, recipe, plan, model_path, gpus = self._spawn_args
        return cls.options(num_cpus=recipe.rollout.ray_cpus_per_worker, num_gpus=gpus, max_restarts=0,
                           scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, i)
                           ).remote(recipe, plan, model_path)

    def _start_nccl(self) -> None:
        """A NCCL group of learner rank 0 (rank 0) and the actors' engines (ranks 1..N) for weights."""
        from anytime.rollout.engines.vllm import NcclWeightSender

        host = weight_group_host()
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        world = 1 + len(self.actors)
        timeout_s = 60 * self.recipe.trainer.dist_timeout_minutes   # a sync waits for the rollouts queued before it
        refs = [a.init_weight_group.remote(host, port, 1 + i, world, timeout_s) for i, a in enumerate(self.actors)]
        self._sender = NcclWeightSender(host, port, world, timeout_s)
        self._get(refs, "the NCCL weight-group set-up")

    def _error(self, i: int, exc: Exception, what: str) -> RolloutWorkerError:
        pid = self.pids[i] if i < len(self.pids) else "?"
        last = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        tried = (f"; restarted {self._restarts[i]} time(s) already (`rollout.worker_restarts`)"
                 if i < len(self._restarts) and self._restarts[i] else "")
        return RolloutWorkerError(f"rollout worker {i} (Ray actor, pid {pid}) failed during {what}: "
                                  f"{type(exc).__name__}: {last}{tried}")

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
                    raise self._error(i, exc, what) from None
            raise

    def _replace_if_dead(self, i: int, actor: Any, exc: Exception, what: str) -> None:
        """Actor `actor` (index i) died during `what`: start another in its place, within the recipe's
        restarts, or fail by name. An actor already replaced is left alone."""
        from ray.exceptions import RayActorError

        if actor is not self.actors[i] and isinstance(exc, RayActorError):
            return
        if not isinstance(exc, RayActorError) or self._restarts[i] >= self.recipe.rollout.worker_restarts:
            raise self._error(i, exc, what) from None
        self._restarts[i] += 1
        log.warning("rollout worker %d (Ray actor, pid %s) died during %s; starting another in its place "
                    "(restart %d of %d)", i, self.pids[i], what, self._restarts[i], self.recipe.rollout.worker_restarts)
        self._replace(i)
        if self._weights is not None:   # the latest weights, for whatever it runs next (a regeneration sets its own)
            self._catch_up.append((i, self.call(i, "update_weights", *self._weights)))
            self._holds[i] = self._weights

    def _replace(self, i: int) -> None:
        """A new actor i in place of the old one, holding the weights at `model_path`."""
        import ray

        ray.kill(self.actors[i])
        self.actors[i], self._holds[i] = self._spawn(i), None
        self.nodes[i], self.pids[i] = self._get_one(i, self.actors[i].where.remote(), "a restart")
        if self.recipe.rollout.pin_cpus and not self._spawn_args[-1]:
            self._get_one(i, self.actors[i].pin.remote(*self._pins[i]), "a restart")

    def _get_one(self, i: int, ref: Any, what: str) -> Any:
        import ray

        try:
            return ray.get(ref)
        except Exception as exc:
            raise self._error(i, exc, what) from None

    def _regenerate(self, i: int, lost: _Call, what: str) -> Any:
        """Actor i's rollout whose actor died, generated again by the actor in its place with the
        weights the first one had; the actor then takes the latest weights back."""
        if lost.weights is None and self._holds[i] is not None:   # back to the weights it started with
            self._replace(i)
        elif lost.weights is not None and self._holds[i] is not lost.weights:
            self.actors[i].update_weights.remote(*lost.weights)
        actor = self.actors[i]
        result = self._get_one(i, actor.rollout.remote(*lost.args), f"the regenerated {what.removeprefix('the ')}")
        self._holds[i] = lost.weights
        if self._weights is not lost.weights:
            self._catch_up.append((i, self.call(i, "update_weights", *self._weights)))
            self._holds[i] = self._weights
        return result

    # ---- the transport ----------------------------------------------------------------------------
    def call(self, i: int, method: str, *args: Any) -> _Call:
        actor = self.actors[i]
        return _Call(actor, getattr(actor, method).remote(*args), method, args, self._holds[i])

    def reply(self, i: int, pending: _Call, what: str) -> Any:
        """The call's result. An actor that died is replaced (within `rollout.worker_restarts`): its
        lost rollout is generated again, a lost weight load is made good by the replacement's own."""
        import ray

        try:
            return ray.get(pending.ref)
        except Exception as exc:
            if pending.method == "rollout":
                self._replace_if_dead(i, pending.actor, exc, what)
                return self._regenerate(i, pending, what)
            if pending.method in ("update_weights", "receive_weights"):
                self._replace_if_dead(i, pending.actor, exc, what)
                return None
            raise self._error(i, exc, what) from None

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> list[_Call]:
        """By NCCL from learner rank 0 (a collective with the actors: it waits for their rollouts in
        flight), or one `ray.put` that every actor reads from the object store."""
        import ray

        if self._sender is not None:
            layout = [(k, tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in state.items()]
            pending = [self.call(i, "receive_weights", layout, version) for i in range(self.size)]
            self._sender.send(state)
            return pending
        held = (ray.put(to_numpy(state)), version)
        pending = [self.call(i, "update_weights", *held) for i in range(self.size)]
        if self.recipe.rollout.worker_restarts:   # kept so that a restart can regenerate with it
            self._weights, self._holds = held, [held] * self.size
        return pending

    def offer_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        import ray

        ref = ray.put(to_numpy(state))
        self._offers.extend((i, a.offer_arrays.options(concurrency_group="weights").remote(version, ref))
                            for i, a in enumerate(self.actors))

    def settle(self) -> None:
        """Surface the failure of an in-flight weight offer that has finished (the rest stay pending),
        and confirm the weights a restarted actor was sent."""
        import ray

        catch_up, self._catch_up = self._catch_up, []
        for i, pending in catch_up:
            self.reply(i, pending, "the weight sync")
        if not self._offers:
            return
        done, _ = ray.wait([ref for _, ref in self._offers], num_returns=len(self._offers), timeout=0)
        finished = set(done)
        for i, ref in self._offers:
            if ref in finished:
                self._get_one(i, ref, "an in-flight weight offer")
        self._offers = [o for o in self._offers if o[1] not in finished]

    def close(self) -> None:
        if not self.actors and self._pg is None:
            return
        import psutil
        import ray

        here = ray.get_runtime_context().get_node_id()
        for actor, node, pid in zip(self.actors, self.nodes, self.pids):
            for call in (actor.close, actor.exit):
                try:
                    ray.get(call.remote(), timeout=30)
                except Exception:  # it exited, or was already dead: killing it below is all that is left
                    pass
            if node == here:   # its exit handlers run after Ray reports the exit: let them finish
                try:
                    psutil.wait_procs([psutil.Process(pid)], timeout=30)
                except psutil.NoSuchProcess:
                    pass
            ray.kill(actor)
        self.actors = []
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._pg)
            self._pg = None
        if self._started_ray:
            ray.shutdown()


class RayRollouts(WorkerPool):
    """`rollout.workers` Ray actors driven by learner rank 0 (other ranks only receive their rows)."""

    transport_type = RayTransport

    @property
    def pids(self) -> list[int]:
        return self.transport.pids if self.transport is not None else []
