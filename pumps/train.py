"""Train pump: one iteration = one RL step = one optimizer step (or `train.updates_per_step`).

Select ready groups -> lazy `begin_train_step` -> `train_microbatch(chunk)` as groups become ready
-> `finish_train_step` -> clear the step's rows (slots free once cleared) -> version + 1 -> publish
the weights through a channel of capacity 1 (training never runs more than one snapshot ahead of
the generation workers). Chunks carry keys and advantages, never tensors: ranks fetch their rows.
A trainer error first asks `train_status` (a finish may have landed: never a second optimizer
step); otherwise the step is aborted and replayed, up to `train.max_step_retries`. A storage that
stays down stops the run with `StorageFailed`; a slot is released only once its rows are gone.
With several updates per step, a chunk never spans two updates: each carries its update's index
(groups in selection order, groups_per_step / updates_per_step to an update), and the trainer
applies an update when the next one's first chunk arrives; the step stays one split-API step.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from replay.ledger import GroupRecord, GroupState, ReadyKey
from replay.storage import TRAIN_ROW_FIELDS
from single_controller.channels import Channel
from single_controller.deadlines import DeadlineExceeded, within
from single_controller.preflight.algorithm import loss_config
from single_controller.protocols import FinishAndBegin, Prefetching, TrainerFailed, TrainerRankDied
from single_controller.state import Finishing, RunState
from single_controller.types import NO_LOSS, StepResult, TrainChunk, TrainStatus, WeightsHandle

PUMP = "train"


class TrainStepFailed(RuntimeError):
    """A train step kept failing after every allowed retry."""


class TrainerDeadline(TrainerFailed):
    """A split-API call outlived its deadline (it may still be running on the trainer)."""


@dataclass(frozen=True)
class StepReport:
    step: int
    result: StepResult
    groups: tuple[GroupRecord, ...]
    chunks: int
    retries: int
    t_start: float  # when the step's first chunk was selected
    t_end: float  # when it finished and the trainer version was bumped (its rows clear in the background)


async def train_pump(state: RunState, weights: Channel[WeightsHandle], on_step: Callable[[StepReport], None]) -> None:
    clk = state.pumps[PUMP]
    try:
        # Clearing a trained step's rows runs beside the next step (its slots free when it is done).
        async with asyncio.TaskGroup() as clears:
            await _train_loop(state, weights, on_step, clears)
    finally:
        weights.close()
        state.stop.train_done = True
        clk.finished = True
        state.request_stop(state.stop.reason or "training finished")


async def _train_loop(state: RunState, weights, on_step, clears: asyncio.TaskGroup) -> None:
    overlap = StepOverlap(state)
    while state.versions.trained < state.cfg.run.max_steps:
        # Exits: max_steps trained; a stop was requested after a step; or no group can arrive.
        report = await _train_step(state, state.versions.trained, clears, overlap)
        if report is None:
            break
        await _after_step(state, weights, on_step, report)
        if state.stop.requested:
            break
    await overlap.close()


async def _after_step(state: RunState, weights: Channel[WeightsHandle], on_step, report: StepReport) -> None:
    version = report.step + 1
    handle = await _timed(state, state.workers.trainer.export_weights(version), f"trainer.export_weights(v{version})")
    # Blocks while the previous snapshot is still being applied: training stays at most one
    # snapshot ahead of the generation workers.
    await state.waiting(weights.send(handle), PUMP, "weight sync")
    state.pumps[PUMP].iterations += 1
    on_step(report)
    if state.hooks.after_step is not None:
        await state.hooks.after_step()  # a periodic checkpoint, when one is due


@dataclass
class _Step:
    """One RL step in progress, kept across its retries."""

    number: int
    groups: list[GroupRecord] = field(default_factory=list)
    chunks: list[TrainChunk] = field(default_factory=list)
    t_start: float | None = None  # when its first chunk was selected
    sent: int = 0  # chunks sent in the current attempt
    is_open: bool = False  # begun on the trainer in the current attempt
    retries: int = 0


async def _train_step(state: RunState, step: int, clears: asyncio.TaskGroup, overlap: StepOverlap) -> StepReport | None:
    """One RL step: begin -> microbatch* as its groups become ready -> finish (`overlap` may have
    begun it behind the previous step's finish, and begins the next one behind this one's).
    Returns the step's report; None: no step (an interrupt, or no group came)."""
    cur = overlap.take(step)
    result: StepResult | None = None
    while result is None:
        # Exits: the step finished (or a finish landed after its deadline); an interrupt, or no
        # group came (no step).
        try:
            if not await _fill(state, cur):
                if cur.is_open:
                    await _timed(
                        state,
                        state.workers.trainer.abort_train_step(step),
                        f"trainer.abort_train_step({step}) (interrupt)",
                    )
                return None
            result = await overlap.finish(cur)
        except TrainerFailed as e:
            result = await _recover(state, cur, e)
    _finish_groups(state, step, cur.groups, clears)
    state.versions.trained = step + 1
    state.notify()
    assert cur.t_start is not None  # set when the step's first chunk was selected
    return StepReport(step, result, tuple(cur.groups), len(cur.chunks), cur.retries, cur.t_start, state.clock())


