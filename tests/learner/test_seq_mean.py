"""The `seq-mean-token-mean` normaliser counts every sampled sequence, as GRPO's 1/G does (and verl
and TRL): zero-advantage rows dropped from the batch still count, so dropping changes no loss."""

import random

import pytest
import torch

from anytime.algo.loss import token_loss
from anytime.batch.anytime_rollout import AnytimeRollout, padded
from tests.helpers import train_rows
from anytime.config import AlgorithmConfig
from anytime.learner.ppo import loss_spec
from anytime.reward.verifier import REASONS

pytestmark = pytest.mark.unit

B, G, S, A = 3, 4, 2, 2
BUDGETS = [3, 6]


def _rollout(seed: int) -> AnytimeRollout:
    """B prompts × G traces of 2-8 thinking tokens, cut at BUDGETS, A summaries of 1-3 tokens each."""
    rng = random.Random(seed)
    think = [[10 + rng.randrange(20) for _ in range(rng.randint(2, 8))] for _ in range(B * G)]
    lengths = torch.tensor([len(t) for t in think]).view(B, G)
    summaries = [[50 + rng.randrange(9) for _ in range(rng.randint(1, 3))] for _ in range(B * G * S * A)]
    cut = torch.minimum(torch.tensor(BUDGETS).view(1, 1, S), lengths[..., None])
    return AnytimeRollout(
        budgets=BUDGETS, golds=["1"] * B, prompt_ids=torch.tensor([[1, 2, 3]] * B), prompt_len=torch.full((B,), 3),
        think_ids=padded(think, torch.long, (B, G)),
        think_logprobs=padded([[-0.1] * len(t) for t in think], torch.float32, (B, G)),
        think_len=lengths, natural_end=torch.ones(B, G, dtype=torch.bool), eos_end=torch.zeros(B, G, dtype=torch.bool),
        cut=cut, forced_close=cut < lengths[..., None], prefix_group=torch.arange(S).expand(B, G, S).clone(),
        summary_ids=padded(summaries, torch.long, (B, G, S, A)),
        summary_logprobs=padded([[-0.5] * len(s) for s in summaries], torch.float32, (B, G, S, A)),
        summary_len=torch.tensor([len(s) for s in summaries]).view(B, G, S, A),
        scores=torch.zeros(B, G, S, A), reasons=torch.full((B, G, S, A), REASONS.index("correct")),
        answers=["1"] * (B * G * S * A), texts=["x"] * (B * G * S * A), close_ids=(90, 91), header_ids=(92,))


def _advantages(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages with many exact zeros: whole traces and summaries that the batch drops."""
    gen = torch.Generator().manual_seed(seed)
    t_adv = torch.randn(B, G, S, generator=gen, dtype=torch.float64)
    t_adv[torch.rand(B, G, generator=gen) < 0.5] = 0.0
    s_adv = torch.randn(B, G, S, A, generator=gen, dtype=torch.float64)
    s_adv[torch.rand(B, G, S, A, generator=gen) < 0.6] = 0.0
    return t_adv, s_adv


def grpo_seq_mean(rollout: AnytimeRollout, t_adv: torch.Tensor, s_adv: torch.Tensor) -> float:
    """The definition, from the rollout alone: (1/N) Σ_i (1/|o_i|) Σ_t −A_{i,t} over every sampled
    sequence i (each thinking trace, each summary), at ratio 1."""
    per_sequence = []
    for b in range(B):
        for g in range(G):
            n = int(rollout.think_len[b, g])
            segment = [min(j for j in range(S) if BUDGETS[j] >= t or j == S - 1) for t in range(1, n + 1)]
            per_sequence.append(sum(-float(t_adv[b, g, j]) for j in segment) / n)
            for j in range(S):
                for a in range(A):
                    per_sequence.append(-float(s_adv[b, g, j, a]))   # one value on every token
    return sum(per_sequence) / len(per_sequence)


def batch_loss(rollout: AnytimeRollout, t_adv: torch.Tensor, s_adv: torch.Tensor, *, pack: bool, drop: bool,
               dp_size: int = 1) -> float:
    """The loss of one mini-batch holding every prompt, summed over `dp_size` replicas' shares."""
    batch = train_rows(rollout, t_adv, s_adv, summary_max_tokens=3, drop_zero_rows=drop, pack=pack)
    algo = AlgorithmConfig(loss_agg="seq-mean-token-mean")
    total = 0.0
    for rank in range(dp_size):
        share = batch.shard(rank, dp_size)
        for mini in share.mini_batches(B, rank, dp_size):
            logprobs = mini.batch.old_logprobs.clone().requires_grad_()   # ratio 1
            loss, _ = token_loss(logprobs, None, mini.batch, loss_spec(algo, mini, share))
            total += float(loss)
    return total


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_seq_mean_counts_every_sampled_sequence(pack, seed):
    rollout, (t_adv, s_adv) = _rollout(seed), _advantages(seed)
    expected = grpo_seq_mean(rollout, t_adv, s_adv)
    dropped = train_rows(rollout, t_adv, s_adv, summary_max_tokens=3, pack=pack)
    assert int(dropped.sequences.sum()) < B * G * (1 + S * A)   # the case: rows really were dropped
    assert batch_loss(rollout, t_adv, s_adv, pack=pack, drop=True) == pytest.approx(expected, rel=1e-6, abs=1e-9)
    assert batch_loss(rollout, t_adv, s_adv, pack=pack, drop=False) == pytest.approx(expected, rel=1e-6, abs=1e-9)
    assert batch_loss(rollout, t_adv, s_adv, pack=pack, drop=True, dp_size=2) == pytest.approx(expected, rel=1e-6,
                                                                                               abs=1e-9)
