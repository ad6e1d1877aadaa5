"""The pool's generation planner: which run's generation worker each free slot should hold.

Pure functions over a snapshot of the pool (no clock, no awaits), so that every interleaving the
scheduler can meet is a plain input here (`tests/test_pool_planner.py` drives them with hypothesis).

A *free* slot is one no run trains on. Each run has one generation worker per slot of its
`gen_slots`; at most one worker is resident on a slot. Demand is a run's generation demand in
groups (what it has in flight plus what it could admit now), pushed by the run on change.

Policies:

* `static`: a slot of a run's `static_slots` holds that run's worker whenever it is free, whatever
  the demand (the baselines: a split by run, or by role when train and generation slots are apart).
* `gap_ratio` (RLix's planner): each run with demand gets a target share of the free slots
  proportional to its demand, at least one slot and at most one per group it demands; slots are
  kept where they are when their run is within its target (no needless switch), then handed to the
  run furthest below its target, normalized ((target - held) / target), donors being the runs above
  theirs; what is left goes to runs whose demand is still not covered by one worker per group, the
  largest shortfall first; a slot nobody needs keeps its resident (idle: switching would cost and
  buy nothing). Among the slots a run may take: one it holds, then an empty one, then a donor's;
  then one nobody trains on, then its own train slot, then another run's train slot (generation
  there is preempted at that run's next train grant).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

POLICIES = ("gap_ratio", "static")


@dataclass(frozen=True)
class RunSlots:
    """One run's place in the pool: a generation worker on each of `gen_slots`; training on
    `train_slots` (granted before generation, never preempted); `static_slots`: the slots its
    workers hold under the `static` policy (by default its `gen_slots`)."""

    name: str
    gen_slots: tuple[int, ...]
    train_slots: tuple[int, ...]
    static_slots: tuple[int, ...] | None = None

    def owns_statically(self, slot: int) -> bool:
        return slot in (self.gen_slots if self.static_slots is None else self.static_slots)


@dataclass(frozen=True)
class Move:
    slot: int
    run: str


@dataclass(frozen=True)
class Moves:
    """What a plan changes: every shrink is done before any expand (a slot is emptied before it is
    filled: at most one resident worker per slot)."""

    shrinks: tuple[Move, ...]
    expands: tuple[Move, ...]


def targets(
    policy: str,
    free: Sequence[int],
    resident: Mapping[int, str | None],
    demand: Mapping[str, int],
    runs: Mapping[str, RunSlots],
) -> dict[int, str | None]:
    """The run each free slot should hold (None: no worker), under `policy`; `demand`: the groups
    each run could generate now."""
    if policy == "static":
        return {s: _static_owner(s, resident.get(s), runs) for s in free}
    if policy == "gap_ratio":
        return _gap_ratio(free, resident, demand, runs)
    raise ValueError(f"unknown pool policy {policy!r} (one of: {', '.join(POLICIES)})")


def _static_owner(slot: int, current: str | None, runs: Mapping[str, RunSlots]) -> str | None:
    owners = [r.name for r in runs.values() if r.owns_statically(slot) and slot in r.gen_slots]
    return current if current in owners else (owners[0] if owners else None)


def shares(free_count: int, demand: Mapping[str, int], runs: Mapping[str, RunSlots]) -> dict[str, int]:
    """Each run's target number of free slots: demand-proportional (round half up), at least 1 for
    a run with demand, at most one per group demanded."""
    eligible = {n: d for n, d in demand.items() if d > 0 and n in runs}
    total = sum(eligible.values())
    return {n: max(1, min(d, math.floor(d / total * free_count + 0.5))) for n, d in eligible.items()}


def _gap_ratio(
    free: Sequence[int], resident: Mapping[int, str | None], demand: Mapping[str, int], runs: Mapping[str, RunSlots]
) -> dict[int, str | None]:
    target_n = shares(len(free), demand, runs)
    plan: dict[int, str | None] = {}
    held = dict.fromkeys(runs, 0)
    for s in free:  # kept where they are while within target
        r = resident.get(s)
        if r in target_n and held[r] < target_n[r]:
            plan[s] = r
            held[r] += 1
    open_slots = [s for s in free if s not in plan]
    _hand_out(open_slots, plan, held, target_n, runs, resident, gap=True)
    # work-conserving: what is left goes to runs demanding more groups than they hold workers
    cap = {n: max(0, demand.get(n, 0)) for n in runs}
    _hand_out(open_slots, plan, held, cap, runs, resident, gap=False)
    for s in open_slots:
        plan[s] = resident.get(s)  # nobody needs it: the resident stays (idle), no switch
    return plan


def _hand_out(
    open_slots: list[int],
    plan: dict[int, str | None],
    held: dict[str, int],
    want: Mapping[str, int],
    runs: Mapping[str, RunSlots],
    resident: Mapping[int, str | None],
    *,
    gap: bool,
) -> None:
    """Give `open_slots` one at a time to the run furthest below `want` (normalized gap, or the
    absolute shortfall when not `gap`) that can use one; removes them from `open_slots`."""
    while True:
        needy = [n for n in want if held[n] < want[n] and any(s in runs[n].gen_slots for s in open_slots)]
        if not needy:
            return
        n = max(needy, key=lambda n: ((want[n] - held[n]) / (want[n] if gap else 1), want[n], _neg(n)))
        slot = min((s for s in open_slots if s in runs[n].gen_slots), key=lambda s: _slot_cost(s, n, resident, runs))
        plan[slot] = n
        held[n] += 1
        open_slots.remove(slot)


def _neg(name: str) -> tuple[int, ...]:
    return tuple(-ord(c) for c in name)  # ties go to the name first in order


def _slot_cost(slot: int, run: str, resident: Mapping[int, str | None], runs: Mapping[str, RunSlots]) -> tuple:
    """Prefer a slot the run holds already (no switch), then an empty one, then a donor's; among
    those, one nobody trains on, then the run's own train slot, then another run's."""
    r = resident.get(slot)
    others_train = any(slot in o.train_slots for o in runs.values() if o.name != run)
    return (0 if r == run else 1 if r is None else 2, 2 if others_train else int(slot in runs[run].train_slots), slot)


def moves(resident: Mapping[int, str | None], plan: Mapping[int, str | None]) -> Moves:
    """The shrinks and expands that turn `resident` into `plan`."""
    shrinks = tuple(Move(s, r) for s, r in sorted(resident.items()) if r is not None and s in plan and plan[s] != r)
    expands = tuple(Move(s, r) for s, r in sorted(plan.items()) if r is not None and resident.get(s) != r)
    return Moves(shrinks, expands)
