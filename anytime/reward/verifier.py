"""The verifiable math reward: answer extraction + math-verify, scored in killable worker processes.

Model outputs are untrusted: a ``\\boxed{9^{9^{9}}}`` sends sympy into a C-level big-integer loop
that no signal can interrupt, and math-verify's own timeouts use ``signal.alarm`` (main thread
only). So `RewardScorer` verifies in a pool of worker processes (`anytime.reward.pool`) that bounds
every item's CPU time (so a busy machine does not change verdicts) and SIGKILLs a worker that
overruns (the item gets reason ``timeout``). Reading the answer out of the text is plain string work with length caps, linear in
the text (`read_answer`); it runs in the parent, so that identical (answer, gold) pairs of a
batch — common at late budgets — are verified once and share the verdict. `score_one` is the same
computation in-process, for tests and trusted input.

A procedural task's gold (`anytime.tasks.reasoning_gym`: a mapping tagged ``task:
reasoning_gym:<name>``) is judged by that task's own scorer instead of math-verify, in the same
workers: math-verify's symbolic equality would pay ``\\boxed{6 - 2}`` for a question asking
6 - 2, since it evaluates the expression (docs/evaluation.md says which judge fits which data).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from anytime.reward.answer import (
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
from anytime.reward.pool import Failure, WorkerPool
from anytime.tasks.reasoning_gym import TaskGold, TaskScorer, as_task_gold, is_full_credit

__all__ = [
    "DEFAULT_HEADER",
    "REASONS",
    "THINK_END",
    "BatchStats",
    "RewardScorer",
    "Verdict",
    "extract_answer",
    "extract_boxed",
    "normalize_gold",
    "read_answer",
    "score_one",
]

REASONS: tuple[str, ...] = ("correct", "wrong", "no_answer", "bad_format", "timeout", "error")


@dataclass(frozen=True)
class Verdict:
    """The reward of one model output."""

    score: float  # 1.0 or 0.0
    reason: str  # one of REASONS
    parsed: str | None  # the extracted \boxed{} content, None when there was none


def read_answer(text: str, header: str = DEFAULT_HEADER, think_end: str = THINK_END) -> Verdict | str:
    """The answer of a model output, or its verdict when it has none: ``bad_format`` unless
    ``think_end`` occurs exactly once, ``no_answer`` without a header paragraph with a non-empty
    box after it. Pure string work, linear in ``len(text)`` (no math parsing: safe outside a
    worker); the verdict of an output depends on ``text`` only through this answer."""
    text = sanitize(text)
    if text.count(think_end) != 1:
        return Verdict(0.0, "bad_format", None)
    answer = extract_answer(text.split(think_end, 1)[1], header)
    if not answer:  # no header paragraph, no box in it, or an empty box
        return Verdict(0.0, "no_answer", answer)
    return answer


def _parse(answer: str, math_timeout_s: int | None) -> list[Any]:
    """math-verify's parse of a gold or predicted answer. Its results end with the answer as a
    string, compared as strings when sympy cannot read one side; that copy gets canonical spacing,
    so ``E_1, E_2`` matches ``E_1,E_2`` there as it would as math."""
    from math_verify import parse  # lazy: importing sympy costs ~1 s

    parsed = parse(as_latex(answer), parsing_timeout=math_timeout_s)
    return [canonical_spacing(item) if isinstance(item, str) else item for item in parsed]


def verify_answer(
    answer: str, golds: Sequence[str], math_timeout_s: int | None, parse_gold: Callable[[str], Any]
) -> Verdict:
    """The verdict of a non-empty extracted ``answer`` against normalised ``golds``."""
    from math_verify import verify

    try:
        predicted = _parse(answer, math_timeout_s)
        correct = bool(predicted) and any(
            verify(parse_gold(gold), predicted, timeout_seconds=math_timeout_s) for gold in golds
        )
    except Exception:  # math-verify swallows most errors itself; anything left is ours to label
        return Verdict(0.0, "error", answer)
    return Verdict(1.0, "correct", answer) if correct else Verdict(0.0, "wrong", answer)


def verify_task_answer(answer: str, gold: TaskGold, scorer: TaskScorer) -> Verdict:
    """The verdict of ``answer`` by the task's own scorer: correct only at full credit (its partial
    credit pays answers that merely contain the result, such as the restated ``6 - 2 = 4``)."""
    try:
        score = scorer(answer, gold)
    except Exception:  # a scorer choking on hostile text, or a gold it cannot read
        return Verdict(0.0, "error", answer)
    return Verdict(1.0, "correct", answer) if is_full_credit(score) else Verdict(0.0, "wrong", answer)


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
    task = as_task_gold(gold)
    golds = normalize_gold(gold) if task is None else []
    read = read_answer(text, header_key(header), think_end)
    if isinstance(read, Verdict):
        return read
    if task is not None:
        return verify_task_answer(read, task, TaskScorer())
    return verify_answer(read, golds, math_timeout_s, lambda g: _parse(g, math_timeout_s))


# ----------------------------------------------------------------------------- the worker pool

_GOLD_CACHE_SIZE = 4096


def _worker_verifier() -> Callable[[str, tuple[str, ...] | TaskGold], tuple[float, str]]:
    """Runs in each worker: verify (answer, golds) with parsed golds cached across items; a
    procedural gold goes to its task's scorer (reasoning-gym is imported on the first one)."""
    # Timeouts are the pool's job (it kills the worker); math-verify's alarm would only blur the
    # "timeout" reason, and its warning about the disabled alarm is noise here.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    gold_cache: dict[str, Any] = {}
    tasks = TaskScorer()

    def parse_gold(gold: str) -> Any:
        if gold not in gold_cache:
            if len(gold_cache) >= _GOLD_CACHE_SIZE:
                gold_cache.clear()
            gold_cache[gold] = _parse(gold, None)
        return gold_cache[gold]

    def verify(answer: str, golds: tuple[str, ...] | TaskGold) -> tuple[float, str]:
        if isinstance(golds, TaskGold):
            verdict = verify_task_answer(answer, golds, tasks)
        else:
            verdict = verify_answer(answer, golds, None, parse_gold)
        return verdict.score, verdict.reason

    return verify


