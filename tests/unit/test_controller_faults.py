"""Layer (b): the controller on the simulated backend when something fails: trainer and generation
failures, deadlines, failing pumps, rewards and environments that fail, full contexts, storage clears that fail or
hang (issue 9)."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from replay.ledger import GroupState
from replay.storage import InMemoryRowStorage, StorageError
from single_controller.backends.sim import (
    Faults,
    SimTrainerGroup,
    sim_prompts,
    sim_rewards,
    sim_workers,
)
from single_controller.controller import Controller, RunFailed
from single_controller.deadlines import DeadlineExceeded, within
from single_controller.state import CLEAR_BACKOFF_MAX_S, CLEAR_BACKOFF_S, Workers, clear_backoff_s
from tests.helpers.sim import assert_clean_end, make_cfg, run_sim, trained_prompts


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
