"""Thinking-budget grids and priors (paper §2.1), and the anytime score of per-budget accuracies.

A *grid* is a strictly increasing list of token budgets b_1 < ... < b_m; a *prior* p_B puts mass
P_j on each b_j. Training cuts every trace at every budget of the grid and weights the budget
rewards by the prior (as the paper's code does).
"""

from __future__ import annotations

from collections.abc import Sequence

from anytime.registry import FunctionRegistry


def even_grid(max_thinking: int, num_budgets: int) -> list[int]:
    """`num_budgets` evenly spaced budgets ending at `max_thinking` (the paper: b_j = j·L/m)."""
    if num_budgets <= 0:
        raise ValueError(f"num_budgets must be positive, got {num_budgets}")
    if max_thinking < num_budgets:
        raise ValueError(f"max_thinking ({max_thinking}) must be at least num_budgets ({num_budgets})")
    return [round(j * max_thinking / num_budgets) for j in range(1, num_budgets + 1)]


def every_grid(step: int, up_to: int, start: int | None = None) -> list[int]:
    """Budgets every `step` tokens from `start` (default `step`) up to and including `up_to`."""
    if step <= 0:
        raise ValueError(f"budget step must be positive, got {step}")
    first = step if start is None else start
    if first <= 0 or first > up_to:
        raise ValueError(f"budget range {first}:{up_to}:{step} is empty; use start <= up_to and start > 0")
    return list(range(first, up_to + 1, step))


def parse_grid(spec: str | Sequence[int]) -> list[int]:
    """A grid from a list, `"250:8000:250"` (start:stop:step, inclusive) or `"2000,4000,8000"`."""
    if isinstance(spec, str):
        text = spec.strip()
        if ":" in text:
            parts = text.split(":")
            if len(parts) != 3:
                raise ValueError(f"budget range {spec!r} must be START:STOP:STEP, e.g. 250:8000:250")
            start, stop, step = (int(p) for p in parts)
            return every_grid(step, stop, start)
        spec = [int(p) for p in text.split(",") if p.strip()]
    grid = [int(b) for b in spec]
    validate_grid(grid)
    return grid


def validate_grid(grid: Sequence[int], max_thinking: int | None = None, name: str = "budgets",
                  limit_name: str = "max_thinking") -> None:
    """The one check of a budget grid (recipes, the rollout, the eval CLI): non-empty, positive,
    strictly increasing, and not past the thinking limit; messages name `name` and `limit_name`."""
    if len(grid) == 0:
        raise ValueError(f"{name} is empty; give at least one budget")
    if any(b <= 0 for b in grid):
        raise ValueError(f"{name} must be positive token counts, got {list(grid)}")
    if any(b >= c for b, c in zip(grid, grid[1:])):
        raise ValueError(f"{name} must be strictly increasing, got {list(grid)}")
    if max_thinking is not None and grid[-1] > max_thinking:
        raise ValueError(f"{name} ends at {grid[-1]}, above {limit_name} = {max_thinking}")


def prior_probs(prior: str, grid: Sequence[int], probs: Sequence[float] | None = None) -> list[float]:
    """The prior P over the grid, by its name in `BUDGET_PRIORS`: `base` (all mass on
    the last budget), `uniform`, `linear` (P_j ∝ b_j, {.1,.2,.3,.4} for four even budgets) or
    `explicit` (given `probs`)."""
    return BUDGET_PRIORS.get(prior)(list(grid), probs)


def base_prior(grid: list[int], probs: Sequence[float] | None = None) -> list[float]:
    return [0.0] * (len(grid) - 1) + [1.0]


def uniform_prior(grid: list[int], probs: Sequence[float] | None = None) -> list[float]:
    return [1.0 / len(grid)] * len(grid)


def linear_prior(grid: list[int], probs: Sequence[float] | None = None) -> list[float]:
    total = float(sum(grid))
    return [b / total for b in grid]


def explicit_prior(grid: list[int], probs: Sequence[float] | None = None) -> list[float]:
    if probs is None or len(probs) != len(grid):
        raise ValueError(f"an explicit prior needs {len(grid)} probabilities (one per budget), got {probs}")
    validate_probs(probs)
    return [float(p) for p in probs]


# The priors by name. Declared here, beside them, and read from here by the recipe schema: this
# module imports nothing heavy, so the names need no declaration of their own in `anytime.algo`.
BUDGET_PRIORS = FunctionRegistry("budget.prior", {
    "base": base_prior,
    "uniform": uniform_prior,
    "linear": linear_prior,
    "explicit": explicit_prior,
}, doc="the prior P over the budget grid")


def validate_probs(probs: Sequence[float]) -> None:
    if any(p < 0 for p in probs):
        raise ValueError(f"prior probabilities must be non-negative, got {list(probs)}")
    if abs(sum(probs) - 1.0) > 1e-6:
        raise ValueError(f"prior probabilities must sum to 1, got sum {sum(probs):.6g}")


def anytime_score(accuracies: Sequence[float], probs: Sequence[float] | None = None) -> float:
    """Prior-weighted mean of per-budget accuracies (plain mean when `probs` is None), eq. 3."""
    if not accuracies:
        raise ValueError("anytime_score needs at least one accuracy")
    if probs is None:
        return float(sum(accuracies) / len(accuracies))
    if len(probs) != len(accuracies):
        raise ValueError(f"{len(accuracies)} accuracies but {len(probs)} prior probabilities")
    return float(sum(p * a for p, a in zip(probs, accuracies)))


def area_under_curve(budgets: Sequence[int], accuracies: Sequence[float]) -> float:
    """Normalised area under the step curve accuracy(b): accuracy at b_j holds on (b_{j-1}, b_j],
    b_0 = 0; divided by b_m so a model perfect at every budget scores 1. This equals the anytime
    score under a uniform prior over *every* token budget."""
    if len(budgets) != len(accuracies) or not budgets:
        raise ValueError("area_under_curve needs one accuracy per budget")
    area, previous = 0.0, 0
    for b, acc in zip(budgets, accuracies):
        area += acc * (b - previous)
        previous = b
    return area / budgets[-1]
