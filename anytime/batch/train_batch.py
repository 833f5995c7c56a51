"""The train batch: padded token rows with loss masks, per-token advantages and log-probs, as
tensors, target-aligned once; selection, padding rows, sharding by prompt, mini- and micro-batches.
(`anytime.batch.packing` builds it from a rollout, row per summary or tree-packed.)

Every per-token tensor is aligned with the token it scores: column t refers to `input_ids[:, t+1]`
(the target predicted at position t), so a learner's log-probs of `input_ids[:, 1:]` line up with
masks, advantages and old log-probs without further shifting.

A tree-packed row holds a whole trace: prompt + thinking, then its summary branches, each seeing
only the prompt, the thinking up to its cut and itself. Each token carries the key span hidden from
it, `[skip_start, skip_end)` (`anytime.models.attention` turns it into position ids and a mask per
micro-batch); rows with no branches have empty spans and are plain causal rows.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields, replace

import torch

from anytime.models.attention import has_branches, position_ids

# Per-row tensors (first dimension = rows) and per-token ones ([rows, T - 1], target-aligned).
_ROW_FIELDS = ("input_ids", "lengths", "prompt_index", "thinking_mask", "summary_mask", "inserted_mask",
               "advantages", "rollout_logprobs", "old_logprobs", "skip_start", "skip_end", "sequences")
_TOKEN_FIELDS = _ROW_FIELDS[3:9]
_INPUT_FIELDS = ("input_ids", "skip_start", "skip_end")   # [R, T], aligned with the input tokens
# Per-prompt counts ([P], over the whole step's prompts) that loss normalisers read: they add up
# across workers and are kept whole by every selection of rows.
PROMPT_COUNT_FIELDS = ("tokens_per_prompt", "sequences_per_prompt")


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
    skip_start: torch.Tensor | None = None   # [R, T] int32: keys [skip_start, skip_end) are hidden from
    skip_end: torch.Tensor | None = None     # this token (a branch's cut-off thinking and earlier branches)
    sequences: torch.Tensor | None = None    # [R] row-per-summary sequences trained in the row
    # [P] sequences (thinking traces and summaries with a token) sampled for every prompt, counted
    # before rows were dropped: the seq-mean normaliser; default: counted from the rows
    sequences_per_prompt: torch.Tensor | None = None

    def __post_init__(self) -> None:
        # Rows built without tree packing: no hidden spans, one sequence per row.
        if self.skip_start is None:
            self.skip_start = torch.zeros(self.input_ids.shape, dtype=torch.int32)
        if self.skip_end is None:
            self.skip_end = torch.zeros(self.input_ids.shape, dtype=torch.int32)
        if self.sequences is None:
            self.sequences = torch.ones(self.input_ids.shape[0], dtype=torch.long)
        if self.sequences_per_prompt is None:
            real = self.prompt_index >= 0
            self.sequences_per_prompt = torch.zeros(self.tokens_per_prompt.shape[0], dtype=torch.long).index_add(
                0, self.prompt_index[real], self.sequences[real].long())

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

    @property
    def packed(self) -> bool:
        """Whether any row holds summary branches (and so needs a tree mask)."""
        return has_branches(self.skip_end)

    @property
    def position_ids(self) -> torch.Tensor:
        return position_ids(self.skip_start, self.skip_end)

    @property
    def segments(self) -> torch.Tensor | None:
        """[R, T-1] target-aligned: which row-per-summary sequence a target token belongs to (0 = the
        thinking, a branch's start column for its tokens), for per-sequence means; None when every
        row is one sequence."""
        return self.skip_end[:, 1:] if self.packed else None

    @property
    def valid_mask(self) -> torch.Tensor:
        """[R, T-1]: target columns inside the row (not padding)."""
        return torch.arange(self.input_ids.shape[1] - 1, device=self.lengths.device) < (self.lengths[:, None] - 1)

    def select(self, rows: torch.Tensor | Sequence[int]) -> TrainBatch:
        """These rows, in this order, trimmed to the longest of them."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        width = int(self.lengths[rows].max()) if len(rows) else 2
        cut = {name: getattr(self, name)[rows] for name in _ROW_FIELDS}
        for name in _INPUT_FIELDS:
            cut[name] = cut[name][:, :width]
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
            if name in (*_INPUT_FIELDS, *_TOKEN_FIELDS):
                t = _pad_columns(t, width - (name not in _INPUT_FIELDS), self.pad_id if name == "input_ids" else 0)
            extra = torch.zeros((count, *t.shape[1:]), dtype=t.dtype)
            if name == "input_ids":
                extra.fill_(self.pad_id)
            elif name == "lengths":
                extra.fill_(2)
            elif name == "prompt_index":
                extra.fill_(-1)
            # sequences stays 0: a padding row trains no sequence
            grown[name] = torch.cat([t, extra])
        return replace(self, **grown)

    def reindexed(self, index: Sequence[int], num_prompts: int) -> TrainBatch:
        """The rows of a worker that rolled out some of a step's prompts, under their indices in the
        whole step: local prompt b becomes `index[b]`, and each per-prompt count a vector over the
        step's `num_prompts` prompts (zero for prompts rolled out elsewhere)."""
        index_t = torch.as_tensor(list(index), dtype=torch.long)
        counts = {}
        for name in PROMPT_COUNT_FIELDS:
            counts[name] = torch.zeros(num_prompts, dtype=getattr(self, name).dtype)
            counts[name][index_t] = getattr(self, name)
        return replace(self, prompt_index=index_t[self.prompt_index], **counts)

    @staticmethod
    def concat(batches: Sequence[TrainBatch]) -> TrainBatch:
        """The rows of several workers' batches of one step (disjoint prompts), ordered by prompt as
        one worker would have built them; per-prompt counts add up."""
        width = max(b.input_ids.shape[1] for b in batches)
        first = batches[0]
        joined = {}
        for name in _ROW_FIELDS:
            parts = [getattr(b, name) for b in batches]
            if name in _INPUT_FIELDS:
                parts = [_pad_columns(t, width, first.pad_id if name == "input_ids" else 0) for t in parts]
            elif name in _TOKEN_FIELDS:
                parts = [_pad_columns(t, width - 1, 0) for t in parts]
            joined[name] = torch.cat(parts)
        order = torch.argsort(joined["prompt_index"], stable=True)
        joined = {name: t[order] for name, t in joined.items()}
        counts = {name: sum(getattr(b, name) for b in batches) for name in PROMPT_COUNT_FIELDS}
        return replace(first, **joined, **counts, max_len=max(b.max_len for b in batches))

    def to(self, device: torch.device | str) -> TrainBatch:
        return replace(self, **{name: getattr(self, name).to(device) for name in _ROW_FIELDS})

    def shard(self, dp_rank: int, dp_size: int) -> TrainBatch:
        """The rows a data-parallel rank trains: those of prompts p with p % dp_size == dp_rank."""
        if dp_size == 1:
            return self
        return self.select((self.prompt_index % dp_size == dp_rank).nonzero().flatten())

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Every field as a tensor (for `anytime.core.dist.scatter_tensors`); `from_tensors` inverts it."""
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
