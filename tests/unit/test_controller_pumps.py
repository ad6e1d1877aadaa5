"""Layer (b): the whole controller on the simulated backend: its pumps and loop (the naive synchronous loop at
L = 0, bounded staleness, prefetch hints, dispatch slices, advantages, the end of the data, early stop), and no
deadlock and no bound violated under arbitrary configs and faults. Faults, weight syncs, checkpoints, worker
death and withdrawal: the other test_controller_*.py files."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replay.storage import InMemoryRowStorage
from single_controller.backends.sim import (
    Faults,
    SimGenerationWorker,
    SimTrainerGroup,
    sim_prompts,
    sim_rewards,
    sim_workers,
)
from single_controller.controller import CapacityConfigError, Controller
from single_controller.state import PumpClock, Workers
from tests.helpers.sim import assert_clean_end, make_cfg, run_sim, trained_prompts


def test_a_pumps_total_wait_counts_the_wait_under_way():
    clk = PumpClock("train")
    clk.wait_s["ready groups"] += 1.5
    clk.wait_s["weight sync"] += 0.25
    assert clk.total_wait_s(10.0) == 1.75 == sum(clk.statistics(10.0).wait_s_by_reason.values())
    clk.waiting_on, clk.wait_started = "ready groups", 9.0
    assert clk.total_wait_s(10.0) == 2.75 == sum(clk.statistics(10.0).wait_s_by_reason.values())


async def test_step_records_split_each_pumps_waits_over_the_steps_and_count_routable_workers():
    ctl, trainer, storage, summary, err = await run_sim(
        make_cfg(steps=4, P=2), gen_s=0.002, train_s=0.002, num_generators=3
    )
    assert err is None and len(summary.history) == 4
    end = ctl.state.clock()
    for name, clk in ctl.state.pumps.items():
        waits = [r[f"pump/{name}_wait_s"] for r in summary.history]
        assert min(waits) >= 0 and sum(waits) <= clk.total_wait_s(end)
    assert sum(r["pump/train_wait_s"] for r in summary.history) > 0  # it waited for groups to generate
    assert [r["rollout/workers_routable"] for r in summary.history] == [3] * 4
    ctl.state.worker_down(ctl.state.workers.generators[1], "test")
    assert ctl.state.routable_count() == len(ctl.state.routable()) == 2


# -- L = 0 is the naive synchronous loop -------------------------------------------------------
@pytest.mark.parametrize("delays", [False, True])
async def test_lookahead_zero_trains_what_a_naive_sync_loop_trains(delays):
    steps, P = 5, 4
    faults = Faults(gen_delay={(f"p{i:06d}", 0): 0.001 * ((7 * i) % 5) for i in range(steps * P)} if delays else {})
    ctl, trainer, storage, summary, err = await run_sim(make_cfg(steps=steps, P=P, L=0, chunk=P), faults)
    assert err is None
    # The naive loop: step k generates prompts k*P .. (k+1)*P-1 with the step-k weights, then trains them.
    naive = {k: [f"p{i:06d}" for i in range(k * P, (k + 1) * P)] for k in range(steps)}
    assert trained_prompts(trainer) == naive
    assert all(h["train/staleness_max"] == 0 for h in summary.history)
    await assert_clean_end(ctl, trainer, storage)


async def test_async_overlaps_with_bounded_staleness():
    ctl, trainer, storage, summary, err = await run_sim(make_cfg(steps=8, L=1, chunk=1), gen_s=0.002, train_s=0.002)
    assert err is None and summary.steps == 8
    assert max(h["train/staleness_max"] for h in summary.history) == 1  # it really ran ahead
    await assert_clean_end(ctl, trainer, storage)


async def test_prefetch_hints_name_next_step_rows_before_that_step_begins():
    class PrefetchingTrainer(SimTrainerGroup):
        def __init__(self, storage):
            super().__init__(storage, group_s=0.002)
            self.hints: list[tuple[int, int, tuple[str, ...]]] = []  # (trainer version, hinted step, keys)

        async def prefetch(self, chunk):
            self.hints.append((self.version, chunk.step, chunk.row_keys))

    storage = InMemoryRowStorage()
    gens, _ = sim_workers(storage, gen_group_s=0.001)
    trainer = PrefetchingTrainer(storage)
    ctl = Controller(make_cfg(steps=8, L=1, chunk=1), sim_prompts(), storage, Workers(gens, trainer))
    await asyncio.wait_for(ctl.run(), 20)
    assert trainer.hints, "no prefetch hint was sent"
    step_of = {k: s for s, keys in trainer.trained.items() for k in keys}
    for version, step, keys in trainer.hints:
        # the trainer's own version may run a finish ahead of the controller's (a remote call)
        assert step in (version, version + 1), "a hint names the step after the one in progress"
        for k in keys:
            assert step_of[k] == step, "hinted rows must be trained in the step they were hinted for"
    await assert_clean_end(ctl, trainer, storage)
    await assert_clean_end(ctl, trainer, storage)


# -- dispatch slices, advantages, capacity, the end of the data and early stop ------------------
async def test_a_steps_worth_of_requests_starts_in_slices_with_the_loop_running_between_them():
    """Admission opening for a whole step used to start every request in one turn of the event
    loop (~5 ms at 256 groups here), and a chunk that completed meanwhile waited behind all of it.
    The rollout pump dispatches in slices and yields between them: at most DISPATCH_SLICE requests
    start per loop turn (a ticker task counts the turns)."""
    from pumps.rollout import DISPATCH_SLICE

    turn = 0
    starts: Counter[int] = Counter()  # loop turn -> requests that started in it

    async def ticker():
        nonlocal turn
        while True:
            turn += 1
            await asyncio.sleep(0)

    class Recording(SimGenerationWorker):
        async def generate(self, request):
            starts[turn] += 1
            return await super().generate(request)

    storage = InMemoryRowStorage()
    _, trainer = sim_workers(storage, train_group_s=0.0005)
    gens = [Recording(f"g{i}", storage, group_s=0.001) for i in range(2)]
    P = 6 * DISPATCH_SLICE
    cfg = make_cfg(steps=3, P=P, chunk=DISPATCH_SLICE, in_flight=2 * P)
    ctl = Controller(cfg, sim_prompts(), storage, Workers(gens, trainer))
    tick = asyncio.create_task(ticker())
    try:
        summary = await asyncio.wait_for(ctl.run(), 30)
    finally:
        tick.cancel()
    assert summary.steps == 3 and sum(starts.values()) >= 3 * P
    assert max(starts.values()) <= DISPATCH_SLICE, sorted(starts.values())[-5:]


async def test_advantages_travel_in_the_chunks_and_are_never_stored():
    """The trainer gets each row's advantage with its chunk (what the advantage pump computed from
    the group's rewards), and the storage never sees an `advantage` column."""
    from single_controller.algorithm.advantages import grpo_advantages

    class Recording(InMemoryRowStorage):
        fields_put: set = set()

        async def put_rows(self, keys, columns, tags=None):
            self.fields_put = self.fields_put | set(columns)
            return await super().put_rows(keys, columns, tags)

    storage = Recording()
    gens, trainer = sim_workers(storage)
    chunks = []
    train_microbatch = trainer.train_microbatch

    async def spy(chunk):
        chunks.append(chunk)
        await train_microbatch(chunk)

    trainer.train_microbatch = spy
    ctl = Controller(make_cfg(steps=3), sim_prompts(), storage, Workers(gens, trainer))
    await asyncio.wait_for(ctl.run(), 30)
    assert chunks and "advantage" not in storage.fields_put
    cfg = ctl.cfg.advantage
    for chunk in chunks:
        assert "advantage" not in chunk.fields and len(chunk.advantages) == len(chunk.row_keys)
        by_group: dict[str, list[float]] = {}
        for key, a in zip(chunk.row_keys, chunk.advantages):
            by_group.setdefault(key.rsplit("_g", 1)[0], []).append(a)
        for group_id, advs in by_group.items():
            rewards = ctl.state.ledger[group_id].rewards
            assert tuple(advs) == grpo_advantages(rewards, normalize_std=cfg.normalize_std, eps=cfg.eps)


