"""The pool scheduler: S slots time-shared by several runs (RLix-style).

Runs register their `RunSlots` and a `RunHandle` (shrink / expand a worker on a slot); their workers
start asleep. Training is granted before generation and never preempted: `acquire_train` waits for
the run's train slots, first come first served, shrinks what is resident there and returns;
`release_train` frees them once the step's weights are on the run's workers. Generation: the planner
divides the free slots by the demand runs push, each plan's shrinks before its expands, so at most
one worker sits on a slot. Every call into a run has a deadline; a slot is free only once its worker
is confirmed out. `timeline` is what `pool run` writes and `bench pool` measures.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Protocol

from single_controller.deadlines import DeadlineExceeded, within
from single_controller.pool.planner import POLICIES, Move, RunSlots, moves, targets

log = logging.getLogger(__name__)

IDLE, GEN, TRAIN, SWITCHING = "idle", "gen", "train", "switching"


class RunHandle(Protocol):
    """The scheduler's way into one run."""

    async def shrink_slot(self, slot: int, preempt: bool) -> None:
        """Out of the slot; `preempt` (a train grant): its groups in flight aborted, not drained."""

    async def expand_slot(self, slot: int) -> None: ...


class RunGone(RuntimeError):
    """A call into a run failed because its controller is gone (a `RunHandle` raises it)."""


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
    failed_shrinks: int  # shrinks the run's side failed (that run fails; its slot stays its until it leaves)
    late_resizes: int  # resizes that outlived `resize_timeout_s` (a shrink asked again, or one after the expand)
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
    failed_shrinks: int = 0
    late_resizes: int = 0
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
        self._left: dict[str, asyncio.Event] = {}  # set when the run leaves the pool
        self._dirty = asyncio.Event()
        self._planning: asyncio.Task[None] | None = None
        self._replan = False  # a change came while a plan ran: plan again after it
        self._granting: set[asyncio.Task[None]] = set()
        self._expanding: dict[int, asyncio.Task[None]] = {}
        self._shrinking: dict[int, asyncio.Future[None]] = {}
        self._tasks: asyncio.TaskGroup  # set by `serve`: grants, plans, expands
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
        self._left[spec.name] = asyncio.Event()
        self._changed()

    def unregister(self, name: str) -> None:
        """The run is gone (ended or dead): its slots are free for the others. Idempotent."""
        if self.runs.pop(name, None) is None:
            return
        self.handles.pop(name)
        self.demand.pop(name)
        self._train_steps.pop(name)
        self._left.pop(name).set()
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
        """Returns once `name` holds its train slots for `step` (at once if it holds them for it already)."""
        self._known(name)
        if step in self._train_steps[name]:
            return
        req = next((r for r in self._pending if r.run == name and r.step == step), None)
        if req is None:
            req = _TrainRequest(name, step, asyncio.get_running_loop().create_future(), self.clock())
            self._pending.append(req)
            self._changed()
        await asyncio.shield(req.granted)

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

    def quiet(self) -> bool:
        """Nothing due or under way: no change unplanned, no plan, grant, shrink or expand running."""
        return not (
            self._dirty.is_set()
            or (self._planning is not None and not self._planning.done())
            or self._granting
            or self._expanding
            or self._shrinking
        )

    # -- the scheduling loop -----------------------------------------------------------------
    async def serve(self) -> None:
        """Serve until `close()`: after every change, take the train requests that can be granted now
        (each grant a task), and plan generation (one plan at a time: a change during a plan plans
        again after it). Expands run beside them; a shrink of a slot being expanded waits for that
        expand to end first."""
        async with asyncio.TaskGroup() as self._tasks:
            while True:
                # Exits: closed.
                await self._dirty.wait()
                if self._closed:
                    return
                self._dirty.clear()
                self._take_train_requests()
                if self._planning is None or self._planning.done():
                    self._planning = self._tasks.create_task(self._plan())
                    self.counters.cycles += 1
                else:
                    self._replan = True

    def _take_train_requests(self) -> None:
        """Reserve the slots of every request that can be granted now, first come first served, and
        start its grant. A request waits while any of its slots is trained on or wanted by an earlier
        request that waits (so a later one never overtakes it)."""
        wanted: set[int] = set()
        for req in list(self._pending):
            slots = self.runs[req.run].train_slots
            if any(s in wanted or self.training[s] is not None for s in slots):
                wanted.update(slots)
                continue
            self._pending.remove(req)
            for s in slots:
                self.training[s] = req.run  # reserved: no expand lands here from now on
            task = self._tasks.create_task(self._grant(req))
            self._granting.add(task)
            task.add_done_callback(self._granting.discard)

    async def _grant(self, req: _TrainRequest) -> None:
        # another run's groups there are aborted (re-dispatched uncharged); the run's own drain
        # first (its next step's groups: bounded by rollout.max_in_flight_per_worker and
        # rollout.shrink_drain_timeout_s), instead of being generated again
        slots = self.runs[req.run].train_slots
        held = [Move(s, r) for s in slots if (r := self.resident[s]) is not None]
        await asyncio.gather(*(self._shrink(m, preempt=m.run != req.run) for m in held))
        if req.run not in self.runs:
            return  # it left meanwhile (`unregister` failed its request and freed its slots)
        for s in slots:
            self._mark(s, TRAIN, req.run)
        self._train_steps[req.run].add(req.step)
        wait = self.clock() - req.t
        c = self.counters
        c.train_grants += 1
        c.train_wait_s += wait
        c.max_train_wait_s = max(c.max_train_wait_s, wait)
        if not req.granted.done():
            req.granted.set_result(None)

    async def _plan(self) -> None:
        try:
            free = [s for s in range(self.slots) if self.training[s] is None]
            plan = targets(self.policy, free, self.resident, self.demand, self.runs)
            mv = moves({s: self.resident[s] for s in free}, plan)
            await asyncio.gather(*(self._shrink(m, preempt=False) for m in mv.shrinks))
            for m in mv.expands:
                # (a grant may have reserved the slot, or a run left, while the shrinks ran)
                if self.resident[m.slot] is None and self.training[m.slot] is None and m.run in self.runs:
                    self.resident[m.slot] = m.run  # reserved: nothing else lands here meanwhile
                    self._expanding[m.slot] = self._tasks.create_task(self._expand(m))
        finally:
            if self._replan:
                self._replan = False
                self._changed()

    async def _shrink(self, m: Move, preempt: bool) -> None:
        """Returns once run `m.run`'s worker is off slot `m.slot` (or the run left the pool)."""
        expanding = self._expanding.get(m.slot)
        if expanding is not None:
            await asyncio.shield(expanding)  # (it handles its own errors)
        while (shrinking := self._shrinking.get(m.slot)) is not None:
            await asyncio.shield(shrinking)  # a plan's shrink and a grant's of the same worker: one call
        if self.resident[m.slot] != m.run:
            return  # the expand failed and was undone, or another shrink took it off
        done = asyncio.get_running_loop().create_future()
        self._shrinking[m.slot] = done
        try:
            await self._shrink_once(m, preempt)
        finally:
            del self._shrinking[m.slot]
            done.set_result(None)

    async def _shrink_once(self, m: Move, preempt: bool) -> None:
        t0 = self.clock()
        self._mark(m.slot, SWITCHING, m.run)
        while True:
            # Exits: the worker is off the slot; the run is gone, or failed the shrink and left.
            left = self._left.get(m.run)
            if left is None:
                return  # it left the pool (`unregister` freed the slot)
            try:
                await within(
                    self.handles[m.run].shrink_slot(m.slot, preempt),
                    self.resize_timeout_s,
                    f"run {m.run}: shrink of slot {m.slot}",
                )
                break
            except RunGone as e:  # its controller is gone, its workers with it: the others get its slots
                self.drop(m.run, f"its controller is gone (shrink of slot {m.slot}: {e})")
                return
            except DeadlineExceeded as e:  # (under Ray the shrink goes on: the next call waits for it)
                log.warning("%s; asking again: the slot is the run's until its worker is out", e)
                self.counters.late_resizes += 1
            except Exception as e:
                log.error(
                    "run %s: shrink of slot %d failed (the run fails; the slot is its until it leaves): %s",
                    m.run,
                    m.slot,
                    e,
                )
                self.counters.failed_shrinks += 1
                await left.wait()
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
        except RunGone as e:
            self.drop(m.run, f"its controller is gone (expand onto slot {m.slot}: {e})")
            return
        except Exception as e:
            # Failed or late (under Ray a late wake goes on): the slot is free only once a shrink has
            # confirmed the worker asleep; then it stays empty until the next change.
            log.warning("run %s: expand onto slot %d failed (shrunk back, the slot stays empty): %s", m.run, m.slot, e)
            self.counters.failed_expands += 1
            if isinstance(e, DeadlineExceeded):
                self.counters.late_resizes += 1
            if self.resident[m.slot] == m.run:
                await self._shrink_once(m, preempt=True)
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
            c.failed_shrinks,
            c.late_resizes,
            c.train_grants,
            c.train_wait_s,
            c.max_train_wait_s,
            c.cycles,
            c.switch_s,
        )
