"""The verifiable math reward: answer extraction + math-verify, scored in killable worker processes.

Model outputs are untrusted: a ``\\boxed{9^{9^{9}}}`` sends sympy into a C-level big-integer loop
that no signal can interrupt, and math-verify's own timeouts use ``signal.alarm`` (main thread
only). So `RewardScorer` scores in a pool of worker processes, bounds every item's wall-clock time
from the parent and SIGKILLs a worker that overruns (the item gets reason ``timeout``, a fresh
worker replaces it). `score_one` is the same computation in-process, for workers and tests.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import os
import signal
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from anytime.answer import (
    DEFAULT_HEADER,
    THINK_END,
    as_latex,
    canonical_spacing,
    extract_answer,
    extract_boxed,
    header_key,
    normalize_gold,
    sanitize,
)

__all__ = [
    "DEFAULT_HEADER",
    "REASONS",
    "THINK_END",
    "RewardScorer",
    "Verdict",
    "extract_answer",
    "extract_boxed",
    "normalize_gold",
    "score_one",
]

REASONS: tuple[str, ...] = ("correct", "wrong", "no_answer", "bad_format", "timeout", "error")


@dataclass(frozen=True)
class Verdict:
    """The reward of one model output."""

    score: float  # 1.0 or 0.0
    reason: str  # one of REASONS
    parsed: str | None  # the extracted \boxed{} content, None when there was none


def _check_format(text: str, think_end: str) -> bool:
    return text.count(think_end) == 1


def _parse(answer: str, math_timeout_s: int | None) -> list[Any]:
    """math-verify's parse of a gold or predicted answer. Its results end with the answer as a
    string, compared as strings when sympy cannot read one side; that copy gets canonical spacing,
    so ``E_1, E_2`` matches ``E_1,E_2`` there as it would as math."""
    from math_verify import parse  # lazy: importing sympy costs ~1 s

    parsed = parse(as_latex(answer), parsing_timeout=math_timeout_s)
    return [canonical_spacing(item) if isinstance(item, str) else item for item in parsed]


def _verify(golds: Sequence[Any], answer: str, math_timeout_s: int | None) -> bool:
    from math_verify import verify

    predicted = _parse(answer, math_timeout_s)
    return bool(predicted) and any(
        verify(gold, predicted, timeout_seconds=math_timeout_s) for gold in golds
    )


def _parse_gold(gold: str, math_timeout_s: int | None) -> Any:
    return _parse(gold, math_timeout_s)


def _score(
    text: str,
    golds: Sequence[str],
    key: str,
    think_end: str,
    math_timeout_s: int | None,
    parse_gold: Callable[[str], Any],
) -> Verdict:
    """Score raw ``text`` against normalised ``golds``; ``key`` is the stripped header."""
    text = sanitize(text)
    if not _check_format(text, think_end):
        return Verdict(0.0, "bad_format", None)
    answer = extract_answer(text.split(think_end, 1)[1], key)
    if not answer:  # no header paragraph, no box in it, or an empty box
        return Verdict(0.0, "no_answer", answer)
    try:
        correct = _verify([parse_gold(gold) for gold in golds], answer, math_timeout_s)
    except Exception:  # math-verify swallows most errors itself; anything left is ours to label
        return Verdict(0.0, "error", answer)
    return Verdict(1.0, "correct", answer) if correct else Verdict(0.0, "wrong", answer)


def score_one(
    text: str,
    gold: object,
    header: str = DEFAULT_HEADER,
    think_end: str = THINK_END,
    *,
    math_timeout_s: int | None = 5,
) -> Verdict:
    """Score one output in this process.

    ``text`` is what follows the thinking and must contain exactly one ``think_end`` (else
    ``bad_format``); the answer is the last ``\\boxed{}`` of the first paragraph after it that
    starts with ``header``. ``math_timeout_s`` is math-verify's own ``signal.alarm`` timeout: it
    only works in the main thread and cannot stop C-level work, so untrusted batches belong in
    `RewardScorer`. Pass None to disable it (then nothing bounds the time).
    """
    if not isinstance(text, str):
        raise ValueError(f"text must be a str (the model output), got {type(text).__name__}")
    if math_timeout_s is not None and threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "score_one with math_timeout_s set must run in the main thread (math-verify uses "
            "signal.alarm); use RewardScorer, or pass math_timeout_s=None and bound time yourself"
        )
    if not think_end:
        raise ValueError("think_end must be a non-empty marker such as '</think>'")
    golds = normalize_gold(gold)
    return _score(
        text,
        golds,
        header_key(header),
        think_end,
        math_timeout_s,
        lambda g: _parse_gold(g, math_timeout_s),
    )


# ----------------------------------------------------------------------------- worker process

_GOLD_CACHE_SIZE = 4096
_MAX_CRASHES = 2  # worker deaths on one item before it is scored "error"
_SIGXCPU = getattr(signal, "SIGXCPU", 24)
_MAX_START_FAILURES = 3  # consecutive deaths of starting workers before the scorer gives up


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
    conn: Connection, key: str, think_end: str, memory_limit_mb: int | None, cpu_cap_s: int
) -> None:
    """Worker loop: receive chunks of (index, text, golds), send one result per item."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _limit_memory(memory_limit_mb)
    # Timeouts are the parent's job (it kills us); math-verify's alarm would only blur the
    # "timeout" reason, and its warning about the disabled alarm is noise here.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    gold_cache: dict[str, Any] = {}

    def parse_gold(gold: str) -> Any:
        if gold not in gold_cache:
            if len(gold_cache) >= _GOLD_CACHE_SIZE:
                gold_cache.clear()
            gold_cache[gold] = _parse_gold(gold, None)
        return gold_cache[gold]

    # Warm math-verify up before announcing readiness, so import time never counts as an
    # item's time.
    _score(f"{think_end}\n\n{key}\n\\boxed{{1}}", ["1"], key, think_end, None, parse_gold)
    conn.send(("ready",))
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return
        if chunk is None:
            return
        for index, text, golds in chunk:
            _cap_next_item_cpu(cpu_cap_s)
            try:
                verdict = _score(text, golds, key, think_end, None, parse_gold)
            except Exception:  # e.g. MemoryError from the address-space limit
                verdict = Verdict(0.0, "error", None)
            try:
                conn.send((index, verdict.score, verdict.reason, verdict.parsed))
            except OSError:  # the parent is gone
                return