async def _fill(state: RunState, cur: _Step) -> bool:
    """Send the step's chunks (again, after a retry) and select more until it has
    `groups_per_step` groups or none can arrive. False: interrupted, or no group came."""
    need = state.cfg.train.groups_per_step
    while not state.stop.abandon_open_step:
        # Exits: the step is full, or no more groups can arrive (every chunk sent); an interrupt.
        if cur.sent < len(cur.chunks):
            await _send_next(state, cur)
        elif len(cur.groups) >= need:
            return True
        else:
            update, room = _update_of(state, len(cur.groups))
            picked = await _wait_selectable(state, cur.number, room, need - len(cur.groups))
            if not picked:
                return bool(cur.chunks) and not state.stop.abandon_open_step
            if not state.stop.abandon_open_step:
                groups, chunk, now = _select(state, cur.number, len(cur.chunks), picked, update)
                cur.t_start = now if cur.t_start is None else cur.t_start
                cur.groups += groups
                cur.chunks.append(chunk)
    return False


async def _send_next(state: RunState, cur: _Step) -> None:
    """Send the step's next unsent chunk, beginning the step first if it is not open."""
    trainer, step = state.workers.trainer, cur.number
    if not cur.is_open:
        if state.hooks.before_train is not None:  # in a pool the train slots, colocated in turns the device, first
            await state.waiting(state.hooks.before_train(step), PUMP, "train slots / device turn")
        begin = trainer.begin_train_step(step, loss_config(state.cfg))
        await _timed(state, begin, f"trainer.begin_train_step({step})")
        cur.is_open = True
    await _timed(
        state,
        trainer.train_microbatch(cur.chunks[cur.sent]),
        f"trainer.train_microbatch(step {step}, chunk {cur.sent})",
    )
    cur.sent += 1


async def _recover(state: RunState, cur: _Step, error: TrainerFailed) -> StepResult | None:
    """After a trainer error inside the step: the recorded result of a finish that landed after
    its deadline (never a second optimizer step), or None once the step is aborted to be sent again
    (`TrainStepFailed` after `train.max_step_retries` retries)."""
    trainer, step = state.workers.trainer, cur.number
    state.pumps[PUMP].errors += 1
    status = await _where_trainer_stands(state, step, error)
    if status.last_finished == step and status.open_step is None:
        # (A next step begun behind that finish was aborted: `FinishAndBegin`; its chunk goes again.)
        result = await _timed(
            state, trainer.finish_train_step(step), f"trainer.finish_train_step({step}) (recorded result)"
        )
        state.counters.late_finishes += 1
        return result
    await _timed(state, trainer.abort_train_step(step), f"trainer.abort_train_step({step})")
    state.counters.aborted_steps += 1
    cur.is_open, cur.sent = False, 0
    cur.retries += 1
    if cur.retries > state.cfg.train.max_step_retries:
        raise TrainStepFailed(f"train step {step} failed {cur.retries} times; last error: {error}") from error
    state.counters.step_retries += 1
    return None


