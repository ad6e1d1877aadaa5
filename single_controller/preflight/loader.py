"""Load and validate the configuration tree of `single_controller.config.schema`.

`load_config(path, overrides)` merges a YAML file and `key=value` overrides over the defaults
(OmegaConf, public API) and validates the plain result in one pass with pydantic (strict: `true` is
no number), then runs `preflight.rules`: unknown keys (with a did-you-mean), types, choices, bounds
and rules are reported together in one `ConfigError`. `config_to_yaml` dumps a `Config` that loads
back equal. The schema stays a plain frozen dataclass tree. The machine's checks
(`preflight.environment`) and the reference writers (`config.reference`) are re-exported here.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import TypeAdapter, ValidationError

from single_controller.config import fields
from single_controller.config.fields import BOUNDS, CHOICES
from single_controller.config.problems import ConfigError, Problem
from single_controller.config.reference import (
    config_reference_markdown,
    readme_reference,
    replace_readme_reference,
    write_readme_reference,
)
from single_controller.config.schema import RETIRED_KEYS, Config
from single_controller.preflight.environment import check_environment, environment_problems
from single_controller.preflight.rules import DIGIT_TASKS, rule_problems

__all__ = [
    "ConfigError",
    "Problem",
    "load_config",
    "environment_problems",
    "check_environment",
    "config_to_yaml",
    "config_reference_markdown",
    "write_readme_reference",
    "replace_readme_reference",
    "readme_reference",
    "BOUNDS",
    "CHOICES",
    "DIGIT_TASKS",
]

_CONFIG = TypeAdapter(Config)
_BOUND_ERRORS = frozenset({"greater_than", "greater_than_equal", "less_than", "less_than_equal"})
_LEAVES: dict[str, tuple[dataclasses.Field, Any]] = {path: (f, tp) for path, f, tp in fields.leaf_fields()}


def load_config(path: str | os.PathLike | None, overrides: Sequence[str] = ()) -> Config:
    """Load `path` (YAML; None: defaults only), apply `key=value` overrides, validate everything.

    Raises `ConfigError` listing every problem found: unreadable file, unknown keys, wrong types,
    unresolvable interpolations, values outside their choices or bounds, and broken rules.
    """
    problems: list[Problem] = []
    failed: set[str] = set()  # paths whose value was rejected: the rules' findings on them are left out
    sources: dict[str, str] = {}  # leaf path -> the file or override that set it last
    merged: DictConfig | ListConfig = OmegaConf.create(_plain(Config()))
    for source, layer in _layers(path, overrides, problems):
        known = _known_keys(layer, Config, "", source, problems, failed, sources)
        merged = OmegaConf.merge(merged, known)
        for leaf, value in _mapping_leaves(known, Config, ""):  # a mapping-valued field is replaced, not merged
            OmegaConf.update(merged, leaf, value, merge=False)
    values = _resolve(merged, problems, failed)
    cfg = _validate(values, problems, failed, sources)
    problems += [p for p in rule_problems(cfg) if not failed.intersection(p.paths)]
    if problems:
        origin = "configuration" if path is None else f"configuration {path}"
        if overrides:
            origin += f" with {len(overrides)} override{'s' if len(overrides) != 1 else ''}"
        raise ConfigError(problems, origin)
    return cfg


def config_to_yaml(cfg: Config) -> str:
    """The complete resolved configuration as YAML (loads back to an equal `Config`)."""
    return OmegaConf.to_yaml(OmegaConf.create(_plain(cfg)))


def _plain(cfg: Config) -> dict[str, Any]:
    """`cfg` as nested dicts, lists and scalars (tuples become lists, as YAML has them)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


# ---------------------------------------------------------------- reading the layers


def _layers(path: str | os.PathLike | None, overrides: Sequence[str], problems: list[Problem]) -> list[tuple[str, Any]]:
    """(source, plain nested dict) of the file and then each override, in the order they apply."""
    layers: list[tuple[str, Any]] = []
    if path is not None:
        layer = _read_yaml(Path(path), problems)
        if layer is not None:
            layers.append((str(path), layer))
    for item in overrides:
        layer = _parse_override(item, problems)
        if layer is not None:
            layers.append((f"override '{item}'", layer))
    return layers


