"""`sc-grpo run`: from a validated config to a finished run directory.

Ray backends: start (or attach to) Ray, start the controller as a CPU-only actor (it starts
TransferQueue and the workers), stream one record per step into the run directory, the console and
the `run.loggers`, save the final policy, and tear everything down on success, error and Ctrl-C;
`sim` backends run the same controller in-process. Every exit writes `metrics.jsonl`, `summary.json`
and `prompt_ledger.json`, and a failure `error.log` beside one paragraph on the console. The first
SIGTERM / SIGINT stops on the last finished step with a checkpoint (exit 130); a second, or 25 s
without an exit, forces it. `resume_dir` continues a run directory. Exit codes: 0, 1 failed, 130.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from single_controller import startup_trace
from single_controller.config.problems import ConfigError, Problem
from single_controller.config.schema import Config, prompts_from_data
from single_controller.errors import error_text
from single_controller.runtime.console import ConsoleReporter, say
from single_controller.runtime.loggers import RecordLoggers, sample_of, sample_text
from single_controller.runtime.logs import RUN_LOG, line_logger, run_log
from single_controller.runtime.records import STEP_KEY, is_eval_record
from single_controller.runtime.run_dir import RunDirectory

log = logging.getLogger(__name__)
step_lines, sample_lines, driver_lines = line_logger("steps"), line_logger("samples"), line_logger("driver")

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130

# After a step's record, the driver's next call waits this long for the records behind it: a few
# steps per call instead of one actor call per step (~20 a second in the embedded run, each one
# CPU time in the driver, in Ray and in the controller's event loop, on a machine the run keeps busy).
RECORDS_LINGER_S = 0.25


def run_from_config(cfg: Config, resume_dir: str | None = None) -> int:
    """Raises `ConfigError` (before anything starts) when this machine cannot run `cfg`."""
    from single_controller.preflight.environment import with_cached_model
    from single_controller.preflight.loader import check_environment

    cfg = with_cached_model(cfg)
    check_environment(cfg)
    if cfg.pool.enabled and not cfg.pool.attach:
        raise ConfigError(
            [
                Problem(
                    ("pool.enabled", "pool.attach"),
                    "pool.enabled=true: a run joins a pool that `sc-grpo pool run POOL.yaml` starts with it, or one "
                    "`sc-grpo pool serve` serves on the cluster (then pool.attach=true and ray.address)",
                )
            ]
        )
    # Libraries' progress bars (Hugging Face's "Writing model shards", "Loading weights") are not
    # sc-grpo's lines: off here and in the Ray processes started from here (read at their import).
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if cfg.backend.generation != "sim":
        from single_controller.runtime.ray_session import check_ray_address

        check_ray_address(cfg.ray.address)  # before a run directory exists for a run that cannot start
    if cfg.model.path is not None and cfg.model.create:
        from single_controller.data.hf_model import prepare_model_dir

        if prepare_model_dir(cfg.model, cfg.seed, data_files=prompts_from_data(cfg)):
            say(f"wrote a random-init model to {cfg.model.path}")
    code, run_path = _run_once(cfg, resume_dir)
    for attempt in range(1, cfg.run.auto_resume + 1):
        why = _healable_failure(run_path) if code == EXIT_FAILED else None
        if why is None:
            break
        with run_log(Path(run_path) / RUN_LOG):
            say(f"auto-resume {attempt}/{cfg.run.auto_resume}: {why}; starting again from the newest checkpoint")
        code, _ = _run_once(cfg, run_path)
    return code


# Failures a restart from the newest checkpoint heals (`run.auto_resume`): the trainer's process or
# state is gone, the ledger and the checkpoint are not.
HEALABLE = ("TrainerRankDied", "TrainerStateLost")


def _healable_failure(run_path: str) -> str | None:
    """What failed the run in `run_path` (its summary.json), when a resume heals it and a checkpoint exists."""
    import json

    from single_controller.checkpoint import CheckpointError, latest_checkpoint

    summary = json.loads((Path(run_path) / "summary.json").read_text(encoding="utf-8"))
    failure = summary.get("failure") or {}
    if failure.get("type") not in HEALABLE:
        return None
    try:
        latest_checkpoint(run_path)
    except CheckpointError:
        return None
    return str(failure["error"]).split("\n", 1)[0]


def _run_once(cfg: Config, resume_dir: str | None) -> tuple[int, str]:
    """One drive of the run (a new run directory, or `resume_dir` resumed from its newest
    checkpoint): its exit code and its run directory."""
    t_start = time.perf_counter()
    startup_trace.mark("driver", "config loaded")
    run_dir, opened = _open_run_dir(cfg, resume_dir)
    with run_log(run_dir.path / RUN_LOG):
        say(opened)
        try:
            if cfg.backend.generation == "sim":  # then the trainer is sim too (config validation)
                from single_controller.runtime.ray_session import new_event_loop

                with asyncio.Runner(loop_factory=new_event_loop) as runner:
                    code = runner.run(_drive_local(cfg, run_dir, t_start, resume_dir is not None))
            else:
                code = _run_on_ray(cfg, run_dir, t_start, resume_dir is not None)
        except KeyboardInterrupt:
            say("interrupted; everything was shut down", err=True)
            code = EXIT_INTERRUPTED
        finally:
            run_dir.close()
    return code, str(run_dir.path)


def _open_run_dir(cfg: Config, resume_dir: str | None) -> tuple[RunDirectory, str]:
    """A new run directory, or `resume_dir` reopened at its newest checkpoint (checked first); and
    the console line that says which."""
    if resume_dir is None:
        run_dir = RunDirectory.create(cfg)
        return run_dir, f"run directory {run_dir.path}"
    from single_controller.checkpoint import latest_checkpoint, read_controller_state

    step = _check_resumable(cfg, resume_dir)  # before anything starts
    recovered = read_controller_state(latest_checkpoint(resume_dir)).get("records", [])
    run_dir = RunDirectory.reopen(resume_dir, cfg, from_step=step, recovered=recovered)
    return run_dir, f"resuming {run_dir.path} from the checkpoint of step {step}"


def _check_resumable(cfg: Config, resume_dir: str) -> int:
    from single_controller.checkpoint import check_compatible, latest_checkpoint, read_controller_state

    path = latest_checkpoint(resume_dir)
    saved = read_controller_state(path)
    check_compatible(saved, cfg, path)
    return int(saved["step"])


def _run_on_ray(cfg: Config, run_dir: RunDirectory, t_start: float, resume: bool) -> int:
    from single_controller.backends.common.colocation import (
        TURNS_ENV,
        colocated_on_gpu,
        threads_per_process,
        turns_path,
    )
    from single_controller.backends.common.worker_logs import LOG_DIR_ENV
    from single_controller.runtime.ray_session import ray_session, worker_env

    # Logical CPUs: TQ takes 1 + storage units; workers and the controller ask for none, so this
    # never oversubscribes the real cores (one torch thread per worker process does that job).
    min_cpus = 1 + cfg.storage.num_storage_units + 1
    # One Ray namespace per run: runs sharing a cluster never collide on actor names.
    namespace = f"sc-grpo-{run_dir.run_id}"
    # Every Ray process of the run writes its output to its own file under logs/, not to this console.
    env = {**worker_env(threads_per_process(cfg.backend)), LOG_DIR_ENV: str(run_dir.logs_path.resolve())}
    if os.environ.get(startup_trace.TRACE_ENV):  # `sc-grpo bench startup`: every process marks its start-up
        env[startup_trace.TRACE_ENV] = os.environ[startup_trace.TRACE_ENV]
    if cfg.backend.colocate and not colocated_on_gpu(cfg):  # on the CPU: compute turns at one lock per node
        env[TURNS_ENV] = turns_path(run_dir.run_id)
    try:
        with ray_session(cfg.ray, min_cpus=min_cpus, env_vars=env, namespace=namespace, log_to_driver=False) as session:
            startup_trace.mark("driver", "ray up")
            say(f"ray {time.perf_counter() - t_start:.1f}s; worker logs in {run_dir.logs_path}")
            # TransferQueue is started by the controller actor, beside the workers' own start-up.
            return session.run(_drive_actor(cfg, run_dir, t_start, resume, session))
    finally:
        if TURNS_ENV in env:  # this node's lock file (other nodes' stay in their temporary directories)
            with contextlib.suppress(OSError):
                os.remove(env[TURNS_ENV])


async def _drive_actor(cfg: Config, run_dir: RunDirectory, t_start: float, resume: bool, session: Any) -> int:
    import ray

    from single_controller.runtime.actor_host import ControllerHost

    actor_cls = ray.remote(num_cpus=0, num_gpus=0)(ControllerHost)
    actor = actor_cls.options(name="sc-grpo-controller", max_concurrency=64, **_on_this_node()).remote(
        cfg, str(run_dir.path.resolve()), resume, run_dir.run_id, run_dir.wall_offset_s
    )

    async def call(method: str, *args: Any) -> Any:
        return await getattr(actor, method).remote(*args)

    try:
        return await _drive(cfg, run_dir, t_start, call, lambda stop: session.on_interrupt(stop))
    finally:
        ray.kill(actor)  # type: ignore[arg-type]  # Ray types ActorClass.remote() as handle | class


def _on_this_node() -> dict:
    """Scheduling options that keep the controller on the driver's node: the metrics URL printed
    here (loopback by default) is then the one that serves, and the run directory is local to it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    try:
        node_id = ray.get_runtime_context().get_node_id()
    except Exception:  # a Ray client driver (ray://) is on no node: let Ray choose
        return {}
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)}


