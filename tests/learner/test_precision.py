"""bf16 weights (`model.dtype: bfloat16`): the torch learner trains fp32 master copies of its
trainable weights under bf16 autocast, so an AdamW step at the paper's learning rate (1e-6), far
below bf16's rounding of a weight, is kept; the weights it syncs to the engine and checkpoints as a
model stay bf16, and a resume restores the fp32 masters, not their bf16 rounding."""

from __future__ import annotations

import os

import pytest
import torch

from anytime.config import AlgorithmConfig, LearnerConfig
from anytime.learner.ppo import loss_spec
from tests.learner.test_old_logprobs import _batch
from tests.learner.test_seq_mean import B

LR = 1e-6


def _tiny_model(dtype: torch.dtype, tied: bool = False) -> torch.nn.Module:
    """A tiny random Qwen2 built in memory (vocabulary large enough for `_batch`'s token ids)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=tied)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(dtype)


def _step(learner) -> dict[str, torch.Tensor]:
    """One on-policy PPO step on the fixed batch; returns the gradients it took."""
    batch = _batch()
    mini = next(iter(batch.mini_batches(B, 0, 1)))
    learner.forward_backward(mini.batch, loss_spec(AlgorithmConfig(), mini, batch, on_policy=True))
    grads = {n: p.grad.detach().clone() for n, p in learner.model.named_parameters() if p.grad is not None}
    assert not learner.optimizer_step().skipped
    return grads


def _weights(learner) -> dict[str, torch.Tensor]:
    """The trainable weights as the optimizer holds them, in float32."""
    return {n: p.detach().float().clone() for n, p in learner.model.named_parameters() if p.requires_grad}


@pytest.mark.integration
def test_a_resume_restores_the_fp32_master_and_the_checkpoint_model_stays_bf16(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    from anytime.config import load_recipe
    from anytime.learner import checkpoint as ckpt
    from anytime.learner.factory import build_learner
    from tests.helpers import QUICKSTART

    recipe = load_recipe(QUICKSTART, ["model.dtype=bfloat16", f"model.path={tiny_model_dir}", "model.tiny=false",
                                      f"learner.lr={LR}", f"learner.mini_batch_prompts={B}"])
    learner = build_learner(recipe, tiny_model_dir)
    for _ in range(3):
        _step(learner)
    folder = ckpt.save_checkpoint(tmp_path, 3, learner, None, {}, keep_last=1)
    saved = load_file(folder / "model" / "model.safetensors")
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}
    resumed = build_learner(recipe, tiny_model_dir)
    ckpt.load_checkpoint(folder, resumed)
    master, restored = _weights(learner), _weights(resumed)
    assert any(not torch.equal(m, m.bfloat16().float()) for m in master.values()), "the master is bf16-exact"
    for name, weight in master.items():
        assert torch.equal(restored[name], weight), name
    _step(learner)
    _step(resumed)   # the same next step: the optimizer state was restored too
    for name, weight in _weights(learner).items():
        assert torch.equal(_weights(resumed)[name], weight), name


@pytest.mark.unit
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_an_lr_1e6_step_reaches_bf16_weights_through_their_fp32_master(tied):
    from anytime.learner.data_parallel import TorchLearner

    cfg = LearnerConfig(lr=LR, mini_batch_prompts=B)
    learner = TorchLearner(_tiny_model(torch.bfloat16, tied), cfg, total_steps=5)
    start, synced = _weights(learner), learner.full_state_dict()
    grads = _step(learner)
    after = _weights(learner)
    # AdamW's first step moves every weight with a nonzero gradient by about lr
    moved = sum(int(((after[n] != start[n]) & (g != 0)).sum()) for n, g in grads.items())
    pushed = sum(int((g != 0).sum()) for g in grads.values())
    assert pushed > 0 and moved / pushed > 0.99, f"the step reached {moved} of {pushed} weights it pushed"
    for _ in range(4):
        _step(learner)
    now, master = learner.full_state_dict(), _weights(learner)
    assert {t.dtype for t in now.values() if t.is_floating_point()} == {torch.bfloat16}
    for name, weight in master.items():   # the engine gets the masters' rounding
        assert torch.equal(now[name], weight.bfloat16()), name
    if tied:
        assert torch.equal(now["lm_head.weight"], now["model.embed_tokens.weight"])
    assert any(not torch.equal(now[k], synced[k]) for k in synced), "5 steps left the bf16 weights unchanged"


@pytest.mark.unit
@pytest.mark.parametrize("overrides,message", [
    (["learner.pipeline.stages=2"], "torch pipeline learner"),
    (["learner.backend=deepspeed", "learner.zero_stage=0"], "ZeRO-0 without `learner.bf16`"),
])
def test_learners_without_a_float32_copy_of_bf16_weights_are_refused(overrides, message):
    from anytime.config import RecipeError, load_recipe

    with pytest.raises(RecipeError, match=message):
        load_recipe(None, ["model.dtype=bfloat16", *overrides])
    load_recipe(None, ["model.dtype=float32", *overrides])   # float32 weights need no copy
    load_recipe(None, ["model.dtype=bfloat16", "learner.backend=deepspeed", "learner.zero_stage=0", "learner.bf16=true"])


@pytest.mark.unit
def test_deterministic_runs_give_cublas_its_fixed_workspace(monkeypatch):
    from anytime.trainer.trainer import use_deterministic_algorithms

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda on: None)
    use_deterministic_algorithms()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
