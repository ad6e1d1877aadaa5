"""Rollout pump: dataloader -> admission gate -> reserve -> generation worker -> commit.

One loop dispatches prompt groups. Every group in flight is one task of the pump's TaskGroup: it
awaits the worker's `generate` under the `timeouts.generate_s` deadline, then commits the group or
discards it. A cancelled `generate` writes none of the request's rows by the time it re-raises, so
a discarded group's keys are cleared only after that. An abort (`RunState.abort_rollouts`: the
stale in-flight rule, a sync with `drain_policy=abort`, the run's end) marks the group and cancels
its task; the task discards it, not as an error. The reward function runs inside the generation
worker, next to the tokens; what comes back is small columns plus version stamps.

A generation failure (`GenerationFailed`, or the request's deadline) clears whatever rows the
attempt may have written, drops the group with reason `generation_failed`, and re-dispatches the
prompt while `rollout.max_retries` allows (`rollout.on_failure=drop`: never). Any other error is a
bug and ends the run with its cause. The deficit accounting of the ledger refills the step the
dropped group was meant for.

A dead worker (`GenerationWorkerDied`) is taken out of routing on its first failed call; its
in-flight prompts are re-dispatched to the others without charging their retry budget; it is
restarted (`Restartable`) and given the current weights before it takes work again. With no
worker left to route to and none coming back, the run stops with `NoGenerationWorkers`.
"""

from __future__ import annotations

import asyncio
import collections

from replay.ledger import GroupRecord, GroupState
from single_controller.deadlines import DeadlineExceeded, within
from single_controller.protocols import GenerationFailed, GenerationWorker, GenerationWorkerDied, Restartable
from single_controller.state import RunState
from single_controller.types import GenerationRequest, GenerationResult, SamplingParams

PUMP = "rollout"
# Groups dispatched between two yields to the event loop. Small enough that a thousand-group step
# does not hold the loop for milliseconds; large enough that a batching worker (the torch backend
# takes up to 16 groups per batch) gets a step's requests together: at 8, the embedded run's
# batches split and its steps took ~10 % longer.
DISPATCH_SLICE = 32


class NoGenerationWorkers(RuntimeError):
    """Every generation worker is dead and none could be restarted."""


def sampling_params(state: RunState, stop_token_id: int | None) -> SamplingParams:
    r = state.cfg.rollout
    return SamplingParams(r.group_size, r.temperature, r.top_p, r.max_new_tokens, stop_token_id)


async def rollout_pump(state: RunState, *, stop_token_id: int | None = None) -> None:
    sampling = sampling_params(state, stop_token_id)
    load: collections.Counter[str] = collections.Counter()  # groups in flight, by worker name
    try:
        async with asyncio.TaskGroup() as children:
            while True:
                # Exits: a stop was requested (the train pump requests one when it ends); or the
                # dataloader is exhausted, no re-dispatch is pending and no group could still need one.
                await state.wait_until(
                    lambda: _admissible(state) or _finished(state) or bool(_needs_restart(state)), PUMP, "admission"
                )
                for w in _needs_restart(state):
                    state.health.restarting.add(w.name)
                    children.create_task(_restart(state, w), name=f"restart {w.name}")
                if _finished(state):
                    if state.stop.requested:  # the groups still in flight are discarded as the task group closes
                        state.abort_rollouts("run_ended", relabel=True)
                    break
                if _admissible(state):
                    _dispatch_slice(state, children, load, sampling)
                    # let what is ready run before the next slice (a chunk completed meanwhile is
                    # not held up behind the start of a whole step's worth of requests)
                    await asyncio.sleep(0)
    finally:
        state.stop.rollout_done = True
        state.pumps[PUMP].finished = True
        state.notify()


def _dispatch_slice(
    state: RunState, children: asyncio.TaskGroup, load: collections.Counter[str], sampling: SamplingParams
) -> None:
    """Dispatch up to DISPATCH_SLICE admissible groups, each to the least-loaded routable worker
    (ties: the first in routing order), and tell the other pumps once."""
    led, version = state.ledger, state.versions.dispatch
    routable = state.routable()
    budget = min(
        DISPATCH_SLICE, state.cfg.rollout.max_in_flight_groups - state.in_flight(), led.capacity - led.resident()
    )
    for _ in range(budget):
        target = led.next_target_step()
        if target is None or not state.sampler.may_admit(target, version) or not state.has_prompt():
            break
        prompt = state.next_prompt()
        attempt = len(state.prompts[prompt.prompt_id].attempts)
        rec = led.reserve(prompt, attempt=attempt, target_step=target, policy_version=version, now=state.clock())
        state.prompts.add_attempt(prompt.prompt_id, rec.group_id)
        worker = min(routable, key=lambda w: load[w.name])
        load[worker.name] += 1
        children.create_task(_rollout(state, worker, rec, sampling, load), name=rec.group_id)
        state.pumps[PUMP].iterations += 1
    state.notify()


def _needs_restart(state: RunState) -> list[GenerationWorker]:
    if not state.health.down:  # the common case, checked on every state change
        return []
    return [
        w
        for w in state.workers.generators
        if w.name in state.health.down and w.name not in state.health.restarting and w.name not in state.health.given_up
    ]


