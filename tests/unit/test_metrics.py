"""The Prometheus exporter and `sc-grpo status`, without Ray and without a Prometheus server.

Layer (a): `families()` of a hand-made statistics record, values derived by hand in comments.
Layer (b): the controller on the simulated backend with the exporter serving it, scraped over HTTP
from a worker thread (the scrape runs `Controller.statistics` on the loop, so the loop must stay
free). Stalls use an injected clock: the test moves time, so "waited 400 s" is exact and nothing
here depends on how fast the machine is. The stall alert of deploy/prometheus/alerts.yml is
evaluated on the scraped values (tests/integration/test_prometheus.py evaluates it in a real Prometheus).
"""

from __future__ import annotations

import asyncio
import inspect
import io
import pathlib
import re
import socket
import threading
import urllib.error
import urllib.request

import pytest
import yaml

from replay.ledger import LedgerStatistics, PromptLedgerStatistics
from replay.storage import InMemoryRowStorage, StorageStatistics
from samplers.staleness import SamplerStatistics
from single_controller.backends.sim import Faults, SimTrainerGroup, sim_prompts, sim_workers
from single_controller.config.schema import Config, MetricsConfig, RolloutConfig, RunConfig, SamplerConfig, TrainConfig
from single_controller.controller import Controller, ControllerStatistics
from single_controller.runtime import status
from single_controller.runtime.metrics import families, parse_metrics, serve_from_config, start_metrics_server
from single_controller.state import ElasticStatistics, PumpStatistics, SyncRecord, Workers

ROOT = pathlib.Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"

# Run shape shared by the simulated runs: P groups of G completions per step, lookahead L = 1, so the
# buffer holds (L + 1) * P = 16 groups. Sim completions have max_new_tokens = 3 tokens after a
# 5-token prompt.
P, G, L, STEPS = 8, 4, 1, 3
CAPACITY = (L + 1) * P
PROMPT_LEN, NEW_TOKENS = 5, 3


def make_cfg(steps: int = STEPS) -> Config:
    return Config(
        run=RunConfig(max_steps=steps, progress_bar=False, plot=False),
        rollout=RolloutConfig(group_size=G, max_new_tokens=NEW_TOKENS),
        train=TrainConfig(groups_per_step=P, min_groups_per_chunk=4),
        sampler=SamplerConfig(max_lookahead_versions=L, max_staleness_versions=L),
    )


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def values(samples: dict, name: str) -> dict[tuple, float]:
    """{sorted label items: value} of one sample name."""
    return {tuple(sorted(s.labels.items())): s.value for s in samples.get(name, [])}


def value(samples: dict, name: str, **labels: str) -> float:
    got = values(samples, name).get(tuple(sorted(labels.items())))
    assert got is not None, f"no sample {name}{labels}; have {sorted(values(samples, name))}"
    return got


def scrape_sync(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        return parse_metrics(resp.read().decode())


async def scrape(url: str) -> dict:
    return await asyncio.to_thread(scrape_sync, url)


async def settle(predicate, what: str, max_yields: int = 10_000) -> None:
    """Let the loop run (no time passes on the fake clock) until `predicate()` holds."""
    for _ in range(max_yields):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never reached: {what}")


def stall_rule() -> tuple[str, float]:
    """The ScGrpoPumpStalled expression and its threshold, checked to have the shape evaluated below."""
    rules = {r["alert"]: r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]}
    expr = rules["ScGrpoPumpStalled"]["expr"].strip()
    m = re.fullmatch(
        r"sc_grpo_pump_current_wait_seconds > (\d+(?:\.\d+)?) and ignoring\(pump, on\) sc_grpo_run_finished == 0", expr
    )
    assert m, f"ScGrpoPumpStalled changed shape; update stall_alert_firing(): {expr}"
    return expr, float(m.group(1))


def stall_alert_firing(samples: dict) -> set[tuple[str, str]]:
    """ScGrpoPumpStalled's condition on one scrape: (pump, on) with a current wait above the
    threshold while sc_grpo_run_finished == 0 (what Prometheus evaluates before `for:`)."""
    _, threshold = stall_rule()
    if value(samples, "sc_grpo_run_finished") != 0:
        return set()
    return {
        (s.labels["pump"], s.labels["on"]) for s in samples["sc_grpo_pump_current_wait_seconds"] if s.value > threshold
    }


