"""The registry styles of everything pluggable: the method's estimators, losses and priors, and the
runtime's dtypes, engines, placements, learners, LR schedules and pipeline schedules.

- `FunctionRegistry`: `name -> the function itself`, built in the module that defines the functions,
  right after them, so "go to definition" from a call by name lands on the registry and from there
  on the function. The method's registries (`anytime.algo`) are these.
- `Names`: the names a recipe key accepts, declared apart from their implementations where those
  import torch (`anytime.algo.__init__`), so that the recipe schema, `anytime config` and
  `docs/recipes.md` know them without importing torch. The implementing module builds its
  `FunctionRegistry` with `Names.implemented_by`, which fails at import when the two disagree.
- `Registry`: `name -> "module:attribute"`, resolved on first use. The runtime components'
  (`anytime.components`, `anytime.defaults`, `anytime.pipeline`) stay this way: their
  implementations import vLLM, DeepSpeed or torch, which declaring them must not.

The recipe schema (`anytime.config`) takes its allowed values from the names (`Choice`), and a wrong
name is answered with the allowed ones and the closest of them. Registries are filled once, when
their module is imported, and never change afterwards.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from anytime.errors import RecipeError


class Names:
    """The names a recipe key `key` accepts, in the order the reference and the errors list them."""

    def __init__(self, key: str, names: Iterable[str], doc: str = ""):
        self.key, self.doc = key, doc
        self._names = tuple(names)

    def names(self) -> tuple[str, ...]:
        return self._names

    def check(self, name: str) -> str:
        """`name` when it is one of the names; else an error listing them, with the closest one."""
        if name not in self._names:
            close = difflib.get_close_matches(str(name), self._names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise RecipeError(f"`{self.key}` must be one of {', '.join(map(repr, self._names))}, "
                              f"got {name!r}{hint}")
        return name

    def implemented_by(self, functions: Mapping[str, Callable[..., Any]]) -> FunctionRegistry:
        """The registry of `functions`, which must be exactly the declared names (checked here, at the
        import of the module that defines them, so a name added on one side only fails at once)."""
        missing = [n for n in self._names if n not in functions]
        extra = [n for n in functions if n not in self._names]
        if missing or extra:
            raise ValueError(f"registry {self.key}: declared names without a function: {missing}; "
                             f"functions under undeclared names: {extra}")
        return FunctionRegistry(self.key, {n: functions[n] for n in self._names}, self.doc)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.key!r}, {list(self._names)})"


class FunctionRegistry(Names):
    """Named functions of one pluggable piece, each entry the function itself."""

    def __init__(self, key: str, functions: Mapping[str, Callable[..., Any]], doc: str = ""):
        for name, function in functions.items():
            if not callable(function):
                raise ValueError(f"registry {key}: entry {name!r} must be a function, got {function!r}")
        super().__init__(key, functions, doc)
        self._functions = dict(functions)

    def get(self, name: str) -> Callable[..., Any]:
        """The function registered as `name` (an error listing the names when unknown)."""
        return self._functions[self.check(name)]


class Registry(Names):
    """Named implementations of one pluggable piece, each entry a `module:attribute` string imported
    on first use (for implementations whose import is heavy: see the module's docstring)."""

    def __init__(self, key: str, entries: Mapping[str, str], doc: str = ""):
        for name, target in entries.items():
            if ":" not in target:
                raise ValueError(f"registry {key}: entry {name!r} must be 'module:attribute', got {target!r}")
        super().__init__(key, entries, doc)
        self._entries = dict(entries)

    def target(self, name: str) -> str:
        """The `module:attribute` an entry names (an error listing the names when unknown)."""
        return self._entries[self.check(name)]

    def get(self, name: str) -> Any:
        """The implementation registered as `name`, imported on first use."""
        module, attribute = self.target(name).split(":")
        value: Any = importlib.import_module(module)
        for part in attribute.split("."):
            value = getattr(value, part)
        return value


class Choice:
    """A recipe field's allowed values: a registry's names, plus values the caller resolves itself
    (such as `auto`). Used as `Annotated[str, Choice(REGISTRY, "auto")]` in the schema."""

    def __init__(self, registry: Names, *extra: str):
        self.registry, self.extra = registry, extra

    def names(self) -> tuple[str, ...]:
        return (*self.extra, *self.registry.names())
