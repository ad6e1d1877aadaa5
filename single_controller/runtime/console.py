"""The console of `sc-grpo run`: sc-grpo's own lines and nothing else.

`say(message)` writes one `sc-grpo: <message>` line (stdout; stderr with `err=True`), also kept as a
log record of `sc_grpo.driver` in `run.log`. `ConsoleReporter(cfg)` prints one line per step and eval
point, with a progress bar on a terminal (`run.progress_bar`). Components' diagnostics go through
`logging` (`runtime.logs`, `sc-grpo run -v`); worker output goes to files (`backends.common.worker_logs`).
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Mapping
from typing import Any, TextIO

from single_controller.config.schema import Config
from single_controller.runtime.logs import line_logger
from single_controller.runtime.records import EVAL_VERSION_KEY, STEP_KEY

__all__ = ["ConsoleReporter", "format_eval_line", "format_step_line", "say"]

_driver_lines = line_logger("driver")


def say(message: str, *, err: bool = False) -> None:
    """`sc-grpo: <message>` on stdout (stderr with `err`), flushed at once; also to run.log."""
    print(f"sc-grpo: {message}", file=sys.stderr if err else sys.stdout, flush=True)
    _driver_lines.log(logging.WARNING if err else logging.INFO, message)


# (metric key, label, format) in the order they appear on a step line
_LINE_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("rollout/reward_mean", "reward", "{:.3f}"),
    ("rollout/success_rate", "success", "{:.3f}"),
    ("train/staleness_mean", "staleness", "{:.2f}"),
    ("time/step_s", "step_time", "{:.2f}s"),
    ("throughput/train_tokens_per_s", "tokens/s", "{:,.0f}"),
)


def format_step_line(record: Mapping[str, Any], max_steps: int | None = None, step: int | None = None) -> str:
    """`step 12/400 | reward 0.512 | success 0.250 | staleness 0.50 | step_time 1.23s | tokens/s 1,234`;
    fields whose key is missing (or not a number) are left out."""
    step = record.get(STEP_KEY, step)
    width = len(str(max_steps)) if max_steps else 0
    head = f"step {step:>{width}}" if step is not None else "step ?"
    if max_steps:
        head += f"/{max_steps}"
    parts = [head]
    for key, label, fmt in _LINE_FIELDS:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            parts.append(f"{label} {fmt.format(value)}")
    return " | ".join(parts)


def format_eval_line(record: Mapping[str, Any]) -> str:
    """`eval v10 | accuracy 0.953 | reward 0.981 | pass@1 0.953 | 64 prompts | 0.12s | reissued 3`."""
    parts = [f"eval v{record.get(EVAL_VERSION_KEY, '?')}"]
    for key, value in record.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            continue
        if key == "eval/accuracy":
            parts.append(f"accuracy {value:.3f}")
        elif key == "eval/reward_mean":
            parts.append(f"reward {value:.3f}")
        elif key.startswith("eval/pass@"):
            parts.append(f"{key.removeprefix('eval/')} {value:.3f}")
    if isinstance(record.get("eval/prompts"), (int, float)):
        parts.append(f"{record['eval/prompts']:.0f} prompts")
    if isinstance(record.get("eval/seconds"), (int, float)):
        parts.append(f"{record['eval/seconds']:.2f}s")
    if record.get("eval/reissued"):
        parts.append(f"reissued {record['eval/reissued']}")
    return " | ".join(parts)


class ConsoleReporter:
    """One line per step, and a tqdm bar over max_steps when `stream` is a terminal.

    `ConsoleReporter(cfg)` takes max_steps and the bar switch from `cfg.run`; `ConsoleReporter(n,
    progress_bar=...)` sets them directly.
    """

    def __init__(
        self,
        run: Config | int,
        *,
        progress_bar: bool | None = None,
        stream: TextIO | None = None,
        prefix: str = "",
    ):
        from tqdm import tqdm

        if isinstance(run, Config):
            max_steps = run.run.max_steps
            progress_bar = run.run.progress_bar if progress_bar is None else progress_bar
        else:
            max_steps = int(run)
            progress_bar = True if progress_bar is None else progress_bar
        self.max_steps = max_steps
        self.prefix = prefix  # before every line (the runs of a pool share one console)
        self.stream = stream if stream is not None else sys.stdout
        is_tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.bar_enabled = progress_bar and is_tty
        self._reported = 0
        self._bar = tqdm(
            total=max_steps,
            file=self.stream,
            disable=not self.bar_enabled,
            unit="step",
            dynamic_ncols=True,
            leave=False,
        )

    def step(self, record: Mapping[str, Any]) -> str:
        """Print the step's line (above the bar) and advance the bar; returns the line."""
        self._reported += 1
        line = self.prefix + format_step_line(record, self.max_steps, step=self._reported)
        if self.bar_enabled:
            self._bar.write(line, file=self.stream)
            self._bar.update(1)  # one record per step
        else:
            print(line, file=self.stream, flush=True)
        return line

    def eval(self, record: Mapping[str, Any]) -> str:
        """Print an eval point's line (above the bar, which does not advance); returns the line."""
        line = self.prefix + format_eval_line(record)
        if self.bar_enabled:
            self._bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)
        return line

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> ConsoleReporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
