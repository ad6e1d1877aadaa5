"""The shipped dashboard and alert rules against a real Prometheus (marker `prometheus`).

Needs the `prometheus` and `promtool` binaries (Debian package `prometheus`); skipped cleanly
without them. What is checked:

1. `promtool check rules` / `check config` accept deploy/prometheus/, and `promtool test rules`
   passes the alert unit tests in deploy/prometheus/alerts_test.yml (synthetic series, `for:` included).
2. A Prometheus on loopback (temp dir, free port, 1 s scrape and evaluation interval) scrapes the
   exporter of a real simulated run (the controller's loop runs in a background thread; a gate
   Event, open while healthy, lets the test stall generation later). Then, through the HTTP API:
   - every target expression of every panel of deploy/grafana/sc-grpo-dashboard.json, with the
     template variables substituted as Grafana would (`$instance` = All = `.*`,
     `$__rate_interval` = 4 x scrape interval), evaluates without error and returns data: at
     least one finite sample over the run (range query, as Grafana's time-series panels do);
   - every alert expression evaluates and returns data. Alerts must stay silent in a healthy run,
     so "returns data" is made meaningful by evaluating each expression with `bool` added to
     every comparison (`a > 300` -> `a > bool 300`): the result is 0/1 for every series the rule
     looks at, so an empty result means a misspelt metric or a label mismatch in the `and`s, not
     a quiet alert. Prometheus itself must also load and evaluate every rule without error;
   - a forced generation stall (the gate cleared) makes ScGrpoPumpStalled's expression, with its
     300 s threshold lowered to STALL_S, return the train pump's series on "ready groups", where
     the same expression returned nothing while the run was healthy.
Prometheus is killed in a `finally`; nothing is left running.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import threading
import time
from dataclasses import replace

import pytest
import yaml

from replay.storage import InMemoryRowStorage
from single_controller.backends.sim import Faults, sim_prompts, sim_workers
from single_controller.config.schema import Config, EvalConfig, RolloutConfig, RunConfig, SamplerConfig, TrainConfig
from single_controller.controller import Controller
from single_controller.runtime.metrics import start_metrics_server
from single_controller.state import Workers
from tests.helpers.prometheus import (
    ALERTS,
    DASHBOARD,
    DEPLOY,
    PROMETHEUS,
    PROMTOOL,
    Prometheus,
    dashboard_targets,
    finite,
    grafana_substitute,
)

STALL_S = 3  # the stall rule's threshold, lowered from 300 s for the test

pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.skipif(
        PROMETHEUS is None or PROMTOOL is None,
        reason="prometheus/promtool binaries not installed (apt-get install prometheus)",
    ),
]


def promtool(*args: str) -> None:
    res = subprocess.run([PROMTOOL, *args], cwd=DEPLOY / "prometheus", capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, f"promtool {' '.join(args)} failed:\n{res.stdout}\n{res.stderr}"


def test_promtool_accepts_rules_config_and_alert_unit_tests():
    promtool("check", "rules", "alerts.yml")
    promtool("check", "config", "prometheus.yml")
    promtool("test", "rules", "alerts_test.yml")


# ---------------------------------------------------------------------------------------------
# query extraction and rewriting
def alert_rules() -> dict[str, str]:
    return {r["alert"]: r["expr"].strip() for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]}


_COMPARISON = re.compile(r"==|!=|>=|<=|>|<")


def with_bool(expr: str) -> str:
    """Add `bool` to every comparison outside label matchers, strings and range selectors."""
    out, i, depth = [], 0, 0
    while i < len(expr):
        c = expr[i]
        if c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
        elif c in "\"'":
            end = expr.index(c, i + 1)
            out.append(expr[i : end + 1])
            i = end + 1
            continue
        m = _COMPARISON.match(expr, i) if depth == 0 else None
        if m:
            out.append(m.group(0))
            i = m.end()
            if not re.match(r"\s*bool\b", expr[i:]):
                out.append(" bool")
            continue
        out.append(c)
        i += 1
    return "".join(out)


def test_with_bool_rewrites_only_comparisons():
    assert (
        with_bool('a{x!="y",z=~"w"} > 300 and ignoring(p) b == 0')
        == 'a{x!="y",z=~"w"} > bool 300 and ignoring(p) b == bool 0'
    )
    assert with_bool("changes(v[5m]) >= bool 1") == "changes(v[5m]) >= bool 1"


# ---------------------------------------------------------------------------------------------
# a simulated run in a background thread, serving metrics
class SimRun:
    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.started = threading.Event()
        self.port: int | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, name="sim-run", daemon=True)

    def __enter__(self) -> SimRun:
        self.thread.start()
        assert self.started.wait(30), "the simulated run did not start"
        if self.error is not None:
            raise self.error
        return self

    def _main(self) -> None:
        try:
            self.loop.run_until_complete(self._run())
        except BaseException as e:  # reported by __exit__/the test
            self.error = e
            self.started.set()
        finally:
            self.loop.close()

    async def _run(self) -> None:
        cfg = Config(
            run=RunConfig(max_steps=1_000_000, progress_bar=False, plot=False),
            rollout=RolloutConfig(group_size=4, max_retries=2),
            train=TrainConfig(groups_per_step=4, min_groups_per_chunk=2),
            sampler=SamplerConfig(max_lookahead_versions=1, max_staleness_versions=1),
        )
        storage = InMemoryRowStorage()
        self.gate = asyncio.Event()
        self.gate.set()  # open: healthy
        faults = Faults(gate=self.gate)
        gens, trainer = sim_workers(storage, num_generators=2, gen_group_s=0.01, train_group_s=0.01, faults=faults)
        cfg = replace(cfg, eval=EvalConfig(enabled=True, every_steps=5, num_prompts=8))  # the eval panels need data
        self.ctl = Controller(cfg, sim_prompts(), storage, Workers(gens, trainer), eval_prompts=list(sim_prompts(8)))
        server, self.port = start_metrics_server(self.ctl.statistics)
        try:
            run = asyncio.ensure_future(self.ctl.run())
            self.started.set()
            await run
        finally:
            await asyncio.to_thread(server.stop)

    def stall_generation(self) -> None:
        self.loop.call_soon_threadsafe(self.gate.clear)

    def __exit__(self, *exc) -> None:
        def stop():
            self.gate.set()
            self.ctl.state.request_stop("test over")

        if not self.loop.is_closed():
            try:
                self.loop.call_soon_threadsafe(stop)
            except RuntimeError:
                pass  # the loop closed in between: the run is over
        self.thread.join(30)
        assert not self.thread.is_alive(), "the simulated run did not stop"
        if self.error is not None:
            if exc[1] is None:
                raise self.error
            exc[1].add_note(f"the simulated run failed: {self.error!r}")


def test_dashboard_and_alerts_evaluate_in_prometheus(tmp_path):
    targets = dashboard_targets()
    rules = alert_rules()
    assert len(targets) >= 30 and len(rules) >= 5
    stall_expr, n = re.subn(
        r"sc_grpo_pump_current_wait_seconds > 300\b",
        f"sc_grpo_pump_current_wait_seconds > {STALL_S}",
        rules["ScGrpoPumpStalled"],
    )
    assert n == 1, rules["ScGrpoPumpStalled"]

    with SimRun() as sim, Prometheus(tmp_path, sim.port) as prom:
        t0 = time.time()
        # Enough scrapes for every rate() window, and some steps trained.
        prom.wait_for(
            lambda: any(float(s["value"][1]) >= 8 for s in prom.query("count_over_time(sc_grpo_trainer_version[1m])")),
            30,
            "8 scrapes",
        )
        assert [s["value"][1] for s in prom.query('up{job="sc-grpo"}')] == ["1"]
        assert float(prom.query("sc_grpo_trainer_version")[0]["value"][1]) > 0, "the run trained nothing"
        t1 = time.time()

        # Every dashboard query, as Grafana would send it.
        empty = []
        for title, t in targets:
            expr = grafana_substitute(t["expr"])
            result = prom.query(expr) if t.get("instant") else prom.query_range(expr, t0, t1)
            if not finite(result):
                empty.append(f"{title} [{t['refId']}]: {expr}")
        assert not empty, "dashboard queries without data:\n" + "\n".join(empty)
        # The $instance variable's query: label_values(<metric>, instance).
        var = next(v for v in json.loads(DASHBOARD.read_text())["templating"]["list"] if v["name"] == "instance")
        metric = re.fullmatch(r"label_values\((\w+), instance\)", var["definition"]).group(1)
        assert prom.api("label/instance/values", **{"match[]": metric}) == [f"127.0.0.1:{sim.port}"]

        # Every alert expression, with `bool` comparisons so that a quiet alert still returns data.
        for name, expr in rules.items():
            assert prom.query(with_bool(expr)), f"{name}: no series for {with_bool(expr)}"
        prom.wait_for(
            lambda: (
                {r["name"]: r["health"] for g in prom.api("rules")["groups"] for r in g["rules"]}.keys() >= rules.keys()
                and all(
                    r.get("lastEvaluation", "").startswith("20")
                    for g in prom.api("rules")["groups"]
                    for r in g["rules"]
                )
            ),
            15,
            "every rule evaluated",
        )
        health = {
            r["name"]: (r["health"], r.get("lastError", "")) for g in prom.api("rules")["groups"] for r in g["rules"]
        }
        assert all(h == "ok" for h, _ in health.values()), health
        firing = [a for a in prom.api("alerts")["alerts"] if a["state"] == "firing"]
        assert not firing, f"alerts firing in a healthy run: {firing}"

        # Healthy: nothing waits STALL_S. Stalled generation: the train pump waits on ready groups.
        assert prom.query(stall_expr) == []
        sim.stall_generation()
        stalled: list[dict] = []

        def train_stalled() -> bool:
            stalled[:] = prom.query(stall_expr)
            return any(s["metric"].get("pump") == "train" and s["metric"].get("on") == "ready groups" for s in stalled)

        prom.wait_for(train_stalled, 25, f"ScGrpoPumpStalled (threshold {STALL_S}s) to name the train pump")
        train = next(s for s in stalled if s["metric"]["pump"] == "train")
        assert float(train["value"][1]) > STALL_S
        assert train["metric"]["job"] == "sc-grpo"
