"""In-flight weight updates (`rollout.staleness_mode: inflight`): the transformers engine takes a new
version between two decoding steps, keeps its caches, stamps every token with the version that
computed it, and the stamped log-probs are exactly that version's; the mailbox hands over only the
newest version; the recipe check refuses what cannot swap mid-generation."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from anytime.config import RecipeError, load_recipe
from anytime.rollout.engines.engine import SamplingConfig, create_engine
from anytime.rollout.workers.inflight import WeightMailbox
from tests.helpers import QUICKSTART

pytestmark = pytest.mark.unit

PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 10]]
SWAP_AT = 3   # the tokens sampled from the 4th distribution on come from the new weights


def new_head(model_dir: str) -> torch.Tensor:
    """Another output layer: it changes the logits and nothing the KV cache holds, so the reference
    for the tokens after a swap is the new model run over the whole sequence."""
    head = AutoModelForCausalLM.from_pretrained(model_dir).lm_head.weight.detach()
    return head + 0.5 * torch.randn(head.shape, generator=torch.Generator().manual_seed(1))


def test_hf_engine_swaps_weights_between_decoding_steps(tiny_model_dir):
    head = new_head(tiny_model_dir)
    params = SamplingConfig(max_new_tokens=12, n=2, temperature=1.0, seed=7)
    polls: list[int] = []

    def source(held: int):
        polls.append(held)   # the prefill polls once, then every step before its forward
        return (5, [("lm_head.weight", head)]) if len(polls) == SWAP_AT + 1 else None

    with create_engine("hf", tiny_model_dir, max_model_len=64) as eng:
        before = eng.generate(PROMPTS, params)
        eng.weight_source = source
        swapped = eng.generate(PROMPTS, params)
        assert (eng.version, eng.swaps) == (5, 1) and eng.swap_seconds > 0
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        reference.lm_head.weight.copy_(head)
    changed = 0
    for prompt, old_samples, new_samples in zip(PROMPTS, before, swapped):
        for old, new in zip(old_samples, new_samples):
            n = len(new.token_ids)
            assert new.versions == [0 if i < SWAP_AT else 5 for i in range(n)]
            # before the swap: the old weights' tokens, the same random stream
            assert new.token_ids[:SWAP_AT] == old.token_ids[:SWAP_AT]
            assert new.logprobs[:SWAP_AT] == old.logprobs[:SWAP_AT]
            # after it: each stamped log-prob is the new weights' over the cached (unchanged) keys/values
            with torch.no_grad():
                logits = reference(torch.tensor([prompt + new.token_ids])).logits[0].float()
            logp = torch.log_softmax(logits, -1)
            for i in range(SWAP_AT, n):
                assert new.logprobs[i] == pytest.approx(float(logp[len(prompt) + i - 1, new.token_ids[i]]), abs=1e-4)
            changed += new.token_ids != old.token_ids
    assert changed   # the swap took effect


def test_a_swap_keeps_the_thinking_cache_for_the_summaries(tiny_model_dir):
    from anytime.rollout.engines.engine import Branch

    head = new_head(tiny_model_dir)
    offers = iter([(1, [("lm_head.weight", head)])])
    with create_engine("hf", tiny_model_dir, max_model_len=64) as eng:
        traces = eng.generate(PROMPTS[:1], SamplingConfig(max_new_tokens=8, temperature=0))
        kept = dict(eng._kept)
        eng.weight_source = lambda held: next(offers, None)
        eng.poll_weights()   # as between two decoding steps
        assert kept and eng.version == 1 and eng._kept == kept   # a plain weight update would drop it
        prefix = PROMPTS[0] + traces[0][0].token_ids
        out = eng.generate_branches([prefix], [[Branch(len(prefix) - 2, (4,))]], SamplingConfig(4, temperature=0))
        assert out[0][0][0].versions == [1] * len(out[0][0][0].token_ids)


def test_the_mailbox_hands_over_only_the_newest_version():
    box = WeightMailbox()
    assert box.take(0) is None
    box.offer(1, [("w", torch.zeros(1))])
    box.offer(3, [("w", torch.ones(1))])
    box.offer(2, [("w", torch.full((1,), 2.0))])   # older than the one waiting: dropped
    version, named = box.take(0)
    assert version == 3 and float(named[0][1]) == 1.0 and box.take(3) is None
    box.offer(2, [])   # older than the one taken
    assert box.take(3) is None
    with pytest.raises(TimeoutError, match="weight version 4 did not reach"):
        box.wait_for(4, held=3, timeout_s=0.05)
    threading.Timer(0.05, box.offer, (4, [])).start()
    box.wait_for(4, held=3, timeout_s=10)


def test_the_vllm_frontend_is_a_vllm_setting():
    """`rollout.vllm_frontend` picks how the vllm engine is driven; with another engine it is refused by
    name, and an unknown frontend lists the two."""
    ok = load_recipe(QUICKSTART, ["rollout.engine=vllm", "rollout.vllm_frontend=async"])
    assert ok.rollout.vllm_frontend == "async"
    with pytest.raises(RecipeError, match="set rollout.engine=vllm or drop rollout.vllm_frontend"):
        load_recipe(QUICKSTART, ["rollout.engine=hf", "rollout.vllm_frontend=async"])
    with pytest.raises(RecipeError, match="async"):
        load_recipe(QUICKSTART, ["rollout.engine=vllm", "rollout.vllm_frontend=asyncllm"])
    from anytime.rollout.engines.vllm import vllm_engine

    with pytest.raises(ValueError, match="one of"):
        vllm_engine("unused", frontend="offline")
