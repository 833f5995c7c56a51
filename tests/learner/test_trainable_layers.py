"""Training only the top of the model (`learner.trainable_layers`): the trained layers get exactly
the gradients the full model gives them, nothing below them gets a gradient or runs a backward, an
untied LM head trains, LoRA adapters land on the top layers only, and bad counts are refused."""

from __future__ import annotations

import pytest
import torch

from anytime.config import AlgorithmConfig, LearnerConfig, LoRAConfig
from anytime.errors import RecipeError
from anytime.learner.freeze import decoder_layers, top_layer_indices, train_top_layers
from anytime.learner.ppo import loss_spec
from tests.helpers import train_rows
from tests.learner.test_seq_mean import B, _advantages, _rollout


def _learner(path: str, trainable_layers: int = 0):
    from transformers import AutoModelForCausalLM

    from anytime.learner.data_parallel import TorchLearner

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    if trainable_layers:
        train_top_layers(model, trainable_layers)
    return TorchLearner(model, LearnerConfig(lr=1e-2, mini_batch_prompts=B), total_steps=10)


def _grads(learner) -> dict[str, torch.Tensor]:
    t_adv, s_adv = _advantages(0)
    batch = train_rows(_rollout(0), t_adv, s_adv, summary_max_tokens=3, drop_zero_rows=False, pack=True)
    batch.old_logprobs = learner.logprobs(batch) - 0.01
    mini = next(iter(batch.mini_batches(B, 0, 1)))
    learner.forward_backward(mini.batch, loss_spec(AlgorithmConfig(), mini, batch))
    return {n: p.grad.clone() for n, p in learner.model.named_parameters() if p.grad is not None}


@pytest.mark.integration
def test_top_layers_get_the_full_models_gradients_and_nothing_below_runs_a_backward(tiny_model_dir):
    full = _grads(_learner(tiny_model_dir))
    learner = _learner(tiny_model_dir, trainable_layers=1)
    layers = decoder_layers(learner.model)
    top = len(layers) - 1
    ran_backward = []
    for i, layer in enumerate(layers):
        layer.register_full_backward_hook(lambda *_, i=i: ran_backward.append(i))
    part = _grads(learner)
    assert part, "no parameter got a gradient"
    # the tiny model's LM head is untied, so it trains too
    assert all(f"layers.{top}." in n or n in ("model.norm.weight", "lm_head.weight") for n in part), sorted(part)
    assert "lm_head.weight" in part and "model.norm.weight" in part
    for name, grad in part.items():
        torch.testing.assert_close(grad, full[name], rtol=1e-9, atol=1e-12)
    assert set(ran_backward) <= {top}, f"backward ran through layers {sorted(set(ran_backward))}"
    trainable = {id(p) for p in learner.trainable_parameters()}
    assert all(id(p) not in trainable for p in layers[0].parameters())


@pytest.mark.integration
def test_an_untied_lm_head_trains_a_tied_one_stays_frozen(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    untied = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    train_top_layers(untied, 1)
    assert untied.get_output_embeddings().weight.requires_grad
    assert not untied.get_input_embeddings().weight.requires_grad
    tied = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tied.get_output_embeddings().weight = tied.get_input_embeddings().weight   # as SmolLM2 ties them
    train_top_layers(tied, 1)
    assert not tied.get_output_embeddings().weight.requires_grad


@pytest.mark.integration
def test_lora_adapters_only_on_the_top_layers(tiny_model_dir):
    pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from anytime.learner.lora import apply_lora, lora_layers

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    total = len(decoder_layers(model))
    apply_lora(model, LoRAConfig(rank=2, alpha=4.0, target_modules=["q_proj", "up_proj"]), tiny_model_dir,
               layers=top_layer_indices(model, 1))
    names = [name for name, _ in lora_layers(model)]
    assert names and all(f"layers.{total - 1}." in n for n in names), names


@pytest.mark.integration
def test_a_count_beyond_the_model_is_refused_with_the_range(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    total = len(decoder_layers(model))
    with pytest.raises(RecipeError, match=f"choose 1..{total}"):
        train_top_layers(model, total + 1)


