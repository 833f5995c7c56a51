"""The four corners where the official AnytimeReasoner code (sail-sg/AnytimeReasoner, brpo.py) is
the reference: the forced close text, traces that stop on EOS, A = 1 summary baselines, and the
constant normaliser's width. Each test is built on the worked case of the issue that found it."""

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from anytime import defaults
from anytime.algo.advantages import summary_advantages
from anytime.batch.train_batch import TrainBatch
from anytime.config import AlgorithmConfig, load_recipe
from anytime.config.answer_format import AnswerFormat
from anytime.learner.ppo import loss_spec
from anytime.reward.verifier import RewardScorer
from anytime.rollout.engines.engine import Completion, RolloutEngine
from anytime.rollout.runner import AnytimeRolloutRunner
from anytime.rollout.settings import AnytimeSettings


REPO = Path(__file__).resolve().parents[2]


class ScriptedEngine(RolloutEngine):
    """Returns given thinking traces and answers every summary request with the same tokens; records
    the summary prompts. A test double for the rollout logic around an engine, not an engine."""

    def __init__(self, traces: list[list[int]], summary: list[int], vocab_size: int):
        self.max_model_len, self.max_prompt_len, self.vocab_size = 512, None, vocab_size
        self._weight_shapes: dict = {}
        self.traces, self.summary, self.summary_prompts = traces, summary, []

    def _generate(self, prompts, params):
        return [[Completion(list(t), [-0.5] * len(t), "stop") for t in self.traces] for _ in prompts]

    def _generate_branches(self, prefixes, branches, params):
        self.summary_prompts = [[p[: b.cut] + list(b.suffix) for b in bs] for p, bs in zip(prefixes, branches)]
        return [[[Completion(list(self.summary), [-0.1] * len(self.summary), "stop")] * params.n for _ in bs]
                for bs in branches]

    def _load_weights(self, updates):
        pass

    def close(self):
        pass


@pytest.mark.unit
def test_close_text_is_the_official_one():
    assert defaults.CLOSE_TEXT == "...\n\n...\n\n</think>"
    for recipe in ("ar_uniform.yaml", "ar_base.yaml", "grpo.yaml", "ar_uniform_16k.yaml"):
        assert load_recipe(REPO / "recipes" / "paper" / recipe).summary.close_text == defaults.CLOSE_TEXT


@pytest.mark.integration
def test_a_trace_ending_in_eos_is_really_cut_below_its_length(tiny_model_dir):
    """Budgets {2, 4, 6}, trace [t, t, EOS]: budget 2 is a real truncation, scored as usual and its
    own prefix group; budgets 4 and 6 (≥ |z| = 3) score 0 and share a group."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    t = tok("1", add_special_tokens=False)["input_ids"][0]
    answer = tok("\\boxed{7}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    engine = ScriptedEngine([[t, t, tok.eos_token_id]], answer, len(tok))
    with RewardScorer(num_workers=1) as scorer:
        runner = AnytimeRolloutRunner(engine, tok, scorer, AnytimeSettings((2, 4, 6), 1, 2, AnswerFormat(summary_max_tokens=8)))
        out = runner.run([[1, 2, 3]], ["7"])
    assert out.eos_end.tolist() == [[True]]
    assert out.prefix_group.tolist() == [[[0, 1, 1]]]
    assert out.cut.tolist() == [[[2, 2, 2]]]
    assert out.scores[0, 0].tolist() == [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]
    close_header = tok(defaults.CLOSE_TEXT + defaults.HEADER, add_special_tokens=False)["input_ids"]
    assert engine.summary_prompts[0][0] == [1, 2, 3, t, t] + close_header  # z[:2] + the official close
    branches, groups = runner.summary_plan(3, False, True, [2, 4, 6])
    assert groups == [0, 1, 1] and [b.cut for b in branches] == [2, 2, 2]
    assert runner.summary_plan(3, False, False, [2, 4, 6])[1] == [0, 1, 1]  # no EOS: z[:3] at 4 and 6


@pytest.mark.unit
def test_one_summary_per_budget_uses_the_trace_mean_baseline():
    """A = 1: the baseline is the mean over the G traces at the same budget even where prefix groups
    say a summary is alone (before the fix it got baseline 0)."""
    scores = torch.tensor([[[1.0], [1.0]], [[0.0], [1.0]], [[0.0], [0.0]]], dtype=torch.float64)  # [G=3, S=2, A=1]
    groups = torch.tensor([[0, 1], [0, 1], [0, 0]])
    adv = summary_advantages(scores, groups)
    assert torch.allclose(adv[:, 0, 0], torch.tensor([2 / 3, -1 / 3, -1 / 3], dtype=torch.float64))
    assert torch.allclose(adv[:, 1, 0], torch.tensor([1 / 3, 1 / 3, -2 / 3], dtype=torch.float64))


@pytest.mark.unit
def test_constant_normaliser_width_is_a_recipe_field():
    batch = TrainBatch(torch.ones(1, 4, dtype=torch.long), torch.tensor([4]), torch.tensor([0]),
                       torch.ones(1, 3, dtype=torch.bool), torch.zeros(1, 3, dtype=torch.bool),
                       torch.zeros(1, 3, dtype=torch.bool), torch.ones(1, 3), torch.zeros(1, 3), torch.zeros(1, 3),
                       torch.tensor([3]), traces_per_prompt=8, max_len=123)
    mini = next(batch.mini_batches(1))
    assert loss_spec(AlgorithmConfig(loss_agg="constant"), mini, batch).max_len == 123  # derived per batch
    spec = loss_spec(AlgorithmConfig(loss_agg="constant", loss_norm_length=10176), mini, batch)
    assert (spec.max_len, spec.num_rows) == (10176, 8)
    assert load_recipe(REPO / "recipes" / "paper" / "ar_uniform.yaml").algorithm.loss_norm_length == 10176
    assert load_recipe(REPO / "recipes" / "quickstart.yaml").algorithm.loss_norm_length is None
    with pytest.raises(ValueError, match="loss_norm_length"):
        load_recipe(None, ["algorithm.loss_norm_length=0"])
