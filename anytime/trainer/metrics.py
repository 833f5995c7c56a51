"""The step's metrics from its workers' sums, stage timers, and the sinks: JSONL always, TensorBoard
when installed, W&B when asked; a live progress bar."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from collections.abc import Sequence
from typing import Any

from anytime.algo.budget import anytime_score
from anytime.batch.step_sums import StepSums
from anytime.config import LoggingConfig, Recipe

log = logging.getLogger(__name__)


def step_metrics(per_worker: Sequence[StepSums], recipe: Recipe) -> dict[str, float]:
    """The step's metrics from every worker's sums (`StepSums.metrics` names them; the anytime score
    weights the accuracies by the recipe's prior), plus each worker's tokens/s and how much longer the
    slowest worker took than the mean (1.0 = balanced). Wall-clock figures go under ``perf/`` (like
    ``time/``) so that comparisons of runs can leave them out."""
    total = StepSums.total(per_worker)
    metrics = total.metrics(recipe.budget.grid())
    metrics["train/anytime_score"] = anytime_score(total.accuracies(), recipe.budget.prior_probs())
    seconds = [s.rollout_seconds for s in per_worker]
    for i, s in enumerate(per_worker):
        metrics[f"perf/rollout_tokens_per_s/worker{i}"] = s.tokens / max(s.rollout_seconds, 1e-9)
    metrics["rollout/tokens"] = total.tokens
    metrics["perf/rollout_tokens_per_s"] = total.tokens / max(max(seconds), 1e-9)
    metrics["perf/rollout_slowest_over_mean"] = max(seconds) / max(sum(seconds) / len(seconds), 1e-9)
    return metrics


def slowest(per_worker: Sequence[dict[str, float]]) -> dict[str, float]:
    """Stage timings of a step whose workers ran side by side: the slowest worker's, per stage."""
    return {k: max(t.get(k, 0.0) for t in per_worker) for k in {k for t in per_worker for k in t}}


class StageTimer:
    """Wall time per named stage: the workers' `gen`, `summaries`, `reward`; the trainer's `adv`,
    `pack`, `scatter`, `logprob`, `update`, `sync`, `eval`, `save`."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    def add(self, name: str, seconds: float) -> None:
        self.times[name] = self.times.get(name, 0.0) + seconds

    def stage(self, name: str) -> "_Stage":
        return _Stage(self, name)


class _Stage:
    def __init__(self, timer: StageTimer, name: str):
        self.timer, self.name = timer, name

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.timer.add(self.name, time.perf_counter() - self.start)


class MetricsLogger:
    def __init__(self, out_dir: str | Path, cfg: LoggingConfig, total_steps: int, enabled: bool = True,
                 run_config: dict[str, Any] | None = None, start_step: int = 0):
        self.enabled = enabled
        self.out_dir = Path(out_dir)
        self._tb = self._wandb = self._bar = None
        if not enabled:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = (self.out_dir / "metrics.jsonl").open("a") if cfg.jsonl else None
        if cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.out_dir / "tensorboard"))
            except ImportError:
                log.debug("tensorboard not installed; skipping TensorBoard logging")
        if cfg.wandb:
            import wandb

            self._wandb = wandb.init(project=cfg.wandb_project, config=run_config, dir=str(self.out_dir))
        if cfg.progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **metrics}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        numeric = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)

    def progress(self, step: int, **fields: float) -> None:
        if self._bar is not None:
            self._bar.n = step
            self._bar.set_postfix({k: f"{v:.3f}" for k, v in fields.items()}, refresh=True)

    def close(self) -> None:
        if not self.enabled:
            return
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._bar is not None:
            self._bar.close()
