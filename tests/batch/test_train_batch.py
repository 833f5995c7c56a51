"""The tensor TrainBatch: rows, masks and advantages built from an AnytimeRollout, target-aligned;
selection, padding rows, sharding by prompt, mini- and micro-batches, the tensor round trip."""

import pytest
import torch

from anytime.batch.anytime_rollout import AnytimeRollout, padded
from anytime.trainer.experience import segment_index
from tests.helpers import train_rows
from anytime.batch.train_batch import TrainBatch
from anytime.reward.verifier import REASONS

pytestmark = pytest.mark.unit

CLOSE, HEADER = (90, 91), (92,)


def test_segment_index():
    assert segment_index(7, [2, 4, 6, 8]).tolist() == [0, 0, 1, 1, 2, 2, 3]
    assert segment_index(3, [2, 4]).tolist() == [0, 0, 1]
    assert segment_index(0, [2]).tolist() == []
    assert segment_index(5, [2, 4]).tolist() == [0, 0, 1, 1, 1]  # past the last budget: last segment


def _rollout() -> AnytimeRollout:
    """One prompt [1, 2, 3], one trace of 5 tokens that ended itself (</think> = 14), budgets {2, 6},
    two summaries per budget: budget 2 is a real cut (close + header), budget 6 is past the end."""
    summaries = [[50, 51], [50, 51], [52], [52]]
    return AnytimeRollout(
        budgets=[2, 6], golds=["1"], prompt_ids=torch.tensor([[1, 2, 3]]), prompt_len=torch.tensor([3]),
        think_ids=torch.tensor([[[10, 11, 12, 13, 14]]]), think_logprobs=torch.full((1, 1, 5), -0.1),
        think_len=torch.tensor([[5]]), natural_end=torch.tensor([[True]]), eos_end=torch.tensor([[False]]),
        cut=torch.tensor([[[2, 5]]]), forced_close=torch.tensor([[[True, False]]]),
        prefix_group=torch.tensor([[[0, 1]]]),
        summary_ids=padded(summaries, torch.long, (1, 1, 2, 2)),
        summary_logprobs=padded([[-0.5, -0.6], [-0.5, -0.6], [-0.7], [-0.7]], torch.float32, (1, 1, 2, 2)),
        summary_len=torch.tensor([[[[2, 2], [1, 1]]]]), scores=torch.ones(1, 1, 2, 2),
        reasons=torch.full((1, 1, 2, 2), REASONS.index("correct")), answers=["1"] * 4, texts=["x"] * 4,
        close_ids=CLOSE, header_ids=HEADER)


def test_build_train_batch_masks_and_advantages():
    rollout = _rollout()
    t_adv = torch.tensor([[[0.5, -0.25]]], dtype=torch.float64)
    s_adv = torch.tensor([[[[1.0, -1.0], [0.0, 0.0]]]], dtype=torch.float64)
    batch = train_rows(rollout, t_adv, s_adv, summary_max_tokens=4, pad_id=0)
    assert len(batch) == 3  # thinking + the two budget-2 summaries; zero-advantage summaries dropped
    assert batch.lengths.tolist() == [8, 10, 10]
    think = batch.input_ids[0, :8].tolist()
    assert think == [1, 2, 3, 10, 11, 12, 13, 14]
    # target-aligned: column t scores input_ids[t + 1]
    assert batch.thinking_mask[0].tolist() == [False, False, True, True, True, True, True, False, False]
    assert batch.advantages[0, 2:7].tolist() == [0.5, 0.5, -0.25, -0.25, -0.25]
    assert torch.allclose(batch.rollout_logprobs[0, 2:7], torch.full((5,), -0.1))
    summ = batch.input_ids[1].tolist()
    assert summ == [1, 2, 3, 10, 11, 90, 91, 92, 50, 51]  # prompt + thinking[:2] + inserted + summary
    assert batch.summary_mask[1].nonzero().flatten().tolist() == [7, 8]  # only the sampled summary tokens
    assert batch.inserted_mask[1].nonzero().flatten().tolist() == [4, 5, 6]  # never trained
    assert not (batch.loss_mask & batch.inserted_mask).any()
    assert batch.advantages[1, 7:9].tolist() == [1.0, 1.0] and batch.advantages[2, 7:9].tolist() == [-1.0, -1.0]
    assert batch.tokens_per_prompt.tolist() == [5 + 2 * 2 + 2 * 1]  # counted before dropping
    assert batch.max_len == 6 + 2 * 2 * (3 + 4)
    assert batch.prompt_index.tolist() == [0, 0, 0]
    full = train_rows(rollout, t_adv, s_adv, summary_max_tokens=4, drop_zero_rows=False)
    assert len(full) == 5
    natural = full.input_ids[3, : full.lengths[3]].tolist()
    assert natural == [1, 2, 3, 10, 11, 12, 13, 14, 92, 52]  # own </think> kept, header only


def _batch(lengths: list[int], prompts: list[int], num_prompts: int) -> TrainBatch:
    R, T = len(lengths), max(lengths)
    ids = torch.zeros(R, T, dtype=torch.long)
    mask = torch.zeros(R, T - 1, dtype=torch.bool)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.arange(1, n + 1) + 100 * i
        mask[i, : n - 1] = True
    zeros = torch.zeros(R, T - 1)
    return TrainBatch(ids, torch.tensor(lengths), torch.tensor(prompts), mask, torch.zeros_like(mask),
                      torch.zeros_like(mask), zeros + 0.5, zeros.clone(), zeros.clone(),
                      torch.arange(num_prompts) + 10, traces_per_prompt=2, max_len=16)


