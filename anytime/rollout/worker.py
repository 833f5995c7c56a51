"""A rollout worker: one engine, one verifier, the anytime rollout, the advantage estimators and the
train-batch builder behind one call, `worker.rollout(prompts, golds, step) -> (TrainBatch, metrics)`,
and the learner's weights coming back to it. Other work on the same engine (the trainer's held-out
eval) is handed in as a function: `worker.apply(fn)` runs `fn(worker)` where the worker lives.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from anytime.algo.advantages import summary_advantages_by_name, thinking_advantages
from anytime.algo.budget import anytime_score
from anytime.batch.anytime_rollout import AnytimeRollout
from anytime.batch.packing import build_train_batch
from anytime.batch.train_batch import TrainBatch
from anytime.core.stats import add_sums
from anytime.rollout.dynamic_sampling import draw_mixed_groups, dynamic_metrics
from anytime.rollout.inflight import WeightMailbox, version_sums
from anytime.rollout.runner import AnytimeRolloutRunner
from anytime.rollout.settings import engine_max_len, training_settings

if TYPE_CHECKING:
    from anytime.config import Recipe

log = logging.getLogger(__name__)
T = TypeVar("T")


def adapter_of(learner: Any) -> Any:
    """A LoRA learner's adapter factors (`anytime.learner.lora.AdapterUpdate`), None for any other
    learner. Not collective: LoRA learners hold their whole model on every rank."""
    update = getattr(learner, "adapter_update", None)
    return update() if update is not None else None


def rollout_sums(rollout: AnytimeRollout, t_adv: torch.Tensor, s_adv: torch.Tensor, rows: int) -> dict[str, float]:
    """The rollout's metrics as sums and counts, so the metrics of several workers add up exactly."""
    B, G, S, A = rollout.scores.shape
    sums = {f"acc_sum/{j}": float(rollout.scores[:, :, j].sum()) for j in range(S)}
    sums.update({
        "summaries_per_budget": float(B * G * A), "traces": float(B * G),
        "think_len_sum": float(rollout.think_len.sum()), "closed_sum": float(rollout.natural_end.sum()),
        "t_adv_sum": float(t_adv.sum()), "t_adv_abs_sum": float(t_adv.abs().sum()), "t_adv_n": float(t_adv.numel()),
        "s_adv_abs_sum": float(s_adv.abs().sum()), "s_adv_n": float(s_adv.numel()), "rows": float(rows),
        "tokens": float(rollout.think_len.sum() + rollout.summary_len.sum()),
    })
    sums.update({f"reason/{k}": float(v) for k, v in rollout.failure_reasons().items()})
    return sums


def rollout_metrics(sums: dict[str, float], budgets: Sequence[int], probs: Sequence[float]) -> dict[str, float]:
    """The step's rollout metrics from the (added-up) sums of its workers."""
    acc = [sums[f"acc_sum/{j}"] / sums["summaries_per_budget"] for j in range(len(budgets))]
    metrics = {f"train/acc@{b}": a for b, a in zip(budgets, acc)}
    metrics["train/anytime_score"] = anytime_score(acc, probs)
    metrics["train/think_len"] = sums["think_len_sum"] / sums["traces"]
    metrics["train/think_closed_frac"] = sums["closed_sum"] / sums["traces"]
    metrics["adv/thinking_mean"] = sums["t_adv_sum"] / sums["t_adv_n"]
    metrics["adv/thinking_abs"] = sums["t_adv_abs_sum"] / sums["t_adv_n"]
    metrics["adv/summary_abs"] = sums["s_adv_abs_sum"] / sums["s_adv_n"]
    reasons = {k.split("/", 1)[1]: v for k, v in sums.items() if k.startswith("reason/") and v}
    for reason, count in reasons.items():
        metrics[f"verifier/{reason}"] = count / sum(reasons.values())
    metrics["train/rows"] = int(sums["rows"])
    if "dynamic/drawn" in sums:
        metrics.update(dynamic_metrics(sums))
    if "token_lag_n" in sums:   # in-flight weights: each token's own staleness
        metrics["rollout/token_version_lag"] = sums["token_lag_sum"] / max(sums["token_lag_n"], 1.0)
        metrics["rollout/token_version_lag_max"] = sums["max/token_lag"]
        metrics["rollout/mixed_version_traces"] = sums["mixed_version_traces"] / sums["traces"]
        metrics["rollout/weight_swaps"] = sums["weight_swaps"]
    return metrics


