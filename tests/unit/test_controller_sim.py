"""Layer (b): the whole controller on the simulated backend: pumps, faults, deadlines, teardown."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replay.ledger import GroupState
from replay.storage import InMemoryRowStorage, StorageError, row_keys
from single_controller.backends.sim import (
    Faults,
    SimGenerationWorker,
    SimTrainerGroup,
    sim_prompts,
    sim_rewards,
    sim_workers,
)
from single_controller.checkpoint import CheckpointError, check_compatible, latest_checkpoint, read_controller_state
from single_controller.controller import CapacityConfigError, Controller, RunFailed
from single_controller.deadlines import DeadlineExceeded, within
from single_controller.protocols import GenerationFailed, SubmitsByTask
from single_controller.state import CLEAR_BACKOFF_MAX_S, CLEAR_BACKOFF_S, PumpClock, Workers, clear_backoff_s
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


# -- faults ------------------------------------------------------------------------------------
async def test_a_steps_worth_of_requests_starts_in_slices_with_the_loop_running_between_them():
    """Admission opening for a whole step used to start every request in one turn of the event
    loop (~5 ms at 256 groups here), and a chunk that completed meanwhile waited behind all of it.
    The rollout pump dispatches in slices and yields between them: at most DISPATCH_SLICE requests
    start per loop turn (a ticker task counts the turns)."""
    from pumps.rollout import DISPATCH_SLICE
    from single_controller.backends.sim import SimGenerationWorker

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


async def test_trainer_failure_mid_step_aborts_and_retries():
    clean = await run_sim(make_cfg(steps=5, L=0, chunk=2))
    faulty = await run_sim(make_cfg(steps=5, L=0, chunk=2), Faults(train_fail={(2, 0, 0)}))
    ctl, trainer, storage, summary, err = faulty
    assert err is None and summary.steps == 5
    assert trainer.aborts == 1 and ctl.state.counters.step_retries == 1
    assert trained_prompts(trainer) == trained_prompts(clean[1]), "the retried step trained other groups"
    await assert_clean_end(ctl, trainer, storage)


async def test_a_chunk_sent_behind_a_finish_that_fails_is_retried_and_trains_what_it_would_have():
    """With the next step's groups ready, its first chunk goes out right behind the finish
    (`FinishAndBegin`). When that chunk fails, the error surfaces on the step's next call and the
    finish behind it applies nothing: the step is aborted and retried, and every step trains the
    same groups as without the fault, and as with `train.pipeline_steps` off."""
    cfg = make_cfg(steps=6, L=2, chunk=2)
    clean = await run_sim(cfg, train_s=0.005)
    ctl, trainer, storage, summary, err = await run_sim(cfg, Faults(train_fail={(3, 0, 0)}), train_s=0.005)
    assert err is None and summary.steps == 6
    assert 3 in trainer.begun_behind_finish and len(clean[1].begun_behind_finish) >= 3
    assert trainer.attempts[3] == 1 and ctl.state.counters.step_retries == 1 and ctl.state.counters.late_finishes == 0
    assert trainer.optimizer_steps == 6
    assert trained_prompts(trainer) == trained_prompts(clean[1])
    await assert_clean_end(ctl, trainer, storage)
    off = await run_sim(make_cfg(steps=6, L=2, chunk=2, train={"pipeline_steps": False}), train_s=0.005)
    assert off[1].begun_behind_finish == [] and trained_prompts(off[1]) == trained_prompts(clean[1])


async def test_trainer_failing_past_retries_fails_the_run_with_its_cause():
    fails = {(1, 0, a) for a in range(3)}
    ctl, trainer, storage, summary, err = await run_sim(
        make_cfg(steps=4, L=1, train={"max_step_retries": 2}), Faults(train_fail=fails)
    )
    assert isinstance(err, RunFailed) and err.pump == "train"
    assert "train step 1 failed 3 times" in str(err) and "injected trainer failure" in str(err)
    assert trainer.aborts == 3
    await assert_clean_end(ctl, trainer, storage)  # teardown cleared rows and settled every prompt
    fates = Counter(r.reason for r in ctl.state.prompts.records() if r.fate == "dropped")
    assert fates["run_failed"] > 0


async def test_generation_failure_is_retried():
    ctl, trainer, storage, summary, err = await run_sim(
        make_cfg(steps=3, L=0, chunk=4), Faults(gen_fail={("p000003", 0)})
    )
    assert err is None
    rec = ctl.state.prompts["p000003"]
    assert rec.attempts == ["p000003-a0", "p000003-a1"] and rec.fate == "trained" and rec.step == 0
    assert ctl.state.ledger.statistics().dropped_by_reason == {"generation_failed": 1}
    await assert_clean_end(ctl, trainer, storage)


async def test_generation_failure_drops_when_policy_says_drop_and_the_step_is_refilled():
    cfg = make_cfg(steps=3, L=0, chunk=4, rollout={"on_failure": "drop"})
    ctl, trainer, storage, summary, err = await run_sim(cfg, Faults(gen_fail={("p000003", 0)}))
    assert err is None
    rec = ctl.state.prompts["p000003"]
    assert (rec.fate, rec.reason, rec.attempts) == ("dropped", "generation_failed", ["p000003-a0"])
    assert all(len(v) == 4 for v in trained_prompts(trainer).values()), "step 0 was not refilled"
    assert "p000004" in trained_prompts(trainer)[0]  # the refill is the next prompt in order
    await assert_clean_end(ctl, trainer, storage)


async def test_stalled_generation_hits_its_deadline_and_is_retried():
    cfg = make_cfg(steps=2, L=0, chunk=4, timeouts={"generate_s": 0.2})
    ctl, trainer, storage, summary, err = await run_sim(cfg, Faults(gen_stall={("p000001", 0)}))
    assert err is None
    assert ctl.state.prompts["p000001"].attempts == ["p000001-a0", "p000001-a1"]
    assert ctl.state.pumps["rollout"].errors == 1
    await assert_clean_end(ctl, trainer, storage)


async def test_deadline_error_names_what_was_awaited():
    with pytest.raises(
        DeadlineExceeded, match=r"timed out after 0.01s waiting for generation worker g0: generate\(p1-a0\)"
    ):
        await within(asyncio.Event().wait(), 0.01, "generation worker g0: generate(p1-a0)")


async def test_a_failing_pump_stops_the_run_with_its_cause(monkeypatch):
    def broken(rewards, **kw):
        raise OSError("disk on fire")

    monkeypatch.setattr("pumps.advantage.grpo_advantages", broken)
    storage = InMemoryRowStorage()
    gens, trainer = sim_workers(storage)
    ctl = Controller(make_cfg(steps=3), sim_prompts(), storage, Workers(gens, trainer))
    with pytest.raises(RunFailed, match="advantage pump failed: OSError: disk on fire") as info:
        await asyncio.wait_for(ctl.run(), 10)
    assert isinstance(info.value.__cause__, OSError)
    assert ctl.state.prompts.unsettled() == []
    assert await storage.resident_keys() == set()


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


def _bad_rewards(prompt_id, attempt, G):
    """sim_rewards, but p000002's reward function raises and p000005's gives a NaN."""
    if prompt_id == "p000002":
        raise ValueError("cannot parse the answer")
    rewards = sim_rewards(prompt_id, attempt, G)
    return (float("nan"),) + rewards[1:] if prompt_id == "p000005" else rewards


@pytest.mark.parametrize("plain", [False, True])  # the worker's generate task / its batching engine's futures
async def test_a_reward_that_raises_or_is_nan_drops_only_its_group_and_the_run_completes(plain):
    cfg = make_cfg(steps=4, P=4, L=1)
    if plain:  # rows not written: requests join the engine's batches (4 groups each) as plain futures
        storage = InMemoryRowStorage()
        gens, trainer = sim_workers(
            storage,
            num_generators=2,
            gen_group_s=0.001,
            faults=Faults(rewards=_bad_rewards),
            workers_write_rows=False,
            trainer_reads_rows=False,
            gen_max_batch=4,
        )
        ctl = Controller(cfg, sim_prompts(), storage, Workers(gens, trainer))
        summary = await asyncio.wait_for(ctl.run(), 30)
    else:
        ctl, trainer, storage, summary, err = await run_sim(cfg, Faults(rewards=_bad_rewards))
        assert err is None
    assert summary.steps == 4
    for pid in ("p000002", "p000005"):  # dropped at the worker (raised) and at the advantage pump (NaN)
        rec = ctl.state.prompts[pid]
        assert (rec.fate, rec.reason, rec.attempts) == ("dropped", "reward_failed", [f"{pid}-a0"])
    # nothing else failed: no batch-mate dropped or retried, every step full
    assert ctl.state.ledger.statistics().dropped_by_reason.get("generation_failed", 0) == 0
    assert ctl.state.prompts.statistics().retries == 0 and ctl.state.pumps["rollout"].errors == 0
    assert all(len(v) == 4 for v in trained_prompts(trainer).values())
    assert ctl.state.counters.reward_failed == 2 == ctl.statistics().reward_failed
    assert summary.history[-1]["rollout/reward_failed"] == 2
    await assert_clean_end(ctl, trainer, storage)


async def test_a_reward_function_failing_on_everything_stops_the_run_naming_its_error():
    def broken(prompt_id, attempt, G):
        raise KeyError("answer")

    cfg = make_cfg(steps=4, P=4, L=1, rollout={"max_reward_failures_in_a_row": 5})
    ctl, trainer, storage, summary, err = await run_sim(cfg, Faults(rewards=broken), timeout=10)
    assert err is not None and "RewardFunctionFailing" in str(err)
    assert "failed on 5 groups in a row" in str(err) and "KeyError('answer')" in str(err)
    assert ctl.state.counters.reward_failed >= 5  # (settled in the same tick as the fifth, the next ones count too)
    await assert_clean_end(ctl, trainer, storage)


async def test_an_environment_failure_drops_its_group_as_env_failed_and_a_dead_one_stops_the_run():
    from single_controller.protocols import EnvironmentFailed

    def flaky(prompt_id, attempt, G):
        if prompt_id in ("p000002", "p000005"):
            raise EnvironmentFailed(f"group of {prompt_id}: episode 0 failed 2 time(s)")
        return sim_rewards(prompt_id, attempt, G)

    ctl, trainer, storage, summary, err = await run_sim(make_cfg(steps=4, P=4, L=1), Faults(rewards=flaky))
    assert err is None and summary.steps == 4
    for pid in ("p000002", "p000005"):  # dropped, never retried (the worker retried its episodes already)
        rec = ctl.state.prompts[pid]
        assert (rec.fate, rec.reason, rec.attempts) == ("dropped", "env_failed", [f"{pid}-a0"])
    assert ctl.state.counters.env_failed == 2 == ctl.statistics().env_failed
    assert ctl.state.counters.reward_failed == 0
    await assert_clean_end(ctl, trainer, storage)

    def dead(prompt_id, attempt, G):
        raise EnvironmentFailed("connection refused")

    cfg = make_cfg(steps=4, P=4, L=1, env={"max_failures_in_a_row": 5})
    ctl, trainer, storage, summary, err = await run_sim(cfg, Faults(rewards=dead), timeout=10)
    assert err is not None and "EnvironmentFailing" in str(err) and "failed on 5 groups in a row" in str(err)
    await assert_clean_end(ctl, trainer, storage)


async def test_a_group_whose_context_is_full_is_dropped_as_context_full_counted_and_not_retried():
    """`ContextFull` (multi-turn: no room for one policy token) costs its group alone: dropped with
    its own reason, counted in the run's state, statistics and metrics, its prompt not retried, no
    batch-mate touched; as many in a row as `env.max_failures_in_a_row` stop the run."""
    from single_controller.protocols import ContextFull
    from single_controller.runtime.metrics import families

    def full(prompt_id, attempt, G):
        if prompt_id in ("p000002", "p000005"):
            raise ContextFull(f"group of {prompt_id}: no room for one policy token")
        return sim_rewards(prompt_id, attempt, G)

    ctl, trainer, storage, summary, err = await run_sim(make_cfg(steps=4, P=4, L=1), Faults(rewards=full))
    assert err is None and summary.steps == 4
    for pid in ("p000002", "p000005"):
        rec = ctl.state.prompts[pid]
        assert (rec.fate, rec.reason, rec.attempts) == ("dropped", "context_full", [f"{pid}-a0"])
    assert ctl.state.ledger.statistics().dropped_by_reason.get("generation_failed", 0) == 0
    assert ctl.state.prompts.statistics().retries == 0 and ctl.state.pumps["rollout"].errors == 0
    assert all(len(v) == 4 for v in trained_prompts(trainer).values())
    st = ctl.statistics()
    assert ctl.state.counters.context_full == 2 == st.context_full
    assert st.env_failed == 0 and st.reward_failed == 0
    exported = {m.name: m for m in families(st)}
    assert exported["sc_grpo_context_full_groups"].samples[0].value == 2
    dropped = exported["sc_grpo_groups_dropped"].samples
    assert {x.labels["reason"]: x.value for x in dropped}["context_full"] == 2
    await assert_clean_end(ctl, trainer, storage)

    def always_full(prompt_id, attempt, G):
        raise ContextFull("no room for one policy token")

    cfg = make_cfg(steps=4, P=4, L=1, env={"max_failures_in_a_row": 5})
    ctl, trainer, storage, summary, err = await run_sim(cfg, Faults(rewards=always_full), timeout=10)
    assert err is not None and "EnvironmentFailing" in str(err)
    assert "first observation filled the context on 5 groups in a row" in str(err)
    await assert_clean_end(ctl, trainer, storage)


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


# -- issue 9: defects of durable runs (each test failed before its fix) ------------------------
async def test_finish_outliving_its_deadline_is_applied_once(monkeypatch):
    # The trainer's finish takes 0.2 s, its deadline is 0.1 s: the call keeps running remotely after
    # the controller stops waiting. The controller must ask where the trainer stands and take the
    # recorded result, not abort (a no-op on a finished step) and replay (a second optimizer step).
    monkeypatch.setattr(SimTrainerGroup, "__init__", _with_finish_s(SimTrainerGroup.__init__, 0.2))
    cfg = make_cfg(steps=3, P=2, G=2, L=1, timeouts={"train_call_s": 0.1})
    ctl, trainer, storage, summary, err = await run_sim(cfg)
    assert err is None, err
    assert summary.steps == 3
    assert trainer.optimizer_steps == 3 == trainer.version
    assert ctl.state.counters.late_finishes == 3 and ctl.state.counters.aborted_steps == 0
    await assert_clean_end(ctl, trainer, storage)


def _with_finish_s(init, finish_s):
    def patched(self, *a, **k):
        init(self, *a, **k)
        self.finish_s = finish_s

    return patched


async def test_storage_deadline_while_evicting_is_retried_not_a_trainer_failure():
    # L=1 with staleness bound 0: groups made for step s+1 on version s are stale when trained, so
    # every step evicts. The first clear of evicted rows hangs past the storage deadline.
    cfg = make_cfg(steps=4, P=2, G=2, L=1, S=0, timeouts={"storage_s": 0.1})
    hung = []

    def hang_first_evicted_clear(ctl, keys):
        groups = {k.rsplit("_g", 1)[0] for k in keys}
        evicting = any(ctl.state.ledger[g].state is GroupState.EVICTED for g in groups)
        if evicting and not hung:
            hung.append(keys)
            return True
        return False

    ctl, trainer, storage, summary, err = await run_sim(cfg, hang_clear=hang_first_evicted_clear, gen_s=0.01)
    assert err is None, err
    assert hung, "the scenario never evicted"
    assert ctl.state.counters.aborted_steps == 0 and ctl.state.counters.step_retries == 0
    assert ctl.state.counters.storage_retries >= 1
    assert summary.steps == 4
    await assert_clean_end(ctl, trainer, storage)  # no slot leaked, no key left


class FailingClearStorage(InMemoryRowStorage):
    """In-memory storage whose first `clear_rows` raises `error`."""

    def __init__(self, error: Exception):
        super().__init__()
        self.error, self.clears = error, 0

    async def clear_rows(self, keys):
        self.clears += 1
        if self.clears == 1:
            raise self.error
        await super().clear_rows(keys)


async def _run_with_failing_clear(error: Exception):
    storage = FailingClearStorage(error)
    gens, trainer = sim_workers(storage, num_generators=2, gen_group_s=0.001)
    ctl = Controller(make_cfg(steps=4, P=2), sim_prompts(), storage, Workers(gens, trainer))
    try:
        return ctl, trainer, storage, await asyncio.wait_for(ctl.run(), 30), None
    except RunFailed as e:
        return ctl, trainer, storage, None, e


async def test_a_storage_error_in_a_clear_is_retried_after_a_pause():
    ctl, trainer, storage, summary, err = await _run_with_failing_clear(StorageError("the store is restarting"))
    assert err is None, err
    assert summary.steps == 4 and ctl.state.counters.storage_retries == 1
    await assert_clean_end(ctl, trainer, storage)


async def test_a_bug_in_a_storage_clear_stops_the_run_at_once_instead_of_being_retried():
    ctl, trainer, storage, summary, err = await _run_with_failing_clear(
        TypeError("clear_rows() got an unexpected keyword")
    )
    assert err is not None and isinstance(err.__cause__, TypeError), err
    assert ctl.state.counters.storage_retries == 0


@pytest.mark.parametrize("attempt", [1, 2, 3, 10])
def test_the_pause_before_a_clear_is_retried_is_jittered_exponential_and_bounded(attempt):
    bound = min(CLEAR_BACKOFF_MAX_S, CLEAR_BACKOFF_S * 2 ** (attempt - 1))
    pauses = [clear_backoff_s(attempt) for _ in range(200)]
    assert all(0.0 <= p <= bound for p in pauses) and len(set(pauses)) > 1


async def test_drop_zero_variance_on_a_solved_task_is_capped_not_a_livelock():
    # Every group scores 1.0 for every sample: all zero-variance. Without a cap the step would be
    # refilled forever and no step would ever finish.
    faults = Faults(rewards=lambda prompt_id, attempt, G: (1.0,) * G)
    cfg = make_cfg(
        steps=3, P=2, G=2, L=1, advantage={"drop_zero_variance": True, "max_zero_variance_drops_per_step": 3}
    )
    ctl, trainer, storage, summary, err = await run_sim(cfg, faults, timeout=10)
    assert err is None, err
    assert summary.steps == 3
    assert all(len(keys) == 2 * 2 for keys in trainer.trained.values())
    assert sum(ctl.state.counters.zero_variance_drops.values()) == 3 * 3  # the cap, for each step
    assert ctl.state.counters.zero_variance_kept >= 3 * 2
    await assert_clean_end(ctl, trainer, storage)


# -- issue 9: checkpoint and resume on the simulated backend ------------------------------------
async def _run_with_dir(cfg, run_dir, *, resume=None, skip=0, history=False):
    import itertools

    storage = InMemoryRowStorage()
    gens, trainer = sim_workers(storage, num_generators=2, gen_group_s=0.002)
    prompts = itertools.islice(sim_prompts(), skip, None)
    run_dir.mkdir(parents=True, exist_ok=True)
    hist = str(run_dir / "prompt_history.jsonl") if history else None
    ctl = Controller(
        cfg, prompts, storage, Workers(gens, trainer), run_dir=str(run_dir), resume=resume, prompt_history=hist
    )

    async def go():
        if resume is not None:
            await trainer.load_state(str(latest_checkpoint(run_dir) / "trainer"))
        return await asyncio.wait_for(ctl.run(), 30)

    return ctl, trainer, storage, await go()


def _per_step(ctl) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for r in ctl.state.prompts.to_dict()["prompts"]:  # the whole ledger, with or without a history file
        if r["fate"] == "trained":
            out.setdefault(r["step"], []).append(r["prompt_id"])
    return {k: sorted(v) for k, v in sorted(out.items())}


DETERMINISTIC_KEYS = ("rollout/reward_mean", "rollout/success_rate", "rollout/groups", "train/rows", "train/loss")


@pytest.mark.parametrize("history", [False, True], ids=["ledger_in_memory", "prompt_history_file"])
async def test_resumed_sim_run_trains_exactly_what_an_uninterrupted_run_trains(tmp_path, history):
    full_cfg = make_cfg(steps=9, P=3, G=2, L=1, checkpoint={"every_steps": 0, "at_exit": False})
    ctl_a, trainer_a, storage_a, _ = await _run_with_dir(full_cfg, tmp_path / "a")
    # The same run "crashes" after step 5 with its last checkpoint at step 4, then resumes.
    first = make_cfg(steps=5, P=3, G=2, L=1, checkpoint={"every_steps": 4, "at_exit": False})
    ctl_b1, _, storage_b1, s1 = await _run_with_dir(first, tmp_path / "b", history=history)
    assert s1.checkpoint.step == 4
    saved = read_controller_state(latest_checkpoint(tmp_path / "b"))
    assert saved["step"] == 4 and saved["rolled_back"], "groups in flight at the cut are rolled back"
    check_compatible(saved, full_cfg, tmp_path / "b")  # max_steps may change on resume
    ctl_b2, trainer_b2, storage_b2, s2 = await _run_with_dir(
        full_cfg, tmp_path / "b", resume=saved, skip=saved["dataloader"]["taken"], history=history
    )
    assert s2.steps == 9 and trainer_b2.optimizer_steps == 9
    # exactly once over the whole run: the resumed ledger holds steps 0..8, each prompt trained once
    assert _per_step(ctl_b2) == _per_step(ctl_a)
    assert [r["step"] for r in ctl_b2.history] == list(range(4, 9))
    for ra, rb in zip(list(ctl_a.history)[4:], ctl_b2.history):
        assert {k: ra[k] for k in DETERMINISTIC_KEYS} == {k: rb[k] for k in DETERMINISTIC_KEYS}, ra["step"]
    assert sorted(trainer_b2.trained) == list(range(4, 9))  # the resumed trainer trained only 4..8
    assert await storage_b2.resident_keys() == set() and ctl_b2.state.ledger.resident() == 0
    assert ctl_b2.state.prompts.unsettled() == []


class ClientOfACrashedRun:
    """One run's client of a row storage that outlives the run (`storage.attach`): once the run has
    crashed (`crashed = True`), nothing it sends reaches the storage any more."""

    def __init__(self, store: InMemoryRowStorage):
        self.store, self.schema, self.crashed = store, store.schema, False
        self.stored: set[str] = set()  # keys this run put and has not cleared

    def _reach(self) -> InMemoryRowStorage:
        if self.crashed:
            raise RuntimeError("the run of this storage client crashed")
        return self.store

    async def put_rows(self, keys, columns, tags=None):
        await self._reach().put_rows(keys, columns, tags)
        self.stored.update(keys)

    async def get_rows(self, keys, fields):
        return await self._reach().get_rows(keys, fields)

    async def clear_rows(self, keys):
        await self._reach().clear_rows(keys)
        self.stored.difference_update(keys)

    async def resident_keys(self):
        return await self._reach().resident_keys()

    def statistics(self):
        return self.store.statistics()


class Crash(Exception):
    pass


async def test_a_resume_into_a_storage_that_outlived_the_crash_clears_the_rows_of_attempts_after_the_cut(tmp_path):
    """`storage.attach`: the crashed run's rows stay in the storage. Those of attempts made after its
    last checkpoint (prompts taken after the cut, for steps the resume never reaches) are named
    nowhere in the checkpoint; the resume clears them too, and its run ends with no key left."""
    import itertools

    store = InMemoryRowStorage()  # the attached storage: it outlives the crashed run
    client = ClientOfACrashedRun(store)
    first = make_cfg(steps=16, P=3, G=2, L=1, checkpoint={"every_steps": 2, "at_exit": False})
    gens, trainer = sim_workers(client, num_generators=2, gen_group_s=0.001, train_group_s=0.01)

    def crash_once_rows_past_the_checkpoint_are_stored(record: dict) -> None:
        # After an odd step, the checkpoint of the step before is the last one the run takes (the
        # next is taken after this record) once it is committed (periodic ones commit in the background).
        pointer = tmp_path / "checkpoints" / "latest"
        if record["step"] % 2 == 0 or not pointer.exists():
            return
        if pointer.read_text().strip() != f"step_{record['step'] - 1:06d}":
            return
        saved = read_controller_state(latest_checkpoint(tmp_path))
        rolled_back = {k for g in saved["rolled_back"] for k in row_keys(g, 2)}
        if client.stored - rolled_back:
            client.crashed = True  # the process is gone: its teardown clears nothing
            raise Crash(f"crashed after step {record['step']}")

    ctl = Controller(
        first,
        sim_prompts(),
        client,
        Workers(gens, trainer),
        run_dir=str(tmp_path),
        on_step=crash_once_rows_past_the_checkpoint_are_stored,
    )
    with pytest.raises(RunFailed):  # whichever pump met the crash first
        await asyncio.wait_for(ctl.run(), 30)
    assert client.crashed
    saved = read_controller_state(latest_checkpoint(tmp_path))
    rolled_back = {k for g in saved["rolled_back"] for k in row_keys(g, 2)}
    after_cut = (await store.resident_keys()) - rolled_back
    assert after_cut, "the crash leaves rows of attempts made after the checkpoint's cut"
    # The resume (with the same storage) trains one step: the crashed run's later attempts are not made again.
    resumed = make_cfg(steps=saved["step"] + 1, P=3, G=2, L=1, checkpoint={"every_steps": 2, "at_exit": False})
    gens2, trainer2 = sim_workers(store, num_generators=2, gen_group_s=0.002)
    await trainer2.load_state(str(latest_checkpoint(tmp_path) / "trainer"))
    prompts = itertools.islice(sim_prompts(), saved["dataloader"]["taken"], None)
    ctl2 = Controller(resumed, prompts, store, Workers(gens2, trainer2), run_dir=str(tmp_path), resume=saved)
    summary = await asyncio.wait_for(ctl2.run(), 30)
    assert summary.steps == saved["step"] + 1 and sorted(trainer2.trained) == [saved["step"]]
    assert await store.resident_keys() == set(), "rows of the crashed run are left in the storage"
    assert ctl2.state.ledger.resident() == 0 and ctl2.state.prompts.unsettled() == []


async def test_checkpoint_from_a_different_config_is_refused_naming_the_keys(tmp_path):
    cfg = make_cfg(steps=2, P=2, G=2, L=1, checkpoint={"every_steps": 1})
    await _run_with_dir(cfg, tmp_path)
    saved = read_controller_state(latest_checkpoint(tmp_path))
    other = make_cfg(steps=5, P=3, G=2, L=1, train={"lr": 0.5})
    with pytest.raises(CheckpointError, match=r"train.groups_per_step: checkpoint 2, now 3.*train.lr"):
        check_compatible(saved, other, tmp_path)
    # a key added to the config after the checkpoint was taken counts as its default then
    del saved["config"]["train.lr"]
    check_compatible(saved, make_cfg(steps=5, P=2, G=2, L=1), tmp_path)
    with pytest.raises(CheckpointError, match=r"train.lr: checkpoint 0.001, now 0.5"):
        check_compatible(saved, make_cfg(steps=5, P=2, G=2, L=1, train={"lr": 0.5}), tmp_path)


async def test_a_crash_mid_write_leaves_the_previous_checkpoint_valid(tmp_path, monkeypatch):
    cfg = make_cfg(steps=4, P=2, G=2, L=1, checkpoint={"every_steps": 2, "at_exit": False})
    await _run_with_dir(cfg, tmp_path)
    good = latest_checkpoint(tmp_path)
    assert good.name == "step_000004"
    # a half-written next checkpoint (the process died before the rename) changes nothing
    (tmp_path / "checkpoints" / "step_000006.tmp" / "trainer").mkdir(parents=True)
    assert latest_checkpoint(tmp_path) == good
    assert read_controller_state(good)["step"] == 4


def _sim_controller(cfg, run_dir):
    storage = InMemoryRowStorage()
    gens, trainer = sim_workers(storage, num_generators=2, gen_group_s=0.002)
    return Controller(cfg, sim_prompts(), storage, Workers(gens, trainer), run_dir=str(run_dir)), trainer


async def test_a_checkpoint_slower_than_a_train_call_has_its_own_deadline(tmp_path):
    """Writing a real model's state takes minutes: a checkpoint is held to `timeouts.checkpoint_s`
    (plus its size), not to the split-API calls' `train_call_s`."""
    cfg = make_cfg(
        steps=4, P=2, G=2, L=1, checkpoint={"every_steps": 2}, timeouts={"train_call_s": 0.2, "checkpoint_s": 5}
    )
    ctl, trainer = _sim_controller(cfg, tmp_path)
    real_save = trainer.save_state

    async def slow_save(directory):
        await asyncio.sleep(0.5)  # longer than a train call may take
        await real_save(directory)

    trainer.save_state = slow_save
    summary = await asyncio.wait_for(ctl.run(), 30)
    assert summary.steps == 4 and summary.checkpoint is not None and summary.checkpoint.step == 4
    assert latest_checkpoint(tmp_path).name == "step_000004"


