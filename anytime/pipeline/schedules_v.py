"""V-shape schedules (two chunks per rank, V placement): ZB-V, V-Half and V-Min.

Rank i holds stage i ("down" chunk) and stage 2p-1-i ("up" chunk), so rank 0 holds the first and
the last stage. ZB-V (Qi et al., arXiv 2401.10241 v2) is handcrafted; V-Half and V-Min (Qi et al.,
"Pipeline Parallelism with Controllable Memory", NeurIPS 2024) repeat a building block every 6
chunk-pass slots and differ only in the block's offsets between ranks: smaller offsets shorten a
microbatch's lifespan on a rank and so the number of microbatches alive at once.
"""

from __future__ import annotations

from collections.abc import Callable

from anytime.pipeline.schedule import Action, Schedule, ScheduleRequest, v_placement, v_shaped


def zb_v(req: ScheduleRequest) -> Schedule:
    """Handcrafted ZB-V: zero bubble at T_F = T_B = T_W with p M_B on every rank.

    Rank r runs, with n = max(2p-1, m) microbatches (actions of microbatches >= m are dropped):
      2(p-r)-1 down F's; r x [up F, down F]; (p-r) x [up F, up I, up W];
      steady until all F's are done: [down F (while any left), down I, down W, up F, up I, up W];
      cool-down: r x [down I, up I], (p-r) x [down I, down W], then the up W's, then the down W's.
    """
    p, m = req.ranks, req.microbatches
    n = max(2 * p - 1, m)
    actions: dict[int, list[Action]] = {}
    for r in range(p):
        down, up = r, 2 * p - 1 - r
        count = {(s, k): 0 for s in (down, up) for k in "FIW"}
        order: list[Action] = []

        def emit(*passes: tuple[int, str]) -> None:
            for stage, kind in passes:
                order.append(Action(stage, kind, count[(stage, kind)]))
                count[(stage, kind)] += 1

        for _ in range(2 * (p - r) - 1):
            emit((down, "F"))
        for _ in range(r):
            emit((up, "F"), (down, "F"))
        for _ in range(p - r):
            emit((up, "F"), (up, "I"), (up, "W"))
        while count[(up, "F")] < count[(down, "F")] or count[(down, "F")] < n:
            if count[(down, "F")] < n:
                emit((down, "F"))
            emit((down, "I"), (down, "W"), (up, "F"), (up, "I"), (up, "W"))
        # Cool-down: I's first (they unblock other ranks), W's fill in behind them.
        w_down = count[(down, "W")]
        for _ in range(r):
            emit((down, "I"), (up, "I"))
        for _ in range(p - r):
            emit((down, "I"))
            order.append(Action(down, "W", w_down))
            w_down += 1
        order += [Action(up, "W", j) for j in range(count[(up, "W")], count[(up, "I")])]
        order += [Action(down, "W", j) for j in range(w_down, count[(down, "I")])]
        actions[r] = [a for a in order if a.microbatch < m]
    return Schedule("zb-v", p, m, 2, v_placement(p), actions)


def v_half(req: ScheduleRequest) -> Schedule:
    """V-Half: about half the activation memory of 1F1B ((p+2)//2 M_B) at half its bubble."""
    p = req.ranks
    delta = 3 if p % 2 == 0 else 0  # keeps the four passes in distinct slots mod 6

    def offsets(i: int) -> tuple[int, int, int, int]:
        return 2 * i, 3 * p - 2 - i, 3 * p + delta - 1 + 2 * i, 6 * p + delta - 2 - i

    return _repeat_block("v-half", req, offsets)


def v_min(req: ScheduleRequest) -> Schedule:
    """V-Min: about a third of 1F1B's activation memory (<= (p+4)//3 M_B), bubble about 2/3 of 1F1B."""
    p = req.ranks
    delta = 2 if p % 3 == 0 else 0  # keeps the four passes in distinct slots mod 6

    def offsets(i: int) -> tuple[int, int, int, int]:
        return i, 2 * p - 1 - i, 2 * p + delta + i, 4 * p + delta - 1 - i

    return _repeat_block("v-min", req, offsets)


def _repeat_block(name: str, req: ScheduleRequest, offsets: Callable[[int], tuple[int, int, int, int]]) -> Schedule:
    """Lay microbatch j's passes on rank i at slot offsets(i) + 6j (down F, up F, up I, down I),
    put each W into the first free slot after its I, and keep the slot order as the rank's order.

    Unused slots disappear in execution (the simulator/runtime start each pass as soon as it can),
    so only the order matters. Each dependency sits at least one slot before its consumer and the
    four offsets differ mod 6, which the construction checks.
    """
    p, m = req.ranks, req.microbatches
    period = 6
    slot_of: dict[tuple[int, str, int], int] = {}
    actions: dict[int, list[Action]] = {}
    for i in range(p):
        down, up = i, 2 * p - 1 - i
        fd, fu, iu, idn = offsets(i)
        if len({x % period for x in (fd, fu, iu, idn)}) != 4:
            raise ValueError(f"{name}: building block offsets collide for p={p}; this p is not supported")
        slots: dict[int, Action] = {}
        for j in range(m):
            for base, stage, kind in ((fd, down, "F"), (fu, up, "F"), (iu, up, "I"), (idn, down, "I")):
                slots[base + period * j] = Action(stage, kind, j)
        for t in sorted(t for t, a in slots.items() if a.kind == "I"):
            free = t + 1
            while free in slots:
                free += 1
            act = slots[t]
            slots[free] = Action(act.stage, "W", act.microbatch)
        order = [slots[t] for t in sorted(slots)]
        slot_of.update({(a.stage, a.kind, a.microbatch): t for t, a in slots.items()})
        actions[i] = order
    _check_block_dependencies(name, p, m, slot_of)
    return Schedule(name, p, m, 2, v_placement(p), actions)


def _check_block_dependencies(name: str, p: int, m: int, slot_of: dict[tuple[int, str, int], int]) -> None:
    last = 2 * p - 1
    for j in range(m):
        for s in range(2 * p):
            deps = []
            if s > 0:
                deps.append((("F", s), ("F", s - 1)))
            deps.append((("I", s), ("I", s + 1) if s < last else ("F", s)))
            for (kind, stage), (dkind, dstage) in deps:
                if slot_of[(dstage, dkind, j)] >= slot_of[(stage, kind, j)]:
                    raise ValueError(f"{name}: building block for p={p} violates {dstage}{dkind}{j} -> {stage}{kind}{j}")


ZB_V = v_shaped(zb_v)
V_HALF = v_shaped(v_half)
V_MIN = v_shaped(v_min)
