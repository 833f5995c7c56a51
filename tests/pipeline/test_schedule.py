"""Schedule IR, generators and golden bubble/memory figures (unit costs unless stated)."""

from __future__ import annotations

import pytest

from anytime.analysis.schedule_sim import simulate
from anytime.pipeline import SCHEDULES
from anytime.pipeline.schedule import (
    DEFAULT_W_MEM_FRACTION,
    Action,
    Schedule,
    StageCosts,
    build_schedule,
    loop_placement,
    v_placement,
)

pytestmark = pytest.mark.unit

PS = (2, 4, 8)
# The ZB-H1 closed form assumes a W fits where it is put: T_W <= min(T_F, T_B) (the paper's setting).
UNEQUAL = [StageCosts(1.0, 1.2, 0.8), StageCosts(1.0, 1.5, 0.5), StageCosts(1.3, 1.0, 0.8), StageCosts(0.7, 2.0, 0.5)]


def ms(p: int) -> list[int]:
    return [p, 2 * p, 3 * p + 1]


def approx(x: float) -> object:
    return pytest.approx(x, abs=1e-9)


# --- IR ---------------------------------------------------------------------------------------


def test_action_str_and_parse_round_trip() -> None:
    a = Action(12, "I", 7)
    assert str(a) == "12I7"
    assert Action.parse("12I7") == a
    assert Action.parse(" 0B3 ") == Action(0, "B", 3)
    for bad in ("3X1", "F1", "1F", "1SEND_F2", "-1F0"):
        with pytest.raises(ValueError, match="cannot parse action"):
            Action.parse(bad)
    with pytest.raises(ValueError, match="kind"):
        Action(0, "Q", 0)


def test_placements() -> None:
    assert loop_placement(3, 2) == [0, 1, 2, 0, 1, 2]
    assert v_placement(3) == [0, 1, 2, 2, 1, 0]


@pytest.mark.parametrize("name", SCHEDULES.names())
def test_every_schedule_is_complete_and_ordered(name: str) -> None:
    for p in PS:
        for m in ms(p):
            m = 3 * p if name == "interleaved-1f1b" and m == 3 * p + 1 else m
            s = build_schedule(name, p, m)
            assert s.name == name and s.ranks == p and s.microbatches == m
            assert s.stages == p * s.chunks == len(s.placement)
            seen: dict[tuple[int, int], list[str]] = {}
            for rank, acts in s.actions.items():
                for a in acts:
                    assert s.placement[a.stage] == rank
                    seen.setdefault((a.stage, a.microbatch), []).append(a.kind)
            assert len(seen) == s.stages * m
            assert all(k in (["F", "B"], ["F", "I", "W"]) for k in seen.values()), name


def test_default_chunks() -> None:
    assert build_schedule("1f1b", 4, 4).chunks == 1
    assert build_schedule("interleaved-1f1b", 4, 8).chunks == 2
    assert build_schedule("interleaved-1f1b", 4, 8, chunks=3).chunks == 3
    for name in ("zb-v", "v-half", "v-min"):
        s = build_schedule(name, 4, 8)
        assert s.chunks == 2 and s.placement == v_placement(4)


def test_validate_rejects_broken_schedules() -> None:
    good = build_schedule("zb-h1", 2, 2)
    acts = {r: list(a) for r, a in good.actions.items()}
    acts[0] = [a for a in acts[0] if str(a) != "0W1"]
    with pytest.raises(ValueError, match="needs a B or both I and W"):
        Schedule("x", 2, 2, 1, [0, 1], acts).validate()
    swapped = {r: list(a) for r, a in good.actions.items()}
    i0 = swapped[1].index(Action(1, "I", 0))
    swapped[1][i0], swapped[1][0] = swapped[1][0], swapped[1][i0]
    with pytest.raises(ValueError, match="F < I < W"):
        Schedule("x", 2, 2, 1, [0, 1], swapped).validate()
    with pytest.raises(ValueError, match="belongs to rank"):
        Schedule("x", 2, 2, 1, [1, 0], good.actions).validate()


def test_dict_round_trip() -> None:
    s = build_schedule("zb-v", 4, 9)
    back = Schedule.from_dict(s.to_dict())
    assert back.actions == s.actions and back.placement == s.placement and back.chunks == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(name="nope", ranks=4, microbatches=4), "unknown schedule"),
        (dict(name="1f1b", ranks=1, microbatches=4), "ranks must be"),
        (dict(name="1f1b", ranks=4, microbatches=0), "microbatches must be"),
        (dict(name="1f1b", ranks=4, microbatches=4, chunks=2), "chunks must be 1"),
        (dict(name="interleaved-1f1b", ranks=4, microbatches=8, chunks=1), "chunks must be >= 2"),
        (dict(name="zb-v", ranks=4, microbatches=8, chunks=3), "chunks = 2"),
        (dict(name="interleaved-1f1b", ranks=4, microbatches=13), "divisible by"),
        (dict(name="zb-auto", ranks=4, microbatches=8, mem_limit=0.5), "below one microbatch"),
        (dict(name="zb-h2", ranks=4, microbatches=8, mem_limit=0.99), "below one microbatch"),
        (dict(name="zb-h1", ranks=4, microbatches=8, w_mem_fraction=1.5), "w_mem_fraction"),
    ],
)
def test_invalid_requests_raise_clear_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_schedule(**kwargs)


