"""Two steps of the paper's recipe (`recipes/paper/ar_linear.yaml`) on CUDA with a tiny model built
from its config, scaled down (tests/gpu/workloads.py says how): on vLLM, and on the transformers engine,
which runs wherever vLLM is not installed."""

from __future__ import annotations

import json
import math

import pytest

from tests.gpu.workloads import WORKLOADS, assert_trained, require, train

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_two_steps_of_the_paper_recipe_on_a_tiny_model(tmp_path, engine):
    workload = WORKLOADS[f"paper_{engine}"]
    require(workload)
    metrics = train(workload, tmp_path)
    assert_trained(metrics, workload.steps)
    out = tmp_path / "run"
    recipe = (out / "recipe.yaml").read_text()
    assert "dtype: bfloat16" in recipe and "gradient_checkpointing: true" in recipe
    for m in metrics.values():   # the paper's grid of four budgets, scaled
        assert all(0.0 <= m[f"train/acc@{b}"] <= 1.0 for b in (64, 128, 192, 256))
    final = json.loads((out / "final_eval.json").read_text())
    assert all(math.isfinite(final[when]["eval/anytime"]) for when in ("before", "after"))
    assert (out / "checkpoints" / f"step_{workload.steps}" / "model" / "model.safetensors").is_file()
