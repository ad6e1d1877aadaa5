"""Prometheus exporter: `ControllerStatistics` -> `/metrics`, read at scrape time.

The only module that imports `prometheus_client`: `families()` turns one statistics record into
metric families (pure), served from a Collector on its own registry. `start_metrics_server` binds
loopback unless told otherwise; `serve_from_config` moves to the next free port when `metrics.port`
is taken. Each scrape runs `stats_fn` on the controller's loop under a deadline, so it sees one
consistent snapshot and a blocked loop shows as failed scrapes. What the pump-wait, idle-ratio and
finished series mean: docs/metrics.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import ipaddress
import logging
import math
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.exposition import start_wsgi_server
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry
from prometheus_client.utils import floatToGoString

from single_controller.config.schema import MetricsConfig
from single_controller.controller import ALGORITHM_METRICS, ControllerStatistics

log = logging.getLogger(__name__)

PREFIX = "sc_grpo_"
STALENESS_BUCKETS = (0, 1, 2, 4, 8)  # policy versions; +Inf is added
BUFFER_STATES = ("reserved", "committed", "ready", "selected", "clearing")
STORAGE_OPS = ("put", "get", "clear")
# Reasons are label values of counters; the known ones are exported at 0 from the start so that
# rate() and the dashboard have a series before the first event. Others appear when they happen.
KNOWN_DROP_REASONS = (
    "generation_failed",
    "reward_failed",
    "env_failed",
    "context_full",
    "zero_variance",
    "stale_in_flight",
    "run_ended",
    "run_failed",
)
KNOWN_EVICT_REASONS = ("stale",)

StatsFn = Callable[[], ControllerStatistics]


# ---------------------------------------------------------------------------------------------
# statistics -> metric families (pure)
def families(s: ControllerStatistics) -> list[Metric]:
    """Every metric the exporter serves, from one statistics record."""
    f = _Families()
    for section in (
        _run_families,
        _pump_families,
        _buffer_families,
        _prompt_families,
        _staleness_families,
        _sync_families,
        _step_families,
        _elastic_families,
        _mismatch_families,
        _algorithm_families,
        _eval_families,
        _storage_families,
    ):
        section(f, s)
    return f.out


class _Families:
    """The metric families of one scrape, in order; `gauge()` and `counter()` add one and return it
    (with `value`: a single sample; without: a family to `add_metric` labelled samples to)."""

    def __init__(self) -> None:
        self.out: list[Metric] = []

    def gauge(
        self, name: str, doc: str, value: float | None = None, labels: Iterable[str] = (), unit: str = ""
    ) -> GaugeMetricFamily:
        fam = GaugeMetricFamily(
            PREFIX + name, doc, value=value, labels=None if value is not None else list(labels), unit=unit
        )
        self.out.append(fam)
        return fam

    def counter(
        self, name: str, doc: str, value: float | None = None, labels: Iterable[str] = (), unit: str = ""
    ) -> CounterMetricFamily:
        fam = CounterMetricFamily(
            PREFIX + name, doc, value=value, labels=None if value is not None else list(labels), unit=unit
        )
        self.out.append(fam)
        return fam


def _run_families(f: _Families, s: ControllerStatistics) -> None:
    """Versions, steps and the run's phase."""
    train = s.pumps.get("train")
    f.gauge(
        "policy_version",
        "Policy version served by the generation workers (bumped by every weight sync).",
        s.policy_version,
    )
    f.gauge("trainer_version", "Optimizer steps completed by the trainer (the next step to train).", s.trainer_version)
    f.counter("steps", "RL steps (optimizer steps) completed.", s.steps)
    f.gauge("admission_open", "1 while new rollouts may be admitted (0 during a weight sync).", float(s.admission_open))
    f.gauge("stopping", "1 once a stop was requested: no new rollouts are dispatched.", float(s.stopping))
    f.gauge(
        "run_finished",
        "1 once the train pump has finished (max_steps, stop or failure).",
        float(bool(train and train.finished)),
    )