def test_stage_costs_reject_nonpositive() -> None:
    with pytest.raises(ValueError, match="StageCosts.f"):
        StageCosts(f=0)
    with pytest.raises(ValueError, match="comm"):
        StageCosts(comm=-1)


# --- golden figures ---------------------------------------------------------------------------


@pytest.mark.parametrize("p", PS)
def test_1f1b_golden(p: int) -> None:
    for m in ms(p):
        r = simulate(build_schedule("1f1b", p, m))
        assert r.idle == [approx(3 * (p - 1))] * p
        assert r.makespan == approx(3 * (m + p - 1))
        assert r.bubble_rate == approx((p - 1) / (m + p - 1))
        assert r.peak_memory == [approx(p - i) for i in range(p)]


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("costs", [StageCosts(), *UNEQUAL])
def test_zb_h1_golden(p: int, costs: StageCosts) -> None:
    for m in ms(p):
        r = simulate(build_schedule("zb-h1", p, m), costs)
        bubble = (p - 1) * (costs.f + costs.b - costs.w)
        assert max(r.idle) == approx(bubble)
        assert max(r.peak_memory) <= p + 1e-9
        assert r.peak_memory[0] == approx(p)  # same as 1F1B


def test_zb_h1_memory_matches_closed_form() -> None:
    # rank i holds (p-i) activations plus i pending W's (M_W each) when m is large enough
    p, wf = 4, 0.3
    r = simulate(build_schedule("zb-h1", p, 12), w_mem_fraction=wf)
    assert r.peak_memory == [approx(p - i + i * wf) for i in range(p)]


@pytest.mark.parametrize("p", PS)
def test_zb_h2_golden(p: int) -> None:
    for m in ms(p):
        r = simulate(build_schedule("zb-h2", p, m))
        assert max(r.peak_memory) <= 2 * p - 1 + 1e-9
        for rank in range(p):
            tl = r.rank_timeline(rank)
            first_i = min(t.start for t in tl if t.action.kind == "I")
            last_f = max(t.end for t in tl if t.action.kind == "F")
            assert r.idle_between(rank, first_i, last_f) == approx(0.0)
        if m >= 2 * p - 1:  # enough microbatches to fill the warm-up: a parallelogram
            assert r.span_idle == [approx(0.0)] * p
            assert max(r.peak_memory) == approx(2 * p - 1)
        assert max(r.idle) <= (p - 1) + 1e-9  # never worse than ZB-H1


@pytest.mark.parametrize("p", PS)
def test_zb_v_golden(p: int) -> None:
    for m in (2 * p, 3 * p + 1):
        r = simulate(build_schedule("zb-v", p, m))
        assert r.peak_memory == [approx(p)] * p
        assert r.span_idle == [approx(0.0)] * p
        assert max(r.idle) == approx((p - 1) / 2)  # only the staggered start, T_F/2 per hop


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("wf", [0.0, 0.5, DEFAULT_W_MEM_FRACTION, 1.0])
def test_v_half_and_v_min_memory(p: int, wf: float) -> None:
    for m in ms(p):
        half = simulate(build_schedule("v-half", p, m), w_mem_fraction=wf)
        assert max(half.peak_memory) <= (p + 2) // 2 + 1e-9
        if m >= 2 * p:
            assert max(half.peak_memory) == approx((p + 2) // 2)
        vmin = simulate(build_schedule("v-min", p, m), w_mem_fraction=wf)
        assert max(vmin.peak_memory) <= (p + 4) // 3 + 1e-9


@pytest.mark.parametrize("name", ["v-half", "v-min"])
@pytest.mark.parametrize("p", PS)
def test_v_shapes_have_a_bubble_free_steady_phase(name: str, p: int) -> None:
    # idle does not grow with m, and stays below 1F1B's
    idles = {m: max(simulate(build_schedule(name, p, m)).idle) for m in (2 * p, 3 * p + 1, 5 * p)}
    assert len({round(x, 9) for x in idles.values()}) == 1
    assert idles[2 * p] < 3 * (p - 1)


@pytest.mark.parametrize("p", PS)
def test_interleaved_golden(p: int) -> None:
    for v in (2, 4):
        r = simulate(build_schedule("interleaved-1f1b", p, 2 * p, chunks=v))
        assert max(r.idle) == approx(3 * (p - 1) / v)
        assert r.peak_memory[0] == approx(p + (p - 1) / v)
        assert r.p2p_messages == 2 * (p * v - 1) * 2 * p  # every stage boundary crosses ranks


def test_p2p_volume_counts_cross_rank_edges() -> None:
    p, m = 4, 8
    assert simulate(build_schedule("1f1b", p, m)).p2p_messages == 2 * (p - 1) * m
    # V placement: 2p stages, the turn at rank p-1 is local
    assert simulate(build_schedule("zb-v", p, m)).p2p_messages == 2 * (2 * p - 2) * m
