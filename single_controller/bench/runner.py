"""Benchmarks: `sc-grpo bench overlap`, `scale`, `embedded` and `eval` (docs/performance.md).

`overlap` runs the controller on the simulated backend twice in one process, generation time equal
to training time: synchronous (L = 0) and asynchronous (L = 1, streaming chunks). It prints the
async/sync steady-state throughput ratio, that ratio over the physical limit
(T_gen + T_train) / max(T_gen, T_train), and the commit -> select latency. The simulated trainer
reads no rows (real trainers read them in their own processes).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from replay.storage import InMemoryRowStorage
from single_controller.backends.sim import Faults, SimMeter, sim_prompts, sim_workers
from single_controller.config.schema import (
    BackendConfig,
    Config,
    RolloutConfig,
    RunConfig,
    SamplerConfig,
    StorageConfig,
    TrainConfig,
)
from single_controller.controller import Controller
from single_controller.state import Workers


def _run_on_loop(main):
    """Run `main` on the kind of event loop the controller gets in a real run (Ray's for an async
    actor: uvloop where installed), so the figures are the production loop's."""
    from single_controller.runtime.ray_session import new_event_loop

    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)


def _loop_name() -> str:
    from single_controller.runtime.ray_session import new_event_loop

    loop = new_event_loop()
    try:
        return f"{type(loop).__module__}.{type(loop).__name__}"
    finally:
        loop.close()


def overlap_config(steps: int, groups: int, lookahead: int, chunk: int) -> Config:
    return Config(
        run=RunConfig(max_steps=steps, progress_bar=False, plot=False),
        rollout=RolloutConfig(group_size=4, max_in_flight_groups=4 * groups),
        train=TrainConfig(groups_per_step=groups, min_groups_per_chunk=chunk),
        sampler=SamplerConfig(max_lookahead_versions=lookahead, max_staleness_versions=lookahead),
        backend=BackendConfig(generation="sim", trainer="sim"),
        storage=StorageConfig(kind="memory"),
    )


async def _run_once(cfg: Config, t_gen: float, t_train: float) -> tuple[float, float, Controller]:
    storage = InMemoryRowStorage()
    P = cfg.train.groups_per_step
    # Real trainers read their rows in their own processes; the fake one would do it on this thread
    # and bill the controller for worker work, so it skips the reads here (the tests keep them).
    gens, trainer = sim_workers(storage, gen_group_s=t_gen / P, train_group_s=t_train / P, trainer_reads_rows=False)
    ctl = Controller(cfg, sim_prompts(), storage, Workers(gens, trainer))
    t0 = time.perf_counter()
    summary = await ctl.run()
    wall = time.perf_counter() - t0
    ends = [h["time/wall_s"] for h in summary.history]
    steady = (len(ends) - 1) / (ends[-1] - ends[0])
    return steady, wall, ctl


