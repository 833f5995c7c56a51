"""Typed dataclasses from plain data (YAML): every value checked against its field's type, with
errors that name the key path and what is allowed (`RecipeError`). The recipe schema
(`anytime.config`) is built with it; choice fields take their allowed values from a registry
(`Annotated[str, Choice(REGISTRY)]`)."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Annotated, Any, Literal

from anytime.errors import RecipeError
from anytime.registry import Choice

RECIPE_DOCS = "docs/recipes.md"


def field_choice(tp: Any) -> Choice | None:
    """The allowed values of an `Annotated[str, Choice(...)]` field (None for other types)."""
    if typing.get_origin(tp) is Annotated:
        return next((m for m in tp.__metadata__ if isinstance(m, Choice)), None)
    return None


def field_choices(tp: Any) -> tuple[Any, ...] | None:
    """The allowed values of a choice (`Choice`) or `Literal` field; None for any other type."""
    choice = field_choice(tp)
    if choice is not None:
        return choice.names()
    return typing.get_args(tp) if typing.get_origin(tp) is Literal else None


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if field_choice(tp) is not None:
        return "one of " + ", ".join(repr(a) for a in field_choice(tp).names())
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if origin is list:
        item = type_name(typing.get_args(tp)[0])
        plural = {"an integer": "integers", "a number": "numbers", "a string": "strings"}
        return f"a list of {plural.get(item, item)}"
    if origin is dict:
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false",
            type(None): "null"}.get(tp, getattr(tp, "__name__", str(tp)))


def convert(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    choice = field_choice(tp)
    if choice is not None:
        return one_of(value, choice.names(), path)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise RecipeError(f"recipe key `{path}` must be a mapping of {tp.__name__} fields, got {value!r}")
        return build(tp, value, path)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return convert(value, arg, path)
            except RecipeError:
                continue
        raise RecipeError(f"recipe key `{path}` must be {type_name(tp)}, got {value!r}")
    if origin is Literal:
        return one_of(value, typing.get_args(tp), path)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise RecipeError(f"recipe key `{path}` must be {type_name(tp)}, got {value!r}")
        (item,) = typing.get_args(tp)
        return [convert(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:   # free-form settings handed on to a library (e.g. `data.task_config`)
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise RecipeError(f"recipe key `{path}` must be a mapping with string keys, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # PyYAML reads `5e-4` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    raise RecipeError(f"recipe key `{path}` must be {type_name(tp)}, got {value!r} ({type(value).__name__})")


def one_of(value: Any, allowed: tuple[Any, ...], path: str) -> Any:
    if value not in allowed:
        close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise RecipeError(f"recipe key `{path}` must be one of {', '.join(map(repr, allowed))}, got {value!r}{hint}")
    return value


def build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls, include_extras=True)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean `{(prefix + '.' if prefix else '') + close[0]}`?" if close else ""
            raise RecipeError(f"unknown recipe key `{path}`{hint} (allowed here: {', '.join(names)}; "
                              f"all keys: {RECIPE_DOCS})")
        try:
            kwargs[key] = convert(value, hints[key], path)
        except RecipeError as exc:
            doc = field_doc(cls, key)
            if not doc or dataclasses.is_dataclass(hints[key]) or RECIPE_DOCS in str(exc):
                raise
            raise RecipeError(f"{exc}. `{path}`: {doc} (all keys: {RECIPE_DOCS})") from None
    return cls(**kwargs)


# --- fields that carry their meaning, and the reference generated from them ----------------------

def opt(default: Any = dataclasses.MISSING, doc: str = "", *, factory: Any = None) -> Any:
    """A schema field with its one line of meaning: errors about the field and the generated
    reference (`reference`) show the same text."""
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata={"doc": doc})
    return dataclasses.field(default=default, metadata={"doc": doc})


def field_doc(cls: type, name: str) -> str:
    return {f.name: f.metadata.get("doc", "") for f in dataclasses.fields(cls)}.get(name, "")


def keys(cls: type, prefix: str = "") -> list[str]:
    """Every leaf key of a schema, dotted (`learner.pipeline.stages`)."""
    hints = typing.get_type_hints(cls, include_extras=True)
    out = []
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        out += keys(hints[f.name], path + ".") if dataclasses.is_dataclass(hints[f.name]) else [path]
    return out


def field_at(cls: type, key: str) -> tuple[dataclasses.Field, Any]:
    """The field of a dotted key (`eval.temperature`) of schema `cls`, and its type."""
    *sections, name = key.split(".")
    for section in sections:
        cls = typing.get_type_hints(cls, include_extras=True)[section]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if name not in fields:
        raise KeyError(f"{key!r} is not a key of {cls.__name__}")
    return fields[name], typing.get_type_hints(cls, include_extras=True)[name]


def field_default(f: dataclasses.Field) -> Any:
    """A field's default (a fresh one for a field with a default factory)."""
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default



def _yaml_value(value: Any) -> str:
    import json

    import yaml

    if isinstance(value, str):   # escapes shown as written in YAML's double-quoted strings
        return json.dumps(value, ensure_ascii=False)
    text = yaml.safe_dump(value, default_flow_style=True, allow_unicode=True, width=10**6).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def reference(cls: type, title: str, intro: str) -> str:
    """A markdown reference of a schema: one table per section, each key with its type, default,
    allowed values and meaning, in the schema's order."""
    lines = [f"# {title}", "", intro, ""]

    def section(section_cls: type, prefix: str, doc: str) -> None:
        hints = typing.get_type_hints(section_cls, include_extras=True)
        leaves = [f for f in dataclasses.fields(section_cls) if not dataclasses.is_dataclass(hints[f.name])]
        if leaves:
            lines.extend([f"## {prefix.rstrip('.')}", ""])
            if doc:
                lines.extend([doc[0].upper() + doc[1:] + ".", ""])
            lines.extend(["| key | type | default | meaning |", "|---|---|---|---|"])
            for f in leaves:
                cell = _cell(f.metadata.get("doc", ""))
                shown = _cell(_yaml_value(field_default(f))).replace("\n", "\\n")
                lines.append(f"| `{prefix}{f.name}` | {_cell(type_name(hints[f.name]))} | `{shown}` | {cell} |")
            lines.append("")
        for f in dataclasses.fields(section_cls):
            if dataclasses.is_dataclass(hints[f.name]):
                section(hints[f.name], f"{prefix}{f.name}.", f.metadata.get("doc", ""))

    for f in dataclasses.fields(cls):
        section(typing.get_type_hints(cls, include_extras=True)[f.name], f"{f.name}.", f.metadata.get("doc", ""))
    return "\n".join(lines).rstrip() + "\n"
