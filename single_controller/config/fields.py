"""The schema seen as dotted paths: leaf fields, their types, choices, bounds and docstrings.

Everything here is read from `single_controller.config.schema` (its type hints with their
`Annotated` metadata, and its source for the docstring under each field); nothing is declared twice.
`CHOICES` and `BOUNDS` are derived tables, path -> allowed words / `annotated_types.Interval`, for
messages, the reference and the tests.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import types
import typing
from collections.abc import Iterator
from typing import Any

import annotated_types as at

from single_controller.config import schema
from single_controller.config.schema import Config

__all__ = [
    "BOUNDS",
    "CHOICES",
    "LEAF_PATHS",
    "all_paths",
    "base_type",
    "bound_text",
    "bounds_of",
    "choices_of",
    "default_of",
    "field_docs",
    "get",
    "hints",
    "is_section",
    "item_section",
    "leaf_fields",
    "type_name",
]


def hints(cls: type) -> dict[str, Any]:
    """The field types of a schema class, `Annotated` metadata kept."""
    return typing.get_type_hints(cls, vars(schema), include_extras=True)


def is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def item_section(tp: Any) -> type | None:
    """The dataclass of a list field's items (`tuple[RewardFunctionConfig, ...]`); None for other fields."""
    inner = base_type(tp)
    if typing.get_origin(inner) is tuple:
        args = typing.get_args(inner)
        if len(args) == 2 and args[1] is Ellipsis and is_section(args[0]):
            return args[0]
    return None


def _strip(tp: Any) -> tuple[Any, bool, tuple[Any, ...]]:
    """(the type without `Optional` and `Annotated`, whether it is optional, its annotated metadata)."""
    optional = False
    metadata: tuple[Any, ...] = ()
    while True:
        if typing.get_origin(tp) is typing.Annotated:
            metadata += tp.__metadata__
            tp = typing.get_args(tp)[0]
        elif typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(args) != 1:
                return tp, optional, metadata
            tp, optional = args[0], True
        else:
            return tp, optional, metadata


def base_type(tp: Any) -> Any:
    """`int` for `Optional[Annotated[int, Ge(1)]]`; a `tuple[...]` or `Literal[...]` stays as it is."""
    return _strip(tp)[0]


def choices_of(tp: Any) -> tuple[str, ...] | None:
    """The words a `Literal[...]` field allows (each item of a `tuple[Literal[...], ...]` field); None
    for other fields."""
    inner = base_type(tp)
    if typing.get_origin(inner) is tuple:
        return choices_of(typing.get_args(inner)[0])
    return typing.get_args(inner) if typing.get_origin(inner) is typing.Literal else None


def bounds_of(tp: Any) -> at.Interval | None:
    """The declared bounds of a numeric field (of each item for a tuple); None when it declares none."""
    inner, _, metadata = _strip(tp)
    if typing.get_origin(inner) is tuple:
        return bounds_of(typing.get_args(inner)[0])
    found: dict[str, Any] = {}
    declared = False
    for m in metadata:
        if isinstance(m, at.Interval):
            declared = True
            found.update({k: v for k, v in dataclasses.asdict(m).items() if v is not None})
        elif isinstance(m, (at.Gt, at.Ge, at.Lt, at.Le)):
            declared = True
            found.update(dataclasses.asdict(m))
    return at.Interval(**found) if declared else None


def bound_text(b: at.Interval) -> str:
    """`>= 1`, `> 0`, `in (0, 1]`: what a value must be."""
    lo, lo_open = (b.gt, True) if b.gt is not None else (b.ge, False)
    hi, hi_open = (b.lt, True) if b.lt is not None else (b.le, False)
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    if lo is not None:
        return f"> {lo:g}" if lo_open else f">= {lo:g}"
    if hi is not None:
        return f"< {hi:g}" if hi_open else f"<= {hi:g}"
    return "any number"


def type_name(tp: Any) -> str:
    """How the reference and the messages name a field's type: `int or null`, `list of 2 floats`,
    `` `retry` / `drop` ``."""
    inner, optional, _ = _strip(tp)
    choices = choices_of(inner)
    if choices is not None:
        name = " / ".join(f"`{c}`" for c in choices)
    elif (item := item_section(inner)) is not None:
        name = "list of {" + ", ".join(f.name for f in dataclasses.fields(item)) + "}"
    elif typing.get_origin(inner) is tuple:
        args = [base_type(a) for a in typing.get_args(inner)]
        if args and args[-1] is not Ellipsis and len(set(args)) == 1:
            name = f"list of {len(args)} {args[0].__name__}s"
        elif choices is not None:
            name = "list of " + " / ".join(f"`{c}`" for c in choices)
        else:
            name = "list"
    elif choices is not None:
        name = " / ".join(f"`{c}`" for c in choices)
    else:
        name = getattr(inner, "__name__", str(inner))
    return f"{name} or null" if optional else name


def leaf_fields(cls: type = Config, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, Any]]:
    """(dotted path, field, type hint) of every non-section field, in declaration order."""
    cls_hints = hints(cls)
    for f in dataclasses.fields(cls):
        tp = cls_hints[f.name]
        if is_section(tp):
            yield from leaf_fields(tp, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f, tp


def all_paths(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted path of the tree, sections included, in declaration order."""
    paths: list[str] = []
    cls_hints = hints(cls)
    for f in dataclasses.fields(cls):
        paths.append(prefix + f.name)
        if is_section(cls_hints[f.name]):
            paths += all_paths(cls_hints[f.name], f"{prefix}{f.name}.")
    return paths


def default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise TypeError(f"config field {f.name!r} has no default")


def get(cfg: Any, path: str) -> Any:
    """The value at a dotted path of a `Config`."""
    obj = cfg
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def field_docs() -> dict[str, dict[str, str]]:
    """class name -> field name -> docstring, read from the string literal under each field."""
    tree = ast.parse(inspect.getsource(schema))
    docs: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields: dict[str, str] = {}
        body = node.body
        for stmt, nxt in zip(body, body[1:] + [None]):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                fields[stmt.target.id] = " ".join(inspect.cleandoc(nxt.value.value).split())
        docs[node.name] = fields
    return docs


LEAF_PATHS: tuple[str, ...] = tuple(path for path, _, _ in leaf_fields())
CHOICES: dict[str, tuple[str, ...]] = {
    path: choices for path, _, tp in leaf_fields() if (choices := choices_of(tp)) is not None
}
BOUNDS: dict[str, at.Interval] = {path: b for path, _, tp in leaf_fields() if (b := bounds_of(tp)) is not None}