def _slow_saves(trainer, seconds: float) -> None:
    real_save = trainer.save_state

    async def slow_save(directory):
        await asyncio.sleep(seconds)
        await real_save(directory)

    trainer.save_state = slow_save


async def test_the_first_checkpoint_of_a_run_has_the_deadline_of_its_weights_size(tmp_path):
    """#48 S5: before a run has written a checkpoint, its deadline counts the size guessed from the
    published weights (8 x 1 GiB here: 0.2 + 8 x 0.5 s), not `checkpoint_s` alone (0.2 s, shorter
    than this write, as a real model's first checkpoint would have been)."""
    from single_controller.types import WeightsHandle

    cfg = make_cfg(
        steps=2,
        P=2,
        G=2,
        L=1,
        checkpoint={"every_steps": 2},
        timeouts={"checkpoint_s": 0.2, "checkpoint_s_per_gib": 0.5},
    )
    ctl, trainer = _sim_controller(cfg, tmp_path)
    real_export = trainer.export_weights

    async def export_1_gib(version):
        handle = await real_export(version)
        return WeightsHandle(handle.version, handle.payload, 2**30)

    trainer.export_weights = export_1_gib
    _slow_saves(trainer, 0.5)
    assert ctl._checkpoint_deadline() == 0.2  # no weights published yet
    summary = await asyncio.wait_for(ctl.run(), 30)
    assert summary.steps == 2 and summary.checkpoint is not None and summary.checkpoint.step == 2
    assert ctl.state.counters.checkpoints_written == 1  # (a second would be held to its real size)


async def test_the_first_checkpoint_after_a_resume_has_the_deadline_of_the_one_it_loaded(tmp_path):
    """#48 S5: a resumed run's first checkpoint is held to `checkpoint_s` plus the size of the
    checkpoint it loaded (here about 1 KB at 2^20 s per GiB: ~1 s; before, 0.2 s, as for none)."""
    first = make_cfg(steps=2, P=2, G=2, L=1, checkpoint={"every_steps": 2, "at_exit": False})
    await _run_with_dir(first, tmp_path)
    path = latest_checkpoint(tmp_path)
    loaded = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    saved = read_controller_state(path)
    cfg = make_cfg(
        steps=4,
        P=2,
        G=2,
        L=1,
        checkpoint={"every_steps": 2, "at_exit": False},
        timeouts={"checkpoint_s": 0.2, "checkpoint_s_per_gib": 2.0**20},
    )
    storage = InMemoryRowStorage()
    gens, trainer = sim_workers(storage, num_generators=2, gen_group_s=0.002)
    await trainer.load_state(str(path / "trainer"))
    prompts = itertools.islice(sim_prompts(), saved["dataloader"]["taken"], None)
    ctl = Controller(cfg, prompts, storage, Workers(gens, trainer), run_dir=str(tmp_path), resume=saved)
    assert 0.5 < 0.2 + loaded / 2**10 < 60  # the deadline this test relies on: longer than the write below
    _slow_saves(trainer, 0.5)
    summary = await asyncio.wait_for(ctl.run(), 30)
    assert summary.steps == 4 and summary.checkpoint is not None and summary.checkpoint.step == 4
    assert ctl._checkpoint_deadline() == 0.2 + ctl.last_checkpoint.num_bytes / 2**10  # then the one written


async def test_a_periodic_checkpoint_commits_in_the_background_while_training_goes_on(tmp_path, monkeypatch):
    """The fsyncs, rename and `latest` of a periodic checkpoint do not hold up training: steps go on
    while step 2's checkpoint is still being committed, and `latest` names it only once it is."""
    import threading
    import time

    from single_controller import checkpoint as ckpt

    cfg = make_cfg(steps=6, P=2, G=2, L=1, checkpoint={"every_steps": 2, "at_exit": False})
    ctl, trainer = _sim_controller(cfg, tmp_path)
    real, seen = ckpt._fsync_tree, {}

    def slow_fsync(path):
        if path.name == "step_000002.tmp":  # committing step 2's checkpoint: wait for 2 more steps
            deadline = time.monotonic() + 10
            while len(trainer.trained) < 4 and time.monotonic() < deadline:
                time.sleep(0.005)
            seen.update(
                trained=len(trainer.trained),
                latest=(tmp_path / "checkpoints" / "latest").exists(),
                thread=threading.current_thread() is not threading.main_thread(),
            )
        real(path)

    monkeypatch.setattr(ckpt, "_fsync_tree", slow_fsync)
    summary = await asyncio.wait_for(ctl.run(), 30)
    assert seen == {"trained": 4, "latest": False, "thread": True}
    assert summary.checkpoint.step == 6 and latest_checkpoint(tmp_path).name == "step_000006"
    assert ctl.state.counters.checkpoints_written == 3
    assert read_controller_state(latest_checkpoint(tmp_path))["step"] == 6


async def test_a_checkpoint_that_fails_to_commit_stops_the_run_with_its_cause(tmp_path, monkeypatch):
    from single_controller import checkpoint as ckpt

    cfg = make_cfg(steps=8, P=2, G=2, L=1, checkpoint={"every_steps": 2, "at_exit": False})
    ctl, trainer = _sim_controller(cfg, tmp_path)
    real = ckpt._fsync_tree

    def full_disk(path):
        if path.name == "step_000004.tmp":
            raise OSError(28, "No space left on device")
        real(path)

    monkeypatch.setattr(ckpt, "_fsync_tree", full_disk)
    with pytest.raises(RunFailed, match=r"train pump failed: OSError: .*No space left on device") as failed:
        await asyncio.wait_for(ctl.run(), 30)
    assert failed.value.checkpoint.step == 2  # the newest one that is durable
    assert latest_checkpoint(tmp_path).name == "step_000002"
    assert trainer.optimizer_steps <= 6  # stopped at the next checkpoint, not at the end


# -- issue 9: generation worker death -----------------------------------------------------------
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


# -- a cancelled request writes nothing more before its rows are cleared -------------------------
class Withdrawing(SubmitsByTask):
    """A sim worker whose cancelled `generate` takes a while to be sure it writes nothing more, then
    records ("withdrawn", group id) in `events`. Requests `hold(request)` picks are never answered;
    `self_cancel` ones are cancelled by the worker itself (a contract breach)."""

    def __init__(self, inner, events, hold=lambda r: False, self_cancel=lambda r: False, withdraw_s=0.01):
        self.inner, self.name = inner, inner.name
        self.events, self.withdraw_s = events, withdraw_s
        self.hold, self.self_cancel = hold, self_cancel
        self.held: list[str] = []

    async def generate(self, request):
        if self.self_cancel(request):
            raise asyncio.CancelledError()
        try:
            if self.hold(request):
                self.held.append(request.group_id)
                await asyncio.Event().wait()
            return await self.inner.generate(request)
        except asyncio.CancelledError:
            await asyncio.sleep(self.withdraw_s)
            self.events.append(("withdrawn", request.group_id))
            raise

    async def update_weights(self, weights):
        await self.inner.update_weights(weights)

    async def in_flight(self):
        return await self.inner.in_flight()


class RecordingClears(InMemoryRowStorage):
    def __init__(self, events):
        super().__init__()
        self.events = events

    async def clear_rows(self, keys):
        self.events.extend(("cleared", gid) for gid in sorted({k.rsplit("_g", 1)[0] for k in keys}))
        await super().clear_rows(keys)


def _withdrawing(cfg, events, train_group_s=0.001, **kw):
    storage = RecordingClears(events)
    inner, trainer = sim_workers(storage, num_generators=2, gen_group_s=0.002, train_group_s=train_group_s)
    gens = [Withdrawing(g, events, **kw) for g in inner]
    return Controller(cfg, sim_prompts(), storage, Workers(gens, trainer)), gens, trainer, storage


def _withdrawn_before_cleared(events, gid):
    return events.index(("withdrawn", gid)) < events.index(("cleared", gid))


async def test_a_request_past_its_deadline_is_withdrawn_before_its_rows_are_cleared_and_retried():
    events: list = []
    cfg = make_cfg(steps=4, P=2, L=1, timeouts={"generate_s": 0.2})
    ctl, gens, trainer, storage = _withdrawing(cfg, events, hold=lambda r: r.group_id == "p000002-a0")
    summary = await asyncio.wait_for(ctl.run(), 30)
    assert summary.steps == 4
    assert [g for w in gens for g in w.held] == ["p000002-a0"]
    assert _withdrawn_before_cleared(events, "p000002-a0")
    # the request failed alone: its worker answered the liveness call, so it stays (never killed as hung)
    assert ctl.state.counters.worker_deaths == 0 and ctl.state.health.given_up == set()
    assert ctl.state.ledger["p000002-a0"].reason == "generation_timeout"
    assert ctl.state.prompts["p000002"].attempts[:2] == ["p000002-a0", "p000002-a1"]
    assert ctl.state.prompts["p000002"].uncharged == 0  # charged to the prompt's retries
    await assert_clean_end(ctl, trainer, storage)