def test_capacity_that_cannot_satisfy_lookahead_is_rejected_before_anything_starts():
    storage = InMemoryRowStorage()
    gens, trainer = sim_workers(storage)
    with pytest.raises(CapacityConfigError, match=r"\(L \+ 1\) \* groups_per_step = 12"):
        Controller(make_cfg(P=4, L=2, capacity=11), sim_prompts(), storage, Workers(gens, trainer))
    assert gens[0].generated == []


async def test_dataloader_exhaustion_trains_the_partial_last_step_and_ends():
    ctl, trainer, storage, summary, err = await run_sim(make_cfg(steps=10, P=4, L=1), prompts=sim_prompts(10))
    assert err is None
    assert [len(v) for v in trained_prompts(trainer).values()] == [4, 4, 2]
    await assert_clean_end(ctl, trainer, storage)


async def test_early_stop_cancels_in_flight_and_settles_everything():
    cfg = make_cfg(steps=50, L=1, run={"stop_at_success_rate": 0.0, "success_window": 2})
    ctl, trainer, storage, summary, err = await run_sim(cfg, gen_s=0.001)
    assert err is None and summary.steps == 2 and "success rate" in summary.stop_reason
    await assert_clean_end(ctl, trainer, storage)


async def test_zero_variance_groups_are_dropped_and_refilled():
    cfg = make_cfg(steps=4, P=4, G=2, L=1, advantage={"drop_zero_variance": True})
    ctl, trainer, storage, summary, err = await run_sim(cfg)
    assert err is None
    zero = [r for r in ctl.state.prompts.records() if r.reason == "zero_variance"]
    assert zero, "expected some zero-variance groups with G=2 and 5 reward levels"
    for r in zero:
        assert len(set(sim_rewards(r.prompt.prompt_id, 0, 2))) == 1
    assert all(len(v) == 4 for v in trained_prompts(trainer).values())
    assert ctl.state.counters.zero_variance_groups == len(zero)
    await assert_clean_end(ctl, trainer, storage)


