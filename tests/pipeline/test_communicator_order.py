"""First contact between pipeline ranks, checked against NCCL's rule for point-to-point communicators.

NCCL creates a communicator per (process group, rank pair) at the first send or receive over it, and
creating it blocks until the peer creates the same one. Ranks that first meet in different
communicators wait for each other forever; gloo has no such rule, so a gloo run alone never shows
it. Here the real executor runs every schedule on 2 and 4 gloo ranks, with its two groups per
pipeline as under NCCL, and every send and receive it makes is recorded as (group, operation,
peer). `waits_forever` then replays each rank's first touches under NCCL's rule. Without the
executor's warm-up, ZB-H1 on 2 ranks is caught in a crossed order; with it, no schedule waits.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from anytime.pipeline import SCHEDULES
from anytime.pipeline.runtime import _MessagePlan, forward_only_actions, p2p_links
from anytime.pipeline.schedule import Schedule, build_schedule

MICROBATCHES = 4
Communicator = tuple[str, tuple[int, int]]   # (group, (low rank, high rank))


def first_touches(calls: list[list]) -> list[Communicator]:
    """The communicators one rank's recorded (group, op, me, peer) calls touch, in first-touch order."""
    seen: list[Communicator] = []
    for group, _, me, peer in calls:
        comm = (group, (min(me, peer), max(me, peer)))
        if comm not in seen:
            seen.append(comm)
    return seen


def waits_forever(order: dict[int, list[Communicator]]) -> dict[int, Communicator]:
    """Replay NCCL's lazy creation: each rank creates its communicators in `order`, and a creation
    completes once both ranks of the pair are at it. Returns where each stuck rank waits ({} when
    every creation completes). Two ranks that first touch C1 then C2 and C2 then C1 stay stuck, as
    does any longer cycle."""
    at = dict.fromkeys(order, 0)
    progressed = True
    while progressed:
        progressed = False
        for rank, comms in order.items():
            if at[rank] == len(comms):
                continue
            comm = comms[at[rank]]
            peers = [r for r in comm[1] if r != rank]
            if all(at[p] < len(order[p]) and order[p][at[p]] == comm for p in peers):
                for r in (rank, *peers):
                    at[r] += 1
                progressed = True
    return {rank: comms[at[rank]] for rank, comms in order.items() if at[rank] < len(comms)}


# -- the executor's calls, recorded on gloo ranks ---------------------------------------------------

class _Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def _record_calls(log: list, label) -> dict:
    """Wrap torch.distributed's point-to-point calls to append (group, op, me, peer) to `log` first."""
    originals = {name: getattr(dist, name) for name in ("isend", "irecv", "send", "recv")}

    def wrap(name):
        def call(tensor, peer, group=None, tag=0):
            log.append((label(group), name.lstrip("i"), dist.get_rank(), peer))
            return originals[name](tensor, peer, group=group, tag=tag)
        return call

    for name in originals:
        setattr(dist, name, wrap(name))
    return originals


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    from anytime.pipeline.runtime import PipelineExecutor, p2p_groups

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    group, reverse = p2p_groups()   # two groups per pipeline, as the executor gets under NCCL
    log: list = []
    originals = _record_calls(log, lambda g: "reverse" if g is reverse else "forward")
    results = {}
    try:
        for name in SCHEDULES.names():
            schedule = build_schedule(name, world, MICROBATCHES)
            last = schedule.stages - 1
            torch.manual_seed(0)
            stages = {s: _Stage() for s, r in enumerate(schedule.placement) if r == rank}
            log.clear()
            executor = PipelineExecutor(stages, schedule, group=group, reverse_group=reverse,
                                        tied=[((0, "proj.weight"), (last, "proj.weight"))])
            warm_up = list(log)
            log.clear()
            executor.train_step(lambda mb: torch.ones(2, 4), lambda out, mb: out.sum(), ((2, 4), torch.float32))
            executor.forward(lambda mb: torch.ones(2, 4), lambda out, mb: None, ((2, 4), torch.float32))
            results[name] = {"warm_up": warm_up, "step": list(log)}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    finally:
        for name, call in originals.items():
            setattr(dist, name, call)
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """world size -> schedule -> rank -> {"warm_up": calls, "step": calls}, one spawn per world size."""
    out = {}
    for world in (2, 4):
        folder = tmp_path_factory.mktemp(f"world{world}")
        mp.spawn(_worker, args=(world, str(folder / "store"), str(folder)), nprocs=world)
        ranks = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world)]
        out[world] = {name: {r: ranks[r][name] for r in range(world)} for name in SCHEDULES.names()}
    return out


