"""Token-level PPO-clip policy loss with clip-higher, loss aggregation modes and optional KL.

Aggregations (the functions in `LOSS_AGGREGATIONS` below, keyed by the recipe's `algorithm.loss_agg`):
- `token-mean`: Σ loss·mask / Σ mask (DAPO);
- `seq-mean-token-mean`: mean over sequences of each sequence's token mean (original GRPO); a
  sequence is a row, or with `segments` (tree-packed rows) a (row, segment id) pair;
- `constant`: Σ loss·mask / (rows × max_len), the Dr.GRPO / AnytimeReasoner normaliser
  (verl's `just_mean` rescaled by mini-batch size), so long traces are not down-weighted.
When a mini-batch is split into micro-batches, pass the mini-batch totals (`num_tokens`,
`num_rows`) so the summed micro-batch gradients equal the mini-batch gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from anytime.algo import KL_ESTIMATOR_NAMES, LOSS_AGGREGATION_NAMES
from anytime.batch.train_batch import TrainBatch


def token_mean(x: torch.Tensor, mask: torch.Tensor, num_tokens: float | None, num_rows: float | None,
                max_len: int | None, segments: torch.Tensor | None) -> torch.Tensor:
    denom = mask.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=x.dtype)
    return (x * mask).sum() / denom.clamp_min(1)


def seq_mean_token_mean(x: torch.Tensor, mask: torch.Tensor, num_tokens: float | None, num_rows: float | None,
                         max_len: int | None, segments: torch.Tensor | None) -> torch.Tensor:
    if segments is None:
        sums, counts = (x * mask).sum(-1), mask.sum(-1)
    else:  # one bucket per (row, segment id): the sequences a packed row holds
        width = int(segments.max()) + 1 if segments.numel() else 1
        key = (segments.long() + width * torch.arange(x.shape[0], device=x.device)[:, None]).flatten()
        sums = x.new_zeros(x.shape[0] * width).index_add(0, key, (x * mask).flatten())
        counts = mask.new_zeros(x.shape[0] * width).index_add(0, key, mask.flatten())
    per_seq = sums / counts.clamp_min(1)
    seqs = (counts > 0).sum() if num_rows is None else torch.as_tensor(num_rows, dtype=x.dtype)
    return per_seq.sum() / seqs.clamp_min(1)


def constant_norm(x: torch.Tensor, mask: torch.Tensor, num_tokens: float | None, num_rows: float | None,
              max_len: int | None, segments: torch.Tensor | None) -> torch.Tensor:
    rows = x.shape[0] if num_rows is None else num_rows
    length = x.shape[-1] if max_len is None else max_len
    return (x * mask).sum() / (rows * length)


LOSS_AGGREGATIONS = LOSS_AGGREGATION_NAMES.implemented_by({
    "token-mean": token_mean,
    "seq-mean-token-mean": seq_mean_token_mean,
    "constant": constant_norm,
})


def aggregate(x: torch.Tensor, mask: torch.Tensor, agg: str, *, num_tokens: float | None = None,
              num_rows: float | None = None, max_len: int | None = None,
              segments: torch.Tensor | None = None) -> torch.Tensor:
    return LOSS_AGGREGATIONS.get(agg)(x, mask.to(x.dtype), num_tokens, num_rows, max_len, segments)


def kl_k1(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio


def kl_k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """e^{−k1} + k1 − 1: unbiased and non-negative."""
    return torch.exp(-log_ratio) + log_ratio - 1.0


KL_ESTIMATORS = KL_ESTIMATOR_NAMES.implemented_by({"k1": kl_k1, "k3": kl_k3})


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token KL(π‖π_ref) estimate of the kind registered in `KL_ESTIMATORS`
    (k1 = log π − log π_ref; k3 = e^{−k1} + k1 − 1)."""
    return KL_ESTIMATORS.get(kind)(logprobs - ref_logprobs)


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                clip_low: float = 0.2, clip_high: float = 0.2, agg: str = "token-mean",
                num_tokens: float | None = None, num_rows: float | None = None, max_len: int | None = None,
                ref_logprobs: torch.Tensor | None = None, kl_coef: float = 0.0, kl_type: str = "k3",
                entropy: torch.Tensor | None = None, entropy_coef: float = 0.0,
                segments: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip loss over tokens `[rows, T]`; ratio clipped to [1 − clip_low, 1 + clip_high].
    `segments [rows, T]` tells the sequences of tree-packed rows apart (seq-mean-token-mean).

    Returns the scalar loss and statistics (clip fraction, approx-KL to the old policy, KL to the
    reference and entropy when given), each a token mean over `mask`.
    """
    mask = mask.to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    norm = {"num_tokens": num_tokens, "num_rows": num_rows, "max_len": max_len, "segments": segments}
    loss = aggregate(per_token, mask, agg, **norm)
    count = mask.sum().clamp_min(1)
    with torch.no_grad():
        stats = {
            "clip_frac": float(((clipped > unclipped).to(mask.dtype) * mask).sum() / count),
            "approx_kl": float((0.5 * log_ratio.pow(2) * mask).sum() / count),
            "ratio_mean": float((ratio * mask).sum() / count),
            "tokens": float(mask.sum()),
        }
    if ref_logprobs is not None and kl_coef != 0.0:
        kl = kl_penalty(logprobs, ref_logprobs, kl_type)
        loss = loss + kl_coef * aggregate(kl, mask, agg, **norm)
        stats["kl_ref"] = float((kl.detach() * mask).sum() / count)
    if entropy is not None:
        if entropy_coef != 0.0:
            loss = loss - entropy_coef * aggregate(entropy, mask, agg, **norm)
        stats["entropy"] = float((entropy.detach() * mask).sum() / count)
    return loss, stats


# --- one mini-batch's loss, as every learner computes it -----------------------------------------

# Statistics averaged over trained tokens (each reported by learners as a sum weighted by tokens).
WEIGHTED_STATS = ("clip_frac", "approx_kl", "ratio_mean", "entropy", "kl_ref")


@dataclass(frozen=True)
class LossSpec:
    """How a mini-batch's tokens become one scalar loss: the PPO-clip settings and the loss
    normaliser of this mini-batch (see `anytime.learner.ppo.loss_spec`)."""

    agg: str = "token-mean"
    clip_low: float = 0.2
    clip_high: float = 0.2
    num_tokens: float | None = None      # None: the tokens of the rows at hand
    num_rows: float | None = None        # None: the rows (sequences, for seq-mean) at hand
    max_len: int | None = None           # None: the rows' width
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    kl_type: str = "k3"
    # old log-probs = these log-probs, detached (`learner.old_logprobs: update`): ratio 1, the
    # clipped objective's gradient is the plain policy gradient, as TRL does with one iteration
    on_policy: bool = False

    def policy_loss_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `policy_loss`."""
        return {"agg": self.agg, "clip_low": self.clip_low, "clip_high": self.clip_high,
                "num_tokens": self.num_tokens, "num_rows": self.num_rows, "max_len": self.max_len,
                "entropy_coef": self.entropy_coef, "kl_coef": self.kl_coef, "kl_type": self.kl_type}


