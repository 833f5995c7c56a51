"""Rollout workers in local processes of their own (`rollout.placement: processes`): one node, no
Ray. `rollout.workers` spawned processes, each with its own engine, verifier and share of the cores;
`anytime.rollout.workers.pool.WorkerPool` drives them from learner rank 0, and this transport carries its
messages: each call and its reply over a pipe (a worker answers its calls in order), weights as
one safetensors file in RAM (/dev/shm) that every worker loads and the learner deletes once all
have it, in-flight offers on a second pipe, read by a thread of the worker while its engine
generates. A worker that dies fails the step by name; workers are not restarted (that is Ray's). A
watchdog kills the workers and deletes the files if the learner is killed; `close` ends them
otherwise.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from anytime.rollout.workers.devices import gpus_after_learners, pin_cpus
from anytime.rollout.workers.placement import RolloutWorkerError
from anytime.rollout.workers.pool import WorkerEndpoint, WorkerPool

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from anytime.config import Recipe
    from anytime.config.placement_plan import PlacementPlan

log = logging.getLogger(__name__)
START_TIMEOUT_S = 600


# ---- the worker process ----------------------------------------------------------------------
def _load(path: str) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return list(load_file(path).items())


class FileWeightsEndpoint(WorkerEndpoint):
    """The endpoint with weights arriving as files (paths cross the pipe, not tensors)."""

    def update_weights(self, path: str, version: int) -> None:   # type: ignore[override]
        super().update_weights(_load(path), version)


def _take_offers(endpoint: WorkerEndpoint, offers: Connection) -> None:
    """In-flight weights: each offered file loaded into the worker's mailbox, then acknowledged."""
    while True:
        try:
            version, path = offers.recv()
        except (EOFError, OSError):
            return
        try:
            endpoint.offer_weights(version, _load(path))
            offers.send(None)
        except Exception as exc:   # reported to the learner, which fails the step by name
            offers.send(f"{type(exc).__name__}: {exc}")


def serve(index: int, count: int, recipe: Recipe, plan: PlacementPlan, model_path: str, gpu: int | None,
          calls: Connection, offers: Connection) -> None:
    """A worker process's main: build the endpoint, then answer calls in order until told to close
    (or until the learner's end of the pipe closes)."""
    if gpu is not None:
        torch.cuda.set_device(gpu)
    elif recipe.rollout.pin_cpus:
        pin_cpus(index, count)
    try:
        endpoint = FileWeightsEndpoint(recipe, plan, model_path)
    except Exception as exc:
        calls.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    if endpoint.worker.mailbox is not None:
        threading.Thread(target=_take_offers, args=(endpoint, offers), daemon=True).start()
    calls.send(("ok", os.getpid()))
    try:
        while True:
            try:
                method, args = calls.recv()
            except (EOFError, OSError):
                return
            if method == "close":
                break
            try:
                calls.send(("ok", getattr(endpoint, method)(*args)))
            except Exception as exc:
                calls.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        endpoint.close()
    calls.send(("ok", None))


# ---- the learner's side ----------------------------------------------------------------------
@dataclass
class _Worker:
    """One worker process and the replies it still owes, in call order."""

    process: Any
    calls: Connection
    offers: Connection
    pid: int = 0
    owed: deque = field(default_factory=deque)          # tickets of calls whose replies are unread
    replies: dict[int, Any] = field(default_factory=dict)
    offers_owed: int = 0


