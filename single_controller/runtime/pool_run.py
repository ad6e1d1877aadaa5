"""`sc-grpo pool run POOL.yaml` and `sc-grpo pool serve`: several runs time-sharing one pool of slots.

`pool run` checks everything first (each run's config with `pool.enabled=true`, distinct names, slots
inside the pool, the pool inside the machine), then starts one local Ray, one TransferQueue, the pool
actor and one controller per run, and drives the runs side by side; each writes its own run directory
and the pool's gets `pool_summary.json` (exit codes, statistics, slot timeline). `pool serve` runs the
pool actor on a cluster for runs started with `pool.attach=true`. POOL.yaml: docs/pool.md. Exit
codes: 0, 1 a run failed, 2 a bad POOL.yaml or config, 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from single_controller.config.problems import ConfigError, Problem
from single_controller.config.schema import Config
from single_controller.pool.planner import POLICIES
from single_controller.runtime.console import say

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
POOL_KEYS = ("slots", "policy", "name", "output_dir", "runs")


@dataclass(frozen=True)
class PoolSpec:
    slots: int
    policy: str
    name: str
    output_dir: str
    runs: tuple[Config, ...]
    resumes: tuple[str | None, ...] = ()  # per run: the run directory it resumes, if it does

    def resume_of(self, cfg: Config) -> str | None:
        return dict(zip((c.run.name for c in self.runs), self.resumes)).get(cfg.run.name)


def load_pool(path: str | os.PathLike) -> PoolSpec:
    """POOL.yaml and its runs' configs, checked together; `ConfigError` lists every problem."""
    import yaml

    from single_controller.preflight.environment import with_cached_model
    from single_controller.preflight.loader import load_config

    problems: list[str] = []
    raw = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    if not isinstance(raw, dict):
        keys = ", ".join(POOL_KEYS)
        raise ConfigError([Problem(("pool",), f"a pool file is a mapping with the keys {keys}")], f"pool {path}")
    problems += [f"unknown key {k!r} (known: {', '.join(POOL_KEYS)})" for k in raw if k not in POOL_KEYS]
    slots, policy = raw.get("slots", 2), raw.get("policy", "gap_ratio")
    name, output_dir = str(raw.get("name", "sc-grpo-pool")), str(raw.get("output_dir", "runs"))
    if not isinstance(slots, int) or slots < 1:
        problems.append(f"slots: a positive whole number, got {slots!r}")
        slots = 0
    if policy not in POLICIES:
        problems.append(f"policy: one of {', '.join(POLICIES)}, got {policy!r}")
    runs: list[Config] = []
    resumes: list[str | None] = []
    for i, entry in enumerate(raw.get("runs") or ()):
        if not isinstance(entry, dict) or ("config" in entry) == ("resume" in entry):
            problems.append(
                f"runs[{i}]: a mapping with `config` (a path) or `resume` (a run directory), and optional "
                "`overrides` (a list)"
            )
            continue
        forced = ["pool.enabled=true", f"pool.name={name}", "run.progress_bar=false"]
        overrides = [*map(str, entry.get("overrides") or ()), *forced]
        try:
            if "resume" in entry:
                runs.append(_resumed(str(entry["resume"]), overrides))
            else:
                runs.append(with_cached_model(load_config(entry["config"], overrides)))
            resumes.append(entry.get("resume"))
        except (ConfigError, OSError) as e:
            problems.append(f"runs[{i}] ({entry.get('config') or entry['resume']}): {e}")
    if not runs and not problems:
        problems.append("runs: at least one run")
    problems += _pool_problems(slots, runs)
    if problems:
        raise ConfigError([Problem(("pool",), p) for p in problems], origin=f"pool {path}")
    return PoolSpec(slots, policy, name, output_dir, tuple(runs), tuple(resumes))


