"""Elastic generation workers (`single_controller/elastic.py`) on the sim backend: shrink and expand
while a run trains, driven through `Controller.shrink_generation` / `expand_generation`."""

import asyncio

import pytest

from replay.storage import InMemoryRowStorage
from single_controller.backends.sim import Faults, sim_prompts, sim_workers
from single_controller.controller import Controller
from single_controller.elastic import ExpandFailed
from single_controller.state import Workers
from tests.helpers.sim import assert_clean_end, make_cfg


def elastic_cfg(steps=8, sleep_level=1, shrink="abort"):
    return make_cfg(steps=steps, P=4, G=2, L=1, in_flight=16, rollout=dict(sleep_level=sleep_level, shrink=shrink))


async def run_elastic(cfg, script, *, faults=None, gen_s=0.004, timeout=30.0):
    """Run the controller with `script(ctl, gens)` beside it. Every submission is checked: to a worker
    that is out of the run, or to one whose weights are not the request's version, it is recorded in
    `violations`."""
    storage = InMemoryRowStorage()
    gens, trainer = sim_workers(storage, num_generators=2, gen_group_s=gen_s, faults=faults or Faults())
    ctl = Controller(cfg, sim_prompts(), storage, Workers(gens, trainer))
    violations: list[str] = []
    for g in gens:
        submit = g.submit

        def checked(request, g=g, submit=submit):
            if g.name in ctl.state.elastic.out:
                violations.append(f"{request.group_id} sent to {g.name} while {ctl.state.elastic.out[g.name]}")
            held = None if g.weights_dropped else g.version
            if held != request.min_version:
                violations.append(f"{request.group_id} (v{request.min_version}) sent to {g.name} holding v{held}")
            return submit(request)

        g.submit = checked
    async with asyncio.timeout(timeout):
        async with asyncio.TaskGroup() as tg:
            run = tg.create_task(ctl.run())
            tg.create_task(script(ctl, gens))
    return ctl, gens, trainer, storage, run.result(), violations


async def at_step(ctl, step):
    await ctl.state.changed.wait_until(lambda: ctl.state.versions.trained >= step)


async def test_a_shrunk_worker_gets_nothing_its_groups_go_again_once_and_versions_step_by_one():
    async def script(ctl, gens):
        await at_step(ctl, 1)
        await ctl.shrink_generation("sim-gen-0", 1)
        await at_step(ctl, 3)
        await ctl.expand_generation("sim-gen-0")
        await at_step(ctl, 4)
        await ctl.shrink_generation("sim-gen-1", 0)
        await at_step(ctl, 6)
        await ctl.expand_generation("sim-gen-1")

    ctl, gens, trainer, storage, summary, violations = await run_elastic(elastic_cfg(), script)
    assert violations == []
    assert [g.calls_while_asleep for g in gens] == [0, 0]
    el = ctl.state.elastic
    assert (el.shrinks, el.expands, el.out) == (2, 2, {})
    assert el.preempted_groups > 0  # groups were in flight on the shrunk workers, and went again
    assert gens[0].sleeps == [1] and gens[1].sleeps == []  # level 0: out of routing only
    await assert_clean_end(ctl, trainer, storage)
    # every preempted group went again, without charging its prompt's retries
    assert sum(r.uncharged for r in ctl.state.prompts.records()) == el.preempted_groups
    # one optimizer step and one version per step, whatever the resizes
    assert summary.steps == trainer.optimizer_steps == 8 and ctl.state.versions.served == 8
    assert [r["sync/policy_version"] for r in summary.history] == list(range(8))  # recorded before its sync
    last = summary.history[-1]
    assert (last["elastic/shrinks"], last["elastic/expands"]) == (2, 2)
    assert last["elastic/preempted_groups"] == el.preempted_groups and last["rollout/workers_shrunk"] == 0
    stats = ctl.statistics()
    assert stats.generation_workers_active == 2 and stats.elastic.shrinks == 2


async def test_an_expand_during_a_weight_sync_rejoins_with_the_newest_weights():
    async def script(ctl, gens):
        await at_step(ctl, 1)
        await ctl.shrink_generation("sim-gen-1", 1)
        update = gens[1].update_weights

        async def late(weights):
            # the expand's first update lands only once the next sync has begun (without gen-1: it is out)
            gens[1].update_weights = update
            await ctl.state.changed.wait_until(lambda: ctl.state.versions.published.version > weights.version)
            await update(weights)

        gens[1].update_weights = late
        await ctl.expand_generation("sim-gen-1")
        assert ctl.state.versions.published.version == gens[1].version  # not the one it started with

    ctl, gens, trainer, storage, summary, violations = await run_elastic(elastic_cfg(), script)
    assert violations == []
    assert gens[1].version == ctl.state.versions.served == 8
    await assert_clean_end(ctl, trainer, storage)


