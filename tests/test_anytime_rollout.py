"""The anytime rollout on a real transformers engine: summary prompts are exactly
prompt + thinking[:b] + close + header, budgets past a trace's end share one prompt, scores
have shape [B, G, S, A]."""

import pytest
import torch
from transformers import AutoTokenizer

from anytime.data import render_prompt
from anytime.reward import RewardScorer
from anytime.rollout.anytime import AnytimeRolloutRunner, AnytimeSettings, Trace, token_id_of
from anytime.rollout.engine import create_engine


class RecordingEngine:
    """Delegates to a real engine and records the branch prompts it was asked for."""

    def __init__(self, engine):
        self.engine = engine
        self.max_model_len = engine.max_model_len
        self.branch_prompts = []

    def generate(self, prompts, params):
        return self.engine.generate(prompts, params)

    def generate_branches(self, prefixes, branches, params):
        self.branch_prompts = [[list(p[: b.cut]) + list(b.suffix) for b in bs] for p, bs in zip(prefixes, branches)]
        return self.engine.generate_branches(prefixes, branches, params)


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    with create_engine("hf", tiny_model_dir, max_model_len=256, max_prompt_len=128) as engine, \
            RewardScorer(num_workers=1) as scorer:
        yield tok, RecordingEngine(engine), scorer


def test_summary_prompts_token_for_token(setup):
    tok, engine, scorer = setup
    settings = AnytimeSettings((8, 16, 24), traces_per_prompt=2, summaries_per_budget=3, summary_max_tokens=6,
                               temperature=1.0, seed=3)
    runner = AnytimeRolloutRunner(engine, tok, scorer, settings)
    prompts = [render_prompt(tok, "Start with 1. Add 2, add 3. What is the last digit of the result?"),
               render_prompt(tok, "Start with 4. Add 5. What is the last digit of the result?")]
    out = runner.run(prompts, ["6", "9"])
    assert out.scores.shape == (2, 2, 3, 3)
    assert out.prefix_group.shape == (2, 2, 3)
    close = tok(settings.close_text, add_special_tokens=False)["input_ids"]
    header = tok(settings.header, add_special_tokens=False)["input_ids"]
    k = 0
    for b, prompt in enumerate(prompts):
        for g, trace in enumerate(out.traces[b]):
            assert len(trace.token_ids) <= 24 and len(trace.logprobs) == len(trace.token_ids)
            for j, budget in enumerate(out.budgets):
                if trace.natural_end and len(trace.token_ids) <= budget:
                    expected = prompt + trace.token_ids + header
                else:  # cut (an EOS that stopped the trace is dropped, and the cut is scored 0)
                    content = len(trace.token_ids) - (1 if trace.eos_end else 0)
                    expected = prompt + trace.token_ids[:min(budget, content)] + close + header
                assert engine.branch_prompts[k][j] == expected
                for s in out.summaries[b][g][j]:
                    assert s.inserted_ids == expected[len(prompt) + s.cut:]
                    assert s.verdict.reason in ("correct", "wrong", "no_answer", "bad_format", "timeout", "error")
                    assert len(s.token_ids) <= 6
                    if trace.eos_end and s.cut >= len(trace.token_ids) - 1:
                        assert s.verdict.score == 0.0
            k += 1
    assert set(out.timings) == {"gen", "summaries", "reward"}
    assert 0.0 <= out.budget_scores.min() and out.budget_scores.max() <= 1.0


def test_traces_that_end_early_share_one_summary_prompt(setup):
    tok, engine, scorer = setup
    runner = AnytimeRolloutRunner(engine, tok, scorer, AnytimeSettings((4, 8, 12, 16), 1, 2, 4))
    end = token_id_of(tok, "</think>")
    trace = Trace([20, 21, 22, 23, 24, end], [0.0] * 6, natural_end=True)
    branches, groups = runner.summary_plan(trace, [4, 8, 12, 16])
    assert groups == [0, 1, 1, 1]
    assert branches[0].cut == 4 and list(branches[0].suffix) == runner.close_ids + runner.header_ids
    assert all(br.cut == 6 and list(br.suffix) == runner.header_ids for br in branches[1:])
    cut_trace = Trace([20] * 16, [0.0] * 16, natural_end=False)
    branches, groups = runner.summary_plan(cut_trace, [4, 8, 12, 16])
    assert groups == [0, 1, 2, 3] and [b.cut for b in branches] == [4, 8, 12, 16]


def test_budget_past_the_engine_length_fails_before_generation(setup):
    tok, engine, scorer = setup
    with pytest.raises(ValueError, match="max model length 256"):
        AnytimeRolloutRunner(engine, tok, scorer, AnytimeSettings((100, 250), 1, 1, 8))
    with pytest.raises(ValueError, match="strictly increasing"):
        AnytimeRolloutRunner(engine, tok, scorer, AnytimeSettings((16, 8), 1, 1, 8))
    with pytest.raises(ValueError, match="must be one token"):
        AnytimeRolloutRunner(engine, tok, scorer, AnytimeSettings((8,), 1, 1, 8, think_end="</thought>"))


def test_summary_text_is_scored_for_natural_and_forced_ends(setup):
    tok, engine, scorer = setup
    runner = AnytimeRolloutRunner(engine, tok, scorer, AnytimeSettings((4, 16), 1, 1, 8))
    end = token_id_of(tok, "</think>")
    answer = tok("\\boxed{7}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    natural = Trace(tok("1: 3+4=7\n", add_special_tokens=False)["input_ids"] + [end], [0.0] * 10, natural_end=True)
    branches, _ = runner.summary_plan(natural, [4, 16])
    texts = [runner.summary_text(natural, br, answer) for br in branches]
    assert texts[0].startswith("\n\n...\n\n</think>") and texts[1].startswith("</think>\n\n**Final Answer**")
    assert [v.score for v in scorer.score(texts, ["7", "7"])] == [1.0, 1.0]
    twice = runner.summary_text(natural, branches[1], tok("</think>\\boxed{7}", add_special_tokens=False)["input_ids"])
    assert scorer.score([twice], ["7"])[0].reason == "bad_format"  # a second </think> breaks the format rule
