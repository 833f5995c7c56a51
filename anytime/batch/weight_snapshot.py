"""The learner's weights as they go to the rollout engines after an update: the trainer takes them from the
learner, shaped as the placement plan asks (`anytime.config.placement_plan`), and hands them to the rollout
side (`Rollouts.sync_weights`), which never calls the learner itself."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class WeightSnapshot:
    """The learner's weights as the placement plan asks for them (`PlacementPlan.lora_weights`,
    `every_rank_gathers`), taken by the trainer before the engines wake: the full (or LoRA-merged) Hugging
    Face state dict, complete on the ranks that hold an engine, or a LoRA adapter's factors (`AdapterUpdate`)
    for engines that serve it themselves. `version`: the updates in them."""

    version: int
    state: dict[str, torch.Tensor] | None = None
    adapter: Sequence[tuple[str, torch.Tensor, torch.Tensor, float]] | None = None

    @property
    def nbytes(self) -> int:
        tensors = list(self.state.values()) if self.state is not None else [
            t for _, a, b, _ in self.adapter or () for t in (a, b)]
        return sum(t.numel() * t.element_size() for t in tensors)
