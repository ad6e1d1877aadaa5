"""Event-driven waiting primitives: no polling, no sentinels.

- `Signal`: state owners call `notify()` after every mutation; waiters `await wait_until(pred)`,
  which re-checks `pred` once per notification and never on a timer.
- `Channel`: bounded and closable. `send` blocks while full (backpressure on the producer);
  `async for` receives until the channel is closed and empty. Sending on a closed channel raises.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


class Signal:
    """Waiters register a predicate; `notify()` schedules one check (per loop iteration, however
    many notifications arrive in it) that evaluates every registered predicate and wakes only the
    waiters whose predicate holds. A check runs after the notifying task's current step, so it sees
    every mutation made before that task's next await. A waiter whose predicate does not hold costs
    one predicate call, not a task switch; a predicate that raises wakes its waiter with the error."""

    def __init__(self) -> None:
        self._waiters: list[tuple[Callable[[], bool], asyncio.Future]] = []
        self._scheduled = False

    def notify(self) -> None:
        if self._waiters and not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._check)

    def _check(self) -> None:
        self._scheduled = False
        waiting = []
        for predicate, fut in self._waiters:
            if fut.done():  # the waiter was cancelled
                continue
            try:
                ready = predicate()
            except BaseException as e:  # the waiter re-raises it
                fut.set_exception(e)
                continue
            if ready:
                fut.set_result(None)
            else:
                waiting.append((predicate, fut))
        self._waiters = waiting

    async def wait_until(self, predicate: Callable[[], bool], *, checked: bool = False) -> None:
        """Return once `predicate()` holds. `checked`: the caller has just seen it false, so it is
        not evaluated again before the first wait (a pump's predicate runs on every state change)."""
        if not checked and predicate():
            return
        loop = asyncio.get_running_loop()
        while True:
            fut = loop.create_future()
            self._waiters.append((predicate, fut))
            await fut
            if predicate():
                return


class ChannelClosed(RuntimeError):
    """send() on a closed channel."""


@dataclass(frozen=True)
class ChannelStatistics:
    capacity: int
    size: int
    sent: int
    closed: bool


class Channel(Generic[T]):
    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError("channel capacity must be >= 1")
        self.capacity = capacity
        self._items: collections.deque[T] = collections.deque()
        self._closed = False
        self._sent = 0
        self._changed = Signal()

    async def send(self, item: T) -> None:
        await self._changed.wait_until(lambda: self._closed or len(self._items) < self.capacity)
        if self._closed:
            raise ChannelClosed("send on a closed channel")
        self._items.append(item)
        self._sent += 1
        self._changed.notify()

    def close(self) -> None:
        self._closed = True
        self._changed.notify()

    async def receive(self) -> T:
        """Next item; raises StopAsyncIteration once closed and drained."""
        await self._changed.wait_until(lambda: self._closed or bool(self._items))
        if not self._items:
            raise StopAsyncIteration
        item = self._items.popleft()
        self._changed.notify()
        return item

    def __aiter__(self) -> Channel[T]:
        return self

    async def __anext__(self) -> T:
        return await self.receive()

    def statistics(self) -> ChannelStatistics:
        return ChannelStatistics(self.capacity, len(self._items), self._sent, self._closed)
