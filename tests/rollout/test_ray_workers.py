"""Rollout workers as Ray actors (`anytime.rollout.workers.ray_workers`): they sample exactly what one
worker samples, take the learner's weights (a vLLM engine in an actor too), a dead actor fails the step
by name, and closed actors leave no temporary folder."""

import json
import os
import subprocess
import sys

import psutil
import pytest

from tests.helpers import QUICKSTART, kill_and_clean, placed, still_running_after
from tests.rollout.test_local import assert_same_run, assert_weights_reached_the_workers, needs_ray, needs_vllm, train


@pytest.mark.e2e
@pytest.mark.ray
@needs_ray
def test_ray_workers_sample_what_one_worker_samples(tmp_path, ray_address):
    # two Ray actors against one in-process worker (one actor is the same worker in a process of its own:
    # tests/trainer/test_inflight_training.py and the async benchmark run it)
    two = train(tmp_path / "two" / "run", "rollout.placement=ray", "rollout.workers=2",
                env={"RAY_ADDRESS": ray_address})
    assert_weights_reached_the_workers(two)
    local = train(tmp_path / "local" / "run")  # one in-process worker, no Ray
    assert_same_run(local, two)


@pytest.mark.e2e
@pytest.mark.ray
@pytest.mark.vllm
@needs_ray
@needs_vllm
def test_a_vllm_engine_in_a_ray_actor(tmp_path, ray_address):
    metrics = train(tmp_path / "run", "rollout.placement=ray", "rollout.engine=vllm", env={"RAY_ADDRESS": ray_address})
    assert_weights_reached_the_workers(metrics)


@pytest.mark.integration
@pytest.mark.ray
@needs_ray
def test_a_killed_ray_worker_fails_the_step_by_name(tiny_model_dir, ray_address):
    from transformers import AutoTokenizer

    from anytime.config import load_recipe
    from anytime.data.prompts import render_prompt
    from anytime.rollout.workers.ray_workers import RayRollouts, RolloutWorkerError

    class OneRank:
        dp_size, dp_ranks = 1, [0]

    recipe = load_recipe(QUICKSTART, ["rollout.placement=ray", "rollout.workers=2", "rollout.n=2", "summary.n=1",
                                      "budget.budgets=[8,16]", "budget.max_thinking=16"])
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rollouts = placed(recipe, RayRollouts, tiny_model_dir, tok, OneRank())
    pids = list(rollouts.pids)
    try:
        assert all(psutil.pid_exists(p) for p in pids)
        kill_and_clean(pids[1])
        prompts = [render_prompt(tok, f"Start with {k}. Step 1: add 2. What is the last digit of the result?")
                   for k in range(2)]
        with pytest.raises(RolloutWorkerError, match=rf"rollout worker 1 \(Ray actor, pid {pids[1]}\) failed during "
                                                     "the rollout of step 0"):
            rollouts.collect(rollouts.submit(prompts, ["2", "3"], 0))
    finally:
        rollouts.close()
    assert not still_running_after(pids, 30)


ACTOR_TEMP_FOLDERS = """
import glob, json, os, sys
import ray
from transformers import AutoTokenizer
from anytime.config import load_recipe
from anytime.config.placement_plan import placement_plan
from anytime.data.prompts import render_prompt
from anytime.rollout.workers.ray_workers import RayRollouts

class OneRank:
    dp_size, dp_ranks = 1, [0]

model, recipe = sys.argv[1], load_recipe(sys.argv[2], ["rollout.placement=ray", "rollout.workers=2", "rollout.n=2",
                                                      "summary.n=1", "budget.budgets=[8,16]", "budget.max_thinking=16"])
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
tok = AutoTokenizer.from_pretrained(model)
rollouts = RayRollouts(recipe, placement_plan(recipe), model, tok, OneRank())
rollouts.collect(rollouts.submit([render_prompt(tok, f"Start with {k}. Step 1: add 2.") for k in range(2)], ["2", "3"], 0))
during = glob.glob(os.path.join(os.environ["TMPDIR"], "pymp-*"))
rollouts.close()
print(json.dumps({"during": during, "after": glob.glob(os.path.join(os.environ["TMPDIR"], "pymp-*"))}))
ray.shutdown()
"""


@pytest.mark.integration
@pytest.mark.ray
@needs_ray
def test_closed_ray_workers_leave_no_temporary_folders(tiny_model_dir):
    """The actors' verifier pools keep sockets in multiprocessing's temporary folders; the actors exit
    as Python does, so those folders go with them (a killed process would leave them)."""
    import shutil
    import tempfile

    tmp = tempfile.mkdtemp(prefix="ax-", dir="/tmp")   # short: Ray's sockets live under it too
    try:
        proc = subprocess.run([sys.executable, "-c", ACTOR_TEMP_FOLDERS, tiny_model_dir, QUICKSTART], capture_output=True,
                              text=True, timeout=600, env={**os.environ, "TMPDIR": tmp, "RAY_ADDRESS": ""})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        folders = json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert folders["during"], "the actors made no temporary folder: the check checks nothing"
    assert folders["after"] == [], folders
