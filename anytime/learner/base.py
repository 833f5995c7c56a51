"""The learner interface: what the trainer and the PPO loop ask of a learner, whatever runs it
(plain PyTorch data parallel, DeepSpeed ZeRO, or a zero-bubble pipeline), and the factory that
builds the one a recipe names. Nothing outside the learners branches on the learner kind.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from anytime.learner.batch import TrainBatch


@dataclass
class StepResult:
    """The outcome of one optimizer step over a mini-batch."""

    grad_norm: float       # global gradient norm before clipping (every rank sees the same)
    skipped: bool          # non-finite gradients: the update was not applied
    lr: float              # the learning rate the step used


@dataclass(frozen=True)
class LossSpec:
    """How a mini-batch's tokens become one scalar loss: the PPO-clip settings and the loss
    normaliser of this mini-batch (see `anytime.learner.ppo.loss_spec`)."""

    agg: str
    clip_low: float
    clip_high: float
    num_tokens: float
    num_rows: float | None
    max_len: int
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    kl_type: str = "k3"

    def policy_loss_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `anytime.algo.loss.policy_loss`."""
        return {"agg": self.agg, "clip_low": self.clip_low, "clip_high": self.clip_high,
                "num_tokens": self.num_tokens, "num_rows": self.num_rows, "max_len": self.max_len,
                "entropy_coef": self.entropy_coef, "kl_coef": self.kl_coef, "kl_type": self.kl_type}


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

    def load(self, folder: Path, weights: dict[str, torch.Tensor]) -> None:
        """Restore the weights (full-model names) and the state `save` wrote."""


def lr_lambda(schedule: str, warmup: int, total: int) -> Callable[[int], float]:
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


# The learner of each (pipelined, backend), as "module:class", imported when used: DeepSpeed is an
# optional extra. Pipelined learners build their stages from the model path themselves; the
# data-parallel ones take a loaded model (and the reference model).
LEARNERS: dict[tuple[bool, str], str] = {
    (False, "torch"): "anytime.learner.data_parallel:TorchLearner",
    (False, "deepspeed"): "anytime.learner.deepspeed_learner:DeepSpeedLearner",
    (True, "torch"): "anytime.learner.pipeline_learner:PipelineLearner",
    (True, "deepspeed"): "anytime.learner.deepspeed_pipeline:DeepSpeedPipelineLearner",
}


def learner_class(pipelined: bool, backend: str) -> type:
    import importlib

    module, name = LEARNERS[(pipelined, backend)].split(":")
    return getattr(importlib.import_module(module), name)


def build_learner(recipe: Any, model_path: str) -> Learner:
    """The learner a recipe asks for, on this process's device."""
    from anytime.defaults import torch_dtype

    lc = recipe.learner
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch_dtype(recipe.model.dtype)
    total = recipe.trainer.steps
    pipelined = lc.pipeline.stages > 1
    kind = learner_class(pipelined, lc.backend)
    if pipelined:
        return kind(model_path, lc, total, dtype=dtype, seed=recipe.trainer.seed, device=device)
    from anytime.learner.data_parallel import load_model

    model = load_model(model_path, dtype, device, recipe.model.trust_remote_code, recipe.model.gradient_checkpointing)
    ref = None
    if lc.reference_model:
        ref = load_model(model_path, dtype, device, recipe.model.trust_remote_code, False).eval()
        ref.requires_grad_(False)
    return kind(model, lc, total, ref_model=ref)
