"""`protocols.FinishAndBegin` for a trainer group: the next step begun behind a finish in flight.

`BehindFinish` holds what the decision needs: the step whose finish is in flight (`finishing`), the
step of the last finish that succeeded (`finished_last`) and the calls sent behind the finish
(`behind`). A group calls `start(step)` when it sends a finish, `end()` when the finish's answer is
in (or it failed), and `succeeded(step)` after a finish that succeeded; `begin(...)` is its
`begin_behind_finish`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from single_controller.protocols import TrainerGroup, TrainStepStateError
from single_controller.types import LossConfig, TrainChunk


class BehindFinish:
    def __init__(self) -> None:
        self.finishing: int | None = None  # the step whose finish is in flight
        self.finished_last: int | None = None  # the step of the last finish that succeeded
        self.behind: list[Any] = []  # the next step's begin and chunk, sent behind the finish

    def start(self, step: int) -> None:
        self.finishing, self.behind = step, []

    def end(self) -> list[Any]:
        """The finish is over (whatever its outcome): returns what was sent behind it."""
        behind, self.finishing, self.behind = self.behind, None, []
        return behind

    def succeeded(self, step: int) -> None:
        self.finished_last = step

    async def begin(
        self,
        group: TrainerGroup,
        step: int,
        loss: LossConfig,
        chunk: TrainChunk,
        *,
        idle: bool,
        send_behind: Callable[[], list[Any]],
    ) -> bool:
        """Begin `step` with `chunk` behind the finish of `step - 1` in flight (`send_behind()`), or,
        when that finish succeeded already and `group` is `idle` (no step open), at once (a plain
        begin and microbatch on `group`). Returns whether anything was sent."""
        if chunk.step != step:
            raise ValueError(f"begin_behind_finish({step}): the chunk belongs to step {chunk.step}")
        if self.finishing is None:
            if not idle or self.finished_last != step - 1:
                return False  # no finish of step - 1 in flight, nor one that succeeded: nothing sent
            await group.begin_train_step(step, loss)
            await group.train_microbatch(chunk)
            return True
        if self.finishing != step - 1 or self.behind:
            raise TrainStepStateError(f"begin_behind_finish({step}) while finishing step {self.finishing}")
        self.behind = send_behind()  # taken over by the finish when it succeeds
        return True
