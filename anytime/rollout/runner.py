"""The anytime rollout, engine-agnostic: thinking traces → budget cuts → prefix-shared summaries →
verified scores (paper §1).

For each prompt, G traces stop at the tokenizer's `</think>` (or EOS) or at the largest budget. Each
trace is cut at every budget b_j; the summary prompt of a cut is prompt + thinking[:b_j] + close
tokens (only when the trace was really cut) + answer-header tokens. Budgets past a trace's natural
end share one summary prompt (one prefix group). A summaries per budget are sampled through
`engine.generate_anytime`, so engines reuse the trace's prefix (and, where the engine streams, start
as soon as their trace ends), and scored by the verifier.

The engine's `Completion`s and the verifier's `Verdict`s are turned into one `AnytimeRollout`
(`anytime.batch.anytime_rollout`); `anytime.batch.packing` turns that into a `TrainBatch`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from anytime.algo.budget import validate_grid
from anytime.batch.anytime_rollout import AnytimeRollout, eos_zeroed, padded
from anytime.reward.verifier import REASONS, RewardScorer, Verdict
from anytime.rollout.engines.engine import Branch, Completion, RolloutEngine
from anytime.rollout.settings import AnytimeSettings, sampling_configs


class AnytimeRolloutRunner:
    """Runs anytime rollouts for batches of prompts on one engine with one verifier."""

    def __init__(self, engine: RolloutEngine, tokenizer: Any, scorer: RewardScorer, settings: AnytimeSettings):
        self.engine, self.tokenizer, self.scorer, self.settings = engine, tokenizer, scorer, settings
        ids = settings.format.ids(tokenizer)
        self.think_end_id, self.close_ids, self.header_ids = ids.think_end, list(ids.close), list(ids.header)
        self.room_after_cut = settings.format.room_after_cut(tokenizer)
        eos = tokenizer.eos_token_id
        self.eos_ids = tuple(sorted({eos} if isinstance(eos, int) else set(eos or ())))
        validate_grid(settings.budgets)
        self._check_lengths(settings.budgets)

    def _check_lengths(self, budgets: Sequence[int]) -> None:
        limit = self.engine.max_model_len
        if budgets[-1] + self.room_after_cut >= limit:
            raise ValueError(f"the largest budget {budgets[-1]} plus {self.room_after_cut} summary tokens does not fit "
                             f"the engine's max model length {limit}; lower the budgets or raise rollout.max_model_len")

    def summary_plan(self, length: int, natural_end: bool, eos_end: bool,
                     budgets: Sequence[int]) -> tuple[list[Branch], list[int]]:
        """The branch (cut + inserted tokens) of every budget for a trace of `length` tokens, and
        its prefix-group id.

        A trace that stopped on EOS is really cut at every budget below its length (scored as
        usual); the budgets at or past the EOS score 0 (`eos_zeroed`) and form their own group,
        even though their summary prompt (the trace without its EOS) equals the last real cut's."""
        content = length - (1 if eos_end else 0)
        branches: list[Branch] = []
        groups: list[int] = []
        seen: dict[tuple[Branch, bool], int] = {}
        for b in budgets:
            if natural_end and length <= b:
                branch = Branch(length, tuple(self.header_ids))
            else:
                branch = Branch(min(b, content), tuple(self.close_ids + self.header_ids))
            groups.append(seen.setdefault((branch, eos_zeroed(eos_end, length, b)), len(seen)))
            branches.append(branch)
        return branches, groups

    def summary_text(self, own_close: bool, branch: Branch, summary_ids: Sequence[int]) -> str:
        """What the verifier reads: everything after the thinking, from its one `</think>` on (the
        model's own closing token when `own_close`, i.e. the trace ended by itself before the cut,
        else the forced close) to the summary."""
        ids = [t for t in summary_ids if t not in self.eos_ids]
        head = [self.think_end_id] if own_close else []
        return self.tokenizer.decode(head + list(branch.suffix) + ids, skip_special_tokens=False)

    def run(self, prompts: Sequence[Sequence[int]], golds: Sequence[Any], budgets: Sequence[int] | None = None,
            seed: int | None = None, prompt_index: Sequence[int] | None = None) -> AnytimeRollout:
        """`prompt_index`: each prompt's index in the whole step (default 0..B-1). Every sampled
        sequence is seeded from it, so a prompt samples the same traces and summaries whichever worker
        rolls it out and whatever else that worker serves (unless `settings.seed_requests` is off)."""
        s = self.settings
        budgets = list(s.budgets if budgets is None else budgets)
        validate_grid(budgets)
        self._check_lengths(budgets)
        if len(prompts) != len(golds):
            raise ValueError(f"{len(prompts)} prompts but {len(golds)} gold answers")
        seed = s.seed if seed is None else seed
        B, G = len(prompts), s.traces_per_prompt
        index = list(range(B)) if prompt_index is None else [int(i) for i in prompt_index]
        if len(index) != B:
            raise ValueError(f"{len(index)} prompt indices for {B} prompts")
        timings: dict[str, float] = {}

        plans: list[tuple[list[Branch], list[int]]] = [([], [])] * (B * G)
        natural, eos = [False] * (B * G), [False] * (B * G)

        def plan(k: int, trace: Completion) -> list[Branch]:
            """Trace k's summary branches, asked for by the engine as soon as the trace ends."""
            plans[k], natural[k], eos[k] = self._trace_plan(trace.token_ids, budgets)
            offset = len(prompts[k // G])
            return [Branch(offset + br.cut, br.suffix) for br in plans[k][0]]

        thinking, summary = sampling_configs(s, budgets, seed, index, (self.think_end_id, *self.eos_ids), self.eos_ids)
        out = self.engine.generate_anytime(prompts, thinking, plan, summary)
        # Streamed summaries overlap the thinking: `gen` runs to the end of the last trace and
        # `summaries` counts only the summary time after it (all of it when the engine runs phases).
        timings["gen"] = out.thinking_s
        timings["summaries"] = out.total_s - out.thinking_s
        traces = [c for per_prompt in out.traces for c in per_prompt]            # [B·G]
        texts, gold_list, summaries = self._summary_texts(plans, natural, traces, out.summaries, golds)
        start = time.perf_counter()
        verdicts = self.scorer.score(texts, gold_list)
        timings["reward"] = time.perf_counter() - start
        self._zero_past_eos(verdicts, eos, traces, budgets)
        assert len(verdicts) == B * G * len(budgets) * s.summaries_per_budget
        return self._rollout(prompts, golds, budgets, traces=traces, summaries=summaries, plans=plans,
                             natural=natural, eos=eos, verdicts=verdicts, texts=texts, timings=timings)

    def _trace_plan(self, ids: Sequence[int],
                    budgets: Sequence[int]) -> tuple[tuple[list[Branch], list[int]], bool, bool]:
        """A finished trace's `summary_plan`, and whether it ended by itself and whether on EOS."""
        natural = bool(ids) and ids[-1] == self.think_end_id
        eos = bool(ids) and ids[-1] in self.eos_ids
        if eos and self.settings.format.eos_ends_thinking:
            # an instruct model's EOS ends its thinking: a natural end, whose summaries are forced
            # after the trace without its EOS (close + header) at every budget past it
            return self.summary_plan(len(ids) - 1, False, False, budgets), True, False
        return self.summary_plan(len(ids), natural, eos, budgets), natural, eos

    def _summary_texts(self, plans: Sequence[tuple[list[Branch], list[int]]], natural: Sequence[bool],
                       traces: Sequence[Completion], sampled: Sequence[Sequence[Sequence[Completion]]],
                       golds: Sequence[Any]) -> tuple[list[str], list[Any], list[Completion]]:
        """The verifier's inputs, one per summary [B·G·S·A]: its text, its gold answer, and the summary."""
        G = self.settings.traces_per_prompt
        texts, gold_list, summaries = [], [], []
        for k, ((branches, _), per_branch) in enumerate(zip(plans, sampled)):
            length = len(traces[k].token_ids)
            for branch, completions in zip(branches, per_branch):
                for comp in completions:
                    texts.append(self.summary_text(natural[k] and branch.cut == length, branch, comp.token_ids))
                    gold_list.append(golds[k // G])
                    summaries.append(comp)
        return texts, gold_list, summaries

    def _zero_past_eos(self, verdicts: list[Verdict], eos: Sequence[bool], traces: Sequence[Completion],
                       budgets: Sequence[int]) -> None:
        """EOS inside the thinking scores 0 at the budgets at or past it (the official code's rule)."""
        S, A = len(budgets), self.settings.summaries_per_budget
        for i, verdict in enumerate(verdicts):
            k, j = divmod(i // A, S)
            if eos_zeroed(eos[k], len(traces[k].token_ids), budgets[j]):
                verdicts[i] = Verdict(0.0, "bad_format", verdict.parsed)

    def _rollout(self, prompts: Sequence[Sequence[int]], golds: Sequence[Any], budgets: list[int], *,
                 traces: Sequence[Completion], summaries: Sequence[Completion],
                 plans: Sequence[tuple[list[Branch], list[int]]], natural: Sequence[bool], eos: Sequence[bool],
                 verdicts: Sequence[Verdict], texts: list[str], timings: dict[str, float]) -> AnytimeRollout:
        """Everything sampled and scored, as padded [B, G, S, A] tensors."""
        B, G, S, A = len(prompts), self.settings.traces_per_prompt, len(budgets), self.settings.summaries_per_budget
        cuts = [br.cut for branches, _ in plans for br in branches]
        # each token's weight version: its own where the engine swaps weights mid-generation, else the
        # version the engine held for the whole rollout
        held = self.engine.version
        own = all(len(c.versions) == len(c.token_ids) for c in (*traces, *summaries))
        think_v = [c.versions if own else [held] * len(c.token_ids) for c in traces]
        summary_v = [c.versions if own else [held] * len(c.token_ids) for c in summaries]
        versions = {"think_versions": padded(think_v, torch.long, (B, G)),
                    "summary_versions": padded(summary_v, torch.long, (B, G, S, A))}
        return AnytimeRollout(
            budgets=budgets, golds=list(golds),
            prompt_ids=padded(prompts, torch.long, (B,)),
            prompt_len=torch.tensor([len(p) for p in prompts], dtype=torch.long),
            think_ids=padded([c.token_ids for c in traces], torch.long, (B, G)),
            think_logprobs=padded([c.logprobs for c in traces], torch.float32, (B, G)),
            think_len=torch.tensor([len(c.token_ids) for c in traces], dtype=torch.long).view(B, G),
            natural_end=torch.tensor(natural, dtype=torch.bool).view(B, G),
            eos_end=torch.tensor(eos, dtype=torch.bool).view(B, G),
            cut=torch.tensor(cuts, dtype=torch.long).view(B, G, S),
            forced_close=torch.tensor([len(br.suffix) > len(self.header_ids) for bs, _ in plans for br in bs],
                                      dtype=torch.bool).view(B, G, S),
            prefix_group=torch.tensor([plan[1] for plan in plans], dtype=torch.long).view(B, G, S),
            summary_ids=padded([c.token_ids for c in summaries], torch.long, (B, G, S, A)),
            summary_logprobs=padded([c.logprobs for c in summaries], torch.float32, (B, G, S, A)),
            summary_len=torch.tensor([len(c.token_ids) for c in summaries], dtype=torch.long).view(B, G, S, A),
            scores=torch.tensor([v.score for v in verdicts], dtype=torch.float32).view(B, G, S, A),
            reasons=torch.tensor([REASONS.index(v.reason) for v in verdicts], dtype=torch.long).view(B, G, S, A),
            answers=[v.parsed for v in verdicts], texts=texts,
            close_ids=tuple(self.close_ids), header_ids=tuple(self.header_ids), timings=timings, **versions)
