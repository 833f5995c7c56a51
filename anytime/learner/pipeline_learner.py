"""The pipelined RL learner (`learner.pipeline.stages > 1`): P pipeline stages × D data-parallel
replicas (`learner.num_processes` = P·D, see `anytime.learner.mesh`), each rank holding its
stages of a `PipelinedCausalLM` and a PyTorch AdamW over their weights
(`anytime.learner.deepspeed_pipeline` puts a DeepSpeed ZeRO engine there instead).

Replica d trains the rows of prompts p with p % D == d; all stages of a replica hold the same rows.
A PPO mini-batch is one padded batch whose row count is rounded up to a multiple of the
schedule's microbatches with zero-mask rows, trained in one pipelined forward/backward; the
replicas' gradients are summed after the schedule's last W (the loss normaliser is global);
`learner.micro_batch_tokens` does not apply (a microbatch is the mini-batch's rows /
`learner.pipeline.microbatches`). Tree-packed rows carry their hidden key spans to the pipeline,
which builds each microbatch's mask and position ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from anytime.algo.loss import LossSpec
from anytime.batch.train_batch import TrainBatch
from anytime.learner.base import StepResult
from anytime.learner.lr_schedules import lr_lambda

if TYPE_CHECKING:
    from anytime.config import LearnerConfig


class PipelineLearner:
    """`model`: a model folder / hub id, a transformers config or a model (see
    `anytime.pipeline.partition.load_causal_lm`). Build it on every rank of the default process
    group, whose size must be a multiple of `cfg.pipeline.stages`."""

    def __init__(self, model: Any, cfg: LearnerConfig, total_steps: int, *, dtype: torch.dtype | None = None,
                 seed: int = 0, device: torch.device | str | None = None) -> None:
        from anytime.learner.mesh import build_mesh

        self.cfg = cfg
        self.device_type = torch.device(device or "cpu").type
        self.mesh = build_mesh(cfg.pipeline.stages, self.device_type)
        self.model = self._build_model(model, total_steps, dtype=dtype, seed=seed, device=device)
        self.config = self.model.config
        self.optimizer = self.model.optimizer
        self.dp_size, self.dp_ranks = self.mesh.replicas, self.mesh.dp_ranks

    def _build_model(self, model: Any, total_steps: int, **kwargs: Any):
        from anytime.pipeline.causal_lm import PipelinedCausalLM

        cfg, m = self.cfg, self.mesh

        def adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
            return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)

        built = PipelinedCausalLM(model, cfg.pipeline.schedule, optimizer_factory=adamw,
                                  dp_group=m.dp_group if m.replicas > 1 else None, **self._model_kwargs(), **kwargs)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            built.optimizer, lr_lambda(cfg.lr_schedule, cfg.warmup_steps, total_steps))
        return built

    def _model_kwargs(self) -> dict[str, Any]:
        """`PipelinedCausalLM` arguments from the recipe and the mesh, whatever steps the stages."""
        from anytime.models.attention import packed_attn_implementation

        cfg, p, m = self.cfg, self.cfg.pipeline, self.mesh
        return {"attn_implementation": packed_attn_implementation(self.device_type) if cfg.pack_summaries else None,
                "microbatches": p.microbatches, "chunks": p.chunks, "offload_chunks": p.offload_chunks,
                "max_grad_norm": cfg.grad_clip if cfg.grad_clip > 0 else None,
                "post_validate": p.post_validating(cfg.backend), "group": m.pp_group,
                "reverse_group": m.pp_reverse_group, "logprob_chunk_tokens": cfg.logprob_chunk_tokens}

    def _tensors(self, batch: TrainBatch) -> dict[str, torch.Tensor]:
        m = self.model.schedule.microbatches
        # A replica whose share of a mini-batch is empty still runs the schedule, on zero-mask rows.
        padded = batch.with_padding_rows(max(m, -(-len(batch) // m) * m) - len(batch))
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
        """All weights under HF names on rank 0, gathered over replica 0's pipeline (with `all_ranks`,
        on every rank, each over its own replica's pipeline: the replicas are identical); otherwise
        every other rank gets its own stages' weights."""
        if all_ranks:
            return self.model.full_state_dict(dst=None)
        if self.mesh.replica != 0:
            return self.model.state_dict()
        return self.model.full_state_dict(dst=0)

    def _state_file(self, folder: Path, stage_rank: int) -> Path:
        return folder / f"pipeline_rank{stage_rank}.pt"

    def save(self, folder: Path) -> None:
        """Replica 0's ranks write their stages' optimizer state (and the LR schedule) themselves."""
        if self.mesh.replica == 0:
            torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()},
                       self._state_file(folder, self.mesh.stage_rank))

    def _check_stages(self, folder: Path, found: int) -> None:
        if found != self.mesh.stages:
            raise ValueError(f"checkpoint {folder} holds the optimizer state of {found} pipeline stages; this run "
                             f"has {self.mesh.stages}: resume with the same learner.pipeline.stages")

    def load(self, folder: Path) -> None:
        from anytime.learner.checkpoint import load_tensors, read_model_weights

        self._check_stages(folder, len(list(folder.glob("pipeline_rank*.pt"))))
        self.model.load_state_dict(read_model_weights(folder))
        state = load_tensors(self._state_file(folder, self.mesh.stage_rank))
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
