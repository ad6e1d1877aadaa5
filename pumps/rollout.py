"""Rollout pump: dataloader -> admission gate -> reserve -> generation worker -> commit.

One loop dispatches prompt groups. A dispatched group is a future: the worker's own
(`protocols.Submitting`), or a task running its `generate`. The future's done callback commits the
group; a failure, a deadline or an abort is handled in a child task of the pump's own TaskGroup
(so a bug propagates and stops the run), which clears the group's keys only after the worker has
withdrawn the request. The reward function runs inside the generation worker, next to the tokens;
what comes back is small columns plus version stamps.

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
import functools
import heapq

from replay.ledger import GroupRecord, GroupState
from single_controller.deadlines import DeadlineExceeded, Expiry, cancel_after, within
from single_controller.protocols import GenerationFailed, GenerationWorker, GenerationWorkerDied, Restartable, Submitting
from single_controller.state import RunState
from single_controller.types import GenerationRequest, SamplingParams

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
    load = {id(w): 0 for w in state.workers.generators}
    clk = state.pumps[PUMP]
    # Workers that take a request without a task of its own (checked once: a protocol check per
    # dispatch would cost more than the task it saves); the others' `generate` runs as a task.
    submitting = {id(w) for w in state.workers.generators if isinstance(w, Submitting)}
    submitted = _Submitted()
    try:
        async with asyncio.TaskGroup() as children:
            submitted.children = children
            while True:
                # Exits: a stop was requested (the train pump requests one when it ends); or the
                # dataloader is exhausted, no re-dispatch is pending and no group could still need one.
                await state.wait_until(
                    lambda: _admissible(state) or _finished(state) or _needs_restart(state), PUMP, "admission"
                )
                for w in _needs_restart(state):
                    state.restarting.add(w.name)
                    children.create_task(_restart(state, w), name=f"restart {w.name}")
                if not _admissible(state) and not _finished(state):
                    continue
                if _finished(state):
                    if state.stopping:
                        _cancel_in_flight(state, "run_ended")
                        # each cancelled submission's callback hands it to a discard (a child task)
                        await state.wait_until(lambda: not submitted.pending, PUMP, "cancelled rollouts")
                    break
                # Dispatch what is admissible, in slices: tell the others once per slice, and let
                # what is ready run in between (a chunk completed meanwhile is not held up behind
                # the start of a whole step's worth of requests).
                routable = state.routable()
                # least-loaded worker first (ties: the first in routing order), as a heap of
                # (load, position): a slice's picks cost O(log W) each, not a scan of every worker
                # (no task of this pump's ends while the slice runs: loads only grow here)
                least = [(load[id(w)], i) for i, w in enumerate(routable)]
                heapq.heapify(least)
                # Admissible now. Within the slice nothing awaits, so only what the slice itself
                # changes can close admission: in-flight groups and resident slots (one more of
                # each per dispatch: counted down here), the target step, and the prompts left.
                led, prompts, clock, version = state.ledger, state.prompts, state.clock, state.dispatch_version
                budget = min(DISPATCH_SLICE, state.cfg.rollout.max_in_flight_groups - state.in_flight(), led.capacity - led.resident())
                target = led.next_target_step()
                while True:
                    prompt = state.next_prompt()
                    pid = prompt.prompt_id
                    rec = led.reserve(prompt, attempt=len(prompts[pid].attempts), target_step=target, policy_version=version, now=clock())
                    gid = rec.group_id
                    prompts.add_attempt(pid, gid)
                    n, i = least[0]
                    worker = routable[i]
                    heapq.heapreplace(least, (n + 1, i))
                    load[id(worker)] = n + 1
                    _submit_one(state, submitted, load, worker, rec, sampling, native=id(worker) in submitting)
                    clk.iterations += 1
                    budget -= 1
                    if budget <= 0:
                        break
                    target = led.next_target_step()
                    if target is None or not state.sampler.may_admit(target, version) or not state.has_prompt():
                        break
                state.notify()
                await asyncio.sleep(0)
    finally:
        try:
            await submitted.close(state)
        finally:
            state.rollout_done = True
            state.pumps[PUMP].finished = True
            state.notify()


def _cancel_in_flight(state: RunState, reason: str) -> None:
    for group_id, task in list(state.in_flight_tasks.items()):
        state.ledger[group_id].abort_reason = reason
        task.cancel()


def _needs_restart(state: RunState) -> list[GenerationWorker]:
    if not state.down_workers:  # the common case, checked on every state change
        return []
    return [
        w for w in state.workers.generators
        if w.name in state.down_workers and w.name not in state.restarting and w.name not in state.given_up
    ]


async def _restart(state: RunState, worker: GenerationWorker) -> None:
    """Bring a dead worker back: a new process, the current weights, then routing. A worker that
    cannot restart stays out; with none left to route to, the run stops."""
    cfg = state.cfg
    try:
        if not isinstance(worker, Restartable):
            raise GenerationFailed(f"generation worker {worker.name} cannot be restarted by its backend")
        if state.restarts_of[worker.name] >= cfg.rollout.max_worker_restarts:
            raise GenerationFailed(f"generation worker {worker.name} died after {cfg.rollout.max_worker_restarts} restarts")
        state.restarts_of[worker.name] += 1
        applied = state.latest_weights
        await within(worker.restart(applied), cfg.timeouts.setup_s, f"restart of generation worker {worker.name}")
        while state.latest_weights is not applied:  # a weight sync landed meanwhile: catch up
            applied = state.latest_weights
            await within(worker.update_weights(applied), cfg.timeouts.weight_sync_s, f"generation worker {worker.name}: update_weights(v{applied.version}) after restart")
    except Exception as e:
        if not [w for w in state.routable() if w is not worker] and not state.restarting - {worker.name}:
            raise NoGenerationWorkers(
                f"no generation worker is left: {', '.join(f'{n} ({why})' for n, why in state.down_workers.items())}; "
                f"restarting {worker.name} failed: {type(e).__name__}: {e}"
            ) from e
        state.pumps[PUMP].errors += 1
        state.given_up.add(worker.name)
        state.teardown_errors.append(f"restart of {worker.name} failed: {e}")
        return  # it stays out of routing; the others carry on
    finally:
        state.restarting.discard(worker.name)
    del state.down_workers[worker.name]
    state.worker_restarts += 1
    state.notify()


def _admissible(state: RunState) -> bool:
    if state.stopping or not state.admission_open or not state.any_routable():
        return False
    if state.in_flight() >= state.cfg.rollout.max_in_flight_groups or not state.ledger.has_capacity():
        return False
    target = state.ledger.next_target_step()
    if target is None or not state.sampler.may_admit(target, state.dispatch_version):
        return False
    return state.has_prompt()


def _finished(state: RunState) -> bool:
    # With every step full the pump keeps waiting: a group dropped or evicted later (zero
    # variance, staleness) must still be refilled. The train pump's end requests the stop.
    if state.stopping:
        return True
    if state.has_prompt():
        return False
    led = state.ledger  # source dry: done once nothing can come back for a re-dispatch
    return state.in_flight() == 0 and led.count(GroupState.COMMITTED) == 0 and led.count(GroupState.READY) == 0


async def _discard(
    state: RunState, rec: GroupRecord, keys, reason: str, cause: BaseException | None = None, charge: bool = True
) -> None:
    """Drop an attempt that produced no usable group; re-dispatch its prompt if the policy allows
    (`charge=False`: whatever the policy, and without counting against its retry budget)."""
    state.ledger.drop(rec.group_id, reason)
    retries = state.cfg.rollout.max_retries if state.cfg.rollout.on_failure == "retry" or not charge else 0
    state.requeue_or_settle(rec, reason, max_retries=retries, charge=charge)
    await state.clear_groups([rec], f"storage clear of {rec.group_id}")


# -- requests in flight: a future each, a task only where the worker has no `submit` -------------
class _Submitted:
    """The pump's submitted requests still in flight, and where their follow-ups run."""

    __slots__ = ("children", "pending", "closed")

    def __init__(self) -> None:
        self.children: asyncio.TaskGroup | None = None  # the pump's task group, once entered
        self.pending: dict[str, tuple[GenerationWorker, GenerationRequest, asyncio.Future]] = {}
        self.closed = False

    async def close(self, state: RunState) -> None:
        """The pump is over: withdraw what is still in flight (a run that failed elsewhere leaves
        no request writing rows behind it), as a cancelled `generate` does on its way out."""
        self.closed = True
        left, self.pending = list(self.pending.values()), {}
        for _, _, fut in left:
            fut.cancel()
        if left:
            await asyncio.gather(*(_withdraw_at_close(state, w, r, f) for w, r, f in left))


