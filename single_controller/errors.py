"""An error said in one readable paragraph, wherever it was raised."""

from __future__ import annotations

import sys


def error_text(e: BaseException) -> str:
    """`Type: message` of an error, one paragraph. An error raised inside a Ray actor reaches here as
    Ray's task error, whose text is the whole remote traceback: it is said as its cause (the
    exception the actor raised) and the actor method it came from; the traceback goes to error.log.
    An exception group (errors that failed together, e.g. two tasks of one TaskGroup) is said as
    each of its errors, nested groups flattened: its own text only counts them."""
    if isinstance(e, BaseExceptionGroup):
        leaves = [error_text(leaf) for leaf in leaf_errors(e)]
        return leaves[0] if len(leaves) == 1 else f"{len(leaves)} errors together: " + "; ".join(leaves)
    exc_mod = sys.modules.get("ray.exceptions")
    if exc_mod is not None and isinstance(e, exc_mod.RayTaskError):
        cause = getattr(e, "cause", None)
        if isinstance(cause, BaseException):
            where = getattr(e, "function_name", None)
            return f"{error_text(cause)}" + (f" (in {where})" if where else "")
    if exc_mod is not None and isinstance(e, exc_mod.RayActorError) and "\n" in str(e):
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        if getattr(e, "actor_init_failed", False):  # the message ends with the remote traceback's last line
            return f"{type(e).__name__}: an actor's __init__ failed: {lines[-1]}"
        return f"{type(e).__name__}: " + "; ".join(lines)
    return f"{type(e).__name__}: {e}"


def leaf_errors(e: BaseException) -> list[BaseException]:
    """The errors inside `e`, in order, nested exception groups flattened (`e` itself if no group)."""
    if not isinstance(e, BaseExceptionGroup):
        return [e]
    return [leaf for sub in e.exceptions for leaf in leaf_errors(sub)]
