"""The controller's run state, shared by the pumps on one event loop.

Every mutation a pump may wait on goes through a method here (or is followed by `notify()`), and
every wait is `await state.wait_until(predicate, pump, on=...)`, which records how long the pump
waited and on what; no locks (one loop, mutations between awaits).

The policy version is the one counter of the run: the number of optimizer steps behind a set of
weights. Rows are stamped with it (`policy_version`), a weights snapshot carries it
(`WeightsHandle.version`), a generation worker reports the one it holds (`policy_version()`). The
controller tracks three of its values (`RunState.versions`): `trained` (the trainer's: optimizer
steps done), `served` (the generation workers') and `dispatch` (what new rollouts are stamped with:
`served`, or with version-gated workers the snapshot being applied).
"""

from __future__ import annotations

import asyncio
import collections
import random
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from replay.ledger import GroupLedger, GroupRecord, GroupState, PromptLedger
from replay.storage import RowStorage, StorageError, StorageWriteError
from samplers.staleness import StalenessSampler
from single_controller.channels import Signal
from single_controller.config.schema import Config, resolved_capacity
from single_controller.deadlines import DeadlineExceeded, within
from single_controller.protocols import GenerationWorker, TrainerGroup
from single_controller.types import Prompt, WeightsHandle

T = TypeVar("T")

PUMPS = ("rollout", "advantage", "train", "weight_sync")

CLEAR_ATTEMPTS = 3  # tries of one storage clear (each under its own deadline) before StorageFailed
CLEAR_BACKOFF_S = 0.05  # the pause after a clear's first failure; it doubles after each one
CLEAR_BACKOFF_MAX_S = 1.0


class StorageFailed(RuntimeError):
    """The row storage kept failing (deadline or error) on the same request after every retry."""


class RewardFunctionFailing(RuntimeError):
    """The reward function failed on `rollout.max_reward_failures_in_a_row` groups with none scored
    between: it fails on everything, and dropping every prompt would never train a step."""


class EnvironmentFailing(RuntimeError):
    """The environment failed `env.max_failures_in_a_row` groups in a row (or its first observation
    left no room for a policy token in as many): it is down or broken, and every prompt would be
    dropped."""


def retryable_storage_error(e: BaseException) -> bool:
    """Whether trying a storage request again can succeed: the storage did not answer in time
    (`DeadlineExceeded`), failed on its side (`StorageError`, which the TransferQueue adapter raises
    for TQ's own errors), or lost its connection (`ConnectionError`). Not a request the storage
    refused (`StorageWriteError`: the same request is refused again) nor any other error (a bug)."""
    if isinstance(e, StorageWriteError):
        return False
    return isinstance(e, (DeadlineExceeded, StorageError, ConnectionError))


def clear_backoff_s(attempt: int) -> float:
    """The pause after failed try `attempt` (1, 2, ...): full jitter over an exponential bound, so
    clears that failed together do not all come back at once."""
    return random.uniform(0.0, min(CLEAR_BACKOFF_MAX_S, CLEAR_BACKOFF_S * 2 ** (attempt - 1)))


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
    wait_s: collections.defaultdict[str, float] = field(default_factory=lambda: collections.defaultdict(float))
    busy_s: float = 0.0
    iterations: int = 0
    errors: int = 0
    finished: bool = False

    def total_wait_s(self, now: float) -> float:
        """Seconds waited so far, for any reason (a wait under way counts up to `now`)."""
        total = sum(self.wait_s.values())
        return total + (now - self.wait_started) if self.waiting_on else total

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
    last_closed_s: float = 0.0  # how long the last sync kept admission closed
    early_admissions: int = 0  # syncs that reopened admission once the snapshot was sent (version-gated workers)


@dataclass
class Workers:
    generators: Sequence[GenerationWorker]
    trainer: TrainerGroup


@dataclass
class Versions:
    """Three values of the policy version (see the module docstring). Owners: the train pump bumps
    `trained`; the weight-sync pump bumps `served` and `dispatch` (`RunState.bump_policy_version`,
    `dispatch`) and sets `latest_weights`."""

    trained: int
    served: int
    dispatch: int
    latest_weights: WeightsHandle | None = None  # the snapshot every worker applied last
    # the newest snapshot published: the one the weight-sync pump is applying, or `latest_weights`
    # (an expanded worker applies it before it rejoins routing)
    published: WeightsHandle | None = None


