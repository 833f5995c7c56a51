"""The anytime rollout, engine-agnostic: thinking traces → budget cuts → prefix-shared summaries →
verified scores (paper §1).

For each prompt, G traces stop at the tokenizer's `</think>` (or EOS) or at the largest budget. Each
trace is cut at every budget b_j; the summary prompt of a cut is prompt + thinking[:b_j] + close
tokens (only when the trace was really cut) + answer-header tokens. Budgets past a trace's natural
end share one summary prompt (one prefix group). A summaries per budget are sampled through
`engine.generate_branches`, so engines reuse the trace's prefix, and scored by the verifier.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from anytime.reward import RewardScorer, Verdict
from anytime.rollout.engine import Branch, RolloutEngine, SamplingConfig


@dataclass(frozen=True)
class AnytimeSettings:
    """Everything the rollout needs besides the engine; built from a recipe or the eval CLI."""

    budgets: tuple[int, ...]
    traces_per_prompt: int            # G
    summaries_per_budget: int         # A
    summary_max_tokens: int
    close_text: str = "\n\n...\n\n</think>"
    header: str = "\n\n**Final Answer**\n"
    think_end: str = "</think>"
    temperature: float = 1.0
    top_p: float = 1.0
    summary_temperature: float = 1.0
    seed: int = 0


@dataclass
class Trace:
    token_ids: list[int]              # generated thinking tokens, the closing `</think>` included
    logprobs: list[float]
    natural_end: bool                 # closed its thinking by itself
    eos_end: bool = False             # stopped on EOS without closing (scores 0 past its end, as the paper)


@dataclass
class Summary:
    cut: int                          # thinking tokens kept before the inserted tokens
    inserted_ids: list[int]           # forced close (if cut) + header; never trained
    token_ids: list[int]
    logprobs: list[float]
    verdict: Verdict


@dataclass
class AnytimeRollout:
    """One rollout batch, the currency between the rollout and the advantage/learner stages."""

    prompts: list[list[int]]                      # [B]
    golds: list[Any]                              # [B]
    budgets: list[int]                            # [S]
    traces: list[list[Trace]]                     # [B][G]
    summaries: list[list[list[list[Summary]]]]    # [B][G][S][A]
    scores: torch.Tensor                          # [B, G, S, A] in {0, 1}
    prefix_group: torch.Tensor                    # [B, G, S]: equal ids share one summary prompt
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def budget_scores(self) -> torch.Tensor:
        """r_j: mean summary score of each trace at each budget, [B, G, S]."""
        return self.scores.mean(-1)

    def accuracy_per_budget(self) -> list[float]:
        return self.scores.mean(dim=(0, 1, 3)).tolist()

    def failure_reasons(self) -> Counter:
        return Counter(s.verdict.reason for b in self.summaries for g in b for j in g for s in j)

    def thinking_lengths(self) -> list[int]:
        return [len(t.token_ids) for per_prompt in self.traces for t in per_prompt]


def segment_index(length: int, budgets: Sequence[int]) -> list[int]:
    """Budget segment of each thinking token: token t (1-based) is in segment j = min{j: b_j ≥ t}."""
    out, j = [], 0
    for t in range(1, length + 1):
        while j < len(budgets) - 1 and budgets[j] < t:
            j += 1
        out.append(j)
    return out


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def token_id_of(tokenizer: Any, text: str) -> int:
    """The single token id of a marker such as `</think>`; an error if it is not one token."""
    ids = _encode(tokenizer, text)
    if len(ids) != 1:
        raise ValueError(f"{text!r} is {len(ids)} tokens for this tokenizer; the thinking end marker must be one "
                         "token (set summary.think_end to the model's own marker)")
    return ids[0]


class AnytimeRolloutRunner:
    """Runs anytime rollouts for batches of prompts on one engine with one verifier."""

    def __init__(self, engine: RolloutEngine, tokenizer: Any, scorer: RewardScorer, settings: AnytimeSettings):
        self.engine, self.tokenizer, self.scorer, self.settings = engine, tokenizer, scorer, settings
        self.think_end_id = token_id_of(tokenizer, settings.think_end)
        self.close_ids = _encode(tokenizer, settings.close_text)
        self.header_ids = _encode(tokenizer, settings.header)
        eos = tokenizer.eos_token_id
        self.eos_ids = tuple(sorted({eos} if isinstance(eos, int) else set(eos or ())))
        budgets = list(settings.budgets)
        if any(b >= c for b, c in zip(budgets, budgets[1:])) or not budgets or budgets[0] <= 0:
            raise ValueError(f"budgets must be positive and strictly increasing, got {budgets}")
        self._check_lengths(budgets)

    def _check_lengths(self, budgets: Sequence[int]) -> None:
        extra = len(self.close_ids) + len(self.header_ids) + self.settings.summary_max_tokens
        limit = self.engine.max_model_len
        if budgets[-1] + extra >= limit:
            raise ValueError(f"the largest budget {budgets[-1]} plus {extra} summary tokens does not fit the engine's "
                             f"max model length {limit}; lower the budgets or raise rollout.max_model_len")

    def summary_plan(self, trace: Trace, budgets: Sequence[int]) -> tuple[list[Branch], list[int]]:
        """The branch (cut + inserted tokens) of every budget and its prefix-group id."""
        content = len(trace.token_ids) - (1 if trace.eos_end else 0)
        branches: list[Branch] = []
        groups: list[int] = []
        seen: dict[Branch, int] = {}
        for b in budgets:
            if trace.natural_end and len(trace.token_ids) <= b:
                branch = Branch(len(trace.token_ids), tuple(self.header_ids))
            else:
                branch = Branch(min(b, content), tuple(self.close_ids + self.header_ids))
            groups.append(seen.setdefault(branch, len(seen)))
            branches.append(branch)
        return branches, groups

    def summary_text(self, trace: Trace, branch: Branch, summary_ids: Sequence[int]) -> str:
        """What the verifier reads: everything after the thinking, from its one `</think>` on (the
        model's own closing token when it ended by itself, else the forced close) to the summary."""
        own_close = [self.think_end_id] if trace.natural_end and branch.cut == len(trace.token_ids) else []
        ids = [t for t in summary_ids if t not in self.eos_ids]
        return self.tokenizer.decode(own_close + list(branch.suffix) + ids, skip_special_tokens=False)

    def run(self, prompts: Sequence[Sequence[int]], golds: Sequence[Any], budgets: Sequence[int] | None = None,
            seed: int | None = None) -> AnytimeRollout:
        s = self.settings
        budgets = list(s.budgets if budgets is None else budgets)
        self._check_lengths(budgets)
        if len(prompts) != len(golds):
            raise ValueError(f"{len(prompts)} prompts but {len(golds)} gold answers")
        seed = s.seed if seed is None else seed
        timings: dict[str, float] = {}

        start = time.perf_counter()
        thinking = self.engine.generate(
            prompts, SamplingConfig(max_new_tokens=budgets[-1], n=s.traces_per_prompt, temperature=s.temperature,
                                    top_p=s.top_p, stop_token_ids=(self.think_end_id, *self.eos_ids), seed=seed))
        timings["gen"] = time.perf_counter() - start
        traces = [[Trace(list(c.token_ids), list(c.logprobs),
                         natural_end=bool(c.token_ids) and c.token_ids[-1] == self.think_end_id,
                         eos_end=bool(c.token_ids) and c.token_ids[-1] in self.eos_ids)
                   for c in per_prompt] for per_prompt in thinking]

        prefixes, branch_lists, plans = [], [], []
        for p, per_prompt in zip(prompts, traces):
            for trace in per_prompt:
                branches, groups = self.summary_plan(trace, budgets)
                prefixes.append(list(p) + trace.token_ids)
                branch_lists.append([Branch(len(p) + br.cut, br.suffix) for br in branches])
                plans.append((branches, groups))
        start = time.perf_counter()
        sampled = self.engine.generate_branches(
            prefixes, branch_lists,
            SamplingConfig(max_new_tokens=s.summary_max_tokens, n=s.summaries_per_budget,
                           temperature=s.summary_temperature, top_p=s.top_p, stop_token_ids=self.eos_ids, seed=seed + 1))
        timings["summaries"] = time.perf_counter() - start

        texts, gold_list = [], []
        flat: list[tuple[int, int, int, int, Branch, Any]] = []
        for k, ((branches, _), per_branch) in enumerate(zip(plans, sampled)):
            b_idx, g_idx = divmod(k, s.traces_per_prompt)
            trace = traces[b_idx][g_idx]
            for j, (branch, completions) in enumerate(zip(branches, per_branch)):
                for a, comp in enumerate(completions):
                    texts.append(self.summary_text(trace, branch, comp.token_ids))
                    gold_list.append(golds[b_idx])
                    flat.append((b_idx, g_idx, j, a, branch, comp))
        start = time.perf_counter()
        verdicts = self.scorer.score(texts, gold_list)
        timings["reward"] = time.perf_counter() - start

        B, G, S, A = len(prompts), s.traces_per_prompt, len(budgets), s.summaries_per_budget
        scores = torch.zeros(B, G, S, A)
        summaries: list[list[list[list[Summary | None]]]] = [[[[None] * A for _ in range(S)] for _ in range(G)]
                                                             for _ in range(B)]
        for (b_idx, g_idx, j, a, branch, comp), verdict in zip(flat, verdicts):
            trace = traces[b_idx][g_idx]
            if trace.eos_end and branch.cut >= len(trace.token_ids) - 1:
                verdict = Verdict(0.0, "bad_format", verdict.parsed)  # EOS inside thinking scores 0 (paper)
            scores[b_idx, g_idx, j, a] = verdict.score
            summaries[b_idx][g_idx][j][a] = Summary(branch.cut, list(branch.suffix), list(comp.token_ids),
                                                    list(comp.logprobs), verdict)
        groups = torch.tensor([plan[1] for plan in plans], dtype=torch.long).view(B, G, S)
        return AnytimeRollout([list(p) for p in prompts], list(golds), budgets, traces, summaries,  # type: ignore[arg-type]
                              scores, groups, timings)
