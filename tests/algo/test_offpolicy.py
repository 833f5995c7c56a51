"""The decoupled off-policy correction: importance weights π_prox/π_behav folded into the advantages
(none / tis / mis, per token or per sampled sequence), their statistics, the recipe keys, and a tiny
run that logs them."""

import math
import random

import pytest
import torch

from anytime.algo.offpolicy import OFFPOLICY_CORRECTIONS
from anytime.algo.loss import LossSpec, policy_loss, token_loss
from anytime.algo.offpolicy import (
    IS_LEVELS,
    apply_offpolicy_correction,
    importance_weights,
    summarize,
    weights_and_sums,
)
from anytime.batch.anytime_rollout import AnytimeRollout, padded
from tests.helpers import train_rows
from anytime.batch.train_batch import TrainBatch
from anytime.reward.verifier import REASONS

B, G, S, A = 2, 3, 2, 2
BUDGETS = [3, 6]
MODES = OFFPOLICY_CORRECTIONS.names()


def _rollout(seed: int) -> AnytimeRollout:
    """B prompts × G traces of 2-8 thinking tokens cut at BUDGETS, A summaries of 1-3 tokens, with
    random engine log-probs."""
    rng = random.Random(seed)
    think = [[10 + rng.randrange(20) for _ in range(rng.randint(2, 8))] for _ in range(B * G)]
    lengths = torch.tensor([len(t) for t in think]).view(B, G)
    summaries = [[50 + rng.randrange(9) for _ in range(rng.randint(1, 3))] for _ in range(B * G * S * A)]
    cut = torch.minimum(torch.tensor(BUDGETS).view(1, 1, S), lengths[..., None])
    return AnytimeRollout(
        budgets=BUDGETS, golds=["1"] * B, prompt_ids=torch.tensor([[1, 2, 3]] * B), prompt_len=torch.full((B,), 3),
        think_ids=padded(think, torch.long, (B, G)),
        think_logprobs=padded([[-rng.random() for _ in t] for t in think], torch.float32, (B, G)),
        think_len=lengths, natural_end=torch.ones(B, G, dtype=torch.bool), eos_end=torch.zeros(B, G, dtype=torch.bool),
        cut=cut, forced_close=cut < lengths[..., None], prefix_group=torch.arange(S).expand(B, G, S).clone(),
        summary_ids=padded(summaries, torch.long, (B, G, S, A)),
        summary_logprobs=padded([[-rng.random() for _ in s] for s in summaries], torch.float32, (B, G, S, A)),
        summary_len=torch.tensor([len(s) for s in summaries]).view(B, G, S, A),
        scores=torch.zeros(B, G, S, A), reasons=torch.full((B, G, S, A), REASONS.index("correct")),
        answers=["1"] * (B * G * S * A), texts=["x"] * (B * G * S * A), close_ids=(90, 91), header_ids=(92,))


def layouts(seed: int = 0, noise: float = 0.3) -> tuple[TrainBatch, TrainBatch]:
    """The row-per-summary and tree-packed batches of one rollout (some sequences dropped for a zero
    advantage), with learner log-probs = engine log-probs + the same noise on the same trained token."""
    rollout, gen = _rollout(seed), torch.Generator().manual_seed(seed)
    t_adv = torch.randn(B, G, S, generator=gen, dtype=torch.float64)
    s_adv = torch.randn(B, G, S, A, generator=gen, dtype=torch.float64)
    t_adv[0, 0], s_adv[1, 2, 0] = 0.0, 0.0
    batches = tuple(train_rows(rollout, t_adv, s_adv, summary_max_tokens=3, pack=pack) for pack in (False, True))
    shift = noise * torch.randn(int(batches[0].loss_mask.sum()), generator=gen)
    for batch in batches:  # both layouts hold the trained tokens in the same order
        batch.old_logprobs = batch.rollout_logprobs.clone()
        batch.old_logprobs[batch.loss_mask] += shift
    return batches


