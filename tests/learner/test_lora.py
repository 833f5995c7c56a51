"""LoRA adapters (`learner.lora`, through peft): one update equals a hand-built PEFT model's, tree
packing gives the same loss and gradients, the KL reference is the base model, the transformers
engine merges the adapter's factors into the same weights the learner would send in full, and
checkpoints hold only the adapter."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from tests.helpers import train_rows
from anytime.config import AlgorithmConfig, LearnerConfig, LoRAConfig
from anytime.learner.ppo import loss_spec
from tests.learner.test_seq_mean import B, _advantages, _rollout

pytest.importorskip("peft")

LORA = LoRAConfig(rank=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj"])


def _randomise_b(peft_model, seed: int = 7) -> None:
    """peft starts lora_B at zero (no gradient reaches lora_A then): give both models the same B."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(peft_model.named_parameters()):
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.05)


def _lora_learner(path: str, cfg: LoRAConfig = LORA, kind: type | None = None, dtype=torch.float64,
                  **learner_kwargs):
    from transformers import AutoModelForCausalLM

    from anytime.learner.data_parallel import TorchLearner
    from anytime.learner.lora import apply_lora

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    torch.manual_seed(0)
    peft_model = apply_lora(model, cfg, path)
    _randomise_b(peft_model)
    lc = LearnerConfig(lr=1e-2, mini_batch_prompts=B, lora=cfg, **learner_kwargs)
    return (kind or TorchLearner)(model, lc, total_steps=10, peft_model=peft_model)


def _mini(learner, pack: bool):
    t_adv, s_adv = _advantages(0)
    batch = train_rows(_rollout(0), t_adv, s_adv, summary_max_tokens=3, drop_zero_rows=False, pack=pack)
    batch.old_logprobs = learner.logprobs(batch) - 0.01   # ratio ≠ 1, inside the clip range
    mini = next(iter(batch.mini_batches(B, 0, 1)))
    return mini, loss_spec(AlgorithmConfig(), mini, batch)


def _adapter_grads(module) -> dict[str, torch.Tensor]:
    return {n.removeprefix("base_model.model."): p.grad.clone() for n, p in module.named_parameters()
            if "lora_" in n and p.grad is not None}


@pytest.mark.integration
def test_one_update_equals_a_hand_built_peft_model(tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from anytime.algo.loss import token_loss

    learner = _lora_learner(tiny_model_dir)
    mini, spec = _mini(learner, pack=False)
    sums = learner.forward_backward(mini.batch, spec)
    # the reference: peft's own model on whole rows (no chunked head, no packing), the loss by hand
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64)
    torch.manual_seed(0)
    ref = get_peft_model(base, LoraConfig(r=LORA.rank, lora_alpha=LORA.alpha, lora_dropout=0.0,
                                          target_modules=LORA.target_modules, task_type="CAUSAL_LM"))
    _randomise_b(ref)
    ref.train()
    b = mini.batch
    logits = ref(input_ids=b.input_ids).logits[:, :-1]
    lp = torch.log_softmax(logits, -1).gather(-1, b.labels.unsqueeze(-1)).squeeze(-1)
    loss, _ = token_loss(torch.where(b.loss_mask, lp, 0.0), None, b, spec)
    loss.backward()
    assert sums["loss"] == pytest.approx(float(loss.detach()), abs=1e-10)
    mine, theirs = _adapter_grads(learner.peft_model), _adapter_grads(ref)
    layers = learner.model.config.num_hidden_layers
    assert mine.keys() == theirs.keys() and len(mine) == 2 * 3 * layers   # A and B of 3 modules per layer
    for name in mine:
        assert torch.allclose(mine[name], theirs[name], atol=1e-10), name
    assert all(g.abs().sum() > 0 for g in mine.values())
    # only the adapter trains: the frozen base gets no gradient and no optimizer state
    assert all(p.grad is None for n, p in learner.model.named_parameters() if "lora_" not in n)
    assert {id(p) for p in learner.optimizer.param_groups[0]["params"]} == \
        {id(p) for n, p in learner.model.named_parameters() if "lora_" in n}


@pytest.mark.integration
def test_tree_packing_gives_the_same_loss_and_adapter_gradients(tiny_model_dir):
    results = []
    for pack in (False, True):
        learner = _lora_learner(tiny_model_dir)
        mini, spec = _mini(learner, pack)
        results.append((learner.forward_backward(mini.batch, spec)["loss"], _adapter_grads(learner.model)))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert loss_a == pytest.approx(loss_b, abs=1e-10)
    assert all(torch.allclose(grads_a[k], grads_b[k], atol=1e-10) for k in grads_a)


