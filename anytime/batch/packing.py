"""From an `AnytimeRollout` and its advantages to a `TrainBatch`, in one of two layouts.

Row per summary (`learner.pack_summaries: false`): each thinking trace is a row (prompt + thinking)
and each summary is a row (prompt + thinking[:cut] + inserted + summary), so the learner recomputes
the thinking prefix once per summary.

Tree-packed (the default; the paper's App. B): one row per trace. Its trunk is prompt + thinking
(the model's own `</think>` included when the trace ended by itself); every summary follows as a
branch (inserted close/header tokens + summary) that sees the prompt, the thinking up to its cut and
itself, with position ids that continue from the cut (`anytime.models.attention`). Budgets that share one
summary prompt past a trace's natural end branch off at the same point; each of the A summaries is
its own branch. The inserted tokens are repeated in every branch so that each trained token is
predicted from the token just left of it, and the usual one-column target shift holds.

Both layouts train the same tokens with the same advantages and the same contexts and positions, so
log-probs, loss and gradients agree up to float summation order. Sequences whose advantages are all
zero are left out when no KL/entropy term needs them: a row of its own is dropped; in a packed row a
zero-advantage branch is left out, and a zero-advantage thinking trace stays as an untrained trunk,
shortened to the longest cut a kept branch needs (nothing sees the rest). Every loss normaliser's
count (`tokens_per_prompt`, `sequences_per_prompt`, the traces) is taken before dropping, so
dropping changes no loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from anytime.batch.anytime_rollout import AnytimeRollout
from anytime.batch.train_batch import TrainBatch


@dataclass
class _Summary:
    """One sampled summary with what the learner needs of it."""

    cut: int                      # thinking tokens it sees
    inserted: torch.Tensor        # forced close / header ids
    ids: torch.Tensor
    advantages: torch.Tensor      # per token (float64, one value)
    logprobs: torch.Tensor        # the engine's


@dataclass
class _Row:
    """One token row under construction: its pieces and, by input position, what is trained."""

    prompt: int                   # index of the prompt in the rollout batch
    pieces: list[torch.Tensor] = field(default_factory=list)
    length: int = 0
    trunk_start: int = 0          # where the thinking starts (after the prompt)
    trained: list[tuple[str, int, torch.Tensor, torch.Tensor]] = field(default_factory=list)  # kind, start, adv, lp
    inserted: list[tuple[int, int]] = field(default_factory=list)                           # start, count
    hidden: list[tuple[int, int, int, int]] = field(default_factory=list)  # tokens [a, b) hide keys [c, d)
    sequences: int = 0

    def _add(self, ids: torch.Tensor) -> int:
        self.pieces.append(ids)
        self.length += len(ids)
        return self.length - len(ids)

    def trunk(self, prompt: torch.Tensor, thinking: torch.Tensor, advantages: torch.Tensor | None = None,
              logprobs: torch.Tensor | None = None) -> None:
        """Prompt + thinking; the thinking is trained when it has advantages."""
        self._add(prompt)
        self.trunk_start = self._add(thinking)
        if advantages is not None:
            self.trained.append(("thinking", self.trunk_start, advantages, logprobs))
            self.sequences += 1

    def branch(self, s: _Summary, hide: bool) -> None:
        """Inserted tokens + summary; with `hide`, the keys between its cut and itself are hidden."""
        start = self._add(s.inserted)
        self.inserted.append((start, len(s.inserted)))
        self.trained.append(("summary", self._add(s.ids), s.advantages, s.logprobs))
        self.sequences += 1
        if hide:
            self.hidden.append((start, self.length, self.trunk_start + s.cut, start))


def _rows_of_trace(prompt_index: int, prompt: torch.Tensor, thinking: torch.Tensor, advantages: torch.Tensor,
                   logprobs: torch.Tensor, train_thinking: bool, summaries: list[_Summary], pack: bool) -> list[_Row]:
    thinking_args = (advantages, logprobs) if train_thinking else ()
    if pack:
        if not train_thinking and not summaries:
            return []
        trunk = len(thinking) if train_thinking else max(s.cut for s in summaries)
        row = _Row(prompt_index)
        row.trunk(prompt, thinking[:trunk], *thinking_args)
        for s in summaries:
            row.branch(s, hide=True)
        return [row]
    rows = []
    if train_thinking:
        rows.append(_Row(prompt_index))
        rows[-1].trunk(prompt, thinking, *thinking_args)
    for s in summaries:
        rows.append(_Row(prompt_index))
        rows[-1].trunk(prompt, thinking[: s.cut])
        rows[-1].branch(s, hide=False)
    return rows


def build_train_batch(rollout: AnytimeRollout, thinking_adv: torch.Tensor, summary_adv: torch.Tensor, *,
                      max_len: int, drop_zero_rows: bool = True, pad_id: int = 0, pack: bool = False) -> TrainBatch:
    """`thinking_adv [B, G, L]` per thinking token, `summary_adv [B, G, S, A]` per summary (every token of
    a summary takes it), both as the experience stage made them (`anytime.trainer.experience`: the
    estimators, their spread over tokens and the loss weights); `max_len` is the `constant` loss
    normaliser's width. `pack` gives one tree-packed row per trace instead of a row per thinking trace
    and per summary."""
    r = rollout
    B, G, S, A = r.scores.shape
    longest = int(r.think_len.max()) if r.think_len.numel() else 0
    if tuple(thinking_adv.shape[:2]) != (B, G) or thinking_adv.dim() != 3 or thinking_adv.shape[-1] < longest:
        raise ValueError(f"thinking advantages must be [B, G, L] with B, G = {(B, G)} and L >= {longest} "
                         f"(one per thinking token), got {tuple(thinking_adv.shape)}")
    if tuple(summary_adv.shape) != (B, G, S, A):
        raise ValueError(f"summary advantages must be [B, G, S, A] = {(B, G, S, A)}, got {tuple(summary_adv.shape)}")
    rows: list[_Row] = []
    tokens = torch.zeros(B, dtype=torch.long)
    sequences = torch.zeros(B, dtype=torch.long)   # with a token, before any is dropped (seq-mean)
    for b in range(B):
        prompt = r.prompt_ids[b, : r.prompt_len[b]]
        for g in range(G):
            n = int(r.think_len[b, g])
            adv = thinking_adv[b, g, :n].double()
            summaries = []
            for j in range(S):
                inserted = torch.tensor(r.inserted_ids(b, g, j), dtype=torch.long)
                for a in range(A):
                    m, value = int(r.summary_len[b, g, j, a]), float(summary_adv[b, g, j, a])
                    if drop_zero_rows and (m == 0 or value == 0):
                        continue
                    summaries.append(_Summary(int(r.cut[b, g, j]), inserted, r.summary_ids[b, g, j, a, :m],
                                              torch.full((m,), value, dtype=torch.float64),
                                              r.summary_logprobs[b, g, j, a, :m]))
            train_thinking = not drop_zero_rows or bool((adv != 0).any())
            rows += _rows_of_trace(b, prompt, r.think_ids[b, g, :n], adv, r.think_logprobs[b, g, :n], train_thinking,
                                   summaries, pack)
            tokens[b] += n + int(r.summary_len[b, g].sum())
            sequences[b] += int(n > 0) + int((r.summary_len[b, g] > 0).sum())
    return _tensors(rows, tokens, sequences, G, max_len, pad_id)


def _tensors(rows: list[_Row], tokens: torch.Tensor, sequences: torch.Tensor, traces: int, max_len: int,
             pad_id: int) -> TrainBatch:
    lengths = torch.tensor([row.length for row in rows], dtype=torch.long)
    R, T = len(rows), int(lengths.max()) if rows else 2
    out = {"input_ids": torch.full((R, T), pad_id, dtype=torch.long),
           **{k: torch.zeros((R, T - 1), dtype=torch.bool) for k in ("thinking_mask", "summary_mask", "inserted_mask")},
           **{k: torch.zeros((R, T - 1), dtype=torch.float32) for k in ("advantages", "rollout_logprobs")},
           **{k: torch.zeros((R, T), dtype=torch.int32) for k in ("skip_start", "skip_end")}}
    for i, row in enumerate(rows):
        out["input_ids"][i, : row.length] = torch.cat(row.pieces)
        # a token at input position p is the target of column p - 1
        for kind, start, adv, logprobs in row.trained:
            cols = slice(start - 1, start - 1 + len(adv))
            out[f"{kind}_mask"][i, cols] = True
            out["advantages"][i, cols] = adv.float()
            out["rollout_logprobs"][i, cols] = logprobs
        for start, count in row.inserted:
            out["inserted_mask"][i, start - 1: start - 1 + count] = True
        for first, end, hide_from, hide_to in row.hidden:
            out["skip_start"][i, first:end] = hide_from
            out["skip_end"][i, first:end] = hide_to
    return TrainBatch(**out, lengths=lengths, prompt_index=torch.tensor([row.prompt for row in rows], dtype=torch.long),
                      old_logprobs=torch.zeros((R, T - 1), dtype=torch.float32), tokens_per_prompt=tokens,
                      traces_per_prompt=traces, max_len=max_len, pad_id=pad_id,
                      sequences=torch.tensor([row.sequences for row in rows], dtype=torch.long),
                      sequences_per_prompt=sequences)
