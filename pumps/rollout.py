"""Rollout pump: dataloader -> admission gate -> reserve -> generation worker -> commit.

A group in flight is a future (the worker's `submit`, `protocols.GenerationWorker`) with a
`timeouts.generate_s` timer; its done callback commits the group, and an attempt that produced no
group is settled by a child task that awaits the worker's `withdraw` before clearing its keys.
Futures, not a task per group, keep the controller's cost per group low (docs/performance.md).

The deadline counts a request's own work, not its queue: when a timer fires the pump asks the worker
(`timeouts.liveness_s`), and a worker is declared hung only if it does not answer; it is then
restarted and its requests go again uncharged. Failures end in one fate each: `generation_failed`
(retried per `rollout.max_retries`), `reward_failed`, `env_failed`, `context_full` (dropped, counted,
not retried); an abort re-dispatches its prompt uncharged; any other error ends the run. A dead
worker leaves routing on its first failed call and is restarted with the current weights; shrunk
workers are out of routing, not dead. With no worker left the run stops with `NoGenerationWorkers`.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field

from replay.ledger import GroupRecord, GroupState
from single_controller.config.schema import rollout_max_new_tokens
from single_controller.deadlines import DeadlineExceeded, within
from single_controller.errors import error_text
from single_controller.protocols import (
    ContextFull,
    EnvironmentFailed,
    GenerationFailed,
    GenerationWorker,
    GenerationWorkerDied,
    ReportsRunning,
    Restartable,
    RewardFailed,
    Sleepable,
    TrainerRankDied,
)
from single_controller.state import RunState
from single_controller.types import GenerationRequest, GenerationResult, SamplingParams

PUMP = "rollout"
# Groups dispatched between two yields to the event loop. Small enough that a thousand-group step
# does not hold the loop for milliseconds; large enough that a batching worker (the torch backend
# takes up to 16 groups per batch) gets a step's requests together: at 8, the embedded run's
# batches split and its steps were slower (docs/performance.md).
DISPATCH_SLICE = 32


class NoGenerationWorkers(RuntimeError):
    """Every generation worker is dead and none could be restarted."""


def sampling_params(state: RunState, stop_token_ids: tuple[int, ...]) -> SamplingParams:
    r = state.cfg.rollout
    new_tokens = rollout_max_new_tokens(state.cfg)
    return SamplingParams(r.group_size, r.temperature, r.top_p, new_tokens, stop_token_ids)


async def rollout_pump(state: RunState, *, stop_token_ids: tuple[int, ...] = ()) -> None:
    sampling = sampling_params(state, stop_token_ids)
    try:
        async with asyncio.TaskGroup() as children:
            flights = _InFlight(state, children)
            try:
                await _pump_loop(state, flights, children, sampling)
            finally:
                await flights.close()
    finally:
        state.stop.rollout_done = True
        state.pumps[PUMP].finished = True
        state.notify()


async def _pump_loop(
    state: RunState, flights: _InFlight, children: asyncio.TaskGroup, sampling: SamplingParams
) -> None:
    while True:
        # Exits: a stop was requested (the train pump requests one when it ends); or the dataloader
        # is exhausted, no re-dispatch is pending and no group could still need one.
        await state.wait_until(
            lambda: flights.bug is not None or _admissible(state) or _finished(state) or bool(_needs_restart(state)),
            PUMP,
            "admission",
        )
        if flights.bug is not None:
            raise flights.bug
        for w in _needs_restart(state):
            state.health.restarting.add(w.name)
            task = children.create_task(_restart(state, w), name=f"restart {w.name}")
            flights.restarts.add(task)
            task.add_done_callback(flights.restarts.discard)
        if _finished(state):
            # At the run's end the groups still in flight are discarded (their prompts `run_ended`),
            # then the pump ends. At an interrupt they are only withdrawn (`flights.close`): still
            # reserved, the final checkpoint rolls them back and a resume dispatches them again, as
            # after a crash at the same moment.
            if state.stop.requested and not state.stop.abandon_open_step:
                state.abort_rollouts("run_ended", relabel=True)
                await state.wait_until(lambda: not flights.pending, PUMP, "aborted rollouts")
            return
        if _admissible(state):
            _dispatch_slice(state, flights, sampling)
            # let what is ready run before the next slice (a chunk completed meanwhile is not held
            # up behind the start of a whole step's worth of requests)
            await asyncio.sleep(0)


def _dispatch_slice(state: RunState, flights: _InFlight, sampling: SamplingParams) -> None:
    """Dispatch up to DISPATCH_SLICE admissible groups, each to the least-loaded routable worker
    (ties: the first in routing order), and tell the other pumps once."""
    led, version = state.ledger, state.versions.dispatch
    routable = _with_room(state)  # read once: a shrink takes a worker out between slices, never inside one
    if not routable:
        return
    budget = min(
        DISPATCH_SLICE, state.cfg.rollout.max_in_flight_groups - state.in_flight(), led.capacity - led.resident()
    )
    cap = state.cfg.rollout.max_in_flight_per_worker
    for _ in range(budget):
        target = led.next_target_step()
        if target is None or not state.sampler.may_admit(target, version) or not state.has_prompt():
            break
        prompt = state.next_prompt()
        attempt = len(state.prompts[prompt.prompt_id].attempts)
        rec = led.reserve(prompt, attempt=attempt, target_step=target, policy_version=version, now=state.clock())
        state.prompts.add_attempt(prompt.prompt_id, rec.group_id)
        load = state.worker_load
        worker = min(routable, key=lambda w: load[w.name])
        flights.submit(worker, rec, sampling)
        if cap and load[worker.name] >= cap:
            routable.remove(worker)
            if not routable:
                break
        state.pumps[PUMP].iterations += 1
    state.notify()


def _with_room(state: RunState) -> list[GenerationWorker]:
    """The routable workers below `rollout.max_in_flight_per_worker` groups in flight."""
    cap = state.cfg.rollout.max_in_flight_per_worker
    routable = state.routable()
    return [w for w in routable if state.worker_load[w.name] < cap] if cap else routable


def _needs_restart(state: RunState) -> list[GenerationWorker]:
    if not state.health.down:  # the common case, checked on every state change
        return []
    return [
        w
        for w in state.workers.generators
        if w.name in state.health.down and w.name not in state.health.restarting and w.name not in state.health.given_up
    ]


async def _restart(state: RunState, worker: GenerationWorker) -> None:
    """Bring a dead worker back: a new process, the current weights, then routing (a shrunk one:
    asleep at its level, for its expand). A worker that cannot restart stays out; with none left to
    route to, the run stops. Serialized with the worker's resizes and weight updates
    (`Elastic.engine_lock`): no shrink or update lands inside a restart."""
    cfg = state.cfg
    async with state.elastic.engine_lock(worker.name):
        try:
            if not isinstance(worker, Restartable):
                raise GenerationFailed(f"generation worker {worker.name} cannot be restarted by its backend")
            if state.health.restarts_of[worker.name] >= cfg.rollout.max_worker_restarts:
                raise GenerationFailed(
                    f"generation worker {worker.name} died after {cfg.rollout.max_worker_restarts} restarts"
                )
            state.health.restarts_of[worker.name] += 1
            applied = state.versions.latest_weights
            await within(worker.restart(applied), cfg.timeouts.setup_s, f"restart of generation worker {worker.name}")
            # A weight sync that landed meanwhile is caught up with while no other can land: it is routed
            # (below, no await between) before the next sync picks its workers. (Chasing syncs instead
            # never ended while the trainer published faster than this worker applies one.)
            async with state.weights_fanout:
                latest = state.versions.latest_weights
                if latest is not applied:
                    assert latest is not None  # set by a weight sync, never unset
                    await within(
                        worker.update_weights(latest),
                        cfg.timeouts.weight_sync_s,
                        f"generation worker {worker.name}: update_weights(v{latest.version}) after restart",
                    )
            await _asleep_if_shrunk(state, worker)  # (no await unless it is shrunk: then it is not routed)
        except Exception as e:
            if isinstance(e, TrainerRankDied):  # the weights' sender is gone: the trainer's failure, not this worker's
                raise
            state.pumps[PUMP].errors += 1
            if (
                isinstance(worker, Restartable)
                and state.health.restarts_of[worker.name] < cfg.rollout.max_worker_restarts
            ):
                # restarts remain: it stays down, and the pump tries again (the `finally` below lets it)
                state.health.down[worker.name] = f"restart failed ({type(e).__name__}: {e}); trying again"
                state.notify()
                return
            others = [w for w in state.routable() if w is not worker] or state.health.restarting - {worker.name}
            # a shrunk worker can still be expanded: the pump waits for it (`elastic`), not an error
            if not others and not set(state.elastic.out) - {worker.name}:
                raise NoGenerationWorkers(
                    f"no generation worker is left: "
                    f"{', '.join(f'{n} ({why})' for n, why in state.health.down.items())}; "
                    f"restarting {worker.name} failed: {type(e).__name__}: {e}"
                ) from e
            state.health.given_up.add(worker.name)
            state.teardown_errors.append(f"restart of {worker.name} failed: {e}")
            state.notify()  # (an expand waiting for this restart gives up)
            return  # it stays out of routing; the others carry on
        finally:
            state.health.restarting.discard(worker.name)
        # back in the run (or, shrunk, ready for its expand) in the same step as its restart's end
        del state.health.down[worker.name]
        state.counters.worker_restarts += 1
        state.notify()


async def _asleep_if_shrunk(state: RunState, worker: GenerationWorker) -> None:
    """A restarted worker that is shrunk out of the run goes back to sleep at its level: its slot is
    not its own (an expand under way wakes it anyway: left awake)."""
    el, name = state.elastic, worker.name
    level = el.level.get(name, 0)
    if el.out.get(name) in ("shrinking", "asleep") and level > 0 and isinstance(worker, Sleepable):
        what = f"generation worker {name}: sleep({level}) after its restart (it is shrunk)"
        await within(worker.sleep(level), state.cfg.timeouts.weight_sync_s, what)


def _admissible(state: RunState) -> bool:
    if state.stop.requested or not state.admission_open or not state.any_routable():
        return False
    if state.cfg.rollout.max_in_flight_per_worker and not _with_room(state):
        return False
    if state.in_flight() >= state.cfg.rollout.max_in_flight_groups or not state.ledger.has_capacity():
        return False
    target = state.ledger.next_target_step()
    if target is None or not state.sampler.may_admit(target, state.versions.dispatch):
        return False
    return state.has_prompt()


def _finished(state: RunState) -> bool:
    # With every step full the pump keeps waiting: a group dropped or evicted later (zero
    # variance, staleness) must still be refilled. The train pump's end requests the stop.
    if state.stop.requested:
        return True
    if state.has_prompt():
        return False
    led = state.ledger  # source dry: done once nothing can come back for a re-dispatch
    return state.in_flight() == 0 and led.count(GroupState.COMMITTED) == 0 and led.count(GroupState.READY) == 0


@dataclass(eq=False)
class _Flight:
    """One group's request in flight."""

    worker: GenerationWorker
    rec: GroupRecord
    request: GenerationRequest
    future: asyncio.Future[GenerationResult]
    sent_at: float
    incarnation: int  # the worker's restarts when it was sent: a later process is not to blame for it
    timer: asyncio.TimerHandle | None = None
    due: bool = False  # its timer fired: the next liveness call of its worker decides
    expired: str | None = None  # why its deadline cancelled it: "timeout" (its own work) or "hung" (its worker)


