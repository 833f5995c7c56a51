"""Locked staleness (`rollout.max_staleness: k`): batch t is generated with the weights of step
max(0, t − k). A k = 1 run equals a lock-step loop built here whose batches come one step late; a
run resumed with batches in flight equals an unbroken one; Ray workers (1 or 2, in the background)
sample exactly what the in-process worker samples; a worker killed with a rollout in flight fails
the step by name, or with `rollout.worker_restarts` is replaced and regenerates exactly what it lost,
and leaves no process behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

from anytime.config import load_recipe
from anytime.trainer.launch import launch_train
from anytime.trainer.experience import experience
from tests.helpers import QUICKSTART, kill_and_clean, placed, read_metrics, snapshot, still_running_after, tiny_overrides

LOCKED = ["rollout.max_staleness=1"]


@pytest.mark.unit
@pytest.mark.parametrize("extra", [[], ["learner.num_processes=2"], ["learner.pipeline.stages=2"],
                                   ["learner.pipeline.stages=2", "learner.num_processes=4"],
                                   ["rollout.staleness_mode=inflight", "rollout.max_staleness=1"]])
def test_the_check_and_the_run_resolve_auto_placement_alike(extra):
    """One rule for `rollout.placement: auto`: the run resolves it from its learner world (a pipeline's
    stages are processes too) to what the recipe checks saw."""
    from anytime.config.placement_plan import resolve_placement

    recipe = load_recipe(QUICKSTART, extra)
    world = recipe.learner.processes
    want = "processes" if "rollout.staleness_mode=inflight" in extra else "inprocess" if world == 1 else "colocated"
    assert resolve_placement(recipe) == resolve_placement(recipe, world) == want


def delayed_lock_step(out: Path, steps: int) -> dict[int, dict]:
    """The reference: the lock-step pieces driven by hand, batch t rolled out before update t − 1 is
    taken (with the weights of step t − 1), everything else as the trainer does it."""
    from anytime.learner.ppo import ppo_update
    from anytime.trainer.launch import prepare_model
    from anytime.trainer.metrics import step_metrics
    from anytime.trainer.trainer import Trainer, step_row_indices

    recipe = load_recipe(QUICKSTART, tiny_overrides(out, steps=steps))
    trainer = Trainer(recipe, prepare_model(recipe))
    try:
        def rollout(t: int):
            idx = step_row_indices(t, recipe.rollout.prompts_per_step, len(trainer.rows))
            shares = trainer.rollouts.collect(trainer.rollouts.submit([trainer.prompts[i] for i in idx],
                                                                      [trainer.rows[i].answer for i in idx], t))
            exp = experience(shares, recipe, trainer.pad_id, trainer.exchange)
            return exp.batch, step_metrics(exp.per_worker, recipe), None

        trainer.evaluate(0)   # as the trainer's eval before training (it samples on the same engine)
        metrics, pending = {}, rollout(0)
        for t in range(steps):
            batch, rollout_metrics, _ = pending
            if t + 1 < steps:
                pending = rollout(t + 1)   # the workers still hold the weights of step t
            batch.old_logprobs = trainer.learner.logprobs(batch)
            stats = ppo_update(trainer.learner, batch, recipe.algorithm, recipe.learner)
            trainer.rollouts.sync_weights(trainer.weight_snapshot(t + 1))
            metrics[t + 1] = {k: v for k, v in {**rollout_metrics, **{f"update/{k}": v for k, v in stats.items()}}.items()
                              if not k.startswith(("time/", "perf/"))}
        return metrics
    finally:
        trainer.close()


@pytest.mark.e2e
def test_locked_k1_equals_lock_step_with_batches_one_step_late(tmp_path):
    out = tmp_path / "locked" / "run"
    assert launch_train(QUICKSTART, tiny_overrides(out, steps=3) + LOCKED) == 0
    locked = read_metrics(out)
    reference = delayed_lock_step(tmp_path / "reference" / "run", steps=3)
    assert [locked[t]["rollout/token_version_lag"] for t in (1, 2, 3)] == [0, 1, 1]
    for t, ref in reference.items():
        for key, value in ref.items():
            assert locked[t][key] == value, (t, key)
    # and it is not the lock-step run: from step 2 on, the samples differ
    assert launch_train(QUICKSTART, tiny_overrides(tmp_path / "sync" / "run", steps=3)) == 0
    sync = read_metrics(tmp_path / "sync" / "run")
    assert sync[1]["update/loss"] == locked[1]["update/loss"]
    assert sync[3]["update/loss"] != locked[3]["update/loss"]


@pytest.mark.e2e
def test_resume_with_batches_in_flight_equals_an_unbroken_run(tmp_path):
    import json
    import shutil

    from anytime.learner.checkpoint import load_in_flight

    full, part = tmp_path / "full" / "run", tmp_path / "part" / "run"
    k2 = ["rollout.max_staleness=2", "trainer.keep_last=4"]
    assert launch_train(QUICKSTART, tiny_overrides(full, steps=4) + k2) == 0
    unbroken = read_metrics(full)
    assert [unbroken[t]["rollout/token_version_lag"] for t in (1, 2, 3, 4)] == [0, 1, 2, 2]
    # as if the run died after step 2: steps 3 and 4 (0-based 2 and 3) were in flight, generated with
    # the weights of steps 0 and 1, and saved with the checkpoint
    step_2 = full / "checkpoints" / "step_2"
    assert [(s["step"], s["version"]) for s in load_in_flight(step_2, 0)] == [(2, 0), (3, 1)]
    shutil.copytree(step_2, part / "checkpoints" / "step_2")
    shutil.copytree(full.parent / "init", part.parent / "init")
    assert launch_train(QUICKSTART, tiny_overrides(part, steps=4) + k2) == 0   # resumes from step_2
    assert read_metrics(part) == {t: unbroken[t] for t in (3, 4)}
    assert json.loads((part / "final_eval.json").read_text())["after"] == \
        json.loads((full / "final_eval.json").read_text())["after"]


@pytest.mark.e2e
@pytest.mark.ray
def test_ray_workers_in_the_background_sample_what_the_in_process_worker_samples(tmp_path, ray_address):
    from tests.rollout.test_local import assert_same_run

    def train(out: Path, *extra: str) -> dict[int, dict]:
        cmd = [sys.executable, "-m", "anytime.cli", "train", QUICKSTART, *tiny_overrides(out, steps=3),
               "rollout.prompts_per_step=4", "learner.lr=1e-2", "learner.deterministic=false", *LOCKED, *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                              env={**os.environ, "RAY_ADDRESS": ray_address})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return read_metrics(out)

    local = train(tmp_path / "local" / "run", "rollout.placement=inprocess")
    two = train(tmp_path / "two" / "run", "rollout.placement=ray", "rollout.workers=2")
    assert_same_run(local, two)   # (1 and 2 Ray workers sample alike: tests/rollout/test_local.py and tests/rollout/test_ray_workers.py)
    assert [two[t]["rollout/token_version_lag"] for t in (1, 2, 3)] == [0, 1, 1]
    # stale by one step: the engine sampled step 3's batch with the weights of step 2, the learner
    # scores it after update 2 (lr 1e-2 moves the tiny model far), so the gap is not the numerics'
    assert two[3]["train/logprob_mismatch"] > 1e-3


@pytest.mark.integration
@pytest.mark.ray
def test_a_worker_killed_with_a_rollout_in_flight_fails_it_by_name(tiny_model_dir, ray_address):
    from transformers import AutoTokenizer

    from anytime.data.prompts import render_prompt
    from anytime.rollout.workers.ray_workers import RayRollouts, RolloutWorkerError

    class OneRank:
        dp_size, dp_ranks = 1, [0]

    recipe = load_recipe(QUICKSTART, ["rollout.placement=ray", "rollout.workers=2", "rollout.n=2", "summary.n=1",
                                      "budget.budgets=[8,16]", "budget.max_thinking=16", *LOCKED])
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rollouts = placed(recipe, RayRollouts, tiny_model_dir, tok, OneRank())
    pids = list(rollouts.pids)
    prompts = [render_prompt(tok, f"Start with {k}. Step 1: add 2. What is the last digit of the result?")
               for k in range(2)]
    try:
        first = rollouts.submit(prompts, ["2", "3"], 0)
        rollouts.submit(prompts, ["2", "3"], 1)   # queued behind the first on each actor
        kill_and_clean(pids[1])          # while step 0's rollout runs
        with pytest.raises(RolloutWorkerError, match=rf"rollout worker 1 \(Ray actor, pid {pids[1]}\) failed during "
                                                     "the rollout of step 0"):
            rollouts.collect(first)
    finally:
        rollouts.close()
    assert not still_running_after(pids, 30)


class OneRankLearner:
    """Learner rank 0 of one: the rows all go to it; each `step` moves its weights by a fixed random
    perturbation of the tiny model's (so that a rollout after a sync samples differently)."""

    dp_size, dp_ranks = 1, [0]

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoModelForCausalLM

        self.gen = torch.Generator().manual_seed(0)
        self.state = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()

    def step(self) -> None:
        self.state = {k: v + 0.05 * torch.randn(v.shape, generator=self.gen) for k, v in self.state.items()}

    def full_state_dict(self) -> dict:
        return self.state