@pytest.mark.integration
@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("warm_up", [False, True], ids=["without-warm-up", "with-warm-up"])
def test_zb_h1_on_2_ranks_first_meets_in_crossed_communicators_unless_warmed_up(recorded, warm_up):
    """ZB-H1's stage 0 first posts a gradient receive (reverse group), stage 1 an activation receive
    (forward group): under NCCL each would wait in a communicator the other never creates."""
    calls = recorded[2]["zb-h1"]
    order = {r: first_touches((c["warm_up"] if warm_up else []) + c["step"]) for r, c in calls.items()}
    if warm_up:
        assert waits_forever(order) == {}
    else:
        assert waits_forever(order) == {0: ("reverse", (0, 1)), 1: ("forward", (0, 1))}


@pytest.mark.integration
@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_every_schedule_creates_its_communicators_in_one_order(recorded, world):
    """Every schedule, a training step and a forward-only pass, tied weights exchanged: no rank
    waits forever, the warm-up alone touches every communicator the step uses, and the warm-up
    calls are one message per link."""
    for name, calls in recorded[world].items():
        order = {r: first_touches(c["warm_up"] + c["step"]) for r, c in calls.items()}
        assert waits_forever(order) == {}, f"{name} on {world} ranks"
        for rank, c in calls.items():
            assert set(first_touches(c["step"])) <= set(first_touches(c["warm_up"])), f"{name}, rank {rank}"
        sent = sorted((me, peer) for c in calls.values() for _, op, me, peer in c["warm_up"] if op == "send")
        schedule = build_schedule(name, world, MICROBATCHES)
        assert sent == sorted(p2p_links(schedule, [((0, "w"), (schedule.stages - 1, "w"))])), name


# -- the warm-up as a pure function of the schedule ---------------------------------------------------

def _used_links(name: str, ranks: int, tied: list) -> set[tuple[int, int]]:
    """(sender, receiver) of every message the executor's plans and tied exchange send."""
    schedule = build_schedule(name, ranks, 8)
    used = set()
    for actions in (schedule.actions, forward_only_actions(schedule)):
        for me in range(ranks):
            used |= {(src, me) for src in _MessagePlan(actions, schedule.placement, me).from_rank}
    for (a, _), (b, _) in tied:
        ra, rb = schedule.placement[a], schedule.placement[b]
        used |= {(ra, rb), (rb, ra)} - {(ra, ra)}
    return used


@pytest.mark.unit
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("name", SCHEDULES.names())
def test_warm_up_links_are_every_link_the_executor_uses_in_a_deadlock_free_order(name, ranks):
    schedule = build_schedule(name, ranks, 8)
    tied = [((0, "w"), (schedule.stages - 1, "w"))]
    links = p2p_links(schedule, tied)
    assert set(links) == _used_links(name, ranks, tied)
    assert len(links) == len(set(links))
    # Each rank walks the one list, keeping its own links; as NCCL communicators they never wait.
    calls = [("forward" if dst > src else "reverse", "send", src, dst) for src, dst in links]
    order = {me: first_touches([call for call in calls if me in call[2:]]) for me in range(ranks)}
    assert waits_forever(order) == {}


@pytest.mark.unit
def test_no_link_without_a_stage_boundary_between_ranks():
    one_rank = Schedule("one-rank", ranks=1, microbatches=1, chunks=2, placement=[0, 0])
    assert p2p_links(one_rank, [((0, "w"), (1, "w"))]) == []


@pytest.mark.unit
def test_replay_finds_crossed_and_cyclic_first_contacts():
    a, b, c = ("g", (0, 1)), ("g", (1, 2)), ("g", (0, 2))
    assert waits_forever({0: [a, ("h", (0, 1))], 1: [("h", (0, 1)), a]}) == {0: a, 1: ("h", (0, 1))}
    assert waits_forever({0: [a, c], 1: [b, a], 2: [c, b]}) == {0: a, 1: b, 2: c}
    assert waits_forever({0: [a, c], 1: [a, b], 2: [c, b]}) == {}
