"""The rollout result: one step's (or one eval batch's) traces, budget cuts, summaries and verified
scores as padded tensors indexed [prompt B, trace G, budget S, summary A]. `anytime.rollout.runner`
builds it from an engine's completions; `anytime.batch.packing` turns it into a `TrainBatch`;
`anytime.evaluation.records` turns it into per-sample records.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from anytime.batch.step_sums import StepSums
from anytime.reward.verifier import REASONS


@dataclass
class AnytimeRollout:
    """One rollout batch as padded tensors (pad id 0, lengths given): the currency between the
    rollout and the advantage / train-batch stages. Shapes: B prompts, G traces per prompt, S
    budgets, A summaries per budget, L longest trace, M longest summary."""

    budgets: list[int]                 # [S]
    golds: list[Any]                   # [B] raw gold answers
    prompt_ids: torch.Tensor           # [B, P] long
    prompt_len: torch.Tensor           # [B]
    think_ids: torch.Tensor            # [B, G, L] generated thinking, the closing `</think>` included
    think_logprobs: torch.Tensor       # [B, G, L] float32, the engine's raw log-probs
    think_len: torch.Tensor            # [B, G]
    natural_end: torch.Tensor          # [B, G] bool: closed its thinking by itself
    eos_end: torch.Tensor              # [B, G] bool: stopped on EOS without closing
    cut: torch.Tensor                  # [B, G, S] thinking tokens kept before the inserted tokens
    forced_close: torch.Tensor         # [B, G, S] bool: the close text was inserted (a real cut)
    prefix_group: torch.Tensor         # [B, G, S] equal ids share one summary prompt
    summary_ids: torch.Tensor          # [B, G, S, A, M] long
    summary_logprobs: torch.Tensor     # [B, G, S, A, M] float32
    summary_len: torch.Tensor          # [B, G, S, A]
    scores: torch.Tensor               # [B, G, S, A] in {0, 1}
    reasons: torch.Tensor              # [B, G, S, A] index into anytime.reward.verifier.REASONS
    answers: list[str | None]          # [B·G·S·A] the extracted answers, in (b, g, j, a) order
    texts: list[str]                   # [B·G·S·A] what the verifier read
    close_ids: tuple[int, ...]
    header_ids: tuple[int, ...]
    timings: dict[str, float] = field(default_factory=dict)
    # the weight version of each sampled token, where the engine takes weights mid-generation
    think_versions: torch.Tensor | None = None     # [B, G, L] long
    summary_versions: torch.Tensor | None = None   # [B, G, S, A, M] long

    @property
    def budget_scores(self) -> torch.Tensor:
        """r_j: mean summary score of each trace at each budget, [B, G, S]."""
        return self.scores.mean(-1)

    def failure_reasons(self) -> Counter:
        return Counter(REASONS[i] for i in self.reasons.flatten().tolist())

    def thinking_lengths(self) -> list[int]:
        return self.think_len.flatten().tolist()

    def select_prompts(self, prompts: Sequence[int]) -> AnytimeRollout:
        """The rollout of these prompts only (groups kept by dynamic sampling), in this order."""
        keep = torch.as_tensor(list(prompts), dtype=torch.long)
        per_prompt = len(self.texts) // max(len(self.golds), 1)   # G·S·A flat entries per prompt
        tensors = {f.name: getattr(self, f.name)[keep] for f in fields(self)
                   if isinstance(getattr(self, f.name), torch.Tensor)}
        flat = [i for b in keep.tolist() for i in range(b * per_prompt, (b + 1) * per_prompt)]
        return replace(self, **tensors, golds=[self.golds[b] for b in keep.tolist()],
                       answers=[self.answers[i] for i in flat], texts=[self.texts[i] for i in flat])

    def inserted_ids(self, b: int, g: int, j: int) -> list[int]:
        """The tokens forced between thinking[:cut] and the summary of budget j (never trained)."""
        return list(self.close_ids if self.forced_close[b, g, j] else ()) + list(self.header_ids)

    def to_state(self) -> dict[str, Any]:
        """Every field, tensors as they are and the rest as plain values (to send or save)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> AnytimeRollout:
        return cls(**{**state, "close_ids": tuple(state["close_ids"]), "header_ids": tuple(state["header_ids"])})


@dataclass
class Draw:
    """One engine call of a worker's share of a step: its rollout, the groups kept (positions in it:
    all of them, but for groups dynamic sampling drops) and the step positions of the slots they fill."""

    rollout: AnytimeRollout
    kept: list[int]
    slots: list[int]


@dataclass
class ScoredRollout:
    """What a rollout worker returns for its share of one step: its draws (traces, cuts, summaries and
    scores), the step's prompt count, metric sums that add up over workers (`StepSums`), and its
    stage timings. Advantages and training rows are the trainer's (`anytime.trainer.experience`)."""

    draws: list[Draw]
    num_prompts: int
    sums: StepSums
    timings: dict[str, float]

    def to_state(self) -> dict[str, Any]:
        """Tensors and plain values only (a checkpoint loads it with `weights_only`)."""
        return {"draws": [{"rollout": d.rollout.to_state(), "kept": d.kept, "slots": d.slots} for d in self.draws],
                "num_prompts": self.num_prompts, "sums": self.sums.to_dict(), "timings": self.timings}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> ScoredRollout:
        draws = [Draw(AnytimeRollout.from_state(d["rollout"]), list(d["kept"]), list(d["slots"]))
                 for d in state["draws"]]
        return cls(draws, int(state["num_prompts"]), StepSums.from_dict(state["sums"]), dict(state["timings"]))


def rollout_sums(rollout: AnytimeRollout) -> StepSums:
    """A rollout's metric sums and counts (accuracy per budget, thinking length, verifier reasons,
    tokens), so that the sums of several draws and workers add up exactly."""
    B, G, S, A = rollout.scores.shape
    return StepSums(traces=float(B * G), summaries_per_budget=float(B * G * A),
                    acc=[float(rollout.scores[:, :, j].sum()) for j in range(S)],
                    think_len=float(rollout.think_len.sum()), closed=float(rollout.natural_end.sum()),
                    tokens=float(rollout.think_len.sum() + rollout.summary_len.sum()),
                    reasons={k: float(v) for k, v in rollout.failure_reasons().items()})


def eos_zeroed(eos_end: bool, length: int, budget: int) -> bool:
    """A trace that stopped on EOS (without closing its thinking) scores 0 at budgets b ≥ |z|."""
    return eos_end and budget >= length


def padded(rows: Sequence[Sequence[float]], dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Ragged rows (in row-major order of `shape`) right-padded with zeros into [*shape, longest]."""
    width = max((len(r) for r in rows), default=0)
    out = torch.zeros((len(rows), max(width, 1)), dtype=dtype)
    for i, r in enumerate(rows):
        if len(r):
            out[i, : len(r)] = torch.tensor(r, dtype=dtype)
    return out.view(*shape, -1)
