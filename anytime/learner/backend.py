"""Learner backends: plain PyTorch (AdamW) and DeepSpeed (ZeRO 0-3), behind one small interface.

Both give: `model` (the trainable module), `backward(loss)`, `step() -> StepResult` (clip, skip on
non-finite gradients, optimizer + scheduler step), `state_dict()` / `load_state_dict()` for
checkpoints, and `full_state_dict()` with full (gathered) weights for weight sync and export.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from anytime.config import LearnerConfig


@dataclass
class StepResult:
    grad_norm: float
    skipped: bool          # non-finite gradients: the update was not applied
    lr: float


def lr_lambda(schedule: str, warmup: int, total: int):
    def fn(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if schedule == "linear":
            return 1.0 - progress
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0
    return fn


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _all_finite(flag: bool) -> bool:
    """True on every rank only if every rank's flag is true."""
    if _world() == 1:
        return flag
    t = torch.tensor([0.0 if flag else 1.0])
    dist.all_reduce(t)
    return t.item() == 0.0


class TorchBackend:
    """Single-process (or DDP-free data-parallel via all-reduce of gradients) PyTorch learner."""

    def __init__(self, model: torch.nn.Module, cfg: LearnerConfig, total_steps: int):
        self.model, self.cfg = model, cfg
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas),
                                           weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(cfg.lr_schedule, cfg.warmup_steps, total_steps))

    def backward(self, loss: torch.Tensor, last: bool = True) -> None:
        loss.backward()

    def step(self) -> StepResult:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if _world() > 1:  # average gradients across data-parallel ranks
            for p in params:
                dist.all_reduce(p.grad)
                p.grad /= _world()
        norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf"))
        lr = self.optimizer.param_groups[0]["lr"]
        if not _all_finite(bool(torch.isfinite(norm))):
            self.optimizer.zero_grad(set_to_none=True)
            return StepResult(float(norm), True, lr)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(float(norm), False, lr)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    @contextlib.contextmanager
    def gathered_parameters(self) -> Iterator[None]:
        yield

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.state_dict().items()}


class DeepSpeedBackend:
    """DeepSpeed engine with ZeRO 0-3; on the CPU it uses gloo and torch's AdamW (no JIT op build)."""

    def __init__(self, model: torch.nn.Module, cfg: LearnerConfig, total_steps: int):
        import deepspeed

        if not dist.is_initialized():
            if "RANK" not in os.environ:  # a single process not started by a launcher: a world of one
                import socket

                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", 0))
                    port = sock.getsockname()[1]
                os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                                  MASTER_PORT=str(port))
            deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
        self.cfg = cfg
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
        self.model = self.engine.module
        self._zero3 = cfg.zero_stage == 3

    def backward(self, loss: torch.Tensor, last: bool = True) -> None:
        # ZeRO reduces gradients in the backward of the accumulation boundary: mark the last micro-batch.
        self.engine.set_gradient_accumulation_boundary(last)
        self.engine.backward(loss, scale_wrt_gas=False)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    def step(self) -> StepResult:
        lr = self.optimizer.param_groups[0]["lr"]
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else float("nan")
        overflow = bool(getattr(self.engine, "skipped_steps", 0) > getattr(self, "_skipped_seen", 0))
        self._skipped_seen = getattr(self.engine, "skipped_steps", 0)
        return StepResult(norm, overflow or not math.isfinite(norm), lr)

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        return {}  # optimizer and scheduler live in the DeepSpeed checkpoint

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    @contextlib.contextmanager
    def gathered_parameters(self) -> Iterator[None]:
        if self._zero3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(self.model.parameters()), modifier_rank=None):
                yield
        else:
            yield

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        with self.gathered_parameters():
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def create_backend(model: torch.nn.Module, cfg: LearnerConfig, total_steps: int) -> TorchBackend | DeepSpeedBackend:
    if cfg.backend == "deepspeed":
        return DeepSpeedBackend(model, cfg, total_steps)
    return TorchBackend(model, cfg, total_steps)
