"""Layer (b): generation worker faults around elastic resizes (`single_controller/elastic.py`), on sim
controllers: a death while shrunk or just before a shrink is handled as outside a pool (down, restarted
asleep, expanded again), a shrink never lands inside the same worker's weight update, and a pooled run
resumed at sleep level 1 updates its routable workers only, and a shrink withdraws the eval requests
on its worker before it sleeps."""

from __future__ import annotations

import asyncio
import itertools

from replay.storage import InMemoryRowStorage
from single_controller.backends.sim import sim_prompts, sim_workers
from single_controller.checkpoint import latest_checkpoint, read_controller_state
from single_controller.controller import Controller
from single_controller.pool.link import InProcessPool, PoolLink
from single_controller.pool.planner import RunSlots
from single_controller.pool.scheduler import PoolScheduler
from single_controller.protocols import GenerationFailed
from single_controller.state import Workers
from tests.helpers.sim import EVAL_PROMPTS, assert_clean_end, make_cfg


def cfg_of(steps: int = 6, **more):
    return make_cfg(steps=steps, P=4, G=2, L=1, in_flight=16, rollout=dict(sleep_level=1, shrink="abort"), **more)


async def run_with(ctl: Controller, script, timeout: float = 20.0):
    async with asyncio.timeout(timeout):
        async with asyncio.TaskGroup() as tg:
            run = tg.create_task(ctl.run())
            tg.create_task(script())
    return run.result()


async def at_step(ctl: Controller, step: int) -> None:
    await ctl.state.changed.wait_until(lambda: ctl.state.versions.trained >= step)


def kill(gen) -> None:
    """kill -9 of the worker's process: every later call fails with `GenerationWorkerDied`."""
    gen.dead = True
    gen._died().set()


async def test_a_worker_that_dies_while_shrunk_is_restarted_asleep_and_expanded_and_a_one_worker_run_goes_on():
    storage = InMemoryRowStorage()
    gens, trainer = sim_workers(storage, num_generators=1, gen_group_s=0.002)
    ctl = Controller(cfg_of(), sim_prompts(), storage, Workers(gens, trainer))
    st = ctl.state

    async def script():
        await at_step(ctl, 1)
        await ctl.shrink_generation("sim-gen-0", 1)
        kill(gens[0])  # while asleep: nothing is routed to it, nothing notices
        await ctl.expand_generation("sim-gen-0")  # finds it dead: down, restarted (asleep), woken
        assert st.routable() == list(gens) and st.health.down == {}

    summary = await run_with(ctl, script)
    assert summary.steps == 6 and trainer.optimizer_steps == 6
    assert gens[0].restarts == 1 and st.counters.worker_deaths == 1 and st.counters.worker_restarts == 1
    assert gens[0].sleeps == [1]  # restarted for its expand: not put to sleep only to be woken
    assert gens[0].calls_while_asleep == 0 and gens[0].version == st.versions.served
    assert st.elastic.failed_expands == 0 and st.elastic.expands == 1
    await assert_clean_end(ctl, trainer, storage)


async def test_a_worker_that_dies_just_before_its_shrink_is_shrunk_down_and_restarted_asleep():
    storage = InMemoryRowStorage()
    gens, trainer = sim_workers(storage, num_generators=2, gen_group_s=0.002)
    ctl = Controller(cfg_of(steps=8), sim_prompts(), storage, Workers(gens, trainer))
    st = ctl.state

    async def script():
        await at_step(ctl, 1)
        kill(gens[1])
        await ctl.shrink_generation("sim-gen-1", 1)  # its sleep finds it dead: shrunk (nothing left on its slot)
        assert st.elastic.out == {"sim-gen-1": "asleep"}
        await st.changed.wait_until(lambda: "sim-gen-1" not in st.health.down)
        assert gens[1].restarts == 1 and gens[1].asleep == 1  # restarted, and put to sleep: it is shrunk
        await at_step(ctl, 3)
        await ctl.expand_generation("sim-gen-1")

    summary = await run_with(ctl, script)
    assert summary.steps == 8 and st.counters.worker_deaths == 1 and st.elastic.failed_expands == 0
    assert gens[1].calls_while_asleep == 0 and gens[1].version == st.versions.served
    await assert_clean_end(ctl, trainer, storage)


