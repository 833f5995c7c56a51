"""The anytime rollout on a real transformers engine: summary prompts are exactly
prompt + thinking[:b] + close + header, budgets past a trace's end share one prompt, scores
have shape [B, G, S, A]."""

import pytest
from transformers import AutoTokenizer

from anytime.config.answer_format import AnswerFormat
from anytime.data.prompts import render_prompt
from anytime.reward.verifier import RewardScorer
from anytime.rollout.engines.engine import Completion, RolloutEngine, create_engine
from anytime.rollout.runner import AnytimeRolloutRunner
from anytime.rollout.settings import AnytimeSettings

pytestmark = pytest.mark.integration


class RecordingEngine(RolloutEngine):
    """A real engine behind the default (two-phase) `generate_anytime`; records the branch prompts."""

    def __init__(self, engine):
        self.engine = engine
        self.max_model_len, self.max_prompt_len = engine.max_model_len, engine.max_prompt_len
        self.vocab_size, self._weight_shapes = engine.vocab_size, engine._weight_shapes
        self.branch_prompts = []

    def _generate(self, prompts, params):
        return self.engine.generate(prompts, params)

    def _generate_branches(self, prefixes, branches, params):
        self.branch_prompts = [[list(p[: b.cut]) + list(b.suffix) for b in bs] for p, bs in zip(prefixes, branches)]
        return self.engine.generate_branches(prefixes, branches, params)

    def _load_weights(self, updates):
        self.engine.update_weights(updates)

    def close(self):
        pass


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    with create_engine("hf", tiny_model_dir, max_model_len=256, max_prompt_len=128) as engine, \
            RewardScorer(num_workers=1) as scorer:
        yield tok, RecordingEngine(engine), scorer


def test_summary_prompts_token_for_token(setup):
    tok, engine, scorer = setup
    settings = AnytimeSettings((8, 16, 24), traces_per_prompt=2, summaries_per_budget=3,
                               format=AnswerFormat(summary_max_tokens=6), temperature=1.0, seed=3)
    runner = AnytimeRolloutRunner(engine, tok, scorer, settings)
    prompts = [render_prompt(tok, "Start with 1. Add 2, add 3. What is the last digit of the result?"),
               render_prompt(tok, "Start with 4. Add 5. What is the last digit of the result?")]
    out = runner.run(prompts, ["6", "9"])
    assert out.scores.shape == (2, 2, 3, 3)
    assert out.prefix_group.shape == (2, 2, 3)
    close = tok(settings.format.close_text, add_special_tokens=False)["input_ids"]
    header = tok(settings.format.header, add_special_tokens=False)["input_ids"]
    k = 0
    for b, prompt in enumerate(prompts):
        assert out.prompt_ids[b, : out.prompt_len[b]].tolist() == prompt
        for g in range(2):
            n = int(out.think_len[b, g])
            trace = out.think_ids[b, g, :n].tolist()
            assert n <= 24 and not out.think_ids[b, g, n:].any()
            natural, eos = bool(out.natural_end[b, g]), bool(out.eos_end[b, g])
            for j, budget in enumerate(out.budgets):
                if natural and n <= budget:
                    expected = prompt + trace + header
                else:  # cut (an EOS that stopped the trace is dropped, and the cut is scored 0)
                    expected = prompt + trace[:min(budget, n - (1 if eos else 0))] + close + header
                assert engine.branch_prompts[k][j] == expected
                assert out.inserted_ids(b, g, j) == expected[len(prompt) + int(out.cut[b, g, j]):]
                for a in range(3):
                    assert 1 <= out.summary_len[b, g, j, a] <= 6
                    if eos and out.cut[b, g, j] >= n - 1:
                        assert out.scores[b, g, j, a] == 0.0
            k += 1
    assert set(out.failure_reasons()) <= {"correct", "wrong", "no_answer", "bad_format", "timeout", "error"}
    assert sum(out.failure_reasons().values()) == len(out.texts) == len(out.answers) == 2 * 2 * 3 * 3
    assert set(out.timings) == {"gen", "summaries", "reward"}
    assert 0.0 <= out.budget_scores.min() and out.budget_scores.max() <= 1.0


def test_traces_that_end_early_share_one_summary_prompt(setup):
    tok, engine, scorer = setup
    settings = AnytimeSettings((4, 8, 12, 16), 1, 2, AnswerFormat(summary_max_tokens=4))
    runner = AnytimeRolloutRunner(engine, tok, scorer, settings)
    branches, groups = runner.summary_plan(6, True, False, [4, 8, 12, 16])  # 6 tokens, the last </think>
    assert groups == [0, 1, 1, 1]
    assert branches[0].cut == 4 and list(branches[0].suffix) == runner.close_ids + runner.header_ids
    assert all(br.cut == 6 and list(br.suffix) == runner.header_ids for br in branches[1:])
    branches, groups = runner.summary_plan(16, False, False, [4, 8, 12, 16])
    assert groups == [0, 1, 2, 3] and [b.cut for b in branches] == [4, 8, 12, 16]
    branches, groups = runner.summary_plan(6, False, True, [4, 8, 12, 16])  # stopped on EOS at token 6
    assert [b.cut for b in branches] == [4, 5, 5, 5] and groups == [0, 1, 1, 1]


