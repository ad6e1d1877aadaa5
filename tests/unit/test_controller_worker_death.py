"""Layer (b): generation worker death on the simulated backend (issue 9): a dead, hung or busy worker,
restarts and their failures, no worker left."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter

import pytest

from replay.storage import InMemoryRowStorage
from single_controller.backends.sim import (
    Faults,
    SimGenerationWorker,
    sim_prompts,
    sim_workers,
)
from single_controller.controller import Controller, RunFailed
from single_controller.protocols import GenerationFailed
from single_controller.state import Workers
from tests.helpers.sim import assert_clean_end, make_cfg, run_sim


@pytest.mark.parametrize("restart_ok", [True, False])
async def test_dead_generation_worker_is_taken_out_restarted_and_costs_no_prompt(restart_ok):
    faults = Faults(die_after={"sim-gen-0": 5}, restart_fails=set() if restart_ok else {"sim-gen-0"})
    cfg = make_cfg(steps=8, P=4, G=2, L=1, rollout={"max_retries": 0})
    ctl, trainer, storage, summary, err = await run_sim(cfg, faults, gen_s=0.003)
    assert err is None, err
    assert summary.steps == 8
    gens = ctl.state.workers.generators
    assert gens[0].restarts == int(restart_ok) and ctl.state.counters.worker_restarts == int(restart_ok)
    assert ctl.state.counters.worker_deaths == 1
    # Out of routing from its first failed call: at most what was already in flight hit the corpse.
    assert gens[0].calls_while_dead <= cfg.rollout.max_in_flight_groups
    # With max_retries=0 any charged failure would drop a prompt: none was dropped or lost.
    fates = Counter(r.fate for r in ctl.state.prompts.records())
    assert fates["dropped"] == 0 or all(
        r.reason == "run_ended" for r in ctl.state.prompts.records() if r.fate == "dropped"
    )
    died = [r for r in ctl.state.prompts.records() if r.uncharged]
    assert died and all(r.fate == "trained" for r in died if r.reason != "run_ended")
    await assert_clean_end(ctl, trainer, storage)


async def test_a_busy_worker_with_a_queue_longer_than_the_deadline_is_never_killed_and_nothing_times_out():
    """The deadline measures a request's own work, not the queue in front of it: one serial worker,
    16 groups in flight at 0.05 s each (0.8 s of queue) against generate_s=0.15. Each request waits
    up to 5x its deadline, is never expired, and the worker is never taken for hung."""
    cfg = make_cfg(steps=4, P=8, G=2, L=1, in_flight=16, timeouts={"generate_s": 0.15, "liveness_s": 1.0})
    ctl, trainer, storage, summary, err = await run_sim(cfg, gen_s=0.05, num_generators=1)
    assert err is None, err
    assert summary.steps == 4
    waited = max(g.t_committed - g.t_reserved for g in ctl.state.ledger.all_records() if g.t_committed)
    assert waited > 3 * cfg.timeouts.generate_s, waited  # the queue did exceed 3x the deadline
    assert ctl.state.counters.worker_deaths == 0 and ctl.state.pumps["rollout"].errors == 0
    assert [r for r in ctl.state.prompts.records() if r.reason not in (None, "run_ended")] == []
    await assert_clean_end(ctl, trainer, storage)


@pytest.mark.parametrize("drain_policy", ["keep", "drain"])
async def test_a_hung_generation_worker_is_replaced_and_the_run_loses_no_prompt(drain_policy):
    """A worker that stops answering (SIGSTOP, a wedged engine: not even a cancel is acknowledged)
    misses its deadlines: it is taken out of routing, its prompts go again uncharged, the weight
    sync carries on without it, and it is killed and restarted; the run finishes every step."""
    faults = Faults(hang_after={"sim-gen-0": 3})
    cfg = make_cfg(
        steps=8,
        P=4,
        G=2,
        L=1,
        rollout={"max_retries": 0},
        sync={"drain_policy": drain_policy, "drain_timeout_s": 5},
        timeouts={"generate_s": 0.3, "weight_sync_s": 0.3, "liveness_s": 0.3},
    )
    ctl, trainer, storage, summary, err = await run_sim(cfg, faults, gen_s=0.003)
    assert err is None, err
    assert summary.steps == 8
    gens = ctl.state.workers.generators
    assert gens[0].restarts == 1 and ctl.state.counters.worker_restarts == 1
    assert ctl.state.health.down == {} and ctl.state.health.given_up == set()
    # With max_retries=0 a charged failure would drop its prompt: every prompt the hang touched
    # went again, uncharged, and was trained.
    records = list(ctl.state.prompts.records())
    assert [r for r in records if r.fate == "dropped" and r.reason != "run_ended"] == []
    assert any(r.uncharged for r in records)
    await assert_clean_end(ctl, trainer, storage)


def _two_workers_g0_dies(worker_cls, *, after: int):
    """A 6-step controller over two generation workers of `worker_cls`; g0 dies after `after` groups."""
    storage = InMemoryRowStorage()
    _, trainer = sim_workers(storage, train_group_s=0.001)
    faults = Faults(die_after={"g0": after})
    gens = [worker_cls(f"g{i}", storage, group_s=0.002, faults=faults) for i in range(2)]
    ctl = Controller(make_cfg(steps=6, P=4, G=2, L=1), sim_prompts(), storage, Workers(gens, trainer))
    return ctl, gens, trainer, storage


async def test_the_run_ends_without_waiting_for_a_worker_restart_under_way():
    """A restart may take `timeouts.setup_s` (minutes); the end of a run (here its last step; a
    SIGTERM's promise is 30 s) does not wait for it."""

    class SlowRestart(SimGenerationWorker):
        async def restart(self, weights):
            await asyncio.sleep(3600)

    ctl, gens, trainer, storage = _two_workers_g0_dies(SlowRestart, after=2)
    summary = await asyncio.wait_for(ctl.run(), 20)
    assert summary.steps == 6 and ctl.state.counters.worker_deaths == 1
    assert ctl.state.health.restarting == set()
    await assert_clean_end(ctl, trainer, storage)


async def test_a_failed_restart_is_tried_again_while_restarts_remain():
    class FailsOnce(SimGenerationWorker):
        async def restart(self, weights):
            if not getattr(self, "failed_once", False):
                self.failed_once = True
                raise GenerationFailed(f"{self.name}: restart failed once")
            await super().restart(weights)

    ctl, gens, trainer, storage = _two_workers_g0_dies(FailsOnce, after=3)
    summary = await asyncio.wait_for(ctl.run(), 30)
    assert summary.steps == 6
    assert gens[0].restarts == 1 and ctl.state.health.given_up == set()
    assert ctl.state.health.restarts_of["g0"] == 2  # the failed attempt and the one that worked
    await assert_clean_end(ctl, trainer, storage)


async def test_a_restarted_worker_catches_up_with_a_trainer_that_publishes_faster_than_it_applies():
    """#48 S6: weight syncs run back to back (the trainer publishes faster than one update) and the
    restarted worker applies a snapshot slower than a sync takes. Its catch-up ends (it used to
    chase each newer snapshot that landed during its last update, forever) with the newest weights,
    and it is routed in time for the next sync to update it with the others (not while a sync that
    left it out is under way: it then missed that sync's weights)."""
    from pumps.rollout import _restart
    from pumps.weight_sync import _sync
    from single_controller.types import WeightsHandle

    class SlowUpdates(SimGenerationWorker):
        update_s = 0.0

        async def update_weights(self, weights):
            await asyncio.sleep(self.update_s)
            await super().update_weights(weights)

        async def restart(self, weights):
            await asyncio.sleep(self.update_s)  # a new process, given `weights`
            await super().restart(weights)

    storage = InMemoryRowStorage()
    _, trainer = sim_workers(storage)
    gens = [SlowUpdates(f"g{i}", storage) for i in range(2)]
    gens[0].update_s, gens[1].update_s = 0.01, 0.05  # a sync takes ~10 ms; g1 restarts or applies one in 50 ms
    ctl = Controller(make_cfg(steps=10_000), sim_prompts(), storage, Workers(gens, trainer))
    st = ctl.state
    st.versions.latest_weights = WeightsHandle(0, None, 0)

    async def trainer_faster_than_one_update():
        for v in itertools.count(1):
            await _sync(st, WeightsHandle(v, None, 0))

    st.worker_down(gens[1], "died")
    st.health.restarting.add("g1")
    syncs = asyncio.create_task(trainer_faster_than_one_update())
    try:
        await asyncio.sleep(0.05)
        await asyncio.wait_for(_restart(st, gens[1]), 2.0)
        assert "g1" not in st.health.down and gens[1] in st.routable()
        assert gens[1].version == st.versions.latest_weights.version  # the newest, when it was routed
        routed_at = gens[1].version
        await st.changed.wait_until(lambda: st.versions.latest_weights.version >= routed_at + 2)
        assert gens[1].version >= routed_at + 1  # the syncs since include it
    finally:
        syncs.cancel()
        await asyncio.wait([syncs])


async def test_a_restart_that_finds_the_trainer_rank_sending_weights_dead_stops_the_run_with_that():
    """#48 S3: a dead weight sender (`TrainerRankDied` from the restart's weights) is the trainer's
    failure: the run stops with it (resumable), not with the worker given up or `NoGenerationWorkers`."""
    from single_controller.protocols import TrainerRankDied

    class SenderDead(SimGenerationWorker):
        async def restart(self, weights):
            raise TrainerRankDied(f"the trainer rank sending weights died during sync_address to {self.name}")

    ctl, gens, trainer, storage = _two_workers_g0_dies(SenderDead, after=2)
    with pytest.raises(RunFailed) as info:
        await asyncio.wait_for(ctl.run(), 20)
    assert info.value.pump == "rollout" and type(info.value.__cause__) is TrainerRankDied
    assert ctl.state.health.given_up == set() and ctl.state.health.restarts_of["g0"] == 1


async def test_no_generation_worker_left_stops_the_run_with_a_typed_error_quickly():
    faults = Faults(die_after={"sim-gen-0": 3, "sim-gen-1": 3}, restart_fails={"sim-gen-0", "sim-gen-1"})
    cfg = make_cfg(steps=50, P=4, G=2, L=1)
    ctl, trainer, storage, summary, err = await run_sim(cfg, faults, gen_s=0.002, timeout=20)
    assert err is not None and err.pump == "rollout"
    assert type(err.__cause__).__name__ == "NoGenerationWorkers", err
    assert "no generation worker is left" in str(err.__cause__)
    assert await storage.resident_keys() == set() and ctl.state.prompts.unsettled() == []
