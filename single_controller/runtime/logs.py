"""What the console shows of sc-grpo's components: their `logging` records, by verbosity.

Every module logs through `logging.getLogger(__name__)`. `console_logging(v)` shows sc-grpo's own
packages (`PACKAGE_LOGGERS`) on stderr: WARNING and up by default, INFO with `-v`, DEBUG with `-vv`,
and restores the loggers on exit. `run_log(path)` keeps `run.log` in the run directory: what the
console showed (the `sc_grpo.*` line loggers, which never reach the console through `logging`), the
sample completions, and the components' INFO and up. Workers log to their files instead.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from single_controller.backends.common.worker_logs import FILE_FORMAT, PACKAGE_LOGGERS

QUIET_FORMAT = "sc-grpo: %(message)s"
LEVELS = (logging.WARNING, logging.INFO, logging.DEBUG)
RUN_LOG = "run.log"
LINES_LOGGER = "sc_grpo"  # the parent of the console lines' loggers

_lines = logging.getLogger(LINES_LOGGER)
_lines.addHandler(logging.NullHandler())  # outside `run_log`, nowhere (not Python's last-resort stderr)
_lines.propagate = False  # a handler on the root logger (a library's, a test's) never prints them again
_lines.setLevel(logging.INFO)


def line_logger(component: str) -> logging.Logger:
    """`sc_grpo.<component>`: the logger of `component`'s console lines, for run.log (see the docstring)."""
    return logging.getLogger(f"{LINES_LOGGER}.{component}")


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
    with _attached(handler, PACKAGE_LOGGERS, lambda logger: level):
        yield


@contextlib.contextmanager
def run_log(path: str | Path) -> Iterator[None]:
    """For the body, append the console lines (`line_logger`) and sc-grpo's components' INFO and up
    (`PACKAGE_LOGGERS`) to the file `path`, one record a line (a sample's record spans several). A
    logger quieter than INFO is made INFO for the body; the console's handler keeps its own level."""
    handler = logging.FileHandler(path, encoding="utf-8")  # appends: a resumed run continues the file
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter(FILE_FORMAT))
    try:
        with _attached(
            handler, (LINES_LOGGER, *PACKAGE_LOGGERS), lambda logger: min(logger.getEffectiveLevel(), logging.INFO)
        ):
            yield
    finally:
        handler.close()


@contextlib.contextmanager
def _attached(
    handler: logging.Handler, names: Sequence[str], level_of: Callable[[logging.Logger], int]
) -> Iterator[None]:
    """`handler` on the loggers `names` for the body, each at `level_of(logger)`; levels restored after."""
    saved = []
    for name in names:
        logger = logging.getLogger(name)
        saved.append((logger, logger.level))
        logger.setLevel(level_of(logger))
        logger.addHandler(handler)
    try:
        yield
    finally:
        for logger, old_level in saved:
            logger.removeHandler(handler)
            logger.setLevel(old_level)
