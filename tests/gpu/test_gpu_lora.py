"""LoRA on CUDA with vLLM (`learner.lora.rank: 8`): on a GPU `learner.lora.vllm_serving: auto` has vLLM
serve the adapter itself, a new `LoRARequest` per weight version (on the CPU it takes merged full
weights), so only this tier runs vLLM's LoRA kernels. The run must train and each step after the first
must sample with the adapter the learner synced (`lora_vllm_adapter` in tests/gpu/workloads.py)."""

from __future__ import annotations

import pytest

from tests.gpu.workloads import WORKLOADS, run_checked

pytestmark = pytest.mark.gpu


def test_vllm_samples_from_each_steps_lora_adapter(tmp_path):
    run_checked(WORKLOADS["lora_vllm_adapter"], tmp_path)
