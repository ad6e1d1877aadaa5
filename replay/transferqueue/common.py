"""What `runtime`, `host` and `storage` share: TQ's actor names, its environment knobs, its import.

`configure_env()` must run before `ray` or `transfer_queue` is imported (both read their knobs at
import, and a local Ray's workers inherit the driver's environment); it sets only what the user has
not. `import_transfer_queue()` is the one way this package imports TQ: environment, start-up shims,
then `import transfer_queue`. Importing this module imports neither Ray, torch nor TQ.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from replay.transferqueue import shims

log = logging.getLogger(__name__)

CONTROLLER_NAME = "TransferQueueController"
CONTROLLER_NAMESPACE = "transfer_queue"
STORAGE_UNIT_NAME = "TransferQueueStorageUnit#{}"  # in the creating driver's namespace


class TQRuntimeError(RuntimeError):
    """TransferQueue could not be started, attached to, or stopped."""


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
    * `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` (only before ray is imported): Ray (and so TQ's ZMQ
      sockets, which carry pickles) binds to 127.0.0.1 instead of the first NIC.
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
            "replay.transferqueue.common.configure_env() set %s after importing %s: this process keeps the old "
            "values (call it before importing ray)",
            newly_set,
            late,
        )
    return {name: os.environ[name] for name in wanted}


def import_transfer_queue() -> Any:
    """`import transfer_queue`, after `configure_env()` and with the start-up shims installed."""
    if "transfer_queue" in sys.modules:
        return sys.modules["transfer_queue"]
    configure_env()
    shims.install_shims()
    import transfer_queue

    return transfer_queue


def client_connected() -> bool:
    """Whether this process has a TQ client (after `start_tq` / `attach_tq`)."""
    tq = import_transfer_queue()
    try:
        tq.get_client()
    except AssertionError:
        return False
    return True
