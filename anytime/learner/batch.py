"""The train batch: rollout + advantages → token rows with loss masks and per-token advantages.

Each thinking trace is one row (prompt + thinking; thinking tokens trainable, each with the
advantage of its budget segment). Each summary is one row (prompt + thinking[:cut] + inserted +
summary; only the sampled summary tokens are trainable, the inserted close/header never are).
Rows whose advantages are all zero are dropped when no KL/entropy term needs them; normalisers are
counted before dropping so the loss is unchanged.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from anytime.rollout.anytime import AnytimeRollout, segment_index


@dataclass
class TrainRow:
    input_ids: list[int]
    loss_mask: list[float]             # per position of input_ids: 1 where the token is trained
    advantages: list[float]
    rollout_logprobs: list[float]      # the engine's sampling logprobs (0 where not trained)
    prompt_index: int                  # which prompt of the rollout batch: mini-batches split by prompt
    kind: str                          # "thinking" | "summary"
    old_logprobs: list[float] | None = None

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class TrainBatch:
    rows: list[TrainRow]
    num_prompts: int
    num_traces: int
    max_len: int          # the constant normaliser's length: thinking + S·A·(inserted + summary)
    tokens_per_prompt: dict[int, int]   # trainable tokens per prompt, counted before zero rows are dropped
    traces_per_prompt: int


def build_train_batch(rollout: AnytimeRollout, thinking_adv: torch.Tensor, summary_adv: torch.Tensor, *,
                      thinking_weight: float = 1.0, summary_weight: float = 1.0, summary_max_tokens: int,
                      drop_zero_rows: bool = True) -> TrainBatch:
    """`thinking_adv [B, G, S]` per budget segment, `summary_adv [B, G, S, A]`."""
    rows: list[TrainRow] = []
    budgets = rollout.budgets
    inserted = 0
    for b, (prompt, traces) in enumerate(zip(rollout.prompts, rollout.traces)):
        for g, trace in enumerate(traces):
            seg = segment_index(len(trace.token_ids), budgets)
            adv = [thinking_weight * float(thinking_adv[b, g, j]) for j in seg]
            n_prompt = len(prompt)
            rows.append(TrainRow(prompt + trace.token_ids, [0.0] * n_prompt + [1.0] * len(adv),
                                 [0.0] * n_prompt + adv, [0.0] * n_prompt + trace.logprobs, b, "thinking"))
            for j, per_budget in enumerate(rollout.summaries[b][g]):
                for a, s in enumerate(per_budget):
                    inserted = max(inserted, len(s.inserted_ids))
                    head = prompt + trace.token_ids[: s.cut] + s.inserted_ids
                    value = summary_weight * float(summary_adv[b, g, j, a])
                    rows.append(TrainRow(head + s.token_ids, [0.0] * len(head) + [1.0] * len(s.token_ids),
                                         [0.0] * len(head) + [value] * len(s.token_ids),
                                         [0.0] * len(head) + s.logprobs, b, "summary"))
    S = len(budgets)
    A = len(rollout.summaries[0][0][0]) if rollout.summaries and rollout.summaries[0] else 0
    max_len = budgets[-1] + S * A * (inserted + summary_max_tokens)
    tokens: dict[int, int] = {}
    for r in rows:
        tokens[r.prompt_index] = tokens.get(r.prompt_index, 0) + int(sum(r.loss_mask))
    if drop_zero_rows:
        rows = [r for r in rows if any(a != 0.0 for a in r.advantages)]
    G = len(rollout.traces[0]) if rollout.traces else 0
    return TrainBatch(rows, len(rollout.prompts), sum(len(t) for t in rollout.traces), max_len, tokens, G)


def padding_row(pad_id: int) -> TrainRow:
    """Two tokens, attended, nothing trained: its loss and gradient terms are exact zeros. Used to
    give every rank (or every pipeline microbatch) the same number of rows/passes."""
    return TrainRow([pad_id, pad_id], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0], -1, "pad", [0.0])


def mini_batches(batch: TrainBatch, prompts_per_mini: int, rank: int = 0,
                 world: int = 1) -> Iterator[tuple[list[TrainRow], int, int]]:
    """(rows, trainable tokens, traces) of each PPO mini-batch: consecutive groups of
    `prompts_per_mini` prompts, of which this data-parallel `rank` keeps prompts p % world == rank."""
    by_prompt: dict[int, list[TrainRow]] = defaultdict(list)
    for row in batch.rows:
        by_prompt[row.prompt_index].append(row)
    per_mini = max(1, prompts_per_mini)
    for start in range(0, batch.num_prompts, per_mini):
        mine = [p for p in range(start, min(start + per_mini, batch.num_prompts)) if p % world == rank]
        rows = [r for p in mine for r in by_prompt.get(p, [])]
        yield rows, sum(batch.tokens_per_prompt.get(p, 0) for p in mine), len(mine) * batch.traces_per_prompt


def pack_micro_batches(rows: Sequence[TrainRow], token_budget: int) -> list[list[TrainRow]]:
    """Group rows (longest first) so each micro-batch's padded size rows × max_len ≤ token_budget;
    a single row longer than the budget gets a micro-batch of its own."""
    order = sorted(rows, key=len, reverse=True)
    batches: list[list[TrainRow]] = []
    current: list[TrainRow] = []
    for row in order:
        if current and len(current[0]) * (len(current) + 1) > token_budget:
            batches.append(current)
            current = []
        current.append(row)
    if current:
        batches.append(current)
    return batches


def collate(rows: Sequence[TrainRow], pad_id: int = 0, device: torch.device | str = "cpu",
            dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Right-padded tensors. Targets are shifted: position t predicts input_ids[t + 1], so the masks,
    advantages and logprobs returned are aligned to the *predicted* token ([rows, T-1])."""
    T = max(len(r) for r in rows)
    n = len(rows)
    ids = torch.full((n, T), pad_id, dtype=torch.long)
    attn = torch.zeros((n, T), dtype=torch.long)
    mask = torch.zeros((n, T), dtype=dtype)
    adv = torch.zeros((n, T), dtype=dtype)
    rollout_lp = torch.zeros((n, T), dtype=dtype)
    old_lp = torch.zeros((n, T), dtype=dtype)
    for i, r in enumerate(rows):
        L = len(r)
        ids[i, :L] = torch.tensor(r.input_ids)
        attn[i, :L] = 1
        mask[i, :L] = torch.tensor(r.loss_mask, dtype=dtype)
        adv[i, :L] = torch.tensor(r.advantages, dtype=dtype)
        rollout_lp[i, :L] = torch.tensor(r.rollout_logprobs, dtype=dtype)
        if r.old_logprobs is not None:
            old_lp[i, 1:L] = torch.tensor(r.old_logprobs, dtype=dtype)
    out = {"input_ids": ids, "attention_mask": attn, "labels": ids[:, 1:], "loss_mask": mask[:, 1:],
           "advantages": adv[:, 1:], "rollout_logprobs": rollout_lp[:, 1:], "old_logprobs": old_lp[:, 1:]}
    return {k: v.to(device) for k, v in out.items()}
