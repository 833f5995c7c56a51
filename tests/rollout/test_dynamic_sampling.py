"""DAPO's dynamic sampling (`rollout.dynamic_sampling`): groups whose rewards are all equal are
dropped and their slots refilled from the next candidates; the draws are seeded so that draw 0 is
what a run without it samples; a worker's batch holds only mixed groups, under their slots."""

from __future__ import annotations

import pytest
import torch

from anytime.batch.anytime_rollout import AnytimeRollout, padded
from anytime.reward.verifier import REASONS, Verdict
from anytime.rollout.workers.dynamic_sampling import draw_mixed_groups, mixed_groups
from anytime.trainer.trainer import step_candidate_rows, step_row_indices


def fake_rollout(golds: list[str], scores: torch.Tensor) -> AnytimeRollout:
    """B prompts with G=1 trace, S=2 budgets, A=1 summary; `scores` [B, 1, 2, 1]."""
    B = len(golds)
    return AnytimeRollout(
        budgets=[2, 4], golds=list(golds), prompt_ids=torch.ones(B, 3, dtype=torch.long),
        prompt_len=torch.full((B,), 3), think_ids=torch.ones(B, 1, 4, dtype=torch.long),
        think_logprobs=torch.zeros(B, 1, 4), think_len=torch.full((B, 1), 4),
        natural_end=torch.zeros(B, 1, dtype=torch.bool), eos_end=torch.zeros(B, 1, dtype=torch.bool),
        cut=torch.tensor([[[2, 4]]] * B), forced_close=torch.ones(B, 1, 2, dtype=torch.bool),
        prefix_group=torch.tensor([[[0, 1]]] * B),
        summary_ids=padded([[5]] * (2 * B), torch.long, (B, 1, 2, 1)),
        summary_logprobs=padded([[-0.1]] * (2 * B), torch.float32, (B, 1, 2, 1)),
        summary_len=torch.ones(B, 1, 2, 1, dtype=torch.long), scores=scores,
        reasons=torch.zeros(B, 1, 2, 1, dtype=torch.long),
        answers=[f"{g}/{j}" for g in golds for j in range(2)], texts=[f"{g}/{j}" for g in golds for j in range(2)],
        close_ids=(9,), header_ids=(8,))


@pytest.mark.unit
def test_a_group_is_mixed_when_any_reward_differs_across_traces_budgets_or_summaries():
    scores = torch.zeros(4, 2, 3, 2)
    scores[1] = 1.0                  # all right: no signal
    scores[2, 0, 0, 1] = 1.0         # one summary of one cut differs
    scores[3, :, 2, :] = 1.0         # every trace right only at the last budget: BRPO's progress signal
    assert mixed_groups(scores).tolist() == [False, False, True, True]


@pytest.mark.unit
def test_select_prompts_keeps_those_groups_texts_and_answers_in_order():
    scores = torch.tensor([0.0, 1.0, 1.0]).view(3, 1, 1, 1).expand(3, 1, 2, 1).clone()
    rollout = fake_rollout(["a", "b", "c"], scores)
    part = rollout.select_prompts([2, 0])
    assert part.golds == ["c", "a"] and part.texts == ["c/0", "c/1", "a/0", "a/1"]
    assert part.scores[:, 0, 0, 0].tolist() == [1.0, 0.0] and part.think_ids.shape[0] == 2


@pytest.mark.unit
def test_draws_refill_only_unfilled_slots_with_their_next_candidate_and_seed_by_draw():
    # the gold decides the group's rewards: "m" mixed, "0" / "1" all equal
    calls = []

    def run(prompts, golds, seed_index):
        calls.append((list(prompts), list(seed_index)))
        rewards = {"m": [0.0, 1.0], "0": [0.0, 0.0], "1": [1.0, 1.0]}
        return fake_rollout(golds, torch.tensor([rewards[g] for g in golds]).view(len(golds), 1, 2, 1))

    candidates = [["p0", "q0", "r0"], ["p1", "q1", "r1"], ["p2", "q2", "r2"]]
    golds = [["m", "1", "m"], ["0", "1", "m"], ["0", "0", "1"]]
    draws = draw_mixed_groups(run, candidates, golds, index=[4, 5, 6], num_prompts=8, max_draws=3)
    assert calls == [(["p0", "p1", "p2"], [4, 5, 6]), (["q1", "q2"], [13, 14]), (["r1", "r2"], [21, 22])]
    assert draws.kept == [[0], [], [0]] and draws.kept_slots == [[4], [], [5]]
    for rollout, keep in zip(draws.drawn, draws.kept):   # no kept group has a single reward
        assert all(mixed_groups(rollout.scores)[keep].tolist())
    counts = draws.counts()
    assert (counts.dynamic_slots, counts.dynamic_drawn, counts.dynamic_kept) == (3.0, 7.0, 2.0)
    metrics = counts.dynamic_metrics()
    assert metrics["rollout/dynamic_dropped_frac"] == pytest.approx(5 / 7)
    assert metrics["rollout/dynamic_drawn_per_kept"] == pytest.approx(3.5)
    assert metrics["rollout/dynamic_unfilled_frac"] == pytest.approx(1 / 3)


