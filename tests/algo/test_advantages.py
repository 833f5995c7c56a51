import pytest
import torch

from anytime.algo.advantages import (
    THINKING_ESTIMATORS,
    brpo_advantages,
    grpo_advantages,
    returns_to_go,
    rloo_advantages,
    summary_advantages,
    summary_advantages_last_only,
    thinking_advantages,
)

pytestmark = pytest.mark.unit

R_EXAMPLE = torch.tensor([[0, 0.5, 1, 1], [0, 0, 0, 0.25]], dtype=torch.float64)
UNIFORM = [0.25] * 4


def test_worked_example_from_the_paper_brief():
    R = returns_to_go(R_EXAMPLE, torch.tensor(UNIFORM, dtype=torch.float64))
    assert torch.allclose(R, torch.tensor([[.625, .625, .5, .25], [.0625] * 4], dtype=torch.float64))
    adv = brpo_advantages(R_EXAMPLE, UNIFORM)
    expected = torch.tensor([[.2812, .3672, .2760, .0770], [-.2812, -.1953, -.0781, .0234]], dtype=torch.float64)
    assert torch.allclose(adv, expected, atol=1e-4)


def test_brpo_batch_dimension_and_variants():
    batch = torch.stack([R_EXAMPLE, R_EXAMPLE.flip(0)])
    out = brpo_advantages(batch, UNIFORM)
    assert out.shape == (2, 2, 4)
    assert torch.allclose(out[1], brpo_advantages(R_EXAMPLE.flip(0), UNIFORM))
    R = returns_to_go(R_EXAMPLE, torch.tensor(UNIFORM, dtype=torch.float64))
    assert torch.allclose(brpo_advantages(R_EXAMPLE, UNIFORM, variant="none"), R)
    assert torch.allclose(brpo_advantages(R_EXAMPLE, UNIFORM, variant="v2only"), R - R.mean(0))
    # v1only: segment 2 of trace 0 → V1 = (0.5·0 + 1·0.5)/(0.5+1)... weights λ^{s-j}: j=0 → .25, j=1 → .5
    v1 = brpo_advantages(R_EXAMPLE, UNIFORM, variant="v1only")
    V1 = (0.25 * 0 + 0.5 * 0.5) / 0.75 * 0.5
    assert v1[0, 2].item() == pytest.approx(0.5 - V1)
    assert v1[0, 0].item() == pytest.approx(R[0, 0].item())  # V1 = 0 at the first segment


def test_brpo_decay_changes_only_v1():
    a = brpo_advantages(R_EXAMPLE, UNIFORM, decay=0.5)
    b = brpo_advantages(R_EXAMPLE, UNIFORM, decay=1.0)
    assert torch.allclose(a[:, :2], b[:, :2])  # segments 0 and 1 have at most one earlier score
    assert not torch.allclose(a[:, 2:], b[:, 2:])


def test_brpo_rejects_bad_input():
    with pytest.raises(ValueError, match="variance_reduction"):
        brpo_advantages(R_EXAMPLE, UNIFORM, variant="v3")
    with pytest.raises(ValueError, match="one entry per budget"):
        brpo_advantages(R_EXAMPLE, [0.5, 0.5])
    with pytest.raises(ValueError, match="shape"):
        brpo_advantages(torch.zeros(4), UNIFORM)


def test_summary_advantages_per_prefix_baseline():
    scores = torch.tensor([[[1, 0, 0, 1], [1, 1, 1, 1]], [[0, 0, 0, 0], [1, 0, 1, 1]]], dtype=torch.float64)
    adv = summary_advantages(scores)
    assert adv.shape == scores.shape
    assert torch.allclose(adv[0, 0], torch.tensor([.5, -.5, -.5, .5], dtype=torch.float64))
    assert torch.allclose(adv[0, 1], torch.zeros(4, dtype=torch.float64))
    assert torch.allclose(adv[1, 1], torch.tensor([.25, -.75, .25, .25], dtype=torch.float64))
    assert summary_advantages(scores[None]).shape == (1, 2, 2, 4)


def test_summary_advantages_shared_prefix_and_single_summary():
    # Budgets 1 and 2 of trace 0 share a prompt (trace ended before budget 1): one group of 4 summaries.
    scores = torch.tensor([[[1, 0], [1, 1], [0, 0]]], dtype=torch.float64)  # [G=1, S=3, A=2]
    groups = torch.tensor([[0, 1, 1]])
    adv = summary_advantages(scores, groups)
    assert torch.allclose(adv[0, 0], torch.tensor([.5, -.5], dtype=torch.float64))
    assert torch.allclose(adv[0, 1:], torch.tensor([[.5, .5], [-.5, -.5]], dtype=torch.float64))
    # A = 1 and no sharing: baseline over the G traces at the same budget.
    single = torch.tensor([[[1], [0]], [[0], [0]]], dtype=torch.float64)  # [G=2, S=2, A=1]
    assert torch.allclose(summary_advantages(single)[:, 0, 0], torch.tensor([.5, -.5], dtype=torch.float64))
    # A = 1: the same G-mean baseline whatever the prefix groups (the official code), not 0.
    groups = torch.tensor([[0, 1], [0, 0]])
    assert torch.allclose(summary_advantages(single, groups), summary_advantages(single))
    assert torch.allclose(summary_advantages(single, groups)[:, 1, 0], torch.zeros(2, dtype=torch.float64))


def test_summary_last_only():
    scores = torch.tensor([[[1.0], [1.0]], [[0.0], [0.0]]])
    adv = summary_advantages_last_only(scores)
    assert torch.allclose(adv[:, 0], torch.zeros(2, 1, dtype=adv.dtype))
    assert torch.allclose(adv[:, 1, 0], torch.tensor([0.5, -0.5], dtype=adv.dtype))


def test_grpo_rloo():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    assert torch.allclose(grpo_advantages(r, scale_by_std=False), torch.tensor([.5, -.5, -.5, .5]))
    std = r.std()
    assert torch.allclose(grpo_advantages(r), torch.tensor([.5, -.5, -.5, .5]) / (std + 1e-6))
    assert torch.allclose(rloo_advantages(r), torch.tensor([1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3]))
    assert grpo_advantages(torch.ones(2, 4)).abs().max() == 0
    with pytest.raises(ValueError, match="at least 2"):
        rloo_advantages(torch.ones(1))


def test_registry_trace_level_estimators_use_the_prior_weighted_return():
    probs = [0.0, 0.0, 0.0, 1.0]
    adv = thinking_advantages("dr_grpo", R_EXAMPLE, probs)
    assert torch.allclose(adv, torch.tensor([[.375] * 4, [-.375] * 4], dtype=torch.float64))
    for name in THINKING_ESTIMATORS.names():   # every registered estimator: [B, G, S] in, [B, G, S] out
        assert thinking_advantages(name, R_EXAMPLE[None], UNIFORM).shape == (1, *R_EXAMPLE.shape)
    assert torch.allclose(thinking_advantages("brpo", R_EXAMPLE, UNIFORM, variant="v2only"),
                          brpo_advantages(R_EXAMPLE, UNIFORM, variant="v2only"))
    with pytest.raises(ValueError, match="must be one of"):
        thinking_advantages("ppo", R_EXAMPLE, UNIFORM)
