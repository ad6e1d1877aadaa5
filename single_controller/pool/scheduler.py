"""The pool scheduler: S slots time-shared by several runs (RLix-style).

Contract:

* A run registers its `RunSlots` with a `RunHandle` (what the scheduler calls back: shrink or
  expand the run's generation worker on a slot; `single_controller/pool/link.py` is the controller's
  side). Its workers start out of the pool (asleep); the scheduler expands them onto slots.
* Training is granted before generation and is never preempted: `acquire_train(run, step)` waits
  until no other run trains on any of the run's `train_slots`, shrinks whatever generation worker
  is resident there (another run's preempted: its groups aborted and re-dispatched; the run's own
  drained first: they are its next step's), then returns. `release_train(run, step)` frees them; a run calls it
  only once its surviving generation workers hold the step's new weights (the weight sync of that
  version ended), so a slot never serves stale weights on the run's behalf. Requests are granted
  first come, first served; acquire/release are idempotent per (run, step).
* Generation: the planner (`planner.targets`) divides the free slots among runs by the demand they
  push (`report_demand`, on change: no polling); every cycle runs its shrinks before its expands, so
  at most one worker is resident on a slot at any moment.
* One cycle at a time, run by `serve()` when something changed (an event, not a poll). Every call
  into a run has a deadline that names it. A run whose shrink fails (its driver died) is taken out
  of the pool and its slots are freed for the others; a failed expand leaves the slot empty until
  the next change.

The slot timeline (`timeline`: (t, slot, state, run)) is what `pool run` writes to the pool summary
and `bench pool` measures.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Protocol

from single_controller.deadlines import within
from single_controller.pool.planner import POLICIES, Move, RunSlots, moves, targets

log = logging.getLogger("sc_grpo.pool")

IDLE, GEN, TRAIN, SWITCHING = "idle", "gen", "train", "switching"


class RunHandle(Protocol):
    """The scheduler's way into one run."""

    async def shrink_slot(self, slot: int, preempt: bool) -> None:
        """Out of the slot; `preempt` (a train grant): its groups in flight aborted, not drained."""

    async def expand_slot(self, slot: int) -> None: ...


class PoolError(RuntimeError):
    """A request the pool cannot take (an unknown run, a name taken, slots outside the pool)."""


@dataclass
class _TrainRequest:
    run: str
    step: int
    granted: asyncio.Future[None]
    t: float


@dataclass(frozen=True)
class PoolStatistics:
    slots: int
    runs: int
    resident: dict[int, str | None]
    training: dict[int, str | None]
    demand: dict[str, int]
    shrinks: int
    expands: int
    failed_expands: int
    train_grants: int
    train_wait_s: float
    max_train_wait_s: float
    cycles: int
    switch_s: float


@dataclass
class _Counters:
    shrinks: int = 0
    expands: int = 0
    failed_expands: int = 0
    train_grants: int = 0
    train_wait_s: float = 0.0
    max_train_wait_s: float = 0.0
    cycles: int = 0
    switch_s: float = 0.0  # slot-seconds spent switching (shrinks and expands)
    dropped_runs: list[str] = field(default_factory=list)


