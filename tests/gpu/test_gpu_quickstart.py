"""The quickstart on CUDA with vLLM in the learner's process (`recipes/quickstart.yaml`, bf16): a short
supervised warm start, then RL steps with the engine asleep during each update (`rollout.enable_sleep`)
and woken for the weight sync."""

from __future__ import annotations

import json
import math

import pytest

from tests.gpu.workloads import STALE_MISMATCH, WORKLOADS, assert_trained, require, train

pytestmark = pytest.mark.gpu


def test_quickstart_trains_on_vllm_that_sleeps_through_each_update(tmp_path):
    workload = WORKLOADS["quickstart_vllm_sleep"]
    require(workload)
    metrics = train(workload, tmp_path)
    assert_trained(metrics, workload.steps)
    out = tmp_path / "run"
    assert (out / "sft_model" / "sft_done.txt").is_file()
    # each wake-up took the weights the learner synced while the engine slept
    for step in range(2, workload.steps + 1):
        assert metrics[step]["train/logprob_mismatch"] < STALE_MISMATCH, (step, metrics[step])
    final = json.loads((out / "final_eval.json").read_text())
    assert all(math.isfinite(final[when]["eval/anytime"]) for when in ("before", "after"))