def test_select_trims_and_padding_rows_train_nothing():
    batch = _batch([3, 8, 5, 2], [0, 0, 1, 2], 3)
    sub = batch.select([2, 0])
    assert sub.input_ids.shape == (2, 5) and sub.advantages.shape == (2, 4)
    assert sub.input_ids[1, :3].tolist() == [1, 2, 3]
    padded_batch = sub.with_padding_rows(2)
    assert len(padded_batch) == 4 and padded_batch.lengths.tolist() == [5, 3, 2, 2]
    assert not padded_batch.loss_mask[2:].any() and padded_batch.prompt_index[2:].tolist() == [-1, -1]
    assert padded_batch.attention_mask[2].tolist() == [1, 1, 0, 0, 0]
    empty = batch.select([]).with_padding_rows(1)
    assert empty.input_ids.shape == (1, 2) and not empty.loss_mask.any()


def test_micro_batches_pack_longest_first_within_the_budget():
    batch = _batch([3, 8, 5, 2], [0, 0, 1, 2], 3)
    groups = batch.micro_batch_rows(16)
    assert groups == [[1, 2], [0, 3]]  # 2 × 8 = 16 fits, a third row (3 × 8) would not
    assert batch.micro_batch_rows(4) == [[1], [2], [0], [3]]  # rows longer than the budget go alone
    ties = _batch([4, 4, 4], [0, 1, 2], 3)
    assert ties.micro_batch_rows(100) == [[0, 1, 2]]  # stable: equal lengths keep their order


def test_mini_batches_and_shards_split_by_prompt():
    batch = _batch([3, 8, 5, 2, 4], [0, 0, 1, 3, 3], 4)  # prompt 2's rows were all dropped
    minis = list(batch.mini_batches(2))
    assert [m.prompts for m in minis] == [[0, 1], [2, 3]]
    assert [m.rows.tolist() for m in minis] == [[0, 1, 2], [3, 4]]
    mine = list(batch.mini_batches(2, dp_rank=1, dp_size=2))
    assert [m.prompts for m in mine] == [[1], [3]] and [len(m.batch) for m in mine] == [1, 2]
    assert batch.shard(0, 2).prompt_index.tolist() == [0, 0]
    assert batch.shard(1, 2).prompt_index.tolist() == [1, 3, 3]


def test_tensor_round_trip():
    batch = _batch([3, 5], [0, 1], 2)
    again = TrainBatch.from_tensors(batch.to_tensors())
    for name, value in batch.to_tensors().items():
        assert torch.equal(value, again.to_tensors()[name]), name
    assert again.max_len == 16 and again.traces_per_prompt == 2


def test_advantages_of_the_wrong_shape_are_refused():
    with pytest.raises(ValueError, match=r"thinking advantages must be \[B, G, S\] = \(1, 1, 2\)"):
        train_rows(_rollout(), torch.zeros(1, 1, 1), torch.zeros(1, 1, 2, 2), summary_max_tokens=4)


def test_packed_row_holds_the_trace_and_its_summaries_as_branches():
    rollout = _rollout()
    t_adv = torch.tensor([[[0.5, -0.25]]], dtype=torch.float64)
    s_adv = torch.tensor([[[[1.0, -1.0], [0.0, 2.0]]]], dtype=torch.float64)
    batch = train_rows(rollout, t_adv, s_adv, summary_max_tokens=4, pack=True)
    assert len(batch) == 1 and batch.sequences.tolist() == [4]  # thinking + 3 summaries (one had advantage 0)
    ids = batch.input_ids[0].tolist()
    #      prompt    thinking (own </think>)  cut 2: close+header+summary ×2         past the end: header + summary
    assert ids == [1, 2, 3, 10, 11, 12, 13, 14, 90, 91, 92, 50, 51, 90, 91, 92, 50, 51, 92, 52]
    # branch tokens continue from their cut and see prompt + thinking[:cut] + themselves
    assert batch.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 8, 9]
    assert batch.skip_start[0, 8:].tolist() == [5] * 10 + [8, 8]
    assert batch.skip_end[0, 8:].tolist() == [8] * 5 + [13] * 5 + [18, 18]
    assert batch.summary_mask[0].nonzero().flatten().tolist() == [10, 11, 15, 16, 18]
    assert batch.inserted_mask[0].nonzero().flatten().tolist() == [7, 8, 9, 12, 13, 14, 17]
    assert batch.advantages[0, [10, 15, 18]].tolist() == [1.0, -1.0, 2.0]
    assert batch.segments[0, [2, 10, 11, 15, 18]].tolist() == [0, 8, 8, 13, 18]
    assert batch.tokens_per_prompt.tolist() == [5 + 2 * 2 + 2 * 1] and batch.packed
    # selection, padding rows and the tensor round trip keep the spans
    grown = batch.select([0]).with_padding_rows(1)
    assert grown.skip_end.shape == grown.input_ids.shape and grown.sequences.tolist() == [4, 0]
    again = TrainBatch.from_tensors(grown.to_tensors())
    assert torch.equal(again.skip_start, grown.skip_start) and torch.equal(again.position_ids, grown.position_ids)
    # zero thinking advantages: an untrained trunk, cut to the longest cut a trained summary needs
    short = train_rows(rollout, torch.zeros(1, 1, 2), s_adv.clone().index_fill_(2, torch.tensor([1]), 0.0),
                              summary_max_tokens=4, pack=True)
    assert short.input_ids[0].tolist() == [1, 2, 3, 10, 11, 90, 91, 92, 50, 51, 90, 91, 92, 50, 51]
    assert not short.thinking_mask.any() and short.sequences.tolist() == [2]
    assert len(train_rows(rollout, torch.zeros(1, 1, 2), torch.zeros(1, 1, 2, 2), summary_max_tokens=4,
                                 pack=True)) == 0
