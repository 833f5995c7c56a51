"""DAPO's dynamic sampling (`rollout.dynamic_sampling`): a group whose rewards are all equal has no
advantage to learn from, so it is dropped and its place in the step is refilled from more prompts.

A step has `rollout.prompts_per_step` slots; the trainer gives each slot its candidate prompts (the
the next rows of the data, then `rollout.dynamic_sampling_max_draws - 1` spares). Draw r
rolls out candidate r of every slot still unfilled, in one engine call; a slot is filled by the
first of its candidates whose group is mixed. A slot with no mixed group after every draw trains
nothing this step (its share of the loss normaliser stays, as for a group whose rows were all
dropped), and the metrics say how often that happened.

Zero variance is judged on every summary reward of the group, across its traces, budgets and
summaries ([G, S, A]), not only on the rewards of the last budget as GRPO's outcome reward would:
BRPO's thinking advantages compare a trace's reward at each budget with the budget-relative
baseline, and the summary advantages compare the summaries of one cut, so a group can carry a
signal while its final-budget rewards all agree. A group whose [G, S, A] rewards are all equal has
zero advantage under every estimator here and is the one dropped.

Seeds: draw r of a slot at step index i is seeded as prompt index r·num_prompts + i, so draw 0 is
seeded as a run without dynamic sampling seeds the same slot (its rows differ after step 0).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from anytime.batch.anytime_rollout import AnytimeRollout
from anytime.batch.step_sums import StepSums


def mixed_groups(scores: torch.Tensor) -> torch.Tensor:
    """[B] bool: the groups of `scores` [B, G, S, A] whose rewards are not all equal."""
    flat = scores.flatten(1)
    return (flat != flat[:, :1]).any(dim=1)


@dataclass
class Draws:
    """What the draws of one worker's slots gave: each draw's rollout of the groups it drew, which
    of them were kept (positions in that rollout) and the step positions of the slots they fill."""

    drawn: list[AnytimeRollout] = field(default_factory=list)
    kept: list[list[int]] = field(default_factory=list)
    kept_slots: list[list[int]] = field(default_factory=list)
    slots: int = 0

    def counts(self) -> StepSums:
        """Metric sums that add up over workers (`StepSums.metrics` names the metrics: the share of groups
        dropped for one reward, prompts drawn per one kept, slots that train nothing)."""
        return StepSums(dynamic_slots=float(self.slots), dynamic_drawn=float(sum(len(r.golds) for r in self.drawn)),
                        dynamic_kept=float(sum(len(k) for k in self.kept)))


def draw_mixed_groups(run: Callable[[list[Any], list[Any], list[int]], AnytimeRollout],
                      candidates: Sequence[Sequence[Any]], golds: Sequence[Sequence[Any]], index: Sequence[int],
                      num_prompts: int, max_draws: int) -> Draws:
    """Fill the slots: `candidates[s]` and `golds[s]` are slot s's prompts and their gold answers in
    draw order, `index[s]` its position in the step of `num_prompts` slots; `run(prompts, golds,
    seed_index)` rolls out a list of prompts under the given seed indices."""
    if len(candidates) != len(golds) or len(candidates) != len(index):
        raise ValueError(f"{len(candidates)} slots of candidates, {len(golds)} of golds, {len(index)} indices")
    draws, pending = Draws(slots=len(candidates)), list(range(len(candidates)))
    for r in range(max_draws):
        chosen = [s for s in pending if r < len(candidates[s])]
        if not chosen:
            break
        rollout = run([candidates[s][r] for s in chosen], [golds[s][r] for s in chosen],
                      [r * num_prompts + index[s] for s in chosen])
        keep = [b for b, ok in enumerate(mixed_groups(rollout.scores).tolist()) if ok]
        draws.drawn.append(rollout)
        draws.kept.append(keep)
        draws.kept_slots.append([index[chosen[b]] for b in keep])
        filled = {chosen[b] for b in keep}
        pending = [s for s in pending if s not in filled]
    return draws