def _pump_families(f: _Families, s: ControllerStatistics) -> None:
    """What each pump waits on and for how long, its busy time, iterations and errors; the idle ratios."""
    wait_total = f.counter(
        "pump_wait",
        "Wall seconds each pump spent waiting, by what it waited on.",
        labels=["pump", "on"],
        unit="seconds",
    )
    current = f.gauge(
        "pump_current_wait",
        "Length of the wait in progress (0 on reasons not awaited now).",
        labels=["pump", "on"],
        unit="seconds",
    )
    waiting = f.gauge("pump_waiting", "1 on the reason a pump is waiting on right now.", labels=["pump", "on"])
    busy = f.counter(
        "pump_busy",
        "Seconds each pump spent awaiting workers or storage (rollout: summed over concurrent calls).",
        labels=["pump"],
        unit="seconds",
    )
    iters = f.counter("pump_iterations", "Loop iterations of each pump (rollout: groups dispatched).", labels=["pump"])
    errors = f.counter(
        "pump_errors", "Recovered errors per pump (failed generations, trainer errors).", labels=["pump"]
    )
    finished = f.gauge("pump_finished", "1 once the pump has exited.", labels=["pump"])
    for name, p in sorted(s.pumps.items()):
        for on, secs in sorted(p.wait_s_by_reason.items()):
            now_waiting = p.waiting_on == on
            wait_total.add_metric([name, on], secs)
            current.add_metric([name, on], p.current_wait_s if now_waiting else 0.0)
            waiting.add_metric([name, on], float(now_waiting))
        busy.add_metric([name], p.busy_s)
        iters.add_metric([name], p.iterations)
        errors.add_metric([name], p.errors)
        finished.add_metric([name], float(p.finished))
    f.gauge(
        "trainer_idle_ratio", "Train pump wait / (wait + trainer-call seconds), run to date.", _idle_ratio(s, "train")
    )
    f.gauge(
        "generation_idle_ratio",
        "Rollout dispatcher admission wait / (wait + generation worker-seconds), run to date.",
        _idle_ratio(s, "rollout"),
    )


def _buffer_families(f: _Families, s: ControllerStatistics) -> None:
    """The replay buffer: groups by state, capacity, rollouts in flight, groups by outcome."""
    led = s.ledger
    by_state = f.gauge(
        "buffer_groups", "Resident groups by state (clearing: terminal, rows being cleared).", labels=["state"]
    )
    for state in BUFFER_STATES + tuple(sorted(set(led.by_state) - set(BUFFER_STATES))):
        by_state.add_metric([state], led.by_state.get(state, 0))
    f.gauge("buffer_resident_groups", "Groups holding a capacity slot.", led.resident)
    f.gauge("buffer_capacity_groups", "Capacity of the replay buffer, in groups.", led.capacity)
    age = 0.0 if led.oldest_ready_t is None else max(0.0, s.t - led.oldest_ready_t)
    f.gauge(
        "oldest_ready_group_age",
        "Seconds the oldest ready (trainable, unselected) group has waited; 0 if none.",
        age,
        unit="seconds",
    )
    in_flight = f.gauge(
        "in_flight_groups", "Rollouts in flight by the policy version they started on.", labels=["version"]
    )
    for version, n in sorted(led.in_flight_by_version.items()):
        in_flight.add_metric([str(version)], n)
    if not led.in_flight_by_version:  # a 0 at the served version, not an empty panel, between waves
        in_flight.add_metric([str(s.policy_version)], 0)
    f.counter(
        "groups_dispatched", "Groups dispatched to generation workers (attempts, retries included).", led.reserved_total
    )
    f.counter("groups_trained", "Groups trained.", led.trained_total)
    _by_reason(
        f.counter("groups_dropped", "Groups dropped, by reason.", labels=["reason"]),
        led.dropped_by_reason,
        KNOWN_DROP_REASONS,
    )
    _by_reason(
        f.counter("groups_evicted", "Ready groups evicted before training, by reason.", labels=["reason"]),
        led.evicted_by_reason,
        KNOWN_EVICT_REASONS,
    )
    f.counter(
        "zero_variance_groups", "Groups whose rewards were all equal (no learning signal).", s.zero_variance_groups
    )


def _prompt_families(f: _Families, s: ControllerStatistics) -> None:
    """Prompts taken and how each settled."""
    pr = s.prompts
    f.counter("prompts_taken", "Prompts taken from the dataloader.", pr.taken)
    f.counter("prompts_trained", "Prompts settled as trained.", pr.trained)
    _by_reason(
        f.counter("prompts_dropped", "Prompts settled as dropped (no retry left), by reason.", labels=["reason"]),
        pr.dropped_by_reason,
        KNOWN_DROP_REASONS,
    )
    _by_reason(
        f.counter("prompts_evicted", "Prompts settled as evicted (no retry left), by reason.", labels=["reason"]),
        pr.evicted_by_reason,
        KNOWN_EVICT_REASONS,
    )
    f.counter("prompt_retries", "Generation attempts beyond the first, over all prompts.", pr.retries)


