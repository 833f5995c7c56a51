"""The training loop end to end on a tiny model: resume determinism, atomic checkpoints under
SIGKILL, NaN/inf skipping, SIGTERM handling, and inputs checked before any work."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from anytime.cli import main
from anytime.config import load_recipe
from anytime.evaluation.records import read_samples
from anytime.learner import checkpoint as ckpt
from anytime.trainer.launch import launch_train, preflight
from tests.helpers import QUICKSTART, read_metrics, tiny_overrides

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
def test_resume_gives_the_same_next_step(tmp_path):
    full, part = tmp_path / "full" / "run", tmp_path / "part" / "run"
    assert launch_train(QUICKSTART, tiny_overrides(full, steps=3) + ["eval.max_sample_records=3"]) == 0
    assert launch_train(QUICKSTART, tiny_overrides(part, steps=2)) == 0
    assert launch_train(QUICKSTART, tiny_overrides(part, steps=3)) == 0  # resume: auto from step_2
    a, b = read_metrics(full), read_metrics(part)
    assert a[3] == b[3]
    assert a[3]["update/grad_norm"] > 0  # the update really did something
    assert [p.name for p in ckpt.list_checkpoints(part / "checkpoints")] == ["step_2", "step_3"]
    # the in-training eval's per-sample records: one file per eval, capped by eval.max_sample_records
    written = sorted(p.name for p in (full / "eval_samples").iterdir())
    assert written == ["step_0.jsonl", "step_3.jsonl"]
    rows = [json.loads(line) for line in (full / "eval_samples" / "step_3.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(r["step"] == 3 and len(r["budgets"]) == 2 for r in rows)
    assert all(isinstance(r["thinking"], str) for r in rows) and any(r["thinking"] for r in rows)  # readable cuts
    uncapped = (part / "eval_samples" / "step_0.jsonl").read_text().splitlines()
    assert len(uncapped) == 4 * 8  # eval.limit problems × eval.samples
    # the run's saved recipe makes `anytime eval` score its checkpoint exactly as the (sampled) in-training eval did
    out = tmp_path / "offline"
    assert main(["eval", "--recipe", str(full / "recipe.yaml"), "--model", str(full / "checkpoints" / "step_3"),
                 "--verifier-workers", "1", "--out", str(out)]) == 0
    offline = json.loads((out / "results.json").read_text())["models"][str(full / "checkpoints" / "step_3")]["synthetic"]
    after = json.loads((full / "final_eval.json").read_text())["after"]
    assert offline["accuracy"] == [after[f"eval/synthetic/acc@{b}"] for b in (8, 16)]

    def sampled(records):  # every trace's length and summary texts (the scores of this model are all 0)
        return [(r["index"], r["sample"], r["thinking_length"], [s["text"] for e in r["budgets"] for s in e["summaries"]])
                for r in records]

    kept = sampled(read_samples(full / "eval_samples" / "step_3.jsonl"))   # the 3 records the cap kept
    assert [s for s in sampled(read_samples(out / "samples.jsonl")) if s[:2] in {k[:2] for k in kept}] == kept


@pytest.mark.unit
def test_missing_inputs_fail_before_any_work(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        preflight(load_recipe(QUICKSTART, ["model.tiny=false", f"model.path={tmp_path}/does-not-exist"]))
    with pytest.raises(FileNotFoundError, match="rows.jsonl"):
        preflight(load_recipe(QUICKSTART, [f"data.train={tmp_path}/rows.jsonl"]))
    with pytest.raises(ValueError, match="unknown benchmark 'aime25'.*available"):
        preflight(load_recipe(QUICKSTART, ["eval.benchmarks=[aime25]"]))
    with pytest.raises(FileNotFoundError, match="test_aime.json"):
        preflight(load_recipe(QUICKSTART, ["eval.benchmarks=[aime24]", f"eval.data_dir={tmp_path}"]))
    assert not (tmp_path / "does-not-exist").exists()


def _tiny_learner(tiny_model_dir, lr=1e-2):
    from transformers import AutoModelForCausalLM

    from anytime.config import LearnerConfig
    from anytime.learner.data_parallel import TorchLearner

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64)
    return TorchLearner(model, LearnerConfig(lr=lr, mini_batch_prompts=1), total_steps=10)


def _batch(advantage: float):
    """One prompt, one 5-token row whose last 4 tokens are trained with `advantage`."""
    from anytime.batch.train_batch import TrainBatch

    trained = torch.tensor([[True] * 4])
    return TrainBatch(torch.tensor([[1, 5, 6, 7, 8]]), torch.tensor([5]), torch.tensor([0]), trained,
                      torch.zeros_like(trained), torch.zeros_like(trained), torch.full((1, 4), advantage),
                      torch.zeros(1, 4), torch.full((1, 4), -5.0), torch.tensor([4]), traces_per_prompt=1, max_len=8)


@pytest.mark.integration
@pytest.mark.parametrize("advantage", [float("nan"), float("inf")])
def test_non_finite_loss_skips_the_update(tiny_model_dir, advantage):
    from anytime.config import AlgorithmConfig, LearnerConfig
    from anytime.learner.ppo import ppo_update

    learner = _tiny_learner(tiny_model_dir)
    before = {k: v.clone() for k, v in learner.model.state_dict().items()}
    stats = ppo_update(learner, _batch(advantage), AlgorithmConfig(), LearnerConfig(mini_batch_prompts=1))
    assert stats["skipped_updates"] == 1.0
    assert all(torch.equal(before[k], v) for k, v in learner.model.state_dict().items())
    stats = ppo_update(learner, _batch(1.0), AlgorithmConfig(), LearnerConfig(mini_batch_prompts=1))
    assert stats["skipped_updates"] == 0.0
    assert any(not torch.equal(before[k], v) for k, v in learner.model.state_dict().items())


@pytest.mark.integration
def test_non_finite_gradient_skips_the_update(tiny_model_dir):
    from anytime.config import AlgorithmConfig, LearnerConfig
    from anytime.learner.ppo import ppo_update

    learner = _tiny_learner(tiny_model_dir)
    before = {k: v.clone() for k, v in learner.model.state_dict().items()}
    param = next(learner.model.parameters())
    handle = param.register_hook(lambda g: g * float("inf"))
    stats = ppo_update(learner, _batch(1.0), AlgorithmConfig(), LearnerConfig(mini_batch_prompts=1))
    handle.remove()
    assert stats["skipped_updates"] == 1.0
    assert all(torch.equal(before[k], v) for k, v in learner.model.state_dict().items())


KILL_DURING_SAVE = textwrap.dedent("""
    import os, signal, sys, torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from anytime.config import LearnerConfig
    from anytime.learner.checkpoint import save_checkpoint
    from anytime.learner.data_parallel import TorchLearner

    model_dir, root = sys.argv[1], sys.argv[2]
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    learner = TorchLearner(model, LearnerConfig(), 10)
    save_checkpoint(root, 1, learner, tok, {"data_position": 1}, keep_last=3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)

    class KillMidWrite:
        def save_pretrained(self, path):
            os.kill(os.getpid(), signal.SIGKILL)   # weights are on disk, the rest is not

    save_checkpoint(root, 2, learner, KillMidWrite(), {"data_position": 2}, keep_last=3)
