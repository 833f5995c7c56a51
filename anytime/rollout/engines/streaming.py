"""Streamed anytime generation, engine-agnostic: the bookkeeping that lets an engine queue a trace's
summary requests the moment that trace ends, while other traces still think (the official code's
schedule: summaries fill the batch during the long tail of slow traces instead of waiting for it).

An engine that streams submits `AnytimeStream.requests()`, reports every finished sample to
`finished`, submits the requests that returns right away, and calls `result()` once none is left.
Seeds are those of the two-phase default (`RolloutEngine.generate_anytime`): a trace's request
seed is its prompt's, a branch's is its index in prefix-major order, so both schedules sample the
same tokens when the engine's samples depend on their seeds only.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from anytime.rollout.engines.engine import AnytimeGeneration, Completion, PlanFn, RolloutEngine, SamplingConfig, planned


@dataclass(frozen=True)
class Request:
    """One prompt to sample `params.n` times; the engine serves each sample and reports it."""

    key: tuple[int, ...]      # (i,): the thinking of prompt i; (k, j): branch j of trace k
    prompt: list[int]
    seed: int | None          # the request's seed (the engine derives one per sample from it)
    params: SamplingConfig


class AnytimeStream:
    """One `generate_anytime` call whose summaries start as soon as their trace ends."""

    def __init__(self, engine: RolloutEngine, prompts: Sequence[Sequence[int]], thinking: SamplingConfig,
                 plan: PlanFn, summary: SamplingConfig) -> None:
        engine._check_prompts(prompts, thinking)  # before anything is generated
        self.engine, self.plan, self.thinking, self.summary = engine, plan, thinking, summary
        self.prompts = [list(p) for p in prompts]
        self.start = time.perf_counter()
        self.num_traces = len(self.prompts) * thinking.n
        self.traces: list[list[Completion | None]] = [[None] * thinking.n for _ in self.prompts]
        self.summaries: list[list[list[Completion | None]]] = [[] for _ in range(self.num_traces)]
        self.traces_left = self.num_traces
        self.thinking_s = 0.0
        self.branches_per_trace: int | None = None
        self.summary_seeds: list[int] | None = None

    def requests(self) -> list[Request]:
        """The thinking requests, one per prompt."""
        seeds = self.thinking.seeds_for(len(self.prompts)) or [None] * len(self.prompts)
        return [Request((i,), p, seed, self.thinking) for i, (p, seed) in enumerate(zip(self.prompts, seeds))]

    def finished(self, request: Request, sample: int, completion: Completion) -> list[Request]:
        """Record a finished sample; a finished trace returns its summary requests, to submit now."""
        if len(request.key) == 2:
            k, j = request.key
            self.summaries[k][j][sample] = completion
            return []
        (i,) = request.key
        k = i * self.thinking.n + sample
        self.traces[i][sample] = completion
        self.traces_left -= 1
        if self.traces_left == 0:
            self.thinking_s = time.perf_counter() - self.start
        prefix = self.prompts[i] + completion.token_ids
        branches = planned(self.plan, k, completion, self.branches_per_trace)
        self.engine._check_branches(k, prefix, branches, self.summary)
        if self.branches_per_trace is None:
            self.branches_per_trace = len(branches)
            self.summary_seeds = self.summary.seeds_for(self.num_traces * len(branches))
        self.summaries[k] = [[None] * self.summary.n for _ in branches]
        first = k * len(branches)
        return [Request((k, j), prefix[: br.cut] + list(br.suffix),
                        None if self.summary_seeds is None else self.summary_seeds[first + j], self.summary)
                for j, br in enumerate(branches)]

    def result(self) -> AnytimeGeneration:
        missing = sum(c is None for per in self.traces for c in per) + \
            sum(c is None for per_trace in self.summaries for per in per_trace for c in per)
        if missing:
            raise RuntimeError(f"the streamed generation ended with {missing} samples missing")
        return AnytimeGeneration(self.traces, self.summaries, self.thinking_s,  # type: ignore[arg-type]
                                 time.perf_counter() - self.start)
