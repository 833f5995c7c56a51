"""Discrete-event simulator for pipeline schedules: time, idle, memory and p2p of one iteration.

Every rank runs its action list strictly in order; an action starts when the rank is free and its
inputs have arrived: F(s, j) needs F(s-1, j); I/B(s, j) needs the input gradient from I/B(s+1, j)
(the last stage needs its own F); W(s, j) needs I(s, j). An edge between two ranks adds the sender
stage's ``comm`` latency; co-located stages (V placement) hand over for free. All ranks start at
t = 0 and the iteration ends at the makespan (a barrier, e.g. the optimizer step).

Memory is counted in M_B = activations of one microbatch on one full stage (one rank's layers).
An F on a chunk of a v-chunk schedule adds 1/v; I frees all but the W share (w_mem_fraction/v);
W frees that share; a fused B frees 1/v. Memory depends only on the order, not on the times.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from anytime.pipeline.schedule import (
    DEFAULT_W_MEM_FRACTION,
    Action,
    Schedule,
    StageCosts,
    normalize_costs,
)


class DeadlockError(ValueError):
    """No rank can run its next action: the order waits on something that never comes first."""


@dataclass(frozen=True)
class ModelShape:
    """Transformer shape for converting M_B to bytes (Korthikanti et al. 2022, also ZB Table 1).

    One layer's activations for one microbatch take ``s*b*(34h + 5as)`` bytes in 16-bit
    (``5as`` is the stored attention scores; set ``flash_attention`` to drop it). A pending W keeps
    ``32sbh`` of it. ``layers`` is the whole model: a full stage holds ``layers / ranks`` of them.
    """

    hidden: int
    heads: int
    seq_len: int
    micro_batch: int
    layers: int
    dtype_bytes: int = 2
    flash_attention: bool = False

    def __post_init__(self) -> None:
        for name in ("hidden", "heads", "seq_len", "micro_batch", "layers", "dtype_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelShape.{name} must be >= 1, got {getattr(self, name)}")

    def _per_token_units(self) -> float:
        scores = 0 if self.flash_attention else 5 * self.heads * self.seq_len
        return 34 * self.hidden + scores

    def layer_activation_bytes(self) -> float:
        scale = self.dtype_bytes / 2  # the 34/5 factors assume 16-bit activations
        return self.seq_len * self.micro_batch * self._per_token_units() * scale

    def stage_activation_bytes(self, ranks: int) -> float:
        """Bytes of M_B: one microbatch's activations on one full stage (layers / ranks layers)."""
        return self.layer_activation_bytes() * self.layers / ranks

    @property
    def w_mem_fraction(self) -> float:
        """M_W / M_B = 32h / (34h + 5as)."""
        return 32 * self.hidden / self._per_token_units()

    def p2p_message_bytes(self) -> int:
        """One boundary activation (or its gradient): s * b * h elements."""
        return self.seq_len * self.micro_batch * self.hidden * self.dtype_bytes


@dataclass(frozen=True)
class TimedAction:
    rank: int
    action: Action
    start: float
    end: float


@dataclass
class SimResult:
    """Outcome of one simulated iteration.

    Bubble definitions: every rank is measured over the whole iteration [0, makespan]; its
    ``idle`` is makespan - busy. ``bubble_rate`` is the largest ``idle`` divided by the makespan,
    i.e. idle / (busy + idle) of the rank that waits most (for 1F1B: (p-1)/(m+p-1)).
    ``span_idle`` counts only the gaps between a rank's first start and its last end: the
    bubble left when iterations run back to back without a barrier (optimizer post-validation).
    """

    schedule: Schedule
    makespan: float
    busy: list[float]
    idle: list[float]
    span_idle: list[float]
    bubble_rate: float
    peak_memory: list[float]  # M_B units, per rank
    w_mem_fraction: float
    p2p_messages: int  # cross-rank sends (activations + gradients), whole iteration
    timeline: list[TimedAction] = field(repr=False)
    peak_memory_bytes: list[float] | None = None
    p2p_bytes: int | None = None

    def rank_timeline(self, rank: int) -> list[TimedAction]:
        return [t for t in self.timeline if t.rank == rank]

    def idle_between(self, rank: int, start: float, end: float) -> float:
        """Idle time of ``rank`` inside the window [start, end]."""
        busy = sum(max(0.0, min(t.end, end) - max(t.start, start)) for t in self.rank_timeline(rank))
        return max(0.0, end - start) - busy

    def to_dict(self) -> dict:
        """Summary in the ``anytime schedule --json`` layout (compute actions only)."""
        out = self.schedule.to_dict()
        out.update(
            makespan=self.makespan,
            bubble_rate=self.bubble_rate,
            peak_memory=list(self.peak_memory),
            idle=list(self.idle),
            span_idle=list(self.span_idle),
            w_mem_fraction=self.w_mem_fraction,
            p2p_messages=self.p2p_messages,
        )
        if self.peak_memory_bytes is not None:
            out["peak_memory_bytes"] = list(self.peak_memory_bytes)
            out["p2p_bytes"] = self.p2p_bytes
        return out

    def chrome_trace(self, us_per_unit: float = 1000.0) -> dict:
        """Chrome/Perfetto trace (one thread per rank); one cost unit is drawn as ``us_per_unit`` us."""
        events: list[dict] = [
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}}
            for r in range(self.schedule.ranks)
        ]
        for t in self.timeline:
            events.append(
                {
                    "name": str(t.action),
                    "cat": t.action.kind,
                    "ph": "X",
                    "pid": 0,
                    "tid": t.rank,
                    "ts": t.start * us_per_unit,
                    "dur": (t.end - t.start) * us_per_unit,
                    "args": {"stage": t.action.stage, "microbatch": t.action.microbatch},
                }
            )
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write_chrome_trace(self, path: str | Path, us_per_unit: float = 1000.0) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.chrome_trace(us_per_unit)))
        return path