@dataclass(frozen=True)
class BatchStats:
    """What one `RewardScorer.score` call did."""

    items: int  # outputs scored
    answered: int  # outputs with an answer to verify (the rest: bad_format / no_answer)
    verified: int  # math-verify runs in the workers: distinct (answer, gold) pairs when deduplicating

    @property
    def fraction_saved(self) -> float:
        """Share of the answered outputs that needed no math-verify run of their own."""
        return 1.0 - self.verified / self.answered if self.answered else 0.0


class RewardScorer:
    """Scores batches of model outputs; math-verify runs in worker processes with a per-item time limit.

    The pool lives until `close()` (or the end of a ``with`` block). Each call reads the answers
    (string work, here), verifies every distinct (answer, gold) pair once (``dedupe=False``: every
    answered output) in the workers, and gives every output the verdict of its pair; each
    verification gets ``timeout_s`` of its worker's CPU time from the moment the worker starts it
    (at most 6 × ``timeout_s`` of wall time), and an overrunning worker is SIGKILLed and replaced. ``last_stats`` describes the last call.
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
        dedupe: bool = True,
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
        self.dedupe = dedupe
        self.last_stats = BatchStats(0, 0, 0)
        self._key, self._think_end = header_key(header), think_end
        self._closed = False
        self._pool = WorkerPool(
            num_workers, timeout_s, _worker_verifier, ("1", ("1",)), chunk_size=chunk_size,
            memory_limit_mb=memory_limit_mb, preload=["math_verify", "anytime.reward.verifier"],
        )

    @property
    def pids(self) -> list[int]:
        """Process ids of the current workers (for monitoring and tests)."""
        return self._pool.pids

    def wait_ready(self) -> None:
        """Block until every worker has started and warmed up (`score` does not need this)."""
        self._pool.wait_ready()

    def score(self, texts: Sequence[str], golds: Sequence[object]) -> list[Verdict]:
        """Score ``texts[i]`` against ``golds[i]``; returns one `Verdict` per item, in order.

        Golds are normalised first (a bad gold raises ValueError naming its row); texts are read
        with `read_answer`, and only their answers reach math-verify (or a procedural task's scorer),
        in the workers.
        """
        if self._closed:
            raise RuntimeError("RewardScorer is closed; create a new one")
        if len(texts) != len(golds):
            raise ValueError(f"got {len(texts)} texts but {len(golds)} golds; pass one gold per text")
        normalized: list[tuple[str, ...] | TaskGold] = []
        for i, (text, gold) in enumerate(zip(texts, golds)):
            if not isinstance(text, str):
                raise ValueError(f"texts[{i}] must be a str, got {type(text).__name__}")
            try:
                normalized.append(as_task_gold(gold) or tuple(normalize_gold(gold)))
            except ValueError as err:
                raise ValueError(f"golds[{i}]: {err}") from err
        verdicts: list[Verdict | None] = [None] * len(texts)
        # (answer, golds) -> the items that share it; without dedupe the item index keeps them apart
        pairs: dict[tuple[Any, ...], list[int]] = {}
        for i, (text, gold) in enumerate(zip(texts, normalized)):
            read = read_answer(text, self._key, self._think_end)
            if isinstance(read, Verdict):
                verdicts[i] = read
            else:
                pairs.setdefault((read, gold) if self.dedupe else (read, gold, i), []).append(i)
        results = self._pool.run([pair[:2] for pair in pairs])
        for ((answer, *_), indices), result in zip(pairs.items(), results):
            verdict = Verdict(0.0, result.reason, None) if isinstance(result, Failure) else Verdict(*result, answer)
            for i in indices:
                verdicts[i] = verdict
        answered = sum(len(indices) for indices in pairs.values())
        self.last_stats = BatchStats(len(texts), answered, len(pairs))
        return verdicts  # type: ignore[return-value]

    def close(self) -> None:
        """Kill and join every worker. Idempotent."""
        self._closed = True
        self._pool.close()

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