@dataclass(eq=False)
class _InFlight:
    """The pump's requests in flight, and where their follow-ups run."""

    state: RunState
    children: asyncio.TaskGroup
    pending: dict[str, _Flight] = field(default_factory=dict)
    bug: BaseException | None = None  # raised in a done callback: the pump raises it
    closed: bool = False
    restarts: set[asyncio.Task] = field(default_factory=set)  # worker restarts under way
    probes: dict[str, asyncio.Task] = field(default_factory=dict)  # liveness calls under way, by worker

    def submit(self, worker: GenerationWorker, rec: GroupRecord, sampling: SamplingParams) -> None:
        state = self.state
        pid = rec.prompt.prompt_id
        sample_id = f"{pid}/{state.prompts.charged_attempts(pid)}"  # the same draws after an uncharged re-dispatch
        request = GenerationRequest(
            rec.group_id, rec.prompt, sampling, rec.keys, sample_id=sample_id, min_version=rec.version_reserved
        )
        incarnation = state.health.restarts_of[worker.name]
        flight = _Flight(worker, rec, request, worker.submit(request), state.clock(), incarnation)
        flight.timer = asyncio.get_running_loop().call_later(state.cfg.timeouts.generate_s, self._due, flight)
        state.worker_load[worker.name] += 1
        state.dispatched_to[rec.group_id] = worker.name  # what a shrink aborts
        self.pending[rec.group_id] = flight
        state.in_flight_requests[rec.group_id] = flight.future  # what `abort_rollouts` cancels
        flight.future.add_done_callback(functools.partial(self._done, flight))

    def _done(self, flight: _Flight, future: asyncio.Future[GenerationResult]) -> None:
        """Commit the answer, or hand the attempt to `_settle` (a child task)."""
        if flight.timer is not None:
            flight.timer.cancel()
        if self.closed:
            return  # withdrawn by `close`
        state, rec = self.state, flight.rec
        state.worker_load[flight.worker.name] -= 1
        state.dispatched_to.pop(rec.group_id, None)
        del self.pending[rec.group_id]
        state.in_flight_requests.pop(rec.group_id, None)
        try:
            if not future.cancelled() and future.exception() is None and not rec.abort_reason:
                _commit(state, flight, future.result())
            else:
                if not future.cancelled() and isinstance(future.exception(), GenerationWorkerDied):
                    # out of routing now, with every other call that died with it, not a task step later
                    _down(state, flight, str(future.exception()))
                self.children.create_task(_settle(state, flight), name=rec.group_id)
        except BaseException as e:  # noqa: BLE001 -- a bug: the pump raises it and the run stops
            self.bug = self.bug or e
        state.notify()

    def _due(self, flight: _Flight) -> None:
        """A request's timer fired: its worker's next liveness call decides (`_probe`)."""
        flight.timer, flight.due = None, True
        name = flight.worker.name
        if name not in self.probes and not self.closed:
            task = self.children.create_task(self._probe(flight.worker), name=f"liveness of {name}")
            self.probes[name] = task
            task.add_done_callback(lambda _t: self.probes.pop(name, None))

    async def _probe(self, worker: GenerationWorker) -> None:
        """Ask `worker` what it is working on; then expire each due request whose own work passed the
        deadline and give the others their timer again. No answer: the worker is hung."""
        state, limit = self.state, self.state.cfg.timeouts.generate_s
        incarnation = state.health.restarts_of[worker.name]
        due = [f for f in self.pending.values() if f.worker is worker and f.due]
        what = (
            f"generation worker {worker.name}: liveness call ({len(due)} request(s) past their "
            f"{limit:g}s deadline{f', e.g. {due[0].rec.group_id}' if due else ''})"
        )
        reports = isinstance(worker, ReportsRunning)
        try:  # (a worker that cannot tell what it is working on answers `in_flight`: alive, no more)
            call = worker.running() if isinstance(worker, ReportsRunning) else worker.in_flight()
            answer = await within(call, state.cfg.timeouts.liveness_s, what)
        except Exception as e:  # noqa: BLE001 -- any failure of the call is the evidence: the worker is hung
            if state.health.restarts_of[worker.name] == incarnation and not self.closed:
                self._hung(worker, incarnation, f"hung: {error_text(e)}")
            return
        now = state.clock()
        running: Mapping[str, float] = answer if isinstance(answer, Mapping) else {}
        for f in [f for f in self.pending.values() if f.worker is worker and f.due]:
            f.due = False
            worked = running.get(f.rec.group_id) if reports else now - f.sent_at  # None: queued or held
            if worked is not None and worked >= limit:
                self._expire(f, "timeout")
            else:
                f.timer = asyncio.get_running_loop().call_later(limit - (worked or 0.0), self._due, f)

    def _hung(self, worker: GenerationWorker, incarnation: int, why: str) -> None:
        """Out of routing (the pump restarts it); every request it had goes again, uncharged."""
        state = self.state
        state.worker_down(worker, why)
        for f in [f for f in self.pending.values() if f.worker is worker and f.incarnation == incarnation]:
            self._expire(f, "hung")

    def _expire(self, flight: _Flight, why: str) -> None:
        """Cancel a request on its deadline, once (an abort that comes while a task-run worker
        unwinds must not cut its withdrawal short)."""
        if flight.timer is not None:
            flight.timer.cancel()
        flight.expired = why
        self.state.in_flight_requests.pop(flight.rec.group_id, None)
        flight.future.cancel()

    async def close(self) -> None:
        """The pump is over: withdraw what is still in flight (a run that failed elsewhere leaves no
        request writing rows behind it); the run's teardown settles those groups."""
        self.closed = True
        for task in [*self.restarts, *self.probes.values()]:  # a restart takes up to `timeouts.setup_s`
            task.cancel()
        left, self.pending = list(self.pending.values()), {}
        self.state.worker_load.clear()
        self.state.dispatched_to.clear()
        for flight in left:
            self.state.in_flight_requests.pop(flight.rec.group_id, None)
            flight.future.cancel()
        await asyncio.gather(*(_withdraw_at_close(self.state, f) for f in left))


