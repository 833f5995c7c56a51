"""Rollout workers in local processes of their own (`rollout.placement: processes`): one node, no
Ray. `rollout.workers` spawned processes, each with its own engine, verifier and share of the
cores, driven by learner rank 0 over a pipe each; rank 0 hands each whole prompts (all branches of a
prompt on one worker), joins their rows and sends every learner rank its own, as the Ray placement
does (`anytime.rollout.ray_workers`), with the same guarantees: a worker runs its calls in order, so
a weight sync reaches it after the rollouts submitted before it (locked staleness), and a worker that
dies fails the step by name. Workers are not restarted (that is Ray's).

Weights travel as one safetensors file in RAM (/dev/shm) that every worker loads and the learner
deletes once all have it. In-flight weights (`rollout.staleness_mode: inflight`) arrive on a second
pipe, read by a thread of the worker while its engine generates. A watchdog kills the workers and
deletes the files if the learner is killed; `close` ends them otherwise.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from anytime.batch.train_batch import TrainBatch
from anytime.core.dist import broadcast_object, local_share, rank_world
from anytime.rollout.placement import (
    RolloutWorkerError,
    gpus_after_learners,
    pin_cpus,
    scatter_results,
    to_numpy,
)

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from anytime.config import Recipe

T = TypeVar("T")
log = logging.getLogger(__name__)
START_TIMEOUT_S = 600


# ---- the worker process ----------------------------------------------------------------------
def _load(path: str) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return list(load_file(path).items())


def _take_offers(worker: Any, offers: Connection) -> None:
    """In-flight weights: each offered file loaded into the worker's mailbox, then acknowledged."""
    while True:
        try:
            version, path = offers.recv()
        except (EOFError, OSError):
            return
        try:
            worker.offer_weights(version, _load(path))
            offers.send(None)
        except Exception as exc:   # reported to the learner, which fails the step by name
            offers.send(f"{type(exc).__name__}: {exc}")


def _call(worker: Any, method: str, args: tuple) -> Any:
    if method == "rollout":
        batch, sums, timings = worker.rollout(*args)
        return to_numpy(batch.to_tensors()), sums, timings
    if method == "update_weights":
        return worker.update_weights(_load(*args))
    if method == "apply":
        fn, min_version = args
        worker.wait_for_version(min_version)
        return worker.apply(fn)
    if method in ("sleep", "wake_up"):
        return getattr(worker, method)()
    raise ValueError(f"unknown rollout worker call {method!r}")


def serve(index: int, count: int, recipe: Recipe, model_path: str, pad_id: int, gpu: int | None,
          calls: Connection, offers: Connection) -> None:
    """A worker process's main: build the worker, then answer calls in order until told to close
    (or until the learner's end of the pipe closes)."""
    from transformers import AutoTokenizer

    from anytime.rollout.worker import RolloutWorker

    if gpu is not None:
        torch.cuda.set_device(gpu)
    elif recipe.rollout.pin_cpus:
        pin_cpus(index, count)
    try:
        worker = RolloutWorker(recipe, model_path, AutoTokenizer.from_pretrained(model_path), pad_id)
    except Exception as exc:
        calls.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    if worker.mailbox is not None:
        threading.Thread(target=_take_offers, args=(worker, offers), daemon=True).start()
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
                calls.send(("ok", _call(worker, method, args)))
            except Exception as exc:
                calls.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        worker.close()
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


@dataclass
class Submitted:
    step: int
    tickets: list[int]


