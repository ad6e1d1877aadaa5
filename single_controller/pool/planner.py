"""The pool's generation planner: which run's generation worker each free slot should hold.

Pure functions over a snapshot of the pool (no clock, no awaits), so that every interleaving the
scheduler can meet is a plain input here (`tests/unit/test_pool_planner.py` drives them with hypothesis).

A *free* slot is one no run trains on. Each run has one generation worker per slot of its
`gen_slots`; at most one worker is resident on a slot. Demand is a run's generation demand in
groups (what it has in flight plus what it could admit now), pushed by the run on change.

Policies:

* `static`: a slot of a run's `static_slots` holds that run's worker whenever it is free, whatever
  the demand (the baselines: a split by run, or by role when train and generation slots are apart).
* `gap_ratio` (RLix's planner): each run with demand gets a target share of the free slots
  proportional to its demand, at least one slot and at most one per group it demands. First every
  run with demand gets one slot, each its own, wherever some assignment can give them that (rounded-up
  targets may add up to more than the free slots; a run may generate on few slots); then slots are
  kept where they are when their run is within its target (no needless switch), then handed to the
  run furthest below its target, normalized ((target - held) / target), donors being the runs above
  theirs; what is left goes to runs whose demand is still not covered by one worker per group, the
  largest shortfall first; a slot nobody needs keeps its resident (idle: switching would cost and
  buy nothing). A run that can use no open slot takes one planned for a run that moves to another
  open slot of its own (an augmenting path: nobody loses a slot), so no greedy choice starves a run
  or leaves a plan that planning again would change. Among the slots a run may take: one it holds,
  then an empty one, then a donor's; then one nobody trains on, then its own train slot, then
  another run's train slot (generation there is preempted at that run's next train grant).
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
    plan: dict[int, str] = {}
    for s in free:  # every run with demand starts on the first slot it holds
        r = resident.get(s)
        if r in target_n and r not in plan.values():
            plan[s] = r
    _hand_out(free, plan, dict.fromkeys(target_n, 1), runs, resident, gap=False)  # one each first
    held = dict.fromkeys(runs, 0)
    for r in plan.values():
        held[r] += 1
    for s in free:  # kept where they are while within target
        r = resident.get(s)
        if s not in plan and r in target_n and held[r] < target_n[r]:
            plan[s] = r
            held[r] += 1
    _hand_out(free, plan, target_n, runs, resident, gap=True)
    # work-conserving: what is left goes to runs demanding more groups than they hold workers
    _hand_out(free, plan, {n: max(0, demand.get(n, 0)) for n in runs}, runs, resident, gap=False)
    # a slot nobody needs keeps its resident (idle), no switch
    return {s: plan[s] if s in plan else resident.get(s) for s in free}


def _hand_out(
    free: Sequence[int],
    plan: dict[int, str],
    want: Mapping[str, int],
    runs: Mapping[str, RunSlots],
    resident: Mapping[int, str | None],
    *,
    gap: bool,
) -> None:
    """Give slots one at a time to the run furthest below `want` (normalized gap, or the absolute
    shortfall when not `gap`) that can get one (`_place`), until none can."""
    held = {n: sum(1 for r in plan.values() if r == n) for n in want}
    stuck: set[str] = set()  # no slot can be found for it (and none will: slots are only filled)
    while True:
        needy = [n for n in want if held[n] < want[n] and n not in stuck]
        if not needy:
            return
        n = max(needy, key=lambda n: ((want[n] - held[n]) / (want[n] if gap else 1), want[n], _neg(n)))
        if _place(n, free, plan, resident, runs, set()):
            held[n] += 1
        else:
            stuck.add(n)


def _place(
    run: str,
    free: Sequence[int],
    plan: dict[int, str],
    resident: Mapping[int, str | None],
    runs: Mapping[str, RunSlots],
    seen: set[int],
) -> bool:
    """One more free slot of its gen_slots for `run`: an open one (the cheapest by `_slot_cost`), or
    else one planned for another run that moves to another slot of its own, and so on (an augmenting
    path): no run loses a slot, and a run whose only slots others could do without gets one."""
    usable = [s for s in free if s in runs[run].gen_slots and plan.get(s) != run]
    for s in sorted(usable, key=lambda s: (s in plan, _slot_cost(s, run, resident, runs))):
        if s in seen:
            continue
        seen.add(s)
        if s not in plan or _place(plan[s], free, plan, resident, runs, seen):
            plan[s] = run
            return True
    return False


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
