"""Start, attach to and stop TransferQueue (TQ) on a Ray cluster.

`start_tq()` creates TQ on the connected Ray (the one-process host, or `tq.init`), refusing when Ray
lacks the CPUs TQ reserves (`tq.init` would hang) and with a deadline on the start. `attach_tq()`
connects this process's client to a running TQ, never starting one. `stop_tq()` is idempotent; only
the creating process closes TQ (`tq.close()` elsewhere kills the shared controller). Ray and TQ are
imported lazily, so importing this module neither freezes Ray's environment nor imports torch.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from replay.transferqueue import host as tq_host
from replay.transferqueue import shims
from replay.transferqueue.common import (
    CONTROLLER_NAME,
    CONTROLLER_NAMESPACE,
    STORAGE_UNIT_NAME,
    TQRuntimeError,
    client_connected,
    import_transfer_queue,
)
from single_controller.deadlines import DeadlineExceeded

log = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = ["TQRuntimeError", "TQRuntimeInfo", "attach_tq", "check_ray_cpus", "start_tq", "stop_tq"]


@dataclass(frozen=True)
class TQRuntimeInfo:
    created: bool  # True: this process started TQ (and is the only one allowed to close it)
    num_storage_units: int  # storage units of the running TQ (-1: unknown, attached)
    startup_s: float  # seconds `start_tq` / `attach_tq` took


# Process-local state: whether this process created the running TQ.
_lock = threading.Lock()
_owned: TQRuntimeInfo | None = None


def _call_with_deadline(fn: Callable[[], T], seconds: float, what: str) -> T:
    """Run blocking `fn` in a daemon thread and give up after `seconds` (tq.init's ray.get calls have
    no timeout). On a deadline the thread is abandoned; the caller cleans up what it may have started."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    thread = threading.Thread(target=target, name=f"tq-deadline:{what}", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise DeadlineExceeded(what, seconds)
    if "error" in box:
        raise box["error"]
    return box["value"]


def _controller() -> Any | None:
    import ray

    try:
        return ray.get_actor(CONTROLLER_NAME, namespace=CONTROLLER_NAMESPACE)
    except ValueError:
        return None


def _require_ray() -> None:
    import ray

    if not ray.is_initialized():
        raise TQRuntimeError("Ray is not initialized in this process: call ray.init(...) before starting TransferQueue")


def check_ray_cpus(num_storage_units: int, available_cpus: float, one_process: bool = False) -> None:
    """TQ's controller and each storage unit are `num_cpus=1` actors (one in all when they share a
    process): with fewer free logical CPUs, `tq.init` waits forever for them to be placed."""
    if num_storage_units < 1:
        raise TQRuntimeError(f"num_storage_units must be >= 1, got {num_storage_units}")
    needed = 1 if one_process else 1 + num_storage_units
    if available_cpus < needed:
        what = (
            "1 process for its controller and storage unit"
            if one_process
            else f"1 controller + {num_storage_units} storage unit(s)"
        )
        raise TQRuntimeError(
            f"TransferQueue needs {needed} free logical Ray CPUs ({what}) but Ray has {available_cpus:g} "
            f"available; tq.init would hang silently. Give Ray more logical CPUs (ray.init(num_cpus=...); "
            f"these actors are mostly idle) or use fewer storage units."
        )