class PoolScheduler:
    def __init__(
        self,
        slots: int,
        policy: str = "gap_ratio",
        *,
        resize_timeout_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        if slots < 1:
            raise PoolError(f"a pool needs at least one slot, got {slots}")
        if policy not in POLICIES:
            raise PoolError(f"unknown pool policy {policy!r} (one of: {', '.join(POLICIES)})")
        self.slots, self.policy, self.clock = slots, policy, clock
        self.resize_timeout_s = resize_timeout_s
        self.runs: dict[str, RunSlots] = {}
        self.handles: dict[str, RunHandle] = {}
        self.demand: dict[str, int] = {}
        self.resident: dict[int, str | None] = dict.fromkeys(range(slots))
        self.training: dict[int, str | None] = dict.fromkeys(range(slots))
        self._train_steps: dict[str, set[int]] = {}
        self._pending: list[_TrainRequest] = []
        self._dirty = asyncio.Event()
        self._expanding: dict[int, asyncio.Task[None]] = {}
        self._expands: asyncio.TaskGroup  # set by `serve`
        self._closed = False
        self.counters = _Counters()
        self.t0 = clock()
        self.timeline: list[tuple[float, int, str, str | None]] = []
        for s in range(slots):
            self._mark(s, IDLE, None)

    # -- what runs call ----------------------------------------------------------------------
    def register(self, spec: RunSlots, handle: RunHandle) -> None:
        if spec.name in self.runs:
            raise PoolError(f"a run named {spec.name!r} is in the pool already")
        outside = sorted(s for s in (*spec.gen_slots, *spec.train_slots) if not 0 <= s < self.slots)
        if outside:
            raise PoolError(f"run {spec.name}: slots {outside} are outside the pool's 0..{self.slots - 1}")
        self.runs[spec.name], self.handles[spec.name] = spec, handle
        self.demand[spec.name] = 0
        self._train_steps[spec.name] = set()
        self._changed()

    def unregister(self, name: str) -> None:
        """The run is gone (ended or dead): its slots are free for the others. Idempotent."""
        if self.runs.pop(name, None) is None:
            return
        self.handles.pop(name)
        self.demand.pop(name)
        self._train_steps.pop(name)
        for s in range(self.slots):
            if self.resident[s] == name:
                self.resident[s] = None
                self._mark(s, IDLE, None)
            if self.training[s] == name:
                self.training[s] = None
                self._mark(s, IDLE, None)
        for req in [r for r in self._pending if r.run == name]:
            self._pending.remove(req)
            if not req.granted.done():
                req.granted.set_exception(PoolError(f"run {name} left the pool"))
        self._changed()

    def drop(self, name: str, why: str) -> None:
        """Take a run that is gone (its controller died, or a call into it failed) out of the pool:
        recorded once in `dropped_runs`, its slots freed for the others."""
        if name not in self.runs:
            return  # gone already (left, or dropped by another path)
        log.error("run %s dropped from the pool: %s", name, why)
        self.counters.dropped_runs.append(name)
        self.unregister(name)

    def report_demand(self, name: str, groups: int) -> None:
        """The groups the run could generate now (in flight, and admissible under its staleness bound)."""
        self._known(name)
        if self.demand[name] != groups:
            self.demand[name] = groups
            self._changed()

    async def acquire_train(self, name: str, step: int) -> None:
        """Returns once `name` holds its train slots for `step` (at once if it holds them already)."""
        self._known(name)
        if self._train_steps[name]:
            self._train_steps[name].add(step)
            return
        req = next((r for r in self._pending if r.run == name), None)
        if req is None:
            req = _TrainRequest(name, step, asyncio.get_running_loop().create_future(), self.clock())
            self._pending.append(req)
            self._changed()
        await asyncio.shield(req.granted)
        self._train_steps[name].add(step)

    def release_train(self, name: str, step: int) -> None:
        if name not in self.runs or step not in self._train_steps[name]:
            return  # released already, or the run left
        self._train_steps[name].discard(step)
        if not self._train_steps[name]:
            for s in self.runs[name].train_slots:
                self.training[s] = None
                self._mark(s, IDLE, None)
            self._changed()

    def close(self) -> None:
        self._closed = True
        self._dirty.set()

    # -- the scheduling loop -----------------------------------------------------------------
    async def serve(self) -> None:
        """Run the scheduling cycles until `close()`: one after every change. Expands run beside the
        cycles (a train grant never waits behind a wake); a shrink of a slot being expanded waits
        for that expand to end first."""
        async with asyncio.TaskGroup() as self._expands:
            while True:
                # Exits: closed.
                await self._dirty.wait()
                if self._closed:
                    return
                self._dirty.clear()
                await self._cycle()
                self.counters.cycles += 1

    async def _cycle(self) -> None:
        for req in list(self._pending):
            if req not in self._pending:
                continue  # its run left the pool during this cycle
            slots = self.runs[req.run].train_slots
            if any(self.training[s] not in (None, req.run) for s in slots):
                continue  # another run trains there: granted when it releases
            for s in slots:
                self.training[s] = req.run
            # another run's groups there are aborted (re-dispatched uncharged); the run's own drain
            # first (its next step's groups: bounded by rollout.max_in_flight_per_worker and
            # rollout.shrink_drain_timeout_s), instead of being generated again
            held = [Move(s, r) for s in slots if (r := self.resident[s]) is not None]
            await asyncio.gather(*(self._shrink(m, preempt=m.run != req.run) for m in held))
            if req.run not in self.runs:
                continue  # it left meanwhile
            for s in slots:
                self._mark(s, TRAIN, req.run)
            self._pending.remove(req)
            self._granted(req)
        free = [s for s in range(self.slots) if self.training[s] is None]
        plan = targets(self.policy, free, self.resident, self.demand, self.runs)
        mv = moves({s: self.resident[s] for s in free}, plan)
        await self._shrink_all(list(mv.shrinks), preempt=False)
        for m in mv.expands:
            if self.resident[m.slot] is None and m.run in self.runs:
                self.resident[m.slot] = m.run  # reserved: nothing else lands here meanwhile
                self._expanding[m.slot] = self._expands.create_task(self._expand(m))

    def _granted(self, req: _TrainRequest) -> None:
        wait = self.clock() - req.t
        c = self.counters
        c.train_grants += 1
        c.train_wait_s += wait
        c.max_train_wait_s = max(c.max_train_wait_s, wait)
        if not req.granted.done():
            req.granted.set_result(None)

    async def _shrink_all(self, shrinks: list[Move], *, preempt: bool) -> None:
        await asyncio.gather(*(self._shrink(m, preempt) for m in shrinks))

    async def _shrink(self, m: Move, preempt: bool) -> None:
        expanding = self._expanding.get(m.slot)
        if expanding is not None:
            await asyncio.shield(expanding)  # (it handles its own errors)
            if self.resident[m.slot] != m.run:
                return  # the expand failed: nothing to shrink
        t0 = self.clock()
        self._mark(m.slot, SWITCHING, m.run)
        try:
            await within(
                self.handles[m.run].shrink_slot(m.slot, preempt),
                self.resize_timeout_s,
                f"run {m.run}: shrink of slot {m.slot}",
            )
        except Exception as e:  # its driver is gone or broken: the others get its slots
            self.drop(m.run, f"its shrink of slot {m.slot} failed: {e}")
            return
        self.resident[m.slot] = None
        self.counters.shrinks += 1
        self.counters.switch_s += self.clock() - t0
        self._mark(m.slot, TRAIN if self.training[m.slot] else IDLE, self.training[m.slot])

    async def _expand(self, m: Move) -> None:
        try:
            await self._expand_once(m)
        finally:
            del self._expanding[m.slot]

    async def _expand_once(self, m: Move) -> None:
        if m.run not in self.runs:
            return  # it left the pool before this began (`unregister` freed the slot)
        t0 = self.clock()
        self._mark(m.slot, SWITCHING, m.run)
        try:
            await within(
                self.handles[m.run].expand_slot(m.slot),
                self.resize_timeout_s,
                f"run {m.run}: expand onto slot {m.slot}",
            )
        except Exception as e:
            log.warning("run %s: expand onto slot %d failed (the slot stays empty): %s", m.run, m.slot, e)
            self.counters.failed_expands += 1
            if self.resident[m.slot] == m.run:
                self.resident[m.slot] = None
                self._mark(m.slot, IDLE, None)
            return
        self.counters.expands += 1
        self.counters.switch_s += self.clock() - t0
        if m.run in self.runs:
            self._mark(m.slot, GEN, m.run)

    # -- bookkeeping -------------------------------------------------------------------------
    def _known(self, name: str) -> None:
        if name not in self.runs:
            raise PoolError(f"no run named {name!r} is in the pool (there are: {', '.join(self.runs) or 'none'})")

    def _changed(self) -> None:
        self._dirty.set()

    def _mark(self, slot: int, state: str, run: str | None) -> None:
        self.timeline.append((self.clock() - self.t0, slot, state, run))

    def summary(self) -> dict:
        """What `pool_summary.json` holds of the pool: its statistics, the runs dropped, the slot timeline."""
        return {
            "statistics": asdict(self.statistics()),
            "dropped_runs": list(self.counters.dropped_runs),
            "timeline": [list(e) for e in self.timeline],
        }

    def statistics(self) -> PoolStatistics:
        c = self.counters
        return PoolStatistics(
            self.slots,
            len(self.runs),
            dict(self.resident),
            dict(self.training),
            dict(self.demand),
            c.shrinks,
            c.expands,
            c.failed_expands,
            c.train_grants,
            c.train_wait_s,
            c.max_train_wait_s,
            c.cycles,
            c.switch_s,
        )