async def _withdraw(worker: GenerationWorker, request: GenerationRequest, fut: asyncio.Future) -> None:
    """Returns once the worker writes none of `request`'s rows (`fut` is cancelled): its
    `withdraw`, or for a `generate` task, the task's end (a cancelled `generate` guarantees that
    before it re-raises)."""
    if isinstance(worker, Submitting):  # what the pump submitted through
        await worker.withdraw(request, fut)
    elif not fut.done():
        await asyncio.wait([fut])


async def _withdraw_at_close(state: RunState, worker: GenerationWorker, request: GenerationRequest, fut: asyncio.Future) -> None:
    what = f"generation worker {worker.name}: withdraw({request.group_id}) (the rollout pump stops)"
    try:
        await within(_withdraw(worker, request, fut), state.cfg.timeouts.generate_s, what)
    except Exception as e:  # the run is ending already: said in its summary, never raised over its cause
        state.teardown_errors.append(f"{what}: {type(e).__name__}: {e}")


def _submit_one(
    state: RunState, submitted: _Submitted, load: dict, worker: GenerationWorker, rec: GroupRecord, sampling: SamplingParams, *, native: bool
) -> None:
    gid = rec.group_id
    request = GenerationRequest(gid, rec.prompt, sampling, rec.keys, min_version=rec.version_reserved)
    # a worker without `submit`: its `generate` as a task, whose cancellation is its withdrawal
    fut = worker.submit(request) if native else asyncio.ensure_future(worker.generate(request))
    expiry = cancel_after(fut, state.cfg.timeouts.generate_s)
    submitted.pending[gid] = (worker, request, fut)
    state.in_flight_tasks[gid] = fut
    fut.add_done_callback(functools.partial(_submission_done, state, submitted, load, worker, rec, request, expiry, state.clock()))


