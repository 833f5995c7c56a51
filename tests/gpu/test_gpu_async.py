"""vLLM's `AsyncLLM` frontend on CUDA (`rollout.vllm_frontend: async`): its engine core runs in a process
of its own and takes the learner's weights by CUDA IPC (`IpcWeightLoader`), in lock-step on one GPU and
in flight on a worker process of its own (which needs a GPU of its own after the learner's)."""

from __future__ import annotations

import pytest

from tests.gpu.workloads import STALE_MISMATCH, WORKLOADS, assert_trained, require, train

pytestmark = pytest.mark.gpu


def test_the_asyncllm_engine_core_takes_each_steps_weights_by_cuda_ipc(tmp_path):
    workload = WORKLOADS["asyncllm_ipc"]
    require(workload)
    metrics = train(workload, tmp_path)
    assert_trained(metrics, workload.steps)
    for step in range(2, workload.steps + 1):   # step 1 sampled the start weights, later steps the synced ones
        assert metrics[step]["train/logprob_mismatch"] < STALE_MISMATCH, (step, metrics[step])


@pytest.mark.gpus(2)
def test_inflight_swaps_reach_the_asyncllm_engine_core_by_cuda_ipc(tmp_path):
    workload = WORKLOADS["inflight_asyncllm_ipc"]
    require(workload)
    metrics = train(workload, tmp_path)
    assert_trained(metrics, workload.steps)
    # version 1 is offered after step 1's update and step 3's batch cannot start without it (k = 1)
    assert sum(m["rollout/weight_swaps"] for m in metrics.values()) >= 1
    assert any(m.get("time/weight_swap", 0.0) > 0 for m in metrics.values())
    for step, m in metrics.items():
        assert 0 <= m["rollout/token_version_lag"] <= m["rollout/token_version_lag_max"] <= 1, step
