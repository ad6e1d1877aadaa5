"""Elastic generation workers: shrink one out of a running run, expand it back in.

`shrink(name, level)` takes the worker out of routing in one synchronous step (nothing is dispatched
to it after), aborts its groups in flight (`preempted`, re-dispatched uncharged) or drains them
(`rollout.shrink=drain`, up to `rollout.shrink_drain_timeout_s`), then sleeps it at `level`.
`expand(name)` wakes it, applies the published weights until they stop changing, checks its version
and only then rejoins routing; any failure leaves it out (`ExpandFailed`), the run's versions
untouched. Both are idempotent and serialized per worker; every engine change holds
`Elastic.engine_lock`. With every worker shrunk the rollout pump waits for an expand (an event).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from single_controller.deadlines import DeadlineExceeded, within
from single_controller.protocols import GenerationFailed, GenerationWorker, GenerationWorkerDied, Sleepable
from single_controller.state import RunState

log = logging.getLogger(__name__)

PREEMPTED = "preempted"  # the abort reason of a shrunk worker's groups


class ElasticWorker(GenerationWorker, Sleepable, Protocol):
    """A generation worker that can be shrunk and expanded."""


class ExpandFailed(RuntimeError):
    """An expand did not bring the worker back: it stays out of routing, asleep; retry the expand."""


def _worker(state: RunState, name: str) -> ElasticWorker:
    by_name: dict[str, GenerationWorker] = {w.name: w for w in state.workers.generators}
    if name not in by_name:
        raise ValueError(f"no generation worker is named {name!r} (there are: {', '.join(by_name)})")
    worker = by_name[name]
    if not isinstance(worker, Sleepable):
        raise TypeError(f"generation worker {name} cannot be shrunk: its backend has no sleep/wake/policy_version")
    return worker  # a GenerationWorker, and Sleepable as checked


def _check_level(state: RunState, level: int) -> None:
    if not 0 <= level <= state.cfg.rollout.sleep_level:
        raise ValueError(f"sleep level {level} is not in 0..rollout.sleep_level={state.cfg.rollout.sleep_level}")


async def shrink(state: RunState, name: str, level: int, mode: str | None = None) -> None:
    """Take generation worker `name` out of the run and put it to sleep at `level` (see the module);
    `mode`: `abort` or `drain` its groups in flight (default: `rollout.shrink`)."""
    _check_level(state, level)
    worker = _worker(state, name)
    el = state.elastic
    async with el.resizing.setdefault(name, asyncio.Lock()):
        if el.out.get(name) == "asleep" and el.level[name] >= level and name not in state.health.down:
            return  # asleep already, as deep or deeper
        t0 = state.clock()
        if name not in el.out:
            el.out[name] = "shrinking"  # out of routing now: the step that picks a worker no longer sees it
            el.level[name] = 0
            state.notify()
            await _empty(state, name, mode or state.cfg.rollout.shrink)
        el.out[name] = "shrinking"
        await _sleep(state, worker, name, max(level, el.level[name]))
        el.out[name] = "asleep"
        el.shrinks += 1
        el.last_shrink_s = state.clock() - t0
        el.shrink_s += el.last_shrink_s
        state.notify()
    log.info("generation worker %s shrunk to sleep level %d in %.3fs", name, level, el.last_shrink_s)


async def _sleep(state: RunState, worker: ElasticWorker, name: str, level: int) -> None:
    """Returns once the worker holds nothing on its slot beyond sleep level `level`: asleep, or dead.
    `level` is recorded first: a restart from then on puts the new process to sleep at it
    (`pumps/rollout.py`). A worker that dies in its sleep is dead (nothing of it is left); one that
    fails it otherwise, or hangs, or is down already, counts only once its restart has replaced it
    (a restart kills the old process first)."""
    el, health = state.elastic, state.health
    el.level[name] = level
    if level == 0:
        return  # routing only: nothing to free
    async with el.engine_lock(name):  # after a weight update or a restart under way, never inside one
        if name not in health.down:
            try:
                await within(
                    worker.sleep(level), state.cfg.timeouts.weight_sync_s, f"generation worker {name}: sleep({level})"
                )
                return
            except GenerationWorkerDied as e:
                log.warning("generation worker %s died before its shrink: out, and restarted asleep", name)
                state.worker_down(worker, f"died in sleep({level}): {e}")
                return
            except (GenerationFailed, DeadlineExceeded) as e:
                state.worker_down(worker, f"sleep({level}) failed: {e}")
    await _restarted(state, name, f"sleep({level})")


async def _restarted(state: RunState, name: str, why: str) -> None:
    """Returns once worker `name` is not down (the rollout pump restarted it), or will not be
    restarted any more (given up, or the rollout pump has ended)."""
    cfg, health = state.cfg, state.health
    await within(
        state.changed.wait_until(lambda: name not in health.down or name in health.given_up or state.stop.rollout_done),
        cfg.timeouts.setup_s * (cfg.rollout.max_worker_restarts + 1),
        f"the restart of generation worker {name} ({why})",
    )


async def _empty(state: RunState, name: str, mode: str) -> None:
    """Returns once no group is in flight on worker `name`: aborted at once, or drained up to the
    deadline and the rest aborted (`mode`)."""
    r = state.cfg.rollout
    # (eval requests on it are withdrawn by the eval pump the moment it is out of routing, and go again elsewhere)
    idle = lambda: (state.worker_load[name] == 0 and state.eval_load[name] == 0) or state.stop.rollout_done  # noqa: E731
    if mode == "drain":
        try:
            await within(
                state.changed.wait_until(idle),
                r.shrink_drain_timeout_s,
                f"groups in flight on generation worker {name} to drain before its shrink",
            )
            return
        except DeadlineExceeded:
            pass  # what did not finish in time is aborted
    state.elastic.preempted_groups += state.abort_rollouts(
        PREEMPTED, lambda rec: state.dispatched_to.get(rec.group_id) == name
    )
    state.notify()
    await state.changed.wait_until(idle)


async def expand(state: RunState, name: str) -> None:
    """Wake generation worker `name`, give it the published weights, and route to it again (see the module)."""
    worker = _worker(state, name)
    el = state.elastic
    async with el.resizing.setdefault(name, asyncio.Lock()):
        if name not in el.out:
            return  # in the run already
        t0 = state.clock()
        el.out[name] = "waking"
        try:
            await _wake(state, worker, name)
        except BaseException as e:
            el.out[name] = "asleep"  # (back to sleep, or down: `_wake`) never routed without the published weights
            el.failed_expands += 1
            state.notify()
            if not isinstance(e, Exception):
                raise
            raise ExpandFailed(f"expand of generation worker {name} failed: {type(e).__name__}: {e}") from e
        # the last check and this are one synchronous step: no sync can publish in between
        del el.out[name], el.level[name]
        el.expands += 1
        el.last_expand_s = state.clock() - t0
        el.expand_s += el.last_expand_s
        state.notify()
    log.info("generation worker %s expanded in %.3fs", name, el.last_expand_s)


async def _wake(state: RunState, worker: ElasticWorker, name: str) -> None:
    """Wake the worker with the published weights. A worker that is down is restarted first (by the
    rollout pump: asleep); one that dies meanwhile is marked down, restarted, and woken again. Any
    other failure puts it back to sleep (or, if that fails too, down: its restart kills it) before
    it is raised: a worker whose expand failed holds its slot no more than before."""
    el, health = state.elastic, state.health
    while True:
        # Exits: woken with the published weights; a failure that is not a death; given up.
        await _restarted(state, name, "expand")
        if name in health.down:
            raise GenerationFailed(f"it is dead and not restarted again: {health.down[name]}")
        async with el.engine_lock(name):
            if name in health.down:
                continue  # it died again meanwhile
            try:
                await _wake_with_published_weights(state, worker, name)
                return
            except GenerationWorkerDied as e:
                log.warning("generation worker %s died while shrunk (found at its expand): restarted, then woken", name)
                state.worker_down(worker, f"died during its expand: {e}")
            except BaseException:
                await _back_to_sleep(state, worker, name)
                raise


async def _back_to_sleep(state: RunState, worker: ElasticWorker, name: str) -> None:
    level = state.elastic.level[name]
    if level == 0:
        return
    try:
        await within(
            worker.sleep(level),
            state.cfg.timeouts.weight_sync_s,
            f"generation worker {name}: sleep({level}) (expand failed)",
        )
    except (GenerationFailed, DeadlineExceeded) as e:
        state.worker_down(worker, f"sleep({level}) after a failed expand failed: {e}")


async def _wake_with_published_weights(state: RunState, worker: ElasticWorker, name: str) -> None:
    cfg = state.cfg
    if state.elastic.level[name] > 0:
        await within(worker.wake(), cfg.timeouts.setup_s, f"generation worker {name}: wake()")
    while True:  # until no sync published newer weights while these were applied
        target = state.versions.published
        if target is None:
            raise RuntimeError("no weights were published yet")
        what = f"generation worker {name}: policy_version()"
        held = await within(worker.policy_version(), cfg.timeouts.weight_sync_s, what)
        if held != target.version:
            what = f"generation worker {name}: update_weights(v{target.version}) (expand)"
            await within(worker.update_weights(target), cfg.timeouts.weight_sync_s, what)
            held = await within(worker.policy_version(), cfg.timeouts.weight_sync_s, what)
        if held != target.version:
            raise RuntimeError(f"it holds weights v{held} after applying the published v{target.version}")
        if state.versions.published is target:
            return


def step_record(state: RunState) -> dict[str, float]:
    """The step record's routing keys: workers routable and shrunk now, and the run's resize totals."""
    el = state.elastic
    return {
        "rollout/workers_routable": state.routable_count(),
        "rollout/workers_shrunk": len(el.out),
        "elastic/shrinks": el.shrinks,
        "elastic/expands": el.expands,
        "elastic/shrink_s": el.shrink_s,
        "elastic/expand_s": el.expand_s,
        "elastic/preempted_groups": el.preempted_groups,
    }