@dataclass
class Stop:
    """Whether and why the run stops. `RunState.request_stop` sets the request; each of the rollout
    and train pumps marks its own end on its way out."""

    requested: bool = False  # no new rollouts: early stop or shutdown
    reason: str | None = None
    # An interrupt: abort the step in progress instead of finishing it, and leave what is not trained
    # unsettled for the final checkpoint (a resume dispatches it again, as after a crash).
    abandon_open_step: bool = False
    rollout_done: bool = False  # the rollout pump has exited: nothing new will be committed
    train_done: bool = False


@dataclass
class StepHooks:
    """The controller's hooks into the train pump (None: no checkpoints)."""

    after_step: Callable[[], Awaitable[None]] | None = None  # a periodic checkpoint, when one is due
    # Whether `after_step` would write a checkpoint once the trainer is at this version (the train
    # pump then sends no next step behind the finish: a checkpoint needs no step open).
    checkpoint_due: Callable[[int], bool] | None = None
    # In a pool (`single_controller/pool/link.py`): awaited before a step begins on the trainer (the
    # grant of the run's train slots), and after each weight sync with the version it applied;
    # colocated in turns (`single_controller/device_turns.py`): the device to training and back.
    before_train: Callable[[int], Awaitable[None]] | None = None
    after_sync: Callable[[int], Awaitable[None]] | None = None


@dataclass(frozen=True)
class Finishing:
    """The step whose finish the train pump sent last: what its step record needs when the finish
    lands after the pump stopped waiting for it (the run failed meanwhile; see `Controller`)."""

    step: int
    chunks: int
    retries: int
    t_start: float  # when its first chunk was selected


@dataclass
class WorkerHealth:
    """Generation workers out of routing. Any pump that sees one die calls `RunState.worker_down`;
    the rollout pump owns the restarts."""

    down: dict[str, str] = field(default_factory=dict)  # worker name -> why it is out of routing
    restarting: set[str] = field(default_factory=set)
    given_up: set[str] = field(default_factory=set)  # dead workers that will not be restarted again
    restarts_of: collections.Counter[str] = field(default_factory=collections.Counter)


@dataclass(frozen=True)
class ElasticStatistics:
    shrunk: int  # generation workers out of the run now (shrinking, asleep or waking)
    shrinks: int
    expands: int
    shrink_s: float
    expand_s: float
    last_shrink_s: float
    last_expand_s: float
    preempted_groups: int
    failed_expands: int
    train_slots_held: int


@dataclass
class Elastic:
    """Generation workers shrunk out of the run (`single_controller/elastic.py` writes it): out of
    routing, not dead. `out` names each one's phase: `shrinking` (its groups being aborted or
    drained), `asleep`, `waking` (woken, getting the published weights). `level`: the sleep level
    of each one that is out (0: routing only)."""

    out: dict[str, str] = field(default_factory=dict)  # worker name -> phase
    level: dict[str, int] = field(default_factory=dict)
    shrinks: int = 0
    expands: int = 0
    failed_expands: int = 0
    shrink_s: float = 0.0  # total seconds of the shrinks (out of routing -> asleep)
    expand_s: float = 0.0  # total seconds of the expands (wake -> weights -> back in routing)
    last_shrink_s: float = 0.0
    last_expand_s: float = 0.0
    preempted_groups: int = 0  # groups in flight a shrink aborted (their prompts re-dispatched uncharged)
    resizing: dict[str, asyncio.Lock] = field(default_factory=dict)  # one shrink or expand of a worker at a time
    # one call that changes a worker's engine at a time: its sleep, its wake and weights (an expand),
    # a weight sync's update, its restart (`engine_lock`)
    engine: dict[str, asyncio.Lock] = field(default_factory=dict)
    train_slots_held: int = 0  # in a pool: the slots the run's trainer holds now (`pool/link.py`)

    def engine_lock(self, name: str) -> asyncio.Lock:
        """Held around every call that changes worker `name`'s engine (sleep, wake, weights, restart):
        a shrink never lands inside a weight update, nor a restart inside either."""
        return self.engine.setdefault(name, asyncio.Lock())

    def statistics(self) -> ElasticStatistics:
        return ElasticStatistics(
            len(self.out),
            self.shrinks,
            self.expands,
            self.shrink_s,
            self.expand_s,
            self.last_shrink_s,
            self.last_expand_s,
            self.preempted_groups,
            self.failed_expands,
            self.train_slots_held,
        )