@pytest.mark.integration
@pytest.mark.ray
def test_a_restarted_worker_regenerates_its_rollouts_in_flight_exactly(tiny_model_dir, ray_address):
    """Locked k = 2 with `rollout.worker_restarts: 1`: worker 1 dies with three rollouts in flight, one
    submitted with the weights it started with and one after each of two syncs; the actor put in its
    place regenerates all three, each with its own weights, and the batches equal an unbroken run's.
    A second death fails by name. In lock-step, an actor replaced with nothing in flight takes the
    latest weights."""
    from transformers import AutoTokenizer

    from anytime.data.prompts import render_prompt
    from anytime.rollout.workers.ray_workers import RayRollouts, RolloutWorkerError

    overrides = ["rollout.placement=ray", "rollout.workers=2", "rollout.n=2", "summary.n=1", "budget.budgets=[8,16]",
                 "budget.max_thinking=16", "rollout.worker_restarts=1",
                 "algorithm.entropy_coef=0.001",   # keeps the rows of zero reward
                 "rollout.max_staleness=2"]
    recipe = load_recipe(QUICKSTART, overrides)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [render_prompt(tok, f"Start with {k}. Step 1: add 2. What is the last digit of the result?")
               for k in range(4)]
    golds = ["2", "3", "4", "5"]

    def three_steps(kill_after_submit: bool) -> tuple[list[dict], list[int]]:
        learner = OneRankLearner(tiny_model_dir)
        rollouts = placed(recipe, RayRollouts, tiny_model_dir, tok, learner)
        first_pids = list(rollouts.pids)
        try:
            handles = [rollouts.submit(prompts, golds, 0)]      # the start weights
            for step in (1, 2):                                 # the weights of steps 1 and 2
                learner.step()
                rollouts.sync_weights(snapshot(learner))
                handles.append(rollouts.submit(prompts, golds, step))
            if kill_after_submit:
                kill_and_clean(first_pids[1])
            batches = [experience(rollouts.collect(h), recipe, 0).batch.to_tensors() for h in handles]
            if kill_after_submit:
                assert rollouts.pids[1] != first_pids[1] and not psutil.pid_exists(first_pids[1])
                kill_and_clean(rollouts.pids[1])   # the restart budget is spent
                with pytest.raises(RolloutWorkerError, match=r"rollout worker 1 .* failed during the rollout of step 3"
                                                             r".*restarted 1 time\(s\) already"):
                    rollouts.collect(rollouts.submit(prompts, golds, 3))
            return batches, [*first_pids, *rollouts.pids]
        finally:
            rollouts.close()

    unbroken, _ = three_steps(kill_after_submit=False)
    restarted, pids = three_steps(kill_after_submit=True)
    assert unbroken[0]["input_ids"].shape[0] == 4 * 2   # prompts × traces (summaries packed in their trace)
    for a, b in ((0, 1), (1, 2)):   # each sync changed the samples
        assert not torch.equal(unbroken[a]["input_ids"], unbroken[b]["input_ids"])
    for want, got in zip(unbroken, restarted):
        assert want.keys() == got.keys()
        for key in want:
            assert torch.equal(want[key], got[key]), key
    # lock-step: an actor found dead by the weight sync, with nothing in flight, is replaced by one that
    # holds the new weights, so the next rollout samples what an unbroken run samples
    learner = OneRankLearner(tiny_model_dir)
    rollouts = placed(load_recipe(QUICKSTART, [*overrides[:-1], "rollout.max_staleness=0"]), RayRollouts,
                      tiny_model_dir, tok, learner)
    pids += rollouts.pids
    try:
        learner.step()
        learner.step()
        kill_and_clean(rollouts.pids[1])
        rollouts.sync_weights(snapshot(learner))   # the weights of step 2: unbroken[2] was sampled with them
        pids.append(rollouts.pids[1])
        batch = experience(rollouts.collect(rollouts.submit(prompts, golds, 2)), recipe, 0).batch.to_tensors()
    finally:
        rollouts.close()
    for key in unbroken[2]:
        assert torch.equal(unbroken[2][key], batch[key]), key
    assert not still_running_after(pids, 30)
