"""Benchmarks: `sc-grpo bench overlap` (below) and `sc-grpo bench eval` (at the end of the file).

`sc-grpo bench overlap`: how much of the physically possible overlap the controller achieves.

Runs the controller on the simulated backend twice in one process, with generation time per step
equal to training time per step: synchronous (L = 0, no streaming: one chunk per step) and
asynchronous (L = 1, streaming chunks). Prints the async/sync throughput ratio, that ratio divided
by the physical limit (T_gen + T_train) / max(T_gen, T_train), and the commit -> select latency
(p50 / p99) measured when the train pump was waiting for the group that completed its chunk.
Throughput is steady state: steps per second between the end of the first and the last step,
so the one-step pipeline fill of the async run is not counted against either mode. The simulated
trainer does not read its rows here: in a real run trainers read them in their own processes, and
in this single-threaded simulation the reads would be billed to the controller.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import replace

from replay.storage import InMemoryRowStorage
from single_controller.backends.sim import sim_prompts, sim_workers
from single_controller.config import (
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
    ap = argparse.ArgumentParser(prog="sc-grpo bench overlap", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--groups", type=int, default=16, help="prompt groups per step")
    ap.add_argument("--t-gen", type=float, default=0.08, help="generation seconds per step")
    ap.add_argument("--t-train", type=float, default=0.08, help="training seconds per step")
    ap.add_argument("--chunk", type=int, default=4, help="min groups per chunk in async mode")
    ap.add_argument("--lookahead", type=int, default=1, help="max_lookahead_versions L of the async mode")
    args = ap.parse_args(argv)

    sync_cfg = overlap_config(args.steps, args.groups, lookahead=0, chunk=args.groups)
    async_cfg = overlap_config(args.steps, args.groups, lookahead=args.lookahead, chunk=args.chunk)
    sync_tp, sync_wall, _ = asyncio.run(_run_once(sync_cfg, args.t_gen, args.t_train))
    async_tp, async_wall, ctl = asyncio.run(_run_once(async_cfg, args.t_gen, args.t_train))
    limit = (args.t_gen + args.t_train) / max(args.t_gen, args.t_train)
    ratio = async_tp / sync_tp
    p50, p99 = ctl.select_latency_percentiles()
    print(
        f"T_gen/step {args.t_gen * 1e3:.0f} ms, T_train/step {args.t_train * 1e3:.0f} ms, {args.groups} groups/step, "
        f"{args.steps} steps (simulated workers in this process; the fake trainer does not read rows)"
    )
    print(f"sync  (L=0, one chunk/step): {sync_tp:.2f} steps/s steady state, wall {sync_wall:.2f} s")
    print(f"async (L={args.lookahead}, chunks of >= {args.chunk}): {async_tp:.2f} steps/s steady state, wall {async_wall:.2f} s")
    print(f"async/sync throughput ratio: {ratio:.3f}")
    print(f"physical limit (T_gen + T_train) / max(T_gen, T_train): {limit:.3f}")
    print(f"ratio / limit: {ratio / limit:.3f} (target >= 0.95)")
    print(f"commit->select latency (train pump waiting): p50 {p50 * 1e3:.3f} ms, p99 {p99 * 1e3:.3f} ms (target p99 < 1 ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main_overlap())


# ---------------------------------------------------------------------------------------------
# `sc-grpo bench eval`
EVAL_BENCH_DOC = """`sc-grpo bench eval`: training throughput with held-out evaluation on vs off.

