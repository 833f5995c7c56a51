"""Optimizer post-validation: global grad-norm clipping and inf/NaN checks without a blocking
all-reduce in front of the optimizer step (zero-bubble paper §5).

A plain pipeline learner must all-reduce the squared gradient norm and an inf flag across the
stages before stepping; that barrier lines the stages up and re-opens the bubble a zero-bubble
schedule closed. Here each rank looks at its own gradients first. Its local norm is a lower
bound of the global one, so a local inf or a local norm above the clip threshold already
decides the outcome (no speculative step). Otherwise the rank steps at once, *speculatively*,
and posts a non-blocking all-reduce of [‖g‖², #non-finite, extra sums]. `validate()` waits for
it when the result is needed and, if the global state disagrees with the speculation:
- global inf/NaN: the step is undone and skipped;
- global norm above the threshold: the step is undone, the gradients scaled by the clip
  coefficient (the same one `torch.nn.utils.clip_grad_norm_` uses) and the step redone.
The undo is the in-place inverse of Adam/AdamW (exact up to rounding, no extra memory) or, for
other optimizers or on request, a restore from a snapshot taken before the speculative step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from anytime.core.dist import collective_device

ROLLBACK_MODES = ("auto", "inverse", "snapshot")
CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s epsilon, so clipping matches it exactly


@dataclass
class Validation:
    """Outcome of one validated step."""

    grad_norm: float
    clipped: bool
    skipped: bool
    speculative: bool      # the rank stepped before the global result was known
    rolled_back: bool      # ... and had to undo that step
    extras: list[float] = field(default_factory=list)


def clip_coefficient(max_grad_norm: float | None, norm: float) -> float:
    """`torch.nn.utils.clip_grad_norm_`'s scale for a gradient of this norm (1: no clipping)."""
    if max_grad_norm is None:
        return 1.0
    return min(1.0, max_grad_norm / (norm + CLIP_EPS))


class GlobalState:
    """This rank's [‖g‖², non-finite flag, extras...] summed over `group`, in flight until `wait()`
    (a blocking all-reduce when `async_op` is False)."""

    def __init__(self, sq_norm: float, nonfinite: bool, extras: Sequence[float], group: dist.ProcessGroup | None,
                 async_op: bool) -> None:
        self.buffer = torch.tensor([0.0 if nonfinite else sq_norm, float(nonfinite), *extras], dtype=torch.float64,
                                   device=collective_device(group))
        self.work = None
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            self.work = dist.all_reduce(self.buffer, group=group, async_op=async_op)

    def wait(self) -> tuple[float, bool, list[float]]:
        """(global ‖g‖², any rank non-finite, summed extras)."""
        if self.work is not None:
            self.work.wait()
        values = self.buffer.cpu().tolist()
        return values[0], values[1] > 0, values[2:]


