"""The learner's pipeline on CUDA: 2 stages on 2 GPUs (`learner.pipeline.stages: 2`,
`learner.num_processes: 2`), the zero-bubble ZB-H1 schedule exchanging activations and gradients over
NCCL, whose send/recv pairs hang (not fail) when the two stages disagree on the order; on the torch
learner in float32, and as the paper's 7B mesh (recipes/paper/ar_uniform_7b.yaml) scaled down, each
stage a DeepSpeed ZeRO-2 engine in bf16. Each run's limit turns a hang into a failure that names it
(`pipeline_*` in tests/gpu/workloads.py)."""

from __future__ import annotations

import pytest

from tests.gpu.workloads import WORKLOADS, run_checked

pytestmark = [pytest.mark.gpu, pytest.mark.gpus(2)]


def test_a_two_stage_zero_bubble_pipeline_trains_over_nccl(tmp_path):
    run_checked(WORKLOADS["pipeline_zbh1_nccl"], tmp_path)


def test_the_papers_deepspeed_pipeline_trains_in_bf16_over_nccl(tmp_path):
    run_checked(WORKLOADS["pipeline_deepspeed_zero2_bf16"], tmp_path)
