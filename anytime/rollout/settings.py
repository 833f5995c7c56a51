"""The rollout's settings (`AnytimeSettings`), built from a training recipe in one place
(`training_settings`); the held-out eval builds its own from the recipe's eval section through
`anytime.evaluation.options`, the same path as `anytime eval --recipe` (always with seeded requests).
The answer format is the settings' `format` (`anytime.config.answer_format`), held, not copied. Also the
sampling configs of a rollout's thinking and summaries (`sampling_configs`) and the engine's longest
request under a recipe (`engine_max_len`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from anytime.config.answer_format import AnswerFormat

if TYPE_CHECKING:
    from anytime.config import Recipe
    from anytime.rollout.engines.engine import SamplingConfig


@dataclass(frozen=True)
class AnytimeSettings:
    """Everything the rollout needs besides the engine; built from a recipe or the eval CLI."""

    budgets: tuple[int, ...]
    traces_per_prompt: int            # G
    summaries_per_budget: int         # A
    format: AnswerFormat = AnswerFormat()
    temperature: float = 1.0
    top_p: float = 1.0
    summary_temperature: float = 1.0
    seed: int = 0
    # one seed per request (placement-invariant samples); False: unseeded, the engine's own generator
    # (`rollout.seed_requests`)
    seed_requests: bool = True


def training_settings(recipe: Recipe) -> AnytimeSettings:
    """The training rollout of a recipe: its budget grid, G traces, A summaries per budget."""
    r, s = recipe, recipe.summary
    return AnytimeSettings(tuple(r.budget.grid()), r.rollout.n, s.n, AnswerFormat.from_recipe(r),
                           temperature=r.rollout.temperature, top_p=r.rollout.top_p,
                           summary_temperature=s.temperature, seed=r.trainer.seed,
                           seed_requests=r.rollout.seed_requests)


def sampling_configs(s: AnytimeSettings, budgets: Sequence[int], seed: int, prompt_index: Sequence[int],
                     think_stop: Sequence[int], eos_ids: Sequence[int]) -> tuple[SamplingConfig, SamplingConfig]:
    """The thinking and summary sampling of one rollout call. Seeded (`s.seed_requests`): one seed per
    thinking request from (seed, the prompt's global index), one per summary branch from (seed + 1, its
    global branch index), so a sample does not depend on the worker or batch that serves it. Unseeded:
    no seeds at all (the engine samples from its own generator)."""
    from anytime.rollout.engines.engine import SamplingConfig
    from anytime.rollout.seeding import request_seeds

    G, S = s.traces_per_prompt, len(budgets)
    think_seeds = summary_seeds = None
    if s.seed_requests:
        think_seeds = request_seeds(seed, prompt_index)
        summary_seeds = request_seeds(seed + 1, [(p * G + g) * S + j for p in prompt_index
                                                 for g in range(G) for j in range(S)])
    thinking = SamplingConfig(max_new_tokens=budgets[-1], n=G, temperature=s.temperature, top_p=s.top_p,
                              stop_token_ids=tuple(think_stop), request_seeds=think_seeds)
    summary = SamplingConfig(max_new_tokens=s.format.summary_max_tokens, n=s.summaries_per_budget,
                             temperature=s.summary_temperature, top_p=s.top_p, stop_token_ids=tuple(eos_ids),
                             request_seeds=summary_seeds)
    return thinking, summary


def engine_max_len(recipe: Recipe, tokenizer: Any) -> int:
    """The longest request the rollout makes: the longest prompt, a whole thinking budget and the room
    a summary needs after the cut (unless the recipe sets rollout.max_model_len)."""
    if recipe.rollout.max_model_len is not None:
        return recipe.rollout.max_model_len
    return (recipe.data.max_prompt_len + recipe.budget.max_thinking
            + AnswerFormat.from_recipe(recipe).room_after_cut(tokenizer))
