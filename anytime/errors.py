"""Errors that name what to change: raised anywhere, printed by the CLI without a traceback."""

from __future__ import annotations


class RecipeError(ValueError):
    """A recipe that cannot run; the message names the key and the fix."""