def _staleness_families(f: _Families, s: ControllerStatistics) -> None:
    """The staleness bound and lookahead, and the staleness of the groups trained."""
    sam = s.sampler
    f.gauge(
        "max_staleness_versions",
        "Configured bound: no group trains with staleness above this.",
        sam.max_staleness_versions,
    )
    f.gauge("max_lookahead_versions", "Configured lookahead L of the admission gate.", sam.max_lookahead_versions)
    stale = HistogramMetricFamily(
        PREFIX + "trained_staleness_versions",
        "Staleness (train step - version that started the group) of trained groups, in policy versions.",
        buckets=_cumulative(sam.trained_staleness, STALENESS_BUCKETS),
        sum_value=float(sum(k * n for k, n in sam.trained_staleness.items())),
    )
    f.out.append(stale)
    f.gauge(
        "trained_staleness_max_versions",
        "Largest staleness of any group trained so far (0 before the first).",
        max(sam.trained_staleness, default=0),
    )
    f.counter(
        "stale_in_flight_aborts",
        "In-flight rollouts cancelled at a weight sync because they could only train too stale.",
        sam.aborted_in_flight_total,
    )


def _sync_families(f: _Families, s: ControllerStatistics) -> None:
    """Weight syncs."""
    sy = s.sync
    sync = SummaryMetricFamily(
        PREFIX + "weight_sync_duration_seconds",
        "Weight syncs (close admission, drain, push, bump).",
        count_value=sy.count,
        sum_value=sy.total_s,
    )
    f.out.append(sync)
    f.gauge("weight_sync_last_duration", "Duration of the last weight sync.", sy.last_s, unit="seconds")
    f.gauge(
        "weight_sync_last_drain",
        "Time the last weight sync spent draining in-flight rollouts.",
        sy.last_drain_s,
        unit="seconds",
    )
    f.gauge(
        "weight_sync_last_admission_closed",
        "Time the last weight sync kept admission closed "
        "(with version-gated workers it reopens once the snapshot is sent).",
        sy.last_closed_s,
        unit="seconds",
    )
    f.counter(
        "weight_sync_early_admissions",
        "Weight syncs that reopened admission once the snapshot was sent, "
        "before every worker had applied it (version-gated workers).",
        sy.early_admissions,
    )
    f.gauge("weight_sync_last", "Size of the last weight snapshot.", sy.last_bytes, unit="bytes")


def _step_families(f: _Families, s: ControllerStatistics) -> None:
    """Step times, trainer retries, checkpoints, generation workers, tokens, reward."""
    f.gauge(
        "step_last_duration",
        "Wall time of the last RL step (end of previous step to end of this one).",
        s.last_step_s,
        unit="seconds",
    )
    f.counter("train_step_aborts", "abort_train_step calls after trainer errors.", s.aborted_steps)
    f.counter("train_step_retries", "Train steps re-run after an abort.", s.step_retries)
    f.counter(
        "train_late_finishes",
        "finish_train_step calls that landed after their deadline (recorded result taken, no second step).",
        s.late_finishes,
    )
    f.counter("storage_clear_retries", "Storage clears retried after a deadline or error.", s.storage_retries)
    f.counter("checkpoints", "Checkpoints written.", s.checkpoints_written)
    f.gauge("checkpoint_last_write", "Time the last checkpoint took to write.", s.last_checkpoint_s, unit="seconds")
    f.gauge("generation_workers", "Generation workers configured.", s.generation_workers)
    f.gauge(
        "generation_workers_down", "Generation workers out of routing (dead or restarting).", s.generation_workers_down
    )
    f.counter("generation_worker_deaths", "Generation workers found dead.", s.worker_deaths)
    f.counter("generation_worker_restarts", "Dead generation workers restarted.", s.worker_restarts)
    f.counter(
        "reward_failed_groups",
        "Groups dropped because their reward function raised or gave a non-finite reward.",
        s.reward_failed,
    )
    f.counter(
        "env_failed_groups",
        "Groups dropped because their environment failed (errors or deadlines past env.max_attempts).",
        s.env_failed,
    )
    f.counter(
        "context_full_groups",
        "Groups dropped because an episode's prompt and first observation left no room for a policy token.",
        s.context_full,
    )
    _episode_counters(f, s.env_totals)
    f.counter(
        "tokens_generated", "Response tokens generated (every committed group, trained or not).", s.tokens_generated
    )
    f.counter("tokens_trained", "Prompt + response tokens of trained groups.", s.tokens_trained)
    f.gauge("last_step_reward_mean", "Mean reward of the completions trained in the last step.", s.last_reward_mean)
    f.gauge(
        "last_step_success_rate",
        "Fraction of the last step's completions with reward >= task.success_reward.",
        s.last_success_rate,
    )


