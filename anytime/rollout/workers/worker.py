"""A rollout worker: one engine, one verifier and the anytime rollout behind one call,
`worker.rollout(prompts, golds, step) -> ScoredRollout` (traces, cuts, summaries and their scores;
the advantages and training rows are the trainer's), and the learner's weights coming back to it.
Other work on the same engine (the trainer's held-out eval) is handed in as a function:
`worker.apply(fn)` runs `fn(worker)` where the worker lives.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from anytime.batch.anytime_rollout import Draw, ScoredRollout, rollout_sums
from anytime.batch.step_sums import StepSums
from anytime.core.stats import add_sums
from anytime.rollout.workers.dynamic_sampling import draw_mixed_groups
from anytime.rollout.workers.inflight import WeightMailbox, version_sums
from anytime.rollout.runner import AnytimeRolloutRunner
from anytime.rollout.settings import engine_max_len, training_settings

if TYPE_CHECKING:
    from anytime.config import Recipe
    from anytime.config.placement_plan import PlacementPlan
    from anytime.batch.weight_snapshot import WeightSnapshot

log = logging.getLogger(__name__)
T = TypeVar("T")


class RolloutWorker:
    """Everything between prompts and their scored rollout for one engine."""

    def __init__(self, recipe: Recipe, plan: PlacementPlan, model_path: str, tokenizer: Any) -> None:
        from anytime.reward.verifier import RewardScorer
        from anytime.rollout.engines.engine import create_engine

        r = recipe
        self.recipe, self.plan, self.tokenizer = recipe, plan, tokenizer
        kwargs: dict[str, Any] = {"logprobs": r.rollout.logprobs}
        if r.rollout.engine == "vllm":
            kwargs.update(frontend=r.rollout.vllm_frontend, own_process=plan.engine_core_apart)
        if r.rollout.engine == "vllm" and torch.cuda.is_available():
            kwargs["gpu_memory_utilization"] = r.rollout.gpu_memory_utilization
            kwargs["enable_sleep_mode"] = r.rollout.enable_sleep
        inflight = r.rollout.staleness_mode == "inflight"
        if r.rollout.engine == "vllm" and plan.lora_weights == "adapter":   # vLLM serves the adapter itself
            kwargs["max_lora_rank"] = r.learner.lora.rank
        if r.rollout.engine == "vllm" and inflight:
            # a swap lands between two engine steps: none may leave a batch running (GPU; off on the CPU)
            kwargs["async_scheduling"] = False
        self.engine = create_engine(r.rollout.engine, model_path, max_model_len=engine_max_len(r, tokenizer),
                                    max_prompt_len=r.data.max_prompt_len, dtype=r.model.dtype, seed=r.trainer.seed,
                                    **kwargs)
        settings = training_settings(r)
        self.scorer = RewardScorer(header=settings.format.verifier_header, think_end=settings.format.think_end)
        self.runner = AnytimeRolloutRunner(self.engine, tokenizer, self.scorer, settings)
        self.mailbox: WeightMailbox | None = None
        if inflight:
            if not self.engine.supports_inflight_updates:
                raise ValueError(f"`rollout.staleness_mode: inflight` needs an engine that takes weights between "
                                 f"decoding steps; the {r.rollout.engine} engine does not: use rollout.engine=hf or vllm")
            self.mailbox = WeightMailbox()
            self.engine.weight_source = self.mailbox.take
        self._merged_logged = False
        self._idle_since: float | None = None   # when the last rollout ended (its wait for the next one)

    def rollout(self, prompts: Sequence[Sequence[int]], golds: Sequence[Any], step: int,
                prompt_index: Sequence[int] | None = None, num_prompts: int | None = None,
                min_version: int = 0) -> ScoredRollout:
        """One step's rollout of some of its prompts: traces, summaries and scores.

        `prompt_index` places these prompts in the whole step (their seeds and rows follow it) and
        `num_prompts` is the step's size. With dynamic sampling each prompt is a slot's candidates
        (golds likewise) and the draws say which groups fill which slot. With in-flight weights the
        rollout first waits for `min_version` (step − k) to be in hand."""
        r = self.recipe
        index = list(range(len(prompts))) if prompt_index is None else list(prompt_index)
        start = time.perf_counter()
        waited = {} if self._idle_since is None else {"rollout_wait": start - self._idle_since}
        swaps, swap_s = self.engine.swaps, self.engine.swap_seconds
        self.wait_for_version(min_version)
        seed = r.trainer.seed * 1_000_003 + step
        num_prompts = len(index) if num_prompts is None else num_prompts
        if r.rollout.dynamic_sampling:
            found = draw_mixed_groups(lambda p, g, i: self.runner.run(p, g, seed=seed, prompt_index=i), prompts, golds,
                                      index, num_prompts, r.rollout.dynamic_sampling_max_draws)
            draws = [Draw(*d) for d in zip(found.drawn, found.kept, found.kept_slots)]
        else:
            rollout = self.runner.run(prompts, golds, seed=seed, prompt_index=index)
            draws = [Draw(rollout, list(range(len(index))), index)]
        timings: dict[str, float] = {}
        sums = StepSums()
        for draw in draws:
            add_sums(timings, draw.rollout.timings)
            sums = sums + rollout_sums(draw.rollout) + version_sums(draw.rollout, step)
        if self.mailbox is not None:
            timings["weight_swap"] = self.engine.swap_seconds - swap_s
            sums.weight_swaps = float(self.engine.swaps - swaps)
        if r.rollout.dynamic_sampling:
            sums = sums + found.counts()
        sums.rollout_seconds = time.perf_counter() - start
        self._idle_since = time.perf_counter()
        return ScoredRollout(draws, num_prompts, sums, {**timings, **waited})

    def apply(self, fn: Callable[[RolloutWorker], T]) -> T:
        """`fn(self)`: work on this worker's engine, verifier and tokenizer handed in by a caller above
        the rollout layer (the trainer's held-out eval), so the rollout never imports it."""
        return fn(self)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        self.engine.update_weights(named_tensors)
        self.engine.took_version(version)

    def offer_weights(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """In-flight weights: the engine takes them at its next decoding step (safe from another thread)."""
        if self.mailbox is None:
            raise RuntimeError("offer_weights is for `rollout.staleness_mode: inflight`; use update_weights")
        self.mailbox.offer(version, named_tensors)

    def wait_for_version(self, version: int) -> None:
        """Until this worker's engine holds `version` or will take it at its next step (in-flight only)."""
        if self.mailbox is not None:
            self.mailbox.wait_for(version, self.engine.version, timeout_s=3600)

    def load(self, weights: WeightSnapshot) -> int:
        """The learner's weights into this worker's engine, as the plan shaped them: a LoRA adapter's factors
        (the engine merges them itself) or full weights. Returns the bytes handed over."""
        if weights.adapter is not None:
            self.engine.update_adapter(weights.adapter)
        else:
            if self.recipe.learner.lora.rank and not self._merged_logged:
                log.info("the %s engine takes full weights: the LoRA adapter is merged into the base for every "
                         "weight sync (sync bytes are the full model's)", self.recipe.rollout.engine)
                self._merged_logged = True
            self.engine.update_weights(weights.state.items())
        self.engine.took_version(weights.version)
        return weights.nbytes

    def sleep(self) -> None:
        """Free the engine's accelerator memory for the learner update (vLLM sleep mode on a GPU)."""
        self.engine.sleep()

    def wake_up(self) -> None:
        self.engine.wake_up()

    def close(self) -> None:
        self.scorer.close()
        self.engine.close()