async def _restart(state: RunState, worker: GenerationWorker) -> None:
    """Bring a dead worker back: a new process, the current weights, then routing. A worker that
    cannot restart stays out; with none left to route to, the run stops."""
    cfg = state.cfg
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
        while state.versions.latest_weights is not applied:  # a weight sync landed meanwhile: catch up
            applied = state.versions.latest_weights
            assert applied is not None  # set by a weight sync, never unset
            await within(
                worker.update_weights(applied),
                cfg.timeouts.weight_sync_s,
                f"generation worker {worker.name}: update_weights(v{applied.version}) after restart",
            )
    except Exception as e:
        if not [w for w in state.routable() if w is not worker] and not state.health.restarting - {worker.name}:
            raise NoGenerationWorkers(
                f"no generation worker is left: {', '.join(f'{n} ({why})' for n, why in state.health.down.items())}; "
                f"restarting {worker.name} failed: {type(e).__name__}: {e}"
            ) from e
        state.pumps[PUMP].errors += 1
        state.health.given_up.add(worker.name)
        state.teardown_errors.append(f"restart of {worker.name} failed: {e}")
        return  # it stays out of routing; the others carry on
    finally:
        state.health.restarting.discard(worker.name)
    del state.health.down[worker.name]
    state.counters.worker_restarts += 1
    state.notify()


def _admissible(state: RunState) -> bool:
    if state.stop.requested or not state.admission_open or not state.any_routable():
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


async def _rollout(
    state: RunState,
    worker: GenerationWorker,
    rec: GroupRecord,
    sampling: SamplingParams,
    load: collections.Counter[str],
) -> None:
    """One group in flight: the worker's answer committed, or the attempt discarded."""
    request = GenerationRequest(rec.group_id, rec.prompt, sampling, rec.keys, min_version=rec.version_reserved)
    result: GenerationResult | Exception | None
    try:
        result = await _generate(state, worker, request, rec)
    except (GenerationFailed, DeadlineExceeded) as e:
        result = e
    finally:
        load[worker.name] -= 1
    if isinstance(result, Exception):
        await _failed(state, worker, rec, result)
        return
    if result is None:
        assert rec.abort_reason is not None  # `_generate` returns None only for an abort
        await _discard(state, rec, rec.abort_reason)  # aborted on purpose: not an error
        return
    if result.group_id != rec.group_id:
        raise RuntimeError(f"generation worker {worker.name} answered {result.group_id} for {rec.group_id}")
    state.ledger.commit(rec.group_id, result, state.clock())
    state.counters.tokens_generated += sum(result.response_lengths)
    state.notify()


async def _generate(
    state: RunState, worker: GenerationWorker, request: GenerationRequest, rec: GroupRecord
) -> GenerationResult | None:
    """The worker's answer, or None when the rollout was aborted (before it started, or while it
    ran: an abort wins over whatever the request did). Raises what `generate` raises, or
    `DeadlineExceeded`; a worker that cancels the request itself breaks its contract (a bug)."""
    if rec.abort_reason:
        return None
    task = asyncio.current_task()
    assert task is not None  # `_rollout` runs in a task of its own (what `abort_rollouts` cancels)
    state.in_flight_tasks[rec.group_id] = task  # what `abort_rollouts` cancels
    t0 = state.clock()
    try:
        result = await within(
            worker.generate(request),
            state.cfg.timeouts.generate_s,
            f"generation worker {worker.name}: generate({rec.group_id})",
        )
    except asyncio.CancelledError:
        if task.cancelling() == 0:
            raise RuntimeError(
                f"generation worker {worker.name} cancelled the request of {rec.group_id} itself "
                "(generate() fails with GenerationFailed; only the controller cancels a request)"
            ) from None
        if rec.abort_reason and task.cancelling() == 1:  # the abort's cancel alone: handled here
            task.uncancel()
            return None
        raise  # the pump is stopping
    finally:
        del state.in_flight_tasks[rec.group_id]
    state.pumps[PUMP].busy_s += state.clock() - t0
    return result


async def _failed(state: RunState, worker: GenerationWorker, rec: GroupRecord, error: Exception) -> None:
    """A request that produced no group. An abort wins; a dead worker's request is re-dispatched
    uncharged (the worker is out of routing at once, with every other call that died with it); a
    failed or late one is charged to the prompt's retries."""
    died = isinstance(error, GenerationWorkerDied)
    if died:
        state.worker_down(worker, str(error))
    if rec.abort_reason:
        await _discard(state, rec, rec.abort_reason)
        return
    state.pumps[PUMP].errors += 1
    await _discard(state, rec, "worker_died" if died else "generation_failed", charge=not died)


async def _discard(state: RunState, rec: GroupRecord, reason: str, charge: bool = True) -> None:
    """Drop an attempt that produced no usable group; re-dispatch its prompt if the policy allows
    (`charge=False`: whatever the policy, and without counting against its retry budget)."""
    state.ledger.drop(rec.group_id, reason)
    retries = state.cfg.rollout.max_retries if state.cfg.rollout.on_failure == "retry" or not charge else 0
    state.requeue_or_settle(rec, reason, max_retries=retries, charge=charge)
    await state.clear_groups([rec], f"storage clear of {rec.group_id}")