@dataclass
class _NextStepStart:
    """The next step's first chunk, selected while this step finishes."""

    step: int
    groups: list[GroupRecord]
    chunk: TrainChunk
    t_start: float
    sent: bool = False  # sent behind a finish that succeeded: the step is open on the trainer


class StepOverlap:
    """The one place where train steps overlap. With a trainer that can (`FinishAndBegin`) and
    `train.pipeline_steps`, while step s finishes on the trainer, step s + 1's first chunk is
    selected as soon as all its groups are ready and sent behind the finish: the trainer begins it
    without waiting a round trip for the controller. (The trainer's side of it, calls queued behind
    a finish in flight, is `backends/common/trainer_group.py`.) The train pump asks it to `finish` a
    step, to hand it a step to start (`take`: with its first chunk when that was selected, and
    perhaps sent, ahead) and to undo a step begun behind the last finish when the run stops (`close`)."""

    def __init__(self, state: RunState):
        self.state = state
        # step s + 1's first chunk, once selected while s finished: its groups belong to s + 1 from
        # then on, whatever the finish does; kept across the retries of step s
        self.ahead: _NextStepStart | None = None

    def take(self, step: int) -> _Step:
        """Step `step` to run, with its first chunk if that was selected (and perhaps sent) ahead."""
        begun, self.ahead = self.ahead, None
        if begun is None:
            return _Step(step)
        assert begun.step == step, f"step {begun.step}'s first chunk was selected ahead, but step {step} starts"
        sent = 1 if begun.sent else 0
        return _Step(step, list(begun.groups), [begun.chunk], begun.t_start, sent=sent, is_open=begun.sent)

    async def finish(self, cur: _Step) -> StepResult:
        """Finish `cur`; the next step's first chunk goes out behind the finish as soon as its groups
        are ready (one kept from an earlier attempt of this step goes out at once)."""
        state, step = self.state, cur.number
        trainer, what = state.workers.trainer, f"trainer.finish_train_step({step})"
        assert cur.t_start is not None  # set when the step's first chunk was selected
        state.finishing = Finishing(step, len(cur.chunks), cur.retries, cur.t_start)
        if not self._may_begin(step + 1):
            return await _timed(state, trainer.finish_train_step(step), what)
        finish = asyncio.ensure_future(_timed(state, trainer.finish_train_step(step), what))
        ready = None if self.ahead is not None else asyncio.ensure_future(self._ready(step + 1))
        behind = False
        try:
            if ready is not None:
                await asyncio.wait([finish, ready], return_when=asyncio.FIRST_COMPLETED)
                if ready.done() and ready.result() and not finish.done() and self._may_begin(step + 1):
                    groups, chunk, now = _select(state, step + 1, 0, ready.result())
                    self.ahead = _NextStepStart(step + 1, groups, chunk, now)
            else:
                await asyncio.sleep(0)  # the finish task's first step: its calls are sent
            if self.ahead is not None and not finish.done():
                assert isinstance(trainer, FinishAndBegin)  # _may_begin checked the capability
                behind = await trainer.begin_behind_finish(step + 1, loss_config(state.cfg), self.ahead.chunk)
            result = await finish
        finally:
            for task in (finish, ready):
                if task is not None and not task.done():
                    task.cancel()
        if self.ahead is not None:
            self.ahead.sent = behind  # else the next step sends it as its first chunk
        return result

    async def close(self) -> None:
        """The run stops with the next step begun behind the last finish: undo it. Its groups stay
        selected and untrained, as an interrupted step's do; teardown settles them."""
        if self.ahead is not None and self.ahead.sent:
            step = self.ahead.step
            await _timed(
                self.state,
                self.state.workers.trainer.abort_train_step(step),
                f"trainer.abort_train_step({step}) (the run stops)",
            )

    def _may_begin(self, step: int) -> bool:
        """Whether `step`'s first chunk may go out behind the previous step's finish: the trainer can
        take it that way, the run is not stopping and `step` is one it will train, and no checkpoint
        is due after the previous step (a checkpoint needs no step open)."""
        state, cfg = self.state, self.state.cfg
        return (
            state.trainer_can(FinishAndBegin)
            and cfg.train.pipeline_steps
            and not (state.stop.requested or state.stop.abandon_open_step)
            and step < cfg.run.max_steps
            and not (state.hooks.checkpoint_due is not None and state.hooks.checkpoint_due(step))
            and state.hooks.before_train is None  # in a pool or in turns a step begins only once it has the device
        )

    async def _ready(self, step: int) -> list[GroupRecord]:
        """Wait until all of `step`'s groups (of its first update) are selectable (never evicts: with
        evictable groups the train pump's own selection goes first); returns them, or [] when they
        cannot all come now. Only a whole step (update) goes out ahead: taking part of it early would
        leave the rest to trickle in as small chunks behind bursts of commits (more calls, later
        selections) for no gain."""
        state, want = self.state, _update_of(self.state, 0)[1]
        ready = state.ledger.ready_index()

        def chunk_ready() -> bool:
            return state.sampler.selectable(ready, step) >= want and not state.sampler.any_evictable(ready, step)

        await state.changed.wait_until(lambda: chunk_ready() or state.stop.requested or state.stop.abandon_open_step)
        if not chunk_ready():
            return []
        return state.sampler.select_from(ready, step, want)