class ProcessTransport:
    """`rollout.workers` local worker processes, and their pipes."""

    def __init__(self, recipe: Recipe, plan: PlacementPlan, model_path: str) -> None:
        self.recipe, self.plan = recipe, plan
        self.workers: list[_Worker] = []
        self._tickets = 0
        self._files: list[tuple[str, list[int]]] = []   # weight files and, per worker, the ticket that reads it
        self._offer_files: list[str] = []                 # in-flight weight files not yet taken by every worker
        self._start(recipe, model_path)

    @property
    def size(self) -> int:
        return len(self.workers)

    def _start(self, recipe: Recipe, model_path: str) -> None:
        import multiprocessing as mp

        from anytime.core.watchdog import watch
        from anytime.rollout.engines.weight_files import weight_file_globs

        count = recipe.rollout.workers
        gpus = self._gpus(count)
        context = mp.get_context("spawn")   # CUDA and threads rule out fork
        for i in range(count):
            calls, child_calls = context.Pipe()
            offers, child_offers = context.Pipe()
            process = context.Process(target=serve, name=f"anytime-rollout-{i}",
                                      args=(i, count, recipe, self.plan, model_path, gpus[i], child_calls,
                                            child_offers))
            process.start()
            child_calls.close()
            child_offers.close()
            self.workers.append(_Worker(process, calls, offers))
        watch([w.process.pid for w in self.workers], owner_files=weight_file_globs(os.getpid()))
        try:
            for i, w in enumerate(self.workers):
                if not w.calls.poll(START_TIMEOUT_S):
                    raise self._error(i, "start-up", f"no answer within {START_TIMEOUT_S} s")
                w.pid = self._read(i, "start-up")
        except BaseException:
            self.close()
            raise

    def _gpus(self, count: int) -> list[int | None]:
        """With GPUs in the plan, worker i takes the i-th GPU after the learner processes' (pipeline stages
        included)."""
        if not self.plan.gpus_per_worker:
            return [None] * count
        return list(gpus_after_learners(self.plan.learner_processes, count)[:count])

    def _error(self, i: int, what: str, why: str) -> RolloutWorkerError:
        w = self.workers[i]
        return RolloutWorkerError(f"rollout worker {i} (local process, pid {w.pid or w.process.pid}) failed during "
                                  f"{what}: {why}")

    def _read(self, i: int, what: str) -> Any:
        """The next reply of worker i."""
        w = self.workers[i]
        try:
            status, value = w.calls.recv()
        except (EOFError, OSError):
            w.process.join(timeout=5)
            raise self._error(i, what, f"the process died (exit code {w.process.exitcode})") from None
        if status == "error":
            raise self._error(i, what, value)
        return value

    def call(self, i: int, method: str, *args: Any) -> int:
        w = self.workers[i]
        self._tickets += 1
        try:
            w.calls.send((method, args))
        except (BrokenPipeError, OSError):
            raise self._error(i, method, f"the process died (exit code {w.process.exitcode})") from None
        w.owed.append(self._tickets)
        return self._tickets

    def reply(self, i: int, ticket: int, what: str) -> Any:
        """The reply to call `ticket` of worker i (replies to earlier calls are read and kept)."""
        w = self.workers[i]
        while ticket not in w.replies:
            if not w.owed:
                raise RuntimeError(f"rollout worker {i} owes no reply to call {ticket}")
            w.replies[w.owed.popleft()] = self._read(i, what)
        value = w.replies.pop(ticket)
        self._delete_loaded_files()
        return value

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> list[int]:
        from anytime.rollout.engines.weight_files import write_weights

        path = write_weights(list(state.items()))
        tickets = [self.call(i, "update_weights", path, version) for i in range(self.size)]
        self._files.append((path, tickets))
        return tickets

    def _delete_loaded_files(self) -> None:
        """Delete the weight files every worker has read (their calls were answered)."""
        keep = []
        for path, tickets in self._files:
            if any(t in w.owed for w, t in zip(self.workers, tickets)):
                keep.append((path, tickets))
            else:
                os.unlink(path)
        self._files = keep

    def offer_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        from anytime.rollout.engines.weight_files import write_weights

        self._check_offers(block=True)   # the previous version reached every worker: its file can go
        path = write_weights(list(state.items()))
        for i, w in enumerate(self.workers):
            try:
                w.offers.send((version, path))
            except (BrokenPipeError, OSError):
                raise self._error(i, "an in-flight weight offer", "the process died") from None
            w.offers_owed += 1
        self._offer_files.append(path)

    def settle(self) -> None:
        self._check_offers(block=False)

    def _check_offers(self, block: bool) -> None:
        """Read the workers' acknowledgements of in-flight offers (waiting for all when `block`);
        delete the files every worker has taken; a failed offer fails by name."""
        for i, w in enumerate(self.workers):
            while w.offers_owed and (block or w.offers.poll()):
                try:
                    problem = w.offers.recv()
                except (EOFError, OSError):
                    raise self._error(i, "an in-flight weight offer", "the process died") from None
                w.offers_owed -= 1
                if problem is not None:
                    raise self._error(i, "an in-flight weight offer", problem)
        taken = len(self._offer_files) - max((w.offers_owed for w in self.workers), default=0)
        for path in self._offer_files[:taken]:
            os.unlink(path)
        self._offer_files = self._offer_files[taken:]

    def close(self) -> None:
        for i, w in enumerate(self.workers):
            try:
                w.calls.send(("close", ()))
                while w.calls.poll(60):   # replies still owed, then the close's own
                    w.calls.recv()
            except (EOFError, OSError, BrokenPipeError):
                pass
            w.process.join(timeout=30)
            if w.process.is_alive():
                log.warning("rollout worker %d (pid %s) did not exit in 30 s; killing it", i, w.process.pid)
                w.process.kill()
                w.process.join(timeout=10)
            w.calls.close()
            w.offers.close()
        self.workers = []
        for path in [p for p, _ in self._files] + self._offer_files:
            if os.path.exists(path):
                os.unlink(path)
        self._files, self._offer_files = [], []


class ProcessRollouts(WorkerPool):
    """`rollout.workers` local worker processes driven by learner rank 0 (other ranks receive their rows)."""

    transport_type = ProcessTransport

    @property
    def workers(self) -> list[_Worker]:
        return self.transport.workers if self.transport is not None else []