async def _drive_local(cfg: Config, run_dir: RunDirectory, t_start: float, resume: bool) -> int:
    from single_controller.runtime.actor_host import ControllerHost

    host = ControllerHost(cfg, str(run_dir.path.resolve()), resume, run_dir.run_id, run_dir.wall_offset_s)

    async def call(method: str, *args: Any) -> Any:
        return await getattr(host, method)(*args)

    def on_interrupt(stop: Callable[[str], None]) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop, signal.Signals(sig).name)

    return await _drive(cfg, run_dir, t_start, call, on_interrupt)


async def _drive(
    cfg: Config,
    run_dir: RunDirectory,
    t_start: float,
    call: Callable[..., Awaitable[Any]],
    on_interrupt: Callable[[Callable[[str], None]], None],
    label: str | None = None,
) -> int:
    """Setup, run while streaming records, write the records, close: the same for an actor or
    in-process. `label`: each console line of the run starts with it (runs of a pool share a console)."""
    # the loggers start before the controller's setup (W&B's takes a second or two)
    drive = _Drive(cfg, run_dir, t_start, call, RecordLoggers.open(cfg, run_dir), label)
    on_interrupt(drive.stop)
    try:
        await drive.run()
    except Exception as e:
        drive.failed(e)
    finally:
        await _write_records(cfg, run_dir, call, drive.summary, t_start, drive.t_ready)
        if drive.summary["failure"] is None and cfg.run.plot:
            # rendered while the controller closes and Ray shuts down; run_dir.close() waits for it
            run_dir.start_plot()
        await drive.close()
    return drive.exit_code()