@dataclass
class Counters:
    """Run totals for the step records, statistics and checkpoints; the pump named beside each
    writes it. Only `zero_variance_drops` is also read by a pump's logic (its per-step cap)."""

    tokens_generated: int = 0  # rollout: response tokens of every committed group (trained or not)
    worker_deaths: int = 0  # RunState.worker_down
    worker_restarts: int = 0  # rollout
    zero_variance_groups: int = 0  # advantage
    zero_variance_drops: collections.Counter[int] = field(
        default_factory=collections.Counter
    )  # advantage: step -> dropped
    zero_variance_kept: int = 0  # advantage: trained because their step hit the drop cap
    reward_failed: int = 0  # rollout, advantage (RunState.reward_failed): groups dropped as `reward_failed`
    reward_failed_in_a_row: int = 0  # the same since a group was last scored (advantage resets it)
    env_failed: int = 0  # rollout (RunState.env_failed): groups dropped as `env_failed`
    env_failed_in_a_row: int = 0  # the same since a group was last scored (advantage resets it)
    context_full: int = 0  # rollout (RunState.context_full): groups dropped as `context_full`
    context_full_in_a_row: int = 0  # the same since a group was last scored (advantage resets it)
    aborted_steps: int = 0  # train: abort_train_step calls after trainer errors
    step_retries: int = 0  # train
    # train: finishes that landed after their deadline (recorded result taken); the controller: one
    # that landed after the run failed
    late_finishes: int = 0
    # train: how long a selection waited past its newest group's commit (the latest ones)
    select_latency_s: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=10_000))
    storage_retries: int = 0  # RunState.clear_groups: clears retried after a storage error
    checkpoints_written: int = 0  # controller
    last_checkpoint_s: float = 0.0  # controller: seconds the last checkpoint took to write


