"""`sc-grpo bench pool`: two runs sharing S slots, against the two static splits, in one invocation.

Each run is a real controller on simulated workers tied to one in-process pool scheduler (the
shrink / expand / train-grant path of a pooled run, with scripted compute in slot-seconds per step).
Layouts (S = 4): shared (`gap_ratio`), static by run (A owns 0-1, B 2-3) and static by role (0-1
generate, 2-3 train). Printed per layout: makespan, slot busy fraction and its ratio to the physical
limit, switching overhead, preempted groups and Jain's fairness; the shared makespan over the better
static split is the acceptance figure (docs/pool.md).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from replay.storage import InMemoryRowStorage
from single_controller.backends.sim import Faults, sim_prompts, sim_workers
from single_controller.config.schema import (
    BackendConfig,
    Config,
    RolloutConfig,
    RunConfig,
    SamplerConfig,
    StorageConfig,
    TimeoutConfig,
    TrainConfig,
)
from single_controller.controller import Controller
from single_controller.pool.link import InProcessPool, PoolLink
from single_controller.pool.planner import RunSlots
from single_controller.pool.scheduler import PoolScheduler
from single_controller.state import Workers

SLEEP_LEVEL = 1


@dataclass(frozen=True)
class SimRun:
    name: str
    gen: float  # slot-seconds of generation per step, in units
    train: float  # slot-seconds of training per step, in units
    slots: RunSlots


@dataclass(frozen=True)
class Layout:
    name: str
    policy: str
    runs: tuple[SimRun, ...]


def layouts(mix: str, b_size: float = 1.0) -> list[Layout]:
    """The three layouts of a mix; `b_size`: run B's work per step relative to A's. Each run's train
    slots are sized to its training share of the two slots a split by run gives it (half up: A 1:3
    -> 1 slot, B 3:1 -> 2 slots, 2:2 -> 1 slot), and are the first of those two slots."""
    a, b = ((3.0, 1.0), (1.0, 3.0)) if mix == "heterogeneous" else ((2.0, 2.0), (2.0, 2.0))
    b = (b[0] * b_size, b[1] * b_size)
    every = (0, 1, 2, 3)

    def train_slots(work: tuple[float, float], first: int) -> tuple[int, ...]:
        n = max(1, min(2, math.floor(2 * work[1] / (work[0] + work[1]) + 0.5)))
        return tuple(range(first, first + n))

    ta, tb = train_slots(a, 0), train_slots(b, 2)

    def pair(a_slots: RunSlots, b_slots: RunSlots) -> tuple[SimRun, ...]:
        return SimRun("A", *a, a_slots), SimRun("B", *b, b_slots)

    return [
        Layout("shared (gap_ratio)", "gap_ratio", pair(RunSlots("A", every, ta), RunSlots("B", every, tb))),
        Layout("static by run", "static", pair(RunSlots("A", (0, 1), ta), RunSlots("B", (2, 3), tb))),
        # by role: slots 0-1 generate (one per run), slots 2-3 train (one per run)
        Layout("static by role", "static", pair(RunSlots("A", (0,), (2,)), RunSlots("B", (1,), (3,)))),
    ]


def lower_bound(layout: Layout, steps: int, lookahead: int, unit_s: float) -> float:
    """No schedule of `layout` ends sooner: the slots' total work over S, and each run's own chain
    (its training steps one after the other, plus its generation between them with lookahead 0, or
    the first step's alone with lookahead >= 1: generation overlaps training then)."""
    chains = []
    for r in layout.runs:
        gen, train = r.gen / len(r.slots.gen_slots), r.train / len(r.slots.train_slots)
        chains.append((steps * (gen + train) if lookahead == 0 else gen + steps * train) * unit_s)
    total = sum(r.gen + r.train for r in layout.runs) * steps * unit_s
    return max(total / 4, *chains)


def _config(steps: int, groups: int, lookahead: int) -> Config:
    return Config(
        run=RunConfig(max_steps=steps, progress_bar=False, plot=False),
        rollout=RolloutConfig(
            group_size=2, max_in_flight_groups=4 * groups, max_in_flight_per_worker=2, sleep_level=SLEEP_LEVEL
        ),
        train=TrainConfig(groups_per_step=groups, min_groups_per_chunk=groups),
        sampler=SamplerConfig(max_lookahead_versions=lookahead, max_staleness_versions=lookahead),
        backend=BackendConfig(generation="sim", trainer="sim"),
        storage=StorageConfig(kind="memory"),
        timeouts=TimeoutConfig(generate_s=60, train_call_s=60, weight_sync_s=60, storage_s=60),
    )


def _slow_wake(worker, switch_s: float) -> None:
    wake = worker.wake

    async def slow_wake() -> None:
        await asyncio.sleep(switch_s)
        await wake()

    worker.wake = slow_wake


async def run_layout(
    layout: Layout,
    *,
    steps: int,
    groups: int,
    lookahead: int,
    unit_s: float,
    switch_s: float,
    watch: Callable[[PoolScheduler, list[PoolLink]], None] | None = None,
):
    """Both runs of `layout` to the end in one pool; returns their figures. `watch(pool, links)`, if
    given, sees the pool and the runs before they start (the tests check their calls)."""
    pool = PoolScheduler(4, layout.policy)
    links, gens = [], []
    for r in layout.runs:
        storage = InMemoryRowStorage()
        g, trainer = sim_workers(
            storage,
            num_generators=len(r.slots.gen_slots),
            gen_group_s=r.gen * unit_s / groups,
            train_group_s=r.train * unit_s / len(r.slots.train_slots) / groups,
            faults=Faults(),
            keep_logs=False,
        )
        for w in g:
            _slow_wake(w, switch_s)
        ctl = Controller(_config(steps, groups, lookahead), sim_prompts(), storage, Workers(g, trainer))
        links.append(PoolLink(ctl, InProcessPool(pool), r.slots, SLEEP_LEVEL))
        gens.append(g)
    if watch is not None:
        watch(pool, links)
    ends: dict[str, float] = {}
    t0 = time.perf_counter()

    async def one(link: PoolLink) -> None:
        await link.run()
        ends[link.spec.name] = time.perf_counter() - t0

    async with asyncio.TaskGroup() as tg:
        serving = tg.create_task(pool.serve())
        async with asyncio.TaskGroup() as runs:
            for link in links:
                runs.create_task(one(link))
        pool.close()
    await serving
    return _figures(layout, pool, links, ends, steps=steps, unit_s=unit_s)


def _figures(layout: Layout, pool: PoolScheduler, links, ends, *, steps: int, unit_s: float) -> dict:
    makespan = max(ends.values())
    useful = sum(r.gen + r.train for r in layout.runs) * steps * unit_s
    preempted = sum(link.ctl.state.elastic.preempted_groups for link in links)
    wasted = sum(
        link.ctl.state.elastic.preempted_groups * r.gen * unit_s / link.ctl.cfg.train.groups_per_step
        for link, r in zip(links, layout.runs, strict=True)
    )
    s = pool.statistics()
    return {
        "makespan_s": makespan,
        "ends": ends,
        "busy": (useful + wasted) / (4 * makespan),
        "of_limit": useful / 4 / makespan,
        "switching": s.switch_s / (4 * makespan),
        "preempted": preempted,
        "resizes": s.shrinks + s.expands,
        "max_train_wait_s": s.max_train_wait_s,
    }


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="sc-grpo bench pool", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8, help="K: steps each run trains")
    p.add_argument("--groups", type=int, default=12, help="groups per step")
    p.add_argument("--lookahead", type=int, default=1, help="sampler.max_lookahead_versions of both runs")
    p.add_argument("--unit-ms", type=float, default=100.0, help="wall time of one unit of work (slot-seconds)")
    p.add_argument("--switch-ms", type=float, default=5.0, help="cost of one expand (wake + weights)")
    p.add_argument(
        "--b-sizes", default="1,0.5", help="run B's work per step relative to A's, one heterogeneous mix each"
    )
    args = p.parse_args(argv)
    print(
        f"bench pool: S=4 slots, K={args.steps} steps per run, {args.groups} groups per step, lookahead "
        f"{args.lookahead}, unit {args.unit_ms:g} ms, expand {args.switch_ms:g} ms, sim workers"
    )
    for size in (float(x) for x in args.b_sizes.split(",")):
        _print_mix("heterogeneous", size, args)
    _print_mix("symmetric", 1.0, args)
    return 0