@pytest.mark.unit
def test_the_layouts_hold_several_sequences_per_packed_row():
    rows, packed = layouts()
    assert rows.segments is None and packed.segments is not None
    assert int(packed.sequences.max()) > 1 and int(rows.sequences.max()) == 1
    assert torch.equal(rows.rollout_logprobs[rows.loss_mask], packed.rollout_logprobs[packed.loss_mask])


@pytest.mark.unit
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("level", IS_LEVELS)
def test_on_policy_samples_change_no_loss_or_gradient(mode, level):
    """Behaviour = proximal: every weight is exactly 1 and the loss and its gradient are bit-equal."""
    for batch in layouts(noise=0.0):
        assert torch.equal(batch.old_logprobs, batch.rollout_logprobs)
        gen = torch.Generator().manual_seed(1)
        new = batch.old_logprobs + 0.1 * torch.randn(batch.old_logprobs.shape, generator=gen)
        before = batch.advantages.clone()
        for agg in ("token-mean", "seq-mean-token-mean", "constant"):
            spec = LossSpec(agg, clip_high=0.28)
            grads, losses = [], []
            for corrected in (False, True):
                if corrected:
                    stats = apply_offpolicy_correction(batch, mode, level, cap=2.0)
                    assert (stats == {}) == (mode == "none")
                logprobs = new.clone().requires_grad_()
                loss, _ = token_loss(logprobs, None, batch, spec)
                loss.backward()
                losses.append(loss.detach())
                grads.append(logprobs.grad)
            assert torch.equal(losses[0], losses[1]) and torch.equal(grads[0], grads[1])
            assert torch.equal(batch.advantages, before)
        weights, stats = importance_weights(batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask,
                                            batch.segments, mode, level, math.inf)
        assert torch.equal(weights, torch.ones_like(weights))
        assert stats == {"is_weight_mean": 1.0, "is_weight_max": 1.0, "is_clipped_frac": 0.0, "is_ess": 1.0}


def _per_row_log_ratio(batch: TrainBatch) -> torch.Tensor:
    """Each trained token's sequence log-weight, summed row by row (a row is one sequence here)."""
    out = torch.zeros(batch.advantages.shape, dtype=torch.float64)
    for r in range(len(batch)):
        m = batch.loss_mask[r]
        out[r, m] = float((batch.old_logprobs[r, m].double() - batch.rollout_logprobs[r, m].double()).sum())
    return out


@pytest.mark.unit
def test_tis_without_a_cap_is_the_plain_importance_weight():
    rows, packed = layouts()
    for batch in (rows, packed):
        m = batch.loss_mask
        w, _ = importance_weights(batch.old_logprobs, batch.rollout_logprobs, m, batch.segments, "tis", "token",
                                  math.inf)
        assert torch.equal(w[m], torch.exp(batch.old_logprobs.double() - batch.rollout_logprobs.double()).float()[m])
        assert torch.equal(w[~m], torch.ones_like(w[~m]))
    sequence_weights = []
    for batch in (rows, packed):
        w, _ = importance_weights(batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask, batch.segments, "tis",
                                  "sequence", math.inf)
        sequence_weights.append(w[batch.loss_mask])
    # the row-per-summary rows are one sequence each: exp of the row's sum ...
    assert torch.allclose(sequence_weights[0], torch.exp(_per_row_log_ratio(rows)).float()[rows.loss_mask],
                          rtol=1e-6, atol=0)
    # ... and the packed rows' segments give every trained token the same sequence weight
    assert torch.allclose(sequence_weights[1], sequence_weights[0], rtol=1e-6, atol=0)
    assert len(set(sequence_weights[0].tolist())) > 2


@pytest.mark.unit
@pytest.mark.parametrize("mode,level", [("tis", "sequence"), ("mis", "sequence"), ("mis", "token")])
def test_both_layouts_get_the_same_corrected_advantages(mode, level):
    rows, packed = layouts(seed=3)
    stats = [apply_offpolicy_correction(b, mode, level, cap=1.3) for b in (rows, packed)]
    assert torch.allclose(rows.advantages[rows.loss_mask], packed.advantages[packed.loss_mask], rtol=1e-6, atol=0)
    assert stats[0] == pytest.approx(stats[1], rel=1e-9)
    assert 0 < stats[0]["is_clipped_frac"] < 1  # the cap really cuts some of them
    if mode == "mis":
        assert (rows.advantages[rows.loss_mask] == 0).any()


