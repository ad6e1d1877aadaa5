"""Every remote wait has a deadline, and its error names what was awaited.

`await within(coro, seconds, "trainer.finish_train_step(step=3)")` raises `DeadlineExceeded` with that
description, instead of hanging forever or raising a bare `TimeoutError`. It is `asyncio.timeout`
underneath: an expired wait cancels what it awaited (which finishes its clean-up first), a
cancellation from anyone else passes through untouched, and a `TimeoutError` the callee raises
itself is not renamed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


class DeadlineExceeded(TimeoutError):
    """A remote call or wait did not finish in time; the message names what was awaited."""

    def __init__(self, what: str, seconds: float):
        super().__init__(f"timed out after {seconds:g}s waiting for {what}")
        self.what = what
        self.seconds = seconds


async def within(aw: Awaitable[T], seconds: float | None, what: str) -> T:
    """Await `aw` for at most `seconds` (None: no deadline, for waits bounded by something else)."""
    if seconds is None:
        return await aw
    scope = asyncio.timeout(seconds)
    try:
        async with scope:
            return await aw
    except TimeoutError:
        if scope.expired():
            raise DeadlineExceeded(what, seconds) from None
        raise  # the callee's own, or an inner deadline's
