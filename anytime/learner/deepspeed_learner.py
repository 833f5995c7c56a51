"""The DeepSpeed learner: the data-parallel micro-batch loop on a DeepSpeed ZeRO 0-3 engine (gloo
and torch's AdamW on the CPU, so nothing is JIT-compiled there). DeepSpeed clips, skips steps with
non-finite gradients, steps the LR schedule and writes its own sharded checkpoint.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from anytime.config import LearnerConfig
from anytime.learner.base import StepResult, lr_lambda
from anytime.learner.data_parallel import DataParallelLearner

CHECKPOINT_TAG = "deepspeed"


def _init_single_process() -> None:
    """A single process not started by a launcher joins a world of one on a free port."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


class DeepSpeedLearner(DataParallelLearner):
    def __init__(self, model: torch.nn.Module, cfg: LearnerConfig, total_steps: int,
                 ref_model: torch.nn.Module | None = None):
        import deepspeed

        if not dist.is_initialized():
            if "RANK" not in os.environ:
                _init_single_process()
            deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
        ds_config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": cfg.grad_clip,
            "zero_optimization": {"stage": cfg.zero_stage},
            "bf16": {"enabled": cfg.bf16},
            "optimizer": {"type": "AdamW", "params": {"lr": cfg.lr, "betas": list(cfg.betas),
                                                       "weight_decay": cfg.weight_decay,
                                                       "torch_adam": not torch.cuda.is_available()}},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        schedule = lr_lambda(cfg.lr_schedule, cfg.warmup_steps, total_steps)
        # DeepSpeed builds the scheduler on its base optimizer, steps it and checkpoints it itself.
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=ds_config,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule))
        super().__init__(self.engine.module, cfg, ref_model)
        self._zero3 = cfg.zero_stage == 3
        self._skipped_seen = 0

    def _backward(self, loss: torch.Tensor, last: bool) -> None:
        # ZeRO reduces gradients in the backward of the accumulation boundary: mark the last micro-batch.
        self.engine.set_gradient_accumulation_boundary(last)
        self.engine.backward(loss, scale_wrt_gas=False)

    def optimizer_step(self) -> StepResult:
        lr = self.optimizer.param_groups[0]["lr"]
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else float("nan")
        skipped = self.engine.skipped_steps > self._skipped_seen  # ZeRO's overflow check, same on every rank
        self._skipped_seen = self.engine.skipped_steps
        return StepResult(norm, skipped or not math.isfinite(norm), lr)

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    @contextlib.contextmanager
    def _gathered(self) -> Iterator[None]:
        if self._zero3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(self.model.parameters()), modifier_rank=None):
                yield
        else:
            yield

    def full_state_dict(self, all_ranks: bool = False) -> dict[str, torch.Tensor]:
        with self._gathered():  # ZeRO-3 gathers on every rank
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def save(self, folder: Path) -> None:
        self.engine.save_checkpoint(str(folder), tag=CHECKPOINT_TAG, save_latest=False)

    def load(self, folder: Path) -> None:
        from anytime.learner.checkpoint import check_deepspeed_files

        check_deepspeed_files(folder / CHECKPOINT_TAG)  # DeepSpeed's own loader unpickles them
        self.engine.load_checkpoint(str(folder), tag=CHECKPOINT_TAG, load_module_strict=False)