def test_budget_past_the_engine_length_fails_before_generation(setup):
    tok, engine, scorer = setup
    eight = AnswerFormat(summary_max_tokens=8)
    with pytest.raises(ValueError, match="max model length 256"):
        AnytimeRolloutRunner(engine, tok, scorer, AnytimeSettings((100, 250), 1, 1, eight))
    with pytest.raises(ValueError, match="strictly increasing"):
        AnytimeRolloutRunner(engine, tok, scorer, AnytimeSettings((16, 8), 1, 1, eight))
    thought = AnswerFormat(think_end="</thought>", close_text="...\n\n...\n\n</thought>", summary_max_tokens=8)
    with pytest.raises(ValueError, match="must be one token"):
        AnytimeRolloutRunner(engine, tok, scorer, AnytimeSettings((8,), 1, 1, thought))


def test_summary_text_is_scored_for_natural_and_forced_ends(setup):
    tok, engine, scorer = setup
    runner = AnytimeRolloutRunner(engine, tok, scorer, AnytimeSettings((4, 16), 1, 1,
                                                                       AnswerFormat(summary_max_tokens=8)))
    answer = tok("\\boxed{7}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    length = len(tok("1: 3+4=7\n", add_special_tokens=False)["input_ids"]) + 1  # + its own </think>
    branches, _ = runner.summary_plan(length, True, False, [4, 16])
    texts = [runner.summary_text(br.cut == length, br, answer) for br in branches]
    assert texts[0].startswith("...\n\n...\n\n</think>") and texts[1].startswith("</think>\n\n**Final Answer**")
    assert [v.score for v in scorer.score(texts, ["7", "7"])] == [1.0, 1.0]
    twice = runner.summary_text(True, branches[1], tok("</think>\\boxed{7}", add_special_tokens=False)["input_ids"])
    assert scorer.score([twice], ["7"])[0].reason == "bad_format"  # a second </think> breaks the format rule


class ScriptedEngine(RecordingEngine):
    """Every trace is `trace`, every summary `summary`: what an instruct model that stops on EOS writes."""

    def __init__(self, engine, trace, summary):
        super().__init__(engine)
        self.trace, self.summary = trace, summary

    def _generate(self, prompts, params):
        return [[Completion(list(self.trace), [-0.5] * len(self.trace), "stop") for _ in range(params.n)]
                for _ in prompts]

    def _generate_branches(self, prefixes, branches, params):
        self.branch_prompts = [[list(p[: b.cut]) + list(b.suffix) for b in bs] for p, bs in zip(prefixes, branches)]
        return [[[Completion(list(self.summary), [-0.5] * len(self.summary), "stop") for _ in range(params.n)]
                 for _ in bs] for bs in branches]


@pytest.mark.parametrize("eos_ends_thinking", [False, True])
def test_an_instruct_models_eos_ends_its_thinking_only_when_asked(setup, eos_ends_thinking):
    """`summary.eos_ends_thinking`: a trace that stops on EOS gets its summary forced right before the
    EOS at every budget past it, and is scored; by default (thinking models) those budgets score 0."""
    tok, engine, scorer = setup
    words = tok("1: 3+4=7", add_special_tokens=False)["input_ids"][:3]
    trace = [*words, tok.eos_token_id]                    # stops on EOS after 3 tokens
    summary = tok("7}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    scripted = ScriptedEngine(engine, trace, summary)
    boxed = AnswerFormat(header="\n\n**Final Answer**\n\\boxed{", summary_max_tokens=6,
                         eos_ends_thinking=eos_ends_thinking)
    settings = AnytimeSettings((2, 8, 16), 1, 1, boxed)
    runner = AnytimeRolloutRunner(scripted, tok, scorer, settings)
    prompt = render_prompt(tok, "What is 3 + 4?")
    out = runner.run([prompt], ["7"])
    close, header = runner.close_ids, runner.header_ids
    assert scripted.branch_prompts[0] == [prompt + words[:2] + close + header] + [prompt + words + close + header] * 2
    assert out.prefix_group[0, 0].tolist() == [0, 1, 1]
    assert bool(out.natural_end[0, 0]) == eos_ends_thinking and bool(out.eos_end[0, 0]) != eos_ends_thinking
    assert out.scores[0, 0, 0, 0] == 1.0                  # budget 2: a real cut, scored either way
    past_the_end = out.scores[0, 0, 1:, 0].tolist()
    assert past_the_end == ([1.0, 1.0] if eos_ends_thinking else [0.0, 0.0])