# ---------------------------------------------------------------------------------------------
# (a) families() of a hand-made record
def handmade_statistics() -> ControllerStatistics:
    pumps = {
        # waiting on "ready groups" for 7 s now; 3 s of earlier "ready groups" waits + the 7 s in progress
        "train": PumpStatistics(
            "train", "ready groups", 7.0, {"ready groups": 10.0, "weight sync": 2.0}, 36.0, 5, 1, False
        ),
        "rollout": PumpStatistics("rollout", None, 0.0, {"admission": 4.0}, 12.0, 40, 2, False),
    }
    return ControllerStatistics(
        t=500.0,
        policy_version=5,
        trainer_version=6,
        admission_open=False,
        stopping=False,
        pumps=pumps,
        ledger=LedgerStatistics(
            capacity=16,
            resident=11,
            by_state={"reserved": 3, "committed": 1, "ready": 4, "selected": 2, "clearing": 1},
            reserved_total=60,
            trained_total=44,
            dropped_by_reason={"generation_failed": 2, "something_new": 1},
            evicted_by_reason={},
            in_flight_by_version={4: 1, 5: 2},
            oldest_ready_t=488.5,
        ),
        prompts=PromptLedgerStatistics(
            taken=50,
            settled=45,
            trained=44,
            dropped_by_reason={"generation_failed": 1},
            evicted_by_reason={},
            retries=3,
        ),
        sampler=SamplerStatistics(1, 1, {0: 3, 1: 2, 3: 1, 9: 1}, 7, 0, 2),
        storage=StorageStatistics(
            puts=10, gets=4, clears=3, rows_put=40, rows_read=16, bytes_put=1000, bytes_read=800, resident_rows=-1
        ),
        sync=SyncRecord(count=5, total_s=2.5, last_s=0.75, last_drain_s=0.25, last_bytes=4096, aborted_in_flight=2),
        zero_variance_groups=3,
        reward_failed=4,
        aborted_steps=1,
        step_retries=1,
        steps=6,
        tokens_generated=1234,
        tokens_trained=5678,
        last_step_s=1.5,
        last_reward_mean=0.25,
        last_success_rate=0.125,
        generation_workers=3,
        generation_workers_active=1,
        elastic=ElasticStatistics(2, 5, 3, 1.5, 0.75, 0.25, 0.125, 7, 1, 1),
    )


