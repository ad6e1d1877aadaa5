"""Worker actors on Ray, controller side: what every backend does the same way with its actors.

* `kill_all(handles)` stops actors for good: each closes (loops stopped, process groups left), then
  exits by itself (queued behind its close), and `ray.kill` is the backstop.
* `first_line(error)` is the one line of a (possibly multi-line, Ray-wrapped) error that messages quote.
* `EarlyCancels`: on the actor's side, the groups whose `cancel` ran before their request arrived.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import ray


class EarlyCancels:
    """Groups a generation actor was told to cancel before it ever saw their request: an async Ray
    actor does not start calls in the order they were sent, so the controller's `cancel(g)` can run
    before the `generate_many` carrying `g`. The group is refused when it arrives (`take`), so no row
    of it is written after the controller cleared its keys. Bounded (`limit`, oldest forgotten): a
    cancel of a group already answered leaves an entry nothing will take."""

    def __init__(self, limit: int = 4096):
        self._ids: OrderedDict[str, None] = OrderedDict()
        self.limit = limit

    def add(self, group_id: str) -> None:
        self._ids[group_id] = None
        while len(self._ids) > self.limit:
            self._ids.popitem(last=False)

    def take(self, group_id: str) -> bool:
        """Whether `group_id` was cancelled before it arrived (and forget it)."""
        if group_id in self._ids:
            del self._ids[group_id]
            return True
        return False


def first_line(e: BaseException) -> str:
    """The first line of a (possibly multi-line, Ray-wrapped) error message. An error raised in an
    actor's method (`RayTaskError`, whose own first line only names the method and the process) gives
    its cause's: `SyncGroupError: weight-sync group ...`."""
    cause = getattr(e, "cause", None) if isinstance(e, ray.exceptions.RayTaskError) else None
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {first_line(cause)}"
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


async def kill_all(handles: Sequence[Any]) -> None:
    """Close each actor (stop loops, leave the gloo group), let it exit after that, and wait for the
    exit; ray.kill remains as a backstop. After this returns every call to these handles fails."""
    closes = [h.close.remote() for h in handles]
    first_error: Exception | None = None
    for ref in closes:
        try:
            await ref
        except ray.exceptions.RayActorError:
            continue  # already dead: nothing left to close
        except Exception as e:  # still stop every actor, then report the first failure
            first_error = first_error or e
    # Queued behind close(): the actor exits itself, so no call can slip in before its death.
    exits = [h.__ray_terminate__.remote() for h in handles]
    for ref in exits:
        with contextlib.suppress(ray.exceptions.RayActorError):  # the expected outcome: the actor is gone
            await ref
    for h in handles:
        ray.kill(h)
    if first_error is not None:
        raise first_error
