"""Every remote wait has a deadline, and its error names what was awaited.

`await within(coro, seconds, "trainer.finish_train_step(step=3)")` raises `DeadlineExceeded` with that
description, instead of hanging forever or raising a bare `TimeoutError`.

The controller awaits one remote call per prompt group (thousands per step at scale), each with
a deadline. `asyncio.timeout` gives every one its own timer in the event loop's heap. Here, the
waits that share a timeout share one timer: their deadlines fall in the order they began, so
they queue in that order, and the timer only ever fires for the oldest one. Beginning and ending
a wait costs a queue insert and removal. An expired wait is cancelled exactly as
`asyncio.timeout` does it, and a cancellation of someone else's passes through untouched.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import OrderedDict
from typing import Awaitable, TypeVar

T = TypeVar("T")


class DeadlineExceeded(TimeoutError):
    """A remote call or wait did not finish in time; the message names what was awaited."""

    def __init__(self, what: str, seconds: float):
        super().__init__(f"timed out after {seconds:g}s waiting for {what}")
        self.what = what
        self.seconds = seconds


class _Wait:
    __slots__ = ("task", "deadline", "cancelling", "expired")

    def __init__(self, task: asyncio.Task, deadline: float):
        self.task = task
        self.deadline = deadline
        self.cancelling = task.cancelling()
        self.expired = False


class _Queue:
    """The waits with one timeout, oldest first, and one timer for the oldest."""

    __slots__ = ("seconds", "waits", "timer")

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.waits: OrderedDict[_Wait, None] = OrderedDict()
        self.timer: asyncio.TimerHandle | None = None

    def add(self, task: asyncio.Task, loop: asyncio.AbstractEventLoop) -> _Wait:
        w = _Wait(task, loop.time() + self.seconds)
        self._push(w, loop)
        return w

    def _push(self, w: _Wait, loop: asyncio.AbstractEventLoop) -> None:
        self.waits[w] = None
        if self.timer is None:
            self.timer = loop.call_at(w.deadline, self._fire, loop)

    def _fire(self, loop: asyncio.AbstractEventLoop) -> None:
        self.timer = None
        now = loop.time()
        while self.waits:
            w = next(iter(self.waits))
            if w.deadline > now:
                self.timer = loop.call_at(w.deadline, self._fire, loop)
                return
            del self.waits[w]
            w.expired = True
            w.task.cancel()


# Each event loop's queues, by timeout; forgotten with the loop (a queue holds no reference to it).
_queues: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[float, _Queue]] = weakref.WeakKeyDictionary()
# The last loop's queues, looked up without the weak dictionary's Python-level `get` (a process
# mostly runs one loop; a call on another loop replaces the entry). A weak reference: the cache
# keeps no loop alive.
_last: tuple[weakref.ref, dict[float, _Queue]] | None = None


def _loop_queues(loop: asyncio.AbstractEventLoop) -> dict[float, _Queue]:
    global _last
    last = _last
    if last is not None and last[0]() is loop:
        return last[1]
    queues = _queues.get(loop)
    if queues is None:
        queues = _queues[loop] = {}
    _last = (weakref.ref(loop), queues)
    return queues


def _queue(loop: asyncio.AbstractEventLoop, seconds: float) -> _Queue:
    """The loop's queue of the waits with this timeout (created on first use)."""
    queues = _loop_queues(loop)
    q = queues.get(seconds)
    if q is None:
        q = queues[seconds] = _Queue(seconds)
    return q


class Expiry(_Wait):
    """A future's deadline (`cancel_after`): `settle` it once the future is done."""

    __slots__ = ("queue",)

    def __init__(self, fut: asyncio.Future, deadline: float, queue: _Queue):
        self.task, self.deadline, self.cancelling, self.expired = fut, deadline, 0, False
        self.queue = queue

    def settle(self) -> bool:
        """Forget the deadline; returns whether it expired (then it cancelled the future, unless
        the future was done already)."""
        self.queue.waits.pop(self, None)
        return self.expired


def cancel_after(fut: asyncio.Future, seconds: float | None) -> Expiry | None:
    """Cancel `fut` unless it is done within `seconds` (None: no deadline): `within` for a future
    whose done callback does the waiter's work, so no task waits on it. Shares `within`'s one
    timer per timeout value. The callback calls `settle()` on the handle, which says whether the
    deadline is what cancelled the future."""
    if seconds is None:
        return None
    loop = asyncio.get_running_loop()
    q = _queue(loop, seconds)
    e = Expiry(fut, loop.time() + seconds, q)
    q._push(e, loop)
    return e


async def within(aw: Awaitable[T], seconds: float | None, what: str) -> T:
    """Await `aw` for at most `seconds` (None: no deadline, for waits bounded by something else)."""
    if seconds is None:
        return await aw
    task = asyncio.current_task()
    if task is None:
        raise RuntimeError(f"within() must run inside a task (waiting for {what})")
    loop = asyncio.get_running_loop()
    q = _queue(loop, seconds)
    w = q.add(task, loop)
    try:
        return await aw
    except asyncio.CancelledError:
        if w.expired:
            w.expired = False  # settled here, not again below
            if task.uncancel() <= w.cancelling:  # nobody else cancelled the task: the deadline did
                raise DeadlineExceeded(what, seconds) from None
        raise
    finally:
        if w.expired:  # expired, but the wait ended otherwise (its result was already on the way)
            task.uncancel()
        else:
            q.waits.pop(w, None)