Trains the same configuration (default configs/embedded.yaml on the embedded torch backend, a fixed
number of steps, no early stop) with eval off and with eval every N steps, alternating, in one
invocation and one Ray session, and prints steps/s over each run (from the first step's start to the
last step's end; the end-of-run eval after the last step is reported apart) and the ratio
eval-on / eval-off (target >= 0.9). `--backend sim` runs the orchestration alone on simulated workers.
"""


async def _eval_bench_run(cfg: Config, runner) -> dict:
    """One run through a ControllerService (a Ray actor for the torch backend, in-process for sim)."""
    from single_controller.deadlines import within

    svc, dispose = runner(cfg)
    try:
        await within(svc("setup"), cfg.timeouts.setup_s, "bench: controller setup")
        t0 = time.perf_counter()
        summary = await svc("run")
        wall = time.perf_counter() - t0
        records, _ = await svc("next_records", 0)
    finally:
        try:
            await within(svc("close"), 60, "bench: controller close")
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
    from single_controller.config_loader import load_config

    ap = argparse.ArgumentParser(prog="sc-grpo bench eval", description=EVAL_BENCH_DOC.splitlines()[0])
    ap.add_argument("--config", default="configs/embedded.yaml", help="the training configuration")
    ap.add_argument("--steps", type=int, default=60, help="RL steps per run (early stop off)")
    ap.add_argument("--every", type=int, default=10, help="eval.every_steps of the eval-on runs")
    ap.add_argument("--repeats", type=int, default=1, help="off/on pairs, alternating (the ratio of the summed times)")
    ap.add_argument("--backend", choices=["torch", "sim"], default=None, help="both roles on this backend (default: the config's)")
    ap.add_argument("overrides", nargs="*", help="config overrides (key=value) for both runs")
    args = ap.parse_args(argv)
    common = [f"run.max_steps={args.steps}", "run.stop_at_success_rate=null", "run.progress_bar=false", "run.plot=false", "metrics.enabled=false", *args.overrides]
    if args.backend == "sim":
        common += ["backend.generation=sim", "backend.trainer=sim", "storage.kind=memory"]
    elif args.backend == "torch":
        common += ["backend.generation=torch", "backend.trainer=torch"]
    off = load_config(args.config, common + ["eval.enabled=false"])
    on = load_config(args.config, common + ["eval.enabled=true", f"eval.every_steps={args.every}"])
    print(EVAL_BENCH_DOC.strip().splitlines()[0])
    print(f"{args.steps} steps per run, eval every {args.every} steps ({on.eval.num_prompts} held-out prompts x {on.eval.num_samples} sample(s)), backend {on.backend.generation}/{on.backend.trainer}, {args.repeats} pair(s)")

    async def pairs(runner) -> list[tuple[dict, dict]]:
        out = []
        for i in range(args.repeats):
            r_off = await _eval_bench_run(off, runner)
            print(f"  pair {i}: eval off {r_off['steps_per_s']:.3f} steps/s ({r_off['train_s']:.1f} s)", flush=True)
            r_on = await _eval_bench_run(on, runner)
            print(
                f"  pair {i}: eval on  {r_on['steps_per_s']:.3f} steps/s ({r_on['train_s']:.1f} s; {r_on['evals']} evals, "
                f"{r_on['eval_s']:.2f} s in eval rounds, {r_on['reissued']} re-issued, final accuracy {r_on['final_accuracy']})",
                flush=True,
            )
            out.append((r_off, r_on))
        return out

    if on.backend.generation == "sim":
        from single_controller.service import ControllerService

        def local(cfg):
            svc = ControllerService(cfg)
            return (lambda method, *a: getattr(svc, method)(*a)), (lambda: None)

        results = asyncio.run(pairs(local))
    else:
        import ray

        from single_controller.ray_runtime import ray_session, worker_env
        from single_controller.service import ControllerService

        def actor(cfg):
            handle = ray.remote(num_cpus=0, num_gpus=0)(ControllerService).options(max_concurrency=64).remote(cfg)
            return (lambda method, *a: getattr(handle, method).remote(*a)), (lambda: ray.kill(handle))

        min_cpus = 1 + on.storage.num_storage_units + 1
        with ray_session(on.ray, min_cpus=min_cpus, env_vars=worker_env(on.backend.torch_threads)) as session:
            results = session.run(pairs(actor))
    steps_off = sum(r["steps"] for r, _ in results)
    steps_on = sum(r["steps"] for _, r in results)
    tp_off = steps_off / sum(r["train_s"] for r, _ in results)
    tp_on = steps_on / sum(r["train_s"] for _, r in results)
    ratio = tp_on / tp_off
    print(f"eval off: {tp_off:.3f} steps/s; eval on (every {args.every}): {tp_on:.3f} steps/s")
    print(f"throughput ratio eval-on / eval-off: {ratio:.3f} (target >= 0.9)")
    return 0
