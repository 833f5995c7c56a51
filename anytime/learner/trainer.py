"""The training loop: rollout → rewards → advantages → train batch → update → weight sync →
metrics → eval → checkpoint, with stage timers under stable names.

Rank 0 owns the rollout engine and the verifier; the rollout's train rows are broadcast and each
data-parallel rank trains on the rows of its own prompts (with `learner.pipeline.stages > 1` the
ranks are pipeline stages instead, and all of them train on all rows).
"""

from __future__ import annotations

import json
import logging
import random
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from anytime.algo.advantages import summary_advantages_by_name, thinking_advantages
from anytime.budget import anytime_score
from anytime.config import Recipe
from anytime.data import PromptRow, encode_prompts, load_rows, synthetic_rows, SYNTHETIC_TRAIN_SEED
from anytime.learner import checkpoint as ckpt
from anytime.learner.backend import create_backend
from anytime.learner.batch import TrainBatch, build_train_batch
from anytime.learner.metrics import MetricsLogger, StageTimer
from anytime.learner.update import fill_logprobs, logprob_mismatch, ppo_update, rank_world

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def _broadcast(obj: Any) -> Any:
    if rank_world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def load_train_rows(recipe: Recipe) -> list[PromptRow]:
    d = recipe.data
    if d.train == "synthetic":
        rows = synthetic_rows(d.synthetic_size, SYNTHETIC_TRAIN_SEED + recipe.trainer.seed, d.synthetic_min_ops,
                              d.synthetic_max_ops)
        random.Random(recipe.trainer.seed).shuffle(rows)
        return rows[: d.limit] if d.limit else rows
    return load_rows(d.train, split=d.split, problem_key=d.problem_key, answer_key=d.answer_key, limit=d.limit,
                     shuffle_seed=recipe.trainer.seed if d.shuffle else None)