async def test_a_shrink_during_the_workers_weight_update_waits_for_it_and_neither_is_taken_for_a_death():
    storage = InMemoryRowStorage()
    gens, trainer = sim_workers(storage, num_generators=2, gen_group_s=0.02)
    ctl = Controller(cfg_of(steps=8), sim_prompts(), storage, Workers(gens, trainer))
    st, g = ctl.state, gens[1]
    updating = asyncio.Event()
    apply = g.update_weights

    async def update(weights):  # as the torch worker's: fetch the snapshot, then apply it, refused while asleep
        updating.set()
        await asyncio.sleep(0.01)
        if g.asleep:
            raise GenerationFailed(f"{g.name}: update_weights(v{weights.version}) while asleep (wake() first)")
        await apply(weights)

    g.update_weights = update

    async def script():
        for step in (1, 3, 5):  # three collisions (the fourth used to give the worker up)
            await at_step(ctl, step)
            updating.clear()
            await updating.wait()  # a weight sync's update of sim-gen-1 is under way
            await ctl.shrink_generation("sim-gen-1", 1)
            assert g.asleep == 1 and st.health.down == {}
            await ctl.expand_generation("sim-gen-1")

    summary = await run_with(ctl, script)
    assert summary.steps == 8 and st.counters.worker_deaths == 0 and g.restarts == 0
    assert st.elastic.shrinks == st.elastic.expands == 3 and g.calls_while_asleep == 0
    await assert_clean_end(ctl, trainer, storage)


async def test_a_pooled_run_resumed_at_sleep_level_1_updates_its_routable_workers_only_and_trains(tmp_path):
    storage = InMemoryRowStorage()
    first = cfg_of(steps=2, checkpoint={"every_steps": 2})
    gens, trainer = sim_workers(storage, num_generators=2, gen_group_s=0.002)
    await asyncio.wait_for(
        Controller(first, sim_prompts(), storage, Workers(gens, trainer), run_dir=str(tmp_path)).run(), 20
    )
    saved = read_controller_state(latest_checkpoint(tmp_path))
    assert saved["step"] == 2
    gens2, trainer2 = sim_workers(storage, num_generators=2, gen_group_s=0.002)
    await trainer2.load_state(str(latest_checkpoint(tmp_path) / "trainer"))
    prompts = itertools.islice(sim_prompts(), saved["dataloader"]["taken"], None)
    ctl = Controller(cfg_of(steps=4), prompts, storage, Workers(gens2, trainer2), run_dir=str(tmp_path), resume=saved)
    pool = PoolScheduler(2)
    link = PoolLink(ctl, InProcessPool(pool), RunSlots("resumed", (0, 1), (0,)), 1)
    async with asyncio.timeout(20):
        async with asyncio.TaskGroup() as tg:
            serving = tg.create_task(pool.serve())
            summary = await link.run()
            pool.close()
    await serving
    assert summary.steps == 4 and sorted(trainer2.trained) == [2, 3]
    # the resume found both workers asleep (out of the pool): they got the weights at their expands
    assert [g.sleeps[0] for g in gens2] == [1, 1] and ctl.state.counters.worker_deaths == 0
    assert ctl.state.elastic.expands >= 1 and pool.statistics().train_grants == 2


async def test_a_shrink_withdraws_the_eval_requests_on_its_worker_before_it_sleeps_and_they_go_again_uncharged():
    cfg = cfg_of(steps=4, eval={"enabled": True, "every_steps": 2, "num_prompts": len(EVAL_PROMPTS)})
    storage = InMemoryRowStorage()
    gens, trainer = sim_workers(storage, num_generators=2, gen_group_s=0.002)
    ctl = Controller(cfg, sim_prompts(), storage, Workers(gens, trainer), eval_prompts=EVAL_PROMPTS)
    g, held, evals_on, at_sleep = gens[1], asyncio.Event(), set(), []
    generate, sleep = g.generate, g.sleep

    async def generating(req):
        if not req.eval:
            return await generate(req)
        evals_on.add(req.group_id)
        try:
            if not held.is_set():  # the first eval request it gets stays in flight until the shrink
                held.set()
                await ctl.state.changed.wait_until(lambda: g.name in ctl.state.elastic.out and bool(g.sleeps))
            return await generate(req)
        finally:
            evals_on.discard(req.group_id)

    async def sleeping(level):
        at_sleep.append(set(evals_on))
        await sleep(level)

    g.generate, g.sleep = generating, sleeping

    async def script():
        await held.wait()
        await ctl.shrink_generation(g.name, 1)
        await ctl.expand_generation(g.name)

    summary = await run_with(ctl, script)
    assert at_sleep == [set()]  # (S4: the held eval request was still in flight on it)
    tracker = ctl.eval_tracker
    assert summary.steps == 4 and tracker.failed == 0 and tracker.request_failures == 0
    assert len(tracker.points) == 3 and tracker.points[-1].version == 4  # (a round may move on to a newer version)
