"""In-process environments (`env.fn`) and the check of an environment before start-up (`check_env`).

`env.fn` is a built-in name (`BUILTIN_ENVS`) or `module:Class`. `check_env_class` refuses, with
`EnvContractError`, a class without async `reset` / `step` or whose constructor rejects `env.args`
(checked on its signature: nothing is instantiated before start-up). `load_env_factory(cfg)` returns
the per-episode factory; `check_env(cfg)` validates `fn` or `url`. Deadlines and failures of an
episode's calls are the runner's (`backends/common/episodes.py`).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from single_controller.envs.contract import EnvContractError, Environment

if TYPE_CHECKING:
    from single_controller.config.schema import EnvConfig

BUILTIN_ENVS: dict[str, str] = {
    "lookup": "single_controller.envs.builtin:LookupEnv",
    "guess": "single_controller.envs.builtin:GuessEnv",
}


def resolve_env_class(spec: str) -> Any:
    """The object `spec` names (a built-in name or `module:Class`), or `EnvContractError` saying why not."""
    target = BUILTIN_ENVS.get(spec, spec)
    module_name, sep, attr_path = target.partition(":")
    if not sep or not module_name or not attr_path:
        raise EnvContractError(
            f"env.fn {spec!r}: expected a built-in environment ({', '.join(sorted(BUILTIN_ENVS))}) or 'module:Class'"
        )
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise EnvContractError(
            f"env.fn {spec!r}: cannot import module {module_name!r}: {type(e).__name__}: {e} (modules are imported "
            "from the current directory and the Python path)"
        ) from e
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise EnvContractError(f"env.fn {spec!r}: module {module_name!r} has no attribute {attr_path!r}") from None
    return obj


def check_env_class(obj: Any, spec: str = "", args: Mapping[str, Any] | None = None) -> None:
    """Refuse what cannot serve as an environment class (see the module's contract)."""
    name = f"env.fn {spec!r}" if spec else f"environment {obj!r}"
    if not inspect.isclass(obj):
        raise EnvContractError(f"{name} is a {type(obj).__name__}, not a class with async reset(item) and step(action)")
    for method in ("reset", "step", "close"):
        fn = getattr(obj, method, None)
        if fn is None and method != "close":
            raise EnvContractError(
                f"{name}: class {obj.__qualname__} has no {method}() method (the contract needs "
                f"`async def {method}(...)`)"
            )
        if fn is not None and not inspect.iscoroutinefunction(fn):
            raise EnvContractError(
                f"{name}: {obj.__qualname__}.{method} must be `async def` (it is a plain {type(fn).__name__})"
            )
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return  # no signature to check (a C type): the first episode will tell
    try:
        signature.bind(**dict(args or {}))
    except TypeError as e:
        raise EnvContractError(
            f"{name}: {obj.__qualname__}{signature} rejects env.args {dict(args or {})!r}: {e}"
        ) from None


def load_env_factory(cfg: EnvConfig) -> Callable[[], Environment]:
    """The per-episode factory of `env.fn`: a fresh `Class(**env.args)` per call (checked first)."""
    if cfg.fn is None:
        raise EnvContractError("env.fn is null: there is no in-process environment to load")
    cls = resolve_env_class(cfg.fn)
    check_env_class(cls, cfg.fn, cfg.args)
    return functools.partial(cls, **dict(cfg.args))


def check_env(cfg: EnvConfig) -> None:
    """Before start-up: `env.fn` imports and satisfies the contract, or `env.url` answers /health with
    the protocol (within `env.timeout_s`). Raises `EnvContractError` naming the spec or url."""
    if cfg.fn is not None and cfg.url is not None:
        raise EnvContractError(f"env.fn ({cfg.fn!r}) and env.url ({cfg.url!r}) exclude each other: give one")
    if cfg.fn is not None:
        load_env_factory(cfg)
    elif cfg.url is not None:
        from single_controller.envs.http_client import check_env_url

        check_env_url(cfg.url, cfg.timeout_s)