class Trainer:
    def __init__(self, recipe: Recipe, model_path: str):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.recipe = recipe
        self.rank, self.world = rank_world()
        self.out = Path(recipe.trainer.output_dir)
        self.model_path = model_path
        seed = recipe.trainer.seed
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        if recipe.learner.deterministic:
            torch.use_deterministic_algorithms(True)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=recipe.model.trust_remote_code)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        dtype = DTYPES[recipe.model.dtype]
        device = "cuda" if torch.cuda.is_available() else "cpu"
        # Pipelined: every rank holds only its stages; `self.model` is then a weightless skeleton
        # (config + save_pretrained for checkpoints) and every rank trains on all rows.
        self.pipelined = recipe.learner.pipeline.stages > 1
        self.ref_model = None
        if self.pipelined:
            from anytime.learner.pipelined import PipelinedBackend

            self.backend = PipelinedBackend(model_path, recipe.learner, recipe.trainer.steps, dtype=dtype, seed=seed,
                                            device=device)
            self.model = self.backend.skeleton
        else:
            self.model = AutoModelForCausalLM.from_pretrained(
                model_path, dtype=dtype, trust_remote_code=recipe.model.trust_remote_code).to(device)
            if recipe.model.gradient_checkpointing:
                self.model.gradient_checkpointing_enable()
            if recipe.learner.reference_model:
                self.ref_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
                self.ref_model.requires_grad_(False)
            self.backend = create_backend(self.model, recipe.learner, recipe.trainer.steps)
        self.rows = load_train_rows(recipe)
        self.prompts = encode_prompts(self.tokenizer, self.rows, recipe.data.instruction, recipe.data.max_prompt_len)
        self.timer = StageTimer()
        self.grid = recipe.budget.grid()
        self.probs = recipe.budget.prior_probs()
        self.runner = self.eval_runner = self.engine = self.scorer = None
        if self.rank == 0:
            self._build_rollout()
        self._stop_signal: int | None = None

    # --- rollout side (rank 0) -----------------------------------------------------------------
    def _build_rollout(self) -> None:
        from anytime.reward import RewardScorer
        from anytime.rollout.anytime import AnytimeRolloutRunner, AnytimeSettings
        from anytime.rollout.engine import create_engine

        r = self.recipe
        max_len = r.rollout.max_model_len or (r.data.max_prompt_len + r.budget.max_thinking
                                              + r.summary.max_tokens + 64)
        kwargs: dict[str, Any] = {}
        if r.rollout.engine == "vllm" and torch.cuda.is_available():
            kwargs["gpu_memory_utilization"] = r.rollout.gpu_memory_utilization
        self.engine = create_engine(r.rollout.engine, self.model_path, max_model_len=max_len,
                                    max_prompt_len=r.data.max_prompt_len, dtype=r.model.dtype, seed=r.trainer.seed,
                                    **kwargs)
        self.scorer = RewardScorer(header=r.summary.header.strip(), think_end=r.summary.think_end)
        common = dict(summary_max_tokens=r.summary.max_tokens, close_text=r.summary.close_text,
                      header=r.summary.header, think_end=r.summary.think_end, seed=r.trainer.seed)
        self.runner = AnytimeRolloutRunner(self.engine, self.tokenizer, self.scorer, AnytimeSettings(
            tuple(self.grid), r.rollout.n, r.summary.n, temperature=r.rollout.temperature, top_p=r.rollout.top_p,
            summary_temperature=r.summary.temperature, **common))
        ev = r.eval
        self.eval_budgets = list(ev.budgets or self.grid)
        self.eval_runner = AnytimeRolloutRunner(self.engine, self.tokenizer, self.scorer, AnytimeSettings(
            tuple(self.eval_budgets), ev.samples, 1, temperature=ev.temperature if ev.temperature > 0 else 0.0,
            top_p=ev.top_p, summary_temperature=ev.temperature, **common))

    def _sync_weights(self) -> None:
        with self.timer.stage("sync"):
            state = self.backend.full_state_dict()  # every rank joins the ZeRO-3 gather
            if self.rank == 0:
                self.engine.update_weights(state.items())

    # --- evaluation ----------------------------------------------------------------------------
    def evaluate(self) -> dict[str, Any]:
        from anytime.benchmarks import load_benchmark
        from anytime.evaluate import evaluate_rows

        ev = self.recipe.eval
        result: dict[str, Any] = {}
        if self.rank == 0:
            with self.timer.stage("eval"):
                scores = []
                for name in ev.benchmarks:
                    rows = load_benchmark(name, data_dir=ev.data_dir, limit=ev.limit, seed=self.recipe.trainer.seed)
                    r = evaluate_rows(self.eval_runner, self.tokenizer, rows, budgets=self.eval_budgets,
                                      instruction=self.recipe.data.instruction,
                                      max_prompt_len=self.recipe.data.max_prompt_len, seed=12345)
                    for j, b in enumerate(self.eval_budgets):
                        result[f"eval/{name}/acc@{b}"] = r["accuracy"][j]
                    result[f"eval/{name}/anytime"] = r["anytime_accuracy"]
                    result[f"eval/{name}/final"] = r["final_accuracy"]
                    result[f"eval/{name}/think_len"] = r["avg_thinking_length"]
                    scores.append(r["anytime_accuracy"])
                result["eval/anytime"] = sum(scores) / max(len(scores), 1)
        return _broadcast(result)

    # --- one step ------------------------------------------------------------------------------
    def _rollout_batch(self, step: int) -> tuple[TrainBatch | None, dict[str, Any]]:
        r = self.recipe
        metrics: dict[str, Any] = {}
        batch = None
        if self.rank == 0:
            n = r.rollout.prompts_per_step
            idx = [(step * n + i) % len(self.rows) for i in range(n)]
            rollout = self.runner.run([self.prompts[i] for i in idx], [self.rows[i].answer for i in idx],
                                      seed=r.trainer.seed * 1_000_003 + step)
            for k, v in rollout.timings.items():
                self.timer.add(k, v)
            with self.timer.stage("adv"):
                scores = rollout.budget_scores.double()  # [B, G, S]
                t_adv = thinking_advantages(r.algorithm.estimator, scores, self.probs, decay=r.algorithm.decay,
                                            variant=r.algorithm.variance_reduction)
                s_adv = summary_advantages_by_name(r.summary.estimator, rollout.scores.double(), rollout.prefix_group)
                batch = build_train_batch(rollout, t_adv, s_adv, thinking_weight=r.algorithm.thinking_loss_weight,
                                          summary_weight=r.summary.loss_weight, summary_max_tokens=r.summary.max_tokens,
                                          drop_zero_rows=r.algorithm.kl_coef == 0 and r.algorithm.entropy_coef == 0)
            acc = rollout.accuracy_per_budget()
            for b, a in zip(rollout.budgets, acc):
                metrics[f"train/acc@{b}"] = a
            metrics["train/anytime_score"] = anytime_score(acc, self.probs)
            lengths = rollout.thinking_lengths()
            metrics["train/think_len"] = sum(lengths) / len(lengths)
            metrics["train/think_closed_frac"] = sum(t.natural_end for p in rollout.traces for t in p) / len(lengths)
            metrics["adv/thinking_mean"] = float(t_adv.mean())
            metrics["adv/thinking_abs"] = float(t_adv.abs().mean())
            metrics["adv/summary_abs"] = float(s_adv.abs().mean())
            total = sum(rollout.failure_reasons().values())
            for reason, c in rollout.failure_reasons().items():
                metrics[f"verifier/{reason}"] = c / total
            metrics["train/rows"] = len(batch.rows)
        return _broadcast(batch), _broadcast(metrics)

    def train_step(self, step: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        self.timer = StageTimer()
        batch, metrics = self._rollout_batch(step)
        with self.timer.stage("logprob"):
            if self.pipelined:  # no data-parallel split: every pipeline rank sees every row
                mine = batch.rows
                self.backend.fill_logprobs(mine, self.pad_id)
            else:
                mine = [row for row in batch.rows if row.prompt_index % self.world == self.rank]
                fill_logprobs(self.model, mine, self.recipe.learner.micro_batch_tokens, self.pad_id)
            metrics["train/logprob_mismatch"] = logprob_mismatch(mine, across_ranks=not self.pipelined)
        with self.timer.stage("update"):
            stats = ppo_update(self.backend, batch, self.recipe.algorithm, self.recipe.learner, self.pad_id,
                               self.ref_model)
        metrics.update({f"update/{k}": v for k, v in stats.items()})
        self._sync_weights()
        metrics.update({f"time/{k}": v for k, v in self.timer.times.items()})
        metrics["time/step"] = time.perf_counter() - t0
        return metrics

    # --- signals and checkpoints ---------------------------------------------------------------
    def _on_signal(self, signum: int, frame: Any) -> None:
        log.warning("received signal %d: finishing this step, saving a checkpoint and exiting", signum)
        self._stop_signal = signum

    def save(self, step: int, extra: dict[str, Any] | None = None) -> Path:
        t = time.perf_counter()
        if self.pipelined:  # each stage's optimizer state goes to rank 0, which writes the checkpoint
            self.backend.prepare_checkpoint()
        path = ckpt.save_checkpoint(self.out / "checkpoints", step, self.model, self.tokenizer, self.backend,
                                    {"data_position": step * self.recipe.rollout.prompts_per_step, **(extra or {})},
                                    self.recipe.trainer.keep_last)
        self.timer.add("save", time.perf_counter() - t)
        return path

    def fit(self) -> dict[str, Any]:
        r = self.recipe
        start_step, history = 0, {}
        resume = ckpt.resolve_resume(self.out / "checkpoints", r.trainer.resume)
        if resume is not None:
            state = ckpt.load_checkpoint(resume, self.backend)
            start_step = state["step"]
            history = state.get("history", {})
            self._sync_weights()
        logger = MetricsLogger(self.out, r.logging, r.trainer.steps, enabled=self.rank == 0,
                               run_config=r.to_dict(), start_step=start_step)
        old_handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            if "before" not in history:
                history["before"] = self.evaluate()
                logger.log(start_step, history["before"])
            step = start_step
            while step < r.trainer.steps:
                metrics = self.train_step(step)
                step += 1
                if r.eval.every and step % r.eval.every == 0 and step < r.trainer.steps:
                    metrics.update(self.evaluate())
                logger.log(step, metrics)
                logger.progress(step, anytime=metrics.get("train/anytime_score", 0.0))
                stop = _broadcast(self._stop_signal)
                if stop is not None or step % r.trainer.save_every == 0 or step == r.trainer.steps:
                    self.save(step, {"history": history})
                if stop is not None:
                    log.warning("stopped by signal %d after step %d; resume with trainer.resume=auto", stop, step)
                    return {"stopped_at": step, **history}
            history["after"] = self.evaluate()
            logger.log(step, history["after"])
            if self.rank == 0:
                (self.out / "final_eval.json").write_text(json.dumps(history, indent=2))
            return history
        finally:
            for s, h in old_handlers.items():
                signal.signal(s, h)
            logger.close()

    def close(self) -> None:
        if self.scorer is not None:
            self.scorer.close()
        if self.engine is not None:
            self.engine.close()