def _update_of(state: RunState, selected: int) -> tuple[int, int]:
    """With `selected` groups of a step selected: (the update the next ones belong to, how many more
    it takes). One update per step: (0, the rest of the step)."""
    per_update = state.cfg.train.groups_per_step // state.cfg.train.updates_per_step
    return selected // per_update, per_update - selected % per_update


def _select(
    state: RunState, step: int, index: int, picked: list[GroupRecord], update: int = 0
) -> tuple[list[GroupRecord], TrainChunk, float]:
    """Select `picked` for `step` as its chunk `index` (of update `update`): the groups, the chunk, and when."""
    now = state.clock()
    groups = state.ledger.select([g.group_id for g in picked], step, now)
    state.sampler.record_selected(groups, step)
    state.notify()
    return groups, _chunk(state, step, index, groups, update), now


async def _where_trainer_stands(state: RunState, step: int, error: Exception) -> TrainStatus:
    """Ask the trainer where it stands after `error`. The status call queues behind a call still
    running on the trainer (one that outlived its deadline), so it is asked again a few times
    before the trainer is declared unresponsive."""
    tries = state.cfg.train.max_step_retries + 1
    for attempt in range(1, tries + 1):
        try:
            return await _timed(
                state, state.workers.trainer.train_status(), f"trainer.train_status (step {step}, after: {error})"
            )
        except TrainerDeadline as e:
            if attempt == tries:
                raise TrainStepFailed(
                    f"train step {step}: the trainer did not say where it stands after {tries} tries "
                    f"({e}); first error: {error}"
                ) from e
    raise AssertionError("unreachable")


def _chunk(state: RunState, step: int, index: int, groups: list[GroupRecord], update: int = 0) -> TrainChunk:
    keys: list[str] = []
    lengths: list[int] = []
    advantages: list[float] = []
    no_loss = state.cfg.train.mask_truncated
    for g in groups:
        keys += g.keys
        lengths += g.seq_lengths
        advantages += g.advantages  # computed by the advantage pump, never stored
        if no_loss and any(g.truncated):  # rows cut short carry no loss (train.mask_truncated)
            cut = len(advantages) - len(g.advantages)
            for i, t in enumerate(g.truncated):
                if t:
                    advantages[cut + i] = NO_LOSS
    return TrainChunk(step, index, tuple(keys), tuple(lengths), TRAIN_ROW_FIELDS, tuple(advantages), update)