@pytest.mark.unit
def test_draw_zero_is_the_plain_step_and_each_draw_takes_fresh_rows():
    for step in range(3):
        slots = step_candidate_rows(step, prompts_per_step=4, draws=3, num_rows=100)
        assert [c[0] for c in slots] == step_row_indices(step * 3, 4, 100)
        rows = [i for c in slots for i in c]
        assert len(set(rows)) == 12 and min(rows) == 12 * step
    assert step_candidate_rows(0, 2, 2, num_rows=3) == [[0, 2], [1, 0]]   # wraps around the data


class ScoreByGold:
    """A verifier that reads the gold only: "mixed" alternates 1, 0, ...; "wrong" is always 0."""

    def __init__(self) -> None:
        self.calls = 0

    def score(self, texts, golds):
        verdicts = []
        for gold in golds:
            self.calls += 1
            right = gold == "mixed" and self.calls % 2 == 0
            verdicts.append(Verdict(float(right), "correct" if right else "wrong", "x"))
        return verdicts

    def close(self) -> None:
        pass


@pytest.mark.integration
def test_a_worker_trains_only_mixed_groups_under_their_slots(tiny_model_dir):
    from transformers import AutoTokenizer

    from anytime.config import load_recipe
    from anytime.data.prompts import render_prompt
    from anytime.config.placement_plan import placement_plan
    from anytime.rollout.workers.worker import RolloutWorker
    from anytime.trainer.experience import experience
    from tests.helpers import QUICKSTART

    recipe = load_recipe(QUICKSTART, ["rollout.engine=hf", "rollout.n=2", "summary.n=1", "budget.budgets=[4,8]",
                                      "budget.max_thinking=8", "rollout.dynamic_sampling=true",
                                      "rollout.dynamic_sampling_max_draws=2"])
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    worker = RolloutWorker(recipe, placement_plan(recipe), tiny_model_dir, tok)
    worker.scorer.close()
    worker.runner.scorer = ScoreByGold()
    drawn = []
    run = worker.runner.run
    worker.runner.run = lambda *a, **k: drawn.append(run(*a, **k)) or drawn[-1]
    try:
        candidates = [[render_prompt(tok, f"Start with {s}{r}. Step 1: add 2.") for r in range(2)] for s in range(3)]
        golds = [["wrong", "wrong"], ["mixed", "wrong"], ["wrong", "mixed"]]
        exp = experience([worker.rollout(candidates, golds, step=0, prompt_index=[0, 1, 2], num_prompts=3)],
                         recipe, pad_id=0)
        batch = exp.batch
    finally:
        worker.close()
    assert [r.golds for r in drawn] == [["wrong", "mixed", "wrong"], ["wrong", "mixed"]]
    assert [mixed_groups(r.scores).tolist() for r in drawn] == [[False, True, False], [False, True]]
    trained = set(batch.prompt_index[batch.sequences > 0].tolist())
    assert trained == {1, 2}                      # slot 0 never got a mixed group: it trains nothing
    assert batch.tokens_per_prompt[0] == 0 and batch.tokens_per_prompt[1:].gt(0).all()
    metrics = exp.sums.metrics(recipe.budget.grid())
    assert metrics["rollout/dynamic_dropped_frac"] == pytest.approx(3 / 5)
    assert metrics["rollout/dynamic_drawn_per_kept"] == pytest.approx(2.5)
    assert metrics["rollout/dynamic_unfilled_frac"] == pytest.approx(1 / 3)