def _resumed(run_dir: str, overrides: list[str]) -> Config:
    """The config a resume of `run_dir` runs with (`sc-grpo run --resume`), checked against its newest checkpoint."""
    from single_controller.checkpoint import CheckpointError, check_compatible, latest_checkpoint, read_controller_state
    from single_controller.runtime.run_dir import resume_config

    cfg = resume_config(run_dir, overrides)
    try:
        path = latest_checkpoint(run_dir)
        check_compatible(read_controller_state(path), cfg, path)
    except CheckpointError as e:
        raise ConfigError([Problem(("resume",), str(e))], f"resume {run_dir}") from e
    return cfg


def _pool_problems(slots: int, runs: Sequence[Config]) -> list[str]:
    problems = []
    names = [c.run.name for c in runs]
    problems += [
        f"two runs are named {n!r} (run.name names a run in the pool)" for n in sorted(set(names)) if names.count(n) > 1
    ]
    for c in runs:
        outside = sorted(s for s in {*c.pool.gen_slots, *c.pool.train_slots} if s >= slots)
        if slots and outside:
            problems.append(f"run {c.run.name}: slots {outside} are outside the pool's 0..{slots - 1}")
    if len({c.backend.generation == "sim" for c in runs}) > 1:
        problems.append("the runs of a pool are all on the sim backend or none is")
    fits = _slots_available(runs)
    if fits is not None and slots > fits[0]:
        problems.append(f"slots: {slots} slots do not fit this machine: it has {fits[0]} {fits[1]}")
    return problems


def _slots_available(runs: Sequence[Config]) -> tuple[int, str] | None:
    """What one slot is on this machine, and how many there are (None: not checked here: the sim
    backend's slots are simulated, an attached cluster's are its own)."""
    if not runs or runs[0].backend.generation == "sim" or runs[0].ray.address is not None:
        return None
    on_gpu = any(c.backend.generation == "vllm" and c.vllm.device != "cpu" for c in runs)
    if on_gpu:
        import torch

        return torch.cuda.device_count(), "GPU(s)"
    return os.cpu_count() or 1, "CPU core(s)"


