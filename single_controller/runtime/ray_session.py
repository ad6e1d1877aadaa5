"""Ray's lifetime for one run: start (or attach), interrupt handling, and a shutdown that leaves nothing.

`ray_session(cfg, min_cpus=...)` sets Ray's and TQ's environment before importing ray, starts a
local Ray (loopback, no dashboard) or attaches to `cfg.address`, and on any exit shuts Ray down and
kills what is left of this session's processes (never another session's; nothing when attached).
The first SIGINT / SIGTERM stops the run cleanly; a second, or `grace_s` later, kills the session
and exits 130. `worker_env` gives worker thread counts; `new_event_loop()` is the loop Ray gives an
async actor (uvloop when installed), used wherever this process makes the controller's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import psutil

from single_controller.config.schema import RayConfig
from single_controller.runtime.console import say

__all__ = ["RaySession", "ray_session", "worker_env", "prepare_environment", "new_event_loop", "DEFAULT_GRACE_S"]

T = TypeVar("T")
log = logging.getLogger(__name__)

WORKER_SETUP_HOOK = "replay.transferqueue.shims.install_shims"
DEFAULT_GRACE_S = 25.0  # first interrupt -> forced exit after this long; keeps Ctrl-C under 30 s
_WAIT_EXIT_S = 5.0  # after ray.shutdown, how long the session's processes get to exit on their own
_TERM_S = 2.0  # SIGTERM -> SIGKILL for stragglers
_EXIT_INTERRUPTED = 130


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A fresh event loop of the kind Ray runs async actors on (see the module docstring)."""
    if os.environ.get("RAY_USE_UVLOOP", "true").lower() in ("true", "1"):  # Ray's own reading of it
        try:
            import uvloop
        except ImportError:  # Windows, or an install without it
            pass
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


class RayUnreachable(ConnectionError):
    """Nothing answers at the Ray address given (`ray.address`, `--address`): said at once, where
    `ray.init` would retry for minutes."""


def check_ray_address(address: str | None, timeout_s: float = 5.0) -> None:
    """Raise `RayUnreachable` when `address` is HOST:PORT and nothing accepts a connection there
    (Ray's GCS port). Other forms (`auto`, `ray://...`, None: a local Ray) are left to `ray.init`."""
    import socket

    if not address or "://" in address or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise RayUnreachable(
            f"nothing answers at the Ray address {address} ({e.strerror or e}); start the cluster's head there "
            "(`ray start --head --port PORT`) or fix the address"
        ) from None


def prepare_environment(*, local: bool = True) -> None:
    """Environment Ray and TransferQueue read at import/start; must run before `import ray`.

    `local`: this process starts its own one-node Ray, which then stays on the loopback
    (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`). A driver attaching to a cluster leaves that alone:
    with it, Ray takes 127.0.0.1 for the driver's node IP and cannot find its raylet among nodes
    on a real network address (and `ray start --address` refuses to add a node)."""
    if local:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("TQ_NUM_THREADS", str(os.cpu_count() or 1))
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def worker_env(torch_threads: int) -> dict[str, str]:
    """Thread-pool sizes for a worker process (`backend.torch_threads`): every BLAS/OpenMP runtime
    torch may use reads one of these at start, so oversubscription is avoided from the first op."""
    n = str(int(torch_threads))
    return {
        "OMP_NUM_THREADS": n,
        "MKL_NUM_THREADS": n,
        "OPENBLAS_NUM_THREADS": n,
        "NUMEXPR_NUM_THREADS": n,
        "VECLIB_MAXIMUM_THREADS": n,
    }


# ----------------------------------------------------------------------------------------------
# Which processes belong to this session


