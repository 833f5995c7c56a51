"""zb-auto: the automatic zero-bubble scheduler (after Qi et al., ICLR 2024, section 3).

Given per-stage T_F, T_B, T_W, the p2p latency, the per-pass activation memory (w_mem_fraction)
and a memory limit, it builds each rank's order while tracking the times it implies:

1. warm-up: every stage runs as many forwards as memory allows and as end before its first input
   gradient can arrive, then the first I's (last stage first);
2. steady: per microbatch, one more F per stage (first -> last) and one I (last -> first); before
   each, pending W's are placed when memory would overflow and when a whole W fits in the wait
   for that pass's input; (flag) a W also goes into a shorter wait before an I when that wait
   would make this stage's accumulated idle the largest of all stages;
3. the W's still pending are appended.

Five yes/no choices give 32 variants (see ``_Flags``); each is timed and the one with the smallest
makespan wins (ties: the shortest longest-rank span, i.e. the least bubble when iterations run
back to back, then the lower peak memory). One chunk per rank; memory is in M_B units.

Where the paper's released code differs in detail (it is not copied here): the warm-up counts may
be forced to fall by one per stage, and partial-gap W's are tried only before I's, which in our
grid of unequal costs (benchmarks/schedules.py) was what kept it never worse than ZB-H1.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import deque
from dataclasses import dataclass

from anytime.pipeline.schedule import Action, Generator, Schedule, ScheduleRequest, loop_placement

_EPS = 1e-9


@dataclass(frozen=True)
class _Flags:
    """The heuristic's yes/no choices; ``zb_auto`` tries every combination."""

    allow_bubble_before_first_i: bool  # a warm-up F may start just before the first I arrives
    prioritize_i: bool  # skip an optional F on a stage 2+ forwards ahead of its successor
    greedy_partial_w: bool  # W into a wait shorter than T_W if that wait would be the worst idle
    strict_warmup: bool  # warm-up counts fall by >= 1 per stage (else: non-increasing)
    bubble_from_start: bool  # a stage's idle counts from t = 0 (else: from its first pass)


class _Builder:
    """Appends actions to per-stage orders and tracks the times and memory they imply."""

    def __init__(self, req: ScheduleRequest, limit: float, flags: _Flags) -> None:
        self.req, self.limit, self.flags = req, limit, flags
        p, m = req.ranks, req.microbatches
        self.p, self.m = p, m
        self.comm = [c.comm for c in req.costs]
        self.order: list[list[Action]] = [[] for _ in range(p)]
        self.free = [0.0] * p
        self.mem = [0.0] * p
        self.bubble = [0.0] * p
        self.pending: list[deque[int]] = [deque() for _ in range(p)]
        self.f_end = [[math.nan] * m for _ in range(p)]
        self.i_end = [[math.nan] * m for _ in range(p)]
        self.n_f = [0] * p
        self.n_i = [0] * p

    def ready(self, s: int, kind: str, j: int) -> float:
        if kind == "F":
            return 0.0 if s == 0 else self.f_end[s - 1][j] + self.comm[s - 1]
        if kind == "I":
            return self.f_end[s][j] if s == self.p - 1 else self.i_end[s + 1][j] + self.comm[s + 1]
        return self.free[s]

    def _append(self, s: int, kind: str, j: int, ready: float) -> None:
        start = max(self.free[s], ready)
        # Flag bubble_from_start: count idle since t = 0 (with equal work per stage the stage
        # with the most idle ends last) rather than since the stage's first pass.
        if self.order[s] or self.flags.bubble_from_start:
            self.bubble[s] += start - self.free[s]
        end = start + self.req.pass_time(s, kind)
        self.order[s].append(Action(s, kind, j))
        self.free[s] = end
        self.mem[s] += self.req.mem_delta(kind)
        if kind == "F":
            self.f_end[s][j] = end
            self.n_f[s] += 1
        elif kind == "I":
            self.i_end[s][j] = end
            self.n_i[s] += 1
            self.pending[s].append(j)

    def _w(self, s: int) -> None:
        self._append(s, "W", self.pending[s].popleft(), self.free[s])

    def can_fit(self, s: int, kind: str) -> bool:
        """Whether ``kind`` fits in memory after running every pending W of stage s."""
        freed = len(self.pending[s]) * -self.req.mem_delta("W")
        return self.mem[s] - freed + self.req.mem_delta(kind) <= self.limit + _EPS

    def place(self, s: int, kind: str, j: int) -> None:
        """Place ``kind`` of microbatch j on stage s, preceded by the W's the rules call for."""
        ready = self.ready(s, kind, j)
        if math.isnan(ready):
            raise AssertionError(f"zb-auto placed {s}{kind}{j} before its dependency")
        need = self.req.mem_delta(kind)
        while self.mem[s] + need > self.limit + _EPS:
            if not self.pending[s]:
                raise ValueError(
                    f"zb-auto: mem_limit={self.limit} M_B cannot hold stage {s}'s in-flight microbatches; raise it"
                )
            self._w(s)
        w_time = self.req.pass_time(s, "W")
        while self.pending[s] and self.free[s] + w_time <= ready + _EPS:
            self._w(s)
        gap = ready - self.free[s]
        if self.flags.greedy_partial_w and self.pending[s] and gap > _EPS and kind == "I":
            if self.bubble[s] + gap > max(self.bubble) + _EPS:
                self._w(s)
        self._append(s, kind, j, ready)

    def flush(self) -> None:
        for s in range(self.p):
            while self.pending[s]:
                self._w(s)


