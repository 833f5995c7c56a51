"""Colocated vLLM on CUDA with two learner ranks (`rollout.placement: colocated`,
`learner.num_processes: 2`): each rank drives a stepped vLLM engine (the `llm` frontend) on its own
GPU, puts it to sleep for every update (`rollout.enable_sleep`) and wakes it for the weight sync, the
layout of the paper's GPU command in docs/distributed.md on 2 GPUs instead of 8. Each wake-up must
take the weights gathered after the update (`colocated_vllm_sleep_two_ranks` in tests/gpu/workloads.py)."""

from __future__ import annotations

import pytest

from tests.gpu.workloads import WORKLOADS, run_checked

pytestmark = [pytest.mark.gpu, pytest.mark.gpus(2)]


def test_colocated_vllm_engines_sleep_through_each_update_on_two_ranks(tmp_path):
    run_checked(WORKLOADS["colocated_vllm_sleep_two_ranks"], tmp_path)