# Multi-turn episodes (`env`): the trained episodes' sums (`episode_stats`), as counters.
_EPISODE_COUNTERS = (
    ("episodes", "env_episodes", "Multi-turn episodes trained.", None),
    ("turns", "env_turns", "Policy turns of the episodes trained.", None),
    ("tool_calls", "env_tool_calls", "Tool calls the policy made in the episodes trained.", None),
    ("env_s", "env_wait", "Time the episodes trained waited for their environment.", "seconds"),
    ("policy_tokens", "env_policy_tokens", "Policy (trained) tokens of the episodes trained.", None),
    ("observation_tokens", "env_observation_tokens", "Observation tokens (not trained) of the episodes.", None),
    ("truncated", "env_truncated_episodes", "Episodes that ended at env.max_turns or the model's length.", None),
    ("retries", "env_episode_retries", "Episode attempts started again after an environment failure.", None),
)


def _elastic_families(f: _Families, s: ControllerStatistics) -> None:
    e = s.elastic
    f.gauge(
        "generation_workers_active",
        "Generation workers in routing (neither down nor shrunk).",
        s.generation_workers_active,
    )
    f.gauge(
        "generation_workers_shrunk", "Generation workers shrunk out of the run (shrinking, asleep or waking).", e.shrunk
    )
    f.counter("generation_shrinks", "Generation workers shrunk (out of routing, then asleep).", e.shrinks)
    f.counter(
        "generation_expands", "Generation workers expanded (woken, published weights applied, routed).", e.expands
    )
    f.counter("generation_expand_failures", "Expands that failed (the worker stayed out of routing).", e.failed_expands)
    f.counter("generation_shrink", "Time spent in shrinks.", e.shrink_s, unit="seconds")
    f.counter("generation_expand", "Time spent in expands (wake + weights + check).", e.expand_s, unit="seconds")
    f.gauge(
        "pool_train_slots",
        "Pool slots the run's trainer holds now (0 outside a pool, or between its steps).",
        e.train_slots_held,
    )
    f.counter(
        "generation_preempted_groups",
        "Groups in flight a shrink aborted (re-dispatched uncharged).",
        e.preempted_groups,
    )


def _episode_counters(f: _Families, totals: dict[str, float]) -> None:
    for key, name, doc, unit in _EPISODE_COUNTERS:
        f.counter(name, doc, totals.get(key, 0.0), unit=unit or "")


def _algorithm_families(f: _Families, s: ControllerStatistics) -> None:
    """The last step's loss and completion statistics (NaN before the first step, or when the run
    does not compute one, e.g. `train_kl` without a KL penalty)."""
    for key, doc in ALGORITHM_METRICS.items():
        f.gauge("last_step_" + key.replace("/", "_"), doc, s.algorithm.get(key, math.nan))


def _mismatch_families(f: _Families, s: ControllerStatistics) -> None:
    """Training-inference mismatch."""
    f.gauge(
        "mismatch_kl_bound", "Configured bound on train_mismatch_kl (metrics.mismatch_kl_bound).", s.mismatch_kl_bound
    )
    # NaN until a step trains tokens that were sampled with its own weights (unknown, never "0").
    f.gauge(
        "train_mismatch_kl",
        "KL(generation || trainer) estimate (k3) "
        "on the last measured step's tokens sampled with the trainer's weights.",
        s.mismatch.get("train/mismatch_kl", math.nan),
    )
    f.gauge(
        "train_mismatch_abs_logprob",
        "Mean |trainer logprob - generation logprob| on the same tokens.",
        s.mismatch.get("train/mismatch_abs_logprob", math.nan),
    )


