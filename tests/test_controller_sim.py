"""Layer (b): the whole controller on the simulated backend: pumps, faults, deadlines, teardown."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replay.storage import InMemoryRowStorage
from single_controller.backends.sim import Faults, SimTrainerGroup, sim_prompts, sim_rewards, sim_workers
from single_controller.config import (
    AdvantageConfig,
    BufferConfig,
    Config,
    RolloutConfig,
    RunConfig,
    SamplerConfig,
    SyncConfig,
    TimeoutConfig,
    TrainConfig,
)
from single_controller.controller import CapacityConfigError, Controller, RunFailed
from single_controller.deadlines import DeadlineExceeded, within
from single_controller.state import Workers


def make_cfg(*, steps=6, P=4, G=2, L=1, S=None, chunk=2, order="in_order", capacity=None, in_flight=64, **sections) -> Config:
    cfg = Config(
        run=RunConfig(max_steps=steps, progress_bar=False, plot=False),
        rollout=RolloutConfig(group_size=G, max_in_flight_groups=in_flight),
        train=TrainConfig(groups_per_step=P, min_groups_per_chunk=chunk),
        sampler=SamplerConfig(max_lookahead_versions=L, max_staleness_versions=L if S is None else S, order=order),
        buffer=BufferConfig(capacity_groups=capacity),
        timeouts=TimeoutConfig(generate_s=5, train_call_s=5, weight_sync_s=5, storage_s=5),
    )
    return replace(cfg, **{k: replace(getattr(cfg, k), **v) for k, v in sections.items()})


def run_sim(cfg, faults=None, *, prompts=None, gen_s=0.0, train_s=0.0, num_generators=2, timeout=30.0):
    storage = InMemoryRowStorage()
    gens, trainer = sim_workers(storage, num_generators=num_generators, gen_group_s=gen_s, train_group_s=train_s, faults=faults)
    ctl = Controller(cfg, prompts if prompts is not None else sim_prompts(), storage, Workers(gens, trainer))

    async def go():
        return await asyncio.wait_for(ctl.run(), timeout)

    try:
        summary = asyncio.run(go())
        err = None
    except RunFailed as e:
        summary, err = None, e
    return ctl, trainer, storage, summary, err


def trained_prompts(trainer) -> dict[int, list[str]]:
    return {s: sorted({k.split("-a")[0] for k in keys}) for s, keys in trainer.trained.items()}


def assert_clean_end(ctl, trainer, storage):
    """Nothing resident, every prompt settled exactly once, nothing trained twice."""
    assert asyncio.run(storage.resident_keys()) == set()
    assert ctl.state.ledger.resident() == 0
    assert ctl.state.prompts.unsettled() == []
    all_keys = [k for keys in trainer.trained.values() for k in keys]
    assert len(all_keys) == len(set(all_keys)), "a row was trained twice"
    prompts_trained = Counter(k.split("-a")[0] for k in {k.rsplit("_g", 1)[0] for k in all_keys})
    assert all(n == 1 for n in prompts_trained.values()), "a prompt was trained twice"
    for rec in ctl.state.prompts.records():
        if rec.fate == "trained":
            assert rec.prompt.prompt_id in trained_prompts(trainer)[rec.step]


# -- L = 0 is the naive synchronous loop -------------------------------------------------------
@pytest.mark.parametrize("delays", [False, True])
def test_lookahead_zero_trains_what_a_naive_sync_loop_trains(delays):
    steps, P = 5, 4
    faults = Faults(gen_delay={(f"p{i:06d}", 0): 0.001 * ((7 * i) % 5) for i in range(steps * P)} if delays else {})
    ctl, trainer, storage, summary, err = run_sim(make_cfg(steps=steps, P=P, L=0, chunk=P), faults)
    assert err is None
    # The naive loop: step k generates prompts k*P .. (k+1)*P-1 with the step-k weights, then trains them.
    naive = {k: [f"p{i:06d}" for i in range(k * P, (k + 1) * P)] for k in range(steps)}
    assert trained_prompts(trainer) == naive
    assert all(h["train/staleness_max"] == 0 for h in summary.history)
    assert_clean_end(ctl, trainer, storage)


def test_async_overlaps_with_bounded_staleness():
    ctl, trainer, storage, summary, err = run_sim(make_cfg(steps=8, L=1, chunk=1), gen_s=0.002, train_s=0.002)
    assert err is None and summary.steps == 8
    assert max(h["train/staleness_max"] for h in summary.history) == 1  # it really ran ahead
    assert_clean_end(ctl, trainer, storage)


def test_prefetch_hints_name_next_step_rows_before_that_step_begins():
    class PrefetchingTrainer(SimTrainerGroup):
        def __init__(self, storage):
            super().__init__(storage, group_s=0.002)
            self.hints: list[tuple[int, tuple[str, ...]]] = []  # (trainer version when hinted, keys)

        async def prefetch(self, chunk):
            self.hints.append((self.version, chunk.row_keys))

    storage = InMemoryRowStorage()
    gens, _ = sim_workers(storage, gen_group_s=0.001)
    trainer = PrefetchingTrainer(storage)
    ctl = Controller(make_cfg(steps=8, L=1, chunk=1), sim_prompts(), storage, Workers(gens, trainer))
    asyncio.run(asyncio.wait_for(ctl.run(), 20))
    assert trainer.hints, "no prefetch hint was sent"
    step_of = {k: s for s, keys in trainer.trained.items() for k in keys}
    for version, keys in trainer.hints:
        for k in keys:
            assert step_of[k] == version + 1, "hinted rows must be those of the step after the current one"
    assert_clean_end(ctl, trainer, storage)
    assert_clean_end(ctl, trainer, storage)


# -- faults ------------------------------------------------------------------------------------
def test_trainer_failure_mid_step_aborts_and_retries():
    clean = run_sim(make_cfg(steps=5, L=0, chunk=2))
    faulty = run_sim(make_cfg(steps=5, L=0, chunk=2), Faults(train_fail={(2, 0, 0)}))
    ctl, trainer, storage, summary, err = faulty
    assert err is None and summary.steps == 5
    assert trainer.aborts == 1 and ctl.state.step_retries == 1
    assert trained_prompts(trainer) == trained_prompts(clean[1]), "the retried step trained other groups"
    assert_clean_end(ctl, trainer, storage)


def test_trainer_failing_past_retries_fails_the_run_with_its_cause():
    fails = {(1, 0, a) for a in range(3)}
    ctl, trainer, storage, summary, err = run_sim(make_cfg(steps=4, L=1, train={"max_step_retries": 2}), Faults(train_fail=fails))
    assert isinstance(err, RunFailed) and err.pump == "train"
    assert "train step 1 failed 3 times" in str(err) and "injected trainer failure" in str(err)
    assert trainer.aborts == 3
    assert_clean_end(ctl, trainer, storage)  # teardown cleared rows and settled every prompt
    fates = Counter(r.reason for r in ctl.state.prompts.records() if r.fate == "dropped")
    assert fates["run_failed"] > 0


def test_generation_failure_is_retried():
    ctl, trainer, storage, summary, err = run_sim(make_cfg(steps=3, L=0, chunk=4), Faults(gen_fail={("p000003", 0)}))
    assert err is None
    rec = ctl.state.prompts["p000003"]
    assert rec.attempts == ["p000003-a0", "p000003-a1"] and rec.fate == "trained" and rec.step == 0
    assert ctl.state.ledger.statistics().dropped_by_reason == {"generation_failed": 1}
    assert_clean_end(ctl, trainer, storage)


def test_generation_failure_drops_when_policy_says_drop_and_the_step_is_refilled():
    cfg = make_cfg(steps=3, L=0, chunk=4, rollout={"on_failure": "drop"})
    ctl, trainer, storage, summary, err = run_sim(cfg, Faults(gen_fail={("p000003", 0)}))
    assert err is None
    rec = ctl.state.prompts["p000003"]
    assert (rec.fate, rec.reason, rec.attempts) == ("dropped", "generation_failed", ["p000003-a0"])
    assert all(len(v) == 4 for v in trained_prompts(trainer).values()), "step 0 was not refilled"
    assert "p000004" in trained_prompts(trainer)[0]  # the refill is the next prompt in order
    assert_clean_end(ctl, trainer, storage)


def test_stalled_generation_hits_its_deadline_and_is_retried():
    cfg = make_cfg(steps=2, L=0, chunk=4, timeouts={"generate_s": 0.2})
    ctl, trainer, storage, summary, err = run_sim(cfg, Faults(gen_stall={("p000001", 0)}))
    assert err is None
    assert ctl.state.prompts["p000001"].attempts == ["p000001-a0", "p000001-a1"]
    assert ctl.state.pumps["rollout"].errors == 1
    assert_clean_end(ctl, trainer, storage)


def test_deadline_error_names_what_was_awaited():
    async def go():
        await within(asyncio.Event().wait(), 0.01, "generation worker g0: generate(p1-a0)")

    with pytest.raises(DeadlineExceeded, match=r"timed out after 0.01s waiting for generation worker g0: generate\(p1-a0\)"):
        asyncio.run(go())


def test_a_failing_pump_stops_the_run_with_its_cause():
    class BrokenStorage(InMemoryRowStorage):
        async def put_rows(self, keys, columns, tags=None):
            if "advantage" in columns:
                raise OSError("disk on fire")
            return await super().put_rows(keys, columns, tags)

    storage = BrokenStorage()
    gens, trainer = sim_workers(storage)
    ctl = Controller(make_cfg(steps=3), sim_prompts(), storage, Workers(gens, trainer))
    with pytest.raises(RunFailed, match="advantage pump failed: OSError: disk on fire") as info:
        asyncio.run(asyncio.wait_for(ctl.run(), 10))
    assert isinstance(info.value.__cause__, OSError)
    assert ctl.state.prompts.unsettled() == []
    assert asyncio.run(storage.resident_keys()) == set()


def test_capacity_that_cannot_satisfy_lookahead_is_rejected_before_anything_starts():
    storage = InMemoryRowStorage()
    gens, trainer = sim_workers(storage)
    with pytest.raises(CapacityConfigError, match=r"\(L \+ 1\) \* groups_per_step = 12"):
        Controller(make_cfg(P=4, L=2, capacity=11), sim_prompts(), storage, Workers(gens, trainer))
    assert gens[0].generated == []


def test_dataloader_exhaustion_trains_the_partial_last_step_and_ends():
    ctl, trainer, storage, summary, err = run_sim(make_cfg(steps=10, P=4, L=1), prompts=sim_prompts(10))
    assert err is None
    assert [len(v) for v in trained_prompts(trainer).values()] == [4, 4, 2]
    assert_clean_end(ctl, trainer, storage)


def test_early_stop_cancels_in_flight_and_settles_everything():
    cfg = make_cfg(steps=50, L=1, run={"stop_at_success_rate": 0.0, "success_window": 2})
    ctl, trainer, storage, summary, err = run_sim(cfg, gen_s=0.001)
    assert err is None and summary.steps == 2 and "success rate" in summary.stop_reason
    assert_clean_end(ctl, trainer, storage)


def test_zero_variance_groups_are_dropped_and_refilled():
    cfg = make_cfg(steps=4, P=4, G=2, L=1, advantage={"drop_zero_variance": True})
    ctl, trainer, storage, summary, err = run_sim(cfg)
    assert err is None
    zero = [r for r in ctl.state.prompts.records() if r.reason == "zero_variance"]
    assert zero, "expected some zero-variance groups with G=2 and 5 reward levels"
    for r in zero:
        assert len(set(sim_rewards(r.prompt.prompt_id, 0, 2))) == 1
    assert all(len(v) == 4 for v in trained_prompts(trainer).values())
    assert ctl.state.zero_variance_groups == len(zero)
    assert_clean_end(ctl, trainer, storage)


def test_drain_policy_syncs_with_nothing_in_flight():
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
    asyncio.run(asyncio.wait_for(ctl.run(), 20))
    assert seen and set(seen) == {0}


def test_abort_policy_cancels_everything_in_flight_at_a_sync_and_redispatches_it():
    # p000003 (for step 1, dispatched ahead with L=1) is slow: it is still in flight at the first weight
    # sync, which aborts it (partial group discarded); the prompt is generated again on the new
    # weights and trained.
    cfg = make_cfg(steps=5, P=2, L=1, chunk=1, sync={"drain_policy": "abort"})
    faults = Faults(gen_delay={("p000003", 0): 0.5})
    ctl, trainer, storage, summary, err = run_sim(cfg, faults, gen_s=0.002, train_s=0.002)
    assert err is None
    rec = ctl.state.prompts["p000003"]
    assert rec.attempts[0] == "p000003-a0" and len(rec.attempts) >= 2 and rec.fate == "trained"
    assert ctl.state.ledger["p000003-a0"].reason == "sync_abort"
    assert ctl.state.sync.aborted_in_flight >= 1
    assert_clean_end(ctl, trainer, storage)


def test_abort_stale_in_flight_redispatches_the_prompt():
    # Window mode: p000000's first attempt is slow; by the time it could finish it is too stale.
    cfg = make_cfg(steps=6, P=2, L=1, S=1, chunk=1, order="fifo", sampler={"abort_stale_in_flight": True})
    faults = Faults(gen_delay={("p000000", 0): 1.0})
    ctl, trainer, storage, summary, err = run_sim(cfg, faults, gen_s=0.002, train_s=0.002)
    assert err is None
    rec = ctl.state.prompts["p000000"]
    assert rec.attempts[0] == "p000000-a0" and len(rec.attempts) >= 2
    assert ctl.state.sampler.statistics().aborted_in_flight_total >= 1
    assert_clean_end(ctl, trainer, storage)


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
def test_no_deadlock_and_invariants_under_arbitrary_configs(L, extra, P, G, chunk, spare, order, in_flight, drain, drop_zero, gen_fail, train_fail, delays):
    S = L + extra
    cfg = make_cfg(
        steps=6, P=P, G=G, L=L, S=S, chunk=min(chunk, P), order=order, in_flight=in_flight,
        capacity=(L + 1) * P + spare, sync={"drain_policy": "drain" if drain else "keep"},
        advantage={"drop_zero_variance": drop_zero},
    )
    faults = Faults(
        gen_fail={(f"p{i:06d}", 0) for i in gen_fail},
        train_fail=set(train_fail),
        gen_delay={(f"p{i:06d}", 0): d * 0.001 for i, d in enumerate(delays)},
    )
    ctl, trainer, storage, summary, err = run_sim(cfg, faults, timeout=20)
    assert err is None, err
    assert summary.steps == 6
    for step, keys in trainer.trained.items():
        groups = {k.rsplit("_g", 1)[0] for k in keys}
        assert len(groups) == P
        for gid in groups:
            assert ctl.state.sampler.staleness(ctl.state.ledger[gid], step) <= S
    assert_clean_end(ctl, trainer, storage)
