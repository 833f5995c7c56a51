import torch

from anytime.learner.batch import TrainRow, build_train_batch, collate, pack_micro_batches
from anytime.reward import Verdict
from anytime.rollout.anytime import AnytimeRollout, Summary, Trace, segment_index


def test_segment_index():
    assert segment_index(7, [2, 4, 6, 8]) == [0, 0, 1, 1, 2, 2, 3]
    assert segment_index(3, [2, 4]) == [0, 0, 1]
    assert segment_index(0, [2]) == []


def _rollout():
    v = Verdict(1.0, "correct", "1")
    trace = Trace([10, 11, 12, 13, 14], [-0.1] * 5, natural_end=True)
    summaries = [[Summary(2, [90, 91, 92], [50, 51], [-0.5, -0.6], v) for _ in range(2)],
                 [Summary(5, [92], [52], [-0.7], v) for _ in range(2)]]
    return AnytimeRollout([[1, 2, 3]], ["1"], [2, 6], [[trace]], [[summaries]],
                          torch.ones(1, 1, 2, 2), torch.tensor([[[0, 1]]]))


def test_build_train_batch_masks_and_advantages():
    rollout = _rollout()
    t_adv = torch.tensor([[[0.5, -0.25]]])
    s_adv = torch.tensor([[[[1.0, -1.0], [0.0, 0.0]]]])
    batch = build_train_batch(rollout, t_adv, s_adv, summary_max_tokens=4)
    kinds = [r.kind for r in batch.rows]
    assert kinds == ["thinking", "summary", "summary"]  # the zero-advantage summaries were dropped
    think = batch.rows[0]
    assert think.input_ids == [1, 2, 3, 10, 11, 12, 13, 14]
    assert think.loss_mask == [0, 0, 0, 1, 1, 1, 1, 1]
    assert think.advantages == [0, 0, 0, 0.5, 0.5, -0.25, -0.25, -0.25]
    summ = batch.rows[1]
    assert summ.input_ids == [1, 2, 3, 10, 11, 90, 91, 92, 50, 51]  # prompt + thinking[:2] + inserted + summary
    assert summ.loss_mask == [0] * 8 + [1, 1]  # inserted tokens are never trained
    assert summ.advantages[-2:] == [1.0, 1.0]
    assert batch.tokens_per_prompt == {0: 5 + 2 * 2 + 2 * 1}
    assert batch.max_len == 6 + 2 * 2 * (3 + 4)
    full = build_train_batch(rollout, t_adv, s_adv, summary_max_tokens=4, drop_zero_rows=False)
    assert len(full.rows) == 5


def test_pack_and_collate():
    rows = [TrainRow(list(range(n)), [0] + [1] * (n - 1), [0] + [0.5] * (n - 1), [0.0] * n, 0, "thinking")
            for n in (3, 8, 5, 2)]
    batches = pack_micro_batches(rows, token_budget=16)
    assert sorted(len(r) for b in batches for r in b) == [2, 3, 5, 8]
    assert all(len(b[0]) * len(b) <= 16 or len(b) == 1 for b in batches)
    t = collate(rows[:2], pad_id=0)
    assert t["input_ids"].shape == (2, 8)
    assert t["loss_mask"].shape == (2, 7)
    assert t["loss_mask"][0].tolist() == [1, 1, 0, 0, 0, 0, 0]
    assert t["labels"][1].tolist() == list(range(1, 8))
