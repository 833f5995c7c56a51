"""Pipeline schedules as data: the action IR, placements, validation and `build_schedule`.

A schedule is, for every pipeline rank, the ordered list of compute actions it runs. Actions use the
notation of ``torch.distributed.pipelining`` (``{stage}{F|I|W|B}{microbatch}``): F = forward,
I = backward for the stage input, W = backward for the weights, B = fused backward (I + W). Keeping
PyTorch's letters lets a schedule be checked by PyTorch's own validators and loaded by its runtime.

Stages are *virtual* stages: with ``chunks = v`` every rank holds v model chunks, so there are
``ranks * v`` stages and ``placement[stage]`` says which rank runs it (loop or V shape).

Generators live in ``schedules_1f1b.py``, ``schedules_zb.py``, ``schedules_v.py`` and ``auto.py``
and are registered by name in ``anytime.pipeline.SCHEDULES``; ``build_schedule`` is the one entry
point.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from anytime.pipeline import SCHEDULES

ACTION_KINDS = ("F", "I", "W", "B")
_ACTION_RE = re.compile(r"^(\d+)([FIWB])(\d+)$")

# M_W / M_B: share of a microbatch's activations that a pending W still holds (the inputs of the
# weight GEMMs, 32sbh of sb(34h + 5as) per layer). 32/34 is its largest value (fused attention
# stores no a*s^2 scores); peak memory never decreases as this fraction grows, so the default
# gives an upper bound. Pass the fraction of your model (``ModelShape.w_mem_fraction``) to be exact.
DEFAULT_W_MEM_FRACTION = 32.0 / 34.0


@dataclass(frozen=True)
class Action:
    """One compute action: ``kind`` of ``stage`` on ``microbatch`` (``str`` gives e.g. ``"2I5"``)."""

    stage: int
    kind: str
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in ACTION_KINDS:
            raise ValueError(f"action kind must be one of {ACTION_KINDS}, got {self.kind!r}")
        if self.stage < 0 or self.microbatch < 0:
            raise ValueError(f"stage and microbatch must be >= 0, got {self.stage}, {self.microbatch}")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of ``str``: ``Action.parse("3W1") == Action(3, "W", 1)``."""
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ValueError(
                f"cannot parse action {text!r}: expected '{{stage}}{{F|I|W|B}}{{microbatch}}', e.g. '2F0'"
            )
        return cls(int(match.group(1)), match.group(2), int(match.group(3)))


@dataclass(frozen=True)
class StageCosts:
    """Time of one pass over a *full* stage (all layers of one rank); a chunk of a v-chunk schedule
    costs 1/v of it. ``b`` is the input backward (I), ``w`` the weight backward; a fused backward
    costs ``b + w``. ``comm`` is the latency of one cross-rank send (same time unit)."""

    f: float = 1.0
    b: float = 1.0
    w: float = 1.0
    comm: float = 0.0

    def __post_init__(self) -> None:
        for name in ("f", "b", "w"):
            if not getattr(self, name) > 0:
                raise ValueError(f"StageCosts.{name} must be > 0, got {getattr(self, name)}")
        if self.comm < 0:
            raise ValueError(f"StageCosts.comm must be >= 0, got {self.comm}")


@dataclass
class Schedule:
    """Per-rank ordered compute actions plus the stage -> rank placement they assume."""

    name: str
    ranks: int
    microbatches: int
    chunks: int
    placement: list[int]
    actions: dict[int, list[Action]] = field(default_factory=dict)

    @property
    def stages(self) -> int:
        return self.ranks * self.chunks

    def stage_to_rank(self, stage: int) -> int:
        return self.placement[stage]

    def to_strings(self) -> dict[int, list[str]]:
        return {rank: [str(a) for a in acts] for rank, acts in sorted(self.actions.items())}

    def to_dict(self) -> dict:
        """JSON-ready form (the ``actions`` keys are strings, as JSON requires). As in the
        ``anytime schedule --json`` output, ``stages`` is the number of pipeline ranks p."""
        return {
            "schedule": self.name,
            "stages": self.ranks,
            "microbatches": self.microbatches,
            "chunks": self.chunks,
            "placement": list(self.placement),
            "actions": {str(r): acts for r, acts in self.to_strings().items()},
        }

    @classmethod
    def from_dict(cls, data: dict) -> Schedule:
        """Inverse of ``to_dict`` (validated), so hand-written schedules can be loaded from JSON."""
        try:
            schedule = cls(
                name=str(data["schedule"]),
                ranks=int(data["stages"]),
                microbatches=int(data["microbatches"]),
                chunks=int(data["chunks"]),
                placement=[int(r) for r in data["placement"]],
                actions={
                    int(r): [Action.parse(a) for a in acts] for r, acts in data["actions"].items()
                },
            )
        except KeyError as err:
            raise ValueError(f"schedule dict is missing key {err}") from None
        schedule.validate()
        return schedule

    def validate(self) -> None:
        """Raise ValueError unless every (stage, microbatch) gets exactly one F and either one B or
        one I and one W, on the rank the placement names, in the order F < I < W."""
        p, v, m = self.ranks, self.chunks, self.microbatches
        if p < 1 or v < 1 or m < 1:
            raise ValueError(f"ranks, chunks and microbatches must be >= 1, got {p}, {v}, {m}")
        if len(self.placement) != p * v:
            raise ValueError(f"placement has {len(self.placement)} entries, expected ranks*chunks = {p * v}")
        for rank in range(p):
            if self.placement.count(rank) != v:
                raise ValueError(f"placement gives rank {rank} {self.placement.count(rank)} stages, expected {v}")
        if sorted(self.actions) != list(range(p)):
            raise ValueError(f"actions must have exactly the ranks 0..{p - 1}, got {sorted(self.actions)}")
        seen: dict[tuple[int, str, int], int] = {}
        for rank, acts in self.actions.items():
            for pos, act in enumerate(acts):
                if act.stage >= p * v or act.microbatch >= m:
                    raise ValueError(f"rank {rank}: action {act} is out of range (stages {p * v}, microbatches {m})")
                if self.placement[act.stage] != rank:
                    raise ValueError(
                        f"rank {rank}: action {act} belongs to rank {self.placement[act.stage]} by the placement"
                    )
                key = (act.stage, act.kind, act.microbatch)
                if key in seen:
                    raise ValueError(f"rank {rank}: action {act} appears twice")
                seen[key] = pos
        for s in range(p * v):
            for j in range(m):
                f = seen.get((s, "F", j))
                i, w, b = seen.get((s, "I", j)), seen.get((s, "W", j)), seen.get((s, "B", j))
                if f is None:
                    raise ValueError(f"missing forward {s}F{j}")
                if b is not None:
                    if i is not None or w is not None:
                        raise ValueError(f"stage {s} microbatch {j} has both a fused B and a split I/W")
                    if b < f:
                        raise ValueError(f"{s}B{j} runs before its forward")
                elif i is None or w is None:
                    raise ValueError(f"stage {s} microbatch {j} needs a B or both I and W")
                elif not f < i < w:
                    raise ValueError(f"stage {s} microbatch {j} must run F < I < W on its rank")


