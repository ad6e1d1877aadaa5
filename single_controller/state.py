"""The controller's run state, shared by the pumps on one event loop.

Contract: every mutation that a pump may be waiting on goes through a method here (or is followed
by `notify()`), and every wait is `await state.wait_until(predicate, pump, on=...)`, which sleeps on
the change signal and records how long the pump waited and on what. No locks are needed: the
pumps run on one loop and mutate between awaits.

Versions: `trainer_version` = optimizer steps completed (the next step to train); `policy_version`
= the version the generation workers serve, bumped by the weight-sync pump once every worker has
applied the snapshot. Admission and staleness read only these and the stamps on each group.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterator, Sequence, TypeVar

from replay.ledger import GroupLedger, GroupRecord, GroupState, PromptLedger
from replay.storage import RowStorage
from samplers.staleness import StalenessSampler
from single_controller.channels import Signal
from single_controller.config import Config, resolved_capacity
from single_controller.protocols import GenerationWorker, TrainerGroup
from single_controller.types import Prompt

T = TypeVar("T")

PUMPS = ("rollout", "advantage", "train", "weight_sync")


@dataclass(frozen=True)
class PumpStatistics:
    name: str
    waiting_on: str | None  # what the pump waits for right now, None while working
    current_wait_s: float  # how long the current wait has lasted
    wait_s_by_reason: dict[str, float]  # cumulative seconds waited, by what was awaited
    busy_s: float  # cumulative seconds spent awaiting workers or storage
    iterations: int
    errors: int
    finished: bool


@dataclass
class PumpClock:
    """Wait/busy accounting of one pump (read by `statistics()`, never by the pump's logic)."""

    name: str
    waiting_on: str | None = None
    wait_started: float = 0.0
    wait_s: collections.Counter = field(default_factory=collections.Counter)
    busy_s: float = 0.0
    iterations: int = 0
    errors: int = 0
    finished: bool = False

    def statistics(self, now: float) -> PumpStatistics:
        current = now - self.wait_started if self.waiting_on else 0.0
        waits = dict(self.wait_s)
        if self.waiting_on:
            waits[self.waiting_on] = waits.get(self.waiting_on, 0.0) + current
        return PumpStatistics(
            self.name, self.waiting_on, current, waits, self.busy_s, self.iterations, self.errors, self.finished
        )


@dataclass
class SyncRecord:
    """Weight-sync accounting, written by the weight-sync pump."""

    count: int = 0
    total_s: float = 0.0
    last_s: float = 0.0
    last_drain_s: float = 0.0
    last_bytes: int = 0
    last_t: float | None = None  # controller clock at the end of the last sync
    aborted_in_flight: int = 0


@dataclass
class Workers:
    generators: Sequence[GenerationWorker]
    trainer: TrainerGroup


class RunState:
    def __init__(
        self,
        cfg: Config,
        dataloader: Iterator[Prompt],
        storage: RowStorage,
        workers: Workers,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.cfg = cfg
        self.clock = clock
        self.storage = storage
        self.workers = workers
        self.sampler = StalenessSampler(cfg.sampler)
        self.ledger = GroupLedger(
            capacity=resolved_capacity(cfg),
            group_size=cfg.rollout.group_size,
            groups_per_step=cfg.train.groups_per_step,
            max_steps=cfg.run.max_steps,
        )
        self.prompts = PromptLedger()
        self._dataloader = dataloader
        self.dataloader_exhausted = False
        self.pending_prompts: collections.deque[Prompt] = collections.deque()  # taken, not yet dispatched

        self.policy_version = 0
        self.trainer_version = 0
        self.admission_open = True
        self.stopping = False  # no new rollouts: early stop or shutdown
        self.stop_reason: str | None = None
        self.rollout_done = False  # the rollout pump has exited: nothing new will be committed
        self.train_done = False

        self.zero_variance_groups = 0
        self.tokens_generated = 0  # response tokens of every committed group (trained or not)
        self.aborted_steps = 0  # abort_train_step calls after trainer errors
        self.step_retries = 0
        self.select_latency_s: collections.deque[float] = collections.deque(maxlen=100_000)
        self.sync = SyncRecord()
        self.teardown_errors: list[str] = []
        self.in_flight_tasks: dict[str, asyncio.Task] = {}  # group_id -> its generation task

        self.changed = Signal()
        self.pumps = {name: PumpClock(name) for name in PUMPS + (("eval",) if cfg.eval.enabled else ())}

    # -- waiting ---------------------------------------------------------------------------------
    def notify(self) -> None:
        self.changed.notify()

    async def wait_until(self, predicate: Callable[[], bool], pump: str, on: str) -> None:
        if not predicate():
            await self.waiting(self.changed.wait_until(predicate), pump, on)

    async def waiting(self, aw: Awaitable[T], pump: str, on: str) -> T:
        """Await `aw`, accounting the time as `pump` waiting on `on`."""
        clk = self.pumps[pump]
        clk.waiting_on, clk.wait_started = on, self.clock()
        try:
            return await aw
        finally:
            clk.wait_s[on] += self.clock() - clk.wait_started
            clk.waiting_on = None

    # -- prompts ---------------------------------------------------------------------------------
    def has_prompt(self) -> bool:
        if self.pending_prompts:
            return True
        if self.dataloader_exhausted:
            return False
        try:
            self.pending_prompts.appendleft(self.prompts.take(next(self._dataloader)).prompt)
        except StopIteration:
            self.dataloader_exhausted = True
            self.notify()  # the train pump may be waiting to learn that nothing more will come
            return False
        return True

    def next_prompt(self) -> Prompt:
        """A prompt to dispatch: re-dispatches first, then fresh ones (call `has_prompt` first)."""
        return self.pending_prompts.popleft()

    def requeue_or_settle(self, rec: GroupRecord, reason: str, *, max_retries: int, fate: str = "dropped") -> bool:
        """After a failed or discarded attempt: re-dispatch its prompt if retries remain, else settle it.
        Returns True if requeued."""
        attempts = len(self.prompts[rec.prompt.prompt_id].attempts)
        if not self.stopping and attempts <= max_retries:
            self.pending_prompts.appendleft(rec.prompt)  # ahead of fresh prompts: it refills its own step
            self.notify()
            return True
        self.prompts.settle(rec.prompt.prompt_id, fate, reason=reason)
        return False

    # -- versions and admission -------------------------------------------------------------------
    def set_admission(self, open_: bool) -> None:
        self.admission_open = open_
        self.notify()

    def bump_policy_version(self, version: int) -> None:
        if version <= self.policy_version:
            raise RuntimeError(f"policy version must increase: {self.policy_version} -> {version}")
        self.policy_version = version
        self.notify()

    def request_stop(self, reason: str) -> None:
        if not self.stopping:
            self.stopping, self.stop_reason = True, reason
        self.notify()

    def in_flight(self) -> int:
        return self.ledger.count(GroupState.RESERVED)
