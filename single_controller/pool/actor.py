"""The pool on Ray: the scheduler as a CPU-only async actor, and the clients on both sides.

`PoolActor` runs a `PoolScheduler` and watches each registered run's controller actor (a call that
returns when the run ends), so a dead run's slots go to the others at once, without polling.
`RayRunHandle` is a run's controller seen by the pool; `RayPoolClient` the pool seen by a run, every
call under a deadline (`pool.grant_timeout_s`, `pool.call_timeout_s`). The actor is named
`pool.name` in the namespace `sc-grpo-pool`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from single_controller.config.schema import PoolConfig
from single_controller.deadlines import DeadlineExceeded, within
from single_controller.pool.planner import RunSlots
from single_controller.pool.scheduler import PoolScheduler, RunGone

log = logging.getLogger(__name__)

NAMESPACE = "sc-grpo-pool"


class PoolCallFailed(RuntimeError):
    """A run's call to its pool failed: the pool actor is gone, or it refused the call."""


class RayRunHandle:
    """A run's controller actor; a call that fails because the actor is gone raises `RunGone`."""

    def __init__(self, actor: Any):
        self.actor = actor

    async def shrink_slot(self, slot: int, preempt: bool) -> None:
        await self._call(self.actor.pool_shrink_slot.remote(slot, preempt))

    async def expand_slot(self, slot: int) -> None:
        await self._call(self.actor.pool_expand_slot.remote(slot))

    async def _call(self, ref: Any) -> None:
        import ray

        try:
            await ref
        except ray.exceptions.RayActorError as e:
            raise RunGone(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e


class PoolActor:
    """Run as `ray.remote(num_cpus=0)(PoolActor)`, named, with `max_concurrency` >= 2 x runs + 4."""

    def __init__(self, slots: int, policy: str, resize_timeout_s: float = 120.0):
        self.scheduler = PoolScheduler(slots, policy, resize_timeout_s=resize_timeout_s)
        self._serving: asyncio.Task[None] | None = None
        self._watches: dict[str, asyncio.Task[None]] = {}

    async def start(self) -> dict:
        if self._serving is None:
            self._serving = asyncio.get_running_loop().create_task(self.scheduler.serve(), name="pool.serve")
        return {"slots": self.scheduler.slots, "policy": self.scheduler.policy}

    async def register(self, spec: RunSlots, run_actor: Any) -> None:
        self.scheduler.register(spec, RayRunHandle(run_actor))
        self._watches[spec.name] = asyncio.get_running_loop().create_task(
            self._watch(spec.name, run_actor), name=f"pool.watch {spec.name}"
        )

    async def _watch(self, name: str, run_actor: Any) -> None:
        try:
            await run_actor.pool_wait_ended.remote()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # its controller died: its workers (owned by it) died with it
            self.scheduler.drop(name, f"its controller is gone ({type(e).__name__})")
            return
        self.scheduler.unregister(name)

    async def unregister(self, name: str) -> None:
        self.scheduler.unregister(name)
        watch = self._watches.pop(name, None)
        if watch is not None and watch is not asyncio.current_task():
            watch.cancel()

    async def report_demand(self, name: str, groups: int) -> None:
        self.scheduler.report_demand(name, groups)

    async def acquire_train(self, name: str, step: int) -> None:
        await self.scheduler.acquire_train(name, step)

    async def release_train(self, name: str, step: int) -> None:
        self.scheduler.release_train(name, step)

    async def summary(self) -> dict:
        return self.scheduler.summary()

    async def close(self) -> None:
        self.scheduler.close()
        if self._serving is not None:
            await self._serving
        for watch in self._watches.values():
            watch.cancel()


class RayPoolClient:
    """A run's `PoolApi` on the pool actor."""

    def __init__(self, cfg: PoolConfig, run_actor: Any):
        import ray

        self.cfg, self.run_actor = cfg, run_actor
        self.actor = ray.get_actor(cfg.name, namespace=NAMESPACE)

    async def _call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        what = f"pool {self.cfg.name}: {method}({', '.join(map(str, args))})"
        try:
            return await within(getattr(self.actor, method).remote(*args), timeout_s or self.cfg.call_timeout_s, what)
        except DeadlineExceeded:
            raise  # its message names the pool and the call
        except Exception as e:  # the pool actor died, or refused the call
            first = str(e).split(". ", 1)[0].split("\n", 1)[0]
            raise PoolCallFailed(f"{what} failed: {type(e).__name__}: {first}") from e

    async def register(self, spec: RunSlots, handle: object) -> None:
        await self._call("register", spec, self.run_actor)

    async def unregister(self, name: str) -> None:
        await self._call("unregister", name)

    async def report_demand(self, name: str, groups: int) -> None:
        await self._call("report_demand", name, groups)

    async def acquire_train(self, name: str, step: int) -> None:
        await self._call("acquire_train", name, step, timeout_s=self.cfg.grant_timeout_s)

    async def release_train(self, name: str, step: int) -> None:
        await self._call("release_train", name, step)
