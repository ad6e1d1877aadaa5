"""Where a worker process's output goes: its own file in the run directory, not the user's console.

The driver puts `SC_GRPO_LOG_DIR=<run dir>/logs` into every Ray process's environment and starts
Ray with `log_to_driver=False`; `redirect_output(name)`, first thing in a worker's constructor,
points file descriptors 1 and 2 at `<name>.log` (appended: a restarted worker adds to its file), so
C extensions and child processes land there too. Without `SC_GRPO_LOG_DIR` it does nothing.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

from single_controller import startup_trace

LOG_DIR_ENV = "SC_GRPO_LOG_DIR"
# The loggers of sc-grpo's own code (`logging.getLogger(__name__)` in each module).
PACKAGE_LOGGERS = ("single_controller", "pumps", "samplers", "replay")
FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def redirect_output(name: str) -> Path | None:
    """Send this process's stdout and stderr to `<$SC_GRPO_LOG_DIR>/<name>.log`; returns the file's
    path, or None when the variable is unset (then nothing changes). Marks the start-up trace: the
    constructor of worker `name` runs (its class's module is imported)."""
    startup_trace.mark(name, "init")
    log_dir = os.environ.get(LOG_DIR_ENV)
    if not log_dir:
        return None
    path = Path(log_dir) / f"{name}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)  # a crash loses no line already printed
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    print(f"==== {name} (pid {os.getpid()}) started {started} ====", file=sys.stderr, flush=True)
    _log_to_stderr()
    return path


class _FileHandler(logging.StreamHandler):
    """INFO and up of sc-grpo's loggers, to this process's stderr (the worker's log file)."""


def _log_to_stderr() -> None:
    handler = _FileHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FILE_FORMAT))
    for name in PACKAGE_LOGGERS:
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if isinstance(h, _FileHandler)]:
            logger.removeHandler(old)
        logger.addHandler(handler)
        logger.propagate = False  # a handler Ray or a library put on the root logger would write it twice
        if logger.level == logging.NOTSET or logger.level > logging.INFO:
            logger.setLevel(logging.INFO)
