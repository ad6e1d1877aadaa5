"""Evaluation during asynchronous training (issue 14): the eval pump on the simulated backend: points at the start,
every k versions and the end, each served by one version; weight updates, worker failures and deaths, deadlines and
the run's end during eval; no hang under arbitrary eval faults."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pumps.eval import eval_metrics
from replay.storage import InMemoryRowStorage, row_keys
from single_controller.backends.sim import Faults, sim_eval_rewards, sim_prompts, sim_workers
from single_controller.controller import Controller, RunFailed
from single_controller.state import Workers
from single_controller.types import GenerationResult
from tests.helpers.sim import EVAL_PROMPTS, assert_clean_end, eval_cfg, make_cfg, run_eval_sim


def expected_point(version: int, prompts=EVAL_PROMPTS, success=1.0) -> dict:
    """What a point for `version` must report: every reward computed from that version alone."""
    res = [
        GenerationResult(p.prompt_id, sim_eval_rewards(p.prompt_id, version, 1), (3,), 5, version, version)
        for p in prompts
    ]
    return eval_metrics(res, success)


def assert_points_served_by_their_version(ctl):
    assert ctl.eval_history, "no eval point was reported"
    for rec in ctl.eval_history:
        v = rec["eval/policy_version"]
        assert {k: rec[k] for k in expected_point(v)} == expected_point(v), f"point v{v} mixes versions"


async def assert_eval_left_nothing(ctl, gens, trainer, storage):
    """Eval wrote no row, entered neither ledger, and no eval request is still in a worker."""
    await assert_clean_end(ctl, trainer, storage)
    rollout_keys = {k for g in gens for gid in g.generated for k in row_keys(gid, ctl.cfg.rollout.group_size)}
    assert storage.put_keys and storage.put_keys <= rollout_keys, "an eval request wrote rows"
    assert not any(r.group_id.startswith("eval") for r in ctl.state.ledger.all_records())
    assert not any(r.prompt.prompt_id.startswith("h") for r in ctl.state.prompts.records())
    assert [await g.in_flight() for g in gens] == [0] * len(gens)
    assert ctl.eval_tracker.statistics().in_progress is False
    assert ctl.state.pumps["eval"].finished


async def test_eval_points_at_start_every_k_versions_and_end_each_served_by_one_version():
    ctl, gens, trainer, storage, summary, err = await run_eval_sim(eval_cfg(steps=12, every=4))
    assert err is None and summary.steps == 12
    versions = [r["eval/policy_version"] for r in ctl.eval_history]
    assert versions[0] == 0 and versions[-1] == 12, versions  # the start and the end of the run
    assert versions == sorted(set(versions))
    # a point is due every 4 versions: none is skipped (a round that sees a weight update lands on
    # a later version, but before the next one is due), and none comes before it is due
    for due in range(4, 12, 4):
        assert any(due <= v < due + 4 for v in versions), (due, versions)
    assert all(b >= (a // 4 + 1) * 4 or b == 12 for a, b in zip(versions, versions[1:])), versions
    assert_points_served_by_their_version(ctl)
    served = Counter(v for g in gens for _, v in g.evaluated)
    assert sum(served.values()) == ctl.eval_tracker.statistics().requests
    await assert_eval_left_nothing(ctl, gens, trainer, storage)


async def test_weight_update_during_eval_reissues_and_reports_one_version():
    # h00003's first attempt of every round is held until training has moved two versions past
    # the round's start, so each round sees a newer version and must re-issue the rest.
    slow = EVAL_PROMPTS[3].prompt_id
    cfg = eval_cfg(steps=30, every=10)
    ctl, gens, trainer, storage, summary, err = await run_eval_sim(
        cfg, held=(slow, lambda st: st.versions.served % 10 >= 2 or st.stop.train_done)
    )
    assert err is None and summary.steps == 30
    first = ctl.eval_history[0]
    assert first["eval/policy_version"] > 0 and first["eval/reissued"] >= len(EVAL_PROMPTS) - 1
    round0 = {v for g in gens for gid, v in g.evaluated if gid.startswith("eval0-")}
    assert len(round0) >= 2, "the first round was meant to straddle a weight update"
    assert ctl.eval_tracker.statistics().reissued > 0
    assert_points_served_by_their_version(ctl)
    await assert_eval_left_nothing(ctl, gens, trainer, storage)


async def test_without_reissue_a_point_mixes_versions(monkeypatch):
    # The pre-fix behaviour (every result counts, whatever version served it) in the same run
    # reports a point whose results came from two versions: the check above can fail.
    import pumps.eval as ev

    async def lax_round(state, prompts, sampling, tracker, index):
        t0, target = state.clock(), state.versions.served
        reqs = [ev.GenerationRequest(f"eval{index}-{p.prompt_id}-a0", p, sampling, eval=True) for p in prompts]
        results = await asyncio.gather(*(ev._request(state, r, i) for i, r in enumerate(reqs)))
        return ev.EvalPoint(target, ev.eval_metrics(results, 1.0), state.clock() - t0, 0, 0, state.clock())

    monkeypatch.setattr(ev, "_round", lax_round)
    slow = EVAL_PROMPTS[3].prompt_id
    ctl, *_ = await run_eval_sim(
        eval_cfg(steps=30, every=10), held=(slow, lambda st: st.versions.served % 10 >= 2 or st.stop.train_done)
    )
    with pytest.raises(AssertionError, match="mixes versions"):
        assert_points_served_by_their_version(ctl)


async def test_generation_failure_during_eval_is_reissued():
    bad = EVAL_PROMPTS[2].prompt_id  # fails on its first attempt in every round
    ctl, gens, trainer, storage, summary, err = await run_eval_sim(eval_cfg(), Faults(gen_fail={(bad, 0)}))
    assert err is None and summary.steps == 12
    st = ctl.eval_tracker.statistics()
    assert st.failed == 0 and st.request_failures == st.rounds == len(ctl.eval_history) >= 3
    assert all(r["eval/failures"] == 1 for r in ctl.eval_history)
    assert_points_served_by_their_version(ctl)
    await assert_eval_left_nothing(ctl, gens, trainer, storage)


async def test_generation_worker_death_during_eval_reissues_uncharged():
    # sim-gen-0 dies when its first rollout group is done, while its share of the first round's
    # eval requests waits behind it: they fail with GenerationWorkerDied and are re-issued to
    # sim-gen-1 (eval.max_retries = 0: a charged failure would abandon the round).
    cfg = eval_cfg(steps=8, every=4, eval={"max_retries": 0}, rollout={"max_worker_restarts": 2})
    ctl, gens, trainer, storage, summary, err = await run_eval_sim(cfg, Faults(die_after={"sim-gen-0": 1}), gen_s=0.01)
    assert err is None and summary.steps == 8
    st = ctl.eval_tracker.statistics()
    assert ctl.state.counters.worker_deaths == 1 and gens[0].restarts == 1
    assert st.failed == 0 and st.request_failures == 0
    first_round = [gid for g in gens for gid, _ in g.evaluated if gid.startswith("eval0-")]
    assert any(gid.startswith("eval0-") and not gid.endswith("-a0") for gid in first_round), "nothing was re-issued"
    assert [r["eval/policy_version"] for r in ctl.eval_history][-1] == 8
    assert_points_served_by_their_version(ctl)
    await assert_eval_left_nothing(ctl, gens, trainer, storage)


async def test_eval_request_failing_past_retries_abandons_the_round_not_the_run():
    bad = EVAL_PROMPTS[2].prompt_id
    faults = Faults(gen_fail={(bad, a) for a in range(3)})  # eval.max_retries = 2: the 3rd failure gives up
    ctl, gens, trainer, storage, summary, err = await run_eval_sim(eval_cfg(eval={"max_retries": 2}), faults)
    assert err is None and summary.steps == 12  # training went on
    st = ctl.eval_tracker.statistics()
    assert ctl.eval_history == [] and st.failed >= 3 and "failed 3 times" in st.last_failure
    assert ctl.state.pumps["eval"].errors == st.failed
    await assert_eval_left_nothing(ctl, gens, trainer, storage)


async def test_stalled_eval_request_hits_its_deadline_and_is_reissued():
    stuck = EVAL_PROMPTS[1].prompt_id
    cfg = eval_cfg(steps=6, every=3, timeouts={"generate_s": 0.2})
    ctl, gens, trainer, storage, summary, err = await run_eval_sim(cfg, Faults(gen_stall={(stuck, 0)}))
    assert err is None and summary.steps == 6
    assert ctl.eval_history and all(r["eval/failures"] == 1 for r in ctl.eval_history)
    assert_points_served_by_their_version(ctl)
    await assert_eval_left_nothing(ctl, gens, trainer, storage)


async def test_run_end_during_eval_reports_the_final_version_and_ends():
    # The first round's held request outlives training: the round follows the versions to the
    # final one, which is then the end-of-run point; nothing hangs waiting for more updates.
    slow = EVAL_PROMPTS[0].prompt_id
    ctl, gens, trainer, storage, summary, err = await run_eval_sim(
        eval_cfg(steps=5, every=100), held=(slow, lambda st: st.stop.train_done)
    )
    assert err is None and summary.steps == 5
    assert [r["eval/policy_version"] for r in ctl.eval_history] == [5]
    assert ctl.eval_history[0]["eval/trainer_version"] == 5
    assert_points_served_by_their_version(ctl)
    await assert_eval_left_nothing(ctl, gens, trainer, storage)


async def test_early_stop_during_eval_still_evaluates_the_final_version():
    cfg = eval_cfg(steps=50, every=100, run={"stop_at_success_rate": 0.0, "success_window": 2})
    ctl, gens, trainer, storage, summary, err = await run_eval_sim(
        cfg, held=(EVAL_PROMPTS[0].prompt_id, lambda st: st.stop.train_done)
    )
    assert err is None and summary.steps == 2
    assert ctl.eval_history[-1]["eval/policy_version"] == 2
    await assert_eval_left_nothing(ctl, gens, trainer, storage)


async def test_interrupt_during_eval_stops_without_a_last_round():
    # The first round waits (a held request) when the run is interrupted after step 2: the round
    # is dropped, no end-of-run round starts, and the run stops on its last finished step.
    def interrupt(ctl, rec):
        if rec["step"] == 2:
            ctl.state.request_stop("interrupted", abandon_open_step=True)

    cfg = eval_cfg(steps=20, every=2)
    ctl, gens, trainer, storage, summary, err = await run_eval_sim(
        cfg, held=(EVAL_PROMPTS[0].prompt_id, lambda st: False), on_step=interrupt
    )
    assert err is None and 3 <= summary.steps < 20
    assert ctl.eval_history == [] and ctl.eval_tracker.statistics().failed == 0
    assert ctl.eval_tracker.statistics().requests == len(EVAL_PROMPTS)  # one round, never re-issued
    await assert_clean_end(ctl, trainer, storage)
    assert ctl.state.pumps["eval"].finished


async def test_run_failure_during_eval_cancels_it_and_leaves_nothing():
    stuck = EVAL_PROMPTS[0].prompt_id  # would stall past the whole test: only cancellation ends it
    faults = Faults(gen_stall={(stuck, 0)}, train_fail={(1, 0, a) for a in range(3)})
    cfg = eval_cfg(steps=6, timeouts={"generate_s": 60}, train={"max_step_retries": 2})
    ctl, gens, trainer, storage, summary, err = await run_eval_sim(cfg, faults, timeout=20)
    assert isinstance(err, RunFailed) and err.pump == "train"
    assert ctl.eval_history == []
    await assert_clean_end(ctl, trainer, storage)
    assert [await g.in_flight() for g in gens] == [0] * len(gens)
    assert storage.put_keys <= {
        k for g in gens for gid in g.generated for k in row_keys(gid, ctl.cfg.rollout.group_size)
    }


async def test_eval_off_adds_no_pump():
    ctl, gens, trainer, storage, summary, err = await run_eval_sim(make_cfg(steps=3), prompts=())
    assert err is None and "eval" not in ctl.state.pumps and ctl.statistics().eval is None
    assert all(g.evaluated == [] for g in gens)


def test_eval_on_without_prompts_is_refused():
    storage = InMemoryRowStorage()
    gens, trainer = sim_workers(storage)
    with pytest.raises(ValueError, match="no eval prompts"):
        Controller(eval_cfg(), sim_prompts(), storage, Workers(gens, trainer))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    L=st.integers(0, 2),
    every=st.integers(1, 4),
    samples=st.integers(1, 3),
    num_generators=st.integers(1, 3),
    eval_fail=st.sets(st.tuples(st.integers(0, 7), st.integers(0, 1)), max_size=3),
    eval_delay=st.dictionaries(st.integers(0, 7), st.integers(1, 30), max_size=3),
    gen_fail=st.sets(st.integers(0, 20), max_size=3),
)
async def test_no_hang_and_every_point_consistent_under_arbitrary_eval_faults(
    L, every, samples, num_generators, eval_fail, eval_delay, gen_fail
):
    cfg = make_cfg(
        steps=6,
        L=L,
        eval={
            "enabled": True,
            "every_steps": every,
            "num_prompts": 8,
            "num_samples": samples,
            "temperature": 1.0,
            "max_retries": 2,
        },
    )
    ids = [p.prompt_id for p in EVAL_PROMPTS]
    faults = Faults(
        gen_fail={(ids[i], a) for i, a in eval_fail} | {(f"p{i:06d}", 0) for i in gen_fail},
        gen_delay={(ids[i], 0): ms * 0.001 for i, ms in eval_delay.items()},
    )
    ctl, gens, trainer, storage, summary, err = await run_eval_sim(
        cfg, faults, num_generators=num_generators, timeout=20
    )
    assert err is None and summary.steps == 6
    assert (
        ctl.eval_history and ctl.eval_history[-1]["eval/policy_version"] == 6
    )  # at most 2 failures each: never abandoned
    for rec in ctl.eval_history:
        v = rec["eval/policy_version"]
        res = [
            GenerationResult(p.prompt_id, sim_eval_rewards(p.prompt_id, v, samples), (3,) * samples, 5, v, v)
            for p in EVAL_PROMPTS
        ]
        assert {k: rec[k] for k in eval_metrics(res, 1.0)} == eval_metrics(res, 1.0)
    await assert_eval_left_nothing(ctl, gens, trainer, storage)
