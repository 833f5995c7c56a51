"""The decoupled off-policy correction (AReaL's decoupled PPO; truncated or masked importance
sampling, TIS / MIS). The engine sampled the tokens (the behaviour policy, `rollout_logprobs`);
PPO's ratio and clip are taken against the learner before the update (the proximal policy,
`old_logprobs`). Each trained token's advantage is multiplied by w = π_prox / π_behav =
exp(old − rollout), computed once per step without gradient (it depends on no trained parameter),
while the clip stays on π / π_prox. Folded into `TrainBatch.advantages` before the PPO epochs, it
reaches every learner (torch, DeepSpeed, pipelined) with no change to their loss code.

Modes (`OFFPOLICY_CORRECTIONS`, recipe `algorithm.offpolicy_correction`): `none`
(w = 1; the batch is left untouched), `tis` (w = min(w, cap)), `mis` (w = 0 above the cap: the
token, or the whole sequence, gives no gradient; verl's mask mode). With cap `inf` a sequence weight
past the float range is inf, and the update it reaches is skipped as non-finite.

Levels (`algorithm.is_level`): `token`, each token its own w; or `sequence`, one w per sampled
sequence, exp(Σ over its trained tokens of old − rollout), truncated or masked as a whole and
applied to all of its tokens. The sequences are the ones seq-mean-token-mean averages over: a row,
or in tree-packed rows a (row, `TrainBatch.segments`) pair, i.e. the thinking trace (segment 0) and
each summary branch. Every trained token belongs to exactly one of them, so no token is ambiguous:
the thinking a packed row's summaries share is trained only as the thinking trace's own tokens
(weighted by that trace's w), and a summary, sampled given its prefix, is weighted by its own
tokens alone, exactly as in the row-per-summary layout. Untrained tokens (prompt, inserted tokens,
padding) never enter a weight or a statistic.

Statistics (`is_*`), over the trained tokens, or the sequences at sequence level, of every rank:
the mean, max and normalised effective sample size (Σw)²/(n·Σw²) of the raw weights (before
truncation), and `is_clipped_frac`, the share truncated (tis) or masked (mis). Ranks send
log-space sums, so a long sequence's weight past the float range still gives a finite ESS, and
ranks that hold the same rows (pipeline stages) leave every statistic unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from anytime.algo import OFFPOLICY_CORRECTION_NAMES
from anytime.batch.train_batch import TrainBatch
from anytime.core.dist import all_gather_object

IS_LEVELS = ("token", "sequence")


# --- the modes: raw weights -> (applied weights, which of them were cut) -------------------------

def no_correction(weights: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """w = 1: the weights are only measured."""
    return torch.ones_like(weights), torch.zeros_like(weights, dtype=torch.bool)


def truncated_weights(weights: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """TIS: min(w, cap)."""
    over = weights > cap
    return weights.clamp(max=cap), over


def masked_weights(weights: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """MIS: w, or 0 when above the cap."""
    over = weights > cap
    return weights.masked_fill(over, 0.0), over


OFFPOLICY_CORRECTIONS = OFFPOLICY_CORRECTION_NAMES.implemented_by(
    {"none": no_correction, "tis": truncated_weights, "mis": masked_weights})


# --- weights and statistics ----------------------------------------------------------------------

def _sequence_ids(mask: torch.Tensor, segments: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """The sampled sequence (row, or row and segment) of each trained token, numbered 0..n-1, and n."""
    rows = torch.arange(mask.shape[0], device=mask.device)[:, None].expand(mask.shape)
    if segments is None:
        key = rows
    else:
        width = int(segments.max()) + 1 if segments.numel() else 1
        key = rows * width + segments.long()
    keys, ids = torch.unique(key[mask], return_inverse=True)
    return ids, len(keys)


def weights_and_sums(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                     segments: torch.Tensor | None, mode: str, level: str, cap: float
                     ) -> tuple[torch.Tensor, dict[str, float]]:
    """The per-token weights (1 on untrained tokens) and this rank's log-space sums of the statistics
    (`summarize` turns several ranks' sums into the statistics)."""
    if level not in IS_LEVELS:
        raise ValueError(f"importance-weight level must be one of {IS_LEVELS}, got {level!r}")
    correct = OFFPOLICY_CORRECTIONS.get(mode)
    mask = mask.bool()
    # float64: a sequence's sum of thousands of small log-ratios, and its exp, keep their precision
    log_ratio = old_logprobs.double()[mask] - rollout_logprobs.double().to(old_logprobs.device)[mask]
    if level == "token":
        log_w = log_ratio
    else:
        sequence, count = _sequence_ids(mask, segments)
        log_w = log_ratio.new_zeros(count).index_add(0, sequence, log_ratio)
    applied, cut = correct(torch.exp(log_w), cap)
    weights = torch.ones(mask.shape, dtype=old_logprobs.dtype, device=old_logprobs.device)
    weights[mask] = (applied if level == "token" else applied[sequence]).to(weights.dtype)
    empty = log_w.numel() == 0
    parts = {"units": float(log_w.numel()), "cut": float(cut.sum()),
             "log_sum": float(torch.logsumexp(log_w, 0)) if not empty else -math.inf,
             "log_sum_sq": float(torch.logsumexp(2 * log_w, 0)) if not empty else -math.inf,
             "log_max": float(log_w.max()) if not empty else -math.inf}
    return weights, parts


def summarize(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    """The statistics of several ranks' sums; with no trained token anywhere, those of w = 1."""
    n = sum(p["units"] for p in parts)
    if n == 0:
        return {"is_weight_mean": 1.0, "is_weight_max": 1.0, "is_clipped_frac": 0.0, "is_ess": 1.0}
    log_sum = torch.logsumexp(torch.tensor([p["log_sum"] for p in parts], dtype=torch.float64), 0)
    log_sum_sq = torch.logsumexp(torch.tensor([p["log_sum_sq"] for p in parts], dtype=torch.float64), 0)
    log_max = torch.tensor(max(p["log_max"] for p in parts), dtype=torch.float64)
    return {"is_weight_mean": float(torch.exp(log_sum - math.log(n))),
            "is_weight_max": float(torch.exp(log_max)),
            "is_clipped_frac": sum(p["cut"] for p in parts) / n,
            "is_ess": float(torch.exp(2 * log_sum - log_sum_sq - math.log(n)))}


def importance_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                       segments: torch.Tensor | None = None, mode: str = "none", level: str = "token",
                       cap: float = 2.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token weights `[R, T]` π_prox/π_behav of the trained tokens under `mode` and `level` (1 on
    untrained ones), and their statistics over these rows. `segments` tells the sequences of
    tree-packed rows apart (`TrainBatch.segments`; None: one sequence per row). Under `none` the
    weights are 1 and the statistics still describe the raw weights."""
    weights, parts = weights_and_sums(old_logprobs, rollout_logprobs, mask, segments, mode, level, cap)
    return weights, summarize([parts])


def apply_offpolicy_correction(batch: TrainBatch, mode: str, level: str, cap: float) -> dict[str, float]:
    """Multiply `batch.advantages` by the importance weights (its old log-probs filled in); return
    the statistics over every rank's rows. `none` leaves the batch untouched and returns {} (and
    runs no collective). Every rank must call it, as it gathers the ranks' statistics."""
    if mode == "none":
        return {}
    weights, parts = weights_and_sums(batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask, batch.segments,
                                      mode, level, cap)
    batch.advantages = batch.advantages * weights.to(batch.advantages)
    return summarize(all_gather_object(parts))