def token_loss(logprobs: torch.Tensor, entropy: torch.Tensor | None, batch: TrainBatch, spec: LossSpec,
               ref_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of some rows of a mini-batch (its share of the mini-batch loss: summing it over the
    mini-batch's micro-batches gives the mini-batch loss) and its statistics as token-weighted sums.
    `logprobs`, `entropy`, `ref_logprobs` are target-aligned like the batch's per-token tensors."""
    old = logprobs.detach() if spec.on_policy else batch.old_logprobs
    return masked_token_loss(logprobs, old, batch.advantages, batch.loss_mask, spec, entropy=entropy,
                             ref_logprobs=ref_logprobs, segments=batch.segments)


def masked_token_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                      mask: torch.Tensor, spec: LossSpec, *, entropy: torch.Tensor | None = None,
                      ref_logprobs: torch.Tensor | None = None, segments: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, dict[str, float]]:
    """`token_loss` on plain tensors (the pipelined model's microbatches): the loss and its
    statistics as sums (`loss`, `tokens`, and each of WEIGHTED_STATS times tokens), so the sums of
    several micro-batches add up."""
    loss, st = policy_loss(logprobs, old_logprobs.to(logprobs.dtype), advantages.to(logprobs.dtype), mask,
                           ref_logprobs=ref_logprobs, entropy=entropy, segments=segments, **spec.policy_loss_kwargs())
    sums = {"loss": float(loss.detach()), "tokens": st["tokens"]}
    sums.update({k: st[k] * st["tokens"] for k in WEIGHTED_STATS if k in st})
    return loss, sums
