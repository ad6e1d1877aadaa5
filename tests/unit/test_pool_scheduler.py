"""Layer (b): the pool scheduler (`single_controller/pool/scheduler.py`) with fake runs, and two sim
controllers time-sharing one pool (`single_controller/bench/pool.py` `run_layout`).

Every run's handle is wrapped in `Checked`, and the pool API in `CheckedPool`: together they keep the
slots as the workers occupy them (`Board`) and record every breach of the pool's contract: two workers
on one slot, a worker expanded onto (or waking on) a slot another run trains on, a train grant that
returns with a worker still on its slots, two runs training on one slot."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import defaultdict
from collections.abc import Callable

import pytest

from single_controller.bench.pool import layouts, run_layout
from single_controller.pool.link import InProcessPool, PoolLink
from single_controller.pool.planner import RunSlots
from single_controller.pool.scheduler import GEN, IDLE, SWITCHING, TRAIN, PoolError, PoolScheduler, RunGone
from tests.helpers.sim import assert_clean_end, trained_prompts

EVERY = (0, 1, 2, 3)


class Board:
    """The slots as the runs' workers occupy them (a worker from the start of its expand to the end of
    its shrink), who trains where (from a grant's return to its release), the calls in order (`log`)
    and every breach (`violations`)."""

    def __init__(self, slots: int):
        self.on: dict[int, str | None] = dict.fromkeys(range(slots))
        self.training: dict[int, str | None] = dict.fromkeys(range(slots))
        self.log: list[tuple] = []
        self.violations: list[str] = []
        self._tick = asyncio.Event()

    def note(self, *entry) -> None:
        self.log.append(entry)
        self._tick.set()
        self._tick = asyncio.Event()

    async def wait_until(self, pred: Callable[[], bool], what: str, timeout: float = 2.0) -> None:
        try:
            async with asyncio.timeout(timeout):
                while not pred():
                    await self._tick.wait()
        except TimeoutError:
            raise AssertionError(f"waited {timeout}s for {what}: slots {self.on}, training {self.training}") from None


class FakeRun:
    """A run's side of the pool, scripted: every call recorded; `delay()` seconds each; a shrink raises
    while `shrink_fails` (its driver died); an expand onto a slot of `expand_fails` raises, once."""

    def __init__(self, delay: Callable[[], float] = lambda: 0.0):
        self.delay = delay
        self.calls: list[tuple] = []
        self.shrink_fails = False
        self.expand_fails: set[int] = set()
        self.drain_s = 0.0  # more for a draining shrink (preempt False)
        self.wake_s = 0.0  # a wake that goes on when its caller stops waiting (a Ray call)
        self._waking: dict[int, asyncio.Future] = {}

    async def shrink_slot(self, slot: int, preempt: bool) -> None:
        self.calls.append(("shrink", slot, preempt))
        if slot in self._waking:  # one resize of a worker at a time, as `elastic` does
            await asyncio.shield(self._waking[slot])
        await asyncio.sleep(self.delay() + (0.0 if preempt else self.drain_s))
        if self.shrink_fails:
            raise RunGone("the run's controller is gone")

    async def expand_slot(self, slot: int) -> None:
        self.calls.append(("expand", slot))
        if self.wake_s:
            self._waking[slot] = asyncio.ensure_future(asyncio.sleep(self.wake_s))
            await asyncio.shield(self._waking[slot])
            del self._waking[slot]
        await asyncio.sleep(self.delay())
        if slot in self.expand_fails:
            self.expand_fails.discard(slot)
            raise RuntimeError(f"wake on slot {slot} failed")


class Checked:
    """A run's handle, checked against the `Board`."""

    def __init__(self, name: str, inner, board: Board):
        self.name, self.inner, self.board = name, inner, board

    async def shrink_slot(self, slot: int, preempt: bool) -> None:
        b, me = self.board, self.name
        if b.on[slot] != me:
            b.violations.append(f"shrink of {me} on slot {slot}, which holds {b.on[slot]}")
        b.note("shrink", me, slot)
        try:
            await self.inner.shrink_slot(slot, preempt)
        except Exception:
            b.on.update({s: None for s, r in b.on.items() if r == me})  # its driver is gone, its workers with it
            b.note("died", me, slot)
            raise
        b.on[slot] = None
        b.note("shrunk", me, slot)

    async def expand_slot(self, slot: int) -> None:
        b, me = self.board, self.name
        if b.on[slot] is not None:
            b.violations.append(f"expand of {me} onto slot {slot}, which holds {b.on[slot]}")
        if b.training[slot] is not None:
            b.violations.append(f"expand of {me} onto slot {slot}, where {b.training[slot]} trains")
        b.on[slot] = me
        b.note("expand", me, slot)
        try:
            await self.inner.expand_slot(slot)
        except BaseException:
            b.note("failed", me, slot)  # (woken maybe: on the slot until a shrink says it is not)
            raise
        if b.on[slot] != me:
            b.violations.append(f"{me}'s worker woke on slot {slot} after it was shrunk (now: {b.on[slot]})")
        if b.training[slot] is not None:
            b.violations.append(f"{me}'s worker woke on slot {slot}, where {b.training[slot]} trains")
        b.note("expanded", me, slot)


class CheckedPool(InProcessPool):
    """The pool API with every run's handle `Checked`, and every train grant checked when it returns."""

    def __init__(self, scheduler: PoolScheduler, board: Board):
        super().__init__(scheduler)
        self.board = board
        self.held: dict[str, set[int]] = defaultdict(set)

    async def register(self, spec: RunSlots, handle) -> None:
        self.scheduler.register(spec, Checked(spec.name, handle, self.board))

    async def acquire_train(self, name: str, step: int) -> None:
        await self.scheduler.acquire_train(name, step)
        b = self.board
        for s in self.scheduler.runs[name].train_slots:
            if b.on[s] is not None:
                b.violations.append(f"{name}'s train grant (step {step}) returned with {b.on[s]} on slot {s}")
            if b.training[s] not in (None, name):
                b.violations.append(f"{name} and {b.training[s]} both train on slot {s}")
            b.training[s] = name
        self.held[name].add(step)
        b.note("granted", name, step)

    async def release_train(self, name: str, step: int) -> None:
        self.held[name].discard(step)
        if not self.held[name]:
            self.board.training.update({s: None for s, r in self.board.training.items() if r == name})
        self.board.note("released", name, step)
        self.scheduler.release_train(name, step)


class Harness:
    """A pool being served, its board and its checked API; `settled()` waits out the work due."""

    def __init__(self, slots: int, policy: str, resize_timeout_s: float = 2.0):
        self.pool = PoolScheduler(slots, policy, resize_timeout_s=resize_timeout_s)
        self.board = Board(slots)
        self.api = CheckedPool(self.pool, self.board)

    async def settled(self) -> None:
        """Returns once the tasks started have run, and nothing is due or under way (`quiet`)."""
        async with asyncio.timeout(2.0):
            while True:
                await asyncio.sleep(0.001)
                if self.pool.quiet():
                    return

    def on(self) -> list[str | None]:
        return [self.board.on[s] for s in sorted(self.board.on)]


@contextlib.asynccontextmanager
async def serving(slots: int = 4, policy: str = "gap_ratio", resize_timeout_s: float = 2.0):
    h = Harness(slots, policy, resize_timeout_s)
    serve = asyncio.create_task(h.pool.serve())
    try:
        yield h
    finally:
        h.pool.close()
        await asyncio.wait_for(serve, 2.0)
    assert h.board.violations == []


# -- train grants ------------------------------------------------------------------------------
async def test_a_train_grant_shrinks_what_is_on_its_train_slots_first_and_nothing_lands_there_until_release():
    b = FakeRun(lambda: 0.01)
    async with serving() as h:
        await h.api.register(RunSlots("A", EVERY, (0, 1)), FakeRun(lambda: 0.01))
        await h.api.register(RunSlots("B", EVERY, (2, 3)), b)
        await h.api.report_demand("B", 8)
        await h.settled()
        assert h.on() == ["B"] * 4
        await h.api.acquire_train("A", 0)  # (CheckedPool: no worker on slots 0-1 when it returns)
        assert h.on() == [None, None, "B", "B"]
        assert sorted(c for c in b.calls if c[0] == "shrink") == [("shrink", 0, True), ("shrink", 1, True)]
        assert h.pool.statistics().training == {0: "A", 1: "A", 2: None, 3: None}
        assert {(s, r) for _, s, st, r in h.pool.timeline if st == TRAIN} == {(0, "A"), (1, "A")}
        # B wants more, and A some: neither lands on slots 0-1 while A trains. Shares of the 2 free
        # slots for 4:9 groups: 8/13 + 0.5 -> 1 and 18/13 + 0.5 -> 1
        await h.api.report_demand("B", 9)
        await h.settled()
        await h.api.report_demand("A", 4)
        await h.settled()
        assert h.on()[:2] == [None, None] and sorted(h.on()[2:]) == ["A", "B"]
        await h.api.release_train("A", 0)
        await h.settled()
        # 4 free slots for 4:9: 16/13 + 0.5 -> 1 and 36/13 + 0.5 -> 3: B back on 0-1
        assert h.on()[:2] == ["B", "B"] and h.on().count("B") == 3
        assert [st for _, s, st, _ in h.pool.timeline if s == 0][-4:] == [TRAIN, IDLE, SWITCHING, GEN]


async def test_acquire_is_idempotent_per_step_the_next_step_waits_for_the_release_a_run_alone_hands_its_slots_back():
    async with serving() as h:
        pool = h.pool
        a = FakeRun()
        await h.api.register(RunSlots("A", EVERY, (0, 1)), a)
        await h.api.report_demand("A", 4)
        await h.settled()
        # its own workers on slots 0-1 are shrunk too, drained (preempt False): their groups are its next step's
        await h.api.acquire_train("A", 0)
        assert h.on() == [None, None, "A", "A"] and sorted(a.calls)[-2:] == [("shrink", 0, False), ("shrink", 1, False)]
        grants, marks = pool.statistics().train_grants, len(pool.timeline)
        again = pool.acquire_train("A", 0)
        with pytest.raises(StopIteration):  # the step it holds: it returned without once yielding to the loop
            again.send(None)
        assert pool.statistics().train_grants == grants == 1 and len(pool.timeline) == marks
        nxt = asyncio.create_task(h.api.acquire_train("A", 1))
        await h.settled()
        assert not nxt.done()  # its next step waits for the release of this one (R3)
        pool.release_train("A", 7)  # never acquired
        assert pool.training == {0: "A", 1: "A", 2: None, 3: None} and len(pool.timeline) == marks
        await h.api.release_train("A", 0)
        await asyncio.wait_for(nxt, 1.0)
        # granted straight from the release: no expand onto slots 0-1 between the two steps
        assert pool.training == {0: "A", 1: "A", 2: None, 3: None} and h.on() == [None, None, "A", "A"]
        assert pool.statistics().train_grants == 2
        pool.release_train("A", 0)  # released already
        assert pool.training[0] == "A"
        await h.api.release_train("A", 1)
        await h.settled()
        assert pool.training == dict.fromkeys(range(4))
        assert h.on() == ["A"] * 4  # alone, with no step waiting: its train slots generate again
        pool.release_train("A", 1)
        pool.release_train("Z", 1)  # a run that left (or never came)
        assert pool.training == dict.fromkeys(range(4))


async def test_a_run_holding_its_train_slot_queues_its_next_step_behind_a_run_that_waits_for_it_and_nobody_overtakes():
    async with serving() as h:
        for name, train in (("A", (0,)), ("B", (0, 1)), ("C", (1,))):
            await h.api.register(RunSlots(name, EVERY, train), FakeRun())
        await h.api.acquire_train("A", 0)
        b = asyncio.create_task(h.api.acquire_train("B", 0))
        await h.settled()
        a1 = asyncio.create_task(h.api.acquire_train("A", 1))
        await h.settled()
        c = asyncio.create_task(h.api.acquire_train("C", 0))
        await h.settled()
        # A's next step is behind B (asked first), and C behind B too: slot 1 is free, but B waits for it
        assert not b.done() and not a1.done() and not c.done()
        await h.api.release_train("A", 0)
        await asyncio.wait_for(b, 1.0)
        await h.settled()
        assert not a1.done() and not c.done()
        await h.api.release_train("B", 0)
        await asyncio.wait_for(asyncio.gather(a1, c), 1.0)
    granted = [e[1:] for e in h.board.log if e[0] == "granted"]
    assert granted[:2] == [("A", 0), ("B", 0)] and sorted(granted[2:]) == [("A", 1), ("C", 0)]
    assert h.pool.statistics().train_grants == 4


async def test_train_requests_on_the_same_slots_are_granted_first_come_first_served_each_after_a_release():
    async with serving() as h:
        for name, train in (("A", (0, 1)), ("B", (0, 1)), ("C", (1,)), ("D", (3,))):
            await h.api.register(RunSlots(name, EVERY, train), FakeRun())
        await h.api.acquire_train("A", 0)
        b = asyncio.create_task(h.api.acquire_train("B", 0))
        await h.settled()
        c = asyncio.create_task(h.api.acquire_train("C", 0))
        await h.settled()
        await asyncio.wait_for(h.api.acquire_train("D", 0), 1.0)  # on another slot: not behind B and C
        assert not b.done() and not c.done()
        await h.api.release_train("A", 0)
        await asyncio.wait_for(b, 1.0)
        await h.settled()
        assert not c.done()  # slot 1 is B's now
        await h.api.release_train("B", 0)
        await asyncio.wait_for(c, 1.0)
    log = h.board.log
    assert [e[1] for e in log if e[0] == "granted"] == ["A", "D", "B", "C"]
    assert log.index(("released", "A", 0)) < log.index(("granted", "B", 0))
    assert log.index(("released", "B", 0)) < log.index(("granted", "C", 0))
    assert h.pool.statistics().train_grants == 4


async def test_a_train_grant_that_drains_holds_up_no_other_grant():
    a = FakeRun()
    async with serving() as h:
        await h.api.register(RunSlots("A", EVERY, (0,)), a)
        await h.api.register(RunSlots("B", EVERY, (3,)), FakeRun())
        await h.api.report_demand("A", 4)
        await h.settled()
        assert h.on() == ["A"] * 4
        a.drain_s = 0.5  # A's own worker on slot 0 drains for its grant; B's grant preempts A's on slot 3
        granting_a = asyncio.create_task(h.api.acquire_train("A", 0))
        await h.board.wait_until(lambda: ("shrink", "A", 0) in h.board.log, "A's drain on slot 0 to begin")
        await asyncio.wait_for(h.api.acquire_train("B", 0), 0.25)  # (S8: it waited out A's drain)
        assert not granting_a.done()
        await asyncio.wait_for(granting_a, 1.0)
    assert h.board.log.index(("granted", "B", 0)) < h.board.log.index(("shrunk", "A", 0))


async def test_an_expand_past_its_deadline_frees_its_slot_only_once_a_shrink_confirms_the_worker_out():
    # Under Ray a late wake goes on after the pool stopped waiting: the slot must not go to another run meanwhile.
    a, b = FakeRun(), FakeRun()
    a.wake_s = 0.3
    async with serving(slots=1, resize_timeout_s=0.05) as h:
        await h.api.register(RunSlots("A", (0,), (0,)), a)
        await h.api.register(RunSlots("B", (0,), (0,)), b)
        await h.api.report_demand("A", 4)
        await h.board.wait_until(lambda: ("failed", "A", 0) in h.board.log, "A's expand to outlive its deadline")
        await h.api.report_demand("A", 0)
        await h.api.report_demand("B", 4)
        await h.board.wait_until(lambda: ("expanded", "B", 0) in h.board.log, "B's expand", timeout=3.0)
        s = h.pool.statistics()
        # the expand's deadline, and the shrink's after it (asked again until the wake has ended)
        assert s.failed_expands == 1 and s.late_resizes >= 2 and s.resident == {0: "B"}
    log = h.board.log
    assert ("shrink", 0, True) in a.calls  # the shrink that confirms A's worker out
    assert log.index(("shrunk", "A", 0)) < log.index(("expand", "B", 0))


async def test_a_train_grant_on_a_slot_being_expanded_waits_for_the_expand_then_shrinks_it():
    async with serving() as h:
        await h.api.register(RunSlots("A", EVERY, (0,)), FakeRun())
        await h.api.register(RunSlots("B", EVERY, (3,)), FakeRun(lambda: 0.05))
        await h.api.report_demand("B", 4)
        await h.board.wait_until(lambda: h.board.on[0] == "B", "B's expand onto slot 0 to begin")
        await h.api.acquire_train("A", 0)
    log = h.board.log
    assert log.index(("expanded", "B", 0)) < log.index(("shrink", "B", 0)) < log.index(("granted", "A", 0))


# -- generation cycles -------------------------------------------------------------------------
async def test_a_rebalance_shrinks_the_donor_before_it_expands_the_taker_in_one_cycle():
    async with serving() as h:
        await h.api.register(RunSlots("A", EVERY, (0,)), FakeRun())
        await h.api.register(RunSlots("B", EVERY, (3,)), FakeRun(lambda: 0.02))
        await h.api.report_demand("B", 4)
        await h.settled()
        assert h.on() == ["B"] * 4
        cycles = h.pool.counters.cycles
        # 4:4 groups on 4 slots: 2 each. B keeps 0 and 2 (its first, then within target); A takes 1
        # (nobody trains there), then 3 (B's train slot, the last left)
        await h.api.report_demand("A", 4)
        await h.settled()
        assert h.on() == ["B", "A", "B", "A"] and h.pool.counters.cycles == cycles + 1
    log = h.board.log
    shrunk = [i for i, e in enumerate(log) if e[0] == "shrunk" and e[1] == "B"]
    expands = [i for i, e in enumerate(log) if e[0] == "expand" and e[1] == "A"]
    assert len(shrunk) == len(expands) == 2 and max(shrunk) < min(expands)
    s = h.pool.statistics()
    assert (s.shrinks, s.expands, s.failed_expands) == (2, 6, 0)


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_under_random_demands_train_steps_and_delays_no_slot_ever_holds_two_workers(seed):
    rng = random.Random(seed)
    specs = [RunSlots("A", EVERY, (0,)), RunSlots("B", EVERY, (1, 2)), RunSlots("C", (2, 3), (3,))]

    async def script(api: CheckedPool, spec: RunSlots) -> None:
        for step in range(12):
            await api.report_demand(spec.name, rng.randrange(0, 6))
            await asyncio.sleep(rng.uniform(0, 0.004))
            if rng.random() < 0.5:
                await api.acquire_train(spec.name, step)
                await asyncio.sleep(rng.uniform(0, 0.004))
                await api.release_train(spec.name, step)

    async with serving() as h:
        for spec in specs:
            await h.api.register(spec, FakeRun(lambda: rng.uniform(0, 0.003)))
        async with asyncio.timeout(10):
            async with asyncio.TaskGroup() as tg:
                for spec in specs:
                    tg.create_task(script(h.api, spec))
        await h.settled()
        assert h.board.violations == [] and h.board.on == h.pool.resident
    s, log = h.pool.statistics(), h.board.log
    assert s.shrinks > 0 and s.expands > 0 and s.failed_expands == 0
    assert s.shrinks == sum(1 for e in log if e[0] == "shrunk") and s.expands == sum(
        1 for e in log if e[0] == "expanded"
    )


# -- failures ----------------------------------------------------------------------------------
async def test_a_run_whose_shrink_fails_is_dropped_and_its_slots_go_to_the_others():
    b = FakeRun()
    async with serving() as h:
        await h.api.register(RunSlots("A", EVERY, (0, 1)), FakeRun())
        await h.api.register(RunSlots("B", EVERY, (0, 1)), b)
        await h.api.report_demand("B", 4)
        await h.settled()
        await h.api.acquire_train("A", 0)
        waiting = asyncio.create_task(h.api.acquire_train("B", 0))  # behind A's grant
        b.shrink_fails = True
        await h.api.report_demand("A", 4)  # the 2 free slots are shared 1:1: B is shrunk on one, and fails
        with pytest.raises(PoolError, match="run B left the pool"):
            await asyncio.wait_for(waiting, 1.0)
        await h.settled()
        assert h.on() == [None, None, "A", "A"]
        await h.api.release_train("A", 0)
        await h.settled()
        assert h.on() == ["A"] * 4
        assert list(h.pool.runs) == ["A"] and h.pool.counters.dropped_runs == ["B"]
        with pytest.raises(PoolError, match="no run named 'B' is in the pool .there are: A"):
            await h.api.report_demand("B", 1)
        assert h.pool.statistics().runs == 1 and "B" not in h.pool.statistics().demand


async def test_a_shrink_the_runs_side_fails_drops_nothing_and_the_slot_stays_its_until_it_leaves():
    a = FakeRun()
    async with serving() as h:
        await h.api.register(RunSlots("A", EVERY, (0,)), a)
        await h.api.register(RunSlots("B", EVERY, (0,)), FakeRun())
        await h.api.report_demand("A", 4)
        await h.settled()
        shrink = a.shrink_slot

        async def failing(slot: int, preempt: bool) -> None:
            await shrink(slot, preempt)
            raise RuntimeError("a bug in the run's shrink")

        a.shrink_slot = failing
        granting = asyncio.create_task(h.api.acquire_train("B", 0))
        await h.board.wait_until(lambda: ("died", "A", 0) in h.board.log, "A's shrink to fail")
        await asyncio.sleep(0.05)
        assert not granting.done() and list(h.pool.runs) == ["A", "B"] and h.pool.counters.dropped_runs == []
        assert h.pool.resident[0] == "A" and h.pool.statistics().failed_shrinks == 1
        await h.api.unregister("A")  # the run failed for it, and left: now its slot is free
        await asyncio.wait_for(granting, 1.0)


async def test_a_failed_expand_leaves_the_slot_empty_counted_until_the_next_change():
    a = FakeRun()
    a.expand_fails = {1}
    async with serving() as h:
        await h.api.register(RunSlots("A", EVERY, (0,)), a)
        await h.api.report_demand("A", 4)
        await h.settled()
        assert h.on() == ["A", None, "A", "A"] and h.pool.resident == {0: "A", 1: None, 2: "A", 3: "A"}
        s = h.pool.statistics()
        assert (s.expands, s.failed_expands) == (3, 1)
        assert [(st, r) for _, slot, st, r in h.pool.timeline if slot == 1][-1] == (IDLE, None)
        assert a.calls[-1] == ("shrink", 1, True)  # the failed expand was shrunk back before the slot was free
        await h.api.report_demand("A", 5)  # a change: planned again, the expand goes again (and works)
        await h.settled()
        assert h.on() == ["A"] * 4 and a.calls.count(("expand", 1)) == 2
        assert (h.pool.statistics().expands, h.pool.statistics().failed_expands) == (4, 1)


def test_register_refuses_a_name_taken_and_slots_outside_the_pool_naming_them():
    pool = PoolScheduler(4)
    pool.register(RunSlots("A", (0, 1), (0,)), FakeRun())
    with pytest.raises(PoolError, match="a run named 'A' is in the pool already"):
        pool.register(RunSlots("A", (2, 3), (2,)), FakeRun())
    with pytest.raises(PoolError, match=r"run B: slots \[-1, 4, 7\] are outside the pool's 0..3"):
        pool.register(RunSlots("B", (0, 4), (7, -1)), FakeRun())
    assert list(pool.runs) == ["A"] and pool.runs["A"].gen_slots == (0, 1)
    with pytest.raises(PoolError, match="no run named 'B' is in the pool .there are: A"):
        pool.report_demand("B", 1)
    with pytest.raises(PoolError, match="at least one slot, got 0"):
        PoolScheduler(0)
    with pytest.raises(PoolError, match="unknown pool policy 'fifo' .one of: gap_ratio, static"):
        PoolScheduler(4, "fifo")


# -- two sim controllers in one pool -----------------------------------------------------------
async def test_two_sim_runs_share_a_pool_train_exactly_once_and_never_serve_stale_or_shrunk_workers():
    board, violations = Board(4), []
    seen: dict = {}

    def watch(pool: PoolScheduler, links: list[PoolLink]) -> None:
        seen["pool"], seen["links"] = pool, links
        for link in links:
            link.pool = CheckedPool(pool, board)
            link.ctl.state.workers.trainer.keep_logs = True  # the rows trained per step (the bench drops them)
            for g in link.ctl.state.workers.generators:
                g.submit = checked_submit(link, g, violations)

    layout = layouts("heterogeneous")[0]
    assert layout.policy == "gap_ratio"
    async with asyncio.timeout(20):
        figures = await run_layout(layout, steps=3, groups=4, lookahead=1, unit_s=0.02, switch_s=0.002, watch=watch)
    pool, links = seen["pool"], seen["links"]
    assert violations == [] and board.violations == []
    for link in links:
        ctl, trainer = link.ctl, link.ctl.state.workers.trainer
        assert trainer.optimizer_steps == 3 and ctl.state.versions.served == 3
        assert [r["sync/policy_version"] for r in ctl.history] == [0, 1, 2]
        assert [g.calls_while_asleep for g in ctl.state.workers.generators] == [0] * 4
        assert [len(trained_prompts(trainer)[step]) for step in range(3)] == [4] * 3  # groups_per_step each
        await assert_clean_end(ctl, trainer, ctl.state.storage)
    # every resize the runs made was the pool's (less each worker's first shrink, out of the run at start)
    s = pool.statistics()
    els = [link.ctl.state.elastic for link in links]
    assert s.shrinks == sum(el.shrinks for el in els) - 8 and s.expands == sum(el.expands for el in els)
    assert s.shrinks > 0 and s.expands >= 4 and s.failed_expands == 0 and s.train_grants >= 2
    assert figures["resizes"] == s.shrinks + s.expands
    assert s.runs == 0 and set(s.resident.values()) == set(s.training.values()) == {None}  # both left
    assert sum(1 for e in pool.timeline if e[2] == SWITCHING) == s.shrinks + s.expands
    assert sum(1 for e in board.log if e[0] == "granted") >= s.train_grants


def checked_submit(link: PoolLink, g, violations: list[str]):
    submit, st = g.submit, link.ctl.state

    def checked(request):
        if g.name in st.elastic.out:
            violations.append(f"{request.group_id} sent to {g.name} while {st.elastic.out[g.name]}")
        held = None if g.weights_dropped else g.version
        if held != request.min_version:
            violations.append(f"{request.group_id} (v{request.min_version}) sent to {g.name} holding v{held}")
        return submit(request)

    return checked