def _warmup_counts(b: _Builder) -> list[int]:
    """Forwards each stage runs before its first I: as many as end before that I can start
    (or start before, with the flag), capped by memory and never rising down the pipe."""
    req, p, m = b.req, b.p, b.m
    per_f = req.mem_delta("F")
    mem_cap = max(1, int(math.floor(b.limit / per_f + _EPS)))
    # Forward end times if every stage ran only forwards, back to back (true during warm-up).
    est = [[0.0] * m for _ in range(p)]
    for s in range(p):
        for j in range(m):
            prev = est[s][j - 1] if j else 0.0
            arrive = est[s - 1][j] + b.comm[s - 1] if s else 0.0
            est[s][j] = max(prev, arrive) + req.pass_time(s, "F")
    counts = [1] * p
    i_end_next = 0.0
    for s in reversed(range(p)):
        arrive = est[s][0] if s == p - 1 else i_end_next + b.comm[s + 1]
        k = 1
        # In the 1F-1B phase stage s needs its next F from stage s-1, which runs that F only after
        # its own next I; that flows only if stage s-1 keeps at least one more forward in flight
        # than stage s (flag strict_warmup: counts fall by >= 1 per stage). Without a long
        # steady phase (small m) equal counts can be better, hence the flag.
        step = 1 if b.flags.strict_warmup else 0
        limit = max(1, min(m, mem_cap - step * s))
        while k < limit:
            start_k = est[s][k] - req.pass_time(s, "F")
            fits = start_k < arrive - _EPS if b.flags.allow_bubble_before_first_i else est[s][k] <= arrive + _EPS
            if not fits:
                break
            k += 1
        if s < p - 1:
            k = min(max(k, counts[s + 1] + step), limit)
        counts[s] = k
        i_end_next = max(arrive, est[s][k - 1]) + req.pass_time(s, "I")
    for s in range(1, p):
        counts[s] = max(1, min(counts[s], counts[s - 1] - step))
    return counts


def _build(req: ScheduleRequest, limit: float, flags: _Flags) -> list[list[Action]]:
    b = _Builder(req, limit, flags)
    p, m = b.p, b.m
    counts = _warmup_counts(b)
    for j in range(max(counts)):
        for s in range(p):
            if counts[s] > j:
                b.place(s, "F", j)
    for s in reversed(range(p)):
        b.place(s, "I", 0)
    for i in range(1, m):
        for s in range(p):
            n = b.n_f[s]
            if n >= m or (s > 0 and n >= b.n_f[s - 1]):
                continue  # nothing left, or the upstream forward is not placed yet
            if n > i and flags.prioritize_i and s < p - 1 and n >= b.n_f[s + 1] + 2:
                continue  # far enough ahead: let the I of this round go first
            if n > i and not b.can_fit(s, "F"):
                continue  # memory is full of microbatches still waiting for their I
            b.place(s, "F", n)
        for s in reversed(range(p)):
            b.place(s, "I", i)
    b.flush()
    return b.order


def _times(req: ScheduleRequest, orders: list[list[Action]]) -> tuple[float, float]:
    """(makespan, longest rank span) by the simulator's timing rules, lean, for one-chunk orders
    (``simulate`` also builds timelines and validates: several times slower)."""
    p, m = req.ranks, req.microbatches
    comm = [c.comm for c in req.costs]
    dur = [{k: req.pass_time(s, k) for k in "FIW"} for s in range(p)]
    f_end = [[math.nan] * m for _ in range(p)]
    g_end = [[math.nan] * m for _ in range(p)]
    pos, free, first = [0] * p, [0.0] * p, [math.inf] * p
    left = sum(len(o) for o in orders)
    while left:
        moved = False
        for s in range(p):
            order = orders[s]
            while pos[s] < len(order):
                a = order[pos[s]]
                j = a.microbatch
                if a.kind == "F":
                    ready = f_end[s - 1][j] + comm[s - 1] if s else 0.0
                elif a.kind == "I":
                    ready = g_end[s + 1][j] + comm[s + 1] if s < p - 1 else f_end[s][j]
                else:
                    ready = 0.0
                if ready != ready:  # NaN: the dependency has not run yet
                    break
                start = max(free[s], ready)
                first[s] = min(first[s], start)
                end = start + dur[s][a.kind]
                free[s] = end
                if a.kind == "F":
                    f_end[s][j] = end
                elif a.kind == "I":
                    g_end[s][j] = end
                pos[s] += 1
                left -= 1
                moved = True
        if not moved:
            return math.inf, math.inf
    return max(free), max(free[s] - first[s] for s in range(p))


def _peak(req: ScheduleRequest, order: list[Action]) -> float:
    mem = peak = 0.0
    for a in order:
        mem += req.mem_delta(a.kind)
        peak = max(peak, mem)
    return peak


def zb_auto(req: ScheduleRequest) -> Schedule:
    """Best heuristic variant under ``mem_limit`` (default p M_B, the 1F1B peak)."""
    p, m = req.ranks, req.microbatches
    limit = float(p) if req.mem_limit is None else float(req.mem_limit)
    best: tuple[float, float, float] | None = None
    best_orders: list[list[Action]] | None = None
    errors: list[str] = []
    for combo in itertools.product((False, True), repeat=len(dataclasses.fields(_Flags))):
        try:
            orders = _build(req, limit, _Flags(*combo))
        except ValueError as err:
            errors.append(str(err))
            continue
        makespan, span = _times(req, orders)
        key = (round(makespan, 9), round(span, 9), max(_peak(req, o) for o in orders))
        if best is None or key < best:
            best, best_orders = key, orders
    if best_orders is None:
        raise ValueError(errors[0])
    return Schedule("zb-auto", p, m, 1, loop_placement(p, 1), {s: best_orders[s] for s in range(p)})


ZB_AUTO = Generator(zb_auto)