def _down(state: RunState, flight: _Flight, why: str) -> None:
    """Take the worker out of routing, unless the process that failed `flight` was replaced already."""
    if state.health.restarts_of[flight.worker.name] == flight.incarnation:
        state.worker_down(flight.worker, why)


def _commit(state: RunState, flight: _Flight, result: GenerationResult) -> None:
    rec = flight.rec
    if result.group_id != rec.group_id:
        raise RuntimeError(f"generation worker {flight.worker.name} answered {result.group_id} for {rec.group_id}")
    state.pumps[PUMP].busy_s += state.clock() - flight.sent_at
    state.ledger.commit(rec.group_id, result, state.clock())
    state.counters.tokens_generated += sum(result.response_lengths)


async def _settle(state: RunState, flight: _Flight) -> None:
    """A request that produced no group. A cancelled one is withdrawn first (its keys are cleared
    only after the worker writes none of them). An abort wins over whatever the request did; then
    the deadline; then what the worker raised: a dead worker's request is re-dispatched uncharged, a
    failed reward drops the group for good, a failed one is charged to the prompt's retries,
    anything else is a bug and stops the run."""
    worker, rec, future = flight.worker, flight.rec, flight.future
    if future.cancelled():
        await _withdraw(state, flight)
    if rec.abort_reason:
        # Aborted on purpose, by the controller: not an error, and not the prompt's doing, so it is
        # re-dispatched uncharged whatever `rollout.on_failure` says (at the run's end, `run_ended`,
        # nothing is re-dispatched any more: the prompt is settled).
        await _discard(state, rec, rec.abort_reason, charge=False)
        return
    if future.cancelled():
        if not flight.expired:
            raise RuntimeError(
                f"generation worker {worker.name} cancelled the request of {rec.group_id} itself "
                "(its future fails with GenerationFailed; only the controller cancels a request)"
            )
        state.pumps[PUMP].errors += 1
        if flight.expired == "hung":  # its worker's doing: out of routing and restarted (`_InFlight._hung`)
            await _discard(state, rec, "worker_hung", charge=False)
        else:  # its own work passed the deadline on a worker that answers: the prompt's retries pay
            await _discard(state, rec, "generation_timeout")
        return
    error = future.exception()
    if not isinstance(error, GenerationFailed):
        raise error  # type: ignore[misc]  # a bug in the worker (never None: done, not cancelled)
    if isinstance(error, RewardFailed):
        await _discard(state, rec, "reward_failed", retry=False)
        state.reward_failed(rec.group_id, str(error))
        return
    if isinstance(error, EnvironmentFailed):  # retried in the worker already (`env.max_attempts`)
        await _discard(state, rec, "env_failed", retry=False)
        state.env_failed(rec.group_id, str(error))
        return
    if isinstance(error, ContextFull):  # the same prompt would fill the context again: not retried
        await _discard(state, rec, "context_full", retry=False)
        state.context_full(rec.group_id, str(error))
        return
    state.pumps[PUMP].errors += 1
    died = isinstance(error, GenerationWorkerDied)
    await _discard(state, rec, "worker_died" if died else "generation_failed", charge=not died)


