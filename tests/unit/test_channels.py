"""`Signal`: waiters wake only when their predicate holds, checked once per burst of notifications."""

from __future__ import annotations

import asyncio

import pytest

from single_controller.channels import Signal


async def test_only_waiters_whose_predicate_holds_wake_and_one_check_serves_a_burst():
    sig, state = Signal(), {"x": 0}
    calls = {1: 0, 2: 0}
    woke: list[int] = []

    def pred(n):
        def p():
            calls[n] += 1
            return state["x"] >= n

        return p

    async def waiter(n):
        await sig.wait_until(pred(n))
        woke.append(n)

    tasks = [asyncio.create_task(waiter(n)) for n in (1, 2)]
    await asyncio.sleep(0)  # both registered (one predicate call each)
    state["x"] = 1
    for _ in range(5):  # a burst: five notifications, one check
        sig.notify()
    state["x"] = 1  # a mutation after notify in the same step is what the check sees
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert woke == [1]
    # waiter 1: on registering, by the burst's one check, by itself after waking;
    # waiter 2: on registering and by the burst's one check (five notifications, one check)
    assert calls == {1: 3, 2: 2}
    state["x"] = 2
    sig.notify()
    await asyncio.gather(*tasks)
    assert woke == [1, 2]


async def test_a_predicate_that_raises_wakes_its_waiter_with_the_error():
    sig, state = Signal(), {"boom": False}

    def pred():
        if state["boom"]:
            raise KeyError("no such group")
        return False

    task = asyncio.create_task(sig.wait_until(pred))
    await asyncio.sleep(0)
    state["boom"] = True
    sig.notify()
    with pytest.raises(KeyError, match="no such group"):
        await asyncio.wait_for(task, 1)


async def test_a_cancelled_waiter_is_dropped_and_the_others_still_wake():
    sig, state = Signal(), {"x": 0}
    gone = asyncio.create_task(sig.wait_until(lambda: state["x"] > 0))
    stays = asyncio.create_task(sig.wait_until(lambda: state["x"] > 0))
    await asyncio.sleep(0)
    gone.cancel()
    await asyncio.sleep(0)
    state["x"] = 1
    sig.notify()
    await asyncio.wait_for(stays, 1)
    assert gone.cancelled()
    assert sig._waiters == []


async def test_a_waiter_that_has_just_checked_its_predicate_is_not_checked_again_before_it_sleeps():
    sig, state, calls = Signal(), {"ready": False}, []

    def ready() -> bool:
        calls.append(state["ready"])
        return state["ready"]

    assert not ready()  # what a caller (RunState.wait_until) does before it waits
    waiter = asyncio.ensure_future(sig.wait_until(ready, checked=True))
    await asyncio.sleep(0)
    assert calls == [False] and not waiter.done()  # asleep without a second evaluation
    sig.notify()
    await asyncio.sleep(0)
    assert calls == [False, False] and not waiter.done()  # a change that does not make it true
    state["ready"] = True
    sig.notify()
    await asyncio.wait_for(waiter, 1)
    assert calls == [False, False, True, True]  # the check that woke it, and the re-check on waking
    calls.clear()
    await sig.wait_until(ready)  # unchecked: a predicate that holds returns at once
    assert calls == [True]
