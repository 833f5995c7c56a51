"""Advantage estimators: BRPO (paper eq. 6-9) for thinking tokens, the per-prefix summary
baseline (§2.3), and the usual trace-level baselines (GRPO, Dr.GRPO, RLOO). Each family is a
registry of the functions themselves, right after them (`VARIANCE_REDUCTIONS`, `SUMMARY_ESTIMATORS`,
`THINKING_ESTIMATORS`); its names are declared in `anytime.algo` too, for the recipe schema.

Shapes: G traces per prompt, S budgets, A summaries per budget. Thinking estimators map
`scores [B, G, S]` (mean summary score of trace g at budget j) and the prior `probs [S]` to the
advantage of each budget *segment* `[B, G, S]`: every thinking token in (b_{j-1}, b_j] gets
entry j. Summary estimators map `[B, G, S, A]` scores to `[B, G, S, A]`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from anytime.algo import SUMMARY_ESTIMATOR_NAMES, THINKING_ESTIMATOR_NAMES, VARIANCE_REDUCTION_NAMES


def _as_tensor(x: torch.Tensor | Sequence, like: torch.Tensor | None = None) -> torch.Tensor:
    t = torch.as_tensor(x, dtype=torch.float64 if like is None else like.dtype)
    return t if like is None else t.to(like.device)


def returns_to_go(scores: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """R[..., s] = Σ_{j ≥ s} P_j r_j (eq. 6)."""
    weighted = scores * probs
    return weighted.flip(-1).cumsum(-1).flip(-1)


def brpo_advantages(scores: torch.Tensor, probs: torch.Tensor | Sequence[float], decay: float = 0.5,
                    variant: str = "brpo") -> torch.Tensor:
    """Budget-relative advantages of the thinking segments, `[G, S]` or `[B, G, S]`.

    V1 (the trace's own progress) is a λ-discounted mean of its earlier budget scores times the
    remaining prior mass; V2 is the group mean return (self included); the baseline moves from V2
    to V1 as the segment index grows: V = (s·V1 + (S−s)·V2) / S. No std normalisation (Dr.GRPO).
    """
    baseline = VARIANCE_REDUCTIONS.get(variant)  # an unknown variant fails before any work
    if not 0.0 < decay <= 1.0:
        raise ValueError(f"decay (λ) must be in (0, 1], got {decay}")
    scores = torch.as_tensor(scores)
    if not scores.is_floating_point():
        scores = scores.double()
    if scores.dim() not in (2, 3):
        raise ValueError(f"scores must be [G, S] or [B, G, S], got shape {tuple(scores.shape)}")
    probs = _as_tensor(probs, scores)
    S = scores.shape[-1]
    if probs.shape != (S,):
        raise ValueError(f"probs must have one entry per budget ({S}), got shape {tuple(probs.shape)}")
    R = returns_to_go(scores, probs)
    return R - baseline(R, scores, probs, decay)


def no_baseline(R: torch.Tensor, scores: torch.Tensor, probs: torch.Tensor, decay: float) -> torch.Tensor | float:
    return 0.0


def group_baseline(R: torch.Tensor, scores: torch.Tensor, probs: torch.Tensor, decay: float) -> torch.Tensor:
    """V2: the group's mean return, self included."""
    return R.mean(dim=-2, keepdim=True).expand_as(R)


def progress_baseline(R: torch.Tensor, scores: torch.Tensor, probs: torch.Tensor, decay: float) -> torch.Tensor:
    """V1[g, s] = (Σ_{j<s} λ^{s-j} r_j / Σ_{j<s} λ^{s-j}) · Σ_{j≥s} P_j, and 0 for s = 0."""
    S = scores.shape[-1]
    idx = torch.arange(S, device=scores.device)
    exponent = (idx[:, None] - idx[None, :]).to(scores.dtype)  # [s, j] = s - j
    weights = torch.where(idx[None, :] < idx[:, None], decay ** exponent, torch.zeros_like(exponent))
    norm = weights.sum(-1).clamp_min(1e-30)
    discounted = scores @ weights.T / norm  # [.., G, s]
    remaining = probs.flip(0).cumsum(0).flip(0)
    return torch.where(idx == 0, torch.zeros_like(discounted), discounted * remaining)


def brpo_baseline(R: torch.Tensor, scores: torch.Tensor, probs: torch.Tensor, decay: float) -> torch.Tensor:
    """V = (s·V1 + (S−s)·V2) / S: from the group's mean return to the trace's own progress."""
    S = scores.shape[-1]
    s = torch.arange(S, device=scores.device).to(scores.dtype)
    V1, V2 = progress_baseline(R, scores, probs, decay), group_baseline(R, scores, probs, decay)
    return (s * V1 + (S - s) * V2) / S


VARIANCE_REDUCTIONS = VARIANCE_REDUCTION_NAMES.implemented_by({
    "brpo": brpo_baseline,
    "v1only": progress_baseline,
    "v2only": group_baseline,
    "none": no_baseline,
})


def summary_advantages(scores: torch.Tensor, prefix_group: torch.Tensor | None = None) -> torch.Tensor:
    """Summary advantages `[G, S, A]` (or `[B, G, S, A]`): score minus the mean of the summaries that
    share the same truncated prefix. `prefix_group [.., G, S]` gives budgets of one trace that share
    one summary prompt (past the trace's natural end) the same id; by default every budget is its own
    prefix. A prefix holding a single summary gets baseline 0. With A = 1 the baseline is the mean
    over the G traces at the same budget, whatever the prefix groups (the official code's rule)."""
    scores = torch.as_tensor(scores)
    if not scores.is_floating_point():
        scores = scores.double()
    if scores.dim() not in (3, 4):
        raise ValueError(f"scores must be [G, S, A] or [B, G, S, A], got shape {tuple(scores.shape)}")
    A = scores.shape[-1]
    if A == 1:
        return scores - scores.mean(dim=-3, keepdim=True)
    if prefix_group is None:
        return scores - scores.mean(dim=-1, keepdim=True)
    prefix_group = torch.as_tensor(prefix_group, device=scores.device)
    if prefix_group.shape != scores.shape[:-1]:
        raise ValueError(f"prefix_group must have shape {tuple(scores.shape[:-1])}, got {tuple(prefix_group.shape)}")
    same = prefix_group[..., :, None] == prefix_group[..., None, :]  # [.., G, S, S]
    sums = (same.to(scores.dtype) @ scores.sum(-1, keepdim=True)).squeeze(-1)  # [.., G, S]
    counts = same.sum(-1).to(scores.dtype) * A
    baseline = torch.where(counts > 1, sums / counts, torch.zeros_like(sums))
    return scores - baseline[..., None]


def summary_advantages_last_only(scores: torch.Tensor, prefix_group: torch.Tensor | None = None) -> torch.Tensor:
    """The GRPO baseline's summary training: only the last budget's summaries learn, against the
    group mean over all G·A of them; other budgets get 0."""
    scores = torch.as_tensor(scores)
    if not scores.is_floating_point():
        scores = scores.double()
    last = scores[..., -1, :]
    adv = torch.zeros_like(scores)
    adv[..., -1, :] = last - last.mean(dim=(-2, -1), keepdim=True)
    return adv


SUMMARY_ESTIMATORS = SUMMARY_ESTIMATOR_NAMES.implemented_by({
    "brpo": summary_advantages,
    "grpo": summary_advantages_last_only,
})


def grpo_advantages(rewards: torch.Tensor, scale_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """(r − group mean) / group std for `[G]` or `[B, G]`; `scale_by_std=False` is Dr.GRPO."""
    rewards = torch.as_tensor(rewards)
    if not rewards.is_floating_point():
        rewards = rewards.double()
    centred = rewards - rewards.mean(dim=-1, keepdim=True)
    if not scale_by_std:
        return centred
    return centred / (rewards.std(dim=-1, keepdim=True, unbiased=True).nan_to_num(0.0) + eps)


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Leave-one-out baseline: r_i − mean_{j≠i} r_j for `[G]` or `[B, G]` (G ≥ 2)."""
    rewards = torch.as_tensor(rewards)
    if not rewards.is_floating_point():
        rewards = rewards.double()
    G = rewards.shape[-1]
    if G < 2:
        raise ValueError("RLOO needs at least 2 samples per prompt")
    others = (rewards.sum(dim=-1, keepdim=True) - rewards) / (G - 1)
    return rewards - others


# --- the thinking estimators, by name -----------------------------------------------------------

def _per_segment(trace_estimator: Callable[[torch.Tensor], torch.Tensor], scores: torch.Tensor,
                 probs: torch.Tensor | Sequence[float]) -> torch.Tensor:
    """A trace-level estimator lifted to segments: the trace reward is the full prior-weighted return
    R[..., 0] (with the `base` prior: the final-budget score), shared by every segment."""
    scores = torch.as_tensor(scores, dtype=torch.float64) if not torch.is_tensor(scores) else scores
    total = returns_to_go(scores, _as_tensor(probs, scores))[..., 0]
    return trace_estimator(total)[..., None].expand_as(scores).clone()


def brpo_thinking(scores: torch.Tensor, probs: torch.Tensor, decay: float = 0.5, variant: str = "brpo",
                  **_: object) -> torch.Tensor:
    """BRPO: budget-relative advantages per segment (`brpo_advantages`)."""
    return brpo_advantages(scores, probs, decay=decay, variant=variant)


def grpo_thinking(scores: torch.Tensor, probs: torch.Tensor, **_: object) -> torch.Tensor:
    """GRPO on the trace's prior-weighted return: centred and scaled by the group's std."""
    return _per_segment(lambda r: grpo_advantages(r, scale_by_std=True), scores, probs)


def dr_grpo_thinking(scores: torch.Tensor, probs: torch.Tensor, **_: object) -> torch.Tensor:
    """Dr.GRPO on the trace's prior-weighted return: centred, not scaled."""
    return _per_segment(lambda r: grpo_advantages(r, scale_by_std=False), scores, probs)


def rloo_thinking(scores: torch.Tensor, probs: torch.Tensor, **_: object) -> torch.Tensor:
    """RLOO on the trace's prior-weighted return: leave-one-out baseline."""
    return _per_segment(rloo_advantages, scores, probs)


THINKING_ESTIMATORS = THINKING_ESTIMATOR_NAMES.implemented_by({
    "brpo": brpo_thinking,
    "grpo": grpo_thinking,
    "dr_grpo": dr_grpo_thinking,
    "rloo": rloo_thinking,
})


def thinking_advantages(name: str, scores: torch.Tensor, probs: Sequence[float] | torch.Tensor,
                        **kwargs: object) -> torch.Tensor:
    """The thinking advantages of the estimator registered as `name` in `THINKING_ESTIMATORS`."""
    return THINKING_ESTIMATORS.get(name)(scores, probs, **kwargs)


def summary_advantages_by_name(name: str, scores: torch.Tensor,
                               prefix_group: torch.Tensor | None = None) -> torch.Tensor:
    """The summary advantages of the estimator registered as `name` in `SUMMARY_ESTIMATORS`."""
    return SUMMARY_ESTIMATORS.get(name)(scores, prefix_group)