def main_overlap(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="sc-grpo bench overlap",
        description="How much of the physically possible overlap the controller achieves: async "
        "against sync throughput on simulated workers in this process.",
    )
    ap.add_argument(
        "--steps", type=int, default=40, help="RL steps per mode (at least 2: throughput is measured between step ends)"
    )
    ap.add_argument("--groups", type=int, default=16, help="prompt groups per step")
    ap.add_argument("--t-gen", type=float, default=0.08, help="generation seconds per step")
    ap.add_argument("--t-train", type=float, default=0.08, help="training seconds per step")
    ap.add_argument("--chunk", type=int, default=4, help="min groups per chunk in async mode")
    ap.add_argument("--lookahead", type=int, default=1, help="max_lookahead_versions L of the async mode")
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error(
            "--steps must be at least 2 (steady-state throughput is measured between the first and the last step's end)"
        )
    if args.groups < 1 or args.t_gen <= 0 or args.t_train <= 0:
        ap.error("--groups must be >= 1 and --t-gen / --t-train > 0")

    sync_cfg = overlap_config(args.steps, args.groups, lookahead=0, chunk=args.groups)
    async_cfg = overlap_config(args.steps, args.groups, lookahead=args.lookahead, chunk=args.chunk)
    sync_tp, sync_wall, _ = _run_on_loop(_run_once(sync_cfg, args.t_gen, args.t_train))
    async_tp, async_wall, ctl = _run_on_loop(_run_once(async_cfg, args.t_gen, args.t_train))
    limit = (args.t_gen + args.t_train) / max(args.t_gen, args.t_train)
    ratio = async_tp / sync_tp
    p50, p99 = ctl.select_latency_percentiles()
    print(
        f"T_gen/step {args.t_gen * 1e3:.0f} ms, T_train/step {args.t_train * 1e3:.0f} ms, {args.groups} groups/step, "
        f"{args.steps} steps (simulated workers in this process; the fake trainer does not read rows)"
    )
    print(f"sync  (L=0, one chunk/step): {sync_tp:.2f} steps/s steady state, wall {sync_wall:.2f} s")
    print(
        f"async (L={args.lookahead}, chunks of >= {args.chunk}): {async_tp:.2f} steps/s steady state, "
        f"wall {async_wall:.2f} s"
    )
    print(f"async/sync throughput ratio: {ratio:.3f}")
    print(f"physical limit (T_gen + T_train) / max(T_gen, T_train): {limit:.3f}")
    print(f"ratio / limit: {ratio / limit:.3f} (target >= 0.95)")
    print(
        f"commit->select latency (train pump waiting): p50 {p50 * 1e3:.3f} ms, p99 {p99 * 1e3:.3f} ms "
        "(target p99 < 1 ms)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main_overlap())


# ---------------------------------------------------------------------------------------------
# `sc-grpo bench eval`
EVAL_BENCH_DOC = """`sc-grpo bench eval`: training throughput with held-out evaluation on vs off.

Trains the same configuration (default configs/embedded.yaml on the embedded torch backend, a fixed
number of steps, no early stop) with eval off and with eval every N steps, alternating, in one
invocation and one Ray session, and prints steps/s over each run (from the first step's start to the
last step's end: the end-of-run eval after the last step is outside it, though the eval count and
eval seconds printed include it) and the ratio
eval-on / eval-off (target >= 0.9). `--backend sim` runs the orchestration alone on simulated workers.
"""


async def _eval_bench_run(cfg: Config, runner) -> dict:
    """One run through a ControllerHost (a Ray actor for the torch backend, in-process for sim)."""
    from single_controller.deadlines import within

    host, dispose = runner(cfg)
    try:
        await within(host("setup"), cfg.timeouts.setup_s, "bench: controller setup")
        t0 = time.perf_counter()
        summary = await host("run")
        wall = time.perf_counter() - t0
        records, _ = await host("next_records", 0)
    finally:
        try:
            await within(host("close"), 60, "bench: controller close")
        finally:
            dispose()
    steps = [r for r in records if "step" in r]
    evals = [r for r in records if "eval/policy_version" in r]
    t_last = steps[-1]["time/wall_s"]
    return {
        "steps": len(steps),
        "train_s": t_last,
        "steps_per_s": len(steps) / t_last,
        "wall_s": wall,
        "evals": len(evals),
        "eval_s": sum(r["eval/seconds"] for r in evals),
        "reissued": sum(r["eval/reissued"] for r in evals),
        "final_accuracy": evals[-1]["eval/accuracy"] if evals else None,
        "stop_reason": summary["stop_reason"],
    }


def main_eval(argv: list[str] | None = None) -> int:
    from single_controller.preflight.loader import load_config

    ap = argparse.ArgumentParser(prog="sc-grpo bench eval", description=EVAL_BENCH_DOC.splitlines()[0])
    ap.add_argument("--config", default="configs/embedded.yaml", help="the training configuration")
    ap.add_argument("--steps", type=int, default=60, help="RL steps per run (early stop off)")
    ap.add_argument("--every", type=int, default=10, help="eval.every_steps of the eval-on runs")
    ap.add_argument("--repeats", type=int, default=1, help="off/on pairs, alternating (the ratio of the summed times)")
    ap.add_argument(
        "--backend", choices=["torch", "sim"], default=None, help="both roles on this backend (default: the config's)"
    )
    ap.add_argument("overrides", nargs="*", help="config overrides (key=value) for both runs")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.steps < 1 or args.every < 1:
        ap.error("--repeats, --steps and --every must each be at least 1")
    common = [
        f"run.max_steps={args.steps}",
        "run.stop_at_success_rate=null",
        "run.progress_bar=false",
        "run.plot=false",
        "metrics.enabled=false",
        *args.overrides,
    ]
    if args.backend == "sim":
        common += ["backend.generation=sim", "backend.trainer=sim", "storage.kind=memory"]
    elif args.backend == "torch":
        common += ["backend.generation=torch", "backend.trainer=torch"]
    off = load_config(args.config, common + ["eval.enabled=false"])
    on = load_config(args.config, common + ["eval.enabled=true", f"eval.every_steps={args.every}"])
    print(EVAL_BENCH_DOC.strip().splitlines()[0])
    print(
        f"{args.steps} steps per run, eval every {args.every} steps "
        f"({on.eval.num_prompts} held-out prompts x {on.eval.num_samples} sample(s)), "
        f"backend {on.backend.generation}/{on.backend.trainer}, {args.repeats} pair(s)"
    )
    results = _eval_pairs(off, on, args.repeats)
    steps_off = sum(r["steps"] for r, _ in results)
    steps_on = sum(r["steps"] for _, r in results)
    tp_off = steps_off / sum(r["train_s"] for r, _ in results)
    tp_on = steps_on / sum(r["train_s"] for _, r in results)
    ratio = tp_on / tp_off
    print(f"eval off: {tp_off:.3f} steps/s; eval on (every {args.every}): {tp_on:.3f} steps/s")
    print(f"throughput ratio eval-on / eval-off: {ratio:.3f} (target >= 0.9)")
    return 0


def _eval_pairs(off: Config, on: Config, repeats: int) -> list[tuple[dict, dict]]:
    """`repeats` (eval off, eval on) pairs of runs, each through a ControllerHost: in-process for
    sim, a Ray actor for the torch backend."""
    from single_controller.runtime.actor_host import ControllerHost

    async def pairs(runner) -> list[tuple[dict, dict]]:
        out = []
        for i in range(repeats):
            r_off = await _eval_bench_run(off, runner)
            print(f"  pair {i}: eval off {r_off['steps_per_s']:.3f} steps/s ({r_off['train_s']:.1f} s)", flush=True)
            r_on = await _eval_bench_run(on, runner)
            print(
                f"  pair {i}: eval on  {r_on['steps_per_s']:.3f} steps/s ({r_on['train_s']:.1f} s; "
                f"{r_on['evals']} evals, {r_on['eval_s']:.2f} s in eval rounds, {r_on['reissued']} re-issued, "
                f"final accuracy {r_on['final_accuracy']})",
                flush=True,
            )
            out.append((r_off, r_on))
        return out

    if on.backend.generation == "sim":

        def local(cfg):
            host = ControllerHost(cfg)
            return (lambda method, *a: getattr(host, method)(*a)), (lambda: None)

        return _run_on_loop(pairs(local))
    import ray

    from single_controller.backends.common.colocation import threads_per_process
    from single_controller.runtime.ray_session import ray_session, worker_env

    def actor(cfg):
        handle = ray.remote(num_cpus=0, num_gpus=0)(ControllerHost).options(max_concurrency=64).remote(cfg)

        def call(method, *a):
            return getattr(handle, method).remote(*a)

        def kill():
            ray.kill(handle)  # type: ignore[arg-type]  # Ray types ActorClass.remote() as handle | class

        return call, kill

    min_cpus = 1 + on.storage.num_storage_units + 1
    with ray_session(on.ray, min_cpus=min_cpus, env_vars=worker_env(threads_per_process(on.backend))) as session:
        return session.run(pairs(actor))


# ---------------------------------------------------------------------------------------------
# `sc-grpo bench scale`
SCALE_BENCH_DOC = """`sc-grpo bench scale`: the control plane at production sizes, on simulated workers.

For each point (prompt groups per step P, simulated generation workers W; G rows per group) runs
the controller synchronously (L = 0, one chunk per step) and asynchronously (L = 1, chunks of
`--chunk` groups) with generation and training each taking T seconds per step (each worker serves
its share of the groups at W * T / P seconds per group), and prints:
  overlap     (async steps/s / sync steps/s) / the physical limit 2, steady state (target >= 0.95)
  of ideal    async steps/s / (1 / T): the fraction of the physically possible throughput (a
              controller too slow for the synchronous run inflates `overlap`; not this)
  cpu/group   process CPU seconds of the async run / groups trained. The simulated workers and
              the in-memory storage run on the controller's thread (they skip the row reads and
              writes real workers do in their own processes; the controller's own advantage puts
              and row clears are counted)
  sim         of that, the time spent in the simulated workers' own code (every step of their
              coroutines and timer callbacks, metered: `SimMeter`), per group
  ctl/group   cpu/group - sim: the controller's CPU per group (target <= 100 us). The event loop's
              work of waking the controller's calls up stays in it, as a real worker's answer costs
              it too; so do the dataloader and the in-memory storage
  wakes       times the event loop's thread fell asleep and was woken up (voluntary context
              switches; other threads of the process are not counted), per group: each costs at
              least the wake-up in the header, and its code runs on cold caches
  select p50/p99  commit -> select latency when the train pump was waiting (target p99 < 1 ms),
              from a third run (asynchronous, training 4x faster than generation: the train pump
              waits for every chunk, so every chunk gives a sample; `n` samples). In the overlap
              runs it waits only while the pipeline fills: one sample, too few for a p99
  rss         the process's resident memory after the point
The simulated generation workers are serial engines by default: each group is answered on its own,
one completion (and one wake-up of the controller) per group, the most events a worker can cause.
`--batch N` makes them batch as the shipped clients do (`ActorGenerationClient` sends a wave of
requests as one `generate_many` call and hands the results back together; the torch backend
batches up to `rollout.max_batch_groups` = 16 groups): the requests of one event-loop tick, and
those queued while a batch computes, are served together, up to N, and answered together at the
batch's end. A batch takes the sum of its groups' times: the throughput of a serial engine.
The controller runs on the event loop a real run gives it: Ray's loop for an async actor, uvloop
where installed (`RAY_USE_UVLOOP=0` measures asyncio's own loop; the header names the loop).
The header also gives what this machine charges for one wake-up of an idle event loop (a bare loop
of that kind with one timer that fires and re-arms itself every 2 ms, then every 100 ms). The
controller pays at least that whenever it wakes from a quiet stretch: with one worker about once
per group (~2 ms apart at 256 x 1), at 16 groups per step a few times per step, ~100 ms apart. On
a virtual machine it can be tens to hundreds of us, and the code that runs next starts on cold
caches.
After the sweep over groups per step, a least-squares line through the points' controller CPU
per step splits it into a fixed cost per step (trainer calls, weight sync to every worker, the step's
record) and a marginal cost per group.
`--keep-cpu-awake` (Linux, a diagnostic): pins the benchmark to one CPU and runs a busy loop on
that CPU in the idle scheduling class (SCHED_IDLE: it runs only when nothing else wants the CPU,
and yields it at once when the benchmark wakes up), so the CPU never goes idle. A virtual machine's
idle CPU halts into the hypervisor, and waking it costs the next code its caches; with the CPU kept
awake the figures show what the controller costs where idle CPUs do not halt (bare metal, or a
guest that polls before halting). The targets are read off the default run.
Then a long run (--long-steps, default 10,000, of --long-groups groups, no simulated latency)
samples memory every 10 % of its steps: Python heap blocks (sys.getallocatedblocks) and RSS,
which should stay flat (target +-10 %) once the pipeline is full.
"""


def idle_wakeup_cpu_s(wakeups: int, sleep_s: float) -> float:
    """Process CPU seconds of one wake-up of an otherwise idle event loop, of the kind the benchmarks
    run on: one timer that fires and re-arms itself `wakeups` times, `sleep_s` apart, nothing else
    (the machine's floor under a controller that wakes from quiet stretches)."""

    async def sleeps() -> float:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        left = wakeups

        def wake() -> None:
            nonlocal left
            left -= 1
            if left:
                loop.call_later(sleep_s, wake)
            else:
                done.set_result(None)

        cpu0 = time.process_time()
        loop.call_later(sleep_s, wake)
        await done
        return (time.process_time() - cpu0) / wakeups

    return _run_on_loop(sleeps())


_SPIN = """
import os, sys
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # first: never competes at normal priority
os.sched_setaffinity(0, {int(sys.argv[1])})
print("ready", flush=True)
parent = os.getppid()
while os.getppid() == parent:  # ends with the benchmark, however it ends
    for _ in range(1_000_000):
        pass
"""


@contextlib.contextmanager
def cpu_kept_awake():
    """Pin this process to one CPU and keep that CPU from going idle with a busy loop of the idle
    scheduling class beside it (`bench scale --keep-cpu-awake`); yields the CPU. Restores the
    process's CPUs and stops the loop on exit."""
    if not (hasattr(os, "sched_setaffinity") and hasattr(os, "SCHED_IDLE")):
        raise SystemExit("--keep-cpu-awake needs Linux (os.sched_setaffinity and the SCHED_IDLE class)")
    cpus = os.sched_getaffinity(0)
    cpu = min(cpus)
    spinner = subprocess.Popen([sys.executable, "-c", _SPIN, str(cpu)], stdout=subprocess.PIPE, text=True)
    assert spinner.stdout is not None  # stdout=PIPE
    try:
        os.sched_setaffinity(0, {cpu})  # inside: a failure from here on still stops the loop and restores the CPUs
        if spinner.stdout.readline().strip() != "ready":  # in its class and on its CPU before anything is measured
            raise RuntimeError(f"--keep-cpu-awake: the busy loop did not start (exit status {spinner.wait()})")
        yield cpu
    finally:
        spinner.kill()
        spinner.wait()
        spinner.stdout.close()
        os.sched_setaffinity(0, cpus)


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def scale_config(steps: int, groups: int, group_size: int, lookahead: int, chunk: int) -> Config:
    cfg = overlap_config(steps, groups, lookahead, chunk)
    return replace(cfg, rollout=replace(cfg.rollout, group_size=group_size))


# the voluntary context switches of the event loop's thread alone (Linux); elsewhere the process's,
# which counts every thread a host process has left running (Ray's, TQ's, a test suite's)
_THIS_THREAD = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
_REWARD_PATTERNS = [tuple(((i * 7 + j * 3) % 5) / 4.0 for j in range(64)) for i in range(16)]


def _cheap_rewards(prompt_id: str, attempt: int, group_size: int) -> tuple[float, ...]:
    """Rewards that vary within a group at no cost (the simulated workers' hashing would be billed
    to the controller here, unlike a real worker's scoring in its own process)."""
    return _REWARD_PATTERNS[(len(prompt_id) + attempt + ord(prompt_id[-1])) % 16][:group_size]


async def _scale_run(cfg: Config, workers: int, t_gen: float, t_train: float, on_step=None, batch: int = 1) -> dict:
    storage, meter = InMemoryRowStorage(), SimMeter()
    P = cfg.train.groups_per_step
    gens, trainer = sim_workers(
        storage,
        num_generators=workers,
        gen_group_s=workers * t_gen / P,
        train_group_s=t_train / P,
        trainer_reads_rows=False,
        workers_write_rows=False,
        keep_logs=False,
        faults=Faults(rewards=_cheap_rewards),
        meter=meter,
        gen_max_batch=batch,
    )
    with tempfile.TemporaryDirectory() as tmp:  # settled prompts stream to disk, as in a real run
        ctl = Controller(
            cfg,
            sim_prompts(),
            storage,
            Workers(gens, trainer),
            on_step=on_step,
            prompt_history=os.path.join(tmp, "prompt_history.jsonl"),
        )
        sleeps0 = resource.getrusage(_THIS_THREAD).ru_nvcsw
        cpu0, t0 = time.process_time(), time.perf_counter()
        summary = await ctl.run()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
        sleeps = resource.getrusage(_THIS_THREAD).ru_nvcsw - sleeps0
        ctl.state.prompts.close()
    ends = [h["time/wall_s"] for h in summary.history]
    p50, p99 = ctl.select_latency_percentiles()
    return {
        "steps_per_s": (len(ends) - 1) / (ends[-1] - ends[0]) if len(ends) > 1 else float("nan"),
        "wall_s": wall,
        "cpu_s": cpu,
        "sim_s": meter.seconds,
        "sleeps": sleeps,  # voluntary context switches: the event loop's thread fell asleep and was woken up
        "groups": summary.steps * P,
        "p50": p50,
        "p99": p99,
        "latency_samples": len(ctl.state.counters.select_latency_s),
    }


def main_scale(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="sc-grpo bench scale",
        description=SCALE_BENCH_DOC.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=SCALE_BENCH_DOC,
    )
    ap.add_argument("--groups", default="16,64,256,1024", help="prompt groups per step, swept at --workers-at")
    ap.add_argument("--workers", default="1,8,64", help="simulated generation workers, swept at --groups-at")
    ap.add_argument("--workers-at", type=int, default=8, help="workers while sweeping groups")
    ap.add_argument("--groups-at", type=int, default=256, help="groups per step while sweeping workers")
    ap.add_argument("--group-size", type=int, default=16, help="G: rows per group")
    ap.add_argument("--t", type=float, default=0.5, help="generation = training seconds per step")
    ap.add_argument("--steps", type=int, default=12, help="RL steps per run")
    ap.add_argument("--chunk", type=int, default=4, help="min groups per chunk in async mode")
    ap.add_argument(
        "--batch",
        type=int,
        default=1,
        help="groups per batch of a simulated generation worker (1: serial engines; 16: as the shipped clients batch)",
    )
    ap.add_argument("--long-steps", type=int, default=10_000, help="steps of the memory run (0: skip it)")
    ap.add_argument("--long-groups", type=int, default=2, help="groups per step of the memory run")
    ap.add_argument(
        "--keep-cpu-awake",
        action="store_true",
        help="diagnostic (Linux): run on one CPU kept from going idle by an idle-class busy loop (see below)",
    )
    args = ap.parse_args(argv)
    if args.keep_cpu_awake:
        with cpu_kept_awake() as cpu:
            return _scale_sweep(args, f"CPU {cpu} kept awake by an idle-class busy loop (a diagnostic: no idle halts)")
    return _scale_sweep(args, "")


def _scale_sweep(args: argparse.Namespace, awake: str) -> int:
    _print_scale_header(args, awake)
    worst = {"overlap": float("inf"), "ideal": float("inf"), "cpu": 0.0, "p99": 0.0}
    at = {"cpu": "", "p99": ""}  # the point of each worst figure
    p99_largest = (0, float("nan"))  # (P, select p99) at the largest groups per step swept: the target's point
    per_step: list[tuple[int, float]] = []  # (P, controller CPU seconds per step) along the sweep over P
    for P, W in _scale_points(args):
        fig = _scale_point(args, P, W)
        if W == args.workers_at:
            per_step.append((P, fig["ctl"] * P))
        worst["overlap"] = min(worst["overlap"], fig["overlap"])
        worst["ideal"] = min(worst["ideal"], fig["ideal"])
        if fig["ctl"] >= worst["cpu"]:
            worst["cpu"], at["cpu"] = fig["ctl"], f"{P} x {W}"
        if fig["p99"] >= worst["p99"]:
            worst["p99"], at["p99"] = fig["p99"], f"{P} x {W}"
        if P > p99_largest[0] or (P == p99_largest[0] and W == args.workers_at):
            p99_largest = (P, fig["p99"])
    print(
        f"worst: overlap {worst['overlap']:.3f} (target >= 0.95), of ideal {worst['ideal']:.3f}, "
        f"ctl/group {worst['cpu'] * 1e6:.1f} us at {at['cpu']} (target <= 100), "
        f"select p99 {worst['p99'] * 1e3:.3f} ms at {at['p99']}"
    )
    print(f"select p99 at {p99_largest[0]} groups per step: {p99_largest[1] * 1e3:.3f} ms (target < 1 ms at 1024)")
    _print_cost_per_step(per_step, args.workers_at)
    if args.long_steps > 0:
        _long_run(args.long_steps, args.long_groups, args.group_size)
    return 0


def _scale_points(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(groups per step, workers): the sweep over groups at --workers-at, then over workers at --groups-at."""
    groups = [int(x) for x in args.groups.split(",") if x]
    workers = [int(x) for x in args.workers.split(",") if x]
    points = [(P, args.workers_at) for P in groups]
    return points + [(args.groups_at, W) for W in workers if (args.groups_at, W) not in points]


def _print_scale_header(args: argparse.Namespace, awake: str) -> None:
    print(SCALE_BENCH_DOC.strip().splitlines()[0])
    engines = f"generation workers batch up to {args.batch} groups" if args.batch > 1 else "serial generation workers"
    print(
        f"G = {args.group_size}, T_gen = T_train = {args.t} s per step, {args.steps} steps per run, "
        f"async chunks of >= {args.chunk} groups, {engines}, event loop {_loop_name()}"
        + (f", {awake}" if awake else "")
    )
    short, long = idle_wakeup_cpu_s(60, 0.002), idle_wakeup_cpu_s(10, 0.1)
    print(
        f"this machine: one wake-up of an idle event loop costs {short * 1e6:.0f} us of CPU after 2 ms asleep, "
        f"{long * 1e6:.0f} us after 100 ms (a bare loop: one timer, nothing else)"
    )
    print(
        f"{'groups/step':>11} {'workers':>7} {'sync st/s':>9} {'async st/s':>10} {'overlap':>7} {'of ideal':>8} "
        f"{'cpu/group':>10} {'sim':>8} {'ctl/group':>10} {'wakes':>6} {'select p50':>10} {'p99':>8} {'n':>5} "
        f"{'rss MB':>7}"
    )


def _scale_point(args: argparse.Namespace, P: int, W: int) -> dict[str, float]:
    """One point of the sweep: its sync, async and latency runs, printed as one row; its figures."""
    G, t, batch = args.group_size, args.t, args.batch
    sync = _run_on_loop(_scale_run(scale_config(args.steps, P, G, 0, P), W, t, t, batch=batch))
    asy = _run_on_loop(_scale_run(scale_config(args.steps, P, G, 1, args.chunk), W, t, t, batch=batch))
    lat = _run_on_loop(_scale_run(scale_config(args.steps, P, G, 1, args.chunk), W, t, t / 4, batch=batch))
    overlap = asy["steps_per_s"] / sync["steps_per_s"] / 2.0
    of_ideal = asy["steps_per_s"] * t
    cpu_per_group = asy["cpu_s"] / asy["groups"]
    sim_per_group = asy["sim_s"] / asy["groups"]
    ctl_per_group = cpu_per_group - sim_per_group
    print(
        f"{P:>11} {W:>7} {sync['steps_per_s']:>9.3f} {asy['steps_per_s']:>10.3f} {overlap:>7.3f} {of_ideal:>8.3f} "
        f"{cpu_per_group * 1e6:>8.1f}us {sim_per_group * 1e6:>6.1f}us {ctl_per_group * 1e6:>8.1f}us "
        f"{asy['sleeps'] / asy['groups']:>6.2f} {lat['p50'] * 1e3:>8.3f}ms {lat['p99'] * 1e3:>6.3f}ms "
        f"{lat['latency_samples']:>5} {_rss_mb():>7.1f}",
        flush=True,
    )
    return {"overlap": overlap, "ideal": of_ideal, "ctl": ctl_per_group, "p99": lat["p99"]}


def _print_cost_per_step(per_step: list[tuple[int, float]], workers: int) -> None:
    """A least-squares line through (groups per step, controller CPU per step): fixed + marginal cost."""
    if len(per_step) < 2:
        return
    n = len(per_step)
    mx, my = sum(p for p, _ in per_step) / n, sum(c for _, c in per_step) / n
    slope = sum((p - mx) * (c - my) for p, c in per_step) / sum((p - mx) ** 2 for p, _ in per_step)
    print(
        f"controller CPU per step ~ {max(0.0, my - slope * mx) * 1e3:.2f} ms + {slope * 1e6:.1f} us x groups per step "
        f"(least squares over the {n} points at {workers} workers)"
    )


def _long_run(steps: int, groups: int, group_size: int) -> None:
    import gc

    every = max(1, steps // 10)
    samples: list[tuple[int, int, float]] = []

    def on_step(rec: dict) -> None:
        if (rec["step"] + 1) % every == 0:
            gc.collect()
            samples.append((rec["step"] + 1, sys.getallocatedblocks(), _rss_mb()))

    cfg = scale_config(steps, groups, group_size, 1, 1)
    r = _run_on_loop(_scale_run(cfg, 1, 0.0, 0.0, on_step=on_step))
    print(
        f"long run: {steps} steps of {groups} groups (G = {group_size}), no simulated latency: {r['wall_s']:.1f} s, "
        f"{r['cpu_s'] / r['groups'] * 1e6:.1f} us CPU per group"
    )
    print(f"{'step':>7} {'heap blocks':>12} {'rss MB':>8}")
    for step, blocks, rss in samples:
        print(f"{step:>7} {blocks:>12} {rss:>8.1f}")
    if len(samples) >= 3:
        base = samples[1]  # after the first 10 %: the pipeline and caches are warm
        growth_b = max(b for _, b, _ in samples[1:]) / base[1] - 1
        growth_r = max(r for _, _, r in samples[1:]) / base[2] - 1
        print(
            f"growth after step {base[0]}: heap blocks {growth_b * 100:+.1f} %, rss {growth_r * 100:+.1f} % "
            "(target within +-10 %)"
        )


# ---------------------------------------------------------------------------------------------
# `sc-grpo bench embedded`
EMBEDDED_BENCH_DOC = """`sc-grpo bench embedded`: the embedded default as a user runs it, against the reference loop.

For each seed: runs `sc-grpo run CONFIG seed=S` as a separate command (its own Ray, TransferQueue
and workers; the run directory in a temporary folder), then the single-process reference loop
(`sc-grpo bench reference`) for the same seed in this process, with the resolved config's task,
digits, groups per step, group size, learning rate and stop rule (a config it cannot mirror, such as
another model or backend, is refused), and prints the run's start-up (as it reports it), its
training time to the target (the end of the step that reached success 0.9 over 5 steps by default,
where the reference loop's clock stops too; the training phase with the run's final checkpoint and
teardown is printed beside it), the whole command's wall time, and the ratio of the run's training
time to the reference loop's; no ratio for a seed where either
stopped short of the success target. Overrides (KEY=VALUE) go anywhere on the line. Targets:
start-up <= 12 s, ratio <= 1.0, whole command <= 30 s. Measure on a quiet machine.
"""


def _reference_for(config: str, overrides: list[str]) -> tuple[dict[str, Any], float]:
    """The reference loop's arguments that mirror the run's resolved config, and the run's target.
    Refuses, naming why, a config the reference loop cannot mirror or one that never stops on success."""
    from single_controller.config.schema import ModelConfig
    from single_controller.preflight.loader import load_config

    cfg = load_config(config, overrides)
    problems = []
    if (cfg.backend.generation, cfg.backend.trainer) != ("torch", "torch"):
        problems.append(
            f"backend.generation={cfg.backend.generation}, backend.trainer={cfg.backend.trainer} "
            "(the reference loop is the torch backends' pieces)"
        )
    if cfg.model != ModelConfig():
        problems.append("a model other than the default embedded one (model.*)")
    if cfg.run.stop_at_success_rate is None:
        problems.append("run.stop_at_success_rate=null (the bench times training to that success rate)")
    if problems:
        raise SystemExit(f"sc-grpo bench embedded: the reference loop cannot mirror this config: {'; '.join(problems)}")
    target = cfg.run.stop_at_success_rate
    assert target is not None  # refused above
    ref: dict[str, Any] = dict(
        task=cfg.task.name,
        num_digits=cfg.task.num_digits,
        prompts_per_step=cfg.train.groups_per_step,
        group_size=cfg.rollout.group_size,
        lr=cfg.train.lr,
        target=target,
        window=cfg.run.success_window,
    )
    return ref, target


def _last_step_wall_s(output_dir: Path) -> float | None:
    """`time/wall_s` of the last step record of the one run under `output_dir` (None: no record)."""
    from single_controller.runtime.records import is_eval_record, read_metrics

    logs = sorted(output_dir.glob("*/metrics.jsonl"))
    if len(logs) != 1:
        return None
    steps = [r for r in read_metrics(logs[0]) if "time/wall_s" in r and not is_eval_record(r)]
    return float(steps[-1]["time/wall_s"]) if steps else None


def main_embedded(argv: list[str] | None = None) -> int:
    args = _embedded_args(argv)
    ref_args, target = _reference_for(args.config, args.overrides)
    print(EMBEDDED_BENCH_DOC.strip().splitlines()[0], flush=True)
    print("reference loop: " + ", ".join(f"{k}={v}" for k, v in ref_args.items()), flush=True)
    rows = []
    for seed in args.seeds:
        proc, whole, last_step_s = _run_command(args, seed)
        done = re.search(r"(\d+) steps in ([\d.]+)s of training \(\+([\d.]+)s startup\): (.*)", proc.stdout)
        if proc.returncode != 0 or done is None:
            print(
                f"seed {seed}: the run failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}",
                flush=True,
            )
            return 1
        row = _compare_seed(seed, done, whole, last_step_s, ref_args, target)
        if row is not None:
            rows.append(row)
    if not rows:
        print(f"no seed reached success {target} in both the run and the reference loop: no ratio to report")
        return 1
    n = len(rows)

    def mean(i: int) -> float:
        return sum(r[i] for r in rows) / n

    print(
        f"mean over {n} seeds: start-up {mean(1):.1f} s (target <= 12), training {mean(3):.1f} s, "
        f"whole command {mean(4):.1f} s (target <= 30), training / reference {mean(7):.2f} (target <= 1.0)"
    )
    return 0


def _embedded_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="sc-grpo bench embedded",
        description=EMBEDDED_BENCH_DOC.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EMBEDDED_BENCH_DOC,
    )
    ap.add_argument("--config", default="configs/embedded.yaml")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="config overrides for the runs (anywhere on the line)"
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    # An override is never a seed: taken out first, so `--seeds 0 1 run.max_steps=50` works too.
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    args = ap.parse_args([a for a in argv if a not in overrides])
    args.overrides = [*args.overrides, *overrides]
    return args


def _run_command(args: argparse.Namespace, seed: int) -> tuple[subprocess.CompletedProcess[str], float, float | None]:
    """`sc-grpo run CONFIG seed=S` as a user runs it, in a temporary output folder: its process, the
    whole command's wall time, and the end of its last step (`_last_step_wall_s`)."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            sys.executable,
            "-m",
            "single_controller",
            "run",
            args.config,
            f"seed={seed}",
            f"run.output_dir={out}",
            "run.progress_bar=false",
            *args.overrides,
        ]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        whole = time.perf_counter() - t0
        return proc, whole, _last_step_wall_s(Path(out))


def _compare_seed(
    seed: int, done: re.Match[str], whole: float, last_step_s: float | None, ref_args: dict[str, Any], target: float
) -> tuple[int, float, int, float, float, int, float, float] | None:
    """The reference loop for `seed` beside the run's figures (`done`: its summary line), printed;
    the seed's row, or None when either stopped short of the target."""
    from single_controller.bench.reference_loop import run_reference

    steps, phase_s, startup_s, reason = int(done[1]), float(done[2]), float(done[3]), done[4]
    # To the target: the end of the step that reached it (the reference loop's clock stops there
    # too); the run's training phase also holds its final checkpoint and teardown.
    train_s = last_step_s if last_step_s is not None else phase_s
    ref = run_reference(seed, **ref_args)
    reached = reason.startswith("success rate >=")
    line = (
        f"seed {seed}: start-up {startup_s:.1f} s | {steps} steps, training {train_s:.2f} s ({reason}; "
        f"with the final checkpoint and teardown {phase_s:.2f} s) | whole command {whole:.1f} s "
        f"| reference loop {ref.steps} steps in {ref.seconds:.2f} s{'' if ref.reached else ' (missed the target)'}"
    )
    if not (reached and ref.reached):
        who = "the run" if not reached else "the reference loop"
        print(f"{line} | no ratio: {who} did not reach success {target}", flush=True)
        return None
    print(f"{line} | ratio {train_s / ref.seconds:.2f}", flush=True)
    return seed, startup_s, steps, train_s, whole, ref.steps, ref.seconds, train_s / ref.seconds
