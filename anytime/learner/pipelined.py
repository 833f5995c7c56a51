"""The pipelined learner backend (`learner.pipeline.stages > 1`): the trainer's backend interface
over a `PipelineLearner`, one process per pipeline rank, each holding its stages and a PyTorch
AdamW over their weights.

Every rank sees the same rows (there is no data-parallel split): a PPO mini-batch is collated into
one padded batch whose row count is rounded up to a multiple of the schedule's microbatches with
zero-mask rows, and trained in one pipelined `train_step` (one optimizer step, as the
unpipelined `ppo_update` takes per mini-batch, with the same loss normalisers, clipping, skipping
of non-finite steps and LR schedule). `micro_batch_tokens` does not apply here: the microbatch
size is the mini-batch's rows / `learner.pipeline.microbatches`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from anytime.config import AlgorithmConfig, LearnerConfig
from anytime.learner.backend import lr_lambda
from anytime.learner.batch import TrainBatch, TrainRow, collate, mini_batches, padding_row


class PipelinedBackend:
    """A pipeline-parallel learner behind the trainer's backend interface.

    `model`: a model folder / hub id, a transformers config or a model (see
    `anytime.pipeline.partition.load_causal_lm`). Build it on every rank of the default process
    group, whose size must be `cfg.pipeline.stages`. `model` (the attribute) is the
    `PipelineLearner`, whose `load_state_dict` takes full-model state dicts (checkpoint resume);
    `skeleton` is a weightless (meta-device) HF model of the same config for `save_pretrained`.
    """

    pipelined = True

    def __init__(self, model: Any, cfg: LearnerConfig, total_steps: int, *, dtype: torch.dtype | None = None,
                 seed: int = 0, device: torch.device | str | None = None) -> None:
        from anytime.pipeline.learner import PipelineLearner

        p = cfg.pipeline
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if world != p.stages:
            raise ValueError(f"learner.pipeline.stages is {p.stages} but {world} learner processes are running; "
                             f"start one process per stage (anytime train does this itself)")
        self.cfg = cfg

        def adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
            return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)

        self.learner = PipelineLearner(
            model, p.schedule, microbatches=p.microbatches, chunks=p.chunks, optimizer_factory=adamw,
            device=device, dtype=dtype, seed=seed, offload_chunks=p.offload_chunks,
            max_grad_norm=cfg.grad_clip if cfg.grad_clip > 0 else None, post_validate=p.post_validate)
        self.model = self.learner
        self.optimizer = self.learner.optimizer
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(cfg.lr_schedule, cfg.warmup_steps, total_steps))
        self.skeleton = self._skeleton(model)
        self._gathered: list[dict] | None = None

    def _skeleton(self, source: Any) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM, GenerationConfig

        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(self.learner.config, dtype=self.learner.dtype)
        if isinstance(source, str):  # keep the model's generation settings (eos ids) in checkpoints
            try:
                skeleton.generation_config = GenerationConfig.from_pretrained(source)
            except OSError:
                pass
        return skeleton

    # -- the RL step -------------------------------------------------------------------------------
    def _padded(self, rows: Sequence[TrainRow], pad_id: int) -> dict[str, torch.Tensor]:
        m = self.learner.schedule.microbatches
        rows = list(rows) + [padding_row(pad_id)] * (-len(rows) % m)
        return collate(rows, pad_id, self.learner.device)

    @torch.no_grad()
    def fill_logprobs(self, rows: Sequence[TrainRow], pad_id: int, attr: str = "old_logprobs") -> None:
        """Store each row's per-token log-probs (pipelined forward; rows grouped as the PPO
        mini-batches group them). Every rank must call it with the same rows."""
        self.learner.train(False)
        by_prompt: dict[int, list[TrainRow]] = defaultdict(list)
        for row in rows:
            by_prompt[row.prompt_index].append(row)
        prompts = sorted(by_prompt)
        per_mini = max(1, self.cfg.mini_batch_prompts)
        for start in range(0, len(prompts), per_mini):
            group = [r for p in prompts[start:start + per_mini] for r in by_prompt[p]]
            lp = self.learner.logprobs(self._padded(group, pad_id))
            for i, row in enumerate(group):
                # float32 like the unpipelined fill_logprobs, so both paths train on the same targets
                setattr(row, attr, lp[i, : len(row) - 1].float().cpu().tolist())

    def ppo_update(self, batch: TrainBatch, algo: AlgorithmConfig, cfg: LearnerConfig,
                   pad_id: int) -> dict[str, float]:
        """PPO epochs over mini-batches of `cfg.mini_batch_prompts` prompts, one pipelined train
        step (and optimizer step) each; returns the statistics of `update.ppo_update`, with loss
        and tokens averaged per mini-batch (there: per micro-batch)."""
        stats: dict[str, list[float]] = defaultdict(list)
        self.learner.train(True)
        for _ in range(cfg.ppo_epochs):
            for rows, num_tokens, num_traces in mini_batches(batch, cfg.mini_batch_prompts):
                lr = self.optimizer.param_groups[0]["lr"]
                if not rows:  # every advantage is zero: nothing to learn, no step (as `update.ppo_update`)
                    stats["empty_minibatches"].append(1.0)
                    continue
                kwargs: dict[str, Any] = {"agg": algo.loss_agg, "clip_low": algo.clip_low,
                                          "clip_high": algo.clip_high, "num_tokens": max(num_tokens, 1),
                                          "max_len": batch.max_len, "entropy_coef": algo.entropy_coef}
                if algo.loss_agg == "constant":
                    kwargs["num_rows"] = max(num_traces, 1)
                elif algo.loss_agg == "seq-mean-token-mean":
                    kwargs["num_rows"] = max(len(rows), 1)  # padding rows excluded
                m = self.learner.train_step(self._padded(rows, pad_id), loss_kwargs=kwargs, entropy=True)
                if m["skipped"]:
                    stats["skipped_updates"].append(1.0)
                    continue
                self.scheduler.step()
                if m["tokens"] > 0:
                    for k in ("clip_frac", "approx_kl", "ratio_mean", "tokens", "entropy"):
                        stats[k].append(m[k])
                stats["loss"].append(m["loss"])
                stats["grad_norm"].append(m["grad_norm"])
                stats["lr"].append(lr)
                stats["skipped_updates"].append(0.0)
        out = {k: (sum(v) if k in ("skipped_updates", "empty_minibatches") else sum(v) / len(v))
               for k, v in stats.items() if v}
        out.setdefault("skipped_updates", 0.0)
        return out

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    # -- weights and checkpoints ------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """All weights under HF names on rank 0 (engine sync, checkpoints, export); each other rank
        gets its own stages' weights. Collective."""
        return self.learner.full_state_dict(dst=0)

    def prepare_checkpoint(self) -> None:
        """Collect every rank's optimizer state on rank 0, where `state_dict()` saves it.
        Collective: call on every rank before `checkpoint.save_checkpoint`."""
        state = _to_cpu(self.optimizer.state_dict())
        box: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(state, box, dst=0)
        self._gathered = box

    def state_dict(self) -> dict[str, Any]:
        """On rank 0 after `prepare_checkpoint()`: the scheduler and every rank's optimizer state."""
        if self._gathered is None:
            raise RuntimeError("PipelinedBackend.state_dict() holds every stage's optimizer state only after "
                               "prepare_checkpoint() ran on all ranks (and only on rank 0)")
        state, self._gathered = {"optimizers": self._gathered, "scheduler": self.scheduler.state_dict()}, None
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        optimizers = state["optimizers"]
        if len(optimizers) != dist.get_world_size():
            raise ValueError(f"checkpoint holds the optimizer state of {len(optimizers)} pipeline stages; this run "
                             f"has {dist.get_world_size()}: resume with the same learner.pipeline.stages")
        self.optimizer.load_state_dict(optimizers[dist.get_rank()])
        self.scheduler.load_state_dict(state["scheduler"])


def _to_cpu(obj: Any) -> Any:
    if torch.is_tensor(obj):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj
