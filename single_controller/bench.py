"""`sc-grpo bench overlap`: how much of the physically possible overlap the controller achieves.

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
