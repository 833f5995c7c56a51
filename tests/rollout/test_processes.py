"""Rollout workers in local processes without Ray (`rollout.placement: processes`): one and two
worker processes sample what the in-process worker samples, in lock-step and with locked staleness;
locked rollouts queue behind each other and the weights reach each worker after the rollouts submitted
before them; a worker killed mid-rollout fails the step by name; nothing is left running and no
weight file is left in /dev/shm."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from anytime.config import load_recipe
from tests.helpers import QUICKSTART, kill_and_clean, placed, read_metrics, tiny_overrides

SMALL = ["rollout.n=2", "summary.n=1", "budget.budgets=[8,16]", "budget.max_thinking=16"]


def train(out: Path, *extra: str) -> dict[int, dict]:
    cmd = [sys.executable, "-m", "anytime.cli", "train", QUICKSTART, *tiny_overrides(out, steps=3),
           "rollout.prompts_per_step=4", "learner.lr=1e-2", "learner.deterministic=false", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return read_metrics(out)


def weight_files() -> list[str]:
    """Weight files whose writer is gone (its pid is in the name): what a run leaked. A live writer's
    files belong to a run still going, such as another test's under pytest-xdist."""
    files = glob.glob("/dev/shm/anytime-weights-*") + glob.glob(os.path.join(tempfile.gettempdir(), "anytime-weights-*"))
    return [f for f in files if not psutil.pid_exists(int(os.path.basename(f).split("-")[2]))]


@pytest.mark.e2e
def test_worker_processes_sample_what_the_in_process_worker_samples(tmp_path):
    from tests.rollout.test_local import assert_same_run, assert_weights_reached_the_workers

    before = set(weight_files())
    local = train(tmp_path / "local" / "run", "rollout.placement=inprocess")
    two = train(tmp_path / "two" / "run", "rollout.placement=processes", "rollout.workers=2")
    assert_same_run(local, two)
    assert_weights_reached_the_workers(two)
    # locked k = 1: the next rollout queued behind the current one, the weights behind both
    locked_local = train(tmp_path / "locked_local" / "run", "rollout.placement=inprocess", "rollout.max_staleness=1")
    locked = train(tmp_path / "locked" / "run", "rollout.placement=processes", "rollout.max_staleness=1")
    assert_same_run(locked_local, locked)
    assert [locked[t]["rollout/token_version_lag"] for t in (1, 2, 3)] == [0, 1, 1]
    assert set(weight_files()) == before


@pytest.mark.integration
def test_a_killed_worker_process_fails_the_step_by_name_and_leaves_nothing(tiny_model_dir):
    from transformers import AutoTokenizer

    from anytime.data.prompts import render_prompt
    from anytime.rollout.workers.placement import RolloutWorkerError
    from anytime.rollout.workers.processes import ProcessRollouts

    class OneRank:
        dp_size, dp_ranks = 1, [0]

    recipe = load_recipe(QUICKSTART, ["rollout.placement=processes", "rollout.workers=2", "rollout.max_staleness=1",
                                      *SMALL])
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    rollouts = placed(recipe, ProcessRollouts, tiny_model_dir, tok, OneRank())
    pids = [w.pid for w in rollouts.workers]
    prompts = [render_prompt(tok, f"Start with {k}. Step 1: add 2. What is the last digit of the result?")
               for k in range(2)]
    try:
        # every process they started (the verifiers' pools), which must end with them
        pids += [c.pid for p in pids for c in psutil.Process(p).children(recursive=True)]
        # stopped first, so it is certain to die with step 0 in hand (the tiny model can finish a
        # rollout between two lines of this test)
        os.kill(pids[1], signal.SIGSTOP)
        first = rollouts.submit(prompts, ["2", "3"], 0)
        rollouts.submit(prompts, ["2", "3"], 1)   # queued behind the first in each worker
        kill_and_clean(pids[1])
        died = rf"rollout worker 1 \(local process, pid {pids[1]}\) failed during the rollout of step 0: the process"
        with pytest.raises(RolloutWorkerError, match=died + r" died \(exit code -9\)"):
            rollouts.collect(first)
    finally:
        rollouts.close()

    def running(pid: int) -> str | None:
        """The command line of a live process (None once it ended, zombies included)."""
        try:
            proc = psutil.Process(pid)
            return None if proc.status() == psutil.STATUS_ZOMBIE else " ".join(proc.cmdline())
        except psutil.Error:
            return None

    def left() -> dict[int, str]:   # the watchdog ends by itself once what it watches has ended
        new = {c.pid for c in psutil.Process().children(recursive=True)} - before
        alive = {p: running(p) for p in set(pids) | new}
        # Python's resource tracker lives as long as this process does
        return {p: cmd for p, cmd in alive.items() if cmd is not None and "resource_tracker" not in cmd}

    deadline = time.time() + 30
    while time.time() < deadline and left():
        time.sleep(0.2)
    assert not left()


@pytest.mark.e2e
def test_worker_processes_end_with_a_learner_killed_mid_run(tmp_path):
    """The learner SIGKILLed (as by the OOM killer) mid-run: its worker processes and their weight
    files are gone within seconds (the watchdog), so nothing keeps running."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "anytime.cli", "train", QUICKSTART, *tiny_overrides(out, steps=1000),
           "rollout.placement=processes", "rollout.workers=2", "rollout.prompts_per_step=4", "trainer.save_every=1000"]
    files_before = set(weight_files())
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers: list[psutil.Process] = []
    try:
        deadline = time.time() + 600
        while time.time() < deadline and not ((out / "metrics.jsonl").exists() and read_metrics(out)):
            time.sleep(0.5)
        assert read_metrics(out), "the run never finished a step"
        workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
                   if "multiprocessing.spawn" in " ".join(p.cmdline())]
        assert len(workers) >= 2
        kill_and_clean(proc.pid)
        proc.wait(timeout=60)
        deadline = time.time() + 30
        while time.time() < deadline and any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in workers):
            time.sleep(0.2)
        assert not [p for p in workers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert set(weight_files()) <= files_before
    finally:
        for p in [proc, *workers]:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except (ProcessLookupError, psutil.NoSuchProcess):
                pass
