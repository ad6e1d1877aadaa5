"""Every workaround of TransferQueue's (and torch's) internals, in one place.

Checked against TransferQueue 0.1.11, tensordict 0.15.3, torch 2.13.0+cpu and Ray 2.60; when TQ
changes, this is the module to read again. Start-up shims, switched on by ONE call,
`install_shims()` (Ray's worker setup hook, and `common.import_transfer_queue`): tensordict imported
without `torch._dynamo`, and no cyclic GC while torch and TQ are imported (what they save:
docs/performance.md). Private-handle helpers for what TQ's public API cannot do: `adopt_controller`,
`forget_tq_handles`, `drop_client`, `clear_empty_partition`. Imports nothing heavy at import time.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.abc
import importlib.util
import logging
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


def install_shims() -> None:
    """Switch on this process's start-up shims (idempotent; imports nothing): the one switch."""
    without_dynamo_at_import()
    pause_gc_until_transfer_queue()


# ---------------------------------------------------------------- import hooks
def _restore_loader(module: Any, loader: Any) -> None:
    """The module keeps its own loader (`importlib.resources` and friends ask it for files), not our wrapper."""
    module.__loader__ = loader
    if getattr(module, "__spec__", None) is not None:
        module.__spec__.loader = loader


class _WrappedLoader(importlib.abc.Loader):
    """The module's own loader, its `exec_module` run inside `around()`."""

    def __init__(self, inner: Any, around: Callable[[], AbstractContextManager[None]]) -> None:
        self.inner, self.around = inner, around

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        _restore_loader(module, self.inner)
        with self.around():
            self.inner.exec_module(module)


class _OneImportFinder(importlib.abc.MetaPathFinder):
    """Finds module `name` once (then leaves `sys.meta_path`), with a loader that runs the module's
    import inside `around()`; runs `around()` empty when the module cannot be found."""

    def __init__(self, name: str, around: Callable[[], AbstractContextManager[None]]) -> None:
        self.name, self.around = name, around

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != self.name:
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _WrappedLoader(spec.loader, self.around)
        else:
            with self.around():
                pass
        return spec


def _hook_installed(name: str) -> bool:
    return any(isinstance(f, _OneImportFinder) and f.name == name for f in sys.meta_path)


# ---------------------------------------------------------------- no Dynamo at import
def _identity(fn: T) -> T:
    return fn


@contextlib.contextmanager
def _compiler_wrappers_as_identity() -> Iterator[None]:
    import torch.compiler as compiler

    if "torch._dynamo" in sys.modules:  # already paid for: nothing to save
        yield
        return
    saved = compiler.allow_in_graph, compiler.assume_constant_result
    compiler.allow_in_graph = compiler.assume_constant_result = _identity
    try:
        yield
    finally:
        compiler.allow_in_graph, compiler.assume_constant_result = saved


def without_dynamo_at_import() -> None:
    """Make the first `import tensordict` of this process skip `torch._dynamo`.

    Works around: tensordict 0.15.3 (TransferQueue 0.1.11's dependency) wraps a few functions with
    `torch.compiler.allow_in_graph` and `assume_constant_result` at import, and on torch 2.13 both
    import all of Dynamo. Those wrappers matter only when tensordict code runs under `torch.compile`,
    which nothing of TQ does: while tensordict's modules execute they are identity functions, and
    `torch.compiler` is restored right after.
    Why: importing Dynamo is a large share of the start-up of every process that imports
    TransferQueue (its host, the controller, every worker; docs/performance.md, "No Dynamo at
    import"). Costs nothing until tensordict is imported; a no-op once it is, or when
    Dynamo is already loaded."""
    if "tensordict" in sys.modules or _hook_installed("tensordict"):
        return
    sys.meta_path.insert(0, _OneImportFinder("tensordict", _compiler_wrappers_as_identity))


# ---------------------------------------------------------------- no garbage collection during the imports
GC_PAUSE_MAX_S = 60.0  # longest pause, in a process that never imports TransferQueue
_gc_lock = threading.Lock()
_gc_timer: threading.Timer | None = None