def loop_placement(ranks: int, chunks: int) -> list[int]:
    """Rank i holds stages i, i + p, i + 2p, ... (Megatron / PyTorch interleaved order)."""
    return [s % ranks for s in range(ranks * chunks)]


def v_placement(ranks: int) -> list[int]:
    """Rank i holds stages i and 2p-1-i: the model goes down the ranks and comes back (ZB-V)."""
    return [s if s < ranks else 2 * ranks - 1 - s for s in range(2 * ranks)]


def normalize_costs(costs: StageCosts | Sequence[StageCosts] | None, stages: int) -> tuple[StageCosts, ...]:
    """One StageCosts per (virtual) stage; a single value applies to all. Values are full-stage costs."""
    if costs is None:
        return (StageCosts(),) * stages
    if isinstance(costs, StageCosts):
        return (costs,) * stages
    costs = tuple(costs)
    if len(costs) != stages or not all(isinstance(c, StageCosts) for c in costs):
        raise ValueError(f"costs must be one StageCosts or a sequence of {stages} (one per stage), got {len(costs)}")
    return costs


@dataclass(frozen=True)
class ScheduleRequest:
    """Everything a generator may use; built and checked by ``build_schedule``."""

    ranks: int
    microbatches: int
    chunks: int
    costs: tuple[StageCosts, ...]  # one per stage
    mem_limit: float | None  # activation memory per rank, in M_B units
    w_mem_fraction: float

    def pass_time(self, stage: int, kind: str) -> float:
        """Duration of one action on one chunk: full-stage cost / chunks."""
        c = self.costs[stage]
        full = {"F": c.f, "I": c.b, "W": c.w, "B": c.b + c.w}[kind]
        return full / self.chunks

    def mem_delta(self, kind: str) -> float:
        """Activation memory change of one action on one chunk, in M_B units."""
        wf = self.w_mem_fraction
        return {"F": 1.0, "I": -(1.0 - wf), "W": -wf, "B": -1.0}[kind] / self.chunks


@dataclass(frozen=True)
class Generator:
    """A schedule generator and the model chunks per rank it accepts (registered by name in
    `anytime.pipeline.SCHEDULES`)."""

    build: Callable[[ScheduleRequest], Schedule]
    default_chunks: int = 1
    allowed_chunks: Callable[[int], bool] = lambda v: v == 1
    chunks_rule: str = "chunks must be 1"


def v_shaped(build: Callable[[ScheduleRequest], Schedule]) -> Generator:
    """A generator of two chunks per rank in a V."""
    return Generator(build, 2, lambda v: v == 2, "V schedules need chunks = 2")


def build_schedule(
    name: str,
    ranks: int,
    microbatches: int,
    chunks: int | None = None,
    costs: StageCosts | Sequence[StageCosts] | None = None,
    mem_limit: float | None = None,
    *,
    w_mem_fraction: float | None = None,
) -> Schedule:
    """Generate schedule ``name`` (one of ``SCHEDULES.names()``) for ``ranks`` ranks and ``microbatches``.

    ``costs`` (full-stage times, one or one per stage) and ``mem_limit`` (activation memory per
    rank in M_B units) matter to the cost-aware generators (zb-h2, zb-auto); ``mem_limit`` below
    one microbatch is rejected. The result is validated before it is returned.
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES.names())}")
    gen = SCHEDULES.get(name)
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 2:
        raise ValueError(f"ranks must be an integer >= 2, got {ranks!r}")
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be an integer >= 1, got {microbatches!r}")
    v = gen.default_chunks if chunks is None else chunks
    if not isinstance(v, int) or not gen.allowed_chunks(v):
        raise ValueError(f"{name}: {gen.chunks_rule}, got chunks={v!r}")
    if mem_limit is not None and not mem_limit >= 1.0:
        raise ValueError(
            f"mem_limit={mem_limit} is below one microbatch's activations (1 M_B); raise it to >= 1"
        )
    wf = DEFAULT_W_MEM_FRACTION if w_mem_fraction is None else float(w_mem_fraction)
    if not 0.0 <= wf <= 1.0:
        raise ValueError(f"w_mem_fraction must be in [0, 1], got {wf}")
    request = ScheduleRequest(ranks, microbatches, v, normalize_costs(costs, ranks * v), mem_limit, wf)
    schedule = gen.build(request)
    schedule.validate()
    return schedule
