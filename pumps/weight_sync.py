"""Weight-sync pump: close admission -> drain policy -> push weights -> bump version -> reopen.

For each snapshot from the train pump: admission closes; `sync.drain_policy` drains, keeps or aborts
the rollouts in flight (those that could only train above the staleness bound are aborted); every
generation worker applies the snapshot; the policy version is bumped and admission reopens (also
after a failure, which then ends the run). With version-gated workers (`protocols.VersionGated`)
admission reopens as soon as the snapshot is sent: the new version's rollouts wait in the workers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from replay.ledger import GroupRecord
from single_controller.channels import Channel
from single_controller.deadlines import DeadlineExceeded, within
from single_controller.protocols import GenerationFailed, version_gated
from single_controller.state import RunState
from single_controller.types import WeightsHandle

PUMP = "weight_sync"


async def weight_sync_pump(state: RunState, weights: Channel[WeightsHandle]) -> None:
    clk = state.pumps[PUMP]
    try:
        # Exits: the train pump closed the channel and every snapshot in it was applied.
        while True:
            try:
                handle = await state.waiting(weights.receive(), PUMP, "weights")
            except StopAsyncIteration:
                break
            await _sync(state, handle)
            clk.iterations += 1
            if state.hooks.after_sync is not None:  # in a pool: the train slots go back now
                await state.hooks.after_sync(handle.version)
    finally:
        clk.finished = True
        state.notify()


async def _sync(state: RunState, handle: WeightsHandle) -> None:
    cfg = state.cfg
    t0 = state.clock()
    t_open = None
    # published first: an expand that ends from now on ends with these weights, or is in the fanout below
    state.versions.published = handle
    state.set_admission(False)
    try:
        if cfg.sync.drain_policy == "drain":
            await within(
                state.wait_until(lambda: state.in_flight() == 0, PUMP, "in-flight rollouts to drain"),
                cfg.sync.drain_timeout_s,
                f"in-flight rollouts to drain before weight sync v{handle.version}",
            )
        elif cfg.sync.drain_policy == "abort":
            _abort_in_flight(state, "sync_abort", lambda rec: True)
        t_drained = state.clock()
        _abort_stale_in_flight(state, handle.version)
        # Not while a restarted worker catches up (`rollout._restart`): it is in `routable` once done.
        async with state.weights_fanout:
            async with asyncio.TaskGroup() as fanout:
                routable = state.routable()
                for w in routable:  # a dead or restarting worker gets the newest weights at restart
                    fanout.create_task(update_worker(state, w, handle))
                if routable and all(version_gated(w) for w in routable):
                    state.versions.latest_weights = handle  # a worker restarted from now on applies these first
                    state.dispatch(handle.version)  # rollouts for it are held by the workers until it lands
                    state.set_admission(True)
                    state.sync.early_admissions += 1
                    t_open = state.clock()
            state.versions.latest_weights = handle  # what a restarted generation worker must apply first
        state.bump_policy_version(handle.version)
    finally:
        state.set_admission(True)
    rec = state.sync
    rec.count += 1
    rec.last_s = state.clock() - t0
    rec.total_s += rec.last_s
    rec.last_drain_s = t_drained - t0
    rec.last_closed_s = (t_open if t_open is not None else state.clock()) - t0
    rec.last_bytes = handle.num_bytes
    rec.last_t = state.clock()
    state.pumps[PUMP].busy_s += rec.last_s


async def update_worker(state: RunState, worker, handle: WeightsHandle, why: str = "") -> None:
    """Apply `handle` on a routable generation worker, serialized with its resizes and restart
    (`Elastic.engine_lock`): one that was shrunk meanwhile is left alone (its expand applies the
    published weights), and so is one down (its restart applies the newest). A worker that fails
    the update is dead, failed or hung: out of routing, and restarted by the rollout pump with the
    newest weights (`versions.latest_weights`); the others go on."""
    name = worker.name
    async with state.elastic.engine_lock(name):
        if name in state.elastic.out or name in state.health.down:
            return
        try:
            await within(
                worker.update_weights(handle),
                state.cfg.timeouts.weight_sync_s,
                f"generation worker {name}: update_weights(v{handle.version}){why}",
            )
        except (GenerationFailed, DeadlineExceeded) as e:
            state.worker_down(worker, f"update_weights(v{handle.version}){why} failed: {e}")


def _abort_stale_in_flight(state: RunState, new_version: int) -> None:
    if not state.sampler.aborts_in_flight:  # the default: no in-flight group is ever looked at
        return
    _abort_in_flight(
        state, "stale_in_flight", lambda rec: state.sampler.should_abort_in_flight(rec, state.versions.trained)
    )


def _abort_in_flight(state: RunState, reason: str, which: Callable[[GroupRecord], bool]) -> None:
    """Abort the in-flight rollouts `which(rec)` selects; the rollout pump discards what they
    wrote and re-dispatches their prompts."""
    aborted = state.abort_rollouts(reason, which)
    state.sampler.record_aborted(aborted)
    state.sync.aborted_in_flight += aborted