def _dependency(action: Action, last_stage: int) -> tuple[str, int, int] | None:
    """The (event, stage, microbatch) an action waits for; "G" = input gradient of a stage is ready."""
    s, j = action.stage, action.microbatch
    if action.kind == "F":
        return ("F", s - 1, j) if s > 0 else None
    if action.kind in ("I", "B"):
        return ("G", s + 1, j) if s < last_stage else ("F", s, j)
    return ("G", s, j)  # W needs its own stage's I


def simulate(
    schedule: Schedule,
    costs: StageCosts | Sequence[StageCosts] | None = None,
    *,
    w_mem_fraction: float | None = None,
    model: ModelShape | None = None,
) -> SimResult:
    """Run ``schedule`` under ``costs`` (full-stage times; one for all stages or one per stage).

    ``w_mem_fraction`` defaults to the model's M_W/M_B when ``model`` is given, else to
    ``DEFAULT_W_MEM_FRACTION``. Raises ``DeadlockError`` if the order can never complete.
    """
    schedule.validate()
    p, v, nstages = schedule.ranks, schedule.chunks, schedule.stages
    per_stage = normalize_costs(costs, nstages)
    if w_mem_fraction is None:
        w_mem_fraction = model.w_mem_fraction if model is not None else DEFAULT_W_MEM_FRACTION
    if not 0.0 <= w_mem_fraction <= 1.0:
        raise ValueError(f"w_mem_fraction must be in [0, 1], got {w_mem_fraction}")
    timeline, free, messages = _run_actions(schedule, per_stage)
    makespan = max(free) if timeline else 0.0
    busy, idle, span_idle = _rank_times(timeline, p, makespan)
    peaks = [_peak_memory(schedule.actions[r], v, w_mem_fraction) for r in range(p)]
    result = SimResult(
        schedule=schedule,
        makespan=makespan,
        busy=busy,
        idle=idle,
        span_idle=span_idle,
        bubble_rate=max(idle) / makespan if makespan > 0 else 0.0,
        peak_memory=peaks,
        w_mem_fraction=w_mem_fraction,
        p2p_messages=messages,
        timeline=sorted(timeline, key=lambda t: (t.rank, t.start)),
    )
    if model is not None:
        unit = model.stage_activation_bytes(p)
        result.peak_memory_bytes = [pk * unit for pk in peaks]
        result.p2p_bytes = messages * model.p2p_message_bytes()
    return result


def _run_actions(
    schedule: Schedule, per_stage: Sequence[StageCosts]
) -> tuple[list[TimedAction], list[float], int]:
    """Play every rank's actions in order: the timeline, each rank's end time and the cross-rank sends."""
    p, v, nstages = schedule.ranks, schedule.chunks, schedule.stages
    place = schedule.placement

    def duration(a: Action) -> float:
        c = per_stage[a.stage]
        return {"F": c.f, "I": c.b, "W": c.w, "B": c.b + c.w}[a.kind] / v

    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * p
    pos = [0] * p
    timeline: list[TimedAction] = []
    messages = 0
    remaining = sum(len(a) for a in schedule.actions.values())
    while remaining:
        progress = False
        for r in range(p):
            acts = schedule.actions[r]
            while pos[r] < len(acts):
                act = acts[pos[r]]
                dep = _dependency(act, nstages - 1)
                ready = 0.0
                if dep is not None:
                    if dep not in done:
                        break
                    ready = done[dep]
                    if place[dep[1]] != r:
                        ready += per_stage[dep[1]].comm
                start = max(free[r], ready)
                end = start + duration(act)
                free[r] = end
                timeline.append(TimedAction(r, act, start, end))
                if act.kind == "F":
                    done[("F", act.stage, act.microbatch)] = end
                    messages += act.stage < nstages - 1 and place[act.stage + 1] != r
                elif act.kind in ("I", "B"):
                    done[("G", act.stage, act.microbatch)] = end
                    messages += act.stage > 0 and place[act.stage - 1] != r
                pos[r] += 1
                remaining -= 1
                progress = True
        if not progress:
            blocked = ", ".join(f"rank {r}: {schedule.actions[r][pos[r]]}" for r in range(p) if pos[r] < len(schedule.actions[r]))
            raise DeadlockError(f"schedule {schedule.name!r} deadlocks; next actions waiting forever: {blocked}")
    return timeline, free, int(messages)


def _rank_times(
    timeline: Sequence[TimedAction], ranks: int, makespan: float
) -> tuple[list[float], list[float], list[float]]:
    """Each rank's busy time, its idle time over the iteration and its idle time between first start and last end."""
    busy = [0.0] * ranks
    first = [float("inf")] * ranks
    last = [0.0] * ranks
    for t in timeline:
        busy[t.rank] += t.end - t.start
        first[t.rank] = min(first[t.rank], t.start)
        last[t.rank] = max(last[t.rank], t.end)
    idle = [makespan - b for b in busy]
    span_idle = [(last[r] - first[r]) - busy[r] if busy[r] else 0.0 for r in range(ranks)]
    return busy, idle, span_idle


def _peak_memory(actions: Sequence[Action], chunks: int, w_mem_fraction: float) -> float:
    delta = {"F": 1.0, "I": -(1.0 - w_mem_fraction), "W": -w_mem_fraction, "B": -1.0}
    mem = peak = 0.0
    for a in actions:
        mem += delta[a.kind] / chunks
        peak = max(peak, mem)
    return peak