async def _withdraw(state: RunState, flight: _Flight) -> None:
    """Returns once the worker writes none of the cancelled request's rows: its `withdraw`, or, for
    a worker that is down and does not answer (hung), its replacement (a restart kills it)."""
    worker, name = flight.worker, flight.worker.name
    what = f"generation worker {name}: withdraw({flight.rec.group_id})"
    try:
        await within(worker.withdraw(flight.request, flight.future), state.cfg.timeouts.generate_s, what)
    except (DeadlineExceeded, GenerationFailed):
        if name not in state.health.down:
            raise
        # (or the run ends: its teardown stops every worker)
        await state.changed.wait_until(
            lambda: name not in state.health.down or name in state.health.given_up or state.stop.requested
        )


async def _withdraw_at_close(state: RunState, flight: _Flight) -> None:
    what = f"generation worker {flight.worker.name}: withdraw({flight.rec.group_id}) (the rollout pump stops)"
    try:
        await within(flight.worker.withdraw(flight.request, flight.future), state.cfg.timeouts.generate_s, what)
    except Exception as e:  # the run is ending already: said in its summary, never raised over its cause
        state.teardown_errors.append(f"{what}: {type(e).__name__}: {e}")


async def _discard(state: RunState, rec: GroupRecord, reason: str, charge: bool = True, retry: bool = True) -> None:
    """Drop an attempt that produced no usable group; re-dispatch its prompt if the policy allows
    (`charge=False`: whatever the policy, and without counting against its retry budget; never once
    the run is stopping; `retry=False`: never, whatever the policy)."""
    state.ledger.drop(rec.group_id, reason)
    r = state.cfg.rollout
    retries = r.max_retries if retry and (r.on_failure == "retry" or not charge) else 0
    state.requeue_or_settle(rec, reason, max_retries=retries, charge=charge)
    await state.clear_groups([rec], f"storage clear of {rec.group_id}")