async def _wait_selectable(state: RunState, step: int, need: int, rest: int | None = None) -> list[GroupRecord]:
    """Wait for at least min(min_groups_per_chunk, need) selectable groups, or for none to be able to
    arrive (then return what there is, possibly nothing); returns at most `need`. Evicts what can
    never train first. `rest`: the groups the step still lacks (more than `need` with several updates)."""
    # In a pool (or colocated in turns) a step is selected whole: its train slots (the device) are
    # asked for only once it can train to the end, never held while its groups are still generated.
    pooled = state.hooks.before_train is not None
    want = max(need, rest or 0) if pooled else min(state.cfg.train.min_groups_per_chunk, need)
    waited_from = None
    while True:
        if state.stop.abandon_open_step:
            return []
        ready = state.ledger.ready_index()
        stale = state.sampler.evictable_from(ready, step)
        if stale:
            await _evict(state, stale, step)
            continue
        picked = state.sampler.select_from(ready, step, need)
        # `want` may exceed `need` (a pooled step's rest): then all of it must be selectable
        enough = len(picked) >= min(want, need) and state.sampler.selectable(ready, step) >= want
        if enough or _no_more_can_arrive(state):
            if waited_from is not None and picked:
                newest = max(_t_committed(g) for g in picked)
                state.counters.select_latency_s.append(max(0.0, state.clock() - max(newest, waited_from)))
            return picked
        waited_from = state.clock()
        # re-checked on every state change: O(keys), not O(groups)
        await state.wait_until(functools.partial(_may_select, state, ready, step, want), PUMP, "ready groups")


def _may_select(state: RunState, ready: Mapping[ReadyKey, Mapping[str, GroupRecord]], step: int, want: int) -> bool:
    """What `_wait_selectable` waits for: `want` selectable groups, one to evict, none that can
    still arrive, or an interrupt."""
    return (
        state.sampler.selectable(ready, step) >= want
        or state.sampler.any_evictable(ready, step)
        or _no_more_can_arrive(state)
        or state.stop.abandon_open_step
    )


def _t_committed(g: GroupRecord) -> float:
    assert g.t_committed is not None, f"READY group {g.group_id} has no t_committed"  # commit sets it
    return g.t_committed


def _no_more_can_arrive(state: RunState) -> bool:
    """No group that is not ready now can become ready: nothing in flight or awaiting advantages,
    and no prompt left to dispatch (the dataloader is dry, or the run is stopping)."""
    source_dry = (
        state.stop.requested or state.stop.rollout_done or (state.dataloader_exhausted and not state.pending_prompts)
    )
    return source_dry and state.ledger.count(GroupState.RESERVED) == 0 and state.ledger.count(GroupState.COMMITTED) == 0


async def _evict(state: RunState, groups: list[GroupRecord], step: int) -> None:
    for g in groups:
        state.ledger.evict(g.group_id, "stale")
        state.requeue_or_settle(g, "stale", max_retries=state.cfg.rollout.max_retries, fate="evicted")
    state.sampler.record_evicted(len(groups))
    state.notify()
    # A storage error here is the storage's, never the trainer's: the open step stays as it is.
    await state.clear_groups(groups, f"storage clear of {len(groups)} evicted groups")


def _finish_groups(state: RunState, step: int, groups: list[GroupRecord], clears: asyncio.TaskGroup) -> None:
    state.ledger.mark_trained_many([g.group_id for g in groups], step)
    state.prompts.settle_trained([g.prompt.prompt_id for g in groups], step)
    clears.create_task(_clear_trained(state, step, groups))