@pytest.mark.parametrize("order", ["in_order", "fifo"])
async def test_a_sync_that_aborts_while_a_late_request_is_being_withdrawn_does_not_hang_the_run(order):
    """A request past its deadline is being withdrawn (slowly) when a weight sync with
    drain_policy=abort aborts what is in flight: the group is still discarded once withdrawn, so
    the train pump is not left waiting for it."""
    events: list = []
    cfg = make_cfg(
        steps=8, P=2, L=1, chunk=1, order=order, timeouts={"generate_s": 0.2}, sync={"drain_policy": "abort"}
    )
    # a step trains for 0.3 s: the held request's deadline (0.2 s) passes before the step's sync,
    # which comes while the withdrawal (0.5 s) is still under way
    hold = lambda r: r.group_id == "p000002-a0"  # noqa: E731
    ctl, gens, trainer, storage = _withdrawing(cfg, events, train_group_s=0.15, hold=hold, withdraw_s=0.5)
    summary = await asyncio.wait_for(ctl.run(), 20)
    assert summary.steps == 8
    assert _withdrawn_before_cleared(events, "p000002-a0")
    assert ctl.state.ledger["p000002-a0"].reason == "sync_abort"  # aborted while it was being withdrawn
    await assert_clean_end(ctl, trainer, storage)