def start_tq(
    num_storage_units: int = 1,
    *,
    storage_capacity: int | None = None,
    timeout_s: float = 180.0,
    one_process: bool = True,
    on_spawned: Callable[[], None] | None = None,
) -> TQRuntimeInfo:
    """Create TQ (controller + `num_storage_units` SimpleStorage units) on the connected Ray.

    With one storage unit and `one_process` (`storage.tq_one_process`), the controller and the unit
    share one actor process (`replay.transferqueue.host`), created before this process imports
    TransferQueue, so both imports run at once; otherwise each is an actor of its own, as `tq.init`
    makes them.

    `on_spawned` is called once TQ's processes were asked for (before this process imports
    TransferQueue and torch), so a caller can start its other processes beside them.

    Idempotent within the creating process. Raises `TQRuntimeError` if Ray is not initialized, lacks
    CPUs, or another process already runs TQ on this cluster (use `attach_tq` there), and
    `DeadlineExceeded` if the start-up does not finish in `timeout_s` (what it started is killed).
    """
    global _owned
    _require_ray()
    import ray

    with _lock:
        if _owned is not None:
            if _owned.num_storage_units != num_storage_units:
                raise TQRuntimeError(
                    f"TransferQueue already started here with {_owned.num_storage_units} storage units, "
                    f"asked for {num_storage_units}"
                )
            if on_spawned is not None:
                on_spawned()
            return _owned
        if _controller() is not None:
            raise TQRuntimeError(
                "a TransferQueue controller already runs on this Ray cluster (started by another process): "
                "use attach_tq() / storage.attach=true"
            )
        one_process = one_process and num_storage_units == 1
        check_ray_cpus(num_storage_units, ray.available_resources().get("CPU", 0.0), one_process)
        conf = _tq_overrides(num_storage_units, storage_capacity)
        t0 = time.perf_counter()
        init = functools.partial(_init_tq_one_process if one_process else _init_tq, conf, on_spawned or _nothing)
        try:
            with _gets_off_the_loop():
                _call_with_deadline(init, timeout_s, f"tq.init({num_storage_units} storage units)")
        except BaseException:
            _kill_tq_actors(num_storage_units)
            shims.forget_tq_handles()
            raise
        _owned = TQRuntimeInfo(True, num_storage_units, time.perf_counter() - t0)
        log.info("replay/tq started: %d storage unit(s) in %.1fs", num_storage_units, _owned.startup_s)
        return _owned


def _nothing() -> None:
    pass


def _tq_overrides(num_storage_units: int, storage_capacity: int | None) -> dict:
    """What we set in TQ's config; the rest is its packaged default."""
    return {
        # KV API only; polling mode keeps a starving low-level fetch from stalling the controller.
        "controller": {"polling_mode": True},
        "backend": {
            "storage_backend": "SimpleStorage",
            "SimpleStorage": {"num_data_storage_units": num_storage_units, "total_storage_size": storage_capacity},
        },
        "metrics": {"enabled": False},
    }


def _init_tq(conf: dict, spawned: Callable[[], None] = _nothing) -> None:
    """TQ's own layout: `tq.init(conf)`, the controller and each storage unit a Ray actor of its own
    (created inside `tq.init`, after TransferQueue's import: `spawned` is called first)."""
    spawned()
    import_transfer_queue().init(conf)


def _init_tq_one_process(conf: dict, spawned: Callable[[], None] = _nothing) -> None:
    """TQ's controller and storage unit in one actor process (`replay.transferqueue.host`), registered
    under the controller's name, then made this process's TQ. The host is created before TransferQueue
    is imported here; an installed TransferQueue that is not laid out as the host needs falls back to
    `_init_tq`."""
    import ray

    host = (
        ray.remote(num_cpus=1)(tq_host.TransferQueueHost)
        .options(name=CONTROLLER_NAME, namespace=CONTROLLER_NAMESPACE)
        .remote(conf)
    )
    # runs once the host's servers are up and its config is stored
    # (Ray types an actor's methods as remote ones only when declared with @ray.method)
    config = host.get_config.remote()  # type: ignore[attr-defined]
    spawned()
    import_transfer_queue()
    if not tq_host.layout_supported():
        log.warning("replay/tq: this TransferQueue cannot share one process; starting its actors one by one")
        ray.kill(host)  # type: ignore[arg-type]  # Ray types ActorClass.remote() as handle | class
        while _controller() is not None:  # the name is free once the host is gone (milliseconds)
            time.sleep(0.05)
        _init_tq(conf)  # `spawned` was called for the host
        return
    shims.adopt_controller(host, ray.get(config))