# ----------------------------------------------------------------------------- parent side


@dataclass(eq=False)
class _Worker:
    process: Any  # multiprocessing process object of the scorer's context
    conn: Connection
    pid: int  # kept here: a closed process object no longer answers .pid
    ready: bool = False
    inflight: deque[int] = field(default_factory=deque)  # item indices, in the worker's order
    deadline: float = float("inf")  # monotonic time by which the head item must be done


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


class RewardScorer:
    """Scores batches of model outputs in a pool of worker processes with a per-item time limit.

    The pool lives until `close()` (or the end of a ``with`` block); items are sent in chunks to
    amortise IPC, each item gets ``timeout_s`` of wall-clock time from the moment its worker
    starts it, and an overrunning worker is SIGKILLed and replaced.
    """

    def __init__(
        self,
        num_workers: int | None = None,
        timeout_s: float = 5.0,
        header: str = DEFAULT_HEADER,
        think_end: str = THINK_END,
        *,
        chunk_size: int | None = None,
        memory_limit_mb: int | None = 4096,
    ) -> None:
        num_workers = (os.cpu_count() or 1) if num_workers is None else num_workers
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be a positive int or None, got {num_workers!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
        if memory_limit_mb is not None and memory_limit_mb < 256:
            raise ValueError(f"memory_limit_mb must be >= 256 or None, got {memory_limit_mb!r}")
        if not think_end:
            raise ValueError("think_end must be a non-empty marker such as '</think>'")
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.chunk_size = chunk_size
        cpu_cap_s = 2 * math.ceil(timeout_s) + 1  # only reached if this process cannot kill
        self._worker_args = (header_key(header), think_end, memory_limit_mb, cpu_cap_s)
        methods = mp.get_all_start_methods()
        # forkserver forks replacements from a server that already imported sympy (ms, not ~1 s)
        # and, unlike fork, is safe in a parent that runs threads (torch, vLLM).
        self._ctx = mp.get_context("forkserver" if "forkserver" in methods else "spawn")
        if "forkserver" in methods:
            self._ctx.set_forkserver_preload(["math_verify", "anytime.reward"])
        self._workers: list[_Worker] = []
        self._closed = False
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
        return _Worker(process, parent_conn, process.pid)

    def _replace(self, worker: _Worker) -> None:
        _reap([worker])
        self._workers[self._workers.index(worker)] = self._spawn()

    @property
    def pids(self) -> list[int]:
        """Process ids of the current workers (for monitoring and tests)."""
        return [w.pid for w in self._workers]

    def score(self, texts: Sequence[str], golds: Sequence[object]) -> list[Verdict]:
        """Score ``texts[i]`` against ``golds[i]``; returns one `Verdict` per item, in order.

        Golds are normalised here (a bad gold raises ValueError naming its row); texts are only
        looked at inside the workers.
        """
        if self._closed:
            raise RuntimeError("RewardScorer is closed; create a new one")
        if len(texts) != len(golds):
            raise ValueError(f"got {len(texts)} texts but {len(golds)} golds; pass one gold per text")
        items = []
        for i, (text, gold) in enumerate(zip(texts, golds)):
            if not isinstance(text, str):
                raise ValueError(f"texts[{i}] must be a str, got {type(text).__name__}")
            try:
                items.append((i, text, normalize_gold(gold)))
            except ValueError as err:
                raise ValueError(f"golds[{i}]: {err}") from err
        if not items:
            return []
        size = self.chunk_size or max(1, min(32, -(-len(items) // (4 * self.num_workers))))
        try:
            return self._run(items, size)
        except BaseException:
            # Busy workers would deliver stale results into the next call: replace them.
            for worker in list(self._workers):
                if worker.inflight or not worker.process.is_alive():
                    self._replace(worker)
            raise

    def _run(self, items: list[tuple[int, str, list[str]]], size: int) -> list[Verdict]:
        by_index = {item[0]: item for item in items}
        pending = deque(items[start:start + size] for start in range(0, len(items), size))
        results: dict[int, Verdict] = {}
        crashes: dict[int, int] = {}  # item index -> worker deaths while it was the head item

        def requeue(worker: _Worker) -> None:
            if worker.inflight:
                pending.appendleft([by_index[i] for i in worker.inflight])
            worker.inflight.clear()

        while len(results) < len(items):
            now = time.monotonic()
            for worker in self._workers:
                # A worker that died while idle gets no work (its item would be an "error");
                # the death check below replaces it.
                if worker.ready and not worker.inflight and pending and worker.process.is_alive():
                    chunk = pending.popleft()
                    try:
                        worker.conn.send(chunk)
                    except OSError:  # died just now, before reading anything
                        pending.appendleft(chunk)
                        continue
                    worker.inflight.extend(index for index, _, _ in chunk)
                    worker.deadline = time.monotonic() + self.timeout_s
            deadline = min(w.deadline for w in self._workers)
            waitables = [w.conn for w in self._workers] + [w.process.sentinel for w in self._workers]
            wait(waitables, timeout=max(0.0, deadline - now) if deadline < float("inf") else None)
            for worker in list(self._workers):
                self._drain(worker, results)
                if not worker.process.is_alive():
                    self._drain(worker, results)  # whatever it sent just before dying
                    if not worker.ready:
                        # A broken environment fails every start; one killed start is retried.
                        self._start_failures += 1
                        if self._start_failures >= _MAX_START_FAILURES:
                            code = worker.process.exitcode
                            self.close()
                            raise RuntimeError(
                                f"reward workers keep dying while starting (last exit code {code}); "
                                "a script that creates a RewardScorer needs an "
                                "`if __name__ == '__main__':` guard"
                            )
                        self._replace(worker)
                        continue
                    # Died mid-chunk (segfault, OOM kill, or killed from outside before it even
                    # read the chunk): the head item gets one retry, a second death makes it an
                    # "error"; the rest of the chunk is requeued.
                    if worker.inflight and worker.process.exitcode == -_SIGXCPU:
                        # The kernel's CPU cap ended it: this process was too slow to kill it.
                        results[worker.inflight.popleft()] = Verdict(0.0, "timeout", None)
                    elif worker.inflight:
                        head = worker.inflight[0]
                        crashes[head] = crashes.get(head, 0) + 1
                        if crashes[head] >= _MAX_CRASHES:
                            results[worker.inflight.popleft()] = Verdict(0.0, "error", None)
                    requeue(worker)
                    self._replace(worker)
                elif worker.inflight and time.monotonic() > worker.deadline:
                    results[worker.inflight.popleft()] = Verdict(0.0, "timeout", None)
                    requeue(worker)
                    self._replace(worker)
        return [results[i] for i in range(len(items))]

    def _drain(self, worker: _Worker, results: dict[int, Verdict]) -> None:
        """Collect every message the worker has sent so far."""
        try:
            while worker.conn.poll():
                message = worker.conn.recv()
                if message == ("ready",):
                    worker.ready = True
                    self._start_failures = 0
                    continue
                index, score, reason, parsed = message
                if not worker.inflight or worker.inflight[0] != index:
                    raise RuntimeError(f"reward worker answered item {index} out of order")
                worker.inflight.popleft()
                results[index] = Verdict(score, reason, parsed)
                # The worker starts the next item as soon as it sent this one.
                worker.deadline = time.monotonic() + self.timeout_s if worker.inflight else float("inf")
        except (EOFError, OSError):
            pass  # the worker died; the caller sees it through the process sentinel

    def close(self) -> None:
        """Kill and join every worker. Idempotent."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