class _Drive:
    """One drive of a `ControllerHost` through `call(method, *args)`: its summary as it stands, the
    interrupts received, and the console lines of each stage."""

    def __init__(
        self,
        cfg: Config,
        run_dir: RunDirectory,
        t_start: float,
        call: Callable[..., Awaitable[Any]],
        loggers: RecordLoggers,
        label: str | None = None,
    ):
        self.cfg, self.run_dir, self.t_start, self.call, self.loggers = cfg, run_dir, t_start, call, loggers
        self.prefix = f"[{label}] " if label else ""
        self.summary: dict[str, Any] = {"steps": 0, "stop_reason": "did not start", "failure": None, "checkpoint": None}
        self.t_ready: float | None = None
        self.interrupted: list[str] = []
        self._stop_requests: set[asyncio.Task] = set()

    def stop(self, name: str) -> None:
        """An interrupt (on the loop's thread): the run stops on its last finished step."""
        self.interrupted.append(name)
        say(f"{self.prefix}{name}: stopping on the last finished step and checkpointing it", err=True)
        task = asyncio.ensure_future(self.call("request_stop", f"interrupted ({name})"))
        self._stop_requests.add(task)
        task.add_done_callback(self._stop_requests.discard)

    async def run(self) -> None:
        await self._setup()
        self.summary = await self._train()
        if self.summary["failure"] is None:
            # the final policy, loadable as model.checkpoint
            self.summary["policy"] = await self.call("save_checkpoint", str(self.run_dir.path / "checkpoint"))
            assert self.t_ready is not None  # set by `_setup`
            startup_s = self.t_ready - self.t_start
            say(
                f"{self.prefix}{self.summary['steps']} steps in {self.summary['wall_s']:.1f}s of training "
                f"(+{startup_s:.1f}s startup): {self.summary['stop_reason']}"
            )

    async def _setup(self) -> None:
        from single_controller.deadlines import within

        what = "controller setup (storage, workers, metrics)"
        info = await within(self.call("setup"), self.cfg.timeouts.setup_s, what)
        self.t_ready = time.perf_counter()
        startup_trace.mark("driver", "ready")
        if info.get("metrics_url"):
            say(f"{self.prefix}metrics on {info['metrics_url']}")
        parts = ", ".join(f"{k[:-2]} {v:.1f}s" for k, v in info.items() if k.endswith("_s"))
        say(f"{self.prefix}started in {self.t_ready - self.t_start:.1f}s{f' ({parts})' if parts else ''}; training")
        if self.interrupted:  # a signal during start-up
            await self.call("request_stop", f"interrupted ({self.interrupted[0]})")

    async def _train(self) -> dict[str, Any]:
        """The run, its records streamed to metrics.jsonl and the console as they come; its summary."""
        run = asyncio.ensure_future(self.call("run"))
        t_run = time.perf_counter() - self.t_start
        reporter = ConsoleReporter(self.cfg, prefix=self.prefix)
        cursor = 0
        try:
            finished = False
            while not finished:
                records, finished = await self.call("next_records", cursor, RECORDS_LINGER_S)
                log.debug("%d record(s) from %d%s", len(records), cursor, ", the run has finished" if finished else "")
                cursor += len(records)
                for rec in records:
                    self._record(rec, t_run, reporter)
            return await run
        except BaseException:
            run.cancel()
            raise
        finally:
            reporter.close()

    def _record(self, rec: dict[str, Any], t_run: float, reporter: ConsoleReporter) -> None:
        # The controller's clock starts as the run starts, at the run's wall clock so far (a resumed
        # run's records continue it); records arrive in batches.
        if "time/wall_s" in rec:
            since = t_run + rec["time/wall_s"] - self.run_dir.wall_offset_s
        else:
            since = time.perf_counter() - self.t_start
        rec = {**rec, "time/since_launch_s": since}
        self.run_dir.append_metrics(rec)
        step_lines.info((reporter.eval if is_eval_record(rec) else reporter.step)(rec))
        sample = sample_of(rec)
        if sample is not None:  # run.log only: the console stays one line a step
            sample_lines.info(sample_text(rec.get(STEP_KEY), sample))
        self.loggers.log(rec)

    def failed(self, e: Exception) -> None:
        error = error_text(e)
        failure = {"pump": None, "error": error, "traceback": "".join(traceback.format_exception(e))}
        self.summary = {**self.summary, "stop_reason": f"failed: {error.split(': ', 1)[-1]}", "failure": failure}

    async def close(self) -> None:
        from single_controller.deadlines import within

        t0 = time.perf_counter()
        try:
            await within(self.call("close"), 60, "controller close")
            log.info("controller closed in %.1fs", time.perf_counter() - t0)
        except Exception as e:
            say(f"{self.prefix}close failed: {e}", err=True)
        finally:
            self.loggers.close()

    def exit_code(self) -> int:
        if self.summary["failure"] is not None:
            _print_failure(self.run_dir, self.summary)
            return EXIT_FAILED
        if self.interrupted:
            ck = self.summary.get("checkpoint")
            where = f"; checkpoint of step {ck['step']} in {ck['path']}" if ck else ""
            resume = f"sc-grpo run --resume {self.run_dir.path}"
            say(f"{self.prefix}interrupted by {self.interrupted[0]}{where}; resume with: {resume}", err=True)
            return EXIT_INTERRUPTED
        return EXIT_OK


