"""Start, attach to and stop TransferQueue (TQ) on a Ray cluster.

Contract:
  * `configure_env()` must run before `ray` or `transfer_queue` is imported: both read their knobs
    at import time (`TQ_NUM_THREADS`, `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`), and Ray workers inherit
    the driver's environment when `ray.init` starts a local cluster. It only sets variables the user
    has not set. `replay.transferqueue.storage` calls it on import, so importing that module first is enough.
  * `start_tq()` (embedded mode) creates the TQ controller and storage units on the Ray this
    process is connected to. It refuses, with a clear error, to start when Ray lacks the logical
    CPUs TQ reserves (`tq.init` would otherwise hang forever, printing nothing), and puts a
    deadline on `tq.init` itself.
  * `attach_tq()` (cluster mode, and every worker process) connects this process's TQ client to a
    controller some other process started, with a deadline; it never starts one.
  * `stop_tq()` is idempotent and safe in `finally:`. Only the process that created TQ closes it
    (`tq.close()` in any other process kills the shared controller, after which every client hangs
    forever); elsewhere it only drops this process's client. `ray.shutdown()` after `stop_tq()`
    leaves no TQ process behind.

Ray is imported lazily so that importing this module does not freeze Ray's environment.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.abc
import importlib.util
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, TypeVar

from single_controller.config.schema import StorageConfig, TimeoutConfig
from single_controller.deadlines import DeadlineExceeded

log = logging.getLogger(__name__)

T = TypeVar("T")

CONTROLLER_NAME = "TransferQueueController"
CONTROLLER_NAMESPACE = "transfer_queue"
STORAGE_UNIT_NAME = "TransferQueueStorageUnit#{}"  # in the creating driver's namespace


class TQRuntimeError(RuntimeError):
    """TransferQueue could not be started, attached to, or stopped."""


@dataclass(frozen=True)
class TQRuntimeInfo:
    created: bool  # True: this process started TQ (and is the only one allowed to close it)
    num_storage_units: int  # storage units of the running TQ (-1: unknown, attached)
    startup_s: float  # seconds `start_tq` / `attach_tq` took


# Process-local state: whether this process created the running TQ.
_lock = threading.Lock()
_owned: TQRuntimeInfo | None = None


def default_num_threads() -> int:
    """TQ compares its thread target with the *physical* core count and warns on every call above it."""
    import psutil

    physical = psutil.cpu_count(logical=False) or 1
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count() or 1
    return max(1, min(physical, usable, 16))


def configure_env(num_threads: int | None = None) -> dict[str, str]:
    """Set TQ's and Ray's environment knobs (only those not already set); returns the values in effect.

    * `TQ_NUM_THREADS=<cores>`: otherwise TQ logs a thread warning on every put/get, in every process.
    * `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` (only before ray is imported): Ray (and so TQ's ZMQ sockets, which carry pickles) binds
      to 127.0.0.1 instead of the first NIC.
    """
    wanted = {"TQ_NUM_THREADS": str(num_threads if num_threads is not None else default_num_threads())}
    if "ray" not in sys.modules:  # it only matters before Ray starts; a Ray worker has its node's address
        wanted["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    newly_set = [name for name in wanted if name not in os.environ]
    for name in newly_set:
        os.environ[name] = wanted[name]
    late = [m for m in ("ray", "transfer_queue") if m in sys.modules]
    if newly_set and late:
        log.warning(
            "replay.transferqueue.runtime.configure_env() set %s after importing %s: this process keeps the old "
            "values (call it before importing ray)",
            newly_set,
            late,
        )
    return {name: os.environ[name] for name in wanted}


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


def client_connected() -> bool:
    """Whether this process has a TQ client (after `start_tq` / `attach_tq`)."""
    tq = import_transfer_queue()

    try:
        tq.get_client()
    except AssertionError:
        return False
    return True


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
        what = "1 process for its controller and storage unit" if one_process else f"1 controller + {num_storage_units} storage unit(s)"
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
) -> TQRuntimeInfo:
    """Create TQ (controller + `num_storage_units` SimpleStorage units) on the connected Ray.

    With one storage unit and `one_process` (`storage.tq_one_process`), the controller and the unit
    share one actor process (`replay.transferqueue.host`), created before this process imports TransferQueue,
    so both imports run at once; otherwise each is an actor of its own, as `tq.init` makes them.

    Idempotent within the creating process. Raises `TQRuntimeError` if Ray is not initialized, lacks
    CPUs, or another process already runs TQ on this cluster (use `attach_tq` there), and
    `DeadlineExceeded` if `tq.init` does not finish in `timeout_s` (what it started is killed).
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
            return _owned
        if _controller() is not None:
            raise TQRuntimeError(
                "a TransferQueue controller already runs on this Ray cluster (started by another process): "
                "use attach_tq() / storage.attach=true"
            )
        one_process = one_process and num_storage_units == 1
        check_ray_cpus(num_storage_units, ray.available_resources().get("CPU", 0.0), one_process)

        conf = {
            # KV API only; polling mode keeps a starving low-level fetch from stalling the controller.
            "controller": {"polling_mode": True},
            "backend": {
                "storage_backend": "SimpleStorage",
                "SimpleStorage": {"num_data_storage_units": num_storage_units, "total_storage_size": storage_capacity},
            },
            "metrics": {"enabled": False},
        }
        t0 = time.perf_counter()
        try:
            with _gets_off_the_loop():
                init = _init_tq_one_process if one_process else _init_tq
                _call_with_deadline(lambda: init(conf), timeout_s, f"tq.init({num_storage_units} storage units)")
        except BaseException:
            _kill_tq_actors(num_storage_units)
            _reset_tq_globals()
            raise
        _owned = TQRuntimeInfo(True, num_storage_units, time.perf_counter() - t0)
        log.info("replay/tq started: %d storage unit(s) in %.1fs", num_storage_units, _owned.startup_s)
        return _owned


def import_transfer_queue() -> Any:
    """`import transfer_queue` (after `configure_env()`), with tensordict imported without
    `torch._dynamo` (see `without_dynamo_at_import`)."""
    if "transfer_queue" in sys.modules:
        return sys.modules["transfer_queue"]
    configure_env()
    without_dynamo_at_import()
    import transfer_queue

    cheaper_thread_limiter()
    return transfer_queue


# TransferQueue's modules that bind its thread limiter by name (0.1.11).
_THREAD_LIMITER_USERS = ("transfer_queue.client", "transfer_queue.storage.simple_storage")


def _thread_limiter(physical_cores: int) -> Callable[..., Any]:
    """TransferQueue's `limit_pytorch_auto_parallel_threads`, with the physical core count read once."""
    import torch
    import transfer_queue.utils.common as tq_common

    @contextlib.contextmanager
    def limit_pytorch_auto_parallel_threads(target_num_threads: int | None = None, info: str = "") -> Iterator[None]:
        target = min(physical_cores, 16) if target_num_threads is None else target_num_threads
        if target > physical_cores:
            log.warning("%s: %d torch threads asked for, more than the %d physical cores; using %d", info, target, physical_cores, physical_cores)
            target = physical_cores
        torch.set_num_threads(target)
        try:
            yield
        finally:
            torch.set_num_threads(tq_common.DEFAULT_TORCH_NUM_THREADS)

    limit_pytorch_auto_parallel_threads.sc_grpo = True  # type: ignore[attr-defined]
    return limit_pytorch_auto_parallel_threads


def cheaper_thread_limiter() -> list[str]:
    """Give TransferQueue a thread limiter that reads the core count once; returns the modules changed.

    TransferQueue 0.1.11 wraps every client put and get, and every storage unit's put, get and clear,
    in `limit_pytorch_auto_parallel_threads`: torch's thread count set to `TQ_NUM_THREADS` for the
    block and back after. Each time, it first asks psutil for the physical core count, which reads
    sysfs, and formats two debug messages: ~70 us of CPU on this project's machine, 6-8 times per
    step of the embedded run, in the trainer and generation workers among others. The replacement
    does the same thread changes (~0.2 us) with the count psutil gave once. Called by
    `import_transfer_queue`; idempotent; a TransferQueue without the limiter is left as it is."""
    modules = [sys.modules.get(name) for name in _THREAD_LIMITER_USERS]
    todo = [
        m for m in modules
        if m is not None and hasattr(m, "limit_pytorch_auto_parallel_threads") and not getattr(m.limit_pytorch_auto_parallel_threads, "sc_grpo", False)
    ]
    if not todo:
        return []
    import psutil

    limiter = _thread_limiter(psutil.cpu_count(logical=False) or 1)
    for module in todo:
        module.limit_pytorch_auto_parallel_threads = limiter
    return [m.__name__ for m in todo]


@contextlib.contextmanager
def _compiler_wrappers_as_identity() -> Iterator[None]:
    import torch.compiler as compiler

    if "torch._dynamo" in sys.modules:  # already paid for: nothing to save
        yield
        return
    saved = compiler.allow_in_graph, compiler.assume_constant_result
    compiler.allow_in_graph = compiler.assume_constant_result = _identity  # type: ignore[assignment]
    try:
        yield
    finally:
        compiler.allow_in_graph, compiler.assume_constant_result = saved


def _identity(fn: T) -> T:
    return fn


class _TensordictLoader(importlib.abc.Loader):
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        _restore_loader(module, self.inner)
        with _compiler_wrappers_as_identity():
            self.inner.exec_module(module)


def _restore_loader(module: Any, loader: Any) -> None:
    """The module keeps its own loader (`importlib.resources` and friends ask it for files), not our wrapper."""
    module.__loader__ = loader
    if getattr(module, "__spec__", None) is not None:
        module.__spec__.loader = loader


class _TensordictFinder(importlib.abc.MetaPathFinder):
    """Finds `tensordict` once, with a loader that runs its import under `_compiler_wrappers_as_identity`."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "tensordict":
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _TensordictLoader(spec.loader)
        return spec


def without_dynamo_at_import() -> None:
    """Make the first `import tensordict` of this process skip `torch._dynamo` (1.3-1.6 s of CPU in
    every process that imports TransferQueue: its controller and storage units, our controller, every
    worker; on two cores, most of a run's start-up was this).

    tensordict wraps a few functorch functions with `torch.compiler.allow_in_graph` and
    `assume_constant_result` at import time, and both import all of Dynamo. Those wrappers only matter
    when tensordict code runs under `torch.compile`, which nothing of TQ does: while tensordict's
    modules execute they are identity functions, and `torch.compiler` is restored right after. Costs
    nothing until tensordict is imported (torch is not imported here); a no-op once it is, or when
    Dynamo is already loaded."""
    if "tensordict" in sys.modules or any(isinstance(f, _TensordictFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _TensordictFinder())


# Longest the cyclic collector stays paused in a worker process that never imports TransferQueue.
GC_PAUSE_MAX_S = 60.0
_gc_pause_lock = threading.Lock()
_gc_paused = False


def pause_gc_until_transfer_queue(max_s: float = GC_PAUSE_MAX_S) -> bool:
    """Pause the cyclic garbage collector while this process imports its start-up modules; resume it
    (`resume_gc`) as soon as `transfer_queue` has been imported, or after `max_s` at the latest.

    Importing torch and TransferQueue allocates ~200k long-lived objects; with the collector on, its
    collections walk them again and again (~0.3 s of CPU per process here, ~12 % of the import). On
    two cores, a run's five Python processes start side by side and start-up is CPU-bound. When it
    resumes, the collector first sets those objects aside for good (`gc.freeze`), so later full
    collections in the process skip them too. Nothing is imported here. Returns whether it paused
    (not when the collector is already off, or `transfer_queue` is already imported)."""
    global _gc_paused
    with _gc_pause_lock:
        if _gc_paused or not gc.isenabled() or "transfer_queue" in sys.modules:
            return False
        _gc_paused = True
        gc.disable()
    sys.meta_path.insert(0, _AfterImportFinder("transfer_queue", resume_gc))
    timer = threading.Timer(max_s, resume_gc)
    timer.daemon = True
    timer.start()
    return True


def resume_gc() -> None:
    """End the pause of `pause_gc_until_transfer_queue` (idempotent; a no-op without one)."""
    global _gc_paused
    with _gc_pause_lock:
        if not _gc_paused:
            return
        _gc_paused = False
        gc.freeze()
        gc.enable()


class _AfterImportLoader(importlib.abc.Loader):
    def __init__(self, inner: Any, then: Callable[[], None]) -> None:
        self.inner, self.then = inner, then

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        _restore_loader(module, self.inner)
        try:
            self.inner.exec_module(module)
        finally:
            self.then()


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    """Finds module `name` once, with a loader that calls `then()` when its import has ended."""

    def __init__(self, name: str, then: Callable[[], None]) -> None:
        self.name, self.then = name, then

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != self.name:
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _AfterImportLoader(spec.loader, self.then)
        else:
            self.then()
        return spec


def worker_process_setup() -> None:
    """Ray `worker_process_setup_hook` of our runs (`ray_runtime.ray_session(setup_hook=...)`): runs in
    every worker process before its actor class is loaded, TQ's own actors included, so TransferQueue
    comes in without Dynamo there too (`without_dynamo_at_import`), with the cyclic collector paused
    until it has (`pause_gc_until_transfer_queue`). Nothing is imported here."""
    without_dynamo_at_import()
    pause_gc_until_transfer_queue()


# What `_init_tq` needs from TQ's interface module; `tq.init` itself is used when any is missing.
_INIT_INTERNALS = (
    "_TQ_CONTROLLER",
    "_TQ_STORAGE",
    "_maybe_create_tq_client",
    "TransferQueueController",
    "StorageBootstrapProvider",
    "process_zmq_server_info",
)


def full_tq_config(overrides: dict) -> Any:
    """TransferQueue's default config with `overrides` merged in, as `tq.init` builds it."""
    from importlib import resources

    from omegaconf import OmegaConf

    return OmegaConf.merge(
        OmegaConf.create({}, flags={"allow_objects": True}),
        OmegaConf.load(resources.files("transfer_queue") / "config.yaml"),
        overrides,
    )


def tq_sampler_class(final: Any) -> type | None:
    """The sampler class a full TQ config names (`controller.sampler`, one of TQ's), or None."""
    import transfer_queue.interface as tqi

    name = final.controller.sampler
    cls = getattr(tqi, name, None) if isinstance(name, str) else None
    return cls if isinstance(cls, type) else None


def _init_tq(conf: dict) -> None:
    """`tq.init(conf)` with its controller and storage units starting at the same time.

    `tq.init` waits for the controller's process to be up before it creates the storage units, so two
    actor start-ups (each a Python process importing torch and TQ, ~2.5 s on two cores) run one after
    the other. The storage units need nothing from the controller, and the controller gets the
    storage units' addresses only with the config stored at the end: here both are created first and
    waited for together; the rest is what `tq.init` does (config stored on the controller, this
    process's client). Checked against TransferQueue 0.1.11; any other layout falls back to `tq.init`."""
    import ray

    tq = import_transfer_queue()
    import transfer_queue.interface as tqi
    if not all(hasattr(tqi, name) for name in _INIT_INTERNALS) or tqi._TQ_CONTROLLER is not None:
        tq.init(conf)
        return
    final = full_tq_config(conf)
    sampler_cls = tq_sampler_class(final)
    provider = tqi.StorageBootstrapProvider.get_provider(final.backend.storage_backend)
    if sampler_cls is None or provider is None or final.metrics.enabled:
        tq.init(conf)
        return
    controller = tqi.TransferQueueController.options(name=CONTROLLER_NAME, namespace=CONTROLLER_NAMESPACE).remote(
        sampler=sampler_cls(), polling_mode=final.controller.polling_mode
    )
    tqi._TQ_CONTROLLER = controller
    # creates the units and waits for their addresses while the controller's process starts
    tqi._TQ_STORAGE = {final.backend.storage_backend: provider(final)}
    final.controller.zmq_info = tqi.process_zmq_server_info(controller)
    ray.get(controller.store_config.remote(final))
    tqi._maybe_create_tq_client(final)


def _init_tq_one_process(conf: dict) -> None:
    """TQ's controller and storage unit in one actor process (`replay.transferqueue.host.TransferQueueHost`),
    registered under the controller's name, then this process's client: what `tq.init` ends with.
    The host is created before TransferQueue is imported here; an installed TransferQueue that is
    not laid out as the host needs falls back to `_init_tq`."""
    import ray

    from replay.transferqueue.host import TransferQueueHost, layout_supported

    host = (
        ray.remote(num_cpus=1)(TransferQueueHost)
        .options(name=CONTROLLER_NAME, namespace=CONTROLLER_NAMESPACE)
        .remote(conf)
    )
    config = host.get_config.remote()  # runs once the host's servers are up and its config is stored
    import_transfer_queue()
    import transfer_queue.interface as tqi

    if not layout_supported() or tqi._TQ_CONTROLLER is not None:
        log.warning("replay/tq: this TransferQueue cannot share one process; starting its actors one by one")
        ray.kill(host)
        while _controller() is not None:  # the name is free once the host is gone (milliseconds)
            time.sleep(0.05)
        _init_tq(conf)
        return
    final = ray.get(config)
    tqi._TQ_CONTROLLER = host
    # `tq.close()` asks each storage handle to shut down, then kills it (and the controller's handle)
    tqi._TQ_STORAGE = {"SimpleStorage": {"host": host}}
    tqi._maybe_create_tq_client(final)


@contextlib.contextmanager
def _gets_off_the_loop():
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
            raise DeadlineExceeded("the TransferQueue controller's config (is its creator still in tq.init?)", timeout_s)
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
            _reset_tq_globals()
        else:
            # Attached (must not kill the shared controller), or Ray is gone (and TQ's actors with it):
            # drop this process's client only, so a later start/attach builds a fresh one.
            _drop_client()


def attach_tq_storage(partition: str, timeout_s: float, group_rows: bool = False):  # -> TQRowStorage
    """`TQRowStorage.attach(partition, timeout_s=..., group_rows=...)`, importable without importing
    TQ: a worker's storage factory, pickled by reference, so the controller can start workers before
    it imports TQ."""
    from replay.transferqueue.storage import TQRowStorage

    return TQRowStorage.attach(partition, timeout_s=timeout_s, group_rows=group_rows)


def open_tq_storage(cfg: StorageConfig, timeouts: TimeoutConfig, partition: str | None = None):  # -> TQRowStorage
    """Start or attach (per `cfg.attach`) and return the row storage of `partition` (default
    `cfg.partition`; a run passes its own, `<cfg.partition>-<run id>`)."""
    if cfg.attach:
        attach_tq(timeouts.setup_s)
    else:
        start_tq(cfg.num_storage_units, timeout_s=timeouts.setup_s, one_process=cfg.tq_one_process)
    from replay.transferqueue.storage import TQRowStorage  # imports TransferQueue: after TQ's processes were created

    return TQRowStorage(partition or cfg.partition, timeout_s=timeouts.storage_s, group_rows=cfg.pack_groups)


def _drop_client() -> None:
    import transfer_queue.interface as tqi

    client = getattr(tqi, "_TQ_CLIENT", None)
    if client is not None:
        try:
            client.close()
        except Exception as e:  # best effort: the peers may already be gone
            log.warning("replay/tq: closing the TQ client failed: %r", e)
    _reset_tq_globals()


def _reset_tq_globals() -> None:
    """Forget TQ's process-wide handles (TQ keeps them in module globals and would reuse stale ones
    after a failed init or a Ray restart)."""
    import transfer_queue.interface as tqi

    for name in ("_TQ_CLIENT", "_TQ_STORAGE", "_TQ_CONTROLLER"):
        if hasattr(tqi, name):
            setattr(tqi, name, None)


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
