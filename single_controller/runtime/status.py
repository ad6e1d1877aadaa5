"""`sc-grpo status`: one compact human summary of a running controller, read from its /metrics.

    sc-grpo status [--url http://127.0.0.1:9464/metrics] [--watch SECONDS] [--timeout SECONDS]

It prints versions, the last step, reward, buffer occupancy, what each pump waits on, staleness, the
last weight sync and eval point, from the scrape alone. Exit status: 0, 1 when the endpoint cannot be
read or is not sc-grpo's (retried with --watch), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import TextIO

from single_controller.runtime.metrics import BUFFER_STATES, Sample, parse_metrics

DEFAULT_URL = "http://127.0.0.1:9464/metrics"  # MetricsConfig defaults
BAR_WIDTH = 32
STATE_CHARS = {"reserved": "g", "committed": "c", "ready": "r", "selected": "t", "clearing": "x"}
PUMP_ORDER = ("rollout", "advantage", "train", "weight_sync")


class StatusError(RuntimeError):
    """The endpoint could not be read as sc-grpo metrics; the message says why."""


def metrics_url(url: str) -> str:
    """Accept `host:port`, `http://host:port` or a full URL; the path defaults to /metrics."""
    if "://" not in url:
        url = "http://" + url
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise StatusError(f"not an http(s) URL: {url!r}")
    return urllib.parse.urlunsplit(parts._replace(path=parts.path if parts.path not in ("", "/") else "/metrics"))


def fetch(url: str, timeout_s: float) -> dict[str, list[Sample]]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            text = resp.read().decode("utf-8")
    except urllib.error.HTTPError as e:
        raise StatusError(f"{url} answered HTTP {e.code} {e.reason} (the controller may be blocked or failing)") from e
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise StatusError(f"cannot reach {url}: {reason} (is a run with metrics.enabled=true serving there?)") from e
    try:
        samples = parse_metrics(text)
    except ValueError as e:
        raise StatusError(f"{url} did not return Prometheus text format: {e}") from e
    if "sc_grpo_trainer_version" not in samples:
        raise StatusError(f"{url} serves metrics, but no sc_grpo_* ones: not an sc-grpo controller")
    return samples


# ---------------------------------------------------------------------------------------------
def render(m: dict[str, list[Sample]], url: str) -> str:
    """The summary, as lines of text (pure: tested with canned samples)."""
    scrape = _Scrape(m)
    lines = [_phase_line(scrape, url), *_progress_lines(scrape), *_buffer_lines(scrape), *_pump_lines(scrape)]
    lines += _staleness_and_sync_lines(scrape)
    lines += _eval_lines(scrape)
    lines.append(_faults_line(scrape))
    return "\n".join(lines)


class _Scrape:
    """One scrape's samples, read by name: `one(name)` for a single value, `by(name, label)` per label value."""

    def __init__(self, m: dict[str, list[Sample]]):
        self.m = m

    def one(self, name: str, default: float = 0.0) -> float:
        s = self.m.get(name)
        return s[0].value if s else default

    def by(self, name: str, label: str) -> dict[str, float]:
        return {s.labels.get(label, ""): s.value for s in self.m.get(name, [])}

    @property
    def finished(self) -> bool:
        return self.one("sc_grpo_run_finished") >= 1


def _phase_line(sc: _Scrape, url: str) -> str:
    phase = "finished" if sc.finished else "stopping" if sc.one("sc_grpo_stopping") >= 1 else "running"
    if not sc.finished and sc.one("sc_grpo_admission_open", 1.0) < 1:
        phase += " (weight sync: admission closed)"
    return f"sc-grpo  {url}  {phase}"


def _progress_lines(sc: _Scrape) -> list[str]:
    one = sc.one
    last_step = _secs(one("sc_grpo_step_last_duration_seconds")) if one("sc_grpo_steps_total") else "-"
    return [
        f"versions  policy v{one('sc_grpo_policy_version'):.0f}  trainer v{one('sc_grpo_trainer_version'):.0f}"
        f"   steps {one('sc_grpo_steps_total'):.0f}   last step " + last_step,
        f"reward    mean {one('sc_grpo_last_step_reward_mean'):.3f}"
        f"   success {100 * one('sc_grpo_last_step_success_rate'):.1f}%"
        f"   tokens generated {one('sc_grpo_tokens_generated_total'):.0f}"
        f"  trained {one('sc_grpo_tokens_trained_total'):.0f}",
    ]