def adam_invertible(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `undo_adam_step` can invert this optimizer's steps."""
    if not isinstance(optimizer, torch.optim.Adam):  # AdamW subclasses Adam
        return False
    return all(not g.get("amsgrad") and not g.get("maximize") and not g.get("capturable")
               and not g.get("differentiable") for g in optimizer.param_groups)


def undo_adam_step(optimizer: torch.optim.Adam) -> None:
    """Invert the last `step()` of Adam/AdamW in place, using the gradients it consumed.

    p ← (p + lr·m̂/(√v̂+ε)) / (1 − lr·wd) (AdamW) ; v ← (v − (1−β2)g²)/β2 ; m ← (m − (1−β1)g)/β1 ;
    step −= 1. A parameter whose state goes back to step 0 loses its state entry, exactly as
    before its first step.
    """
    decoupled = isinstance(optimizer, torch.optim.AdamW) or any(
        g.get("decoupled_weight_decay", False) for g in optimizer.param_groups)
    with torch.no_grad():
        for group in optimizer.param_groups:
            beta1, beta2 = group["betas"]
            lr, wd, eps = float(group["lr"]), group["weight_decay"], group["eps"]
            for p in group["params"]:
                state = optimizer.state.get(p)
                if p.grad is None or not state:
                    continue
                step = float(state["step"])
                m, v = state["exp_avg"], state["exp_avg_sq"]
                bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** step
                denom = (v.sqrt() / math.sqrt(bc2)).add_(eps)
                p.addcdiv_(m, denom, value=lr / bc1)
                grad = p.grad
                if wd != 0:
                    if decoupled:
                        p.div_(1 - lr * wd)
                    else:
                        grad = grad.add(p, alpha=wd)
                if step <= 1:
                    del optimizer.state[p]
                    continue
                v.addcmul_(grad, grad, value=-(1 - beta2)).div_(beta2)
                m.sub_(grad, alpha=1 - beta1).div_(beta1)
                state["step"] -= 1


class _Snapshot:
    """Parameters and optimizer state before a speculative step (any optimizer, exact)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.params = [(p, p.detach().clone()) for g in optimizer.param_groups for p in g["params"]]
        self.state = {p: {k: v.clone() if torch.is_tensor(v) else v for k, v in optimizer.state[p].items()}
                      for p, _ in self.params if p in optimizer.state}

    def restore(self, optimizer: torch.optim.Optimizer) -> None:
        with torch.no_grad():
            for p, saved in self.params:
                p.copy_(saved)
                if p in self.state:
                    optimizer.state[p] = self.state[p]
                else:
                    optimizer.state.pop(p, None)


class PostValidator:
    """Speculative optimizer step with deferred global clip / inf validation.

    `norm_params` are the parameters whose gradients count toward the global norm on this rank
    (a tied weight held by two ranks counts once); clipping scales every parameter the optimizer
    owns. With `enabled=False` it is the classic blocking path (all-reduce, clip, step), kept as
    the baseline. `step(extras)` also sums the floats in `extras` across ranks for free (the
    learner's loss statistics ride on the same all-reduce).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, norm_params: Sequence[nn.Parameter], *,
                 max_grad_norm: float | None = None, group: dist.ProcessGroup | None = None,
                 enabled: bool = True, rollback: str = "auto") -> None:
        if rollback not in ROLLBACK_MODES:
            raise ValueError(f"rollback={rollback!r}; choose one of {', '.join(ROLLBACK_MODES)}")
        if rollback == "inverse" and not adam_invertible(optimizer):
            raise ValueError("rollback='inverse' needs torch.optim.Adam/AdamW without amsgrad/maximize/capturable; "
                             "use rollback='snapshot' for other optimizers")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm}")
        self.optimizer, self.norm_params = optimizer, list(norm_params)
        self.max_grad_norm, self.group, self.enabled = max_grad_norm, group, enabled
        self.inverse = rollback == "inverse" or (rollback == "auto" and adam_invertible(optimizer))
        self._state: GlobalState | None = None
        self._stepped = False
        self._snapshot: _Snapshot | None = None

    @property
    def pending(self) -> bool:
        return self._state is not None

    def _params(self) -> list[nn.Parameter]:
        return [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]

    def _local_sq_norm(self) -> torch.Tensor:
        grads = [p.grad.detach() for p in self.norm_params if p.grad is not None]
        if not grads:
            return torch.zeros((), dtype=torch.float64)
        return torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]).pow(2).sum().cpu()

    def step(self, extras: Sequence[float] = ()) -> Validation | None:
        """Step now if the local gradients allow it; returns the validation when it is already known
        (disabled mode or a single rank), else None (call `validate()`)."""
        if self.pending:
            raise RuntimeError("previous step not validated yet: call validate() first")
        sq = float(self._local_sq_norm())
        nonfinite = not math.isfinite(sq)
        self._state = GlobalState(sq, nonfinite, extras, self.group, async_op=self.enabled)
        self._stepped = False
        if self.enabled and not nonfinite and clip_coefficient(self.max_grad_norm, math.sqrt(sq)) >= 1.0:
            self._snapshot = None if self.inverse else _Snapshot(self.optimizer)
            self.optimizer.step()
            self._stepped = True
        return None if self.enabled else self.validate()

    def validate(self) -> Validation:
        """Wait for the global state and make the local step agree with it."""
        if not self.pending:
            raise RuntimeError("nothing to validate: call step() first")
        sq, nonfinite, extras = self._state.wait()
        self._state = None
        stepped, rolled_back, clipped = self._stepped, False, False
        coef = clip_coefficient(self.max_grad_norm, math.sqrt(sq)) if not nonfinite else 1.0
        if stepped and (nonfinite or coef < 1.0):
            self._undo()
            rolled_back = True
        if not nonfinite:
            if coef < 1.0:
                clipped = True
                with torch.no_grad():
                    for p in self._params():
                        p.grad.mul_(coef)
            if not stepped or rolled_back:
                self.optimizer.step()
        self._snapshot, self._stepped = None, False
        self.optimizer.zero_grad(set_to_none=True)
        return Validation(grad_norm=math.sqrt(sq) if not nonfinite else float("inf"), clipped=clipped,
                          skipped=nonfinite, speculative=stepped, rolled_back=rolled_back, extras=extras)

    def _undo(self) -> None:
        if self.inverse:
            undo_adam_step(self.optimizer)
        else:
            self._snapshot.restore(self.optimizer)
