"""The step's experience stage (`anytime.trainer.experience`): advantages per group by the recipe's
estimators, their spread over tokens with the loss weights, the rows of the kept groups under their step
positions, the step's typed sums (`anytime.batch.step_sums.StepSums`), and the importance correction
once the old log-probs are in."""

from __future__ import annotations

import pytest
import torch

from anytime.algo.advantages import summary_advantages_by_name, thinking_advantages
from anytime.batch.anytime_rollout import Draw, ScoredRollout, rollout_sums
from anytime.batch.step_sums import StepSums
from anytime.config import load_recipe
from anytime.rollout.workers.inflight import version_sums
from anytime.trainer.experience import (experience, group_advantages, importance_correction, loss_width,
                                        segment_index, token_advantages)
from anytime.trainer.metrics import StageTimer
from tests.helpers import QUICKSTART
from tests.rollout.test_dynamic_sampling import fake_rollout

pytestmark = pytest.mark.unit


def recipe(*overrides: str):
    return load_recipe(QUICKSTART, ["budget.budgets=[2,4]", "budget.max_thinking=4", "rollout.n=1", "summary.n=1",
                                    *overrides])


def rollout(golds=("a", "b", "c"), step_scores=((0, 1), (1, 1), (0, 0))):
    scores = torch.tensor(step_scores, dtype=torch.float32).view(len(golds), 1, 2, 1)
    return fake_rollout(list(golds), scores)


def test_group_advantages_are_the_recipes_estimators_own():
    r, ro = recipe("algorithm.estimator=brpo"), rollout()
    thinking, summary = group_advantages(ro, r)
    want = thinking_advantages("brpo", ro.budget_scores.double(), r.budget.prior_probs(), decay=r.algorithm.decay,
                               variant=r.algorithm.variance_reduction)
    assert torch.equal(thinking, want)
    assert torch.equal(summary, summary_advantages_by_name(r.summary.estimator, ro.scores.double(), ro.prefix_group))