@pytest.mark.integration
def test_kl_reference_is_the_base_model_with_the_adapter_off(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from anytime.learner.data_parallel import forward_logprobs

    learner = _lora_learner(tiny_model_dir, reference_model=True)
    mini, _ = _mini(learner, pack=True)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64)
    base.set_attn_implementation(learner.model.config._attn_implementation)
    with torch.no_grad():
        want, _ = forward_logprobs(base, mini.batch)
        with learner.peft_model.disable_adapter():
            got, _ = forward_logprobs(learner.model, mini.batch)
        adapted, _ = forward_logprobs(learner.model, mini.batch)
    assert torch.allclose(got, want, atol=1e-12)
    assert not torch.allclose(adapted, want, atol=1e-6)   # the adapter is on again afterwards
    spec = dataclasses.replace(_mini(learner, pack=True)[1], kl_coef=0.1)
    sums = learner.forward_backward(mini.batch, spec)
    assert sums["kl_ref"] > 0   # computed against the base model


@pytest.mark.integration
def test_engine_merges_adapter_factors_into_the_learners_merged_weights(tiny_model_dir):
    from anytime.learner.lora import adapter_bytes
    from anytime.rollout.engines.hf import HFEngine

    learner = _lora_learner(tiny_model_dir)
    engine = HFEngine(tiny_model_dir, max_model_len=64, dtype="float64")
    full = learner.full_state_dict()
    assert set(full) == set(engine.model.state_dict())   # Hugging Face names, no peft prefixes
    for _ in range(2):   # the second update merges onto the base, not onto the first merge
        update = learner.adapter_update()
        engine.update_adapter(update)
        state = engine.model.state_dict()
        assert all(torch.equal(state[k], v) for k, v in learner.full_state_dict().items())
        with torch.no_grad():
            for n, p in learner.model.named_parameters():
                if "lora_B" in n:
                    p.mul_(2.0)
    sent = adapter_bytes(update)
    assert sent * 20 < sum(t.numel() * t.element_size() for t in full.values())
    engine.close()


@pytest.mark.integration
@pytest.mark.deepspeed
def test_deepspeed_lora_step_equals_torch_and_saves_the_adapter_only(tiny_model_dir, tmp_path):
    pytest.importorskip("deepspeed")
    import torch.distributed as dist

    # the single-process DeepSpeed world writes RANK, WORLD_SIZE, ... into os.environ: undo it afterwards,
    # or later `anytime train` calls in this process would take themselves for launched ranks
    saved = dict(os.environ)

    from anytime.learner.deepspeed_learner import DeepSpeedLearner

    try:
        learners = [_lora_learner(tiny_model_dir, dtype=torch.float32),
                    _lora_learner(tiny_model_dir, kind=DeepSpeedLearner, dtype=torch.float32, zero_stage=2)]
        for learner in learners:
            mini, spec = _mini(learner, pack=True)
            learner.forward_backward(mini.batch, spec)
            assert not learner.optimizer_step().skipped
        (a, b) = ({k: v for k, v in lr.model.state_dict().items() if "lora_" in k} for lr in learners)
        assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
        ds = learners[1]
        ds.save(tmp_path)
        assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
        modules = torch.load(next((tmp_path / "deepspeed").glob("mp_rank_*model_states.pt")), weights_only=False)
        assert modules["module"] and all("lora_" in k for k in modules["module"])   # the frozen base is not saved
        before = {k: v.clone() for k, v in b.items()}
        with torch.no_grad():
            for k, p in ds.model.named_parameters():
                if "lora_" in k:
                    p.zero_()
        ds.load(tmp_path)
        assert all(torch.equal(before[k], v) for k, v in ds.model.state_dict().items() if k in before)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)


@pytest.mark.integration
def test_non_finite_loss_skips_the_adapter_update(tiny_model_dir):
    from anytime.learner.ppo import ppo_update
    from tests.trainer.test_trainer import _batch

    learner = _lora_learner(tiny_model_dir)
    before = {k: v.clone() for k, v in learner.model.state_dict().items()}
    stats = ppo_update(learner, _batch(float("nan")), AlgorithmConfig(), LearnerConfig(mini_batch_prompts=1))
    assert stats["skipped_updates"] == 1.0
    assert all(torch.equal(before[k], v) for k, v in learner.model.state_dict().items())
    stats = ppo_update(learner, _batch(1.0), AlgorithmConfig(), LearnerConfig(mini_batch_prompts=1))
    changed = [k for k, v in learner.model.state_dict().items() if not torch.equal(before[k], v)]
    assert stats["skipped_updates"] == 0.0 and changed and all("lora_" in k for k in changed)
