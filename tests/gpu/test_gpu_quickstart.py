"""The quickstart on CUDA with vLLM in the learner's process (`recipes/quickstart.yaml`, bf16): a short
supervised warm start, then RL steps with the engine asleep during each update (`rollout.enable_sleep`)
and woken for the weight sync; each wake-up takes the weights the learner synced while the engine
slept (`quickstart_vllm_sleep` in tests/gpu/workloads.py)."""

from __future__ import annotations

import pytest

from tests.gpu.workloads import WORKLOADS, run_checked

pytestmark = pytest.mark.gpu


def test_quickstart_trains_on_vllm_that_sleeps_through_each_update(tmp_path):
    run_checked(WORKLOADS["quickstart_vllm_sleep"], tmp_path)
