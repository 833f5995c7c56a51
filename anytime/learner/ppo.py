"""The PPO update, written once for every learner: epochs over mini-batches, the loss normaliser,
the empty-mini-batch and non-finite skips, and the reduction of the update statistics.

Learners differ only in how one mini-batch becomes a gradient (`Learner.forward_backward`:
micro-batch accumulation, a DeepSpeed engine, a pipeline schedule) and how it is applied
(`Learner.optimizer_step`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import TYPE_CHECKING

from anytime.algo.loss import WEIGHTED_STATS, LossSpec
from anytime.batch.train_batch import MiniBatch, TrainBatch
from anytime.core.dist import any_across_ranks, rank_world, sum_across_ranks
from anytime.learner.base import Learner

if TYPE_CHECKING:
    from anytime.config import AlgorithmConfig, LearnerConfig

_COUNTS = ("skipped_updates", "empty_minibatches")


def loss_spec(algo: AlgorithmConfig, mini: MiniBatch, batch: TrainBatch, on_policy: bool = False) -> LossSpec:
    """The loss normaliser of one mini-batch, in one place. It is global: the same for every
    data-parallel replica, counted over the whole mini-batch, so each replica's loss is its share
    of the mini-batch loss and the learners *sum* the replicas' gradients.

    - `token-mean`: the trained tokens of the mini-batch's prompts, counted before zero-advantage
      rows were dropped (dropping them then changes nothing);
    - `constant` (Dr.GRPO): those prompts' traces × a width: `algorithm.loss_norm_length` when the
      recipe fixes it (the official code's max_response_length), else the batch's `max_len`;
    - `seq-mean-token-mean`: the sequences sampled for the mini-batch's prompts (every thinking
      trace and summary with a token), counted before zero-advantage rows were dropped, as GRPO's
      1/G, verl and TRL count them; so dropping changes no loss here either.
    """
    tokens = float(batch.tokens_per_prompt[mini.all_prompts].sum()) if mini.all_prompts else 0.0
    rows: float | None = None
    if algo.loss_agg == "constant":
        rows = float(max(len(mini.all_prompts) * batch.traces_per_prompt, 1))
    elif algo.loss_agg == "seq-mean-token-mean":
        rows = float(max(int(batch.sequences_per_prompt[mini.all_prompts].sum()) if mini.all_prompts else 0, 1))
    return LossSpec(algo.loss_agg, algo.clip_low, algo.clip_high, num_tokens=max(tokens, 1.0), num_rows=rows,
                    max_len=algo.loss_norm_length or batch.max_len, entropy_coef=algo.entropy_coef,
                    kl_coef=algo.kl_coef, kl_type=algo.kl_type, on_policy=on_policy)


def logprob_mismatch(batch: TrainBatch) -> float:
    """Mean |learner − rollout| log-prob over the trained tokens of every rank's rows (engine vs
    learner numerics, or a stale engine). Ranks holding the same rows (pipeline stages) weigh
    them equally, so the mean is unchanged."""
    mask = batch.loss_mask
    total = float((batch.old_logprobs - batch.rollout_logprobs).abs()[mask].sum())
    total, count = sum_across_ranks([total, float(mask.sum())])
    return total / max(count, 1.0)


def ppo_update(learner: Learner, batch: TrainBatch, algo: AlgorithmConfig, cfg: LearnerConfig) -> dict[str, float]:
    """PPO epochs over mini-batches of `cfg.mini_batch_prompts` prompts, one optimizer step each;
    `batch` is this rank's share with its old log-probs filled in.

    Statistics are per optimizer step, averaged over steps: `loss` is the step's loss (the sum of the
    replicas' shares, as the gradient is), `tokens` the trained tokens of the step over all
    replicas, and the WEIGHTED_STATS token-weighted means over them; so none of them depends on
    micro-batching, on the number of replicas or on the learner kind.
    """
    dp_rank = learner.dp_ranks[rank_world()[0]]
    stats: dict[str, list[float]] = defaultdict(list)
    for _ in range(cfg.ppo_epochs):
        for mini in batch.mini_batches(cfg.mini_batch_prompts, dp_rank, learner.dp_size):
            if not any_across_ranks(len(mini.batch) > 0):  # every advantage was zero: nothing to learn
                stats["empty_minibatches"].append(1.0)
                continue
            sums = learner.forward_backward(mini.batch, loss_spec(algo, mini, batch, cfg.old_logprobs == "update"))
            if any_across_ranks(not math.isfinite(sums["loss"])):
                learner.zero_grad()
                stats["skipped_updates"].append(1.0)
                continue
            result = learner.optimizer_step()
            stats["skipped_updates"].append(1.0 if result.skipped else 0.0)
            if result.skipped:
                continue
            keys = ("loss", "tokens", *WEIGHTED_STATS)
            values = sum_across_ranks([sums.get(k, 0.0) for k in keys] + [float("kl_ref" in sums)])
            total, has_kl = dict(zip(keys, values)), values[-1] > 0
            stats["loss"].append(total["loss"])
            stats["grad_norm"].append(result.grad_norm)
            stats["lr"].append(result.lr)
            if total["tokens"] > 0:
                stats["tokens"].append(total["tokens"])
                for k in WEIGHTED_STATS:
                    if k != "kl_ref" or has_kl:
                        stats[k].append(total[k] / total["tokens"])
    out = {k: (sum(v) if k in _COUNTS else sum(v) / len(v)) for k, v in stats.items() if v}
    out.setdefault("skipped_updates", 0.0)
    return out