# -- pool run ------------------------------------------------------------------------------------
def main_run(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="sc-grpo pool run", description=__doc__.split("\n\n")[0])
    p.add_argument("pool", metavar="POOL.yaml")
    args = p.parse_args(list(argv))
    try:
        spec = load_pool(args.pool)
    except (ConfigError, OSError) as e:
        say(str(e), err=True)
        return EXIT_USAGE
    pool_dir = Path(spec.output_dir) / f"pool-{datetime.now():%Y%m%d-%H%M%S}"
    pool_dir.mkdir(parents=True, exist_ok=True)
    names = ", ".join(c.run.name for c in spec.runs)
    say(f"pool of {spec.slots} slot(s), {spec.policy}: {names}; pool directory {pool_dir}")
    t0 = time.perf_counter()
    try:
        if spec.runs[0].backend.generation == "sim":
            codes, summary = asyncio.run(_pool_local(spec))
        else:
            codes, summary = _pool_on_ray(spec)
    except KeyboardInterrupt:
        say("interrupted; everything was shut down", err=True)
        return EXIT_INTERRUPTED
    summary["wall_s"] = time.perf_counter() - t0
    (pool_dir / "pool_summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    say(f"pool done in {summary['wall_s']:.1f}s: " + ", ".join(f"{n} exit {c}" for n, c in codes.items()))
    if any(c == EXIT_INTERRUPTED for c in codes.values()):
        return EXIT_INTERRUPTED
    return EXIT_FAILED if any(codes.values()) else EXIT_OK


async def _drive_runs(spec: PoolSpec, host_of: Callable[[Config, Any], Any], on_interrupt) -> tuple[dict, dict]:
    """Drive every run of `spec` side by side (`runtime.driver._drive`); their exit codes and directories."""
    from single_controller.runtime.driver import _drive
    from single_controller.runtime.run_dir import RunDirectory

    codes: dict[str, int] = {}
    dirs: dict[str, str] = {}

    async def one(cfg: Config) -> None:
        resume = spec.resume_of(cfg)
        if resume is None:
            run_dir = RunDirectory.create(cfg)
            say(f"run {cfg.run.name}: run directory {run_dir.path}")
        else:
            from single_controller.checkpoint import latest_checkpoint, read_controller_state

            saved = read_controller_state(latest_checkpoint(resume))
            run_dir = RunDirectory.reopen(resume, cfg, from_step=saved["step"], recovered=saved.get("records", []))
            say(f"run {cfg.run.name}: resuming {run_dir.path} from the checkpoint of step {saved['step']}")
        dirs[cfg.run.name] = str(run_dir.path)
        call = host_of(cfg, run_dir)
        try:
            codes[cfg.run.name] = await _drive(
                cfg, run_dir, time.perf_counter(), call, on_interrupt, label=cfg.run.name
            )
        finally:
            run_dir.close()

    async with asyncio.TaskGroup() as tg:
        for cfg in spec.runs:
            tg.create_task(one(cfg))
    return codes, dirs


async def _pool_local(spec: PoolSpec) -> tuple[dict, dict]:
    from single_controller.pool.link import InProcessPool
    from single_controller.pool.scheduler import PoolScheduler
    from single_controller.runtime.actor_host import ControllerHost

    scheduler = PoolScheduler(spec.slots, spec.policy)

    def host_of(cfg: Config, run_dir) -> Any:
        resume = spec.resume_of(cfg) is not None
        host = ControllerHost(
            cfg,
            str(run_dir.path.resolve()),
            resume,
            run_dir.run_id,
            run_dir.wall_offset_s,
            pool=InProcessPool(scheduler),
        )

        async def call(method: str, *args: Any) -> Any:
            return await getattr(host, method)(*args)

        return call

    async with asyncio.TaskGroup() as tg:
        serving = tg.create_task(scheduler.serve())
        try:
            codes, dirs = await _drive_runs(spec, host_of, lambda stop: None)
        finally:
            scheduler.close()
    await serving
    return codes, _summary(spec, codes, dirs, scheduler.summary())


def _summary(spec: PoolSpec, codes: dict, dirs: dict, pool: dict) -> dict:
    return {
        "slots": spec.slots,
        "policy": spec.policy,
        "runs": {c.run.name: {"run_dir": dirs.get(c.run.name), "exit_code": codes.get(c.run.name)} for c in spec.runs},
        **pool,
    }


def _pool_on_ray(spec: PoolSpec) -> tuple[dict, dict]:
    import uuid

    from single_controller.backends.common.colocation import threads_per_process
    from single_controller.runtime.ray_session import check_ray_address, ray_session, worker_env

    first = spec.runs[0]
    check_ray_address(first.ray.address)
    # TQ takes 1 + storage units logical CPUs; the controllers and the workers ask for none
    min_cpus = 1 + first.storage.num_storage_units + 1
    env = worker_env(threads_per_process(first.backend))
    namespace = f"sc-grpo-pool-{uuid.uuid4().hex[:8]}"
    with ray_session(first.ray, min_cpus=min_cpus, env_vars=env, namespace=namespace, log_to_driver=False) as session:
        return session.run(_pool_ray_main(spec, session))


async def _pool_ray_main(spec: PoolSpec, session: Any) -> tuple[dict, dict]:
    import contextlib
    from dataclasses import replace

    import ray

    from replay.transferqueue.runtime import start_tq, stop_tq
    from single_controller.pool.actor import NAMESPACE, PoolActor

    first = spec.runs[0]
    await asyncio.to_thread(
        start_tq,
        first.storage.num_storage_units,
        timeout_s=first.timeouts.setup_s,
        one_process=first.storage.tq_one_process,
    )
    actor_cls = ray.remote(num_cpus=0, num_gpus=0)(PoolActor)
    pool: Any = actor_cls.options(name=spec.name, namespace=NAMESPACE, max_concurrency=8 * len(spec.runs) + 16).remote(
        spec.slots, spec.policy
    )
    actors: list[Any] = []
    stops: list[Callable[[str], None]] = []
    session.on_interrupt(lambda name: [stop(name) for stop in stops])
    try:
        await pool.start.remote()

        def host_of(cfg: Config, run_dir) -> Any:
            # every run attaches to the pool's TransferQueue; its own config.yaml keeps its own setting
            attached = replace(cfg, storage=replace(cfg.storage, attach=True))
            actor = _controller_actor(attached, run_dir, spec.resume_of(cfg) is not None)
            actors.append(actor)

            async def call(method: str, *args: Any) -> Any:
                return await getattr(actor, method).remote(*args)

            return call

        codes, dirs = await _drive_runs(spec, host_of, stops.append)
        pool_summary = await pool.summary.remote()
    finally:
        for actor in actors:
            ray.kill(actor)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(pool.close.remote(), 10)
        ray.kill(pool)
        await asyncio.to_thread(stop_tq)
    return codes, _summary(spec, codes, dirs, pool_summary)


def _controller_actor(cfg: Config, run_dir, resume: bool) -> Any:
    """One run's `ControllerHost` as a named Ray actor; its processes log to the run's own logs/."""
    import ray

    from single_controller.backends.common.worker_logs import LOG_DIR_ENV
    from single_controller.runtime.actor_host import ControllerHost
    from single_controller.runtime.driver import _on_this_node

    actor_cls = ray.remote(num_cpus=0, num_gpus=0)(ControllerHost)
    return actor_cls.options(
        name=f"sc-grpo-controller-{cfg.run.name}",
        max_concurrency=64,
        runtime_env={"env_vars": {LOG_DIR_ENV: str(run_dir.logs_path.resolve())}},
        **_on_this_node(),
    ).remote(cfg, str(run_dir.path.resolve()), resume, run_dir.run_id, run_dir.wall_offset_s)


# -- pool serve ----------------------------------------------------------------------------------
def main_serve(argv: Sequence[str]) -> int:
    import signal
    import threading

    p = argparse.ArgumentParser(prog="sc-grpo pool serve", description="the pool actor on a Ray cluster until Ctrl-C")
    p.add_argument("--address", required=True, help="the Ray cluster, HEAD_IP:6379")
    p.add_argument("--slots", type=int, required=True, help="slots of the pool (GPUs of the cluster it may use)")
    p.add_argument("--policy", choices=POLICIES, default="gap_ratio")
    p.add_argument("--name", default="sc-grpo-pool", help="the pool actor's name (runs: pool.name)")
    args = p.parse_args(list(argv))
    if args.slots < 1:
        say("sc-grpo pool serve: --slots must be at least 1", err=True)
        return EXIT_USAGE
    from single_controller.runtime.storage_service import _connect

    try:
        _connect(args.address, 30.0)
    except ConnectionError as e:
        say(f"sc-grpo pool serve: {e}", err=True)
        return EXIT_FAILED
    import ray

    from single_controller.pool.actor import NAMESPACE, PoolActor

    gpus = int(ray.cluster_resources().get("GPU", 0))
    if gpus and args.slots > gpus:
        say(f"sc-grpo pool serve: {args.slots} slots do not fit the cluster: it has {gpus} GPU(s)", err=True)
        return EXIT_USAGE
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stop.set())
    pool: Any = (
        ray.remote(num_cpus=0)(PoolActor)
        .options(name=args.name, namespace=NAMESPACE, max_concurrency=256)
        .remote(args.slots, args.policy)
    )
    try:
        ray.get(pool.start.remote())
        say(
            f"sc-grpo pool: ready: {args.slots} slot(s), {args.policy}, on the Ray cluster at {args.address}; runs "
            f"join with ray.address={args.address} pool.enabled=true pool.attach=true pool.name={args.name}; "
            "Ctrl-C stops it"
        )
        while not stop.wait(1.0):
            pass
        return EXIT_OK
    finally:
        ray.kill(pool)
        ray.shutdown()


def main(argv: Sequence[str]) -> int:
    """`sc-grpo pool run|serve ...`"""
    actions = {"run": main_run, "serve": main_serve}
    if not argv or argv[0] not in actions:
        say("usage: sc-grpo pool run POOL.yaml | sc-grpo pool serve --address HEAD:6379 --slots N", err=True)
        return EXIT_USAGE
    return actions[argv[0]](argv[1:])