class RunState:
    """What the pumps share: configuration and workers, the ledgers and sampler, and small records
    each with its owner (`versions`, `stop`, `hooks`, `health`, `counters`, `sync`)."""

    def __init__(
        self,
        cfg: Config,
        dataloader: Iterator[Prompt],
        storage: RowStorage,
        workers: Workers,
        clock: Callable[[], float] = time.monotonic,
        first_step: int = 0,
        prompts: PromptLedger | None = None,
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
            first_step=first_step,
        )
        self.prompts = prompts if prompts is not None else PromptLedger()
        self._dataloader = dataloader
        self.dataloader_exhausted = False
        self.pending_prompts: collections.deque[Prompt] = collections.deque()  # taken, not yet dispatched
        self.versions = Versions(trained=first_step, served=first_step, dispatch=first_step)
        self.admission_open = True
        self.stop = Stop()
        self.hooks = StepHooks()
        self.health = WorkerHealth()
        self.elastic = Elastic()
        self.counters = Counters()
        self.sync = SyncRecord()
        # Held by the weight-sync pump while it applies a snapshot and sets `versions.latest_weights`;
        # a restarted generation worker takes it for its last catch-up, so no newer snapshot lands
        # between that update and its return to routing (`pumps/rollout._restart`).
        self.weights_fanout = asyncio.Lock()
        self.finishing: Finishing | None = None  # the train pump's
        # group_id -> the worker's future for it, while its request is in flight (the rollout pump's)
        self.in_flight_requests: dict[str, asyncio.Future] = {}
        # the rollout pump's too: group_id -> the worker its request went to, and requests in flight by worker
        self.dispatched_to: dict[str, str] = {}
        self.worker_load: collections.Counter[str] = collections.Counter()
        self.eval_load: collections.Counter[str] = collections.Counter()  # the eval pump's requests in flight by worker
        self.teardown_errors: list[str] = []
        self.changed = Signal()
        self.pumps = {name: PumpClock(name) for name in PUMPS + (("eval",) if cfg.eval.enabled else ())}

    def notify(self) -> None:
        """Called on every state change a pump may wait on: one check of the waiters per loop iteration."""
        self.changed.notify()

    def trainer_can(self, capability: type) -> bool:
        """Whether the trainer group has an optional capability (a runtime-checkable protocol)."""
        return isinstance(self.workers.trainer, capability)

    # -- waiting ---------------------------------------------------------------------------------
    async def wait_until(self, predicate: Callable[[], bool], pump: str, on: str) -> None:
        """Return once `predicate()` holds, accounting the time as `pump` waiting on `on`."""
        if not predicate():
            await self.waiting(self.changed.wait_until(predicate, checked=True), pump, on)

    async def waiting(self, aw: Awaitable[T], pump: str, on: str) -> T:
        """Await `aw`, accounting the time as `pump` waiting on `on`."""
        clk = self.pumps[pump]
        clk.waiting_on, clk.wait_started = on, self.clock()
        try:
            return await aw
        finally:
            clk.wait_s[on] += self.clock() - clk.wait_started
            clk.waiting_on = None

    # -- storage ---------------------------------------------------------------------------------
    async def clear_groups(self, groups: Sequence[GroupRecord], what: str) -> None:
        """Clear terminal groups' rows, then release their slots (a slot is freed only once its rows
        are gone, so none ever leaks). A clear that fails in a way a retry can fix
        (`retryable_storage_error`) is tried again after a jittered, exponentially growing pause, up
        to CLEAR_ATTEMPTS tries, then `StorageFailed` names `what`; any other error is a bug and
        propagates at once."""
        keys = [k for g in groups for k in g.keys]
        for attempt in range(1, CLEAR_ATTEMPTS + 1):
            try:
                await within(self.storage.clear_rows(keys), self.cfg.timeouts.storage_s, what)
                break
            except Exception as e:
                if not retryable_storage_error(e):
                    raise
                if attempt == CLEAR_ATTEMPTS:
                    raise StorageFailed(f"{what} failed {attempt} times; last error: {e}") from e
                self.counters.storage_retries += 1
                await asyncio.sleep(clear_backoff_s(attempt))
        for g in groups:
            self.ledger.release(g.group_id)
        self.notify()

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

    def requeue_or_settle(
        self, rec: GroupRecord, reason: str, *, max_retries: int, fate: str = "dropped", charge: bool = True
    ) -> bool:
        """After a failed or discarded attempt: re-dispatch its prompt if retries remain, else settle it.
        `charge=False`: the attempt was lost through no fault of the prompt (its worker died) and does
        not count against the retry budget. Returns True if requeued. Once the run is stopping nothing
        is dispatched again: at its end the prompt is settled; at an interrupt it stays unsettled, so
        the final checkpoint keeps it for a resume to dispatch (as after a crash)."""
        pid = rec.prompt.prompt_id
        if not charge:
            self.prompts[pid].uncharged += 1
        attempts = self.prompts.charged_attempts(pid)
        if (not self.stop.requested or self.stop.abandon_open_step) and attempts <= max_retries:
            self.pending_prompts.appendleft(rec.prompt)  # ahead of fresh prompts: it refills its own step
            self.notify()
            return True
        self.prompts.settle(rec.prompt.prompt_id, fate, reason=reason)
        return False

    def reward_failed(self, group_id: str, why: str) -> None:
        """Count a group just dropped as `reward_failed` (its reward function raised, or gave a
        non-finite reward); `rollout.max_reward_failures_in_a_row` of them raise `RewardFunctionFailing`."""
        self._failed_in_a_row("reward_failed", group_id, why)

    def env_failed(self, group_id: str, why: str) -> None:
        """Count a group just dropped as `env_failed` (its environment failed an episode more often
        than `env.max_attempts` allows); `env.max_failures_in_a_row` of them raise `EnvironmentFailing`."""
        self._failed_in_a_row("env_failed", group_id, why)

    def context_full(self, group_id: str, why: str) -> None:
        """Count a group just dropped as `context_full` (multi-turn: an episode's prompt and first
        observation left no room for one policy token); `env.max_failures_in_a_row` of them raise
        `EnvironmentFailing`."""
        self._failed_in_a_row("context_full", group_id, why)

    def _failed_in_a_row(self, kind: str, group_id: str, why: str) -> None:
        """Count a failed group of `kind`; the advantage pump resets the runs of failures at every
        group it scores, and a run as long as the kind's bound stops the run."""
        c = self.counters
        setattr(c, kind, getattr(c, kind) + 1)
        in_a_row = getattr(c, f"{kind}_in_a_row") + 1
        setattr(c, f"{kind}_in_a_row", in_a_row)
        self.notify()
        error, what, setting, bound = {
            "reward_failed": (
                RewardFunctionFailing,
                "the reward function failed",
                "rollout.max_reward_failures_in_a_row",
                self.cfg.rollout.max_reward_failures_in_a_row,
            ),
            "env_failed": (
                EnvironmentFailing,
                "the environment failed",
                "env.max_failures_in_a_row",
                self.cfg.env.max_failures_in_a_row,
            ),
            "context_full": (
                EnvironmentFailing,
                "the prompt and the environment's first observation filled the context",
                "env.max_failures_in_a_row",
                self.cfg.env.max_failures_in_a_row,
            ),
        }[kind]
        if in_a_row >= bound:
            raise error(
                f"{what} on {in_a_row} groups in a row, none scored between "
                f"({setting} = {bound}); the last, {group_id}: {why}"
            )

    # -- versions and admission -------------------------------------------------------------------
    def set_admission(self, open_: bool) -> None:
        self.admission_open = open_
        self.notify()

    def dispatch(self, version: int) -> None:
        """New rollouts are for `version` from now on (its snapshot is on its way to every worker,
        each of which holds them until it has applied it: `protocols.VersionGated`)."""
        v = self.versions
        if version <= v.dispatch:
            raise RuntimeError(f"dispatch version must increase: {v.dispatch} -> {version}")
        v.dispatch = version
        self.notify()

    def bump_policy_version(self, version: int) -> None:
        v = self.versions
        if version <= v.served:
            raise RuntimeError(f"policy version must increase: {v.served} -> {version}")
        v.served = version
        v.dispatch = max(v.dispatch, version)
        self.notify()

    def request_stop(self, reason: str, *, abandon_open_step: bool = False) -> None:
        """No new rollouts. `abandon_open_step` (an interrupt): the step in progress is aborted, not
        finished with fewer groups, so the run stops on the last finished step (its checkpoint)."""
        if not self.stop.requested:
            self.stop.requested, self.stop.reason = True, reason
        self.stop.abandon_open_step = self.stop.abandon_open_step or abandon_open_step
        self.notify()

    def in_flight(self) -> int:
        return self.ledger.count(GroupState.RESERVED)

    def abort_rollouts(
        self, reason: str, which: Callable[[GroupRecord], bool] = lambda rec: True, *, relabel: bool = False
    ) -> int:
        """Abort the rollouts in flight that `which(rec)` selects and that no abort marked yet: each is
        marked with `reason` and, while its request is in flight, its future is cancelled; the
        rollout pump discards it, not as an error (one whose answer came already sees the mark).
        `relabel` (the run's end): the ones marked already take `reason` too.
        Returns how many were aborted now."""
        aborted = 0
        for rec in self.ledger.in_state(GroupState.RESERVED):
            if rec.abort_reason is None and which(rec):
                rec.abort_reason = reason
                future = self.in_flight_requests.pop(rec.group_id, None)  # cancelled once
                if future is not None:
                    future.cancel()
                aborted += 1
            elif relabel and rec.abort_reason is not None:
                rec.abort_reason = reason
        return aborted

    # -- generation worker health ------------------------------------------------------------------
    def routable(self) -> list[GenerationWorker]:
        """Generation workers that take work: not known dead, not restarting, not shrunk."""
        down, out = self.health.down, self.elastic.out
        return [w for w in self.workers.generators if w.name not in down and w.name not in out]

    def routable_count(self) -> int:
        """`len(routable())`, without the list in the common case (no worker shrunk)."""
        if not self.elastic.out:
            return len(self.workers.generators) - len(self.health.down)
        return len(self.routable())

    def any_routable(self) -> bool:
        return self.routable_count() > 0

    def worker_down(self, worker: GenerationWorker, why: str) -> None:
        """Take a dead worker out of routing (the rollout pump restarts it)."""
        if worker.name not in self.health.down:
            self.health.down[worker.name] = why
            self.counters.worker_deaths += 1
            self.notify()
