"""The pipelined RL learner (`learner.pipeline.stages > 1`): one process per pipeline rank, each
holding its stages of a `PipelinedCausalLM` and a PyTorch AdamW over their weights.

There is no data-parallel split: every rank holds the same rows. A PPO mini-batch is one padded
batch whose row count is rounded up to a multiple of the schedule's microbatches with zero-mask
rows, trained in one pipelined forward/backward; `learner.micro_batch_tokens` does not apply
(a microbatch is the mini-batch's rows / `learner.pipeline.microbatches`). Tree-packed rows carry
their hidden key spans to the pipeline, which builds each microbatch's mask and position ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from anytime.config import LearnerConfig
from anytime.dist import rank_world
from anytime.learner.base import LossSpec, StepResult, lr_lambda
from anytime.learner.batch import TrainBatch


class PipelineLearner:
    """`model`: a model folder / hub id, a transformers config or a model (see
    `anytime.pipeline.partition.load_causal_lm`). Build it on every rank of the default process
    group, whose size must be `cfg.pipeline.stages`."""

    def __init__(self, model: Any, cfg: LearnerConfig, total_steps: int, *, dtype: torch.dtype | None = None,
                 seed: int = 0, device: torch.device | str | None = None) -> None:
        from anytime.attention import packed_attn_implementation
        from anytime.pipeline.causal_lm import PipelinedCausalLM

        p = cfg.pipeline
        world = rank_world()[1]
        if world != p.stages:
            raise ValueError(f"learner.pipeline.stages is {p.stages} but {world} learner processes are running; "
                             f"start one process per stage (anytime train does this itself)")
        self.cfg = cfg

        def adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
            return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)

        self.model = PipelinedCausalLM(
            model, p.schedule, microbatches=p.microbatches, chunks=p.chunks, optimizer_factory=adamw,
            device=device, dtype=dtype, seed=seed, offload_chunks=p.offload_chunks,
            max_grad_norm=cfg.grad_clip if cfg.grad_clip > 0 else None, post_validate=p.post_validate,
            attn_implementation=packed_attn_implementation(device or "cpu") if cfg.pack_summaries else None,
            logprob_chunk_tokens=cfg.logprob_chunk_tokens)
        self.config = self.model.config
        self.optimizer = self.model.optimizer
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(cfg.lr_schedule, cfg.warmup_steps, total_steps))
        self.dp_size, self.dp_ranks = 1, [0] * world

    def _tensors(self, batch: TrainBatch) -> dict[str, torch.Tensor]:
        padded = batch.with_padding_rows(-len(batch) % self.model.schedule.microbatches)
        return {"input_ids": padded.input_ids, "attention_mask": padded.attention_mask,
                "loss_mask": padded.loss_mask.float(), "advantages": padded.advantages,
                "old_logprobs": padded.old_logprobs, "skip_start": padded.skip_start, "skip_end": padded.skip_end}

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Pipelined forward passes, one per PPO mini-batch of rows."""
        self.model.train(False)
        out = torch.zeros(batch.advantages.shape, dtype=torch.float32)
        for mini in batch.mini_batches(self.cfg.mini_batch_prompts):
            if len(mini.batch) == 0:
                continue
            lp = self.model.logprobs(self._tensors(mini.batch))[: len(mini.batch)].float().cpu()
            out[mini.rows, : lp.shape[1]] = torch.where(mini.batch.valid_mask, lp, 0.0)
        return out

    def forward_backward(self, batch: TrainBatch, loss: LossSpec) -> dict[str, float]:
        self.model.train(True)
        result = self.model.forward_backward(self._tensors(batch), loss_kwargs=loss.policy_loss_kwargs(), entropy=True)
        return result["sums"]

    def optimizer_step(self) -> StepResult:
        lr = self.optimizer.param_groups[0]["lr"]
        self.model.optimizer_step()
        metrics = self.model.validate()
        if not metrics["skipped"]:
            self.scheduler.step()
        return StepResult(metrics["grad_norm"], metrics["skipped"], lr)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def full_state_dict(self, all_ranks: bool = False) -> dict[str, torch.Tensor]:
        """All weights under HF names on rank 0 (every rank with `all_ranks`); otherwise each other
        rank gets its own stages' weights."""
        return self.model.full_state_dict(dst=None if all_ranks else 0)

    def _state_file(self, folder: Path, rank: int) -> Path:
        return folder / f"pipeline_rank{rank}.pt"

    def save(self, folder: Path) -> None:
        """Each rank writes its stages' optimizer state (and the LR schedule) itself."""
        torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()},
                   self._state_file(folder, rank_world()[0]))

    def load(self, folder: Path) -> None:
        from anytime.learner.checkpoint import load_tensors, read_model_weights

        stages, (rank, world) = len(list(folder.glob("pipeline_rank*.pt"))), rank_world()
        if stages != world:
            raise ValueError(f"checkpoint {folder} holds the optimizer state of {stages} pipeline stages; this run "
                             f"has {world}: resume with the same learner.pipeline.stages")
        self.model.load_state_dict(read_model_weights(folder))
        state = load_tensors(self._state_file(folder, rank))
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
