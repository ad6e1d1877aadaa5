"""Layer (b): weight syncs of the controller on the simulated backend: the drain and abort policies,
version-gated workers, stale requests aborted in flight."""

from __future__ import annotations

import asyncio

import pytest

from replay.storage import InMemoryRowStorage
from single_controller.backends.sim import (
    Faults,
    sim_prompts,
    sim_workers,
)
from single_controller.controller import Controller
from single_controller.protocols import SubmitsByTask
from single_controller.state import Workers
from tests.helpers.sim import assert_clean_end, make_cfg, run_sim


async def test_drain_policy_syncs_with_nothing_in_flight():
    cfg = make_cfg(steps=5, L=1, sync={"drain_policy": "drain"})
    storage = InMemoryRowStorage()
    gens, trainer = sim_workers(storage, gen_group_s=0.001, train_group_s=0.001)
    ctl = Controller(cfg, sim_prompts(), storage, Workers(gens, trainer))
    seen = []
    for g in gens:
        orig = g.update_weights

        async def spy(handle, orig=orig):
            seen.append(ctl.state.in_flight())
            return await orig(handle)

        g.update_weights = spy
    await asyncio.wait_for(ctl.run(), 20)
    assert seen and set(seen) == {0}


async def test_abort_policy_cancels_everything_in_flight_at_a_sync_and_redispatches_it():
    # p000003 (for step 1, dispatched ahead with L=1) is slow: it is still in flight at the first weight
    # sync, which aborts it (partial group discarded); the prompt is generated again on the new
    # weights and trained.
    cfg = make_cfg(steps=5, P=2, L=1, chunk=1, sync={"drain_policy": "abort"})
    faults = Faults(gen_delay={("p000003", 0): 0.5})
    ctl, trainer, storage, summary, err = await run_sim(cfg, faults, gen_s=0.002, train_s=0.002)
    assert err is None
    rec = ctl.state.prompts["p000003"]
    assert rec.attempts[0] == "p000003-a0" and len(rec.attempts) >= 2 and rec.fate == "trained"
    assert ctl.state.ledger["p000003-a0"].reason == "sync_abort"
    assert ctl.state.sync.aborted_in_flight >= 1
    await assert_clean_end(ctl, trainer, storage)


@pytest.mark.parametrize(
    "sections, slow, reason",
    [
        ({"sync": {"drain_policy": "abort"}}, "p000003", "sync_abort"),
        ({"sampler": {"abort_stale_in_flight": True}, "order": "fifo", "S": 1}, "p000000", "stale_in_flight"),
    ],
)
async def test_an_abort_the_controller_decides_redispatches_the_prompt_uncharged_even_with_on_failure_drop(
    sections, slow, reason
):
    # The abort is the controller's own decision, not a failure of the prompt: with on_failure=drop
    # (no retry budget at all) the prompt is still generated again and trained, never dropped.
    cfg = make_cfg(steps=5, P=2, L=1, chunk=1, rollout={"on_failure": "drop", "max_retries": 0}, **sections)
    faults = Faults(gen_delay={(slow, 0): 0.5})
    ctl, trainer, storage, summary, err = await run_sim(cfg, faults, gen_s=0.002, train_s=0.002)
    assert err is None
    rec = ctl.state.prompts[slow]
    assert ctl.state.ledger[f"{slow}-a0"].reason == reason
    assert (rec.fate, rec.reason) == ("trained", None) and len(rec.attempts) >= 2
    assert rec.uncharged == len(rec.attempts) - 1  # every abort uncharged, the trained attempt charged
    assert set(ctl.state.prompts.statistics().dropped_by_reason) <= {"run_ended"}  # in flight at the end
    await assert_clean_end(ctl, trainer, storage)


class SlowUpdates(SubmitsByTask):
    """A sim generation worker whose weight updates take `update_s`; `gated`: it honours
    `min_version` (`protocols.VersionGated`), holding a request until its weights are applied."""

    def __init__(self, inner, update_s: float, gated: bool):
        self.inner, self.name, self.update_s = inner, inner.name, update_s
        self.honours_min_version = gated
        self.applied = asyncio.Event()
        self.calls = []  # (min_version, version applied when the request arrived)
        self.served = []  # (min_version, version_start of the result)

    async def generate(self, request):
        self.calls.append((request.min_version, self.inner.version))
        while self.honours_min_version and request.min_version is not None and self.inner.version < request.min_version:
            self.applied.clear()
            await self.applied.wait()
        result = await self.inner.generate(request)
        self.served.append((request.min_version, result.version_start))
        return result

    async def update_weights(self, weights):
        await asyncio.sleep(self.update_s)
        await self.inner.update_weights(weights)
        self.applied.set()

    async def in_flight(self):
        return await self.inner.in_flight()


@pytest.mark.parametrize("gated", [False, True])
async def test_version_gated_workers_get_the_next_versions_rollouts_while_they_load_its_weights(gated):
    """With workers that honour `min_version`, a weight sync reopens admission as soon as it has sent
    the snapshot: requests for the new version reach the workers while they still load it, and are
    served with it. Without, admission stays closed until every worker has applied it."""
    steps, P = 6, 4
    storage = InMemoryRowStorage()
    inner, trainer = sim_workers(storage, num_generators=2, gen_group_s=0.001, train_group_s=0.002)
    gens = [SlowUpdates(g, 0.02, gated) for g in inner]
    ctl = Controller(make_cfg(steps=steps, P=P, L=1, chunk=P), sim_prompts(), storage, Workers(gens, trainer))
    summary = await asyncio.wait_for(ctl.run(), 30)
    assert summary.steps == steps
    early = [(m, have) for g in gens for m, have in g.calls if m is not None and m > have]
    sync = ctl.state.sync
    if gated:
        assert early, "no request reached a worker before its weights"
        assert sync.early_admissions == sync.count > 0 and sync.last_closed_s < 0.02 <= sync.last_s
    else:
        assert early == [] and sync.early_admissions == 0 and sync.last_closed_s >= 0.02
    served = [vs for g in gens for vs in g.served]
    assert len(served) >= steps * P and all(start >= m for m, start in served)  # never older weights than stamped
    assert all(h["train/staleness_max"] <= 1 for h in summary.history)
    await assert_clean_end(ctl, trainer, storage)


async def test_abort_stale_in_flight_redispatches_the_prompt():
    # Window mode: p000000's first attempt is slow; by the time it could finish it is too stale.
    cfg = make_cfg(steps=6, P=2, L=1, S=1, chunk=1, order="fifo", sampler={"abort_stale_in_flight": True})
    faults = Faults(gen_delay={("p000000", 0): 1.0})
    ctl, trainer, storage, summary, err = await run_sim(cfg, faults, gen_s=0.002, train_s=0.002)
    assert err is None
    rec = ctl.state.prompts["p000000"]
    assert rec.attempts[0] == "p000000-a0" and len(rec.attempts) >= 2
    assert ctl.state.sampler.statistics().aborted_in_flight_total >= 1
    await assert_clean_end(ctl, trainer, storage)
