import math

import pytest
import torch

from anytime.algo.logprobs import token_entropy, token_logprobs
from anytime.algo.loss import aggregate, kl_penalty, policy_loss

pytestmark = pytest.mark.unit


def test_aggregations():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert aggregate(x, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate(x, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(x, mask, "constant").item() == pytest.approx(10 / 6)
    assert aggregate(x, mask, "constant", num_rows=4, max_len=10).item() == pytest.approx(10 / 40)
    assert aggregate(x, mask, "token-mean", num_tokens=8).item() == pytest.approx(10 / 8)
    with pytest.raises(ValueError, match="must be one of"):
        aggregate(x, mask, "sum")


def test_seq_mean_over_the_sequences_of_packed_rows():
    """Both rows above packed into one row: the segment ids keep the two sequences' means apart."""
    x = torch.tensor([[9.0, 1.0, 2.0, 3.0, 7.0, 4.0]])
    mask = torch.tensor([[0, 1, 1, 1, 0, 1]])
    segments = torch.tensor([[0, 0, 0, 0, 5, 5]])
    assert aggregate(x, mask, "seq-mean-token-mean", segments=segments).item() == pytest.approx((2 + 4) / 2)
    assert aggregate(x, mask, "seq-mean-token-mean", segments=segments, num_rows=3).item() == pytest.approx(6 / 3)
    assert aggregate(x, mask, "seq-mean-token-mean").item() == pytest.approx(10 / 4)  # one sequence without them


def test_ppo_clip_higher():
    old = torch.zeros(1, 4)
    new = torch.log(torch.tensor([[0.5, 0.9, 1.1, 1.5]]))
    adv = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    mask = torch.ones(1, 4)
    loss, stats = policy_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # positive advantage: min(r·A, clip(r)·A) → 0.5, 0.9, 1.1, 1.28
    assert loss.item() == pytest.approx(-(0.5 + 0.9 + 1.1 + 1.28) / 4)
    assert stats["clip_frac"] == pytest.approx(0.25)
    loss_neg, stats_neg = policy_loss(new, old, -adv, mask, clip_low=0.2, clip_high=0.28)
    # negative advantage: max(-r·A..) → clip at 0.8 for r = 0.5, others unclipped
    assert loss_neg.item() == pytest.approx((0.8 + 0.9 + 1.1 + 1.5) / 4)
    assert stats_neg["clip_frac"] == pytest.approx(0.25)


def test_gradient_is_advantage_weighted_and_masked():
    logp = torch.zeros(2, 3, requires_grad=True)
    adv = torch.tensor([[1.0, -2.0, 3.0], [0.5, 0.5, 0.5]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss, _ = policy_loss(logp, torch.zeros(2, 3), adv, mask, agg="constant")
    loss.backward()
    assert torch.allclose(logp.grad, -(adv * mask) / 6)


def test_kl_and_entropy():
    lp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -2.0]])
    assert torch.allclose(kl_penalty(lp, ref, "k1"), torch.tensor([[0.5, 0.0]]))
    assert kl_penalty(lp, ref, "k3")[0, 0].item() == pytest.approx(math.exp(-0.5) + 0.5 - 1)
    loss, stats = policy_loss(lp, lp, torch.zeros(1, 2), torch.ones(1, 2), ref_logprobs=ref, kl_coef=0.1,
                              entropy=torch.tensor([[1.0, 3.0]]))
    assert loss.item() == pytest.approx(0.1 * (math.exp(-0.5) + 0.5 - 1) / 2)
    assert stats["entropy"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="kl_type. must be one of"):
        kl_penalty(lp, ref, "k2")


def test_token_logprobs_and_entropy():
    logits = torch.randn(2, 5, 11, dtype=torch.float64)
    labels = torch.randint(0, 11, (2, 5))
    expected = torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)
    assert torch.allclose(token_logprobs(logits, labels), expected)
    uniform = torch.zeros(1, 1, 8)
    assert token_entropy(uniform).item() == pytest.approx(math.log(8))
