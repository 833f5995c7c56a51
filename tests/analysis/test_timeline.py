"""The step-timeline simulator against hand-computed timelines, the orderings its modes must keep,
its bookkeeping, its input checks, and the paper-scale script run end to end."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from anytime.analysis.timeline import DecodeModel, Hardware, Split, Workload, calibrate, simulate

REPO = Path(__file__).resolve().parents[2]
DECODE = DecodeModel(latency_s=0.01, peak_tokens_per_s=1000.0)


def step_s(active: int) -> float:
    return 0.01 + active / 1000.0


def constant(prompts: int = 4, traces: int = 2, length: int = 100) -> Workload:
    """Every trace `length` tokens; 2 cuts × 2 summaries of 10 tokens; 20 prompt tokens: 160 trained a trace."""
    return Workload(prompts, traces, (50, 100), 2, 10, 20, (length,))


def varying(prompts: int = 8) -> Workload:
    return Workload(prompts, 4, (100, 200), 2, 10, 20, tuple(range(5, 260, 7)))


def hardware(learner_tokens_per_s: float = 640.0, sync: float = 0.5, slots: int = 64) -> Hardware:
    return Hardware(DECODE, slots, learner_tokens_per_s, sync)


@pytest.mark.unit
def test_lockstep_colocated_is_generation_then_learning_then_sync():
    # 2 devices, each 2 prompts × 2 traces: 4 traces of 100 tokens together, then their 16 summaries in one wave
    generation, summaries = 100 * step_s(4), 10 * step_s(16)
    learn = 8 * 160 / (2 * 640.0)
    p = simulate("lockstep", constant(), hardware(), Split.colocated_on(2))
    assert p.step_s == pytest.approx(generation + summaries + learn + 0.5, abs=1e-9)
    assert p.first_step_s == pytest.approx(p.step_s, abs=1e-9)
    assert (p.generation_s, p.summaries_s, p.learner_s, p.sync_s) == pytest.approx(
        (generation, summaries, learn, 0.5), abs=1e-9)
    assert p.rollout_idle_s == pytest.approx(0, abs=1e-9) and p.learner_idle_s == pytest.approx(0, abs=1e-9)


@pytest.mark.unit
def test_lockstep_split_leaves_each_side_idle_while_the_other_works():
    p = simulate("lockstep", constant(), hardware(), Split(2, 1))
    generation = 100 * step_s(4) + 10 * step_s(16)
    learn = 8 * 160 / 640.0
    assert p.step_s == pytest.approx(generation + learn + 0.5, abs=1e-9)
    assert p.rollout_idle_s == pytest.approx(learn + 0.5, abs=1e-9)
    assert p.learner_idle_s == pytest.approx(generation, abs=1e-9)


@pytest.mark.unit
@pytest.mark.parametrize("learner_tokens_per_s", [1280.0, 320.0])   # engine-bound, learner-bound
def test_locked_one_step_stale_hides_the_shorter_side(learner_tokens_per_s):
    generation = 100 * step_s(4) + 10 * step_s(16)
    learn = 8 * 160 / (2 * learner_tokens_per_s)
    p = simulate("locked", constant(), hardware(learner_tokens_per_s), Split(2, 2), staleness=1)
    assert p.step_s == pytest.approx(max(generation, learn + 0.5), abs=1e-9)
    assert p.first_step_s == pytest.approx(generation + learn + 0.5, abs=1e-9)   # nothing to overlap at start


@pytest.mark.unit
@pytest.mark.parametrize("learner_tokens_per_s", [1280.0, 355.0, 160.0])
def test_inflight_against_locked_when_every_trace_has_the_same_length(learner_tokens_per_s):
    """With every slot busy in both (4 traces on 4 slots, 16 summaries in 4 full waves) the engines do
    the same work, G. The learner takes L + S either way; the in-flight engine also stops for S at each
    swap while it has sequences running: in-flight = max(G, L) + S, locked = max(G, L + S)."""
    generation = 100 * step_s(4) + 4 * 10 * step_s(4)
    learn, sync = 4 * 160 / learner_tokens_per_s, 0.5
    work, box = constant(prompts=2), hardware(learner_tokens_per_s, sync, slots=4)
    inflight = simulate("inflight", work, box, Split(1, 1), staleness=1)
    locked = simulate("locked", work, box, Split(1, 1), staleness=1)
    assert locked.step_s == pytest.approx(max(generation, learn + sync), abs=1e-9)
    assert inflight.step_s == pytest.approx(max(generation, learn) + sync, abs=1e-9)
    assert inflight.engine_pause_s == pytest.approx(sync if generation > learn else 0.0, abs=1e-9)


@pytest.mark.unit
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_inflight_beats_locked_on_a_long_tail_when_swaps_are_free(seed):
    box = hardware(learner_tokens_per_s=1e6, sync=0.0)
    for k in (1, 2):
        inflight = simulate("inflight", varying(), box, Split(2, 1), staleness=k, seed=seed)
        locked = simulate("locked", varying(), box, Split(2, 1), staleness=k, seed=seed)
        assert inflight.step_s < 0.95 * locked.step_s, (k, inflight.step_s, locked.step_s)


@pytest.mark.unit
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_staleness_never_slows_the_locked_mode(seed):
    for box in (hardware(160.0), hardware(2000.0)):   # learner-bound, engine-bound
        times = [simulate("lockstep", varying(), box, Split(2, 2), seed=seed).step_s]
        times += [simulate("locked", varying(), box, Split(2, 2), staleness=k, seed=seed).step_s for k in (1, 2, 3)]
        assert all(b <= a + 1e-9 for a, b in zip(times, times[1:])), times
        assert times[-1] < times[0]


@pytest.mark.unit
def test_more_rollout_devices_never_slow_generation():
    # prompt p goes to device p % R, so each device's prompts at 2R are a subset of one device's at R
    runs = [simulate("lockstep", varying(), hardware(), Split(r, 1), seed=3) for r in (1, 2, 4, 8)]
    rollout = [p.step_s - p.learner_s - p.sync_s for p in runs]
    busy = [p.generation_s + p.summaries_s for p in runs]
    assert all(b <= a + 1e-9 for a, b in zip(rollout, rollout[1:])), rollout
    assert all(b <= a + 1e-9 for a, b in zip(busy, busy[1:])), busy
    assert rollout[-1] < rollout[0]


@pytest.mark.unit
@pytest.mark.parametrize("mode,k,split", [("lockstep", 0, Split.colocated_on(2)), ("lockstep", 0, Split(2, 1)),
                                          ("locked", 2, Split(2, 1)), ("inflight", 2, Split(3, 1))])
def test_the_breakdown_adds_up_to_the_step(mode, k, split):
    p = simulate(mode, varying(), hardware(sync=0.3), split, staleness=k, seed=5)
    rollout = p.generation_s + p.summaries_s + p.engine_pause_s
    learner = p.learner_s + p.sync_s
    if split.colocated:
        rollout = learner = rollout + learner
    assert rollout + p.rollout_idle_s == pytest.approx(p.step_s, rel=1e-9)
    assert learner + p.learner_idle_s == pytest.approx(p.step_s, rel=1e-9)
    assert min(p.rollout_idle_s, p.learner_idle_s) > -1e-9
    assert len(set(round(t, 6) for t in p.step_times)) > 1   # the sampled lengths vary the steps


@pytest.mark.unit
def test_calibrate_recovers_the_decode_model():
    model = DecodeModel(latency_s=0.008, peak_tokens_per_s=12000.0)
    fitted = calibrate((256, model.step_s(256)), (16, model.step_s(16)))
    assert fitted.latency_s == pytest.approx(0.008, rel=1e-9)
    assert fitted.peak_tokens_per_s == pytest.approx(12000.0, rel=1e-9)
    with pytest.raises(ValueError, match="different batch sizes"):
        calibrate((64, 0.01), (64, 0.02))
    with pytest.raises(ValueError, match="measure again"):
        calibrate((16, 0.02), (256, 0.01))   # a larger batch faster
    with pytest.raises(ValueError, match="measure again"):
        calibrate((16, 0.001), (256, 0.1))   # more than proportional: negative latency


@pytest.mark.unit
@pytest.mark.parametrize("change,message", [
    (dict(split=Split(0, 2)), "at least one device"),
    (dict(split=Split(2, 0)), "at least one device"),
    (dict(hardware=Hardware(DecodeModel(0.01, -5.0), 64, 640.0, 0.5)), "peak tokens/s > 0"),
    (dict(hardware=Hardware(DECODE, 64, -640.0, 0.5)), "give a throughput > 0"),
    (dict(hardware=Hardware(DECODE, 64, 640.0, -1.0)), "give a time >= 0"),
    (dict(workload=Workload(4, 2, (50, 100), 2, 10, 20, ())), "give a non-empty sample"),
    (dict(workload=Workload(4, 2, (100, 50), 2, 10, 20, (80,))), "increasing thinking budgets"),
    (dict(mode="locked", staleness=-1), "give k >= 0"),
    (dict(staleness=1), "use mode 'locked'"),
    (dict(mode="locked", staleness=1, split=Split.colocated_on(2)), "use separate devices"),
    (dict(mode="async"), "use one of"),
    (dict(steps=3), "raise steps"),
])
def test_bad_inputs_say_what_to_change(change, message):
    args = dict(mode="lockstep", workload=constant(), hardware=hardware(), split=Split(2, 2), staleness=0, steps=8)
    with pytest.raises(ValueError, match=message):
        simulate(**{**args, **change})


@pytest.mark.e2e
def test_paper_scale_script_runs(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "eval" / "async_scale.py"), "--out", str(tmp_path), "--steps",
                          "8", "--shares", "0.3", "--learner-factors", "2"],
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "paper_scale.json").read_text())
    table = (tmp_path / "paper_scale.md").read_text()
    assert len(summary["results"]) == 2 and len(summary["recommended"]) == 2
    for case, predictions in summary["results"].items():
        assert len(predictions) == 1 + 4 * 4   # colocated lock-step, 4 splits × 4 modes
        assert all(p["step_s"] > 0 for p in predictions)
        assert summary["recommended"][case]["step_s"] <= 1.05 * min(p["step_s"] for p in predictions)
    for row in ("| 8 colocated |", "| 4:4 |", "| 5:3 |", "| 6:2 |", "| 7:1 |", "inflight k=2", "Not run on GPUs"):
        assert row in table
    assert "recommended" in out.stdout


@pytest.mark.unit
def test_the_documented_example_runs(capsys):
    text = (REPO / "docs" / "async.md").read_text()
    examples = [body for body in re.findall(r"```python\n(.*?)```", text, re.S) if "anytime.analysis.timeline" in body]
    assert examples, "docs/async.md lost its simulator example"
    for body in examples:
        exec(compile(body, "docs/async.md", "exec"), {})
    printed = capsys.readouterr().out
    assert all(f"{mode} k=" in printed for mode in ("lockstep", "locked", "inflight"))
