"""`within`: a deadline per wait that names what was awaited, and behaves as `asyncio.timeout` does."""

import asyncio

import pytest

from single_controller.deadlines import DeadlineExceeded, within


async def test_of_many_waits_only_the_late_ones_expire():
    gates = [asyncio.Event() for _ in range(200)]

    async def wait(i):
        return await within(gates[i].wait(), 0.2, f"gate {i}")

    tasks = [asyncio.create_task(wait(i)) for i in range(200)]
    await asyncio.sleep(0.01)
    for i in range(0, 200, 2):  # the even ones end in time
        gates[i].set()
    done = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(d is True for d in done[0::2])
    late = done[1::2]
    assert all(isinstance(e, DeadlineExceeded) for e in late)
    assert str(late[0]) == "timed out after 0.2s waiting for gate 1"
    assert all(t.cancelling() == 0 for t in tasks)


async def test_deadlines_fire_in_order_for_waits_begun_at_different_times():
    t0 = asyncio.get_running_loop().time()
    ended: dict[str, float] = {}

    async def wait(name, delay):
        await asyncio.sleep(delay)
        try:
            await within(asyncio.Event().wait(), 0.1, name)
        except DeadlineExceeded:
            ended[name] = asyncio.get_running_loop().time() - t0

    await asyncio.gather(wait("a", 0.0), wait("b", 0.05), wait("c", 0.12))
    # Each wait's deadline counts from its own start (none expires early on an older wait's timer),
    # and none waits for much more (a loaded machine may run the loop late, never early).
    assert 0.10 <= ended["a"] < ended["b"] < ended["c"]
    assert ended["b"] >= 0.15 and ended["c"] >= 0.22
    assert ended["c"] < 0.22 + 0.5


async def test_a_cancellation_from_outside_is_not_renamed_a_deadline():
    started = asyncio.Event()

    async def wait():
        started.set()
        await within(asyncio.Event().wait(), 5.0, "never")

    task = asyncio.create_task(wait())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_an_outside_cancel_that_lands_with_the_deadline_stays_a_cancel():
    fut = asyncio.get_running_loop().create_future()
    # When the deadline cancels the awaited future, this callback runs before the task resumes:
    # someone else cancels the task in the same moment, and that cancel must win.
    fut.add_done_callback(lambda _f: task.cancel())
    task = asyncio.create_task(within(fut, 0.02, "raced"))
    with pytest.raises(asyncio.CancelledError):
        await task
    assert fut.cancelled()


async def test_nested_waits_each_report_their_own_deadline():
    async def inner():
        return await within(asyncio.Event().wait(), 0.05, "inner call")

    with pytest.raises(DeadlineExceeded, match="inner call"):
        await within(inner(), 1.0, "outer call")

    async def slow():
        await asyncio.sleep(0.2)

    with pytest.raises(DeadlineExceeded, match="outer call"):
        await within(within(slow(), 1.0, "inner call"), 0.05, "outer call")
    assert asyncio.current_task().cancelling() == 0


async def test_a_callee_timeout_error_is_not_ours_to_rename():
    async def raises():
        raise TimeoutError("the callee's own")

    with pytest.raises(TimeoutError, match="the callee's own") as e:
        await within(raises(), 1.0, "x")
    assert not isinstance(e.value, DeadlineExceeded)


async def test_a_task_keeps_waiting_normally_after_one_of_its_waits_expired():
    with pytest.raises(DeadlineExceeded):
        await within(asyncio.Event().wait(), 0.01, "first")
    assert await within(asyncio.sleep(0.01, result=7), 0.5, "second") == 7
    await asyncio.sleep(0.6)  # the first wait's timer is long gone: nothing cancels us now


async def test_each_event_loop_fires_its_own_deadlines():
    """Another loop (another thread's, or the next test's) gets deadlines that fire on its own loop."""
    with pytest.raises(DeadlineExceeded, match="here"):
        await within(asyncio.sleep(5), 0.01, "here")

    def another_loop():
        async def main():
            with pytest.raises(DeadlineExceeded, match="there"):
                await within(asyncio.sleep(5), 0.01, "there")

        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(main())
        finally:
            loop.close()

    await asyncio.wait_for(asyncio.to_thread(another_loop), 10)
    with pytest.raises(DeadlineExceeded, match="here again"):
        await within(asyncio.sleep(5), 0.01, "here again")
