"""vLLM's `AsyncLLM` frontend on CUDA (`rollout.vllm_frontend: async`): its engine core runs in a process
of its own and takes the learner's weights by CUDA IPC (`IpcWeightLoader`), in lock-step on one GPU and
in flight on a worker process of its own (which needs a GPU of its own after the learner's). The runs
and their checks are `asyncllm_ipc` and `inflight_asyncllm_ipc` in tests/gpu/workloads.py."""

from __future__ import annotations

import pytest

from tests.gpu.workloads import WORKLOADS, run_checked

pytestmark = pytest.mark.gpu


def test_the_asyncllm_engine_core_takes_each_steps_weights_by_cuda_ipc(tmp_path):
    run_checked(WORKLOADS["asyncllm_ipc"], tmp_path)


@pytest.mark.gpus(2)
def test_inflight_swaps_reach_the_asyncllm_engine_core_by_cuda_ipc(tmp_path):
    run_checked(WORKLOADS["inflight_asyncllm_ipc"], tmp_path)
