"""`learner.old_logprobs: update` (the update's own log-probs, detached, as the PPO ratio's old
ones) gives the gradient a recomputed pass gives on a fully on-policy step, and is refused where it
would not; `learner.bf16` autocasts the torch learner's forward passes."""

from __future__ import annotations

import pytest
import torch

from anytime.config import AlgorithmConfig, LearnerConfig
from anytime.learner.ppo import loss_spec
from tests.helpers import train_rows
from tests.learner.test_seq_mean import B, _advantages, _rollout


def _learner(path: str, dtype=torch.float64, **kwargs):
    from transformers import AutoModelForCausalLM

    from anytime.learner.data_parallel import TorchLearner

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return TorchLearner(model, LearnerConfig(lr=1e-2, mini_batch_prompts=B, **kwargs), total_steps=10)


def _batch():
    t_adv, s_adv = _advantages(0)
    return train_rows(_rollout(0), t_adv, s_adv, summary_max_tokens=3, drop_zero_rows=False, pack=True)


def _grads(learner, on_policy: bool) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    batch = _batch()
    if not on_policy:
        batch.old_logprobs = learner.logprobs(batch)
    mini = next(iter(batch.mini_batches(B, 0, 1)))
    sums = learner.forward_backward(mini.batch, loss_spec(AlgorithmConfig(), mini, batch, on_policy=on_policy))
    grads = {n: p.grad.clone() for n, p in learner.model.named_parameters() if p.grad is not None}
    learner.zero_grad()
    return sums, grads


@pytest.mark.integration
def test_the_updates_own_logprobs_give_the_recomputed_gradient(tiny_model_dir):
    learner = _learner(tiny_model_dir)
    sums_recomputed, recomputed = _grads(learner, on_policy=False)
    sums_own, own = _grads(learner, on_policy=True)
    assert own.keys() == recomputed.keys() and own
    for name, grad in own.items():
        torch.testing.assert_close(grad, recomputed[name], rtol=1e-5, atol=1e-7)   # recomputed: float32-stored
    assert sums_own["loss"] == pytest.approx(sums_recomputed["loss"], rel=1e-6)   # recomputed: stored in float32
    assert sums_own["clip_frac"] == 0.0


@pytest.mark.integration
def test_bf16_autocasts_the_torch_learners_forward(tiny_model_dir):
    batch = _batch()
    exact = _learner(tiny_model_dir, dtype=torch.float32).logprobs(batch)
    mixed = _learner(tiny_model_dir, dtype=torch.float32, bf16=True)
    approx = mixed.logprobs(batch)
    mask = batch.valid_mask
    gap = (approx - exact).abs()[mask]
    assert 0 < float(gap.max()) < 0.1, float(gap.max())   # bf16 numerics: close, not equal
    sums, grads = _grads(mixed, on_policy=True)
    assert torch.isfinite(torch.tensor(sums["loss"])) and all(g.dtype == torch.float32 for g in grads.values())


