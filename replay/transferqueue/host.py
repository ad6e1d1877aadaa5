"""The one-process host: TransferQueue's controller and its storage unit in one Ray actor process
(`storage.tq_one_process`, on by default with one storage unit).

With one storage unit a second process only costs start-up: a client asks the controller, then the
unit, one after the other. `TransferQueueHost` builds both in one actor, registered under the
controller's actor name, and builds TQ's config itself so the starter need not import TQ first.
Checked against TransferQueue 0.1.11; `layout_supported` tells `runtime` to fall back to `tq.init`
when an installed TQ is laid out otherwise. This module imports neither torch nor TQ.
"""

from __future__ import annotations

from typing import Any

from replay.transferqueue import shims
from replay.transferqueue.common import STORAGE_UNIT_NAME, import_transfer_queue
from single_controller import startup_trace

# What the host calls on TransferQueue's server classes.
_CONTROLLER_METHODS = ("get_zmq_server_info", "store_config", "get_config")
_UNIT_METHODS = ("get_zmq_server_info", "shutdown")


def full_tq_config(overrides: dict) -> Any:
    """TransferQueue's default config with `overrides` merged in, as `tq.init` builds it."""
    from importlib import resources

    from omegaconf import OmegaConf

    with resources.as_file(resources.files("transfer_queue") / "config.yaml") as defaults:
        return OmegaConf.merge(OmegaConf.create({}, flags={"allow_objects": True}), OmegaConf.load(defaults), overrides)


def tq_sampler_class(final: Any) -> type | None:
    """The sampler class a full TQ config names (`controller.sampler`, one of TQ's), or None."""
    import transfer_queue.interface as tqi

    name = final.controller.sampler
    cls = getattr(tqi, name, None) if isinstance(name, str) else None
    return cls if isinstance(cls, type) else None


def plain_class(actor_class: Any) -> type | None:
    """The class a `@ray.remote` decorator wrapped (TransferQueue decorates its server classes), or
    None when `actor_class` is not such a wrapper of a class."""
    cls = getattr(actor_class, "__ray_actor_class__", None)
    return cls if isinstance(cls, type) else None


def layout_supported() -> bool:
    """Whether the installed TransferQueue has what the host builds on (call after importing it)."""
    from transfer_queue.controller import TransferQueueController
    from transfer_queue.storage.simple_storage import SimpleStorageUnit

    controller, unit = plain_class(TransferQueueController), plain_class(SimpleStorageUnit)
    return (
        controller is not None
        and unit is not None
        and all(hasattr(controller, m) for m in _CONTROLLER_METHODS)
        and all(hasattr(unit, m) for m in _UNIT_METHODS)
        and shims.can_adopt_controller()
    )


class TransferQueueHost:
    """One Ray actor process running TransferQueue's controller and its SimpleStorage unit(s)."""

    def __init__(self, overrides: dict) -> None:
        startup_trace.mark("transferqueue", "init")
        import_transfer_queue()
        startup_trace.mark("transferqueue", "transfer_queue imported")
        from transfer_queue.controller import TransferQueueController
        from transfer_queue.storage.simple_storage import SimpleStorageUnit

        if not layout_supported():
            raise RuntimeError(
                "this TransferQueue is not laid out as replay.transferqueue.host needs (checked against 0.1.11): "
                "set storage.tq_one_process=false"
            )
        final = full_tq_config(overrides)
        if final.backend.storage_backend != "SimpleStorage":
            raise ValueError(f"one TransferQueue process hosts SimpleStorage only, not {final.backend.storage_backend}")
        sampler = tq_sampler_class(final)
        if sampler is None:
            raise ValueError(f"unknown TransferQueue sampler {final.controller.sampler!r}")
        controller_cls, unit_cls = plain_class(TransferQueueController), plain_class(SimpleStorageUnit)
        assert controller_cls is not None and unit_cls is not None  # layout_supported() checked both
        self._controller = controller_cls(sampler=sampler(), polling_mode=final.controller.polling_mode)
        unit_conf = dict(final.backend.SimpleStorage)
        self._units = {
            STORAGE_UNIT_NAME.format(i): unit_cls(config=unit_conf)
            for i in range(int(unit_conf["num_data_storage_units"]))
        }
        final.controller.zmq_info = self._controller.get_zmq_server_info()
        final.backend.SimpleStorage.zmq_info = {name: u.get_zmq_server_info() for name, u in self._units.items()}
        self._controller.store_config(final)
        startup_trace.mark("transferqueue", "serving")

    # What TransferQueue calls on its controller's handle (attaching processes: `get_config`).
    def get_zmq_server_info(self) -> Any:
        return self._controller.get_zmq_server_info()

    def store_config(self, conf: Any) -> None:
        self._controller.store_config(conf)

    def get_config(self) -> Any:
        return self._controller.get_config()

    def shutdown(self) -> None:
        """What `tq.close()` asks of a storage handle before it kills it: stop the units' servers."""
        for unit in self._units.values():
            unit.shutdown()
