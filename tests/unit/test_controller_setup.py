"""The controller's start-up order (`ControllerHost._ray_workers`), with TransferQueue and the worker
starters replaced by recorders: no Ray, no TQ, no torch import."""

from __future__ import annotations

import threading
import time

import replay.transferqueue.factory as tq_factory
import single_controller.backends.registry as registry
from single_controller.config.schema import Config
from single_controller.runtime.actor_host import ControllerHost


async def test_the_storage_thread_imports_nothing_while_the_controller_imports_the_worker_starters(monkeypatch):
    """Two threads importing at once can find a module missing (CPython bpo-38884; once in a CI suite,
    `No module named 'single_controller.backends.common.weight_broadcast'` on a resume). TQ's
    processes are still asked for first; then the storage thread, which imports TransferQueue next,
    waits until the controller's thread has imported the starters and TQ's modules."""
    events: list[tuple[str, str]] = []

    def note(what: str) -> None:
        events.append((what, threading.current_thread().name))

    def open_tq_storage(cfg, timeouts, partition, on_spawned):
        note("TQ's processes asked for")
        on_spawned()
        note("the storage thread imports TransferQueue")
        return "storage"

    def load_starters(cfg):
        note("the controller imports the starters")
        time.sleep(0.3)  # torch and the backend modules: seconds, in a real run
        note("starters imported")
        return "start generation", "start trainer"

    async def start_workers(cfg, factory, *, storage_ready, starters):
        assert starters == ("start generation", "start trainer")
        assert await storage_ready == "storage"
        return ["a generation worker"], "the trainer"

    monkeypatch.setattr(tq_factory, "open_tq_storage", open_tq_storage)
    monkeypatch.setattr(tq_factory, "import_storage_modules", lambda: note("TQ's modules imported"))
    monkeypatch.setattr(registry, "load_starters", load_starters)
    monkeypatch.setattr(registry, "start_workers", start_workers)
    host = ControllerHost(Config())
    assert await host._ray_workers() == ("storage", ["a generation worker"], "the trainer")
    assert [what for what, _ in events] == [
        "TQ's processes asked for",
        "the controller imports the starters",
        "starters imported",
        "TQ's modules imported",
        "the storage thread imports TransferQueue",
    ]
    main = threading.current_thread().name
    assert [thread == main for _, thread in events] == [False, True, True, True, False]
