"""Actor classes Ray can start before the process that starts them has imported their code.

A worker's class lives in a module that imports torch and the model code (seconds of CPU). To hand
a class to `ray.remote`, the controller would import all of that first, and only then could the
worker processes start their own imports; on two cores that left one core idle for seconds of every
start-up. `deferred_actor("pkg.module:Class", methods)` is a light stand-in with the same name and
methods: the actor's process imports `pkg.module` when the actor is built there, and every method
forwards to the real object. `methods` maps each public method to whether it is a coroutine
function (Ray makes an actor with any `async def` method an async actor, so the stand-in keeps each
method's kind); `check_deferred` (run by the tests) proves a stand-in matches its class.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any


def _resolve(target: str) -> type:
    module, _, qualname = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _forwarder(name: str, is_async: bool) -> Callable[..., Any]:
    if is_async:

        async def forward_async(self, *args: Any, **kwargs: Any) -> Any:
            return await getattr(self._impl, name)(*args, **kwargs)

        forward: Callable[..., Any] = forward_async
    else:

        def forward_sync(self, *args: Any, **kwargs: Any) -> Any:
            return getattr(self._impl, name)(*args, **kwargs)

        forward = forward_sync
    forward.__name__ = forward.__qualname__ = name
    return forward


def deferred_actor(target: str, methods: Mapping[str, bool]) -> type:
    """A class named like `target`'s whose instances build `target(*args, **kwargs)` on creation
    (importing its module in the actor's process) and forward `methods` to it."""
    qualname = target.partition(":")[2].rsplit(".", 1)[-1]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._impl = _resolve(target)(*args, **kwargs)

    namespace: dict[str, Any] = {
        "__init__": __init__,
        "__doc__": f"Stand-in for {target} (see single_controller.backends.common.deferred).",
        "_deferred_target": target,
    }
    for name, is_async in methods.items():
        namespace[name] = _forwarder(name, is_async)
    cls = type(qualname, (), namespace)
    cls.__module__ = __name__
    return cls


def public_methods(cls: type) -> dict[str, bool]:
    """`cls`'s public methods (its own and inherited) and whether each is a coroutine function."""
    out = {}
    for name, fn in inspect.getmembers(cls, inspect.isfunction):
        if not name.startswith("_"):
            out[name] = inspect.iscoroutinefunction(fn)
    return out


def check_deferred(stand_in: type) -> None:
    """Raise if `stand_in` does not have exactly its target's public methods, each of the same kind."""
    want = public_methods(_resolve(stand_in._deferred_target))
    got = public_methods(stand_in)
    if got != want:
        missing = sorted(set(want) - set(got))
        extra = sorted(set(got) - set(want))
        kind = sorted(n for n in set(got) & set(want) if got[n] != want[n])
        raise AssertionError(
            f"{stand_in._deferred_target}: stand-in out of date (missing {missing}, extra {extra}, sync/async differs {kind})"
        )