@contextlib.contextmanager
def _gets_off_the_loop() -> Iterator[None]:
    """Our blocking Ray calls here run on a worker thread (callers in async actors use
    asyncio.to_thread), never on an event loop: Ray's one-time warning about `ray.get` inside an
    async actor would be a false alarm, printed into every run's console."""
    old = os.environ.get("RAY_WARN_BLOCKING_GET_INSIDE_ASYNC")
    os.environ["RAY_WARN_BLOCKING_GET_INSIDE_ASYNC"] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("RAY_WARN_BLOCKING_GET_INSIDE_ASYNC", None)
        else:
            os.environ["RAY_WARN_BLOCKING_GET_INSIDE_ASYNC"] = old


def attach_tq(timeout_s: float = 60.0) -> TQRuntimeInfo:
    """Connect this process's TQ client to the controller another process started (Ray workers,
    cluster mode). Never starts TQ. No-op if this process is already connected."""
    with _gets_off_the_loop():
        return _attach_tq(timeout_s)


def _attach_tq(timeout_s: float) -> TQRuntimeInfo:
    _require_ray()
    if _owned is not None:
        return _owned
    if client_connected():
        return TQRuntimeInfo(False, -1, 0.0)
    import ray

    tq = import_transfer_queue()
    t0 = time.perf_counter()
    controller = _controller()
    if controller is None:
        raise TQRuntimeError(
            f"no TransferQueue controller ({CONTROLLER_NAMESPACE}/{CONTROLLER_NAME}) on this Ray cluster: "
            "start it with replay.transferqueue.runtime.start_tq() in the driver first"
        )
    # The controller gets its config only at the end of tq.init: wait for it here, with a deadline
    # (tq.init() would poll it forever).
    while True:
        left = timeout_s - (time.perf_counter() - t0)
        if left <= 0:
            what = "the TransferQueue controller's config (is its creator still in tq.init?)"
            raise DeadlineExceeded(what, timeout_s)
        try:
            conf = ray.get(controller.get_config.remote(), timeout=left)
        except ray.exceptions.GetTimeoutError:
            continue
        if conf is not None:
            break
        time.sleep(min(0.2, max(left, 0.0)))
    left = max(timeout_s - (time.perf_counter() - t0), 0.1)
    _call_with_deadline(tq.init, left, "tq.init() attaching to the running controller")
    info = TQRuntimeInfo(False, -1, time.perf_counter() - t0)
    log.info("replay/tq attached in %.1fs", info.startup_s)
    return info


def stop_tq(timeout_s: float = 60.0) -> None:
    """Close TQ if this process created it, else drop this process's client. Idempotent; never raises
    for "nothing to stop" or "Ray already shut down" (safe in `finally:`)."""
    global _owned
    if "transfer_queue" not in sys.modules:
        return  # never used here
    import ray
    import transfer_queue as tq

    with _lock:
        owned, _owned = _owned, None
        if owned is not None and ray.is_initialized():
            try:
                with _gets_off_the_loop():
                    _call_with_deadline(tq.close, timeout_s, "tq.close()")
            except DeadlineExceeded:
                log.error("replay/tq: tq.close() timed out after %gs; killing TQ actors", timeout_s)
                _kill_tq_actors(owned.num_storage_units)
            shims.forget_tq_handles()
        else:
            # Attached (must not kill the shared controller), or Ray is gone (and TQ's actors with it):
            # drop this process's client only, so a later start/attach builds a fresh one.
            shims.drop_client()


def _kill_tq_actors(num_storage_units: int) -> None:
    """Best-effort kill of what a failed or hung tq.init/close may have left (this process created them)."""
    import ray

    if not ray.is_initialized():
        return
    handles = []
    for name, ns in [(CONTROLLER_NAME, CONTROLLER_NAMESPACE)] + [
        (STORAGE_UNIT_NAME.format(i), None) for i in range(num_storage_units)
    ]:
        try:
            handles.append(ray.get_actor(name, namespace=ns))
        except ValueError:
            pass
    for handle in handles:
        try:
            ray.kill(handle)
        except Exception as e:
            log.warning("replay/tq: ray.kill of a TQ actor failed: %r", e)