async def _write_records(
    cfg: Config,
    run_dir: RunDirectory,
    call: Callable[..., Awaitable[Any]],
    summary: dict,
    t_start: float,
    t_ready: float | None,
) -> None:
    """summary.json, prompt_ledger.json and (on failure) error.log, whatever happened."""
    from single_controller.deadlines import within

    failure = summary.get("failure")
    if failure is not None:
        (Path(run_dir.path) / "error.log").write_text(
            f"{failure.get('pump') or 'run'}: {failure['error']}\n\n{failure.get('traceback', '')}", encoding="utf-8"
        )
    record = {k: v for k, v in summary.items() if k != "failure"}
    if failure is not None:
        record["failure"] = {"pump": failure.get("pump"), "type": failure.get("type"), "error": failure["error"]}
    record["startup_s"] = (t_ready - t_start) if t_ready is not None else None
    record["command_s"] = time.perf_counter() - t_start
    try:
        # streamed by the controller's host into the run directory (local to it): a long run's
        # ledger is never one value in memory or on the wire
        path = str(Path(run_dir.path) / "prompt_ledger.json")
        await within(call("write_prompt_ledger", path), cfg.timeouts.checkpoint_s, "writing prompt_ledger.json")
    except Exception as e:
        record["prompt_ledger_error"] = f"{type(e).__name__}: {e}"
    run_dir.write_json("summary.json", record)


def _print_failure(run_dir: RunDirectory, summary: dict) -> None:
    f = summary["failure"]
    where = f" in the {f['pump']} pump" if f.get("pump") else ""
    ck = summary.get("checkpoint")
    lines = [f"sc-grpo: run failed{where} after {summary['steps']} steps: {f['error']}"]
    if ck:
        lines.append(f"  last checkpoint: {ck['path']} (step {ck['step']})")
        lines.append(f"  resume with:     sc-grpo run --resume {run_dir.path}")
    else:
        lines.append("  no checkpoint was written; the run cannot be resumed")
    lines.append(f"  full traceback:  {Path(run_dir.path) / 'error.log'}")
    if run_dir.logs_path.is_dir():
        lines.append(f"  worker logs:     {run_dir.logs_path}")
    print("\n".join(lines), file=sys.stderr, flush=True)
    driver_lines.error("\n".join(lines))
