"""The learner interface: what the trainer and the PPO loop ask of a learner, whatever runs it
(plain PyTorch data parallel, DeepSpeed ZeRO, or a zero-bubble pipeline). The implementations are
registered in `anytime.learner` and built by `anytime.learner.factory.build_learner`; nothing
outside the learners branches on the learner kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from anytime.algo.loss import LossSpec
from anytime.batch.train_batch import TrainBatch


@dataclass
class StepResult:
    """The outcome of one optimizer step over a mini-batch."""

    grad_norm: float       # global gradient norm before clipping (every rank sees the same)
    skipped: bool          # non-finite gradients: the update was not applied
    lr: float              # the learning rate the step used


class Learner(Protocol):
    """A policy learner. Every method is collective: all learner ranks call it together.

    Rows of prompt p are trained by data-parallel rank p % dp_size; `dp_ranks[r]` is the
    data-parallel rank of global rank r (pipeline stages of one replica share it).
    """

    dp_size: int
    dp_ranks: list[int]
    config: Any                # the Hugging Face model config

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """log π(input_ids[:, t+1] | input_ids[:, :t+1]) of this rank's rows, [R, T-1] float32."""

    def forward_backward(self, batch: TrainBatch, loss: LossSpec) -> dict[str, float]:
        """Accumulate the gradient of this rank's share of one mini-batch's loss (`loss` normalises
        over the whole mini-batch: learners sum the replicas' gradients). Returns this rank's sums: `loss`, `tokens`
        and token-weighted statistics (`clip_frac`, `approx_kl`, `ratio_mean`, `entropy`, `kl_ref`
        times tokens); a non-finite `loss` means the gradient must not be applied."""

    def optimizer_step(self) -> StepResult:
        """Clip by the global norm and step (skipped, on every rank, if any gradient is non-finite)."""

    def zero_grad(self) -> None:
        """Drop the accumulated gradient without stepping."""

    def full_state_dict(self, all_ranks: bool = False) -> dict[str, torch.Tensor]:
        """The whole model's weights under Hugging Face names, complete on rank 0 (on every rank with
        `all_ranks`, for rollout workers colocated with each learner rank)."""

    def save(self, folder: Path) -> None:
        """Write the learner's own state (optimizer, scheduler, shards) into `folder`."""

    def load(self, folder: Path) -> None:
        """Restore the weights and the state `save` wrote from a checkpoint folder."""
