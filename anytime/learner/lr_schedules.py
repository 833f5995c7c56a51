"""Learning-rate multipliers (registered in `anytime.components.LR_SCHEDULES`): a linear warm-up, then
the named schedule as a function of the progress through the remaining steps."""

from __future__ import annotations

import math
from collections.abc import Callable

from anytime.components import LR_SCHEDULES


def constant(progress: float) -> float:
    return 1.0


def linear(progress: float) -> float:
    return 1.0 - progress


def cosine(progress: float) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_lambda(schedule: str, warmup: int, total: int) -> Callable[[int], float]:
    """The multiplier of step `step` for `torch.optim.lr_scheduler.LambdaLR`."""
    after_warmup = LR_SCHEDULES.get(schedule)

    def fn(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        return after_warmup(min(1.0, (step - warmup) / max(1, total - warmup)))

    return fn