def _eval_families(f: _Families, s: ControllerStatistics) -> None:
    """Held-out evaluation (only when eval is on)."""
    if s.eval is not None:
        ev, last = s.eval, s.eval.last
        f.gauge("eval_in_progress", "1 while an eval round is running.", float(ev.in_progress))
        f.counter("eval_rounds", "Eval points reported (each served entirely by one policy version).", ev.rounds)
        f.counter(
            "eval_failed_rounds", "Eval rounds abandoned after eval.max_retries failures of one request.", ev.failed
        )
        f.counter("eval_requests", "Eval requests issued (re-issues included).", ev.requests)
        f.counter(
            "eval_reissued_requests", "Eval requests re-issued because another policy version served them.", ev.reissued
        )
        f.counter(
            "eval_request_failures",
            "Eval requests that failed (GenerationFailed or deadline) and were re-issued or gave up.",
            ev.request_failures,
        )
        if last is not None:
            k = str(ev.num_samples)
            f.gauge("eval_policy_version", "Policy version of the last eval point.", last.version)
            f.gauge(
                "eval_accuracy",
                "Last eval point: fraction of held-out completions with reward >= task.success_reward.",
                last.metrics["eval/accuracy"],
            )
            f.gauge(
                "eval_reward_mean",
                "Last eval point: mean reward of the held-out completions.",
                last.metrics["eval/reward_mean"],
            )
            f.gauge(
                "eval_pass_at_k",
                "Last eval point: fraction of held-out prompts solved by any of k samples.",
                labels=["k"],
            ).add_metric([k], last.metrics[f"eval/pass@{k}"])
            f.gauge("eval_last_duration", "Wall time of the last eval round.", last.seconds, unit="seconds")
            f.gauge(
                "eval_last_tokens", "Response tokens generated for the last eval point.", last.metrics["eval/tokens"]
            )


def _storage_families(f: _Families, s: ControllerStatistics) -> None:
    """Row-storage calls, rows and bytes."""
    st = s.storage
    ops = f.counter("storage_operations", "Row-storage calls by operation.", labels=["op"])
    for op, n in zip(STORAGE_OPS, (st.puts, st.gets, st.clears)):
        ops.add_metric([op], n)
    rows = f.counter("storage_rows", "Rows written (put) and read (get).", labels=["op"])
    rows.add_metric(["put"], st.rows_put)
    rows.add_metric(["get"], st.rows_read)
    nbytes = f.counter(
        "storage", "Bytes written (put) and read (get) through this client.", labels=["op"], unit="bytes"
    )
    nbytes.add_metric(["put"], st.bytes_put)
    nbytes.add_metric(["get"], st.bytes_read)
    if st.resident_rows >= 0:
        f.gauge("storage_resident_rows", "Rows stored and not yet cleared (as this client knows).", st.resident_rows)


def _idle_ratio(s: ControllerStatistics, pump: str) -> float:
    p = s.pumps.get(pump)
    if p is None:
        return 0.0
    wait = sum(p.wait_s_by_reason.values())
    return wait / (wait + p.busy_s) if wait + p.busy_s > 0 else 0.0


def _by_reason(fam: CounterMetricFamily, counts: dict[str, int], known: Iterable[str]) -> None:
    for reason in sorted(set(known) | set(counts)):
        fam.add_metric([reason], counts.get(reason, 0))


def _cumulative(counts: dict[int, int], bounds: Iterable[int]) -> list[tuple[str, float]]:
    buckets = [(floatToGoString(b), float(sum(n for k, n in counts.items() if k <= b))) for b in bounds]
    return buckets + [("+Inf", float(sum(counts.values())))]


class ControllerCollector:
    """A prometheus_client Collector reading `stats_fn()` once per scrape."""

    def __init__(self, stats_fn: StatsFn):
        self._stats_fn = stats_fn

    def collect(self) -> Iterator[Metric]:
        yield from families(self._stats_fn())

    def describe(self) -> list[Metric]:
        return []  # never call stats_fn at registration (wrong thread, maybe before the run)