""")


@pytest.mark.integration
def test_sigkill_during_checkpoint_write_keeps_the_previous_one(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from anytime.config import LearnerConfig
    from anytime.learner.data_parallel import TorchLearner

    root = tmp_path / "checkpoints"
    proc = subprocess.run([sys.executable, "-c", KILL_DURING_SAVE, tiny_model_dir, str(root)], capture_output=True)
    assert proc.returncode == -signal.SIGKILL
    assert (root / "step_2.tmp").is_dir()  # the interrupted write
    assert [p.name for p in ckpt.list_checkpoints(root)] == ["step_1"]
    latest = ckpt.resolve_resume(root, "auto")
    assert latest.name == "step_1"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.0)
    state = ckpt.load_checkpoint(latest, TorchLearner(model, LearnerConfig(), 10))
    assert state["step"] == 1 and state["data_position"] == 1
    assert all(torch.equal(original[k], v) for k, v in model.state_dict().items())


@pytest.mark.integration
def test_checkpoint_files_that_would_run_code_are_refused(tiny_model_dir, tmp_path):
    """A checkpoint from an untrusted source must not execute code on load (pickle's REDUCE)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from anytime.config import LearnerConfig
    from anytime.learner.data_parallel import TorchLearner

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    learner = TorchLearner(model, LearnerConfig(), 10)
    path = ckpt.save_checkpoint(tmp_path, 1, learner, AutoTokenizer.from_pretrained(tiny_model_dir), {}, keep_last=1)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"optimizer": Payload(), "scheduler": {}}, path / "optimizer.pt")
    with pytest.raises(ValueError, match="refusing to load"):
        ckpt.load_checkpoint(path, learner)
    assert not marker.exists()


@pytest.mark.e2e
def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "anytime.cli", "train", QUICKSTART, *tiny_overrides(out, steps=1000),
           "trainer.save_every=1000"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while time.time() < deadline:
        if (out / "metrics.jsonl").exists() and len(read_metrics(out)) >= 2:
            break
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    saved = ckpt.list_checkpoints(out / "checkpoints")
    assert len(saved) == 1 and int(saved[0].name.split("_")[1]) >= 2
    assert "stopped by signal" in output


@pytest.mark.unit
def test_threads_are_capped_at_the_process_share_of_the_cores(monkeypatch):
    from anytime.trainer.launch import thread_count

    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(4 * cores))  # more processes than cores: one thread each
    assert thread_count(2) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # one process: all of its cores, and no more
    assert thread_count(cores) == cores
    assert thread_count(cores + 3) == cores


@pytest.mark.unit
def test_rollouts_in_flight_saved_as_rows_by_an_older_version_are_refused_by_name(tmp_path):
    """Checkpoints now hold the scored rollouts in flight (the trainer builds their rows); one that
    holds rows instead cannot continue exactly, and says what to do."""
    from collections import deque

    from anytime.config import load_recipe
    from anytime.learner.checkpoint import in_flight_file
    from anytime.trainer.trainer import Trainer
    from tests.helpers import QUICKSTART

    trainer = Trainer.__new__(Trainer)
    trainer.recipe, trainer.rank, trainer._in_flight = load_recipe(QUICKSTART, ["rollout.max_staleness=1"]), 0, deque()
    torch.save([{"step": 3, "version": 2, "batch": {"input_ids": torch.zeros(1, 2)}, "metrics": {}, "timings": {}}],
               in_flight_file(tmp_path, 0))
    with pytest.raises(ValueError, match="holds rollouts in flight as training rows.*trainer.resume=null"):
        trainer._restore_in_flight(tmp_path, 3)