def _print_mix(mix: str, b_size: float, args: argparse.Namespace) -> None:
    kw = dict(steps=args.steps, groups=args.groups, lookahead=args.lookahead, unit_s=args.unit_ms / 1e3)
    lays = layouts(mix, b_size)
    results = {lay.name: asyncio.run(run_layout(lay, switch_s=args.switch_ms / 1e3, **kw)) for lay in lays}
    work = ", ".join(f"{r.name} gen:train {r.gen:g}:{r.train:g} units" for r in lays[0].runs)
    print(f"\n{mix} mix ({work} per step)")
    print(
        f"{'layout':<20} {'makespan s':>10} {'bound s':>8} {'busy':>6} {'of limit':>8} {'switch':>7} "
        f"{'preempt':>7} {'fair':>5}"
    )
    by_run = results["static by run"]["ends"]
    for lay in lays:
        f = results[lay.name]
        fair = jain([by_run[r] / f["ends"][r] for r in by_run])
        bound = lower_bound(lay, args.steps, args.lookahead, args.unit_ms / 1e3)
        print(
            f"{lay.name:<20} {f['makespan_s']:>10.3f} {bound:>8.3f} {f['busy']:>6.3f} {f['of_limit']:>8.3f} "
            f"{f['switching']:>7.3f} {f['preempted']:>7d} {fair:>5.2f}"
        )
    shared = results["shared (gap_ratio)"]["makespan_s"]
    best = min(f["makespan_s"] for n, f in results.items() if n.startswith("static"))
    print(f"shared / better static split: {shared / best:.3f}")