def record_landed_finish(state: RunState, step: int, result: StepResult) -> StepReport:
    """A finish of `step` that landed after the train pump stopped waiting for it (the run failed
    meanwhile, and a remote call runs to its end): the step as `_train_step` would have ended it,
    its groups trained, its prompts settled `trained@step`, the trainer version bumped. Its report
    is returned; the run's teardown clears its rows."""
    f, at = state.finishing, state.versions.trained
    if f is None or f.step != step or at != step:
        raise RuntimeError(
            f"the trainer applied step {step}, but the controller is at step {at} and the train pump last "
            f"sent the finish of {'no step' if f is None else f'step {f.step}'}"
        )
    groups = [g for g in state.ledger.in_state(GroupState.SELECTED) if g.trained_step == step]
    state.ledger.mark_trained_many([g.group_id for g in groups], step)
    state.prompts.settle_trained([g.prompt.prompt_id for g in groups], step)
    state.versions.trained = step + 1
    state.notify()
    return StepReport(step, result, tuple(groups), f.chunks, f.retries, f.t_start, state.clock())


async def _clear_trained(state: RunState, step: int, groups: list[GroupRecord]) -> None:
    await state.clear_groups(groups, f"storage clear of step {step} rows")


async def prefetch_pump(state: RunState) -> None:
    """Hints the trainer group to read the next step's rows as soon as they are ready, so the read
    overlaps the current step's compute instead of starting when the step does. Never waits on the
    read itself; hints are best effort (a hinted group may still be trained later or evicted).
    Trainer groups without the `Prefetching` capability get no hints (the pump ends at once)."""
    trainer = state.workers.trainer
    if not isinstance(trainer, Prefetching):
        return
    hinted: set[str] = set()
    seen = (-1, -1)  # (trainer version, READY marks) when the pump last looked
    while True:
        # Exits: the train pump has finished. Looks again only when a group became READY or the
        # trainer moved on (not on every state change: a look selects over the READY groups).
        await state.changed.wait_until(functools.partial(_prefetch_due, state, seen))
        if state.stop.train_done:
            return
        if state.versions.trained != seen[0]:  # forget hints of groups no longer waiting (memory stays flat)
            hinted = {g for g in hinted if g in state.ledger.ready_ids()}
        seen = (state.versions.trained, state.ledger.ready_marks)
        step = state.versions.trained + 1
        groups = _unhinted(state, hinted)
        if not groups:
            continue
        hinted.update(g.group_id for g in groups)
        chunk = _chunk(state, step, -1, groups)
        try:
            await within(trainer.prefetch(chunk), state.cfg.timeouts.train_call_s, f"trainer.prefetch(step {step})")
        except (TrainerFailed, TrainerRankDied, DeadlineExceeded):
            return  # hints are best effort: the train pump meets the same trainer and reports it


def _prefetch_due(state: RunState, seen: tuple[int, int]) -> bool:
    """The train pump finished, or a group became READY or the trainer moved on since `seen`."""
    return state.stop.train_done or (state.versions.trained, state.ledger.ready_marks) != seen


def _unhinted(state: RunState, hinted: set[str]) -> list[GroupRecord]:
    if state.versions.trained + 1 >= state.cfg.run.max_steps:
        return []
    nxt = state.sampler.select_from(
        state.ledger.ready_index(), state.versions.trained + 1, state.cfg.train.groups_per_step
    )
    return [g for g in nxt if g.group_id not in hinted]


async def _timed(state: RunState, aw, what: str):
    """A trainer call with its deadline; a deadline is a trainer error (`TrainerDeadline`)."""
    t0 = state.clock()
    try:
        return await within(aw, state.cfg.timeouts.train_call_s, what)
    except DeadlineExceeded as e:
        raise TrainerDeadline(str(e)) from e
    finally:
        state.pumps[PUMP].busy_s += state.clock() - t0