async def test_a_failed_expand_leaves_the_worker_out_and_a_retry_brings_it_back():
    faults = Faults(wake_fails={"sim-gen-1"})

    async def script(ctl, gens):
        await at_step(ctl, 1)
        await ctl.shrink_generation("sim-gen-1", 1)
        with pytest.raises(ExpandFailed, match="sim-gen-1.*wake failed"):
            await ctl.expand_generation("sim-gen-1")
        assert ctl.state.elastic.out == {"sim-gen-1": "asleep"} and ctl.state.elastic.failed_expands == 1
        assert await gens[1].policy_version() is None  # no weights applied, none routed
        await at_step(ctl, 3)
        faults.wake_fails.clear()
        await ctl.expand_generation("sim-gen-1")

    ctl, gens, trainer, storage, summary, violations = await run_elastic(elastic_cfg(), script, faults=faults)
    assert violations == [] and gens[1].calls_while_asleep == 0
    assert ctl.state.elastic.expands == 1 and summary.steps == 8
    await assert_clean_end(ctl, trainer, storage)


async def test_with_every_worker_shrunk_the_run_waits_without_error_and_goes_on_at_an_expand():
    async def script(ctl, gens):
        await at_step(ctl, 1)
        await asyncio.gather(ctl.shrink_generation("sim-gen-0", 1), ctl.shrink_generation("sim-gen-1", 1))
        st = ctl.state
        await st.changed.wait_until(lambda: st.in_flight() == 0)
        await asyncio.sleep(0.1)  # long enough for a polling or erroring pump to show itself
        assert st.pumps["rollout"].waiting_on == "admission" and st.in_flight() == 0
        assert ctl.statistics().generation_workers_active == 0
        await ctl.expand_generation("sim-gen-0")

    ctl, gens, trainer, storage, summary, violations = await run_elastic(elastic_cfg(), script)
    assert violations == [] and summary.steps == 8
    assert ctl.state.elastic.out == {"sim-gen-1": "asleep"}
    await assert_clean_end(ctl, trainer, storage)


async def test_shrink_and_expand_are_idempotent():
    async def script(ctl, gens):
        await at_step(ctl, 1)
        await ctl.expand_generation("sim-gen-0")  # routable already: nothing to do
        await ctl.shrink_generation("sim-gen-0", 0)
        await ctl.shrink_generation("sim-gen-0", 0)
        await ctl.shrink_generation("sim-gen-0", 1)  # deeper: sleeps now
        await ctl.shrink_generation("sim-gen-0", 1)
        await ctl.shrink_generation("sim-gen-0", 0)  # shallower than asleep: nothing
        await ctl.expand_generation("sim-gen-0")
        await ctl.expand_generation("sim-gen-0")
        with pytest.raises(ValueError, match="sleep level 2"):
            await ctl.shrink_generation("sim-gen-0", 2)  # above rollout.sleep_level
        with pytest.raises(ValueError, match="no generation worker is named 'nope'"):
            await ctl.shrink_generation("nope")

    ctl, gens, trainer, storage, summary, violations = await run_elastic(elastic_cfg(), script)
    el = ctl.state.elastic
    assert violations == [] and gens[0].sleeps == [1]
    assert (el.shrinks, el.expands) == (2, 1)  # the first shrink, and its deepening; one expand
    await assert_clean_end(ctl, trainer, storage)


async def test_a_draining_shrink_lets_the_groups_in_flight_finish():
    async def script(ctl, gens):
        await at_step(ctl, 1)
        await ctl.shrink_generation("sim-gen-0", 1)
        assert ctl.state.worker_load["sim-gen-0"] == 0
        await at_step(ctl, 3)
        await ctl.expand_generation("sim-gen-0")

    ctl, gens, trainer, storage, summary, violations = await run_elastic(elastic_cfg(shrink="drain"), script)
    assert violations == [] and ctl.state.elastic.preempted_groups == 0
    assert not [r for r in ctl.state.prompts.records() if r.uncharged]
    await assert_clean_end(ctl, trainer, storage)
