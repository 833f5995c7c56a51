"""The experience stage of a step: from the scored rollouts a learner rank holds to the rows it trains,
with everything that touches advantages in one place.

1. **Advantages per group** (`group_advantages`): the thinking advantages [B, G, S], one per budget
   segment of each trace, by `algorithm.estimator` (BRPO's budget-relative baseline, GRPO's, RLOO's,
   ...), and the summary advantages [B, G, S, A] among the summaries of one cut, by `summary.estimator`.
2. **Spread over tokens** (`token_advantages`): each thinking token takes its segment's advantage
   (token t is in the first segment whose budget is ≥ t), scaled by the thinking and summary loss
   weights; and the `constant` loss normaliser's width (`loss_width`).
3. **Rows** (`anytime.batch.packing.build_train_batch`): the kept groups of every draw as token rows,
   under their positions in the step.
4. **This rank's rows** (`anytime.trainer.rows.RowExchange`): each learner rank gets the rows of its
   data-parallel rank, every rank the workers' sums and timings.

After the learner's old log-probs (the trainer's `logprob` stage), `importance_correction` weights the
advantages by π_prox / π_behav (`anytime.algo.offpolicy`), under the `adv` timer too. The trainer's step
calls `experience` and `importance_correction`; tests call them directly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from anytime.algo.advantages import summary_advantages_by_name, thinking_advantages
from anytime.algo.offpolicy import apply_offpolicy_correction
from anytime.batch.anytime_rollout import AnytimeRollout, ScoredRollout
from anytime.batch.packing import build_train_batch
from anytime.batch.step_sums import StepSums
from anytime.batch.train_batch import TrainBatch

if TYPE_CHECKING:
    from anytime.config import Recipe
    from anytime.trainer.metrics import StageTimer

# (rows this rank built or None, its per-worker sums, timings) -> (this rank's rows, every worker's sums, timings)
Exchange = Callable[[TrainBatch | None, list[StepSums], list[dict[str, float]]],
                    tuple[TrainBatch, list[StepSums], list[dict[str, float]]]]


def group_advantages(rollout: AnytimeRollout, recipe: Recipe) -> tuple[torch.Tensor, torch.Tensor]:
    """A rollout's two advantages, per group, each by the recipe's estimator (`anytime.algo.advantages`):
    thinking [B, G, S] (`algorithm.estimator`) and summary [B, G, S, A] (`summary.estimator`)."""
    a = recipe.algorithm
    thinking = thinking_advantages(a.estimator, rollout.budget_scores.double(), recipe.budget.prior_probs(),
                                   decay=a.decay, variant=a.variance_reduction)
    summary = summary_advantages_by_name(recipe.summary.estimator, rollout.scores.double(), rollout.prefix_group)
    return thinking, summary


def segment_index(length: int, budgets: Sequence[int]) -> torch.Tensor:
    """Budget segment of each thinking token: token t (1-based) is in segment j = min{j: b_j ≥ t}
    (tokens past the last budget stay in the last segment)."""
    positions = torch.arange(1, length + 1)
    return torch.searchsorted(torch.tensor(budgets), positions).clamp_max(len(budgets) - 1)


def token_advantages(rollout: AnytimeRollout, thinking: torch.Tensor, summary: torch.Tensor, *,
                     thinking_weight: float = 1.0, summary_weight: float = 1.0
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each thinking token's advantage [B, G, L] (its segment's, times `algorithm.thinking_loss_weight`; 0
    past the trace) and each summary's [B, G, S, A] (times `summary.loss_weight`; every token of a summary
    takes its summary's), in float64."""
    B, G, S, A = rollout.scores.shape
    if tuple(thinking.shape) != (B, G, S):
        raise ValueError(f"thinking advantages must be [B, G, S] = {(B, G, S)}, got {tuple(thinking.shape)}")
    if tuple(summary.shape) != (B, G, S, A):
        raise ValueError(f"summary advantages must be [B, G, S, A] = {(B, G, S, A)}, got {tuple(summary.shape)}")
    tokens = torch.zeros((B, G, rollout.think_ids.shape[-1]), dtype=torch.float64)
    for b in range(B):
        for g in range(G):
            n = int(rollout.think_len[b, g])
            tokens[b, g, :n] = thinking_weight * thinking[b, g].double()[segment_index(n, rollout.budgets)]
    return tokens, summary_weight * summary.double()


def loss_width(rollout: AnytimeRollout, summary_max_tokens: int) -> int:
    """The `constant` loss normaliser's width when the recipe fixes none (`algorithm.loss_norm_length`):
    the largest budget plus S·A times the inserted tokens and the summary limit (the official code's
    max_response_length, 10176 = 8000 + 16 × 136 for its 8k runs)."""
    from anytime.config.answer_format import summary_room

    B, G, S, A = rollout.scores.shape
    inserted = len(rollout.header_ids) + (len(rollout.close_ids) if bool(rollout.forced_close.any()) else 0)
    return rollout.budgets[-1] + S * A * summary_room(inserted, summary_max_tokens)


