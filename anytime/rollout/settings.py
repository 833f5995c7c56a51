"""The rollout's settings (`AnytimeSettings`), built from a training recipe in one place
(`training_settings`); the held-out eval builds its own from the recipe's eval section through
`anytime.evaluation.options`, the same path as `anytime eval --recipe`. Also the engine's longest
request under a recipe (`engine_max_len`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from anytime import defaults

if TYPE_CHECKING:
    from anytime.config import Recipe


@dataclass(frozen=True)
class AnytimeSettings:
    """Everything the rollout needs besides the engine; built from a recipe or the eval CLI."""

    budgets: tuple[int, ...]
    traces_per_prompt: int            # G
    summaries_per_budget: int         # A
    summary_max_tokens: int = defaults.SUMMARY_MAX_TOKENS
    close_text: str = defaults.CLOSE_TEXT
    header: str = defaults.HEADER
    think_end: str = defaults.THINK_END
    temperature: float = 1.0
    top_p: float = 1.0
    summary_temperature: float = 1.0
    seed: int = 0
    eos_ends_thinking: bool = False   # instruct models: EOS closes the thinking (see the runner)


def training_settings(recipe: Recipe) -> AnytimeSettings:
    """The training rollout of a recipe: its budget grid, G traces, A summaries per budget."""
    r, s = recipe, recipe.summary
    return AnytimeSettings(tuple(r.budget.grid()), r.rollout.n, s.n, summary_max_tokens=s.max_tokens,
                           close_text=s.close_text, header=s.header, think_end=s.think_end,
                           temperature=r.rollout.temperature, top_p=r.rollout.top_p,
                           summary_temperature=s.temperature, seed=r.trainer.seed,
                           eos_ends_thinking=s.eos_ends_thinking)


def text_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else 0


def engine_max_len(recipe: Recipe, tokenizer: Any) -> int:
    """The longest request the rollout makes: the longest prompt, a whole thinking budget, the
    inserted close and header, and a summary (unless the recipe sets rollout.max_model_len)."""
    if recipe.rollout.max_model_len is not None:
        return recipe.rollout.max_model_len
    s = recipe.summary
    inserted = text_tokens(tokenizer, s.close_text) + text_tokens(tokenizer, s.header)
    return recipe.data.max_prompt_len + recipe.budget.max_thinking + inserted + s.max_tokens
