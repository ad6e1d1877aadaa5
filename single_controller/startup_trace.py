"""Marks of a run's start-up, by process, for `sc-grpo bench startup`.

With `SC_GRPO_STARTUP_TRACE=<file>` in the environment (the driver hands it on to every Ray process
of the run), `mark(role, what)` appends one JSON line `{"t", "pid", "role", "what"}` to that file;
the first mark of a process also records when the process itself was created (`spawned`), so a
split shows each process's spawn, imports and set-up side by side. Without the variable it does
nothing and costs one environment lookup. Lines are short single `write`s to a file opened for
appending, so processes never interleave within a line.
"""

from __future__ import annotations

import json
import os
import time

TRACE_ENV = "SC_GRPO_STARTUP_TRACE"
_marked_spawn: set[int] = set()


def mark(role: str, what: str) -> None:
    path = os.environ.get(TRACE_ENV)
    if not path:
        return
    now = time.time()
    lines = []
    pid = os.getpid()
    if pid not in _marked_spawn:
        _marked_spawn.add(pid)
        created = process_created()
        if created is not None:
            lines.append({"t": created, "pid": pid, "role": role, "what": "spawned"})
    lines.append({"t": now, "pid": pid, "role": role, "what": what})
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(line) + "\n" for line in lines))


def process_created() -> float | None:
    """When this process was created (wall clock, ~10 ms resolution), from /proc; None elsewhere."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            ticks = int(f.read().rpartition(")")[2].split()[19])
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
    except (OSError, IndexError, ValueError):
        return None
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def read_marks(path: str) -> list[dict]:
    """The marks written to `path`, oldest first."""
    with open(path, encoding="utf-8") as f:
        return sorted((json.loads(line) for line in f if line.strip()), key=lambda m: m["t"])
