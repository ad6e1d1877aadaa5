"""What is wrong with a configuration: `Problem` (one finding) and `ConfigError` (all of them).

Every stage of loading (reading, types and bounds, cross-field rules, checks of this machine) returns
`Problem`s instead of raising, so that one `ConfigError` lists everything at once; its `str()` is the
readable multi-line report the CLI prints (no traceback needed).
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ConfigError", "Problem"]


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a configuration: the dotted key(s) involved and what is wrong."""

    paths: tuple[str, ...]
    message: str
    source: str = ""  # where the offending value came from (a file or an override), if known

    def __str__(self) -> str:
        where = f" (in {self.source})" if self.source else ""
        return f"{self.message}{where}"


class ConfigError(ValueError):
    """Every problem found in a configuration; `str()` is a readable multi-line report."""

    def __init__(self, problems: Sequence[Problem], origin: str = "configuration"):
        self.problems: tuple[Problem, ...] = tuple(problems)
        self.origin = origin
        n = len(self.problems)
        lines = [f"invalid {origin}: {n} problem{'s' if n != 1 else ''}"]
        lines += [_indent_bullet(str(p)) for p in self.problems]
        super().__init__("\n".join(lines))


def _indent_bullet(text: str, width: int = 100) -> str:
    """`  - text`, wrapped at `width` with continuation lines indented under the text."""
    out: list[str] = []
    for i, line in enumerate(text.splitlines() or [""]):
        out += textwrap.wrap(
            line,
            width=width,
            initial_indent="  - " if i == 0 else "    ",
            subsequent_indent="    ",
            break_long_words=False,
            break_on_hyphens=False,
        ) or ["    "]
    return "\n".join(out)