class RolloutWorker:
    """Everything between prompts and a `TrainBatch` for one engine (rank 0 of the learners owns it)."""

    def __init__(self, recipe: Recipe, model_path: str, tokenizer: Any, pad_id: int) -> None:
        from anytime.reward.verifier import RewardScorer
        from anytime.rollout.engine import create_engine

        r = recipe
        self.recipe, self.tokenizer, self.pad_id = recipe, tokenizer, pad_id
        self.probs = r.budget.prior_probs()
        kwargs: dict[str, Any] = {"logprobs": r.rollout.logprobs}
        if r.rollout.engine == "vllm":
            kwargs["frontend"] = r.rollout.vllm_frontend
        if r.rollout.engine == "vllm" and torch.cuda.is_available():
            kwargs["gpu_memory_utilization"] = r.rollout.gpu_memory_utilization
            kwargs["enable_sleep_mode"] = r.rollout.enable_sleep
        inflight = r.rollout.staleness_mode == "inflight"
        if (r.rollout.engine == "vllm" and r.learner.lora.rank > 0 and r.rollout.placement != "ray" and not inflight
                and r.learner.lora.vllm_serves_adapter(torch.cuda.is_available())):
            # vLLM serves the adapter itself (Ray actors and in-flight swaps take merged full weights)
            kwargs["max_lora_rank"] = r.learner.lora.rank
        if r.rollout.engine == "vllm" and inflight:
            # a swap lands between two engine steps: none may leave a batch running (GPU; off on the CPU)
            kwargs["async_scheduling"] = False
        self.engine = create_engine(r.rollout.engine, model_path, max_model_len=engine_max_len(r, tokenizer),
                                    max_prompt_len=r.data.max_prompt_len, dtype=r.model.dtype, seed=r.trainer.seed,
                                    **kwargs)
        self.scorer = RewardScorer(header=r.summary.header.strip(), think_end=r.summary.think_end)
        self.runner = AnytimeRolloutRunner(self.engine, tokenizer, self.scorer, training_settings(r))
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
                min_version: int = 0) -> tuple[TrainBatch, dict[str, float], dict[str, float]]:
        """One step's rollout of some of its prompts → (train batch, metric sums, stage timings).

        `prompt_index` places these prompts in the whole step (its seeds and mini-batches follow it)
        and `num_prompts` is the step's size; the batch's prompt indices are global. Metric sums of
        several workers add up (see `rollout_metrics`). With in-flight weights the rollout first waits
        for `min_version` (step − k) to be in hand."""
        r = self.recipe
        index = list(range(len(prompts))) if prompt_index is None else list(prompt_index)
        start = time.perf_counter()
        waited = {} if self._idle_since is None else {"rollout_wait": start - self._idle_since}
        swaps, swap_s = self.engine.swaps, self.engine.swap_seconds
        self.wait_for_version(min_version)
        seed = r.trainer.seed * 1_000_003 + step
        num_prompts = len(index) if num_prompts is None else num_prompts
        if r.rollout.dynamic_sampling:   # each prompt is a slot's candidates, golds likewise
            draws = draw_mixed_groups(lambda p, g, i: self.runner.run(p, g, seed=seed, prompt_index=i), prompts, golds,
                                      index, num_prompts, r.rollout.dynamic_sampling_max_draws)
            rollouts, kept, slots = draws.drawn, draws.kept, draws.kept_slots
        else:
            rollouts = [self.runner.run(prompts, golds, seed=seed, prompt_index=index)]
            kept, slots = [list(range(len(index)))], [index]
        timings: dict[str, float] = {}
        adv_seconds, batches, sums = 0.0, [], {}
        for rollout, keep, slot in zip(rollouts, kept, slots):
            add_sums(timings, rollout.timings)
            adv_start = time.perf_counter()
            batch, part = self._train_rows(rollout, keep, slot, num_prompts)
            batches.append(batch)
            add_sums(sums, part)
            if self.mailbox is not None:
                add_sums(sums, version_sums(rollout, step))
            adv_seconds += time.perf_counter() - adv_start
        batch = batches[0] if len(batches) == 1 else TrainBatch.concat(batches)
        timings["adv"] = adv_seconds
        if self.mailbox is not None:
            timings["weight_swap"] = self.engine.swap_seconds - swap_s
            sums["weight_swaps"] = float(self.engine.swaps - swaps)
        # `train/rows` counts trained sequences (a thinking trace or a summary), whatever the layout
        sums["rows"] = float(batch.sequences.sum())
        if r.rollout.dynamic_sampling:
            sums.update(draws.counts())
        sums["rollout_seconds"] = time.perf_counter() - start
        self._idle_since = time.perf_counter()
        return batch, sums, {**timings, **waited}

    def _train_rows(self, rollout: AnytimeRollout, keep: list[int], slots: list[int], num_prompts: int
                    ) -> tuple[TrainBatch, dict[str, float]]:
        """The rows of the kept groups of `rollout` under their slots in the step, and the metric sums
        of every group it drew. Advantages are computed per group, so on the whole draw."""
        r = self.recipe
        scores = rollout.budget_scores.double()  # [B, G, S]
        t_adv = thinking_advantages(r.algorithm.estimator, scores, self.probs, decay=r.algorithm.decay,
                                    variant=r.algorithm.variance_reduction)
        s_adv = summary_advantages_by_name(r.summary.estimator, rollout.scores.double(), rollout.prefix_group)
        whole = keep == list(range(len(rollout.golds)))
        chosen = rollout if whole else rollout.select_prompts(keep)
        batch = build_train_batch(chosen, t_adv[keep], s_adv[keep], thinking_weight=r.algorithm.thinking_loss_weight,
                                  summary_weight=r.summary.loss_weight, summary_max_tokens=r.summary.max_tokens,
                                  drop_zero_rows=r.algorithm.kl_coef == 0 and r.algorithm.entropy_coef == 0,
                                  pad_id=self.pad_id, pack=r.learner.pack_summaries)
        return batch.reindexed(slots, num_prompts), rollout_sums(rollout, t_adv, s_adv, 0)

    def apply(self, fn: Callable[[RolloutWorker], T]) -> T:
        """`fn(self)`: work on this worker's engine, verifier and tokenizer handed in by a caller above
        the rollout layer (the trainer's held-out eval), so the rollout never imports it."""
        return fn(self)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.engine.update_weights(named_tensors)

    def offer_weights(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """In-flight weights: the engine takes them at its next decoding step (safe from another thread)."""
        if self.mailbox is None:
            raise RuntimeError("offer_weights is for `rollout.staleness_mode: inflight`; use update_weights")
        self.mailbox.offer(version, named_tensors)

    def wait_for_version(self, version: int) -> None:
        """Until this worker's engine holds `version` or will take it at its next step (in-flight only)."""
        if self.mailbox is not None:
            self.mailbox.wait_for(version, self.engine.version, timeout_s=3600)

    def sync_adapter(self, learner: Any, update: Sequence[tuple[str, torch.Tensor, torch.Tensor, float]]) -> int:
        """A LoRA learner's weights into this worker's engine: only the adapter's factors (`update`)
        when the engine merges them itself, else the full merged weights. Returns the bytes handed over."""
        if self.engine.accepts_adapters:
            self.engine.update_adapter(update)
            return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for _, a, b, _ in update)
        if not self._merged_logged:
            log.info("the %s engine takes full weights: the LoRA adapter is merged into the base for every weight "
                     "sync (sync bytes are the full model's)", self.recipe.rollout.engine)
            self._merged_logged = True
        state = learner.full_state_dict()
        self.engine.update_weights(state.items())
        return sum(t.numel() * t.element_size() for t in state.values())

    def sleep(self) -> None:
        """Free the engine's accelerator memory for the learner update (vLLM sleep mode on a GPU)."""
        self.engine.sleep()

    def wake_up(self) -> None:
        self.engine.wake_up()

    def close(self) -> None:
        self.scorer.close()
        self.engine.close()
