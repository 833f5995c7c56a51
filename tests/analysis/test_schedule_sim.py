"""The pipeline-schedule simulator and its plots: timing rules, comm latency, memory in bytes, deadlocks, exports."""

from __future__ import annotations

import json

import pytest

from anytime.analysis.schedule_plot import plot_timeline, text_timeline
from anytime.analysis.schedule_sim import DeadlockError, ModelShape, simulate
from anytime.pipeline.schedule import Action, Schedule, StageCosts, build_schedule

pytestmark = pytest.mark.unit


def test_two_rank_1f1b_timeline_by_hand() -> None:
    r = simulate(build_schedule("1f1b", 2, 2))
    assert text_timeline(r) == "rank  0 |FF..BB.BB|\nrank  1 |.FBBFBB..|"
    assert r.makespan == 9 and r.busy == [6, 6] and r.idle == [3, 3] and r.span_idle == [3, 0]
    assert [(str(t.action), t.start, t.end) for t in r.rank_timeline(1)] == [
        ("1F0", 1, 2), ("1B0", 2, 4), ("1F1", 4, 5), ("1B1", 5, 7)
    ]


def test_comm_latency_applies_only_across_ranks() -> None:
    c = 0.25
    loop = simulate(build_schedule("1f1b", 2, 1), StageCosts(comm=c))
    assert loop.makespan == pytest.approx(6 + 2 * c)
    # ZB-V, p=2, m=1, half-cost chunks. Critical path: 0F0 | 1F0 2F0 | 3F0 3I0 | 2I0 2W0 1I0 | 0I0 0W0
    # (rank 1 runs 2W0 before 1I0): ten passes of 0.5, four cross-rank hops; the turn is local.
    v = simulate(build_schedule("zb-v", 2, 1), StageCosts(comm=c))
    assert v.makespan == pytest.approx(5.0 + 4 * c)
    assert v.p2p_messages == 4


def test_per_stage_costs() -> None:
    costs = [StageCosts(1, 1, 1), StageCosts(2, 2, 2)]
    r = simulate(build_schedule("1f1b", 2, 1), costs)
    assert r.makespan == pytest.approx(1 + 2 + 4 + 2)
    assert r.busy == [pytest.approx(3), pytest.approx(6)]
    with pytest.raises(ValueError, match="one per stage"):
        simulate(build_schedule("1f1b", 2, 1), [StageCosts()] * 3)


def test_chunk_costs_are_fractions_of_the_stage() -> None:
    # one microbatch through 2 ranks x 2 chunks: every pass costs half a stage
    r = simulate(build_schedule("interleaved-1f1b", 2, 1, chunks=2), StageCosts(f=2, b=2, w=2))
    assert all(t.end - t.start == pytest.approx(1 if t.action.kind == "F" else 2) for t in r.timeline)
    assert r.makespan == pytest.approx(4 * 1 + 4 * 2)


def test_deadlock_is_reported() -> None:
    actions = {
        0: [Action(0, "F", 0), Action(0, "B", 0), Action(0, "F", 1), Action(0, "B", 1)],
        1: [Action(1, "F", 1), Action(1, "F", 0), Action(1, "B", 0), Action(1, "B", 1)],
    }
    sched = Schedule("bad", 2, 2, 1, [0, 1], actions)
    sched.validate()  # well-formed, yet rank 1 waits for 0F1, which waits for 1B0
    with pytest.raises(DeadlockError, match="deadlocks"):
        simulate(sched)


def test_memory_in_bytes_from_model_shape() -> None:
    model = ModelShape(hidden=1024, heads=16, seq_len=2048, micro_batch=1, layers=24)
    per_layer = 2048 * (34 * 1024 + 5 * 16 * 2048)
    assert model.layer_activation_bytes() == per_layer
    assert model.w_mem_fraction == pytest.approx(32 * 1024 / (34 * 1024 + 5 * 16 * 2048))
    r = simulate(build_schedule("1f1b", 4, 8), model=model)
    assert r.w_mem_fraction == pytest.approx(model.w_mem_fraction)
    assert r.peak_memory_bytes == [pytest.approx((4 - i) * per_layer * 6) for i in range(4)]
    assert r.p2p_bytes == r.p2p_messages * 2048 * 1024 * 2
    flash = ModelShape(1024, 16, 2048, 1, 24, flash_attention=True)
    assert flash.w_mem_fraction == pytest.approx(32 / 34)
    with pytest.raises(ValueError, match="hidden"):
        ModelShape(0, 1, 1, 1, 1)


def test_w_fraction_changes_only_split_schedules() -> None:
    lo = simulate(build_schedule("zb-h1", 4, 8), w_mem_fraction=0.0)
    hi = simulate(build_schedule("zb-h1", 4, 8), w_mem_fraction=1.0)
    assert lo.peak_memory == [4, 3, 2, 1] and hi.peak_memory == [4, 4, 4, 4]
    assert simulate(build_schedule("1f1b", 4, 8), w_mem_fraction=1.0).peak_memory == [4, 3, 2, 1]
    with pytest.raises(ValueError, match="w_mem_fraction"):
        simulate(build_schedule("1f1b", 4, 8), w_mem_fraction=-0.1)


def test_chrome_trace(tmp_path) -> None:
    r = simulate(build_schedule("zb-h1", 2, 3))
    path = r.write_chrome_trace(tmp_path / "t" / "trace.json", us_per_unit=10)
    data = json.loads(path.read_text())
    events = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(events) == len(r.timeline) == 2 * 3 * 3
    first = min(events, key=lambda e: (e["tid"], e["ts"]))
    assert first["name"] == "0F0" and first["ts"] == 0 and first["dur"] == 10 and first["cat"] == "F"
    names = {e["args"]["name"] for e in data["traceEvents"] if e["ph"] == "M"}
    assert names == {"rank 0", "rank 1"}


def test_png_timeline(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    out = plot_timeline(simulate(build_schedule("zb-v", 4, 8)), tmp_path / "zbv.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_to_dict_has_the_cli_keys() -> None:
    d = simulate(build_schedule("v-half", 4, 8)).to_dict()
    for key in ("schedule", "stages", "microbatches", "chunks", "placement", "makespan", "bubble_rate",
                "peak_memory", "actions"):
        assert key in d
    assert d["stages"] == 4 and d["chunks"] == 2 and len(d["placement"]) == 8
    assert d["actions"]["0"][0] == "0F0"
