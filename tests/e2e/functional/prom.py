"""Prometheus against a real `sc-grpo run` (tests/e2e/functional/metrics.sh).

    python tests/e2e/functional/prom.py --target 127.0.0.1:PORT --pid PID --dir DIR [--panel REGEX ...]

Starts a Prometheus on loopback (config, data and log under DIR, 1 s scrape interval) scraping
TARGET (started before the run is up, so it sees the run from its first step), waits until the run
(process PID) has exited, then evaluates every target expression of
the shipped dashboard's panels whose title matches a --panel regex (read from
deploy/grafana/sc-grpo-dashboard.json, template variables substituted as Grafana does) as a range
query over the time the target was up, and fails unless each returns data. Prometheus is stopped
before it exits. The machinery (Prometheus wrapper, dashboard reading, Grafana substitution) is
tests/helpers/prometheus.py's (shared with tests/integration/test_prometheus.py).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root: tests.helpers imports from there
from tests.helpers import prometheus as tp  # noqa: E402


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by the script) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="host:port of the run's metrics endpoint")
    ap.add_argument("--pid", type=int, required=True, help="the run's process: query once it has exited")
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--panel", action="append", required=True, help="regex of dashboard panel titles to query")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--min-steps", type=float, default=5, help="steps the scraped trainer version must reach")
    a = ap.parse_args()
    if tp.PROMETHEUS is None:
        print("prom: the prometheus binary is not installed (apt-get install prometheus)", file=sys.stderr)
        return 1
    a.dir.mkdir(parents=True, exist_ok=True)
    host, port = a.target.rsplit(":", 1)
    panels = [(title, t) for title, t in tp.dashboard_targets() if any(re.search(p, title) for p in a.panel)]
    missing = [p for p in a.panel if not any(re.search(p, title) for title, _ in panels)]
    if missing:
        print(f"prom: no dashboard panel title matches {missing}", file=sys.stderr)
        return 1
    if host != "127.0.0.1":
        print(f"prom: the target must be on 127.0.0.1 (metrics.host), not {host}", file=sys.stderr)
        return 1
    with tp.Prometheus(a.dir, int(port)) as prom:
        t0 = time.time()
        deadline = time.monotonic() + a.timeout
        while alive(a.pid):  # polling an external process from a script: fine
            if time.monotonic() > deadline:
                print(f"prom: the run (pid {a.pid}) did not exit within {a.timeout:.0f}s", file=sys.stderr)
                return 1
            time.sleep(1)
        t1 = time.time()
        time.sleep(2)  # the last scrape's samples are queryable
        up = prom.query_range('up{job="sc-grpo"}', t0, t1)
        scrapes = sum(1 for s in up for _, v in s["values"] if v == "1")
        version = prom.query_range("max(sc_grpo_trainer_version)", t0, t1)
        top = max((float(v) for s in version for _, v in s["values"]), default=-1)
        print(f"prom: {scrapes} successful scrapes of {a.target}, trainer version up to {top:.0f}", file=sys.stderr)
        if top < a.min_steps:
            print(
                f"prom: Prometheus saw the trainer version reach only "
                f"{top:.0f} (< {a.min_steps:.0f}): too few scrapes of the run",
                file=sys.stderr,
            )
            return 1
        empty = []
        for title, t in panels:
            expr = tp.grafana_substitute(t["expr"])
            result = prom.query(expr) if t.get("instant") else prom.query_range(expr, t0, t1)
            ok = tp.finite(result)
            print(
                f"prom: {'ok   ' if ok else 'EMPTY'} {title} [{t['refId']}]: {expr} ({len(result)} series)",
                file=sys.stderr,
            )
            if not ok:
                empty.append(f"{title} [{t['refId']}]: {expr}")
    if empty:
        print("prom: dashboard queries without data over the run:\n  " + "\n  ".join(empty), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
