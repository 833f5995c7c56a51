"""In-flight training end to end on a worker process of its own (a Ray actor, or a local process):
weights offered while the worker generates are taken mid-rollout, no token is older than k steps,
and the swaps themselves change nothing but the weights: with updates too small to move a float32
weight, every version equals the first and the run samples and trains exactly as lock-step does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import QUICKSTART, read_metrics, tiny_overrides

pytestmark = pytest.mark.e2e

INFLIGHT = ["rollout.staleness_mode=inflight", "rollout.max_staleness=2"]


def train(out: Path, ray_address: str | None, *extra: str) -> dict[int, dict]:
    cmd = [sys.executable, "-m", "anytime.cli", "train", QUICKSTART, *tiny_overrides(out, steps=5),
           "rollout.prompts_per_step=4", "learner.deterministic=false", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                          env={**os.environ, **({"RAY_ADDRESS": ray_address} if ray_address else {})})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = read_metrics(out)
    timings = [line for line in (out / "metrics.jsonl").read_text().splitlines() if "time/weight_swap" in line]
    return metrics | {"timed_swaps": len(timings)}


STILL = "learner.lr=1e-30"   # an update below float32 resolution: every version holds the same weights


@pytest.fixture(scope="module")
def still_lock_step(tmp_path_factory) -> dict[int, dict]:
    """The lock-step run both placements are held against (one run for the module)."""
    lock_step = train(tmp_path_factory.mktemp("lock") / "run", None, STILL, "rollout.placement=inprocess")
    lock_step.pop("timed_swaps")
    return lock_step


@pytest.mark.parametrize("placement", ["processes", pytest.param("ray", marks=pytest.mark.ray)])
def test_inflight_swaps_change_nothing_but_the_weights(tmp_path, placement, request, still_lock_step):
    from tests.rollout.test_local import assert_same_run

    address = request.getfixturevalue("ray_address") if placement == "ray" else None
    inflight = train(tmp_path / "inflight" / "run", address, STILL, *INFLIGHT, f"rollout.placement={placement}")
    assert inflight.pop("timed_swaps") == 5
    assert_same_run(still_lock_step, inflight)
    # the versions did arrive: step 5's batch (0-based 4) cannot start before version 2 is in hand (how
    # many of the four versions the worker took depends on timing: a newer offer replaces one not taken)
    assert sum(m["rollout/weight_swaps"] for m in inflight.values()) >= 1
    for step, m in inflight.items():
        assert 0 <= m["rollout/token_version_lag"] <= m["rollout/token_version_lag_max"] <= 2, step
        assert 0 <= m["rollout/mixed_version_traces"] <= 1


@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_inflight_tokens_are_never_older_than_k_steps_and_checkpoints_lose_no_batch(tmp_path, engine):
    """No token is older than k = 2 steps, and the off-policy correction sees the gap. In flight, a
    checkpoint holds the batches still in flight, as in locked mode: a run that dies after step 2 and
    resumes from its checkpoint trains the very batches (tokens, versions, behaviour log-probs) of
    steps 3 and 4 that the unbroken run trained, so those steps equal it. On either engine (vLLM's
    versions come from its own per-token spans). On vLLM the resumed run drives the engine through
    `AsyncLLM` (`rollout.vllm_frontend: async`) and the unbroken one steps vLLM's `LLM`: the pending
    batches come from the checkpoint, and the frontends sample alike."""
    import json
    import shutil

    from anytime.learner.checkpoint import load_in_flight

    if engine == "vllm":
        pytest.importorskip("vllm")
    full, part = tmp_path / "full" / "run", tmp_path / "part" / "run"
    extra = ["learner.lr=1e-2", "algorithm.offpolicy_correction=tis", *INFLIGHT, "rollout.placement=processes",
             "trainer.keep_last=5", f"rollout.engine={engine}"]
    unbroken = train(full, None, *extra)
    unbroken.pop("timed_swaps")
    for step, m in unbroken.items():
        assert m["rollout/token_version_lag_max"] <= 2, step
        assert m["offpolicy/is_weight_max"] > 0 and 0 < m["offpolicy/is_ess"] <= 1
    # step 1: nothing but the start weights existed, so engine and learner agree but for the numerics
    assert unbroken[1]["rollout/token_version_lag_max"] == 0
    assert unbroken[1]["offpolicy/is_weight_max"] == pytest.approx(1.0, abs=1e-3)
    # later steps train on tokens of earlier versions (lr 1e-2 moves the tiny model far): the gap shows
    assert max(m["train/logprob_mismatch"] for m in unbroken.values()) > 1e-3
    step_2 = full / "checkpoints" / "step_2"
    assert [s["step"] for s in load_in_flight(step_2, 0)] == [2, 3]
    shutil.copytree(step_2, part / "checkpoints" / "step_2")
    shutil.copytree(full.parent / "init", part.parent / "init")
    resumed = train(part, None, *extra, *(["rollout.vllm_frontend=async"] if engine == "vllm" else []))
    resumed.pop("timed_swaps")
    for t in (3, 4):
        assert resumed[t] == unbroken[t], t
    assert json.loads((part / "final_eval.json").read_text())["before"] == \
        json.loads((full / "final_eval.json").read_text())["before"]