@dataclass
class _Tracker:
    """Remembers the session's processes so that shutdown can verify they are all gone."""

    owned: bool  # we started the cluster: its processes are ours to clean up
    driver: psutil.Process = field(default_factory=psutil.Process)
    session_dir: str | None = None
    raylet_pids: set[int] = field(default_factory=set)
    known: dict[int, psutil.Process] = field(default_factory=dict)

    def _ray_descendants(self) -> list[psutil.Process]:
        # only Ray's: a subprocess the run started for itself is not ours to kill
        return [p for p in self.driver.children(recursive=True) if _is_ray_process(p)]

    def record(self) -> None:
        for p in self._ray_descendants():
            self.known.setdefault(p.pid, p)
            with contextlib.suppress(psutil.Error):
                if p.name() == "raylet":
                    self.raylet_pids.add(p.pid)

    def live(self) -> list[psutil.Process]:
        """Ray processes among our descendants, those recorded earlier (even if reparented since),
        and orphaned workers of our raylet."""
        found: dict[int, psutil.Process] = {}
        for p in list(self.known.values()) + self._ray_descendants():
            if p.pid != self.driver.pid and _alive(p):
                found[p.pid] = p
        if self.owned:
            for p in self._orphans():
                found.setdefault(p.pid, p)
        return list(found.values())

    def _orphans(self) -> Iterator[psutil.Process]:
        """Workers reparented away from us (their raylet died first), matched by what ties them to
        this session: `RAY_RAYLET_PID` of our raylet, or log files open in our session directory."""
        if not self.raylet_pids and not self.session_dir:
            return
        uid = os.getuid()
        for p in psutil.process_iter(["pid", "name", "uids"]):
            try:
                if p.pid == self.driver.pid or p.info["uids"] is None or p.info["uids"].real != uid:
                    continue
                if not _is_ray_process(p):
                    continue
                env_raylet = p.environ().get("RAY_RAYLET_PID")
                if env_raylet is not None and int(env_raylet) in self.raylet_pids:
                    yield p
                elif self.session_dir and any(f.path.startswith(self.session_dir + os.sep) for f in p.open_files()):
                    yield p
            except (psutil.Error, ValueError, OSError):
                continue

    def kill_all(self, sig: int = signal.SIGKILL) -> list[psutil.Process]:
        procs = self.live()
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.send_signal(sig)
        return procs


_RAY_BINARIES = ("raylet", "gcs_server", "plasma_store", "redis-server")
_RAY_PACKAGE_PART = f"{os.sep}ray{os.sep}"


def _is_ray_process(p: psutil.Process) -> bool:
    """A Ray worker (`ray::...`, or not yet titled), a Ray binary, or a script of the ray package."""
    try:
        name = p.name()
        if name.startswith("ray::") or name in _RAY_BINARIES:
            return True
        if any(_RAY_PACKAGE_PART in arg for arg in p.cmdline()[:4]):
            return True
        return "RAY_RAYLET_PID" in p.environ()
    except (psutil.Error, OSError):
        return False


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


# ----------------------------------------------------------------------------------------------
# Interrupts


