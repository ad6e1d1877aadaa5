"""Learning-rate schedules: the lr of RL step s as a pure function of s (`lr_at`).

Every trainer sets its optimizer's lr to `lr_at(step, schedule)` right before the optimizer step,
so a resumed run trains each step with exactly the lr of an uninterrupted run. With W warmup steps,
T = max_steps and m = min_lr_ratio: linear warmup lr * (s + 1) / W for s < W, then `constant` lr,
`linear` lr * (1 - (1 - m) * p) or `cosine` lr * (m + (1 - m) * (1 + cos(pi p)) / 2), with
p = (s - W) / (T - 1 - W) clipped to [0, 1]: the last step trains with m * lr.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

LR_SCHEDULES = ("constant", "linear", "cosine")
DECAYING = ("linear", "cosine")


@dataclass(frozen=True)
class LrSchedule:
    """`train.lr`, `train.lr_schedule`, `train.warmup_steps`, `train.min_lr_ratio` and the decay horizon
    (`run.max_steps`; None is accepted for `constant` only)."""

    lr: float
    kind: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    total_steps: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in LR_SCHEDULES:
            raise ValueError(f"lr schedule must be one of {LR_SCHEDULES}, got {self.kind!r}")
        if self.warmup_steps < 0 or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"warmup_steps {self.warmup_steps} < 0 or min_lr_ratio {self.min_lr_ratio} not in [0, 1]")
        if self.kind in DECAYING and (self.total_steps is None or self.total_steps < self.warmup_steps + 2):
            raise ValueError(
                f"a {self.kind} lr schedule decays over the run's max_steps after {self.warmup_steps} warmup steps: "
                f"it needs max_steps >= warmup_steps + 2, got {self.total_steps}"
            )


def lr_at(step: int, s: LrSchedule) -> float:
    """The learning rate of optimizer step `step` (0-based) under `s` (see the module docstring)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    if s.kind == "constant":
        return s.lr
    assert s.total_steps is not None  # LrSchedule refuses a decaying schedule without one
    p = min(1.0, (step - s.warmup_steps) / (s.total_steps - 1 - s.warmup_steps))
    m = s.min_lr_ratio
    if s.kind == "linear":
        return s.lr * (1.0 - (1.0 - m) * p)
    return s.lr * (m + (1.0 - m) * 0.5 * (1.0 + math.cos(math.pi * p)))
