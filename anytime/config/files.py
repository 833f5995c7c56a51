"""Recipe files as plain data: YAML read with `base: other.yaml` inheritance and dotted
`key.path=value` overrides merged on top. The typed schema (`anytime.config`) checks the result;
every problem found here is a `RecipeError` naming the file or the override."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from anytime.errors import RecipeError


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`override` on top of `base`, section by section (a non-mapping value replaces the whole key)."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def parse_override(text: str) -> dict[str, Any]:
    """`rollout.n=8` → {"rollout": {"n": 8}}; the value is parsed as YAML (`[1, 2]`, `null`, `true`)."""
    if "=" not in text:
        raise RecipeError(f"override {text!r} must look like key.path=value, e.g. rollout.n=8")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise RecipeError(f"override {text!r} has an empty key; write e.g. budget.prior=uniform")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise RecipeError(f"override {text!r}: value is not valid YAML ({exc.problem})") from None
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def load_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A recipe file's mapping, its `base:` chain merged underneath (`seen`: the chain so far)."""
    if not path.is_file():
        raise RecipeError(f"recipe file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise RecipeError(f"recipe file {str(path)!r} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"recipe file {str(path)!r} must hold a mapping of sections (model:, data:, ...)")
    parent = data.pop("base", None)   # `base: other.yaml` inherits and overrides another recipe
    if parent is not None:
        parent_path = (path.parent / str(parent)).resolve()
        if parent_path in seen:
            raise RecipeError(f"recipe {str(path)!r}: `base` chain loops through {str(parent_path)!r}")
        data = merge(load_yaml(parent_path, seen + (parent_path,)), data)
    return data


def read_recipe_data(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """The recipe file's data (nothing when `path` is None) with every override merged on top, in order."""
    data: dict[str, Any] = {} if path is None else load_yaml(Path(path).resolve())
    for text in overrides:
        data = merge(data, parse_override(text))
    return data
