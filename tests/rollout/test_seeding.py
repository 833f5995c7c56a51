"""Placement-invariant sampling: a request's samples depend only on its seed (from its global
index), not on the other requests of the call, the batch chunking or the worker serving it."""

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from anytime.config.answer_format import AnswerFormat
from anytime.data.prompts import render_prompt
from anytime.reward.verifier import RewardScorer
from anytime.rollout.engines.engine import Branch, SamplingConfig, create_engine
from anytime.rollout.runner import AnytimeRolloutRunner
from anytime.rollout.seeding import request_seeds, sample_seeds, uniforms
from anytime.rollout.settings import AnytimeSettings


@pytest.mark.unit
def test_streams_are_uniform_and_independent():
    seeds = sample_seeds(request_seeds(7, range(2000)), 4)
    assert len(set(seeds.tolist())) == 8000
    u = np.stack([uniforms(seeds, t) for t in range(5)])
    assert u.min() >= 0.0 and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 0.01 and abs(u.var() - 1 / 12) < 0.005
    assert abs(np.corrcoef(u[0], u[1])[0, 1]) < 0.05  # positions of one stream are not correlated
    assert request_seeds(7, [3]) == request_seeds(7, range(5))[3:4]  # a seed depends on its index only


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    with create_engine("hf", tiny_model_dir, max_model_len=256, max_prompt_len=128) as eng:
        yield eng


@pytest.mark.integration
def test_inverse_cdf_sampling_follows_the_distribution(engine):
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]])).repeat(20000, 1)
    rng = sample_seeds(request_seeds(0, range(20000)), 1)
    tokens, _ = engine._sample(logits, SamplingConfig(max_new_tokens=1), rng, 0)
    freq = torch.bincount(tokens, minlength=4).double() / 20000
    assert torch.allclose(freq, torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64), atol=0.015)


@pytest.mark.integration
def test_hf_samples_do_not_depend_on_the_rest_of_the_call(engine, tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [render_prompt(tok, f"Start with {k}. Step 1: add 3. What is the last digit of the result?")
               for k in range(3)]
    seeds = request_seeds(11, range(3))
    params = SamplingConfig(max_new_tokens=12, n=2, temperature=1.0, request_seeds=seeds)
    together = engine.generate(prompts, params)
    alone = engine.generate(prompts[2:], SamplingConfig(max_new_tokens=12, n=2, request_seeds=seeds[2:]))
    assert [c.token_ids for c in together[2]] == [c.token_ids for c in alone[0]]
    assert together[0][0].token_ids != together[0][1].token_ids or together[0][0].token_ids != together[1][0].token_ids
    engine.max_batch_rows = 1  # one row at a time: other chunking, same samples
    try:
        chunked = engine.generate(prompts, params)
        branches = [[Branch(len(p) + 2, (5, 6)), Branch(len(p) + 4, (5,))] for p in prompts]
        prefixes = [p + c[0].token_ids for p, c in zip(prompts, together)]
        b_seeds = request_seeds(3, range(6))
        b_params = SamplingConfig(max_new_tokens=6, n=2, request_seeds=b_seeds)
        one_by_one = engine.generate_branches(prefixes, branches, b_params)
    finally:
        engine.max_batch_rows = 512
    assert [[c.token_ids for c in s] for s in chunked] == [[c.token_ids for c in s] for s in together]
    batched = engine.generate_branches(prefixes, branches, b_params)
    last = engine.generate_branches(prefixes[2:], branches[2:], SamplingConfig(max_new_tokens=6, n=2,
                                                                              request_seeds=b_seeds[4:]))
    assert [[c.token_ids for c in s] for s in batched[2]] == [[c.token_ids for c in s] for s in last[0]]
    assert [[c.token_ids for c in s] for b in batched for s in b] == \
        [[c.token_ids for c in s] for b in one_by_one for s in b]
    with pytest.raises(ValueError, match="2 request seeds for 3 requests"):
        engine.generate(prompts, SamplingConfig(max_new_tokens=2, request_seeds=seeds[:2]))


@pytest.mark.integration
def test_anytime_rollout_of_a_prompt_is_the_same_on_any_worker(engine, tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [render_prompt(tok, f"Start with {k}. Step 1: add 4. Step 2: add 5. What is the last digit of the result?")
               for k in range(4)]
    golds = [str((k + 9) % 10) for k in range(4)]
    with RewardScorer(num_workers=1) as scorer:
        settings = AnytimeSettings((8, 16), 2, 2, AnswerFormat(summary_max_tokens=6), seed=0)
        runner = AnytimeRolloutRunner(engine, tok, scorer, settings)
        whole = runner.run(prompts, golds, seed=5)
        shard = runner.run(prompts[1::2], golds[1::2], seed=5, prompt_index=[1, 3])  # worker 2 of 2
    for name in ("think_ids", "think_len", "cut", "summary_ids", "summary_len", "scores"):
        a, b = getattr(whole, name)[1::2], getattr(shard, name)
        width = min(a.shape[-1], b.shape[-1])  # padded widths follow the longest in each call
        assert torch.equal(a[..., :width], b[..., :width]) and not a[..., width:].any() and not b[..., width:].any(), name
