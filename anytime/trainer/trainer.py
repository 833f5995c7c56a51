"""The training loop. One step, in `Trainer.train_step`, each stage under a timer of that name:

rollout (`gen`, `summaries`, `reward`: thinking traces, a summary at every budget cut, verified
scores; on the rollout workers) → advantages (`adv`: thinking advantages by `algorithm.estimator`,
summary advantages by `summary.estimator`) → rows (`pack`: the kept groups as training rows) →
each learner rank's own rows (`scatter`) → old log-probs and off-policy weights (`logprob`) →
PPO update (`update`) → weight sync to the workers (`sync`); then metrics, eval and checkpoints.

A prompt becomes a gradient step through these containers (docs/architecture.md lists them too):
1. `PromptRow` (`anytime.data.prompts`): problem and gold answer, encoded to a prompt's token ids;
2. `Completion` (`anytime.rollout.engines.engine`): one sampled continuation (thinking trace or summary) as
   the engine returns it, requested as `Branch`es of a trace (`AnytimeGeneration` when streamed);
3. `Verdict` (`anytime.reward.verifier`): the verifier's score of one summary;
4. `AnytimeRollout` (`anytime.batch.anytime_rollout`): the traces, cuts, summaries and scores as
   padded tensors [prompt, trace, budget, summary]; a worker returns its share of the step as a
   `ScoredRollout` (its draws, metric sums and timings);
5. `TrainBatch` (`anytime.batch.train_batch`): token rows with thinking / summary / inserted masks,
   per-token advantages and rollout / old log-probs, target-aligned, built by
   `anytime.batch.packing`; every learner rank receives only its own rows, and mini- and
   micro-batches are `TrainBatch`es too (a mini-batch travels as a `MiniBatch`);
6. `LossSpec` (`anytime.algo.loss`): one mini-batch's loss normaliser and PPO-clip settings;
7. `StepResult` (`anytime.learner.base`): the optimizer step's norm, skip and learning rate.

`RolloutWorker`s (engine + verifier) run where `rollout.placement` puts them
(`anytime.rollout.workers.placement`: on learner rank 0, on every learner rank, in processes of their own or
as Ray actors); the `Learner` (torch, DeepSpeed or pipeline) and the one PPO loop
(`anytime.learner.ppo`) train. The held-out eval runs on the first rollout worker's engine
(`anytime.evaluation.in_training`).
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from anytime.batch.anytime_rollout import ScoredRollout
from anytime.config import Recipe
from anytime.core.dist import broadcast_object, rank_world
from anytime.data.prompts import encode_prompts
from anytime.data.sources import load_train_rows
from anytime.evaluation.in_training import evaluate_on_worker
from anytime.evaluation.records import write_samples
from anytime.learner import checkpoint as ckpt
from anytime.learner.factory import build_learner
from anytime.learner.ppo import logprob_mismatch, ppo_update
from anytime.config.placement_plan import placement_plan
from anytime.batch.weight_snapshot import WeightSnapshot
from anytime.rollout.workers.placement import create_rollouts
from anytime.trainer.experience import experience, importance_correction
from anytime.trainer.metrics import MetricsLogger, StageTimer, slowest, step_metrics
from anytime.trainer.rows import RowExchange

log = logging.getLogger(__name__)


@dataclass
class InFlight:
    """A step's rollout submitted ahead of the step (`rollout.max_staleness`): its placement handle
    until collected, then the scored rollouts this rank holds; `version` is the step whose weights
    the workers held."""

    step: int
    version: int
    handle: Any = None
    result: list[ScoredRollout] | None = None


def step_row_indices(step: int, prompts_per_step: int, num_rows: int) -> list[int]:
    """The training rows step `step` rolls out: the next `prompts_per_step`, wrapping around the data."""
    return [(step * prompts_per_step + i) % num_rows for i in range(prompts_per_step)]


def step_candidate_rows(step: int, prompts_per_step: int, draws: int, num_rows: int) -> list[list[int]]:
    """Dynamic sampling: each slot's candidate rows, in draw order. Step `step` takes the next
    `prompts_per_step × draws` rows (the data advances `draws` times as fast as without dynamic
    sampling): the first `prompts_per_step` are draw 0 of the slots, each further block one more draw."""
    first = step * prompts_per_step * draws
    return [[(first + r * prompts_per_step + i) % num_rows for r in range(draws)] for i in range(prompts_per_step)]


def use_deterministic_algorithms() -> None:
    """torch's deterministic algorithms; on CUDA, cuBLAS is deterministic only with a fixed workspace, and
    torch raises at the first matmul without one (CUBLAS_WORKSPACE_CONFIG, read when cuBLAS is called)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def release_cached_device_memory() -> None:
    """Return the blocks torch's CUDA allocator caches for this process to the device (a colocated engine
    is about to wake into that memory); nothing to do on the CPU."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class Trainer:
    def __init__(self, recipe: Recipe, model_path: str):
        from transformers import AutoTokenizer

        self.recipe, self.model_path = recipe, model_path
        self.rank, self.world = rank_world()
        self.out = Path(recipe.trainer.output_dir)
        seed = recipe.trainer.seed
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        if recipe.learner.deterministic:
            use_deterministic_algorithms()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=recipe.model.trust_remote_code)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.learner = build_learner(recipe, model_path)
        self.rows = load_train_rows(recipe)
        self.prompts = encode_prompts(self.tokenizer, self.rows, recipe.data.instruction, recipe.data.max_prompt_len)
        self.timer = StageTimer()
        self.plan = placement_plan(recipe, world=self.world)
        if self.rank == 0:
            log.info("%s", self.plan.describe())
        self.exchange = RowExchange(self.plan, self.learner)   # collective: groups made in one order on every rank
        self.rollouts = create_rollouts(recipe, self.plan, model_path, self.tokenizer, self.learner)
        self._stop_signal: int | None = None
        self._in_flight: deque[InFlight] = deque()   # submitted rollouts, oldest first
        self._weights_version = 0                     # the step whose weights the workers hold

    # --- rollouts, up to `rollout.max_staleness` steps ahead -----------------------------------
    def _submit(self, step: int) -> None:
        ro = self.recipe.rollout
        if ro.dynamic_sampling:   # every slot travels with its candidates (anytime.rollout.workers.dynamic_sampling)
            slots = step_candidate_rows(step, ro.prompts_per_step, ro.dynamic_sampling_max_draws, len(self.rows))
            prompts: list[Any] = [[self.prompts[i] for i in c] for c in slots]
            golds: list[Any] = [[self.rows[i].answer for i in c] for c in slots]
        else:
            idx = step_row_indices(step, ro.prompts_per_step, len(self.rows))
            prompts, golds = [self.prompts[i] for i in idx], [self.rows[i].answer for i in idx]
        handle = self.rollouts.submit(prompts, golds, step)
        self._in_flight.append(InFlight(step, self._weights_version, handle))

    @property
    def rows_per_step(self) -> int:
        ro = self.recipe.rollout
        return ro.prompts_per_step * (ro.dynamic_sampling_max_draws if ro.dynamic_sampling else 1)

    def _collect(self, item: InFlight) -> list[ScoredRollout]:
        if item.result is None:
            item.result, item.handle = self.rollouts.collect(item.handle), None
        return item.result

    def _rollout(self, step: int) -> list[ScoredRollout]:
        """The step's scored rollouts this rank holds (see `Rollouts.collect`). Locked staleness k:
        the rollouts of steps up to step + k are submitted now, with the weights of this step, so
        batch t is generated with the weights of step max(0, t − k) whatever the placement; where
        workers have processes of their own they run while the learner updates."""
        r = self.recipe
        start = time.perf_counter()
        last = self._in_flight[-1].step if self._in_flight else step - 1
        for ahead in range(last + 1, min(step + r.rollout.max_staleness, r.trainer.steps - 1) + 1):
            self._submit(ahead)
        item = self._in_flight.popleft()
        if item.step != step:
            raise RuntimeError(f"the rollout in flight is step {item.step}'s, not step {step}'s")
        shares = self._collect(item)
        self.timer.add("learner_wait", time.perf_counter() - start)
        return shares

    def _settle_in_flight(self) -> list[dict[str, Any]]:
        """Every rollout in flight collected (they stay queued): what this rank holds, to checkpoint."""
        return [{"step": item.step, "version": item.version, "shares": [s.to_state() for s in self._collect(item)]}
                for item in self._in_flight]

    def _restore_in_flight(self, folder: Path, step: int) -> None:
        saved = ckpt.load_in_flight(folder, self.rank)
        if saved is None:
            if self.recipe.rollout.max_staleness:
                log.warning("%s holds no rollouts in flight (saved lock-step): steps after %d are rolled out with its "
                            "weights, not with the earlier ones an unbroken run would have used", folder, step)
            return
        for s in saved:
            if "shares" not in s:
                raise ValueError(f"{folder} holds rollouts in flight as training rows, as anytime saved them before "
                                 "the trainer built the rows itself; resume it with the anytime version that wrote it, "
                                 "or start from its weights with trainer.resume=null and model.path set to "
                                 f"{folder / 'model'}")
            self._in_flight.append(InFlight(s["step"], s["version"],
                                            result=[ScoredRollout.from_state(x) for x in s["shares"]]))

    def train_step(self, step: int) -> dict[str, Any]:
        """One step of the method, each stage under its timer (`time/<stage>` in the metrics)."""
        r, t0 = self.recipe, time.perf_counter()
        self.timer = StageTimer()
        # rollout: thinking traces, summaries at every cut, verified scores (on the workers)
        shares = self._rollout(step)
        # experience: advantages and their spread over tokens (adv), rows (pack), each rank its own (scatter)
        exp = experience(shares, r, self.pad_id, self.exchange, self.timer)
        metrics = step_metrics(exp.per_worker, r)
        for name, seconds in slowest(exp.timings).items():   # the workers' stages (gen, summaries, reward)
            self.timer.add(name, seconds)
        if r.rollout.enable_sleep:
            self.rollouts.sleep()
        if r.learner.old_logprobs == "recompute":   # else the update's own (fully on-policy, checked at load)
            with self.timer.stage("logprob"):       # the learner before the update: PPO's proximal policy
                exp.batch.old_logprobs = self.learner.logprobs(exp.batch)
            metrics["train/logprob_mismatch"] = logprob_mismatch(exp.batch)
            with self.timer.stage("adv"):           # engine (behaviour) vs learner (proximal) policy
                metrics.update(importance_correction(exp.batch, r))
        with self.timer.stage("update"):
            stats = ppo_update(self.learner, exp.batch, r.algorithm, r.learner)
        metrics.update({f"update/{k}": v for k, v in stats.items()})
        with self.timer.stage("sync"):     # the new weights to the workers (or offered, in flight)
            self._sync_weights(step + 1)
        metrics.update({f"time/{k}": v for k, v in self.timer.times.items()})
        metrics["time/step"] = time.perf_counter() - t0
        return metrics

    def _sync_weights(self, version: int) -> None:
        """The learner's weights to the engines. They are gathered while the engines still sleep, and the
        learner's cached device blocks are freed before the engines wake into that memory."""
        weights = self.weight_snapshot(version)
        if self.recipe.rollout.enable_sleep:
            release_cached_device_memory()
            self.rollouts.wake_up()
        self.rollouts.sync_weights(weights)
        self._weights_version = version

    def weight_snapshot(self, version: int) -> WeightSnapshot:
        """The learner's weights shaped as the placement plan asks: a LoRA adapter's factors for engines that
        serve it, else the full (merged) weights, complete on every rank with an engine (collective)."""
        if self.plan.lora_weights == "adapter":   # not collective: LoRA learners hold the model on every rank
            return WeightSnapshot(version, adapter=self.learner.adapter_update())
        return WeightSnapshot(version, state=self.learner.full_state_dict(all_ranks=self.plan.every_rank_gathers))

    def evaluate(self, step: int) -> dict[str, Any]:
        """Held-out metrics; rank 0 writes the per-sample records to eval_samples/step_{step}.jsonl."""
        with self.timer.stage("eval"):
            metrics, records = self.rollouts.on_first_worker(evaluate_on_worker)
            if self.rank == 0 and records:
                write_samples([{"step": step, **r} for r in records],
                              self.out / "eval_samples" / f"step_{step}.jsonl", self.recipe.eval.max_sample_records)
            return metrics

    # --- signals and checkpoints ---------------------------------------------------------------
    def _on_signal(self, signum: int, frame: Any) -> None:
        log.warning("received signal %d: finishing this step, saving a checkpoint and exiting", signum)
        self._stop_signal = signum

    def save(self, step: int, extra: dict[str, Any] | None = None) -> Path:
        with self.timer.stage("save"):
            return ckpt.save_checkpoint(
                self.out / "checkpoints", step, self.learner, self.tokenizer,
                {"data_position": step * self.rows_per_step, **(extra or {})},
                self.recipe.trainer.keep_last, generation_source=self.model_path, in_flight=self._settle_in_flight())

    def fit(self) -> dict[str, Any]:
        r = self.recipe
        start_step, history = 0, {}
        resume = ckpt.resolve_resume(self.out / "checkpoints", r.trainer.resume)
        if resume is not None:
            state = ckpt.load_checkpoint(resume, self.learner)
            start_step = state["step"]
            history = state.get("history", {})
            self._sync_weights(start_step)
            self._restore_in_flight(resume, start_step)
        logger = MetricsLogger(self.out, r.logging, r.trainer.steps, enabled=self.rank == 0,
                               run_config=r.to_dict(), start_step=start_step)
        if self.rank == 0:  # the resolved recipe: `anytime eval --recipe` on it scores like the in-training eval
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "recipe.yaml").write_text(r.to_yaml())
        old_handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            if "before" not in history:
                history["before"] = self.evaluate(start_step)
                logger.log(start_step, history["before"])
            step = start_step
            while step < r.trainer.steps:
                metrics = self.train_step(step)
                step += 1
                if r.eval.every and step % r.eval.every == 0 and step < r.trainer.steps:
                    metrics.update(self.evaluate(step))
                logger.log(step, metrics)
                logger.progress(step, anytime=metrics.get("train/anytime_score", 0.0))
                stop = broadcast_object(self._stop_signal)
                if stop is not None or step % r.trainer.save_every == 0 or step == r.trainer.steps:
                    self.save(step, {"history": history})
                if stop is not None:
                    log.warning("stopped by signal %d after step %d; resume with trainer.resume=auto", stop, step)
                    return {"stopped_at": step, **history}
            history["after"] = self.evaluate(step)
            logger.log(step, history["after"])
            if self.rank == 0:
                (self.out / "final_eval.json").write_text(json.dumps(history, indent=2))
            return history
        finally:
            for s, h in old_handlers.items():
                signal.signal(s, h)
            logger.close()

    def close(self) -> None:
        self.rollouts.close()
