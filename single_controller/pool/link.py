"""A run's side of a pool: its controller's generation workers on the pool's slots.

`PoolLink(ctl, pool, spec, level).run()` starts every generation worker shrunk, registers the run
once its first weights are published, and pushes its generation demand on every change (and at
least every `HEARTBEAT_S`). The train pump asks for the train slots before each step
(`StepHooks.before_train`) and the weight-sync pump releases them once the step's weights are on
every routable worker (`StepHooks.after_sync`); the pool's `shrink_slot` / `expand_slot` are the
controller's elastic calls. A pool that fails ends the run like a failing pump; a run that ends
leaves the pool.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Protocol

from single_controller import elastic
from single_controller.controller import Controller, RunSummary
from single_controller.pool.planner import RunSlots
from single_controller.state import RunState

log = logging.getLogger(__name__)

HEARTBEAT_S = 10.0  # a run reports its demand at least this often (the pool's liveness, seen from the run)


class PoolResizeFailed(RuntimeError):
    """A shrink or expand the pool asked of this run failed on the run's side (not a worker's death,
    which the run handles, nor an expand to try again): the run stops with it."""


class PoolApi(Protocol):
    """What a run calls on its pool (`InProcessPool`, or the pool actor's client)."""

    async def register(self, spec: RunSlots, handle: PoolLink) -> None: ...

    async def unregister(self, name: str) -> None: ...

    async def report_demand(self, name: str, groups: int) -> None: ...

    async def acquire_train(self, name: str, step: int) -> None: ...

    async def release_train(self, name: str, step: int) -> None: ...


def generation_demand(state: RunState) -> int:
    """Groups this run could generate now: those in flight, plus those the staleness gate would
    admit at the current dispatch version (for the step its trainer fills and, as the lookahead
    allows, later ones), up to `rollout.max_in_flight_groups`."""
    cfg, led = state.cfg, state.ledger
    n = state.in_flight()
    if state.stop.requested or not state.has_prompt():
        return n
    room = cfg.rollout.max_in_flight_groups - n
    s = led.next_target_step()
    while s is not None and s < cfg.run.max_steps and room > 0 and state.sampler.may_admit(s, state.versions.dispatch):
        short = min(room, max(0, cfg.train.groups_per_step - led.live(s)))
        n, room, s = n + short, room - short, s + 1
    return n


def _differs(state: RunState, last: int) -> bool:
    return state.stop.train_done or generation_demand(state) != last


class PoolLink:
    def __init__(self, ctl: Controller, pool: PoolApi, spec: RunSlots, level: int):
        gens = [w.name for w in ctl.state.workers.generators]
        if len(gens) != len(spec.gen_slots):
            raise ValueError(
                f"run {spec.name}: {len(gens)} generation workers for {len(spec.gen_slots)} gen_slots {spec.gen_slots}"
            )
        self.ctl, self.pool, self.spec, self.level = ctl, pool, spec, level
        self.worker_on = dict(zip(spec.gen_slots, gens, strict=True))
        self.train_held: set[int] = set()
        self.failure: PoolResizeFailed | None = None  # a resize the pool asked for failed on this side

    # -- what the pool calls -------------------------------------------------------------------
    async def shrink_slot(self, slot: int, preempt: bool) -> None:
        """`preempt`: for a train grant, its groups in flight are aborted at once (re-dispatched
        uncharged); otherwise (a rebalance) they drain first, up to `rollout.shrink_drain_timeout_s`.
        A worker that dies meanwhile is out too (down, and restarted asleep: `elastic.shrink`); a
        shrink that fails otherwise fails the run (the pool keeps the slot its until it leaves)."""
        try:
            await self.ctl.shrink_generation(self.worker_on[slot], self.level, "abort" if preempt else "drain")
        except Exception as e:
            self._fail(PoolResizeFailed(f"run {self.spec.name}: the pool's shrink of slot {slot} failed: {e}"), e)
            raise

    async def expand_slot(self, slot: int) -> None:
        """`elastic.ExpandFailed` leaves the worker asleep (the pool tries again later); any other
        failure fails the run."""
        try:
            await self.ctl.expand_generation(self.worker_on[slot])
        except elastic.ExpandFailed:
            raise
        except Exception as e:
            self._fail(PoolResizeFailed(f"run {self.spec.name}: the pool's expand onto slot {slot} failed: {e}"), e)
            raise

    def _fail(self, error: PoolResizeFailed, cause: Exception) -> None:
        error.__cause__ = cause
        self.failure = self.failure or error
        self.ctl.state.notify()  # the pool companion raises it: the run stops with it

    # -- the run -------------------------------------------------------------------------------
    async def run(self) -> RunSummary:
        st = self.ctl.state
        for name in self.worker_on.values():  # out of the run until the pool expands them
            await elastic.shrink(st, name, self.level)
        st.hooks.before_train = self._before_train
        st.hooks.after_sync = self._after_sync
        self.ctl.companions["pool"] = self._member  # beside the pumps: its failure ends the run
        try:
            return await self.ctl.run()
        finally:
            try:
                await asyncio.shield(self.pool.unregister(self.spec.name))
            except Exception as e:  # the pool is gone: it has no slots of ours to free
                log.warning("run %s: leaving the pool failed: %s", self.spec.name, e)

    async def _member(self, st: RunState) -> None:
        """Register once there are weights to expand workers with, then push the demand on change."""
        await st.changed.wait_until(lambda: st.versions.published is not None or st.stop.train_done)
        if st.stop.train_done:
            return
        await self.pool.register(self.spec, self)
        last = -1
        while not st.stop.train_done:
            # Exits: training is done (nothing more to generate for); a resize failed on this side; the
            # pool is gone (a report fails).
            if self.failure is not None:
                raise self.failure
            demand = generation_demand(st)
            if demand != last:
                await self.pool.report_demand(self.spec.name, demand)
                last = demand
            try:
                async with asyncio.timeout(HEARTBEAT_S):
                    await st.changed.wait_until(functools.partial(self._news, last))
            except TimeoutError:
                # Nothing changed for a while: report again. A run whose workers are all shrunk calls
                # the pool for nothing else, so without this a pool that died would leave it waiting
                # for an expand forever; the report to a dead pool fails and ends the run.
                last = -1

    def _news(self, last: int) -> bool:
        return self.failure is not None or _differs(self.ctl.state, last)

    async def _before_train(self, step: int) -> None:
        await self.pool.acquire_train(self.spec.name, step)
        self.train_held.add(step)
        self.ctl.state.elastic.train_slots_held = len(self.spec.train_slots)

    async def _after_sync(self, version: int) -> None:
        for step in sorted(s for s in self.train_held if s < version):
            self.train_held.discard(step)
            await self.pool.release_train(self.spec.name, step)
        if not self.train_held:
            self.ctl.state.elastic.train_slots_held = 0


class InProcessPool:
    """A `PoolApi` on a scheduler in this process (the bench, the tests)."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    async def register(self, spec: RunSlots, handle: PoolLink) -> None:
        self.scheduler.register(spec, handle)

    async def unregister(self, name: str) -> None:
        self.scheduler.unregister(name)

    async def report_demand(self, name: str, groups: int) -> None:
        self.scheduler.report_demand(name, groups)

    async def acquire_train(self, name: str, step: int) -> None:
        await self.scheduler.acquire_train(name, step)

    async def release_train(self, name: str, step: int) -> None:
        self.scheduler.release_train(name, step)