def family_samples(stats: ControllerStatistics) -> dict:
    out: dict = {}
    for fam in families(stats):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def test_families_of_a_handmade_record():
    m = family_samples(handmade_statistics())
    # Staleness {0: 3, 1: 2, 3: 1, 9: 1}: cumulative le=0: 3, le=1: 5, le=2: 5, le=4: 6, le=8: 6, +Inf: 7;
    # sum = 0*3 + 1*2 + 3*1 + 9*1 = 14; max = 9 > bound 1.
    assert values(m, "sc_grpo_trained_staleness_versions_bucket") == {
        (("le", "0.0"),): 3,
        (("le", "1.0"),): 5,
        (("le", "2.0"),): 5,
        (("le", "4.0"),): 6,
        (("le", "8.0"),): 6,
        (("le", "+Inf"),): 7,
    }
    assert value(m, "sc_grpo_trained_staleness_versions_count") == 7
    assert value(m, "sc_grpo_trained_staleness_versions_sum") == 14
    assert value(m, "sc_grpo_trained_staleness_max_versions") == 9
    assert value(m, "sc_grpo_max_staleness_versions") == 1
    # Pumps: the current wait only on the reason awaited now; totals include the wait in progress.
    assert value(m, "sc_grpo_pump_current_wait_seconds", pump="train", on="ready groups") == 7.0
    assert value(m, "sc_grpo_pump_current_wait_seconds", pump="train", on="weight sync") == 0.0
    assert value(m, "sc_grpo_pump_current_wait_seconds", pump="rollout", on="admission") == 0.0
    assert value(m, "sc_grpo_pump_waiting", pump="train", on="ready groups") == 1
    assert value(m, "sc_grpo_pump_waiting", pump="rollout", on="admission") == 0
    assert value(m, "sc_grpo_pump_wait_seconds_total", pump="train", on="ready groups") == 10.0
    assert value(m, "sc_grpo_pump_busy_seconds_total", pump="train") == 36.0
    assert value(m, "sc_grpo_pump_errors_total", pump="rollout") == 2
    # Idle ratios: train (10 + 2) / (12 + 36) = 0.25; rollout 4 / (4 + 12) = 0.25.
    assert value(m, "sc_grpo_trainer_idle_ratio") == pytest.approx(0.25, abs=1e-12)
    assert value(m, "sc_grpo_generation_idle_ratio") == pytest.approx(0.25, abs=1e-12)
    # The train pump has not finished: the run has not either.
    assert value(m, "sc_grpo_run_finished") == 0
    assert value(m, "sc_grpo_admission_open") == 0
    # Buffer: every state present, oldest ready group 500 - 488.5 = 11.5 s old.
    assert values(m, "sc_grpo_buffer_groups") == {
        (("state", "reserved"),): 3,
        (("state", "committed"),): 1,
        (("state", "ready"),): 4,
        (("state", "selected"),): 2,
        (("state", "clearing"),): 1,
    }
    assert value(m, "sc_grpo_oldest_ready_group_age_seconds") == 11.5
    assert values(m, "sc_grpo_in_flight_groups") == {(("version", "4"),): 1, (("version", "5"),): 2}
    # Known reasons exported at 0 from the start, unknown ones as they come.
    assert value(m, "sc_grpo_groups_dropped_total", reason="generation_failed") == 2
    assert value(m, "sc_grpo_groups_dropped_total", reason="something_new") == 1
    assert value(m, "sc_grpo_groups_dropped_total", reason="zero_variance") == 0
    assert value(m, "sc_grpo_groups_dropped_total", reason="reward_failed") == 0
    assert value(m, "sc_grpo_reward_failed_groups_total") == 4
    assert value(m, "sc_grpo_groups_evicted_total", reason="stale") == 0
    assert value(m, "sc_grpo_prompt_retries_total") == 3
    # Sync as a summary: mean = 2.5 / 5.
    assert value(m, "sc_grpo_weight_sync_duration_seconds_count") == 5
    assert value(m, "sc_grpo_weight_sync_duration_seconds_sum") == 2.5
    assert value(m, "sc_grpo_weight_sync_last_drain_seconds") == 0.25
    assert value(m, "sc_grpo_stale_in_flight_aborts_total") == 2
    assert value(m, "sc_grpo_tokens_generated_total") == 1234
    assert value(m, "sc_grpo_storage_bytes_total", op="get") == 800
    # resident_rows == -1 means unknown: no sample rather than a wrong one.
    assert "sc_grpo_storage_resident_rows" not in m
    # Elastic generation: 3 workers, 2 shrunk, 1 active; 5 shrinks (1.5 s), 3 expands (0.75 s), 7 preempted groups.
    assert value(m, "sc_grpo_generation_workers_active") == 1
    assert value(m, "sc_grpo_generation_workers_shrunk") == 2
    assert value(m, "sc_grpo_generation_shrinks_total") == 5
    assert value(m, "sc_grpo_generation_expands_total") == 3
    assert value(m, "sc_grpo_generation_expand_failures_total") == 1
    assert value(m, "sc_grpo_generation_shrink_seconds_total") == 1.5
    assert value(m, "sc_grpo_generation_expand_seconds_total") == 0.75
    assert value(m, "sc_grpo_generation_preempted_groups_total") == 7
    assert value(m, "sc_grpo_pool_train_slots") == 1


def test_nothing_in_flight_is_a_zero_at_the_served_version_not_an_empty_panel():
    import dataclasses

    st = handmade_statistics()
    st = dataclasses.replace(st, ledger=dataclasses.replace(st.ledger, in_flight_by_version={}))
    assert values(family_samples(st), "sc_grpo_in_flight_groups") == {(("version", str(st.policy_version)),): 0}