class _Interrupts:
    """SIGINT/SIGTERM policy: first -> clean stop, second (or grace expired) -> forced exit."""

    def __init__(self, grace_s: float, tracker: _Tracker | None):
        self.grace_s = grace_s
        self.count = 0
        self.cleaning = False  # in the session's own shutdown: do not interrupt it, only force
        self.main_task: asyncio.Task | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.graceful: Callable[[str], None] | None = None  # first interrupt: ask the run to stop itself
        self._tracker = tracker  # the processes a forced exit kills (None: borrowed, kill nothing)
        self._saved: dict[int, Any] = {}
        self._watchdog: threading.Timer | None = None
        self.enabled = threading.current_thread() is threading.main_thread()

    def install(self, *signums: int) -> None:
        if not self.enabled:
            return
        for s in signums:
            previous = signal.signal(s, self._handle)
            self._saved.setdefault(s, previous)

    def restore(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        for s, previous in self._saved.items():
            signal.signal(s, previous if previous is not None else signal.SIG_DFL)
        self._saved.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        self.count += 1
        name = signal.Signals(signum).name
        if self.count >= 2:
            self.force(f"second interrupt ({name})")
        self._watchdog = threading.Timer(
            self.grace_s, self.force, args=(f"still running {self.grace_s:g}s after {name}",)
        )
        self._watchdog.daemon = True
        self._watchdog.start()
        if self.cleaning:
            say(f"{name}: already shutting down Ray (interrupt again to force)", err=True)
            return
        task, loop = self.main_task, self.loop
        if self.graceful is not None and loop is not None and task is not None and not task.done():
            # The run stops itself on its last finished step and checkpoints it; the watchdog
            # above still forces an exit if that takes longer than the grace period.
            loop.call_soon_threadsafe(self.graceful, name)
            return
        say(f"{name}: stopping the run cleanly (interrupt again to force)", err=True)
        if task is not None and loop is not None and not task.done():
            # Like asyncio.Runner: we run in the loop's thread between two bytecodes, so cancel the
            # main task directly and wake the selector so the loop sees it.
            task.cancel()
            loop.call_soon_threadsafe(lambda: None)
            return
        raise KeyboardInterrupt

    def force(self, why: str) -> None:
        tracker = self._tracker
        killed = tracker.kill_all(signal.SIGKILL) if tracker is not None and tracker.owned else []
        say(f"forced exit: {why}; killed {len(killed)} Ray process(es)", err=True)
        os._exit(_EXIT_INTERRUPTED)


# ----------------------------------------------------------------------------------------------
# The session


@dataclass
class RaySession:
    """A started (or attached, or borrowed) Ray; `run(coro)` runs the controller's main coroutine."""

    address: str | None
    num_cpus: int | None
    owned: bool  # started by this session (so shut down and cleaned by it)
    session_dir: str | None
    _interrupts: _Interrupts = field(repr=False)
    _tracker: _Tracker = field(repr=False)

    @property
    def interrupted(self) -> bool:
        return self._interrupts.count > 0

    def on_interrupt(self, stop: Callable[[str], None]) -> None:
        """Call `stop(signal name)` on the run's loop at the first SIGINT/SIGTERM instead of
        cancelling the run (a second one, or the grace period, still forces the exit)."""
        self._interrupts.graceful = stop

    def processes(self) -> list[psutil.Process]:
        """The live processes of this session (empty when attached or borrowed)."""
        return self._tracker.live() if self.owned else []

    def run(self, main: Coroutine[Any, Any, T]) -> T:
        """Run `main` on a fresh event loop; the first interrupt cancels it (then KeyboardInterrupt
        is raised here, as `asyncio.run` does), so its TaskGroup and teardown run normally."""
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            loop = runner.get_loop()
            task = loop.create_task(main)
            self._interrupts.main_task, self._interrupts.loop = task, loop
            try:
                return loop.run_until_complete(task)
            except asyncio.CancelledError:
                if self._interrupts.count > 0:
                    raise KeyboardInterrupt from None
                raise
            finally:
                self._interrupts.main_task = self._interrupts.loop = None


@contextlib.contextmanager
def ray_session(
    cfg: RayConfig,
    *,
    min_cpus: int,
    log_to_driver: bool = True,
    env_vars: Mapping[str, str] | None = None,
    namespace: str | None = "sc-grpo",
    grace_s: float = DEFAULT_GRACE_S,
    setup_hook: str | None = WORKER_SETUP_HOOK,
) -> Iterator[RaySession]:
    """Start a local Ray (or attach to `cfg.address`) for the body; see the module docstring.

    `min_cpus`: logical CPUs the run needs (TQ storage units + workers + controller); a local Ray gets
    `cfg.num_cpus` or max(min_cpus, os.cpu_count()). `env_vars` go to every worker (`runtime_env`),
    e.g. `worker_env(cfg.backend.torch_threads)`. A run passes `log_to_driver=False`: its workers'
    output goes to files in its run directory (`backends.common.worker_logs`), not to the console.
    `setup_hook` ("module.function") runs in every worker process before its actor class loads (Ray's
    `worker_process_setup_hook`); by default TransferQueue is imported there without torch._dynamo,
    and with the cyclic collector paused until it is in (`replay.transferqueue.shims.install_shims`).
    A local Ray starts no idle "prestarted" workers: every process of a run is an actor with its own
    runtime environment, so they were never used and only took CPU while the run started. Nor, unless
    `cfg.ray_observability`, does it keep Ray's own task events, metrics and event-loop statistics
    (CPU per step in the raylet, the GCS and Ray's metrics agent, docs/performance.md; nothing of
    ours reads them).
    """
    prepare_environment(local=cfg.address is None)
    import ray

    if ray.is_initialized():  # someone else owns it (e.g. a test fixture): borrow, never shut down
        with _borrowed(grace_s) as session:
            yield session
        return

    check_ray_address(cfg.address)
    owned = cfg.address is None
    tracker = _Tracker(owned=owned)
    interrupts = _Interrupts(grace_s, tracker)
    kwargs = _init_args(cfg, min_cpus, log_to_driver, env_vars, namespace, setup_hook)
    interrupts.install(signal.SIGINT, signal.SIGTERM)
    try:
        try:
            log.info("starting Ray: %s", kwargs if owned else f"attaching to {cfg.address}")
            context = ray.init(**kwargs)
        finally:
            tracker.record()  # even a half-started cluster is cleaned up below
        # ray.init installs its own SIGTERM handler (exit without cancelling the run): put ours back
        interrupts.install(signal.SIGTERM)
        if owned:
            tracker.session_dir = _session_dir(ray)
            log.info("Ray session directory %s", tracker.session_dir)
        address = getattr(context, "address_info", {}).get("gcs_address") or cfg.address
        yield RaySession(address, kwargs.get("num_cpus"), owned, tracker.session_dir, interrupts, tracker)
    finally:
        interrupts.cleaning = True
        try:
            _shutdown(ray, tracker)
        finally:
            interrupts.restore()


@contextlib.contextmanager
def _borrowed(grace_s: float) -> Iterator[RaySession]:
    """A session over a Ray this process did not start: interrupts handled, nothing shut down."""
    interrupts = _Interrupts(grace_s, None)
    interrupts.install(signal.SIGINT)
    try:
        yield RaySession(None, None, False, None, interrupts, _Tracker(owned=False))
    finally:
        interrupts.restore()


def _init_args(
    cfg: RayConfig,
    min_cpus: int,
    log_to_driver: bool,
    env_vars: Mapping[str, str] | None,
    namespace: str | None,
    setup_hook: str | None,
) -> dict[str, Any]:
    """`ray.init`'s arguments for `ray_session` (see its docstring)."""
    kwargs: dict[str, Any] = dict(log_to_driver=log_to_driver, logging_level=logging.WARNING)
    if namespace is not None:
        kwargs["namespace"] = namespace
    runtime_env: dict[str, Any] = {}
    if env_vars:
        runtime_env["env_vars"] = dict(env_vars)
    if setup_hook:
        runtime_env["worker_process_setup_hook"] = setup_hook
    if runtime_env:
        kwargs["runtime_env"] = runtime_env
    if cfg.address is not None:
        kwargs["address"] = cfg.address
        return kwargs
    system: dict[str, bool | int] = {"enable_worker_prestart": False, "prestart_worker_first_driver": False}
    if not cfg.ray_observability:
        system.update(enable_metrics_collection=False, task_events_report_interval_ms=0, event_stats=False)
    num_cpus = cfg.num_cpus or max(min_cpus, os.cpu_count() or 1)
    kwargs.update(num_cpus=num_cpus, include_dashboard=False, _system_config=system)
    return kwargs


def _session_dir(ray: Any) -> str | None:
    """The local session's directory (where Ray keeps its own logs), if Ray says."""
    try:
        return ray._private.worker._global_node.get_session_dir_path()
    except Exception:  # a private API: its absence costs only the orphan search by open log files
        return None


def _shutdown(ray: Any, tracker: _Tracker) -> None:
    """ray.shutdown(), then wait for the session's processes to exit; kill what does not."""
    if tracker.owned:
        tracker.record()  # workers started since the last look are still our descendants now
    before = tracker.live() if tracker.owned else []
    try:
        ray.shutdown()
    except Exception as e:  # keep going: the processes must go regardless
        log.warning("ray.shutdown() failed (%s: %s); killing its processes", type(e).__name__, e)
    if not tracker.owned:
        return
    deadline = time.monotonic() + _WAIT_EXIT_S
    _, alive = psutil.wait_procs(before, timeout=_WAIT_EXIT_S)
    stragglers = {p.pid: p for p in alive if _alive(p)}
    # anything that appeared meanwhile (or was orphaned by the raylet's exit) gets the rest of the wait
    for p in tracker.live():
        stragglers.setdefault(p.pid, p)
    if stragglers:
        _, alive = psutil.wait_procs(list(stragglers.values()), timeout=max(0.0, deadline - time.monotonic()))
        stragglers = {p.pid: p for p in alive if _alive(p)}
    if not stragglers:
        return
    names = ", ".join(sorted({_name(p) for p in stragglers.values()}))
    # routine for a vLLM engine (its engine core exits after its actor): said with -v, not as a warning
    log.info("%d Ray process(es) outlived ray.shutdown(); terminating: %s", len(stragglers), names)
    for sig, wait in ((signal.SIGTERM, _TERM_S), (signal.SIGKILL, _TERM_S)):
        for p in stragglers.values():
            with contextlib.suppress(psutil.Error):
                p.send_signal(sig)
        _, alive = psutil.wait_procs(list(stragglers.values()), timeout=wait)
        stragglers = {p.pid: p for p in alive if _alive(p)}
        if not stragglers:
            return
    log.warning("could not kill: %s", ", ".join(f"{_name(p)} (pid {p.pid})" for p in stragglers.values()))


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.Error:
        return f"pid {p.pid}"