# ---------------------------------------------------------------------------------------------
# serving
def on_loop(fn: StatsFn, loop: asyncio.AbstractEventLoop, timeout_s: float) -> StatsFn:
    """`fn` made safe to call from another thread: it runs on `loop` between two awaits.

    Called on the loop's own thread, or once the loop is closed or stopped, `fn` runs directly.
    A loop that does not answer within `timeout_s` raises `TimeoutError` (the scrape fails)."""

    def call() -> ControllerStatistics:
        if loop.is_closed() or not loop.is_running() or _running_loop() is loop:
            return fn()
        fut: concurrent.futures.Future[ControllerStatistics] = concurrent.futures.Future()

        def run() -> None:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # handed to the scrape thread, which raises it
                    fut.set_exception(e)

        loop.call_soon_threadsafe(run)
        try:
            return fut.result(timeout_s)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(
                f"controller event loop did not answer a statistics request within {timeout_s}s"
            ) from None

    return call


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


@dataclass
class MetricsServer:
    """A running `/metrics` endpoint; `stop()` shuts it down and closes its socket."""

    httpd: object  # wsgiref WSGIServer (ThreadingMixIn)
    thread: threading.Thread
    registry: CollectorRegistry

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.httpd.socket.getsockname()[:2]  # type: ignore[attr-defined]
        return host, port

    @property
    def port(self) -> int:
        return self.address[1]

    @property
    def url(self) -> str:
        host, port = self.address
        shown = "127.0.0.1" if host == "0.0.0.0" else f"[{host}]" if ":" in host else host
        return f"http://{shown}:{port}/metrics"

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving (blocks up to one server poll interval; from async code use a thread)."""
        if self.thread.is_alive():
            self.httpd.shutdown()  # type: ignore[attr-defined]
            self.thread.join(timeout_s)
        self.httpd.server_close()  # type: ignore[attr-defined]

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_metrics_server(
    stats_fn: StatsFn,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    loop: asyncio.AbstractEventLoop | None = None,
    timeout_s: float = 5.0,
) -> tuple[MetricsServer, int]:
    """Serve `stats_fn()` as Prometheus metrics on http://host:port/metrics (port 0: any free port).

    `loop`: the event loop that owns the statistics (default: the loop running in this thread, if
    any); each scrape runs `stats_fn` there, waiting at most `timeout_s`."""
    loop = loop if loop is not None else _running_loop()
    fn = on_loop(stats_fn, loop, timeout_s) if loop is not None else stats_fn
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ControllerCollector(fn))
    try:
        httpd, thread = start_wsgi_server(port, addr=host, registry=registry)
    except OSError as e:
        raise OSError(e.errno, f"cannot serve metrics on {host}:{port}: {e.strerror or e}") from e
    server = MetricsServer(httpd, thread, registry)
    bound_host, bound_port = server.address
    if not _is_loopback(bound_host):
        log.warning("metrics endpoint bound to non-loopback address %s:%d (metrics.host)", bound_host, bound_port)
    return server, bound_port


PORT_SEARCH = 16  # metrics.port taken: try the next ports up to port + 15, then any free port


def serve_from_config(
    cfg: MetricsConfig, stats_fn: StatsFn, *, loop: asyncio.AbstractEventLoop | None = None
) -> MetricsServer | None:
    """`start_metrics_server` per `MetricsConfig`; None when metrics are disabled. A taken
    `cfg.port` (another run on this host) is not an error: the next free port up to
    `cfg.port + 15` is used, then any free one; `server.url` is what was actually bound."""
    if not cfg.enabled:
        return None
    candidates = [cfg.port + i for i in range(PORT_SEARCH) if cfg.port + i <= 65535] if cfg.port else []
    for port in [*candidates, 0]:
        try:
            server, _ = start_metrics_server(stats_fn, cfg.host, port, loop=loop)
        except OSError as e:
            if port == 0 or e.errno != errno.EADDRINUSE:
                raise
            continue
        if cfg.port and server.port != cfg.port:
            log.warning("metrics.port %d is taken; serving metrics on %s", cfg.port, server.url)
        else:
            log.info("serving metrics on %s", server.url)
        return server
    raise AssertionError("unreachable: port 0 either binds or raises")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return host == "localhost"


# ---------------------------------------------------------------------------------------------
# reading an exposition back (the `sc-grpo status` command and tests)
@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def parse_metrics(text: str) -> dict[str, list[Sample]]:
    """Samples of a Prometheus text exposition, by sample name (`x_total`, `x_bucket`, ...)."""
    out: dict[str, list[Sample]] = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            out.setdefault(smp.name, []).append(Sample(smp.name, dict(smp.labels), float(smp.value)))
    return out