class ProcessRollouts:
    """`rollout.workers` local worker processes driven by learner rank 0 (other ranks receive their rows)."""

    def __init__(self, recipe: Recipe, model_path: str, tokenizer: Any, pad_id: int, learner: Any) -> None:
        self.recipe, self.learner = recipe, learner
        self.workers: list[_Worker] = []
        self._tickets = 0
        self._files: list[tuple[str, list[int]]] = []   # weight files and, per worker, the ticket that reads it
        self._offer_files: list[str] = []                 # in-flight weight files not yet taken by every worker
        self._offered = 0
        self._watchdog = None
        if rank_world()[0] == 0:
            self._start(recipe, model_path, pad_id)

    def _start(self, recipe: Recipe, model_path: str, pad_id: int) -> None:
        import multiprocessing as mp

        from anytime.core.watchdog import watch
        from anytime.rollout.weight_files import weight_file_globs

        count = recipe.rollout.workers
        gpus = self._gpus(count)
        context = mp.get_context("spawn")   # CUDA and threads rule out fork
        for i in range(count):
            calls, child_calls = context.Pipe()
            offers, child_offers = context.Pipe()
            process = context.Process(target=serve, name=f"anytime-rollout-{i}",
                                      args=(i, count, recipe, model_path, pad_id, gpus[i], child_calls, child_offers))
            process.start()
            child_calls.close()
            child_offers.close()
            self.workers.append(_Worker(process, calls, offers))
        self._watchdog = watch([w.process.pid for w in self.workers], owner_files=weight_file_globs(os.getpid()))
        try:
            for i, w in enumerate(self.workers):
                if not w.calls.poll(START_TIMEOUT_S):
                    raise self._error(i, "start-up", f"no answer within {START_TIMEOUT_S} s")
                w.pid = self._reply(i, "start-up")
        except BaseException:
            self.close()
            raise

    def _gpus(self, count: int) -> list[int | None]:
        """On CUDA, worker i takes the i-th GPU after the learner processes' (pipeline stages included)."""
        if not torch.cuda.is_available():
            return [None] * count
        return list(gpus_after_learners(self.recipe.learner.processes, count)[:count])

    # ---- calls, answered in order -------------------------------------------------------------
    def _error(self, i: int, what: str, why: str) -> RolloutWorkerError:
        w = self.workers[i]
        return RolloutWorkerError(f"rollout worker {i} (local process, pid {w.pid or w.process.pid}) failed during "
                                  f"{what}: {why}")

    def _reply(self, i: int, what: str) -> Any:
        w = self.workers[i]
        try:
            status, value = w.calls.recv()
        except (EOFError, OSError):
            w.process.join(timeout=5)
            raise self._error(i, what, f"the process died (exit code {w.process.exitcode})") from None
        if status == "error":
            raise self._error(i, what, value)
        return value

    def _send(self, i: int, method: str, *args: Any) -> int:
        w = self.workers[i]
        self._tickets += 1
        try:
            w.calls.send((method, args))
        except (BrokenPipeError, OSError):
            raise self._error(i, method, f"the process died (exit code {w.process.exitcode})") from None
        w.owed.append(self._tickets)
        return self._tickets

    def _result(self, i: int, ticket: int, what: str) -> Any:
        """The reply to call `ticket` of worker i (replies to earlier calls are read and kept)."""
        w = self.workers[i]
        while ticket not in w.replies:
            if not w.owed:
                raise RuntimeError(f"rollout worker {i} owes no reply to call {ticket}")
            w.replies[w.owed.popleft()] = self._reply(i, what)
        return w.replies.pop(ticket)

    # ---- the placement interface ----------------------------------------------------------------
    def rollout(self, prompts: Sequence[Sequence[int]], golds: Sequence[Any], step: int
                ) -> tuple[TrainBatch, dict[str, float], dict[str, float]]:
        return self.collect(self.submit(prompts, golds, step))

    def submit(self, prompts: Sequence[Sequence[int]], golds: Sequence[Any], step: int) -> Submitted:
        n, tickets = len(prompts), []
        for i in range(len(self.workers)):
            c = local_share(range(n), i, len(self.workers))
            tickets.append(self._send(i, "rollout", [list(prompts[j]) for j in c], [golds[j] for j in c], step, c,
                                      n, self._offered))
        return Submitted(step, tickets)

    def collect(self, handle: Submitted) -> tuple[TrainBatch, dict[str, float], dict[str, float]]:
        results = None
        if self.workers:
            what = f"the rollout of step {handle.step}"
            results = [self._result(i, t, what) for i, t in enumerate(handle.tickets)]
            self._delete_loaded_files()
            self._check_offers(block=False)
        return scatter_results(results, self.recipe, self.learner)

    def sync_weights(self, learner: Any, version: int = 0) -> None:
        """The learner's weights to every worker, as one file in RAM: queued behind their rollouts
        (locked), or offered at once on the second pipe (in flight); at max_staleness 0 the call
        returns when every worker has them."""
        from anytime.rollout.weight_files import write_weights

        state = learner.full_state_dict()  # collective; complete on rank 0
        if not self.workers:
            return
        path = write_weights(list(state.items()))
        if self.recipe.rollout.staleness_mode == "inflight":
            self._check_offers(block=True)   # the previous version reached every worker: its file can go
            for i, w in enumerate(self.workers):
                try:
                    w.offers.send((version, path))
                except (BrokenPipeError, OSError):
                    raise self._error(i, "an in-flight weight offer", "the process died") from None
                w.offers_owed += 1
            self._offer_files.append(path)
            self._offered = version
            return
        self._files.append((path, [self._send(i, "update_weights", path) for i in range(len(self.workers))]))
        if self.recipe.rollout.max_staleness == 0:
            for i, ticket in enumerate(self._files[-1][1]):
                self._result(i, ticket, "the weight sync")
            self._delete_loaded_files()

    def _delete_loaded_files(self) -> None:
        """Delete the weight files every worker has read (their calls were answered)."""
        keep = []
        for path, tickets in self._files:
            if any(t in w.owed for w, t in zip(self.workers, tickets)):
                keep.append((path, tickets))
            else:
                for w, t in zip(self.workers, tickets):
                    w.replies.pop(t, None)
                os.unlink(path)
        self._files = keep

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

    def on_first_worker(self, fn: Callable[[Any], T]) -> T:
        value = None
        if self.workers:
            value = self._result(0, self._send(0, "apply", fn, self._offered), getattr(fn, "__name__", "a call"))
            self._delete_loaded_files()
        return broadcast_object(value)

    def _everyone(self, method: str) -> None:
        tickets = [self._send(i, method) for i in range(len(self.workers))]
        for i, t in enumerate(tickets):
            self._result(i, t, method)

    def sleep(self) -> None:
        self._everyone("sleep")

    def wake_up(self) -> None:
        self._everyone("wake_up")

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
