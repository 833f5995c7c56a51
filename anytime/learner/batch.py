"""The train batch: an `AnytimeRollout` + advantages → padded token rows with loss masks and
per-token advantages, as tensors, target-aligned once.

Each thinking trace is one row (prompt + thinking; thinking tokens trainable, each with the
advantage of its budget segment). Each summary is one row (prompt + thinking[:cut] + inserted +
summary; only the sampled summary tokens are trainable, the inserted close/header never are).
Rows whose advantages are all zero are dropped when no KL/entropy term needs them; the loss
normalisers are counted before dropping, so the loss is unchanged.

Every per-token tensor is aligned with the token it scores: column t refers to `input_ids[:, t+1]`
(the target predicted at position t), so a learner's log-probs of `input_ids[:, 1:]` line up with
masks, advantages and old log-probs without further shifting.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields, replace

import torch

from anytime.rollout.anytime import AnytimeRollout

# Per-row tensors (first dimension = rows) and per-token ones ([rows, T - 1], target-aligned).
_ROW_FIELDS = ("input_ids", "lengths", "prompt_index", "thinking_mask", "summary_mask", "inserted_mask",
               "advantages", "rollout_logprobs", "old_logprobs")
_TOKEN_FIELDS = _ROW_FIELDS[3:]


@dataclass
class TrainBatch:
    """Rows of one rollout step (or a rank's share, a mini-batch, a micro-batch of it)."""

    input_ids: torch.Tensor            # [R, T] long, right-padded with pad_id
    lengths: torch.Tensor              # [R] tokens of each row
    prompt_index: torch.Tensor         # [R] prompt of the rollout batch (mini-batches and ranks split by it)
    thinking_mask: torch.Tensor        # [R, T-1] bool: thinking tokens (trained)
    summary_mask: torch.Tensor         # [R, T-1] bool: sampled summary tokens (trained)
    inserted_mask: torch.Tensor        # [R, T-1] bool: forced close / header tokens (never trained)
    advantages: torch.Tensor           # [R, T-1] float32
    rollout_logprobs: torch.Tensor     # [R, T-1] float32, the engine's
    old_logprobs: torch.Tensor         # [R, T-1] float32, the learner's before the update
    tokens_per_prompt: torch.Tensor    # [P] trained tokens of every prompt, counted before rows were dropped
    traces_per_prompt: int             # G
    max_len: int                       # the constant normaliser's width: thinking + S·A·(inserted + summary)
    pad_id: int = 0

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_prompts(self) -> int:
        return self.tokens_per_prompt.shape[0]

    @property
    def loss_mask(self) -> torch.Tensor:
        return self.thinking_mask | self.summary_mask

    @property
    def attention_mask(self) -> torch.Tensor:
        return (torch.arange(self.input_ids.shape[1], device=self.lengths.device) < self.lengths[:, None]).long()

    @property
    def labels(self) -> torch.Tensor:
        return self.input_ids[:, 1:]

    def select(self, rows: torch.Tensor | Sequence[int]) -> TrainBatch:
        """These rows, in this order, trimmed to the longest of them."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        width = int(self.lengths[rows].max()) if len(rows) else 2
        cut = {name: getattr(self, name)[rows] for name in _ROW_FIELDS}
        cut["input_ids"] = cut["input_ids"][:, :width]
        for name in _TOKEN_FIELDS:
            cut[name] = cut[name][:, : width - 1]
        return replace(self, **cut)

    def with_padding_rows(self, count: int) -> TrainBatch:
        """`count` extra two-token rows, attended but never trained: their loss and gradient terms are
        exact zeros. They give every rank (or pipeline microbatch) the same number of rows."""
        if count <= 0:
            return self
        width = max(self.input_ids.shape[1], 2)
        grown = {}
        for name in _ROW_FIELDS:
            t = getattr(self, name)
            if name in ("input_ids", *_TOKEN_FIELDS):
                t = _pad_columns(t, width - (name != "input_ids"), self.pad_id if name == "input_ids" else 0)
            extra = torch.zeros((count, *t.shape[1:]), dtype=t.dtype)
            if name == "input_ids":
                extra.fill_(self.pad_id)
            elif name == "lengths":
                extra.fill_(2)
            elif name == "prompt_index":
                extra.fill_(-1)
            grown[name] = torch.cat([t, extra])
        return replace(self, **grown)

    def to(self, device: torch.device | str) -> TrainBatch:
        return replace(self, **{name: getattr(self, name).to(device) for name in _ROW_FIELDS})

    def shard(self, dp_rank: int, dp_size: int) -> TrainBatch:
        """The rows a data-parallel rank trains: those of prompts p with p % dp_size == dp_rank."""
        if dp_size == 1:
            return self
        return self.select((self.prompt_index % dp_size == dp_rank).nonzero().flatten())

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Every field as a tensor (for `anytime.dist.scatter_tensors`); `from_tensors` inverts it."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("traces_per_prompt", "max_len", "pad_id"):
            out[name] = torch.tensor(out[name], dtype=torch.long)
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> TrainBatch:
        values = dict(tensors)
        for name in ("traces_per_prompt", "max_len", "pad_id"):
            values[name] = int(values[name])
        return cls(**values)

    def mini_batches(self, prompts_per_mini: int, dp_rank: int = 0, dp_size: int = 1) -> Iterator[MiniBatch]:
        """PPO mini-batches: consecutive groups of `prompts_per_mini` prompts of the whole rollout
        batch, of which this data-parallel rank holds prompts p % dp_size == dp_rank."""
        per_mini = max(1, prompts_per_mini)
        for start in range(0, self.num_prompts, per_mini):
            every = list(range(start, min(start + per_mini, self.num_prompts)))
            mine = [p for p in every if p % dp_size == dp_rank]
            rows = torch.isin(self.prompt_index, torch.tensor(mine, dtype=torch.long)).nonzero().flatten()
            yield MiniBatch(self.select(rows), mine, rows, every)

    def micro_batch_rows(self, token_budget: int) -> list[list[int]]:
        """Rows grouped longest first so each micro-batch's padded size rows × longest ≤ token_budget;
        a single row longer than the budget gets a micro-batch of its own."""
        order = torch.argsort(self.lengths, descending=True, stable=True).tolist()
        groups: list[list[int]] = []
        for row in order:
            if groups and int(self.lengths[groups[-1][0]]) * (len(groups[-1]) + 1) <= token_budget:
                groups[-1].append(row)
            else:
                groups.append([row])
        return groups

    def micro_batches(self, token_budget: int) -> list[TrainBatch]:
        return [self.select(rows) for rows in self.micro_batch_rows(token_budget)]


@dataclass
class MiniBatch:
    """One optimizer step's rows on this rank and the prompts they belong to (some of whose rows
    may all have been dropped: the loss normaliser still counts them)."""

    batch: TrainBatch
    prompts: list[int]
    rows: torch.Tensor                 # the rows' indices in the batch they came from
    all_prompts: list[int]             # the mini-batch's prompts on every data-parallel rank


def _pad_columns(t: torch.Tensor, width: int, value: int) -> torch.Tensor:
    if t.shape[1] >= width:
        return t
    return torch.cat([t, torch.full((t.shape[0], width - t.shape[1]), value, dtype=t.dtype)], dim=1)


def segment_index(length: int, budgets: Sequence[int]) -> torch.Tensor:
    """Budget segment of each thinking token: token t (1-based) is in segment j = min{j: b_j ≥ t}
    (tokens past the last budget stay in the last segment)."""
    positions = torch.arange(1, length + 1)
    return torch.searchsorted(torch.tensor(budgets), positions).clamp_max(len(budgets) - 1)


def build_train_batch(rollout: AnytimeRollout, thinking_adv: torch.Tensor, summary_adv: torch.Tensor, *,
                      thinking_weight: float = 1.0, summary_weight: float = 1.0, summary_max_tokens: int,
                      drop_zero_rows: bool = True, pad_id: int = 0) -> TrainBatch:
    """`thinking_adv [B, G, S]` per budget segment, `summary_adv [B, G, S, A]` per summary."""
    r = rollout
    B, G, S, A = r.scores.shape
    if tuple(thinking_adv.shape) != (B, G, S):
        raise ValueError(f"thinking advantages must be [B, G, S] = {(B, G, S)}, got {tuple(thinking_adv.shape)}")
    if tuple(summary_adv.shape) != (B, G, S, A):
        raise ValueError(f"summary advantages must be [B, G, S, A] = {(B, G, S, A)}, got {tuple(summary_adv.shape)}")
    budgets = r.budgets
    rows: list[tuple[list[torch.Tensor], list[int], int]] = []    # (pieces, [n_prompt, n_inserted], prompt)
    values: list[tuple[torch.Tensor, torch.Tensor, str]] = []      # (advantage per trained token, logprobs, kind)
    tokens = torch.zeros(B, dtype=torch.long)
    for b in range(B):
        prompt = r.prompt_ids[b, : r.prompt_len[b]]
        for g in range(G):
            n = int(r.think_len[b, g])
            think = r.think_ids[b, g, :n]
            adv = thinking_weight * thinking_adv[b, g].double()[segment_index(n, budgets)]
            rows.append(([prompt, think], [len(prompt), 0], b))
            values.append((adv, r.think_logprobs[b, g, :n], "thinking"))
            for j in range(S):
                inserted = torch.tensor(r.inserted_ids(b, g, j), dtype=torch.long)
                head = [prompt, r.think_ids[b, g, : r.cut[b, g, j]], inserted]
                for a in range(A):
                    m = int(r.summary_len[b, g, j, a])
                    value = summary_weight * float(summary_adv[b, g, j, a])
                    rows.append(([*head, r.summary_ids[b, g, j, a, :m]],
                                 [len(prompt) + int(r.cut[b, g, j]), len(inserted)], b))
                    values.append((torch.full((m,), value, dtype=torch.float64),
                                   r.summary_logprobs[b, g, j, a, :m], "summary"))
            tokens[b] += n + int(r.summary_len[b, g].sum())
    inserted_max = len(r.close_ids) + len(r.header_ids) if bool(r.forced_close.any()) else len(r.header_ids)
    max_len = budgets[-1] + S * A * (inserted_max + summary_max_tokens)
    keep = [i for i, (adv, _, _) in enumerate(values) if not drop_zero_rows or bool((adv != 0).any())]

    lengths = torch.tensor([sum(len(p) for p in rows[i][0]) for i in keep], dtype=torch.long)
    R, T = len(keep), int(lengths.max()) if keep else 2
    out = {"input_ids": torch.full((R, T), pad_id, dtype=torch.long),
           **{k: torch.zeros((R, T - 1), dtype=torch.bool) for k in ("thinking_mask", "summary_mask", "inserted_mask")},
           **{k: torch.zeros((R, T - 1), dtype=torch.float32) for k in ("advantages", "rollout_logprobs")}}
    for row, i in enumerate(keep):
        pieces, (start, n_inserted), _ = rows[i]
        adv, logprobs, kind = values[i]
        ids = torch.cat(pieces)
        out["input_ids"][row, : len(ids)] = ids
        # the trained tokens are the last len(adv) of the row; target column = input position - 1
        first = len(ids) - len(adv) - 1
        out[f"{kind}_mask"][row, first: first + len(adv)] = True
        out["inserted_mask"][row, start - 1: start - 1 + n_inserted] = True
        out["advantages"][row, first: first + len(adv)] = adv.float()
        out["rollout_logprobs"][row, first: first + len(adv)] = logprobs
    return TrainBatch(**out, lengths=lengths, prompt_index=torch.tensor([rows[i][2] for i in keep], dtype=torch.long),
                      old_logprobs=torch.zeros((R, T - 1), dtype=torch.float32), tokens_per_prompt=tokens,
                      traces_per_prompt=G, max_len=max_len, pad_id=pad_id)