def test_mismatch_gauges_and_their_bound():
    import dataclasses
    import math

    unmeasured = family_samples(handmade_statistics())
    assert math.isnan(value(unmeasured, "sc_grpo_train_mismatch_kl"))  # unknown, not 0
    measured = dataclasses.replace(
        handmade_statistics(),
        mismatch={"train/mismatch_kl": 2e-3, "train/mismatch_abs_logprob": 0.05},
        mismatch_kl_bound=1e-3,
    )
    got = family_samples(measured)
    assert value(got, "sc_grpo_train_mismatch_kl") == 2e-3
    assert value(got, "sc_grpo_train_mismatch_abs_logprob") == 0.05
    assert value(got, "sc_grpo_mismatch_kl_bound") == 1e-3


def test_only_the_exporter_imports_prometheus_client():
    importers = []
    for pkg in ("single_controller", "pumps", "samplers", "replay"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if re.search(r"^\s*(import|from)\s+prometheus_client", path.read_text(), re.M):
                importers.append(str(path.relative_to(ROOT)))
    assert importers == ["single_controller/runtime/metrics.py"]


# ---------------------------------------------------------------------------------------------
# binding
def test_binds_loopback_unless_configured():
    stats = handmade_statistics
    assert inspect.signature(start_metrics_server).parameters["host"].default == "127.0.0.1"
    assert MetricsConfig().host == "127.0.0.1"
    server, port = start_metrics_server(stats)
    try:
        assert server.httpd.socket.getsockname() == ("127.0.0.1", port) and port > 0
        assert value(scrape_sync(server.url), "sc_grpo_policy_version") == 5
    finally:
        server.stop()
    with pytest.raises(OSError):  # stopped means the socket is closed
        socket.create_connection(("127.0.0.1", port), timeout=1).close()

    from_cfg = serve_from_config(MetricsConfig(port=0), stats)
    try:
        assert from_cfg.httpd.socket.getsockname()[0] == "127.0.0.1"
    finally:
        from_cfg.stop()
    assert serve_from_config(MetricsConfig(enabled=False, port=0), stats) is None

    public, _ = start_metrics_server(stats, host="0.0.0.0")  # only because the caller asked
    try:
        assert public.httpd.socket.getsockname()[0] == "0.0.0.0"
    finally:
        public.stop()


def test_a_taken_port_moves_to_the_next_free_one_and_the_url_says_so():
    # Two runs on one host both ask for the same metrics.port: the second serves on the next free
    # port, and its `url` (what the run prints) is the one that answers.
    first = serve_from_config(MetricsConfig(port=0), handmade_statistics)  # stands for the other run
    taken = first.port
    try:
        if taken + 15 > 65535:
            pytest.skip("ephemeral port too close to 65535 to probe upward")
        second = serve_from_config(MetricsConfig(port=taken), handmade_statistics)
        try:
            assert taken < second.port <= taken + 15
            assert second.url == f"http://127.0.0.1:{second.port}/metrics"
            assert value(scrape_sync(second.url), "sc_grpo_policy_version") == 5
            assert value(scrape_sync(first.url), "sc_grpo_policy_version") == 5  # the first one is untouched
        finally:
            second.stop()
    finally:
        first.stop()


def test_scrape_errors_surface_as_http_errors():
    def broken() -> ControllerStatistics:
        raise RuntimeError("statistics exploded")

    server, _ = start_metrics_server(broken)
    try:
        with pytest.raises(urllib.error.HTTPError) as e:
            scrape_sync(server.url)
        assert e.value.code == 500
    finally:
        server.stop()

    # A blocked event loop fails the scrape within the deadline instead of hanging or reading torn state.
    loop = asyncio.new_event_loop()
    release, entered = threading.Event(), threading.Event()

    async def blocked() -> None:
        entered.set()
        release.wait()  # deliberately blocks this loop's thread (the failure being tested)

    t = threading.Thread(target=loop.run_until_complete, args=(blocked(),))
    t.start()
    try:
        assert entered.wait(5)
        server, _ = start_metrics_server(handmade_statistics, loop=loop, timeout_s=0.2)
        try:
            with pytest.raises(urllib.error.HTTPError) as e:
                scrape_sync(server.url)
            assert e.value.code == 500
        finally:
            server.stop()
    finally:
        release.set()
        t.join(5)
        loop.close()


# ---------------------------------------------------------------------------------------------
# (b) the controller on the sim backend, scraped over HTTP
async def test_sim_run_scraped_over_http():
    async def go():
        storage = InMemoryRowStorage()
        gate = asyncio.Event()
        gens, trainer = sim_workers(storage, num_generators=2, faults=Faults(gate=gate))
        ctl = Controller(make_cfg(), sim_prompts(), storage, Workers(gens, trainer))
        server, port = start_metrics_server(ctl.statistics)  # loop: this one
        try:
            assert server.httpd.socket.getsockname() == ("127.0.0.1", port)
            run = asyncio.create_task(ctl.run())
            st = ctl.state
            await settle(
                lambda: st.ledger.resident() == CAPACITY and st.pumps["rollout"].waiting_on == "admission",
                "buffer reserved",
            )
            before = await scrape(server.url)
            gate.set()
            summary = await asyncio.wait_for(run, 30)
            after = await scrape(server.url)
        finally:
            await asyncio.to_thread(server.stop)
        return summary, before, after, trainer

    summary, before, m, trainer = await go()
    # Mid-run (generation gated): every slot reserved, in flight on version 0, nothing trained yet.
    assert value(before, "sc_grpo_buffer_groups", state="reserved") == CAPACITY
    assert value(before, "sc_grpo_buffer_capacity_groups") == CAPACITY
    assert value(before, "sc_grpo_in_flight_groups", version="0") == CAPACITY
    assert value(before, "sc_grpo_pump_waiting", pump="train", on="ready groups") == 1
    assert value(before, "sc_grpo_pump_waiting", pump="rollout", on="admission") == 1
    assert value(before, "sc_grpo_run_finished") == 0
    assert value(before, "sc_grpo_steps_total") == 0

    # After the run: counts that follow from the run shape.
    assert summary.steps == STEPS
    assert value(m, "sc_grpo_run_finished") == 1
    assert (
        value(m, "sc_grpo_steps_total")
        == value(m, "sc_grpo_trainer_version")
        == value(m, "sc_grpo_policy_version")
        == STEPS
    )
    trained_groups = STEPS * P
    assert value(m, "sc_grpo_groups_trained_total") == value(m, "sc_grpo_prompts_trained_total") == trained_groups
    assert value(m, "sc_grpo_trained_staleness_versions_count") == trained_groups
    assert value(m, "sc_grpo_trained_staleness_versions_bucket", le="+Inf") == trained_groups
    assert (
        value(m, "sc_grpo_trained_staleness_versions_bucket", le="1.0") == trained_groups
    )  # nothing staler than L = 1
    assert value(m, "sc_grpo_trained_staleness_max_versions") <= value(m, "sc_grpo_max_staleness_versions") == L
    assert value(m, "sc_grpo_tokens_generated_total") == trained_groups * G * NEW_TOKENS
    assert value(m, "sc_grpo_tokens_trained_total") == trained_groups * G * (PROMPT_LEN + NEW_TOKENS)
    assert value(m, "sc_grpo_weight_sync_duration_seconds_count") == STEPS
    assert value(m, "sc_grpo_pump_iterations_total", pump="train") == STEPS
    assert value(m, "sc_grpo_buffer_resident_groups") == 0
    assert value(m, "sc_grpo_storage_resident_rows") == 0
    assert value(m, "sc_grpo_storage_rows_total", op="get") == sum(len(k) for k in trainer.trained.values())
    assert value(m, "sc_grpo_pump_wait_seconds_total", pump="train", on="ready groups") > 0  # it waited on the gate
    assert 0 < value(m, "sc_grpo_trainer_idle_ratio") < 1
    assert not stall_alert_firing(m)
    last = summary.history[-1]
    assert value(m, "sc_grpo_last_step_reward_mean") == last["rollout/reward_mean"]
    assert value(m, "sc_grpo_last_step_success_rate") == last["rollout/success_rate"]
    assert value(m, "sc_grpo_step_last_duration_seconds") == last["time/step_s"]


async def test_generation_stall_grows_the_train_pumps_wait_and_fires_the_stall_condition():
    async def go():
        clock = FakeClock()
        storage = InMemoryRowStorage()
        gate = asyncio.Event()  # generation blocks until the test sets it
        gens, trainer = sim_workers(storage, faults=Faults(gate=gate))
        ctl = Controller(make_cfg(steps=2), sim_prompts(), storage, Workers(gens, trainer), clock=clock)
        server, _ = start_metrics_server(ctl.statistics)
        run = asyncio.create_task(ctl.run())
        try:
            st = ctl.state
            await settle(
                lambda: (
                    st.pumps["train"].waiting_on == "ready groups" and st.pumps["rollout"].waiting_on == "admission"
                ),
                "stalled",
            )
            at_start = await scrape(server.url)
            clock.t += 400.0  # the stall lasts 400 s
            stalled = await scrape(server.url)
            out = io.StringIO()
            rc = await asyncio.to_thread(status.main, ["--url", server.url], out)
            gate.set()
            await asyncio.wait_for(run, 30)
            done = await scrape(server.url)
        finally:
            gate.set()
            await asyncio.to_thread(server.stop)
        return at_start, stalled, done, rc, out.getvalue()

    at_start, stalled, done, rc, shown = await go()
    assert value(at_start, "sc_grpo_pump_current_wait_seconds", pump="train", on="ready groups") == 0.0
    assert stall_alert_firing(at_start) == set()
    # The wait in progress is exactly the time the clock moved, on what the train pump awaits.
    assert value(stalled, "sc_grpo_pump_current_wait_seconds", pump="train", on="ready groups") == 400.0
    assert value(stalled, "sc_grpo_pump_wait_seconds_total", pump="train", on="ready groups") == 400.0
    assert value(stalled, "sc_grpo_pump_current_wait_seconds", pump="rollout", on="admission") == 400.0
    assert value(stalled, "sc_grpo_trainer_idle_ratio") == 1.0  # waited 400 s, no trainer call yet
    assert ("train", "ready groups") in stall_alert_firing(stalled)
    assert value(stalled, "sc_grpo_in_flight_groups", version="0") == CAPACITY
    # sc-grpo status shows the same picture.
    assert rc == 0
    assert re.search(r"train\s+waiting on ready groups for 6\.7m", shown), shown
    assert f"{CAPACITY}/{CAPACITY}" in shown
    # Once the run is over nothing is a stall.
    assert value(done, "sc_grpo_run_finished") == 1
    assert value(done, "sc_grpo_pump_current_wait_seconds", pump="train", on="ready groups") == 0.0
    assert stall_alert_firing(done) == set()


class BlockingTrainer(SimTrainerGroup):
    """A trainer whose microbatches block until `release` is set: a stalled trainer."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.release = asyncio.Event()
        self.blocked = False

    async def train_microbatch(self, chunk):
        self.blocked = True
        await self.release.wait()
        await super().train_microbatch(chunk)


async def test_stalled_trainer_fills_the_buffer_to_capacity():
    async def go():
        clock = FakeClock()
        storage = InMemoryRowStorage()
        gens, _ = sim_workers(storage)
        trainer = BlockingTrainer(storage)
        ctl = Controller(make_cfg(steps=2), sim_prompts(), storage, Workers(gens, trainer), clock=clock)
        server, _ = start_metrics_server(ctl.statistics)
        run = asyncio.create_task(ctl.run())
        try:
            st = ctl.state
            await settle(
                lambda: (
                    trainer.blocked
                    and st.ledger.resident() == CAPACITY
                    and st.in_flight() == 0
                    and st.pumps["advantage"].waiting_on == "committed groups"
                    and st.pumps["rollout"].waiting_on == "admission"
                ),
                "buffer full behind a blocked trainer",
            )
            first = await scrape(server.url)
            clock.t += 50.0
            full = await scrape(server.url)
            trainer.release.set()
            await asyncio.wait_for(run, 30)
            done = await scrape(server.url)
        finally:
            trainer.release.set()
            await asyncio.to_thread(server.stop)
        return first, full, done

    first, full, done = await go()
    assert value(full, "sc_grpo_buffer_resident_groups") == value(full, "sc_grpo_buffer_capacity_groups") == CAPACITY
    # The first chunk (at least min_groups_per_chunk = 4, at most a step) is on the blocked trainer;
    # every other slot holds a ready group.
    selected = value(full, "sc_grpo_buffer_groups", state="selected")
    assert 4 <= selected <= P
    assert value(full, "sc_grpo_buffer_groups", state="ready") == CAPACITY - selected
    assert sum(v for v in values(full, "sc_grpo_buffer_groups").values()) == CAPACITY
    # Ready groups were committed at the fake t0: 50 s old now. The trainer is busy, not waiting.
    assert value(full, "sc_grpo_oldest_ready_group_age_seconds") == 50.0
    assert not any(v for (labels, v) in values(full, "sc_grpo_pump_waiting").items() if ("pump", "train") in labels)
    assert value(full, "sc_grpo_pump_current_wait_seconds", pump="rollout", on="admission") == 50.0
    # ScGrpoBufferFull's condition over these two scrapes: full, trainer version unchanged, not finished.
    assert value(first, "sc_grpo_trainer_version") == value(full, "sc_grpo_trainer_version") == 0
    assert value(full, "sc_grpo_run_finished") == 0
    # Released, the run drains the buffer.
    assert value(done, "sc_grpo_buffer_resident_groups") == 0
    assert value(done, "sc_grpo_steps_total") == 2


# ---------------------------------------------------------------------------------------------
# sc-grpo status
def test_status_reports_unreachable_and_foreign_endpoints(capsys):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert status.main(["--url", f"127.0.0.1:{port}", "--timeout", "2"]) == 1
    err = capsys.readouterr().err
    assert f"cannot reach http://127.0.0.1:{port}/metrics" in err

    server, port = start_metrics_server(handmade_statistics)
    try:
        out = io.StringIO()
        assert status.main(["--url", f"http://127.0.0.1:{port}"], out) == 0
        shown = out.getvalue()
    finally:
        server.stop()
    assert "policy v5  trainer v6" in shown
    assert re.search(r"train\s+waiting on ready groups for 7\.00s  \(1 errors\)", shown), shown
    assert re.search(r"rollout\s+busy  \(2 errors\)", shown), shown
    assert "11/16" in shown
    assert "weight sync: admission closed" in shown
    assert "7 groups trained, by versions behind: 0:3 1:2 2:0 3-4:1 5-8:0 >8:1" in shown
    assert "dropped generation_failed 2, something_new 1" in shown
    with pytest.raises(SystemExit) as e:
        status.main(["--watch", "0"])
    assert e.value.code == 2


def test_status_bar_scales_states_to_capacity():
    # 16 slots in 32 cells: 2 cells per group.
    assert status._bar({"reserved": 3, "ready": 4, "selected": 2}, 16) == "gggggg" + "rrrrrrrr" + "tttt" + "." * 14
    assert status.metrics_url("localhost:9464") == "http://localhost:9464/metrics"
    assert status.metrics_url("http://h:1/custom") == "http://h:1/custom"


def test_completion_records_by_hand():
    """Two groups of two: lengths 3, 5 | 4, 8 -> mean 5, min 3, max 8; one row of four cut short;
    advantages 1, -1, 0.5, -0.5 -> mean 0, std sqrt((1 + 1 + .25 + .25) / 4) = sqrt(0.625)."""
    import math

    from replay.ledger import GroupRecord
    from single_controller.controller import completion_records
    from single_controller.types import Prompt

    def group(lengths, truncated, advantages):
        rec = GroupRecord("g", Prompt("p", (1,)), 0, 0, 0, 0, 0.0)
        rec.response_lengths, rec.truncated, rec.advantages = lengths, truncated, advantages
        return rec

    got = completion_records([group((3, 5), (False, False), (1.0, -1.0)), group((4, 8), (False, True), (0.5, -0.5))])
    assert got == {
        "rollout/completion_len_mean": 5.0,
        "rollout/completion_len_min": 3.0,
        "rollout/completion_len_max": 8.0,
        "rollout/truncated_rate": 0.25,
        "rollout/advantage_mean": 0.0,
        "rollout/advantage_std": math.sqrt(0.625),
    }
    assert completion_records([group((2, 2), (), (0.0, 0.0))])["rollout/truncated_rate"] == 0.0  # not told: none cut
