"""How a run opens its TransferQueue storage: the two calls the controller makes.

`open_tq_storage(cfg, timeouts, partition)` starts TQ (or attaches, per `storage.attach`) in the
controller and returns the run's `TQRowStorage`; `attach_tq_storage(partition, timeout_s,
group_rows)` is the workers' storage factory, called in each worker's own process. Importing this
module imports neither torch nor TQ, so the controller can start its workers before it imports TQ.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from replay.transferqueue.runtime import attach_tq, start_tq
from single_controller.config.schema import StorageConfig, TimeoutConfig

if TYPE_CHECKING:
    from replay.transferqueue.storage import TQRowStorage


def attach_tq_storage(partition: str, timeout_s: float, group_rows: bool = False) -> TQRowStorage:
    """`TQRowStorage.attach(partition, timeout_s=..., group_rows=...)`, importable without importing TQ."""
    from replay.transferqueue.storage import TQRowStorage

    return TQRowStorage.attach(partition, timeout_s=timeout_s, group_rows=group_rows)


def import_storage_modules() -> None:
    """Import what `open_tq_storage` imports once TQ's processes were asked for: TransferQueue and this
    package's row storage (with torch and tensordict). See `ControllerHost._ray_workers`: a process that
    imports on another thread meanwhile imports these first, on that thread."""
    from replay.transferqueue import storage  # noqa: F401


def open_tq_storage(
    cfg: StorageConfig,
    timeouts: TimeoutConfig,
    partition: str | None = None,
    on_spawned: Callable[[], None] | None = None,
) -> TQRowStorage:
    """Start or attach (per `cfg.attach`) and return the row storage of `partition` (default
    `cfg.partition`; a run passes its own, `<cfg.partition>-<run id>`). `on_spawned`: called once
    TQ's processes were asked for (at once when attaching), before TransferQueue is imported here."""
    if cfg.attach:
        if on_spawned is not None:
            on_spawned()
        attach_tq(timeouts.setup_s)
    else:
        start_tq(
            cfg.num_storage_units, timeout_s=timeouts.setup_s, one_process=cfg.tq_one_process, on_spawned=on_spawned
        )
    # imports TransferQueue: after TQ's processes were created
    from replay.transferqueue.storage import TQRowStorage

    return TQRowStorage(partition or cfg.partition, timeout_s=timeouts.storage_s, group_rows=cfg.pack_groups)
