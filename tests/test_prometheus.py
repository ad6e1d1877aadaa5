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
import math
import pathlib
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import replace

import pytest
import yaml

from replay.storage import InMemoryRowStorage
from single_controller.backends.sim import Faults, sim_prompts, sim_workers
from single_controller.config.schema import Config, EvalConfig, RolloutConfig, RunConfig, SamplerConfig, TrainConfig
from single_controller.controller import Controller
from single_controller.runtime.metrics import start_metrics_server
from single_controller.state import Workers

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from free_ports import free_port  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "sc-grpo-dashboard.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
PROMETHEUS, PROMTOOL = shutil.which("prometheus"), shutil.which("promtool")
SCRAPE_S = 1
RATE_INTERVAL = f"{4 * SCRAPE_S}s"  # Grafana's $__rate_interval floor: 4 x scrape interval
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
def dashboard_targets() -> list[tuple[str, dict]]:
    """(panel title, target) for every target of every panel, rows' nested panels included."""

    def walk(panels):
        for p in panels:
            yield p
            yield from walk(p.get("panels", []))

    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t) for p in walk(dash["panels"]) for t in p.get("targets", [])]


def grafana_substitute(expr: str) -> str:
    out = expr.replace("$__rate_interval", RATE_INTERVAL).replace('instance=~"$instance"', 'instance=~".*"')
    assert "$" not in out, f"unsubstituted template variable in {expr!r}"
    return out


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


# ---------------------------------------------------------------------------------------------
# a Prometheus server on loopback
class Prometheus:
    def __init__(self, tmp: pathlib.Path, target_port: int):
        self.port = free_port()
        self.log = tmp / "prometheus.log"
        config = {
            "global": {
                "scrape_interval": f"{SCRAPE_S}s",
                "evaluation_interval": f"{SCRAPE_S}s",
                "scrape_timeout": f"{SCRAPE_S}s",
            },
            "rule_files": [str(ALERTS)],
            "scrape_configs": [{"job_name": "sc-grpo", "static_configs": [{"targets": [f"127.0.0.1:{target_port}"]}]}],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.cmd = [
            PROMETHEUS,
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Prometheus:
        self._log = open(self.log, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self.wait_for(lambda: self._ready(), 30, "Prometheus to become ready")
        except BaseException:
            self.__exit__(None, None, None)  # __exit__ is not called when __enter__ raises
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited with {self.proc.returncode}:\n{self.log.read_text()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def api(self, path: str, **params) -> dict:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params, doseq=True)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as e:  # 400/422: a bad expression; the body says why
            body = json.loads(e.read())
        assert body["status"] == "success", f"{path} {params}: {body.get('errorType')}: {body.get('error')}"
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.api("query", query=expr)["result"]

    def query_range(self, expr: str, start: float, end: float) -> list[dict]:
        return self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{SCRAPE_S}s")[
            "result"
        ]

    @staticmethod
    def wait_for(predicate, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():  # polling an external process from a sync test: fine
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
            time.sleep(0.25)


def finite(result: list[dict]) -> bool:
    vals = [v for s in result for _, v in s.get("values", [s.get("value", (0, "NaN"))])]
    return any(math.isfinite(float(v)) for v in vals)


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
