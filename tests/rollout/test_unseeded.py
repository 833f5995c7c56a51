"""`rollout.seed_requests`: on (the default) every thinking request and summary branch carries its own
seed, so samples do not depend on placement; off, the rollout's sampling configs carry none (vLLM then
samples the batch from its own generator instead of one per request), the engines still run, the
held-out eval stays seeded, and Ray restarts, which promise the same samples, are refused."""

import dataclasses

import pytest
import torch
from transformers import AutoTokenizer

from anytime.config import load_recipe
from anytime.config.answer_format import AnswerFormat
from anytime.data.prompts import render_prompt
from anytime.evaluation.options import EvalOptions, recipe_options
from anytime.reward.verifier import RewardScorer
from anytime.rollout.engines.engine import SamplingConfig, create_engine
from anytime.rollout.runner import AnytimeRolloutRunner
from anytime.rollout.seeding import request_seeds
from anytime.rollout.settings import AnytimeSettings, sampling_configs, training_settings

BUDGETS = [100, 200]
SMALL = ["rollout.n=2", "summary.n=3", "budget.budgets=[100, 200]"]


def _configs(*overrides: str) -> tuple[SamplingConfig, SamplingConfig]:
    settings = training_settings(load_recipe(None, [*SMALL, *overrides]))
    return sampling_configs(settings, BUDGETS, seed=5, prompt_index=[3, 7], think_stop=(11, 2), eos_ids=(2,))


@pytest.mark.unit
def test_requests_are_seeded_by_default():
    thinking, summary = _configs()
    assert thinking.request_seeds == tuple(request_seeds(5, [3, 7]))      # from each prompt's global index
    assert summary.request_seeds == tuple(request_seeds(6, [(p * 2 + g) * 2 + j for p in (3, 7)
                                                             for g in range(2) for j in range(2)]))
    assert (thinking.n, summary.n, thinking.max_new_tokens, thinking.stop_token_ids) == (2, 3, 200, (11, 2))
    assert summary.stop_token_ids == (2,)


@pytest.mark.unit
def test_seed_requests_off_gives_sampling_configs_without_seeds():
    seeded = _configs()
    unseeded = _configs("rollout.seed_requests=false")
    for config, same, requests in zip(unseeded, seeded, (2, 2 * 2 * 2)):
        assert config.request_seeds is None and config.seed is None
        assert config.seeds_for(requests) is None          # the engines' "unseeded" case
        assert config == dataclasses.replace(same, request_seeds=None)   # nothing else changes


@pytest.mark.unit
def test_the_held_out_eval_stays_seeded():
    recipe = load_recipe(None, [*SMALL, "rollout.seed_requests=false"])
    assert not training_settings(recipe).seed_requests
    assert EvalOptions(**recipe_options(recipe)).settings(0).seed_requests


@pytest.mark.integration
@pytest.mark.vllm
def test_vllm_sampling_params_of_an_unseeded_request_carry_no_seed():
    pytest.importorskip("vllm")
    from vllm.sampling_params import SamplingType

    from anytime.rollout.engines.vllm.engine import VLLMEngine

    config = SamplingConfig(max_new_tokens=4, n=2, temperature=1.0)
    unseeded = VLLMEngine._sampling_params(config, None)
    # RANDOM, not RANDOM_SEED: vLLM makes no generator of the request's own (its per-request path)
    assert unseeded.seed is None and unseeded.sampling_type == SamplingType.RANDOM
    seeded = VLLMEngine._sampling_params(config, 17)
    assert seeded.seed == 17 and seeded.sampling_type == SamplingType.RANDOM_SEED


@pytest.mark.integration
def test_hf_engine_runs_an_unseeded_rollout_from_its_own_generator(tiny_model_dir, monkeypatch):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [render_prompt(tok, f"Start with {k}. Add 4. What is the last digit of the result?") for k in range(2)]
    golds = [str((k + 4) % 10) for k in range(2)]
    with create_engine("hf", tiny_model_dir, max_model_len=256, max_prompt_len=128, seed=0) as engine, \
            RewardScorer(num_workers=1) as scorer:
        seen = []
        generate_anytime = engine.generate_anytime

        def spy(prompts, thinking, plan, summary):
            seen.append((thinking, summary))
            return generate_anytime(prompts, thinking, plan, summary)

        monkeypatch.setattr(engine, "generate_anytime", spy)
        runs = {}
        for seeded in (True, False):
            settings = AnytimeSettings((8, 16), 2, 2, AnswerFormat(summary_max_tokens=6), temperature=1.0, seed=0,
                                       seed_requests=seeded)
            runner = AnytimeRolloutRunner(engine, tok, scorer, settings)
            runs[seeded] = [runner.run(prompts, golds, seed=5) for _ in range(2)]
    assert all(c.request_seeds is not None for c in seen[0] + seen[1])
    assert all(c.request_seeds is None and c.seed is None for c in seen[2] + seen[3])
    first, again = runs[False]
    assert first.scores.shape == (2, 2, 2, 2)
    assert torch.equal(runs[True][0].think_ids, runs[True][1].think_ids)   # seeded: the same samples again
    assert not torch.equal(first.think_ids, again.think_ids)               # unseeded: the generator moved on