def _submission_done(
    state: RunState, submitted: _Submitted, load: dict, worker: GenerationWorker, rec: GroupRecord,
    request: GenerationRequest, expiry: Expiry | None, t0: float, fut: asyncio.Future,
) -> None:
    """A submitted request is done: commit its group, or hand a failure, a cancellation or an abort
    to a child task (it awaits the worker's withdrawal and the clear). An error here is a bug: it
    goes to the pump's task group, which stops the run."""
    if submitted.closed:
        return  # withdrawn by `_Submitted.close`
    gid = rec.group_id
    load[id(worker)] -= 1
    del submitted.pending[gid]
    expired = expiry.settle() if expiry is not None else False
    try:
        if not fut.cancelled() and fut.exception() is None and not rec.abort_reason:
            state.in_flight_tasks.pop(gid, None)
            result = fut.result()
            state.pumps[PUMP].busy_s += state.clock() - t0
            if result.group_id != gid:
                raise RuntimeError(f"generation worker {worker.name} answered {result.group_id} for {gid}")
            state.ledger.commit(gid, result, state.clock())
            state.tokens_generated += sum(result.response_lengths)
            state.notify()
            return
        if not fut.cancelled() and isinstance(fut.exception(), GenerationWorkerDied):
            # Out of routing now, with every other call that died with it, not a task step later:
            # by then it may be restarted.
            state.worker_down(worker, str(fut.exception()))
        task = _spawn(submitted, _after_submission(state, worker, rec, request, fut, expired), gid)
    except BaseException as e:  # noqa: BLE001 -- re-raised in the pump's task group
        if _spawn(submitted, _reraise(e), f"{gid} (commit)") is None:
            state.teardown_errors.append(f"rollout pump, after it stopped: {gid}: {type(e).__name__}: {e}")
        return
    if task is None:  # the pump is stopping: `_Submitted.close` withdraws it with the others
        submitted.pending[gid] = (worker, request, fut)
        return
    state.in_flight_tasks[gid] = task
    task.add_done_callback(functools.partial(_forget, state, gid))
    state.notify()  # the pump may wait for its cancelled submissions to be handed over


def _spawn(submitted: _Submitted, coro, name: str) -> asyncio.Task | None:
    """A child task of the pump, or None once its task group takes no more (the pump is stopping)."""
    try:
        return submitted.children.create_task(coro, name=name)
    except RuntimeError:
        coro.close()
        return None


def _forget(state: RunState, group_id: str, _task: asyncio.Task) -> None:
    state.in_flight_tasks.pop(group_id, None)


async def _reraise(error: BaseException) -> None:
    raise error


async def _after_submission(
    state: RunState, worker: GenerationWorker, rec: GroupRecord, request: GenerationRequest, fut: asyncio.Future, expired: bool
) -> None:
    """A submitted request that produced no group. An abort (set before the cancel) wins over
    whatever the request did; then a deadline; then what the worker raised: a dead worker's
    request is re-dispatched uncharged, a failed one charged to its retries, anything else is a
    bug and stops the run."""
    clk = state.pumps[PUMP]
    keys = rec.keys
    if fut.cancelled():
        # Withdrawn first: the clear of its keys must come after the worker writes none of them.
        await within(_withdraw(worker, request, fut), state.cfg.timeouts.generate_s, f"generation worker {worker.name}: withdraw({rec.group_id})")
    if rec.abort_reason:
        # Cancelled on purpose (stale in-flight rule, or the run is ending), or its answer raced
        # the cancel: not an error.
        await _discard(state, rec, keys, rec.abort_reason)
        return
    if fut.cancelled():
        if not expired:
            raise RuntimeError(
                f"generation worker {worker.name} cancelled the request of {rec.group_id} itself "
                "(a submitted request's future fails as generate() would raise; only the controller cancels it)"
            )
        clk.errors += 1
        what = f"generation worker {worker.name}: generate({rec.group_id})"
        await _discard(state, rec, keys, "generation_failed", cause=DeadlineExceeded(what, state.cfg.timeouts.generate_s))
        return
    e = fut.exception()
    if isinstance(e, GenerationWorkerDied):  # taken out of routing already (`_submission_done`)
        clk.errors += 1
        await _discard(state, rec, keys, "worker_died", cause=e, charge=False)
    elif isinstance(e, GenerationFailed):
        clk.errors += 1
        await _discard(state, rec, keys, "generation_failed", cause=e)
    else:
        raise e  # a bug: it stops the run
