"""The policy update: learner log-probs of the rollout (`logprob` stage) and PPO mini-batch epochs
over micro-batches packed by a token budget (`update` stage)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from anytime.algo.logprobs import token_entropy, token_logprobs
from anytime.algo.loss import policy_loss
from anytime.config import AlgorithmConfig, LearnerConfig
from anytime.learner.batch import TrainBatch, TrainRow, collate, mini_batches, pack_micro_batches, padding_row


def rank_world() -> tuple[int, int]:
    """(rank, world size) of the learner group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _max_across_ranks(value: int) -> int:
    if rank_world()[1] == 1:
        return value
    t = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _any_across_ranks(flag: bool) -> bool:
    return _max_across_ranks(int(flag)) > 0


def forward_logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor], with_entropy: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    logits = out.logits[:, :-1]
    lp = token_logprobs(logits, batch["labels"])
    return lp, (token_entropy(logits) if with_entropy else None)


@torch.no_grad()
def fill_logprobs(model: torch.nn.Module, rows: Sequence[TrainRow], token_budget: int, pad_id: int,
                  attr: str = "old_logprobs") -> None:
    """Compute the model's log-prob of every next token of each row and store it on the row."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    for micro in pack_micro_batches(rows, token_budget):
        batch = collate(micro, pad_id, device)
        lp, _ = forward_logprobs(model, batch)
        for i, row in enumerate(micro):
            setattr(row, attr, lp[i, : len(row) - 1].float().cpu().tolist())
    model.train(was_training)


def logprob_mismatch(rows: Sequence[TrainRow], across_ranks: bool = False) -> float:
    """Mean |learner − rollout| log-prob over trained tokens (engine/learner numerics drift), over
    the rows of every data-parallel rank when `across_ranks`."""
    total, count = 0.0, 0
    for r in rows:
        if r.old_logprobs is None:
            continue
        for m, old, roll in zip(r.loss_mask[1:], r.old_logprobs, r.rollout_logprobs[1:]):
            if m:
                total += abs(old - roll)
                count += 1
    if across_ranks:
        total, count = _sum_across_ranks([total, float(count)])
    return total / max(count, 1)


_WEIGHTED_STATS = ("clip_frac", "approx_kl", "ratio_mean", "entropy", "kl_ref")


def _sum_across_ranks(values: list[float]) -> list[float]:
    if rank_world()[1] == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def ppo_update(backend: Any, batch: TrainBatch, algo: AlgorithmConfig, cfg: LearnerConfig, pad_id: int,
               ref_model: torch.nn.Module | None = None) -> dict[str, float]:
    """PPO epochs over mini-batches of `cfg.mini_batch_prompts` prompts; one optimizer step each.

    With several data-parallel ranks every rank holds the rows of its own prompts; ranks pad with
    empty micro-batches so they run the same number of backward passes (ZeRO reduces inside them).
    A pipelined backend (`learner.pipeline.stages > 1`) runs the mini-batches itself, every rank
    on all rows.

    Statistics are per optimizer step and then averaged over steps: `loss` is the step's loss (the
    mean over data-parallel ranks of each rank's normalised loss, as the averaged gradients are),
    `tokens` the trained tokens of the step over all ranks, and clip_frac / approx_kl / ratio_mean /
    entropy / kl_ref token-weighted means over them; so they do not depend on micro-batching.
    """
    if getattr(backend, "pipelined", False):
        if ref_model is not None and algo.kl_coef != 0.0:
            raise ValueError("the pipelined learner has no reference-model KL term; set algorithm.kl_coef: 0")
        return backend.ppo_update(batch, algo, cfg, pad_id)
    model = backend.model
    device = next(model.parameters()).device
    rank, world = rank_world()
    stats: dict[str, list[float]] = defaultdict(list)
    dummy = padding_row(pad_id)
    model.train()
    for _ in range(cfg.ppo_epochs):
        for rows, num_tokens, num_traces in mini_batches(batch, cfg.mini_batch_prompts, rank, world):
            micro = pack_micro_batches(rows, cfg.micro_batch_tokens)
            most = _max_across_ranks(len(micro))
            if most == 0:  # every advantage in this mini-batch is zero: nothing to learn, no step
                stats["empty_minibatches"].append(1.0)
                continue
            micro += [[dummy]] * (most - len(micro))
            bad = False
            step_loss, step_tokens = 0.0, 0.0
            weighted = dict.fromkeys(_WEIGHTED_STATS, 0.0)
            for index, mb in enumerate(micro):
                tensors = collate(mb, pad_id, device)
                lp, ent = forward_logprobs(model, tensors, with_entropy=True)
                ref_lp = None
                if ref_model is not None and algo.kl_coef != 0.0:
                    with torch.no_grad():
                        ref_lp, _ = forward_logprobs(ref_model, tensors)
                mask = tensors["loss_mask"]
                loss, st = policy_loss(
                    lp, tensors["old_logprobs"].to(lp.dtype), tensors["advantages"].to(lp.dtype), mask,
                    clip_low=algo.clip_low, clip_high=algo.clip_high, agg=algo.loss_agg,
                    num_tokens=max(num_tokens, 1), num_rows=max(num_traces, 1) if algo.loss_agg == "constant" else None,
                    max_len=batch.max_len, ref_logprobs=ref_lp, kl_coef=algo.kl_coef, kl_type=algo.kl_type,
                    entropy=ent, entropy_coef=algo.entropy_coef)
                if algo.loss_agg == "seq-mean-token-mean":
                    # per-row means summed over this micro-batch, averaged over the mini-batch's rows
                    loss = loss * (mask.sum(-1) > 0).sum() / max(len(rows), 1)
                if _any_across_ranks(not bool(torch.isfinite(loss))):
                    bad = True
                    break
                backend.backward(loss, last=index == len(micro) - 1)
                step_loss += float(loss.detach())
                step_tokens += st["tokens"]
                for k in _WEIGHTED_STATS:
                    weighted[k] += st.get(k, 0.0) * st["tokens"]
            if bad:
                backend.zero_grad()
                stats["skipped_updates"].append(1.0)
                continue
            result = backend.step()
            stats["skipped_updates"].append(1.0 if result.skipped else 0.0)
            if result.skipped:
                continue
            sums = _sum_across_ranks([step_loss, step_tokens, *weighted.values()])
            stats["loss"].append(sums[0] / world)
            stats["grad_norm"].append(result.grad_norm)
            stats["lr"].append(result.lr)
            if sums[1] > 0:
                stats["tokens"].append(sums[1])
                for k, v in zip(_WEIGHTED_STATS, sums[2:]):
                    if k != "kl_ref" or ref_lp is not None:
                        stats[k].append(v / sums[1])
    out = {k: (sum(v) if k in ("skipped_updates", "empty_minibatches") else sum(v) / len(v))
           for k, v in stats.items() if v}
    out.setdefault("skipped_updates", 0.0)
    return out
