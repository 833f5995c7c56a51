"""Killable worker processes for the verifier: run one function over many small payloads with a
time limit per item.

Each worker runs ``make_work()`` once and then the returned function on every payload it is sent.
The parent sends payloads in chunks (a worker holds up to two, so it never waits for the parent
between chunks), gives every item ``timeout_s`` of its worker's CPU time from the moment the worker
starts it (wall time where the OS does not report a process's CPU time), and SIGKILLs and replaces
a worker that overruns (the item's result is ``Failure("timeout")``) or dies twice on one item
(``Failure("error")``). Counting CPU time keeps a verdict from depending on how busy the machine
was: an item starved of CPU by other jobs gets its full allowance, up to ``_STARVED_WALL_FACTOR``
times ``timeout_s`` of wall time. `anytime.reward.verifier` builds the verifier on it.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import pickle
import signal
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import psutil

_MAX_CRASHES = 2  # worker deaths on one item before it is an "error"
_SIGXCPU = getattr(signal, "SIGXCPU", 24)
_MAX_START_FAILURES = 3  # consecutive deaths of starting workers before the pool gives up
_MAX_CHUNK = 32
# A second chunk is queued behind a busy worker only if it is this small: a send larger than the
# socket buffer would block the parent until the worker reads it, i.e. past a stuck item's deadline.
_MAX_QUEUED_BYTES = 16 * 1024
_STARVED_WALL_FACTOR = 6  # wall time, in time limits, an item starved of CPU may take at most


def _cpu_seconds(usage: psutil.Process) -> float | None:
    """CPU seconds (user + system) the process has used; None where the OS does not tell."""
    try:
        times = usage.cpu_times()
    except (psutil.Error, NotImplementedError):
        return None
    return times.user + times.system


@dataclass(frozen=True)
class Failure:
    """The result of an item the pool could not finish: ``timeout`` or ``error``."""

    reason: str


def _cap_next_item_cpu(cpu_cap_s: int) -> None:
    """Let the kernel end this worker (SIGXCPU) if the next item burns ``cpu_cap_s`` CPU seconds.

    A backstop for when the parent cannot kill us: if the trainer itself is SIGKILLed, forkserver
    workers outlive it (they hold the server's liveness pipe), and a worker stuck in C code would
    spin forever. CPU time never exceeds wall time, so the parent's wall-clock kill comes first.
    """
    try:
        import resource
    except ImportError:  # not Unix
        return
    usage = resource.getrusage(resource.RUSAGE_SELF)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = int(usage.ru_utime + usage.ru_stime) + cpu_cap_s
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _limit_memory(memory_limit_mb: int | None) -> None:
    try:
        import resource
    except ImportError:  # not Unix
        return
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a SIGXCPU'd worker leaves no core file
    if memory_limit_mb is not None:
        limit = memory_limit_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _worker_main(
    conn: Connection,
    make_work: Callable[[], Callable[..., Any]],
    warmup: tuple[Any, ...],
    memory_limit_mb: int | None,
    cpu_cap_s: int,
) -> None:
    """Worker loop: receive pickled chunks of (index, payload), send (index, result) per item."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _limit_memory(memory_limit_mb)
    work = make_work()
    # Warm up (imports, caches) before announcing readiness, so it never counts as an item's time.
    work(*warmup)
    conn.send(("ready",))
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return
        for index, payload in pickle.loads(data):
            _cap_next_item_cpu(cpu_cap_s)
            try:
                result = work(*payload)
            except Exception:  # e.g. MemoryError from the address-space limit
                result = Failure("error")
            try:
                conn.send((index, result))
            except OSError:  # the parent is gone
                return


@dataclass(eq=False)
class _Worker:
    process: Any  # multiprocessing process object of the pool's context
    conn: Connection
    pid: int  # kept here: a closed process object no longer answers .pid
    usage: psutil.Process  # for its CPU time
    ready: bool = False
    inflight: deque[int] = field(default_factory=deque)  # item indices, in the worker's order
    chunk_ends: deque[int] = field(default_factory=deque)  # last index of each chunk it holds
    deadline: float = float("inf")  # monotonic time by which the head item must be done
    started: float = 0.0  # monotonic time the head item started
    cpu_started: float | None = None  # the worker's CPU seconds then (None: wall time only)


def _reap(workers: list[_Worker]) -> None:
    """SIGKILL and join workers; safe to call twice and from a GC finalizer."""
    for worker in workers:
        if worker.process.is_alive():
            worker.process.kill()
    for worker in workers:
        worker.process.join()
        worker.conn.close()
        worker.process.close()
    workers.clear()


class WorkerPool:
    """``num_workers`` processes that run ``make_work()``'s function with a per-item time limit."""

    def __init__(
        self,
        num_workers: int,
        timeout_s: float,
        make_work: Callable[[], Callable[..., Any]],
        warmup: tuple[Any, ...],
        *,
        chunk_size: int | None = None,
        memory_limit_mb: int | None = None,
        preload: Sequence[str] = (),
    ) -> None:
        self.num_workers, self.timeout_s, self.chunk_size = num_workers, float(timeout_s), chunk_size
        cpu_cap_s = 2 * math.ceil(timeout_s) + 1  # only reached if this process cannot kill
        self._worker_args = (make_work, warmup, memory_limit_mb, cpu_cap_s)
        methods = mp.get_all_start_methods()
        # forkserver forks replacements from a server that already imported the preloads (ms, not
        # ~1 s) and, unlike fork, is safe in a parent that runs threads (torch, vLLM).
        self._ctx = mp.get_context("forkserver" if "forkserver" in methods else "spawn")
        if "forkserver" in methods:
            self._ctx.set_forkserver_preload(list(preload))
        self._workers: list[_Worker] = []
        self._start_failures = 0
        self._finalizer = weakref.finalize(self, _reap, self._workers)
        for _ in range(num_workers):
            self._workers.append(self._spawn())

    def _spawn(self) -> _Worker:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            target=_worker_main, args=(child_conn, *self._worker_args), daemon=True,
            name="anytime-reward-worker",
        )
        process.start()
        child_conn.close()
        return _Worker(process, parent_conn, process.pid, psutil.Process(process.pid))

    def _replace(self, worker: _Worker) -> None:
        _reap([worker])
        self._workers[self._workers.index(worker)] = self._spawn()

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self._workers]

    def wait_ready(self) -> None:
        """Block until every worker has warmed up (for benchmarks that time start-up)."""
        while not all(w.ready for w in self._workers):
            wait([w.conn for w in self._workers] + [w.process.sentinel for w in self._workers], timeout=1.0)
            for worker in list(self._workers):
                self._drain(worker, {})
                if not worker.ready and not worker.process.is_alive():
                    self._start_failed(worker)

    def run(self, payloads: Sequence[tuple[Any, ...]]) -> list[Any]:
        """``work(*payload)`` for every payload, in order; a `Failure` where an item timed out or
        kept killing its worker."""
        try:
            return self._run(list(enumerate(payloads)))
        except BaseException:
            # Busy workers would deliver stale results into the next call: replace them.
            for worker in list(self._workers):
                if worker.inflight or not worker.process.is_alive():
                    self._replace(worker)
            raise

    def _next_chunk(self, pending: deque[tuple[int, Any]]) -> list[tuple[int, Any]]:
        # Guided sizes: large chunks while much is left, single items at the end, so the
        # workers finish together.
        size = self.chunk_size or max(1, min(_MAX_CHUNK, len(pending) // (4 * self.num_workers)))
        return [pending.popleft() for _ in range(min(size, len(pending)))]

    def _dispatch(self, pending: deque[tuple[int, Any]]) -> None:
        for worker in self._workers:
            # A worker that died while idle gets no work (its item would be an "error"); the
            # death check in _run replaces it.
            while worker.ready and pending and len(worker.chunk_ends) < 2 and worker.process.is_alive():
                chunk = self._next_chunk(pending)
                data = pickle.dumps(chunk, protocol=pickle.HIGHEST_PROTOCOL)
                if worker.inflight and len(data) > _MAX_QUEUED_BYTES:
                    pending.extendleft(reversed(chunk))
                    break
                try:
                    worker.conn.send_bytes(data)
                except OSError:  # died just now, before reading anything
                    pending.extendleft(reversed(chunk))
                    break
                if not worker.inflight:
                    self._start_item(worker)
                worker.inflight.extend(index for index, _ in chunk)
                worker.chunk_ends.append(chunk[-1][0])

    def _run(self, items: list[tuple[int, Any]]) -> list[Any]:
        by_index = dict(items)
        pending = deque(items)
        results: dict[int, Any] = {}
        crashes: dict[int, int] = {}  # item index -> worker deaths while it was the head item

        def requeue(worker: _Worker) -> None:
            pending.extendleft(reversed([(i, by_index[i]) for i in worker.inflight]))
            worker.inflight.clear()
            worker.chunk_ends.clear()

        while len(results) < len(items):
            self._dispatch(pending)
            now = time.monotonic()
            deadline = min(w.deadline for w in self._workers)
            waitables = [w.conn for w in self._workers] + [w.process.sentinel for w in self._workers]
            wait(waitables, timeout=max(0.0, deadline - now) if deadline < float("inf") else None)
            for worker in list(self._workers):
                self._drain(worker, results)
                if not worker.process.is_alive():
                    self._drain(worker, results)  # whatever it sent just before dying
                    if not worker.ready:
                        self._start_failed(worker)
                        continue
                    # Died mid-chunk (segfault, OOM kill, or killed from outside before it even
                    # read the chunk): the head item gets one retry, a second death makes it an
                    # "error"; the rest is requeued.
                    if worker.inflight and worker.process.exitcode == -_SIGXCPU:
                        # The kernel's CPU cap ended it: this process was too slow to kill it.
                        results[worker.inflight.popleft()] = Failure("timeout")
                    elif worker.inflight:
                        head = worker.inflight[0]
                        crashes[head] = crashes.get(head, 0) + 1
                        if crashes[head] >= _MAX_CRASHES:
                            results[worker.inflight.popleft()] = Failure("error")
                    requeue(worker)
                    self._replace(worker)
                elif worker.inflight and time.monotonic() > worker.deadline and not self._starved(worker):
                    results[worker.inflight.popleft()] = Failure("timeout")
                    requeue(worker)
                    self._replace(worker)
        return [results[i] for i in range(len(items))]

    def _start_item(self, worker: _Worker) -> None:
        worker.started = time.monotonic()
        worker.cpu_started = _cpu_seconds(worker.usage)
        worker.deadline = worker.started + self.timeout_s

    def _starved(self, worker: _Worker) -> bool:
        """Whether the head item is past its deadline only for want of CPU (the machine is busy);
        if so its deadline moves to when it will have had ``timeout_s`` of CPU."""
        now = time.monotonic()
        if worker.cpu_started is None or now - worker.started >= _STARVED_WALL_FACTOR * self.timeout_s:
            return False
        cpu = _cpu_seconds(worker.usage)
        if cpu is None:
            return False
        used = cpu - worker.cpu_started
        if used >= 0.95 * self.timeout_s:
            return False
        worker.deadline = now + max(self.timeout_s - used, 0.05)
        return True

    def _start_failed(self, worker: _Worker) -> None:
        # A broken environment fails every start; one killed start is retried.
        self._start_failures += 1
        if self._start_failures >= _MAX_START_FAILURES:
            code = worker.process.exitcode
            self.close()
            raise RuntimeError(
                f"reward workers keep dying while starting (last exit code {code}); a script that "
                "creates a RewardScorer needs an `if __name__ == '__main__':` guard"
            )
        self._replace(worker)

    def _drain(self, worker: _Worker, results: dict[int, Any]) -> None:
        """Collect every message the worker has sent so far."""
        try:
            while worker.conn.poll():
                message = worker.conn.recv()
                if message == ("ready",):
                    worker.ready = True
                    self._start_failures = 0
                    continue
                index, result = message
                if not worker.inflight or worker.inflight[0] != index:
                    raise RuntimeError(f"reward worker answered item {index} out of order")
                worker.inflight.popleft()
                if worker.chunk_ends and worker.chunk_ends[0] == index:
                    worker.chunk_ends.popleft()
                results[index] = result
                # The worker starts the next item as soon as it sent this one.
                if worker.inflight:
                    self._start_item(worker)
                else:
                    worker.deadline = float("inf")
        except (EOFError, OSError):
            pass  # the worker died; the caller sees it through the process sentinel

    def close(self) -> None:
        """Kill and join every worker. Idempotent."""
        self._finalizer()