@pytest.mark.parametrize("in_flight, spare", [(3, 8), (8, 0), (64, 0)])
async def test_a_dispatch_slice_stops_at_the_in_flight_limit_and_at_capacity(in_flight, spare):
    """A slice dispatches without re-checking admission after every group: it counts down the
    in-flight limit and the free slots itself. Neither may ever be exceeded (the ledger refuses a
    reservation beyond capacity), and each is reached."""
    P = 8
    cfg = make_cfg(steps=4, P=P, G=2, L=1, chunk=1, in_flight=in_flight, capacity=2 * P + spare)
    storage = InMemoryRowStorage()
    gens, trainer = sim_workers(storage, num_generators=3, gen_group_s=0.002, train_group_s=0.001)
    ctl = Controller(cfg, sim_prompts(), storage, Workers(gens, trainer))
    seen: list[tuple[int, int]] = []  # (groups in flight, resident groups) at each request a worker gets
    for g in gens:

        def counted(request, inner=g.generate):
            seen.append((ctl.state.in_flight(), ctl.state.ledger.resident()))
            return inner(request)

        g.generate = counted
    summary = await asyncio.wait_for(ctl.run(), 30)
    assert summary.steps == 4
    assert max(n for n, _ in seen) == min(in_flight, cfg.buffer.capacity_groups)
    assert max(r for _, r in seen) <= cfg.buffer.capacity_groups
    await assert_clean_end(ctl, trainer, storage)


# -- no deadlock, no bound violated, nothing lost, under arbitrary configs and faults ----------
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    L=st.integers(0, 2),
    extra=st.integers(0, 1),
    P=st.integers(1, 4),
    G=st.integers(2, 3),
    chunk=st.integers(1, 4),
    spare=st.integers(0, 3),
    order=st.sampled_from(["in_order", "fifo", "freshest"]),
    in_flight=st.integers(1, 8),
    drain=st.booleans(),
    drop_zero=st.booleans(),
    gen_fail=st.sets(st.integers(0, 30), max_size=4),
    train_fail=st.sets(st.tuples(st.integers(0, 5), st.integers(0, 2), st.just(0)), max_size=2),
    delays=st.lists(st.integers(0, 3), min_size=30, max_size=30),
)
async def test_no_deadlock_and_invariants_under_arbitrary_configs(
    L, extra, P, G, chunk, spare, order, in_flight, drain, drop_zero, gen_fail, train_fail, delays
):
    S = L + extra
    cfg = make_cfg(
        steps=6,
        P=P,
        G=G,
        L=L,
        S=S,
        chunk=min(chunk, P),
        order=order,
        in_flight=in_flight,
        capacity=(L + 1) * P + spare,
        sync={"drain_policy": "drain" if drain else "keep"},
        advantage={"drop_zero_variance": drop_zero},
    )
    faults = Faults(
        gen_fail={(f"p{i:06d}", 0) for i in gen_fail},
        train_fail=set(train_fail),
        gen_delay={(f"p{i:06d}", 0): d * 0.001 for i, d in enumerate(delays)},
    )
    ctl, trainer, storage, summary, err = await run_sim(cfg, faults, timeout=20)
    assert err is None, err
    assert summary.steps == 6
    for step, keys in trainer.trained.items():
        groups = {k.rsplit("_g", 1)[0] for k in keys}
        assert len(groups) == P
        for gid in groups:
            assert ctl.state.sampler.staleness(ctl.state.ledger[gid], step) <= S
    await assert_clean_end(ctl, trainer, storage)


async def test_the_ledger_forgets_finished_steps():
    """The per-step counts the rollout pump reads keep only the steps still open: flat memory over
    a long run (they used to keep one entry per step ever dispatched)."""
    ctl, trainer, storage, summary, err = await run_sim(make_cfg(steps=120, P=2, G=2, L=1, chunk=1))
    assert err is None and summary.steps == 120
    led = ctl.state.ledger
    assert len(led._live_by_step) <= 3 and len(led._open_by_step) <= 3, (
        dict(led._live_by_step),
        dict(led._open_by_step),
    )