def _read_yaml(path: Path, problems: list[Problem]) -> dict | None:
    try:
        path.read_bytes()
    except OSError as e:
        problems.append(Problem((), f"cannot read config file {str(path)!r}: {e.strerror or e}"))
        return None
    try:
        loaded = OmegaConf.load(path)  # OmegaConf's YAML dialect: 1e-3 is a float, duplicate keys fail
    except yaml.YAMLError as e:
        problems.append(Problem((), f"{path} is not valid YAML:\n{e}"))
        return None
    except (OSError, OmegaConfBaseException) as e:  # a scalar document
        problems.append(Problem((), f"{path} must hold a mapping of sections ({e})"))
        return None
    if not isinstance(loaded, DictConfig):
        problems.append(Problem((), f"{path} must hold a mapping of sections, not a list"))
        return None
    data = OmegaConf.to_container(loaded, resolve=False)
    assert isinstance(data, dict)
    return data


def _parse_override(item: str, problems: list[Problem]) -> dict | None:
    key, sep, _ = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        problems.append(Problem((), f"override {item!r} is not of the form key=value (e.g. train.lr=3e-4)"))
        return None
    try:
        parsed = OmegaConf.to_container(OmegaConf.from_dotlist([item]), resolve=False)
    except (OmegaConfBaseException, yaml.YAMLError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        problems.append(Problem((), f"override {item!r}: cannot parse the value: {first}"))
        return None
    assert isinstance(parsed, dict)
    return parsed


# ---------------------------------------------------------------- keys, then values


def _known_keys(
    layer: Any,
    cls: type,
    prefix: str,
    source: str,
    problems: list[Problem],
    failed: set[str],
    sources: dict[str, str],
) -> dict[str, Any]:
    """`layer` without its unknown keys and its non-mapping sections, each of which is a problem."""
    if layer is None:  # a YAML section with every key commented out
        return {}
    if not isinstance(layer, dict):
        section = prefix.rstrip(".") or "the top level"
        message = f"{section}: expected a mapping of {cls.__name__} fields, got {layer!r}"
        problems.append(Problem((prefix.rstrip("."),), message, source))
        failed.add(prefix.rstrip("."))
        return {}
    hints = fields.hints(cls)
    known: dict[str, Any] = {}
    for key, value in layer.items():
        path = f"{prefix}{key}"
        if key not in hints:
            problems.append(Problem((path,), _unknown_key_message(path, cls, prefix), source))
        elif fields.is_section(hints[key]):
            known[key] = _known_keys(value, hints[key], f"{path}.", source, problems, failed, sources)
        else:
            known[key] = value
            sources[path] = source
            if (item := fields.item_section(hints[key])) is not None and isinstance(value, list):
                _unknown_item_keys(value, item, path, source, problems)
    return known


def _mapping_leaves(known: dict[str, Any], cls: type, prefix: str) -> list[tuple[str, Any]]:
    """(path, value) of the fields of `known` whose type is a mapping (`data.reasoning_gym.config`)."""
    hints = fields.hints(cls)
    out: list[tuple[str, Any]] = []
    for key, value in known.items():
        if fields.is_section(hints[key]):
            out += _mapping_leaves(value, hints[key], f"{prefix}{key}.")
        elif isinstance(value, dict):
            out.append((f"{prefix}{key}", value))
    return out


def _unknown_item_keys(items: list, cls: type, path: str, source: str, problems: list[Problem]) -> None:
    """Each unknown key of the items of a list of mappings (`reward.functions`) is a problem."""
    names = [f.name for f in dataclasses.fields(cls)]
    for i, item in enumerate(items):
        for key in item if isinstance(item, dict) else ():
            if key not in names:
                close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
                hint = f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(names)}"
                problems.append(Problem((path,), f"{path}[{i}].{key}: unknown key; {hint}", source))


def _unknown_key_message(path: str, cls: type, prefix: str) -> str:
    if path in RETIRED_KEYS:
        return f"{path}: no longer a key; {RETIRED_KEYS[path]}"
    key = path.rsplit(".", 1)[-1]
    section = prefix.rstrip(".")
    where = f"in section '{section}'" if section else "at the top level"
    siblings = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(key, siblings, n=1, cutoff=0.6)
    if close:
        return f"{path}: unknown key {where}; did you mean '{prefix}{close[0]}'?"
    # the right name in the wrong section (e.g. run.lr), or a close full path
    paths = fields.all_paths()
    elsewhere = [p for p in paths if p.rsplit(".", 1)[-1] == key]
    close_paths = difflib.get_close_matches(path, paths, n=1, cutoff=0.75)
    if elsewhere:
        hint = f"did you mean '{elsewhere[0]}'?"
    elif close_paths:
        hint = f"did you mean '{close_paths[0]}'?"
    else:
        hint = f"known keys here: {', '.join(siblings)}"
    return f"{path}: unknown key {where}; {hint}"


