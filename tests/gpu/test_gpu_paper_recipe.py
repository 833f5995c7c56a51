"""Two steps of the paper's recipe (`recipes/paper/ar_linear.yaml`) on CUDA with a tiny model built
from its config, scaled down (tests/gpu/workloads.py says how): on vLLM, and on the transformers engine,
which runs wherever vLLM is not installed. The runs keep the paper's bf16 and gradient checkpointing,
score its grid of four budgets (scaled), evaluate before and after, and save the model."""

from __future__ import annotations

import pytest

from tests.gpu.workloads import WORKLOADS, run_checked

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_two_steps_of_the_paper_recipe_on_a_tiny_model(tmp_path, engine):
    run_checked(WORKLOADS[f"paper_{engine}"], tmp_path)
