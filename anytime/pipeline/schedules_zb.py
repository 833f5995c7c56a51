"""Handcrafted zero-bubble schedules on one chunk per rank: ZB-H1 and ZB-H2 (Qi et al., ICLR 2024)."""

from __future__ import annotations

import bisect
from collections import deque

from anytime.pipeline.schedule import Action, Generator, Schedule, ScheduleRequest, loop_placement

_EPS = 1e-9


def zb_h1(req: ScheduleRequest) -> Schedule:
    """1F1B with the backward split into I and W, and rank i's W's delayed by i microbatches.

    The delayed W's fill the cool-down gaps, cutting the bubble to (p-1)(T_F+T_B-T_W) while rank i
    holds at most (p-i) M_B + i M_W <= p M_B, the 1F1B peak.
    """
    p, m = req.ranks, req.microbatches
    actions: dict[int, list[Action]] = {}
    for i in range(p):
        warmup = min(p - 1 - i, m)
        order = [Action(i, "F", j) for j in range(warmup)]
        for k in range(m):
            if warmup + k < m:
                order.append(Action(i, "F", warmup + k))
            order.append(Action(i, "I", k))
            if k >= i:
                order.append(Action(i, "W", k - i))
        order += [Action(i, "W", k) for k in range(max(0, m - i), m)]
        actions[i] = order
    return Schedule("zb-h1", p, m, 1, loop_placement(p, 1), actions)


def zb_h2(req: ScheduleRequest) -> Schedule:
    """Zero bubble with up to (2p-1) M_B per rank (or ``mem_limit`` when given).

    Built by cost-aware list scheduling: whenever a rank is free it runs, in priority order, a
    ready I (it unblocks the ranks above), a ready F that fits in memory, or its oldest pending
    W; otherwise it waits. Early ranks thus fill the wait for their first I with extra forwards
    (2p-1-2i at equal costs), and W's soak up every gap, which at equal costs leaves no idle time
    between a rank's first and last action once m >= 2p-1.
    """
    p, m = req.ranks, req.microbatches
    cap = float(2 * p - 1) if req.mem_limit is None else float(req.mem_limit)
    orders = _list_schedule(req, cap)
    return Schedule("zb-h2", p, m, 1, loop_placement(p, 1), orders)


def _list_schedule(req: ScheduleRequest, cap: float) -> dict[int, list[Action]]:
    """Greedy event-driven scheduler (single chunk, loop placement); priority I > F > W."""
    p, m = req.ranks, req.microbatches
    comm = [c.comm for c in req.costs]
    f_end: list[list[float | None]] = [[None] * m for _ in range(p)]
    i_end: list[list[float | None]] = [[None] * m for _ in range(p)]
    n_f, n_i = [0] * p, [0] * p
    pending: list[deque[int]] = [deque() for _ in range(p)]
    mem = [0.0] * p
    clock = [0.0] * p
    orders: dict[int, list[Action]] = {r: [] for r in range(p)}
    events: list[float] = []  # sorted times at which some dependency becomes ready
    total = 3 * p * m
    stalled: set[int] = set()

    def place(r: int, act: Action, start: float) -> None:
        end = start + req.pass_time(r, act.kind)
        orders[r].append(act)
        mem[r] += req.mem_delta(act.kind)
        clock[r] = end
        if act.kind == "F":
            f_end[r][act.microbatch] = end
            n_f[r] += 1
            bisect.insort(events, end + (comm[r] if r < p - 1 else 0.0))
        elif act.kind == "I":
            i_end[r][act.microbatch] = end
            n_i[r] += 1
            pending[r].append(act.microbatch)
            bisect.insort(events, end + (comm[r] if r > 0 else 0.0))
        bisect.insort(events, end)

    placed = 0
    while placed < total:
        # Earliest rank first; a rank that just found nothing to do yields to others at that time.
        # (Clocks are rounded so float noise cannot split a tie.)
        r = min((round(clock[x], 9), x in stalled, x) for x in range(p) if len(orders[x]) < 3 * m)[2]
        t = clock[r]
        i_ready = f_ready = None
        if n_i[r] < n_f[r]:
            j = n_i[r]
            dep = f_end[r][j] if r == p - 1 else i_end[r + 1][j]
            if dep is not None:
                i_ready = dep + (comm[r + 1] if r < p - 1 else 0.0)
        if n_f[r] < m and mem[r] + req.mem_delta("F") <= cap + _EPS:
            j = n_f[r]
            dep = 0.0 if r == 0 else f_end[r - 1][j]
            if dep is not None:
                f_ready = dep + (comm[r - 1] if r > 0 else 0.0)
        if i_ready is not None and i_ready <= t + _EPS:
            place(r, Action(r, "I", n_i[r]), t)
        elif f_ready is not None and f_ready <= t + _EPS:
            place(r, Action(r, "F", n_f[r]), t)
        elif pending[r]:
            place(r, Action(r, "W", pending[r].popleft()), t)
        else:
            busy_now = [x for x in range(p) if x != r and x not in stalled and len(orders[x]) < 3 * m]
            if any(abs(clock[x] - t) <= _EPS for x in busy_now):
                stalled.add(r)
                continue
            # Wake at the next moment anything can change: a known arrival, a completion, or
            # another rank's next decision (it may place what this rank waits for).
            wake = [x for x in (i_ready, f_ready) if x is not None and x > t + _EPS]
            k = bisect.bisect_right(events, t + _EPS)
            wake += events[k : k + 1]
            wake += [clock[x] for x in range(p) if x != r and len(orders[x]) < 3 * m and clock[x] > t + _EPS]
            nxt = min(wake, default=None)
            if nxt is None:
                raise ValueError(
                    f"zb-h2: memory limit {cap} M_B leaves rank {r} no runnable action; raise mem_limit"
                )
            clock[r] = nxt
            stalled.clear()
            continue
        stalled.clear()
        placed += 1
    return orders


ZB_H1 = Generator(zb_h1)
ZB_H2 = Generator(zb_h2)