def _buffer_lines(sc: _Scrape) -> list[str]:
    states = sc.by("sc_grpo_buffer_groups", "state")
    resident, capacity = sc.one("sc_grpo_buffer_resident_groups"), sc.one("sc_grpo_buffer_capacity_groups")
    counts = "  ".join(f"{s} {states.get(s, 0):.0f}" for s in BUFFER_STATES)
    in_flight = sorted(((int(v), n) for v, n in sc.by("sc_grpo_in_flight_groups", "version").items() if n > 0))
    flight = "  ".join(f"v{v}: {n:.0f}" for v, n in in_flight) or "none"
    oldest = _secs(sc.one("sc_grpo_oldest_ready_group_age_seconds"))
    return [
        f"buffer    [{_bar(states, capacity)}] {resident:.0f}/{capacity:.0f}  " + counts,
        "          " + "  ".join(f"{c}={s}" for s, c in STATE_CHARS.items()) + "  .=free",
        f"in flight {flight}   oldest ready group {oldest}",
    ]


def _pump_lines(sc: _Scrape) -> list[str]:
    m = sc.m
    current = {(s.labels["pump"], s.labels["on"]): s.value for s in m.get("sc_grpo_pump_current_wait_seconds", [])}
    waiting_on = {s.labels["pump"]: s.labels["on"] for s in m.get("sc_grpo_pump_waiting", []) if s.value >= 1}
    done = sc.by("sc_grpo_pump_finished", "pump")
    errors = sc.by("sc_grpo_pump_errors_total", "pump")
    pumps = [p for p in PUMP_ORDER if p in done] + sorted(set(done) - set(PUMP_ORDER))
    lines = []
    for i, pump in enumerate(pumps):
        if done.get(pump, 0) >= 1:
            doing = "finished"
        elif pump in waiting_on:
            on = waiting_on[pump]
            doing = f"waiting on {on} for {_secs(current.get((pump, on), 0.0))}"
        elif sc.finished:
            doing = "idle (run finished)"
        elif pump == "eval" and sc.one("sc_grpo_eval_in_progress") < 1:
            doing = "idle (next round not due)"
        else:
            doing = "busy"
        err = f"  ({errors[pump]:.0f} errors)" if errors.get(pump, 0) > 0 else ""
        lines.append(f"{'pumps' if i == 0 else '':<10}{pump:<12} {doing}{err}")
    trainer_idle, generation_idle = sc.one("sc_grpo_trainer_idle_ratio"), sc.one("sc_grpo_generation_idle_ratio")
    lines.append(f"idle      trainer {100 * trainer_idle:.0f}%   generation {100 * generation_idle:.0f}%")
    return lines


def _staleness_and_sync_lines(sc: _Scrape) -> list[str]:
    one = sc.one
    staleness = (
        f"staleness {_staleness(sc.m.get('sc_grpo_trained_staleness_versions_bucket', []))}"
        f"   max {one('sc_grpo_trained_staleness_max_versions'):.0f}"
        f" (bound {one('sc_grpo_max_staleness_versions'):.0f},"
        f" lookahead {one('sc_grpo_max_lookahead_versions'):.0f})"
    )
    syncs = one("sc_grpo_weight_sync_duration_seconds_count")
    if not syncs:
        return [staleness, "sync      no weight sync yet"]
    avg = one("sc_grpo_weight_sync_duration_seconds_sum") / syncs
    sync = (
        f"sync      {syncs:.0f} syncs   last {_secs(one('sc_grpo_weight_sync_last_duration_seconds'))}"
        f" (drain {_secs(one('sc_grpo_weight_sync_last_drain_seconds'))})   mean {_secs(avg)}"
    )
    return [staleness, sync]


def _eval_lines(sc: _Scrape) -> list[str]:
    if "sc_grpo_eval_rounds_total" not in sc.m:
        return []
    one = sc.one
    k = next(iter(sc.by("sc_grpo_eval_pass_at_k", "k")), None)
    last = (
        f"v{one('sc_grpo_eval_policy_version'):.0f} accuracy {100 * one('sc_grpo_eval_accuracy'):.1f}%"
        f"  pass@{k} {100 * one('sc_grpo_eval_pass_at_k'):.1f}%  reward {one('sc_grpo_eval_reward_mean'):.3f}"
        f"  ({_secs(one('sc_grpo_eval_last_duration_seconds'))})"
        if k is not None
        else "no point yet"
    )
    reissued, failed = one("sc_grpo_eval_reissued_requests_total"), one("sc_grpo_eval_failed_rounds_total")
    extra = f"   {reissued:.0f} re-issued" if reissued else ""
    extra += f"   {failed:.0f} rounds failed" if failed else ""
    return [f"eval      {last}   {one('sc_grpo_eval_rounds_total'):.0f} points{extra}"]


