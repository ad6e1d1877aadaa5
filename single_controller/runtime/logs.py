"""What the console shows of sc-grpo's components: their `logging` records, by verbosity.

Every module logs through `logging.getLogger(__name__)`, so a record names its component
(`single_controller.runtime.ray_session`, `replay.transferqueue.runtime`, ...). `console_logging(v)`
is how a command of the CLI shows them on stderr while it runs:
- v = 0: WARNING and up, as `sc-grpo: <message>`, beside sc-grpo's own console lines (`runtime.console`);
- v = 1 (`-v`): INFO and up, v >= 2 (`-vv`): DEBUG and up, each with its time, level and component.
Only sc-grpo's own packages are shown (`PACKAGE_LOGGERS`), not the libraries'. On exit the loggers
are as they were. Worker processes log to their files instead (`backends.common.worker_logs`).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

from single_controller.backends.common.worker_logs import FILE_FORMAT, PACKAGE_LOGGERS

QUIET_FORMAT = "sc-grpo: %(message)s"
LEVELS = (logging.WARNING, logging.INFO, logging.DEBUG)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is when a record comes (a test's capture, a redirection)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> object:  # the StreamHandler attribute, read at each record
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass


@contextlib.contextmanager
def console_logging(verbosity: int = 0) -> Iterator[None]:
    """Show sc-grpo's log records on stderr for the body, per `verbosity` (see the module docstring)."""
    level = LEVELS[min(max(verbosity, 0), len(LEVELS) - 1)]
    handler = _StderrHandler()
    handler.setLevel(level)
    handler.setFormatter(logging.Formatter(QUIET_FORMAT if verbosity <= 0 else FILE_FORMAT))
    saved = []
    for name in PACKAGE_LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, logger.level))
        logger.setLevel(level)
        logger.addHandler(handler)
    try:
        yield
    finally:
        for logger, old_level in saved:
            logger.removeHandler(handler)
            logger.setLevel(old_level)
