"""DeepSpeed ZeRO-3 in bf16 on CUDA, the paper's learner: on one GPU with the transformers engine; on
two GPUs as two learner processes over NCCL, and with a vLLM Ray actor on the second GPU that takes
each step's weights by NCCL broadcast from learner rank 0 (`rollout.weight_sync: nccl`, Ray placement
only). The runs and their checks are the `deepspeed_*` workloads in tests/gpu/workloads.py."""

from __future__ import annotations

import pytest

from tests.gpu.workloads import WORKLOADS, run_checked

pytestmark = pytest.mark.gpu


def test_deepspeed_zero3_trains_in_bf16_on_one_gpu(tmp_path):
    run_checked(WORKLOADS["deepspeed_zero3_bf16"], tmp_path)


@pytest.mark.gpus(2)
def test_deepspeed_zero3_trains_in_bf16_on_two_ranks_over_nccl(tmp_path):
    run_checked(WORKLOADS["deepspeed_two_ranks"], tmp_path)   # both ranks' engines took the gathered weights


@pytest.mark.gpus(2)
def test_a_vllm_ray_actor_takes_deepspeed_weights_by_nccl(tmp_path):
    run_checked(WORKLOADS["deepspeed_ray_nccl"], tmp_path)