@dataclass
class DrawAdvantages:
    """One draw's advantages: per group (every group drawn, for the statistics) and spread over the
    tokens of the groups kept (what the rows carry)."""

    thinking: torch.Tensor         # [B, G, S] per budget segment
    summary: torch.Tensor          # [B, G, S, A] per summary
    kept_tokens: torch.Tensor      # [kept, G, L] per thinking token, loss-weighted
    kept_summaries: torch.Tensor   # [kept, G, S, A] per summary, loss-weighted

    def sums(self) -> StepSums:
        """Over every group drawn, kept or not."""
        return StepSums(thinking_adv=float(self.thinking.sum()), thinking_adv_abs=float(self.thinking.abs().sum()),
                        thinking_adv_n=float(self.thinking.numel()), summary_adv_abs=float(self.summary.abs().sum()),
                        summary_adv_n=float(self.summary.numel()))


def draw_advantages(rollout: AnytimeRollout, kept: Sequence[int], recipe: Recipe) -> DrawAdvantages:
    thinking, summary = group_advantages(rollout, recipe)
    chosen = kept_groups(rollout, kept)
    tokens, summaries = token_advantages(chosen, thinking[list(kept)], summary[list(kept)],
                                         thinking_weight=recipe.algorithm.thinking_loss_weight,
                                         summary_weight=recipe.summary.loss_weight)
    return DrawAdvantages(thinking, summary, tokens, summaries)


def kept_groups(rollout: AnytimeRollout, kept: Sequence[int]) -> AnytimeRollout:
    """The rollout of the groups dynamic sampling kept (all of them without it)."""
    return rollout if list(kept) == list(range(len(rollout.golds))) else rollout.select_prompts(kept)


def rows_of(share: ScoredRollout, advantages: Sequence[DrawAdvantages], recipe: Recipe, pad_id: int
            ) -> tuple[TrainBatch | None, StepSums]:
    """A worker's share of the step as training rows of its kept groups, under their positions in the
    step, and its sums with those of its advantages and rows."""
    r, batches, sums = recipe, [], share.sums
    for draw, adv in zip(share.draws, advantages):
        sums = sums + adv.sums()
        chosen = kept_groups(draw.rollout, draw.kept)
        batch = build_train_batch(chosen, adv.kept_tokens, adv.kept_summaries,
                                  max_len=loss_width(chosen, r.summary.max_tokens), pad_id=pad_id,
                                  pack=r.learner.pack_summaries,
                                  drop_zero_rows=r.algorithm.kl_coef == 0 and r.algorithm.entropy_coef == 0)
        batches.append(batch.reindexed(draw.slots, share.num_prompts))
    rows = joined(batches)
    sums.rows = float(rows.sequences.sum()) if rows is not None else 0.0   # sequences (a thinking trace or a summary)
    return rows, sums


def joined(batches: list[TrainBatch]) -> TrainBatch | None:
    """The rows of disjoint prompts of one step as one batch, ordered by prompt (None for none)."""
    return None if not batches else batches[0] if len(batches) == 1 else TrainBatch.concat(batches)


def keep_here(rows: TrainBatch | None, sums: list[StepSums], timings: list[dict[str, float]]
              ) -> tuple[TrainBatch, list[StepSums], list[dict[str, float]]]:
    """The exchange of a learner of one process: its rows are all the rows."""
    if rows is None:
        raise ValueError("no worker returned rows for this step")
    return rows, sums, timings


@dataclass
class Experience:
    """What a learner rank trains on in one step, and what the step measured of it."""

    batch: TrainBatch                         # this rank's rows: per-token advantages, rollout log-probs
    sums: StepSums                            # every worker's sums, added up
    per_worker: list[StepSums] = field(default_factory=list)
    timings: list[dict[str, float]] = field(default_factory=list)   # every worker's stage timings


def experience(shares: Sequence[ScoredRollout], recipe: Recipe, pad_id: int, exchange: Exchange = keep_here,
               timer: StageTimer | None = None) -> Experience:
    """This rank's rows of a step from the scored rollouts it holds (every worker's on learner rank 0
    where workers are apart, its own colocated worker's, none elsewhere): advantages and their spread over
    tokens (`adv`), rows (`pack`), each rank its own (`scatter`). Collective where `exchange` is."""
    from anytime.trainer.metrics import StageTimer

    timer = timer or StageTimer()
    with timer.stage("adv"):
        advantages = [[draw_advantages(d.rollout, d.kept, recipe) for d in share.draws] for share in shares]
    with timer.stage("pack"):
        built = [rows_of(share, adv, recipe, pad_id) for share, adv in zip(shares, advantages)]
    with timer.stage("scatter"):
        batch, per_worker, timings = exchange(joined([rows for rows, _ in built if rows is not None]),
                                              [sums for _, sums in built], [share.timings for share in shares])
    return Experience(batch, StepSums.total(per_worker), per_worker, timings)


def importance_correction(batch: TrainBatch, recipe: Recipe) -> dict[str, float]:
    """The engine's (behaviour) against the learner's (proximal) policy, once the batch holds its old
    log-probs: the advantages weighted by π_prox / π_behav, truncated or masked (`algorithm.offpolicy_correction`),
    and the weights' statistics (`offpolicy/`). Collective (every rank gathers the statistics)."""
    a = recipe.algorithm
    return {f"offpolicy/{k}": v for k, v in
            apply_offpolicy_correction(batch, a.offpolicy_correction, a.is_level, a.is_cap).items()}
