"""Weight-sync pump: close admission -> drain policy -> push weights -> bump version -> reopen.

Receives weight snapshots from the train pump's channel. For each: new rollouts stop being
admitted; with `sync.drain_policy=drain` the pump waits (with a deadline) until no rollout is in
flight, with `keep` in-flight rollouts run on and carry their start/end versions; in-flight
rollouts that the sampler says could only train above the staleness bound are cancelled (their
prompts re-dispatched); every generation worker applies the snapshot; then the policy version is
bumped and admission reopens. Admission reopens even if the sync fails, but the failure ends the
run (the pump's exception propagates to the controller's TaskGroup).
"""

from __future__ import annotations

import asyncio

from replay.ledger import GroupState
from single_controller.channels import Channel
from single_controller.deadlines import within
from single_controller.protocols import GenerationWorkerDied
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
    finally:
        clk.finished = True
        state.notify()


async def _sync(state: RunState, handle: WeightsHandle) -> None:
    cfg = state.cfg
    t0 = state.clock()
    state.set_admission(False)
    try:
        if cfg.sync.drain_policy == "drain":
            await within(
                state.wait_until(lambda: state.in_flight() == 0, PUMP, "in-flight rollouts to drain"),
                cfg.sync.drain_timeout_s,
                f"in-flight rollouts to drain before weight sync v{handle.version}",
            )
        t_drained = state.clock()
        _abort_stale_in_flight(state, handle.version)
        async with asyncio.TaskGroup() as fanout:
            for w in state.routable():  # a dead or restarting worker gets the newest weights at restart
                fanout.create_task(_update(state, w, handle))
        state.latest_weights = handle  # what a restarted generation worker must apply first
        state.bump_policy_version(handle.version)
    finally:
        state.set_admission(True)
    rec = state.sync
    rec.count += 1
    rec.last_s = state.clock() - t0
    rec.total_s += rec.last_s
    rec.last_drain_s = t_drained - t0
    rec.last_bytes = handle.num_bytes
    rec.last_t = state.clock()
    state.pumps[PUMP].busy_s += rec.last_s


async def _update(state: RunState, worker, handle: WeightsHandle) -> None:
    try:
        await within(worker.update_weights(handle), state.cfg.timeouts.weight_sync_s, f"generation worker {worker.name}: update_weights(v{handle.version})")
    except GenerationWorkerDied as e:
        state.worker_down(worker, str(e))  # restarted by the rollout pump, with the newest weights


def _abort_stale_in_flight(state: RunState, new_version: int) -> None:
    aborted = 0
    for group_id, task in list(state.in_flight_tasks.items()):
        rec = state.ledger[group_id]
        if rec.state is GroupState.RESERVED and state.sampler.should_abort_in_flight(rec, state.trainer_version):
            rec.abort_reason = "stale_in_flight"
            task.cancel()
            aborted += 1
    state.sampler.record_aborted(aborted)
    state.sync.aborted_in_flight += aborted
