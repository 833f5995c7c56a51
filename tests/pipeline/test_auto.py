"""zb-auto, the automatic zero-bubble heuristic: memory limits and comparisons with ZB-H1/ZB-H2."""

from __future__ import annotations

import itertools

import pytest

from anytime.analysis.schedule_sim import simulate
from anytime.pipeline.schedule import StageCosts, build_schedule

EPS = 1e-9


def _grid(ps: tuple[int, ...]) -> list[tuple[int, int, StageCosts]]:
    costs = [StageCosts(1.0, b, w, c) for b, w, c in itertools.product((0.5, 1.0, 1.5, 2.0), (0.5, 1.0, 1.5), (0.0, 0.2))]
    return [(p, m, c) for p in ps for m in (p, 2 * p, 3 * p + 1) for c in costs]


def _check_against_handcrafted(p: int, m: int, costs: StageCosts) -> None:
    h1 = simulate(build_schedule("zb-h1", p, m, costs=costs), costs)
    h2 = simulate(build_schedule("zb-h2", p, m, costs=costs), costs)
    a1 = simulate(build_schedule("zb-auto", p, m, costs=costs, mem_limit=p), costs)
    a2 = simulate(build_schedule("zb-auto", p, m, costs=costs, mem_limit=2 * p), costs)
    assert max(a1.peak_memory) <= p + EPS and max(a2.peak_memory) <= 2 * p + EPS
    assert a1.makespan <= h1.makespan + EPS, (p, m, costs)  # 1F1B memory: never worse than ZB-H1
    assert a2.makespan <= h2.makespan + EPS, (p, m, costs)  # twice that: reaches ZB-H2


@pytest.mark.unit
def test_equal_costs_match_the_handcrafted_bubbles() -> None:
    for p in (2, 4, 8):
        for m in (2 * p, 3 * p + 1):
            a1 = simulate(build_schedule("zb-auto", p, m))  # default limit: p M_B
            assert max(a1.idle) == pytest.approx(p - 1) and max(a1.peak_memory) <= p + EPS
            a2 = simulate(build_schedule("zb-auto", p, m, mem_limit=2 * p))
            assert a2.span_idle == [pytest.approx(0.0)] * p  # the ZB-H2 parallelogram


@pytest.mark.unit
def test_memory_limit_is_respected() -> None:
    p, m, costs = 4, 10, StageCosts(1.0, 1.3, 0.7, 0.1)
    spans = []
    for limit in (1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0):
        r = simulate(build_schedule("zb-auto", p, m, costs=costs, mem_limit=limit), costs)
        assert max(r.peak_memory) <= limit + EPS
        spans.append(r.makespan)
    assert spans[-1] < spans[0]  # more memory buys a shorter iteration
    assert spans == sorted(spans, reverse=True)


@pytest.mark.unit
def test_per_stage_costs_are_used() -> None:
    costs = [StageCosts(1, 1, 1), StageCosts(1, 1, 1), StageCosts(1.5, 1.5, 1.5), StageCosts(1, 1, 1)]
    auto = simulate(build_schedule("zb-auto", 4, 8, costs=costs), costs)
    h1 = simulate(build_schedule("zb-h1", 4, 8), costs)
    assert auto.makespan <= h1.makespan + EPS


@pytest.mark.unit
@pytest.mark.parametrize("costs", [StageCosts(1, 1.5, 0.5), StageCosts(1, 0.5, 1.5, 0.2), StageCosts(1, 2, 1, 0.2)])
def test_zb_auto_vs_handcrafted_fast(costs: StageCosts) -> None:
    for p, m in ((2, 5), (4, 8), (4, 13)):
        _check_against_handcrafted(p, m, costs)


@pytest.mark.integration
@pytest.mark.parametrize("p", [2, 4, 8])
def test_zb_auto_vs_handcrafted_grid(p: int) -> None:
    for p_, m, costs in _grid((p,)):
        _check_against_handcrafted(p_, m, costs)