def _faults_line(sc: _Scrape) -> str:
    faults = [
        _reasons("dropped", sc.by("sc_grpo_groups_dropped_total", "reason")),
        _reasons("evicted", sc.by("sc_grpo_groups_evicted_total", "reason")),
    ]
    counts = {
        "retries": sc.one("sc_grpo_prompt_retries_total"),
        "step retries": sc.one("sc_grpo_train_step_retries_total"),
        "step aborts": sc.one("sc_grpo_train_step_aborts_total"),
        "stale aborts": sc.one("sc_grpo_stale_in_flight_aborts_total"),
    }
    faults += [f"{k} {v:.0f}" for k, v in counts.items() if v > 0]
    return "faults    " + ("   ".join(f for f in faults if f) or "none")


def _secs(s: float) -> str:
    if s >= 120:
        return f"{s / 60:.1f}m"
    return f"{s:.1f}s" if s >= 10 else f"{s:.2f}s" if s >= 0.1 else f"{s * 1000:.1f}ms"


def _bar(states: dict[str, float], capacity: float) -> str:
    if capacity <= 0:
        return "?" * BAR_WIDTH
    cells: list[str] = []
    for state, ch in STATE_CHARS.items():
        cells += [ch] * round(states.get(state, 0) / capacity * BAR_WIDTH)
    return "".join(cells)[:BAR_WIDTH].ljust(BAR_WIDTH, ".")


def _staleness(buckets: list[Sample]) -> str:
    """Per-bucket counts of the cumulative histogram, e.g. `0:200 1:184 2:0 3-4:0 5-8:0 >8:0`."""
    cum = sorted(((float(b.labels["le"]), b.value) for b in buckets), key=lambda x: x[0])
    if not cum or cum[-1][1] == 0:
        return "no group trained yet"
    parts, lo, prev = [], 0, 0.0
    for le, n in cum:
        name = f">{lo - 1}" if le == float("inf") else f"{lo}" if int(le) == lo else f"{lo}-{int(le)}"
        parts.append(f"{name}:{n - prev:.0f}")
        prev = n
        lo = int(le) + 1 if le != float("inf") else lo
    return f"{cum[-1][1]:.0f} groups trained, by versions behind: " + " ".join(parts)


def _reasons(what: str, counts: dict[str, float]) -> str:
    nonzero = {r: n for r, n in sorted(counts.items()) if n > 0}
    return f"{what} " + ", ".join(f"{r} {n:.0f}" for r, n in nonzero.items()) if nonzero else ""


# ---------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    ap = argparse.ArgumentParser(
        prog="sc-grpo status", description="Summarize a running sc-grpo controller from its metrics endpoint."
    )
    ap.add_argument("--url", default=DEFAULT_URL, help=f"metrics endpoint (default {DEFAULT_URL}; host:port is enough)")
    ap.add_argument("--watch", type=float, metavar="SECONDS", help="refresh every SECONDS until Ctrl-C")
    ap.add_argument(
        "--timeout", type=float, default=3.0, metavar="SECONDS", help="HTTP timeout of one fetch (default 3)"
    )
    args = ap.parse_args(argv)
    if args.watch is not None and args.watch <= 0:
        ap.error("--watch needs a positive number of seconds")
    try:
        url = metrics_url(args.url)
    except StatusError as e:
        print(f"sc-grpo status: {e}", file=sys.stderr)
        return 2
    if args.watch is None:
        try:
            print(render(fetch(url, args.timeout), url), file=out)
        except StatusError as e:
            print(f"sc-grpo status: {e}", file=sys.stderr)
            return 1
        return 0
    clear = "\033[H\033[J" if out.isatty() else ""
    try:
        while True:
            try:
                text = render(fetch(url, args.timeout), url)
            except StatusError as e:
                text = f"sc-grpo status: {e}"
            print(
                f"{clear}{time.strftime('%H:%M:%S')}  (every {args.watch:g}s, Ctrl-C to quit)\n{text}",
                file=out,
                flush=True,
            )
            time.sleep(args.watch)  # a synchronous CLI: sleeping here blocks nothing else
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