def pause_gc_until_transfer_queue(max_s: float = GC_PAUSE_MAX_S) -> bool:
    """Pause the cyclic garbage collector until `transfer_queue` has been imported (`max_s` at the
    latest), then set the import's objects aside for good (`gc.freeze`) and resume it.

    Works around: importing torch 2.13 and TransferQueue 0.1.11 allocates a great many long-lived
    objects, which the collector walks again and again while they are created; after the freeze,
    later full collections skip them too (what it saves: docs/performance.md, "No garbage
    collection during the imports"). Imports nothing. Returns whether it paused (not when the collector is already
    off or paused, or `transfer_queue` is already imported)."""
    global _gc_timer
    with _gc_lock:
        if _gc_timer is not None or not gc.isenabled() or "transfer_queue" in sys.modules:
            return False
        gc.disable()
        _gc_timer = threading.Timer(max_s, resume_gc)
        _gc_timer.daemon = True
        _gc_timer.start()
    sys.meta_path.insert(0, _OneImportFinder("transfer_queue", _resume_gc_after))
    return True


def resume_gc() -> None:
    """End the pause of `pause_gc_until_transfer_queue` (idempotent; a no-op without one)."""
    global _gc_timer
    with _gc_lock:
        if _gc_timer is None:
            return
        _gc_timer.cancel()
        _gc_timer = None
        gc.freeze()
        gc.enable()


@contextlib.contextmanager
def _resume_gc_after() -> Iterator[None]:
    try:
        yield
    finally:
        resume_gc()


# ---------------------------------------------------------------- TQ's process-local handles
# `transfer_queue.interface` keeps this process's client, the storage handles `tq.close()` shuts down,
# and the controller's handle in module globals; `tq.init` and `tq.close` are the only public ways to
# set or clear them.
_HANDLES = ("_TQ_CLIENT", "_TQ_STORAGE", "_TQ_CONTROLLER")


def can_adopt_controller() -> bool:
    """Whether `adopt_controller` can work here: the installed TransferQueue keeps its handles where
    0.1.11 does, and this process has no controller handle yet (call after importing TQ)."""
    import transfer_queue.interface as tqi

    return (
        all(hasattr(tqi, name) for name in _HANDLES)
        and callable(getattr(tqi, "_maybe_create_tq_client", None))
        and tqi._TQ_CONTROLLER is None
    )


def adopt_controller(host: Any, final_config: Any) -> None:
    """Make the one-process host (`replay.transferqueue.host`) this process's TQ: what `tq.init(conf)`
    ends with, on a controller it did not create.

    Works around: `tq.init` 0.1.11 can only create TQ's controller and storage units as Ray actors of
    their own; there is no public way to hand it a controller. After this, `tq.close()` treats the host
    as the controller and as the storage unit (it asks the storage handles to shut down, then kills
    them and the controller).
    Why: one process fewer at start-up (docs/performance.md, "One TransferQueue process, not two")."""
    import transfer_queue.interface as tqi

    tqi._TQ_CONTROLLER = host
    tqi._TQ_STORAGE = {"SimpleStorage": {"host": host}}
    tqi._maybe_create_tq_client(final_config)


def forget_tq_handles() -> None:
    """Forget TQ's process-wide handles. Works around: after a failed or timed-out `tq.init` or
    `tq.close`, or a Ray restart, TQ 0.1.11 would reuse the stale handles (a later `tq.init` in this
    process would attach to nothing)."""
    import transfer_queue.interface as tqi

    for name in _HANDLES:
        if hasattr(tqi, name):
            setattr(tqi, name, None)


def drop_client() -> None:
    """Close this process's TQ client and forget TQ's handles, leaving the controller running.
    Works around: TQ 0.1.11's only teardown, `tq.close()`, also kills the shared controller, after
    which every other client hangs forever; a process that attached must not call it."""
    import transfer_queue.interface as tqi

    client = getattr(tqi, "_TQ_CLIENT", None)
    if client is not None:
        try:
            client.close()
        except Exception as e:  # teardown, best effort (TQ's close logs its own errors): the peers may be gone
            log.warning("replay/tq: closing the TQ client failed: %r", e)
    forget_tq_handles()


def clear_empty_partition(client: Any, partition: str) -> Awaitable[Any] | None:
    """The call that drops `partition`'s metadata from TQ's controller (None: this TQ has no such call).
    Works around: TQ 0.1.11's public `clear_partition()` skips a partition without samples as
    "non-existent" and so never removes an empty one; this is the controller request it ends with."""
    drop = getattr(client, "_clear_partition_in_controller", None)
    return drop(partition) if drop is not None else None