# --- small examples by hand ----------------------------------------------------------------------

RAW = [0.5, 1.5, 3.0, 10.0]


def _token_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw weights RAW on the trained tokens; huge ratios on two untrained ones."""
    old = torch.log(torch.tensor([[0.5, 1.5, 1e6, 3.0], [10.0, 1e-6, 1.0, 1.0]], dtype=torch.float64)).float()
    mask = torch.tensor([[True, True, False, True], [True, False, False, False]])
    return old, torch.zeros_like(old), mask


@pytest.mark.unit
def test_tis_truncates_and_mis_masks_tokens_above_the_cap():
    old, rollout, mask = _token_case()
    for mode, want in (("none", [1, 1, 1, 1]), ("tis", [0.5, 1.5, 2.0, 2.0]), ("mis", [0.5, 1.5, 0.0, 0.0])):
        w, stats = importance_weights(old, rollout, mask, None, mode, "token", 2.0)
        assert w[mask].tolist() == pytest.approx(want, rel=1e-6), mode
        assert w[~mask].tolist() == [1.0] * 4  # untrained tokens: untouched, whatever their ratio
        n, total, squares = 4, sum(RAW), sum(x * x for x in RAW)
        assert stats["is_weight_mean"] == pytest.approx(total / n, rel=1e-6)   # raw weights, before the cap
        assert stats["is_weight_max"] == pytest.approx(10.0, rel=1e-6)
        assert stats["is_ess"] == pytest.approx(total ** 2 / (n * squares), rel=1e-6)
        assert stats["is_clipped_frac"] == (0.0 if mode == "none" else 0.5)


@pytest.mark.unit
def test_sequence_level_uses_each_sequences_sum():
    """Row 0 packs a thinking trace (segment 0) and a summary branch (segment 5); row 1 is one
    sequence. Untrained tokens inside a sequence do not enter its sum."""
    log_ratio = torch.tensor([[9.0, 0.1, 0.2, 9.0, 9.0, 0.5, 0.4, -9.0],
                              [0.0, -0.2, -0.3, 9.0, 0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[False, True, True, False, False, True, True, False],
                         [False, True, True, False, False, False, False, False]])
    segments = torch.tensor([[0, 0, 0, 0, 5, 5, 5, 5], [0] * 8])
    rollout = -torch.rand(log_ratio.shape, generator=torch.Generator().manual_seed(0))
    old = rollout + log_ratio
    raw = [math.exp(0.3), math.exp(0.9), math.exp(-0.5)]   # thinking, summary, row 1
    assert raw[1] > 2.0 > raw[0] > 1 > raw[2]
    for mode, want in (("tis", [raw[0], 2.0, raw[2]]), ("mis", [raw[0], 0.0, raw[2]])):
        w, stats = importance_weights(old, rollout, mask, segments, mode, "sequence", 2.0)
        assert w[0, 1:3].tolist() == pytest.approx([want[0]] * 2, rel=1e-6)
        assert w[0, 5:7].tolist() == pytest.approx([want[1]] * 2, rel=1e-6)
        assert w[1, 1:3].tolist() == pytest.approx([want[2]] * 2, rel=1e-6)
        assert w[~mask].eq(1).all()
        assert stats["is_clipped_frac"] == pytest.approx(1 / 3)   # of sequences, not tokens
        assert stats["is_weight_mean"] == pytest.approx(sum(raw) / 3, rel=1e-6)
        assert stats["is_ess"] == pytest.approx(sum(raw) ** 2 / (3 * sum(x * x for x in raw)), rel=1e-6)
    # without segments a row is one sequence
    w, _ = importance_weights(old, rollout, mask, None, "tis", "sequence", math.inf)
    assert w[0, mask[0]].tolist() == pytest.approx([math.exp(1.2)] * 4, rel=1e-6)


@pytest.mark.unit
def test_a_sequence_weight_past_the_float_range():
    """exp(1000) is inf even in float64: tis still caps it, mis masks it, and the ESS stays finite."""
    old = torch.tensor([[1.0] * 1000 + [0.0, 0.0]])
    mask = torch.ones_like(old, dtype=torch.bool)
    segments = torch.tensor([[0] * 1000 + [7, 7]])
    for mode, want in (("tis", 2.0), ("mis", 0.0)):
        w, stats = importance_weights(old, torch.zeros_like(old), mask, segments, mode, "sequence", 2.0)
        assert w[0, 0] == want and w[0, -1] == 1.0
        assert stats["is_ess"] == pytest.approx(0.5) and stats["is_weight_max"] == math.inf


@pytest.mark.unit
def test_statistics_combine_across_ranks():
    """Two ranks' sums give the statistics of all their rows; ranks holding the same rows (pipeline
    stages) change nothing."""
    old, rollout, mask = _token_case()
    parts = [weights_and_sums(old[i:i + 1], rollout[i:i + 1], mask[i:i + 1], None, "mis", "token", 2.0)[1]
             for i in range(2)]
    whole = importance_weights(old, rollout, mask, None, "mis", "token", 2.0)[1]
    assert summarize(parts) == pytest.approx(whole, rel=1e-12)
    assert summarize(parts + parts) == pytest.approx(whole, rel=1e-12)
    empty = weights_and_sums(old[:0], rollout[:0], mask[:0], None, "mis", "token", 2.0)[1]
    assert summarize(parts + [empty]) == pytest.approx(whole, rel=1e-12)
    assert summarize([empty]) == {"is_weight_mean": 1.0, "is_weight_max": 1.0, "is_clipped_frac": 0.0, "is_ess": 1.0}


@pytest.mark.unit
def test_none_leaves_the_batch_untouched_and_an_unknown_level_is_refused():
    _, packed = layouts()
    advantages = packed.advantages
    assert apply_offpolicy_correction(packed, "none", "sequence", 0.5) == {}
    assert packed.advantages is advantages
    with pytest.raises(ValueError, match="level must be one of"):
        apply_offpolicy_correction(packed, "tis", "row", 2.0)


@pytest.mark.unit
def test_corrected_advantages_reach_the_loss():
    """The learner's loss of the corrected batch is the PPO loss with w·A."""
    _, packed = layouts(seed=1)
    w, _ = importance_weights(packed.old_logprobs, packed.rollout_logprobs, packed.loss_mask, packed.segments,
                              "tis", "token", 1.2)
    want, _ = policy_loss(packed.old_logprobs, packed.old_logprobs, packed.advantages * w, packed.loss_mask)
    apply_offpolicy_correction(packed, "tis", "token", 1.2)
    got, _ = token_loss(packed.old_logprobs, None, packed, LossSpec())
    assert torch.equal(got, want)


# --- the recipe ----------------------------------------------------------------------------------


# --- a tiny run ----------------------------------------------------------------------------------

@pytest.mark.e2e
def test_a_tiny_run_logs_the_offpolicy_statistics(tmp_path):
    from anytime.trainer.launch import launch_train
    from tests.helpers import QUICKSTART, read_metrics, tiny_overrides

    out = tmp_path / "run"
    assert launch_train(QUICKSTART, tiny_overrides(out, steps=1) + ["algorithm.offpolicy_correction=tis"]) == 0
    step = read_metrics(out)[1]
    stats = {k: v for k, v in step.items() if k.startswith("offpolicy/")}
    assert set(stats) == {f"offpolicy/is_{k}" for k in ("weight_mean", "weight_max", "clipped_frac", "ess")}
    assert all(math.isfinite(v) for v in stats.values())
    # lock-step on CPU: the engine's and the learner's numerics nearly agree
    assert 0.9 < stats["offpolicy/is_ess"] <= 1 + 1e-9
    assert stats["offpolicy/is_weight_mean"] == pytest.approx(1, abs=0.1)
    assert stats["offpolicy/is_weight_max"] >= stats["offpolicy/is_weight_mean"]
