"""A Prometheus server on loopback and the shipped dashboard's queries, for the Prometheus test
(tests/integration/test_prometheus.py) and the functional suite's metrics script
(tests/e2e/functional/prom.py). Not a test module."""

from __future__ import annotations

import json
import math
import pathlib
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

import yaml

from tests.helpers.free_ports import free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "sc-grpo-dashboard.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
PROMETHEUS, PROMTOOL = shutil.which("prometheus"), shutil.which("promtool")
SCRAPE_S = 1
RATE_INTERVAL = f"{4 * SCRAPE_S}s"  # Grafana's $__rate_interval floor: 4 x scrape interval


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
