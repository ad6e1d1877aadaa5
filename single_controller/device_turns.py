"""Colocated turns (`backend.colocate_form: turns`): generation and training take the device in turns,
a whole phase at a time.

Before a train step begins (`StepHooks.before_train`) every generation worker is shrunk
(`elastic.shrink`: out of routing, its groups in flight aborted or drained per `rollout.shrink`,
then asleep at `rollout.sleep_level`: vLLM frees its KV cache and weights) and the trainer takes
back what `train.offload` moved to host memory. Once the step's weights are published
(`StepHooks.after_sync`) the trainer offloads again and every worker is expanded: woken, given the
published weights, version-checked, routed to. A step that began under the turn before that (its
groups were all ready already: the train pump selects a step whole) keeps the device for training:
the handover waits for the next weights.

Nothing else changes: the step selects its groups whole (as in a pool), the staleness bound, the
ledger and the weight-sync policy are the run's own; a worker that dies asleep is restarted asleep.
The train pump waits on `before_train` under its own name ("train slots / device turn"), so a switch
that hangs surfaces like any other wait.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass, field

from single_controller import elastic
from single_controller.deadlines import within
from single_controller.protocols import Offloadable
from single_controller.state import RunState

log = logging.getLogger(__name__)


@dataclass
class TurnsRecord:
    """What the turns did, for the step record and the tests: `events` in order, e.g.
    ("sleep", 0), ("onload", 0), ("offload", 1), ("wake", 1): (what, step or version)."""

    holder: str = "generate"  # who has the device now
    to_train: int = 0
    to_generate: int = 0
    kept_for_training: int = 0  # weights published while a later step had begun: no handover then
    sleep_s: float = 0.0  # shrinking the workers (their sleep included)
    wake_s: float = 0.0  # expanding them (wake, weights, version check)
    offload_s: float = 0.0
    onload_s: float = 0.0
    offloaded_bytes: int = 0  # the last offload's
    # the newest switches (bounded: the controller's memory stays flat over a long run)
    events: collections.deque[tuple[str, int]] = field(default_factory=lambda: collections.deque(maxlen=256))

    def step_record(self) -> dict[str, float]:
        return {
            "turns/to_train": self.to_train,
            "turns/to_generate": self.to_generate,
            "turns/kept_for_training": self.kept_for_training,
            "turns/sleep_s": self.sleep_s,
            "turns/wake_s": self.wake_s,
            "turns/offload_s": self.offload_s,
            "turns/onload_s": self.onload_s,
            "turns/offloaded_bytes": self.offloaded_bytes,
        }


class DeviceTurns:
    """The run's side of colocated turns; `install()` puts it into the train and weight-sync pumps."""

    def __init__(self, state: RunState):
        self.state = state
        cfg = state.cfg
        self.level = cfg.rollout.sleep_level
        self.offload = cfg.train.offload
        self.record = TurnsRecord()
        self._lock = asyncio.Lock()  # one switch at a time
        self._last_begun = -1  # the newest step that began under the training turn

    @classmethod
    def of_run(cls, state: RunState) -> DeviceTurns | None:
        """The run's turns, installed (`backend.colocate_form: turns`), or None."""
        backend = state.cfg.backend
        if not (backend.colocate and backend.colocate_form == "turns"):
            return None
        turns = cls(state)
        turns.install()
        return turns

    def install(self) -> None:
        hooks = self.state.hooks
        if hooks.before_train is not None or hooks.after_sync is not None:
            raise RuntimeError("colocated turns and a pool both want the train hooks: a run has one or the other")
        hooks.before_train = self.to_train
        hooks.after_sync = self.after_sync

    def _names(self) -> list[str]:
        return [w.name for w in self.state.workers.generators]

    async def to_train(self, step: int) -> None:
        """The device to the trainer, before `step` begins (a no-op while the trainer has it)."""
        st, rec = self.state, self.record
        async with self._lock:
            self._last_begun = max(self._last_begun, step)
            if rec.holder == "train":
                return
            t0 = st.clock()
            for name in self._names():
                await elastic.shrink(st, name, self.level)
            rec.sleep_s += st.clock() - t0
            rec.events.append(("sleep", step))
            if self.offload != "none":
                moved = await within(self._trainer().onload(), st.cfg.timeouts.train_call_s, "trainer.onload")
                rec.onload_s += moved.seconds
                rec.events.append(("onload", step))
            rec.holder = "train"
            rec.to_train += 1
        log.debug("device turn to training before step %d", step)

    async def after_sync(self, version: int) -> None:
        """After weights `version` are published (no worker is in routing to apply them): the device
        back to generation, the workers woken with those weights; unless step `version` has begun."""
        st, rec = self.state, self.record
        async with self._lock:
            if rec.holder == "generate":
                return
            if self._last_begun >= version:  # step `version` (or later) is training already
                rec.kept_for_training += 1
                return
            if self.offload != "none":
                what = f"trainer.offload({self.offload})"
                moved = await within(self._trainer().offload(self.offload), st.cfg.timeouts.train_call_s, what)
                rec.offload_s += moved.seconds
                rec.offloaded_bytes = moved.num_bytes
                rec.events.append(("offload", version))
            t0 = st.clock()
            for name in self._names():
                await elastic.expand(st, name)
            rec.wake_s += st.clock() - t0
            rec.events.append(("wake", version))
            rec.holder = "generate"
            rec.to_generate += 1
        log.debug("device turn to generation at v%d", version)

    def _trainer(self) -> Offloadable:
        trainer = self.state.workers.trainer
        if not isinstance(trainer, Offloadable):
            raise TypeError(f"train.offload={self.offload}: the trainer ({type(trainer).__name__}) cannot offload")
        return trainer