def test_each_thinking_token_takes_its_segments_advantage_times_the_loss_weights():
    ro = rollout()
    thinking = torch.tensor([[[0.5, -0.25]], [[1.0, 2.0]], [[0.0, 3.0]]], dtype=torch.float64)
    summary = torch.ones(3, 1, 2, 1, dtype=torch.float64)
    tokens, summaries = token_advantages(ro, thinking, summary, thinking_weight=2.0, summary_weight=0.5)
    # 4 thinking tokens, budgets 2 and 4: tokens 1-2 are segment 0, tokens 3-4 segment 1
    assert segment_index(4, ro.budgets).tolist() == [0, 0, 1, 1]
    assert tokens[0, 0].tolist() == [1.0, 1.0, -0.5, -0.5] and tokens[2, 0].tolist() == [0.0, 0.0, 6.0, 6.0]
    assert torch.equal(summaries, torch.full((3, 1, 2, 1), 0.5, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"thinking advantages must be \[B, G, S\]"):
        token_advantages(ro, thinking[:, :, :1], summary)


def test_the_constant_normalisers_width_is_the_last_budget_and_every_summarys_room():
    ro = rollout()   # a real cut somewhere: close (1 token) + header (1 token) inserted
    assert loss_width(ro, summary_max_tokens=5) == 4 + 2 * 1 * (1 + 1 + 5)


def test_experience_trains_the_kept_groups_and_counts_every_group_drawn():
    """Two draws of one worker (dynamic sampling kept group 0 of the first and group 0 of the second):
    rows only of the kept groups, under the slots they fill; advantage sums over every group drawn."""
    r = recipe("rollout.prompts_per_step=4")
    first, second = rollout(), rollout(golds=("d",), step_scores=((1, 0),))
    sums = rollout_sums(first) + rollout_sums(second)
    share = ScoredRollout([Draw(first, [0], [2]), Draw(second, [0], [0])], 4, sums, {"gen": 1.0})
    timer = StageTimer()
    exp = experience([share], r, pad_id=0, timer=timer)
    assert set(timer.times) == {"adv", "pack", "scatter"}
    assert sorted(set(exp.batch.prompt_index.tolist())) == [0, 2]   # the slots the kept groups fill
    assert exp.batch.tokens_per_prompt.tolist()[1] == 0 and exp.batch.tokens_per_prompt.tolist()[3] == 0
    t1, _ = group_advantages(first, r)
    t2, _ = group_advantages(second, r)
    assert exp.sums.thinking_adv_n == t1.numel() + t2.numel()   # every group drawn, kept or not
    assert exp.sums.thinking_adv == pytest.approx(float(t1.sum() + t2.sum()))
    assert exp.sums.rows == float(exp.batch.sequences.sum()) and exp.timings == [{"gen": 1.0}]
    metrics = exp.sums.metrics(r.budget.grid())
    assert metrics["train/rows"] == int(exp.sums.rows) and "adv/thinking_abs" in metrics


def test_step_sums_add_keep_the_maximum_and_travel_in_the_flat_form_earlier_versions_saved():
    a = StepSums(traces=2, acc=[1.0, 2.0], reasons={"correct": 3.0}, token_lag=4, token_lag_n=2, token_lag_max=2)
    b = StepSums(traces=1, acc=[0.5, 0.5], reasons={"wrong": 1.0}, token_lag=1, token_lag_n=1, token_lag_max=1)
    total = a + b
    assert (total.traces, total.acc, total.reasons) == (3, [1.5, 2.5], {"correct": 3.0, "wrong": 1.0})
    assert (total.token_lag, total.token_lag_max) == (5, 2)   # a sum, and the largest
    assert StepSums.from_dict(total.to_dict()) == total
    older = {"acc_sum/0": 1.0, "acc_sum/1": 2.0, "summaries_per_budget": 4.0, "traces": 2.0, "think_len_sum": 8.0,
             "closed_sum": 1.0, "tokens": 12.0, "reason/correct": 3.0, "max/token_lag": 1.0, "t_adv_n": 4.0}
    loaded = StepSums.from_dict(older)
    assert (loaded.acc, loaded.think_len, loaded.closed, loaded.reasons, loaded.token_lag_max, loaded.thinking_adv_n) \
        == ([1.0, 2.0], 8.0, 1.0, {"correct": 3.0}, 1.0, 4.0)


def test_every_token_records_its_weight_version_so_the_lag_comes_from_the_data():
    """Round 6: a locked rollout's tokens carry the version the engine held (set by every sync), an
    in-flight one's their own; the one lag metric reads them."""
    ro = rollout()
    ro.think_versions = torch.full(ro.think_ids.shape, 3, dtype=torch.long)
    ro.summary_versions = torch.full(ro.summary_ids.shape, 3, dtype=torch.long)
    lag = version_sums(ro, step=4)
    assert lag.token_lag / lag.token_lag_n == 1.0 and lag.token_lag_max == 1.0 and lag.mixed_version_traces == 0
    metrics = (rollout_sums(ro) + lag + StepSums(thinking_adv_n=1, summary_adv_n=1)).metrics(ro.budgets)
    assert metrics["rollout/token_version_lag"] == 1.0 and metrics["rollout/token_version_lag_max"] == 1.0


def test_the_importance_correction_weights_the_advantages_only_when_asked():
    r = recipe()
    share = ScoredRollout([Draw(rollout(), [0, 1, 2], [0, 1, 2])], 3, rollout_sums(rollout()), {})
    batch = experience([share], r, pad_id=0).batch
    before = batch.advantages.clone()
    batch.old_logprobs = batch.rollout_logprobs + 0.1 * batch.loss_mask   # the learner a little above the engine
    assert importance_correction(batch, r) == {} and torch.equal(batch.advantages, before)
    tis = recipe("algorithm.offpolicy_correction=tis", "algorithm.is_cap=2.0")
    stats = importance_correction(batch, tis)
    assert stats["offpolicy/is_weight_mean"] == pytest.approx(float(torch.exp(torch.tensor(0.1))), rel=1e-5)
    trained = batch.loss_mask
    assert torch.allclose(batch.advantages[trained], before[trained] * torch.exp(torch.tensor(0.1)))