def _resolve(merged: DictConfig | ListConfig, problems: list[Problem], failed: set[str]) -> dict[str, Any]:
    """The merged tree as plain nested dicts, resolving leaf by leaf so each bad interpolation is
    reported (and replaced by the field's default), not just the first."""
    values: dict[str, Any] = {}
    for path, (f, _) in _LEAVES.items():
        try:
            value = OmegaConf.select(merged, path, throw_on_resolution_failure=True)
            if isinstance(value, (DictConfig, ListConfig)):
                value = OmegaConf.to_container(value, resolve=True)
        except OmegaConfBaseException as e:
            first = str(e).strip().splitlines()[0]
            problems.append(Problem((path,), f"{path}: cannot resolve its value: {first}"))
            failed.add(path)
            value = _plain_default(f)
        _put(values, path, value)
    return values


def _plain_default(f: dataclasses.Field) -> Any:
    default = fields.default_of(f)
    return list(default) if isinstance(default, tuple) else default


def _put(tree: dict[str, Any], path: str, value: Any) -> None:
    *sections, key = path.split(".")
    for s in sections:
        tree = tree.setdefault(s, {})
    tree[key] = value


def _lookup(tree: dict[str, Any], path: str) -> Any:
    for part in path.split("."):
        tree = tree[part]
    return tree


def _validate(values: dict[str, Any], problems: list[Problem], failed: set[str], sources: dict[str, str]) -> Config:
    """The `Config` of `values`; each rejected field is a problem and is judged by the rules with its
    default instead (their findings on it are left out)."""
    _numbers_as_text(values)
    try:
        return _CONFIG.validate_json(json.dumps(values), strict=True)
    except ValidationError as e:
        errors = e.errors()
    first: dict[str, Any] = {}
    for err in errors:  # one problem per field (a tuple may have several bad items)
        first.setdefault(_leaf_of(err["loc"]), err)
    for path, err in first.items():
        message = _item_message(path, err) or _value_message(path, err, _lookup(values, path))
        problems.append(Problem((path,), message, sources.get(path, "")))
        failed.add(path)
        _put(values, path, _plain_default(_LEAVES[path][0]))
    return _CONFIG.validate_json(json.dumps(values), strict=True)


def _leaf_of(loc: tuple) -> str:
    """The field a pydantic error location is in: `reward.functions` for ('reward', 'functions', 0, 'fn')."""
    path = ""
    for part in loc:
        if not isinstance(part, str):
            break
        path = f"{path}.{part}" if path else part
        if path in _LEAVES:
            break
    return path


def _item_message(path: str, err: Any) -> str | None:
    """What is wrong with one item of a list of mappings (`reward.functions[0].fn: Field required`)."""
    loc = list(err["loc"])
    rest = loc[len(path.split(".")) :]
    if not rest or not isinstance(rest[0], int) or fields.item_section(_LEAVES[path][1]) is None:
        return None
    where = f"{path}[{rest[0]}]" + "".join(f".{p}" for p in rest[1:] if isinstance(p, str))
    return f"{where}: {err['msg']}"


def _accepts_text(tp: Any) -> bool:
    """A plain text field (`str`, `str | None`), not a choice."""
    return tp is str or (typing.get_origin(tp) in (typing.Union, types.UnionType) and str in typing.get_args(tp))


def _numbers_as_text(values: dict[str, Any]) -> None:
    """A number given for a text field is that text (`run.name=2024`), as YAML cannot tell them apart."""
    for path, (_, tp) in _LEAVES.items():
        try:
            value = _lookup(values, path)
        except (KeyError, TypeError):
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool) and _accepts_text(tp):
            _put(values, path, str(value))


def _value_message(path: str, err: Any, value: Any) -> str:
    """What is wrong with one field's value, from pydantic's error and the field's declaration."""
    if err["type"] == "literal_error":  # of the field, or of one item of a list of choices
        choices, bad = CHOICES[path], err["input"]
        close = difflib.get_close_matches(str(bad), choices, n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        what = "each item must" if isinstance(value, list) else "must"
        return f"{path}: {what} be one of {', '.join(choices)}; got {bad!r}{hint}"
    if err["type"] in _BOUND_ERRORS:
        return f"{path}: must be {fields.bound_text(BOUNDS[path])}, got {err['input']!r}"
    reason = {"missing": "too few items", "too_long": "too many items"}.get(err["type"], err["msg"])
    return f"{path}: expected {fields.type_name(_LEAVES[path][1])}, got {value!r} ({reason})"