def test_rows_cut_short_travel_without_loss_and_overlong_rows_are_punished_before_advantages():
    """train.mask_truncated: a truncated row's advantage travels as NO_LOSS (the trainer drops the
    row); reward.overlong_buffer: DAPO's punishment of each row's length joins its reward before
    the group's advantages, and the record keeps the rewards as scored."""
    import math
    from types import SimpleNamespace

    from pumps.advantage import shaped_rewards
    from pumps.train import _chunk
    from replay.ledger import GroupRecord
    from single_controller.algorithm.advantages import grpo_advantages
    from single_controller.types import Prompt

    cfg = make_cfg(
        train={"mask_truncated": True},
        rollout={"max_new_tokens": 8},
        reward={"overlong_buffer": 4, "overlong_penalty": 1.0},
    )
    rec = GroupRecord("g", Prompt("p", (1, 2)), 0, 0, 0, 0, 0.0, keys=("g_0", "g_1", "g_2"))
    rec.rewards, rec.response_lengths, rec.truncated = (1.0, 1.0, 0.0), (3, 6, 8), (False, False, True)
    rec.seq_lengths, rec.advantages = (5, 8, 10), (0.5, 0.25, -0.75)
    # lengths 3, 6, 8 against 8 new tokens with a buffer of 4: 0, (4 - 6) / 4 = -0.5, -1
    assert shaped_rewards(rec, cfg) == (1.0, 0.5, -1.0)
    assert rec.rewards == (1.0, 1.0, 0.0)
    assert grpo_advantages(shaped_rewards(rec, cfg), normalize_std=True, eps=1e-6) != grpo_advantages(
        rec.rewards, normalize_std=True, eps=1e-6
    )
    chunk = _chunk(SimpleNamespace(cfg=cfg), 0, 0, [rec])
    assert chunk.advantages[:2] == (0.5, 0.25) and math.isnan(chunk.advantages[2])
    plain = _chunk(SimpleNamespace(cfg=make_cfg()), 0, 0, [rec])
    assert plain.advantages == rec.advantages


@pytest.mark.parametrize("chunk", [1, 3])
async def test_several_updates_per_step_never_split_a_chunk_across_updates(chunk):
    """train.updates_per_step: a step's groups go in its updates in selection order, groups_per_step /
    updates_per_step groups each, a chunk never spanning two (the sim trainer refuses an update out of
    order, as a rank does); one weight sync per step; a retried step sends its updates again;
    exactly-once holds. The last step is partial (the data runs out): fewer updates."""
    P, G, M = 6, 2, 3
    cfg = make_cfg(steps=5, P=P, G=G, L=1, chunk=chunk, train={"updates_per_step": M, "max_step_retries": 2})
    ctl, trainer, storage, summary, err = await run_sim(cfg, Faults(train_fail={(2, 1, 0)}), prompts=sim_prompts(26))
    assert err is None and summary.steps == 5
    for step, updates in trainer.updates.items():
        groups = [sorted({k.rsplit("_g", 1)[0] for k in keys}) for keys in updates]
        want = [P // M] * M if step < 4 else [2]  # 26 prompts: 4 whole steps, then 2 groups
        assert [len(g) for g in groups] == want, (step, groups)
        assert [k for keys in updates for k in keys] == trainer.trained[step]
    assert trainer.attempts[2] == 1  # step 2 failed once and ran again, all its updates
    assert ctl.state.versions.trained == 5
    await assert_clean_end(ctl, trainer, storage)


async def test_the_kl_in_the_reward_is_measured_for_every_committed_group_before_its_advantages():
    """reward.kl_coef: the trainer measures each committed group's KL to the reference before its
    advantages, which are then the group's rewards minus kl_coef x that KL; the step records report
    the KL and its penalty."""
    from single_controller.algorithm.advantages import grpo_advantages
    from single_controller.backends.sim import sim_reward_kl

    cfg = make_cfg(steps=3, reward={"kl_coef": 0.5})
    ctl, trainer, storage, summary, err = await run_sim(cfg)
    assert err is None and summary.steps == 3
    measured = {k for keys in trainer.reward_kl_calls for k in keys}
    adv = ctl.cfg.advantage
    for keys in trainer.trained.values():
        assert set(keys) <= measured
        for group_id in {k.rsplit("_g", 1)[0] for k in keys}:
            rec = ctl.state.ledger[group_id]
            assert rec.reward_kl == tuple(sim_reward_kl(k) for k in rec.keys)
            shaped = [r - 0.5 * sim_reward_kl(k) for r, k in zip(rec.rewards, rec.keys)]
            assert rec.advantages == grpo_advantages(shaped, normalize_std=adv.normalize_std, eps=adv.eps)
    records = [r for r in ctl.history if "reward/kl_mean" in r]
    assert len(records) == 3 and all(r["reward/kl_penalty_mean"] == -0.5 * r["reward/kl_mean"] for r in records)
    await assert_clean_end(ctl, trainer, storage)