async def test_an_aborted_request_is_withdrawn_before_its_rows_are_cleared():
    """The stale in-flight rule cancels a request: discarded as aborted (not an error),
    after the worker's withdrawal."""
    events: list = []
    cfg = make_cfg(steps=6, P=2, L=1, S=1, chunk=1, order="fifo", sampler={"abort_stale_in_flight": True})
    ctl, gens, trainer, storage = _withdrawing(cfg, events, hold=lambda r: r.group_id == "p000000-a0")
    summary = await asyncio.wait_for(ctl.run(), 30)
    assert summary.steps == 6
    assert _withdrawn_before_cleared(events, "p000000-a0")
    assert ctl.state.sampler.statistics().aborted_in_flight_total >= 1 and ctl.state.pumps["rollout"].errors == 0
    assert ctl.state.prompts["p000000"].attempts[0] == "p000000-a0" and len(ctl.state.prompts["p000000"].attempts) >= 2
    await assert_clean_end(ctl, trainer, storage)


async def test_requests_still_in_flight_when_the_run_fails_are_withdrawn():
    events: list = []
    cfg = make_cfg(steps=6, P=2, L=1, train={"max_step_retries": 0})
    ctl, gens, trainer, storage = _withdrawing(cfg, events, hold=lambda r: r.group_id in ("p000004-a0", "p000005-a0"))
    trainer.faults.train_fail.add((1, 0, 0))
    with pytest.raises(RunFailed, match="injected trainer failure"):
        await asyncio.wait_for(ctl.run(), 30)
    held = [g for w in gens for g in w.held]
    assert held and all(("withdrawn", g) in events for g in held)
    assert ctl.state.teardown_errors == []


async def test_a_worker_that_cancels_a_request_itself_stops_the_run_naming_it():
    events: list = []
    ctl, gens, trainer, storage = _withdrawing(
        make_cfg(steps=4, P=2), events, self_cancel=lambda r: r.group_id == "p000001-a0"
    )
    with pytest.raises(RunFailed, match=r"cancelled the request of p000001-a0 itself"):
        await asyncio.wait_for(ctl.run(), 30)


async def test_two_errors_that_fail_the_run_together_are_each_named_not_counted_as_a_group():
    """Two settle tasks of the rollout pump raise in the same tick: the run's error is an exception
    group of two; RunFailed says each error (type: message), not "(2 sub-exceptions)"."""
    events: list = []
    ctl, gens, trainer, storage = _withdrawing(
        make_cfg(steps=4, P=2), events, self_cancel=lambda r: r.group_id in ("p000000-a0", "p000001-a0")
    )
    with pytest.raises(RunFailed) as info:
        await asyncio.wait_for(ctl.run(), 30)
    text = str(info.value)
    assert isinstance(info.value.__cause__, BaseExceptionGroup)  # the two errors did fail together
    assert "sub-exception" not in text
    assert text.startswith("rollout pump failed: 2 errors together: RuntimeError: generation worker sim-gen-")
    for gid in ("p000000-a0", "p000001-a0"):
        assert f"cancelled the request of {gid} itself" in text
