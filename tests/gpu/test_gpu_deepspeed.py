"""DeepSpeed ZeRO-3 in bf16 on CUDA, the paper's learner: on one GPU with the transformers engine; on
two GPUs as two learner processes over NCCL, and with a vLLM Ray actor on the second GPU that takes
each step's weights by NCCL broadcast from learner rank 0 (`rollout.weight_sync: nccl`, Ray placement
only)."""

from __future__ import annotations

import pytest

from tests.gpu.workloads import STALE_MISMATCH, WORKLOADS, assert_trained, require, train

pytestmark = pytest.mark.gpu


def test_deepspeed_zero3_trains_in_bf16_on_one_gpu(tmp_path):
    workload = WORKLOADS["deepspeed_zero3_bf16"]
    require(workload)
    metrics = train(workload, tmp_path)
    assert_trained(metrics, workload.steps)
    assert (tmp_path / "run" / "checkpoints" / f"step_{workload.steps}").is_dir()


@pytest.mark.gpus(2)
def test_deepspeed_zero3_trains_in_bf16_on_two_ranks_over_nccl(tmp_path):
    workload = WORKLOADS["deepspeed_two_ranks"]
    require(workload)
    metrics = train(workload, tmp_path)
    assert_trained(metrics, workload.steps)
    for step in range(2, workload.steps + 1):   # both ranks' engines took the gathered weights
        assert metrics[step]["train/logprob_mismatch"] < STALE_MISMATCH, (step, metrics[step])


@pytest.mark.gpus(2)
def test_a_vllm_ray_actor_takes_deepspeed_weights_by_nccl(tmp_path):
    workload = WORKLOADS["deepspeed_ray_nccl"]
    require(workload)
    metrics = train(workload, tmp_path)
    assert_trained(metrics, workload.steps)
    for step in range(2, workload.steps + 1):
        assert metrics[step]["train/logprob_mismatch"] < STALE_MISMATCH, (step, metrics[step])
