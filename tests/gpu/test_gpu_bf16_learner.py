"""The torch learner on CUDA with bf16 weights (`model.dtype: bfloat16`): one AdamW step at the paper's
learning rate, 1e-6, far below bf16's rounding of a weight, still moves the weights it trains, each by
about the learning rate."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import QUICKSTART

pytestmark = pytest.mark.gpu

LR = 1e-6


def _trainable(learner) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in learner.model.named_parameters() if p.requires_grad}


def test_one_bf16_step_at_lr_1e6_moves_the_learners_weights(tiny_model_dir):
    from anytime.config import AlgorithmConfig, load_recipe
    from anytime.learner.factory import build_learner
    from anytime.learner.ppo import loss_spec
    from tests.learner.test_old_logprobs import _batch
    from tests.learner.test_seq_mean import B

    recipe = load_recipe(QUICKSTART, ["model.dtype=bfloat16", f"model.path={tiny_model_dir}", "model.tiny=false",
                                      f"learner.lr={LR}", f"learner.mini_batch_prompts={B}"])
    learner = build_learner(recipe, tiny_model_dir)
    try:
        assert next(learner.model.parameters()).is_cuda
        before = _trainable(learner)
        batch = _batch()
        mini = next(iter(batch.mini_batches(B, 0, 1)))
        sums = learner.forward_backward(mini.batch, loss_spec(AlgorithmConfig(), mini, batch, on_policy=True))
        pushed = {n: p.grad != 0 for n, p in learner.model.named_parameters() if p.grad is not None}
        result = learner.optimizer_step()
        after = _trainable(learner)
    finally:
        del learner
        torch.cuda.empty_cache()   # the GPU runs after this one want its memory
    assert math.isfinite(sums["loss"]) and not result.skipped and math.isfinite(result.grad_norm)
    moved = sum(int(((after[n] != before[n]) & where).sum()) for n, where in pushed.items())
    total = sum(int(where.sum()) for where in pushed.values())
    assert total > 0 and moved / total > 0.99, f"the step reached {moved} of the {total} weights it pushed"
    # AdamW's first step moves a weight by lr (its gradient's sign) plus a decay far below it
    largest = max(float((after[n] - before[n]).abs().max()) for n in after)
    assert largest <= 1.5 * LR, largest
