"""Colocated turns (`backend.colocate_form: turns`, `single_controller/device_turns.py`) on the sim
backend: the device goes to training before each step (every worker asleep, the trainer's state
back) and to generation after its weights are published (the trainer offloaded, every worker awake
with those weights); nothing generates while a step is open, every prompt trains once, the
staleness bound holds."""

import asyncio
import dataclasses

from replay.storage import InMemoryRowStorage
from single_controller.backends.sim import sim_prompts, sim_workers
from single_controller.controller import Controller
from single_controller.state import Workers
from tests.helpers.sim import assert_clean_end, make_cfg


def turns_cfg(steps=6, level=1, offload="all", L=1):
    return make_cfg(
        steps=steps,
        P=4,
        G=2,
        L=L,
        in_flight=16,
        rollout=dict(sleep_level=level),
        backend=dict(generation="sim", trainer="sim", colocate=True, colocate_form="turns"),
        train=dict(groups_per_step=4, min_groups_per_chunk=2, offload=offload),
    )


async def run_turns(cfg, *, gen_s=0.003, train_s=0.004):
    """Run with every generation submission and every step's begin and finish checked against the
    turns: `violations` lists each one made while the other role had the device."""
    storage = InMemoryRowStorage()
    gens, trainer = sim_workers(storage, num_generators=2, gen_group_s=gen_s, train_group_s=train_s)
    ctl = Controller(cfg, sim_prompts(), storage, Workers(gens, trainer))
    violations: list[str] = []
    for g in gens:
        submit = g.submit

        def checked(request, g=g, submit=submit):
            if trainer._open is not None:
                violations.append(f"{request.group_id} sent to {g.name} while step {trainer._step} is open")
            if cfg.train.offload != "none" and trainer.offloaded is None and trainer.version > 0:
                violations.append(f"{request.group_id} generated with the trainer's state on the device")
            return submit(request)

        g.submit = checked
    for name in ("begin_train_step", "finish_train_step"):
        call = getattr(trainer, name)

        async def checked_call(step, *args, call=call, name=name):
            awake = [g.name for g in gens if g.asleep is None]
            if awake:
                violations.append(f"{name}({step}) while {awake} awake")
            return await call(step, *args)

        setattr(trainer, name, checked_call)
    async with asyncio.timeout(30):
        summary = await ctl.run()
    return ctl, gens, trainer, storage, summary, violations


async def test_turns_put_the_engine_to_sleep_for_each_step_and_wake_it_with_the_new_weights():
    cfg = turns_cfg()
    ctl, gens, trainer, storage, summary, violations = await run_turns(cfg)
    assert violations == []
    assert summary.steps == trainer.optimizer_steps == 6 and ctl.state.versions.served == 6
    rec = ctl.turns.record
    # Handovers: sleep and onload before a step begins, offload and wake once its weights are
    # published. Usually one per step; a step whose groups were all ready as the previous one ended
    # begins before the weights go out and keeps the device (more so on a loaded machine; the last
    # test pins that case), so the handovers are counted, not assumed.
    events = list(rec.events)
    cycles = [events[i : i + 4] for i in range(0, len(events), 4)]
    assert len(events) % 4 == 0 and len(cycles) >= 2, events
    starts = [0]
    for (sleep, onload, offload, wake), begin in zip(cycles, starts):
        assert (sleep, onload) == (("sleep", begin), ("onload", begin)), events
        assert offload[0] == "offload" and wake == ("wake", offload[1]) and offload[1] > begin, events
        starts.append(offload[1])  # the next handover is before the step that version trains
    assert starts[-1] == 6, events
    n = len(cycles)
    assert (rec.to_train, rec.to_generate) == (n, n)
    assert trainer.moves == [e for e in events if e[0] in ("onload", "offload")]  # after the last: offloaded
    assert trainer.implicit_onloads == 0  # the turns brought the state back before every begin
    assert [g.sleeps for g in gens] == [[1] * n, [1] * n]
    assert all(g.asleep is None for g in gens)  # awake at the end, with the last weights
    assert [g.version for g in gens] == [6, 6]
    await assert_clean_end(ctl, trainer, storage)  # every prompt trained exactly once
    bound = cfg.sampler.max_staleness_versions
    assert max(r["train/staleness_max"] for r in summary.history) <= bound
    last = summary.history[-1]  # written as the last step ends, before its weights go out
    assert (last["turns/to_train"], last["turns/to_generate"]) == (n, n - 1)
    assert (ctl.state.elastic.shrinks, ctl.state.elastic.expands) == (2 * n, 2 * n)


async def test_turns_at_sleep_level_2_without_offload_never_moves_the_trainer():
    cfg = turns_cfg(steps=4, level=2, offload="none", L=0)
    ctl, gens, trainer, storage, summary, violations = await run_turns(cfg)
    assert violations == []
    assert summary.steps == 4
    assert trainer.moves == []
    assert [g.sleeps for g in gens] == [[2] * 4, [2] * 4]
    assert [e for e, _ in ctl.turns.record.events] == ["sleep", "wake"] * 4
    await assert_clean_end(ctl, trainer, storage)
    assert max(r["train/staleness_max"] for r in summary.history) == 0


async def test_without_turns_generation_overlaps_training_and_the_checks_above_can_fail():
    cfg = turns_cfg(steps=4, offload="none")
    cfg = cfg.__class__(**{**cfg.__dict__, "backend": cfg.backend.__class__(generation="sim", trainer="sim")})
    ctl, gens, trainer, storage, summary, violations = await run_turns(cfg, gen_s=0.003, train_s=0.01)
    assert ctl.turns is None and summary.steps == 4
    assert any("awake" in v for v in violations) and any("is open" in v for v in violations)


async def test_a_step_whose_groups_were_all_ready_trains_on_without_a_handover():
    """Fast generation with a lookahead of one: the next step's groups are all ready as a step
    ends, it begins before the weights go out, and the device stays with training until the next
    weights (no sleep and wake in between); the turns still never overlap."""
    cfg = turns_cfg(steps=8, L=1)
    ctl, gens, trainer, storage, summary, violations = await run_turns(cfg, gen_s=0.0005, train_s=0.02)
    assert violations == []
    rec = ctl.turns.record
    assert summary.steps == 8 and rec.kept_for_training > 0
    assert rec.to_train + rec.kept_for_training == 8  # every step began under a turn: its own, or kept
    assert trainer.implicit_onloads == 0
    await assert_clean_end(ctl, trainer, storage)
    assert max(r["train/staleness_max"] for r in summary.history) <= cfg.sampler.max_staleness_versions


async def test_a_step_of_several_updates_takes_the_device_only_once_all_its_groups_are_ready():
    """train.updates_per_step with turns: the device goes to training only once the whole step can
    train (not its first update's groups: the rest could then never be generated, the engine asleep),
    and each step then trains its updates in turn."""
    cfg = turns_cfg(steps=4)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, updates_per_step=2))
    ctl, gens, trainer, storage, summary, violations = await run_turns(cfg)
    assert violations == [] and summary.steps == 4
    for step, updates in trainer.updates.items():
        assert [len({k.rsplit("_g", 1)[0] for k in keys}) for keys in updates] == [2, 2], (step, updates)
    await assert_clean_end(ctl, trainer, storage)
