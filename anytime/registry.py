"""One registry style for everything pluggable: estimators, losses, priors, dtypes, engines,
placements, learners, LR schedules and pipeline schedules.

Registries are `name -> "module:attribute"` entries resolved on first use, so declaring one
imports nothing heavy (torch, vLLM, DeepSpeed) and creates no import edge. The method's live in
their package's `__init__.py` (`anytime.algo`, `anytime.pipeline`); the runtime components' in
`anytime.components`, below the recipe that validates their names. The recipe schema (`anytime.config`)
takes its allowed values from the registries, so adding an estimator is one entry in one place,
and a wrong name is answered with the allowed ones.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Iterator, Mapping
from typing import Any

from anytime.errors import RecipeError


class Registry:
    """Named implementations of one pluggable piece, picked by the recipe key `key`."""

    def __init__(self, key: str, entries: Mapping[str, str], doc: str = ""):
        for name, target in entries.items():
            if ":" not in target:
                raise ValueError(f"registry {key}: entry {name!r} must be 'module:attribute', got {target!r}")
        self.key, self.doc = key, doc
        self._entries = dict(entries)

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def target(self, name: str) -> str:
        """The `module:attribute` an entry names (an error listing the names when unknown)."""
        if name not in self._entries:
            close = difflib.get_close_matches(str(name), self.names(), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise RecipeError(f"`{self.key}` must be one of {', '.join(map(repr, self.names()))}, "
                              f"got {name!r}{hint}")
        return self._entries[name]

    def get(self, name: str) -> Any:
        """The implementation registered as `name`, imported on first use."""
        module, attribute = self.target(name).split(":")
        value: Any = importlib.import_module(module)
        for part in attribute.split("."):
            value = getattr(value, part)
        return value

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.key!r}, {list(self._entries)})"


class Choice:
    """A recipe field's allowed values: a registry's names, plus values the caller resolves itself
    (such as `auto`). Used as `Annotated[str, Choice(REGISTRY, "auto")]` in the schema."""

    def __init__(self, registry: Registry, *extra: str):
        self.registry, self.extra = registry, extra

    def names(self) -> tuple[str, ...]:
        return (*self.extra, *self.registry.names())
