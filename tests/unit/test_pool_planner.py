"""Layer (a): the pool's generation planner (`single_controller/pool/planner.py`), pure, with no asyncio.

Random pools (1-6 slots, 1-3 runs, random gen/train/static slots, residents consistent with the runs'
gen_slots, random demands, a random subset of free slots) drive `targets` and `moves` under both
policies; hand-computed plans pin the numbers."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from single_controller.pool.planner import Move, RunSlots, moves, shares, targets

NAMES = ("A", "B", "C")


@dataclass(frozen=True)
class Pool:
    slots: int
    runs: dict[str, RunSlots]
    free: tuple[int, ...]
    resident: dict[int, str | None]
    demand: dict[str, int]

    def plan(self, policy: str, resident: dict[int, str | None] | None = None) -> dict[int, str | None]:
        return targets(policy, self.free, self.resident if resident is None else resident, self.demand, self.runs)


@st.composite
def pools(draw, *, same_gen_slots: bool = False) -> Pool:
    n = draw(st.integers(1, 6))
    slot_sets = st.sets(st.integers(0, n - 1), min_size=1).map(lambda s: tuple(sorted(s)))
    every = tuple(range(n))
    runs = {}
    for name in NAMES[: draw(st.integers(1, 3))]:
        gen = every if same_gen_slots else draw(slot_sets)
        runs[name] = RunSlots(name, gen, draw(slot_sets), draw(st.none() | slot_sets))
    free = tuple(sorted(draw(st.sets(st.integers(0, n - 1)))))
    resident = {s: draw(st.sampled_from([None, *(r for r in runs if s in runs[r].gen_slots)])) for s in range(n)}
    demand = {r: draw(st.integers(0, 8)) for r in runs}
    return Pool(n, runs, free, resident, demand)


def held(plan: dict[int, str | None], run: str) -> int:
    return sum(1 for r in plan.values() if r == run)


def applied(resident: dict[int, str | None], plan: dict[int, str | None]) -> dict[int, str | None]:
    """`resident` after the plan's moves, shrinks first; a slot filled twice, or a shrink of a worker
    that is not there, fails here."""
    after = dict(resident)
    mv = moves(resident, plan)
    for m in mv.shrinks:
        assert after[m.slot] == m.run, f"shrink of {m} but {after[m.slot]} is resident"
        after[m.slot] = None
    for m in mv.expands:
        assert after[m.slot] is None, f"expand of {m} onto a slot {after[m.slot]} still holds"
        after[m.slot] = m.run
    return after


def has_distinct_slots(runs: dict[str, RunSlots], names: list[str], free: tuple[int, ...]) -> bool:
    """Whether each run of `names` can hold a free slot of its gen_slots, no two the same (Hall)."""
    return any(
        all(s in runs[n].gen_slots for n, s in zip(names, pick, strict=True))
        for pick in itertools.permutations(free, len(names))
    )


# -- both policies -----------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["gap_ratio", "static"])
@settings(max_examples=200, deadline=None)
@given(pool=pools())
def test_a_plan_covers_only_the_free_slots_each_with_a_run_that_may_generate_there(policy, pool):
    plan = pool.plan(policy)
    assert sorted(plan) == list(pool.free)
    for s, r in plan.items():
        assert r is None or s in pool.runs[r].gen_slots, f"slot {s} planned for {r}, not among its gen_slots"


@pytest.mark.parametrize("policy", ["gap_ratio", "static"])
@settings(max_examples=200, deadline=None)
@given(pool=pools())
def test_moves_shrink_every_slot_before_it_is_filled_and_end_at_the_plan(policy, pool):
    plan = pool.plan(policy)
    after = applied(pool.resident, plan)
    assert {s: after[s] for s in plan} == plan
    assert {s: r for s, r in after.items() if s not in plan} == {
        s: r for s, r in pool.resident.items() if s not in plan
    }, "a slot outside the plan (trained on) was moved"
    mv = moves(pool.resident, plan)
    assert len({m.slot for m in mv.shrinks}) == len(mv.shrinks) and len({m.slot for m in mv.expands}) == len(mv.expands)


@pytest.mark.parametrize("policy", ["gap_ratio", "static"])
@settings(max_examples=200, deadline=None)
@given(pool=pools())
def test_planning_again_after_the_moves_with_the_same_demands_moves_nothing(policy, pool):
    plan = pool.plan(policy)
    after = applied(pool.resident, plan)
    again = pool.plan(policy, after)
    assert again == plan
    assert moves(after, again).shrinks == () and moves(after, again).expands == ()


# -- gap_ratio ---------------------------------------------------------------------------------
@settings(max_examples=400, deadline=None)
@given(pool=pools())
def test_gap_ratio_gives_every_run_with_demand_a_slot_when_the_free_slots_allow_one_each(pool):
    wanting = [r for r in pool.runs if pool.demand[r] > 0 and set(pool.free) & set(pool.runs[r].gen_slots)]
    if not has_distinct_slots(pool.runs, wanting, pool.free):
        return  # no plan could: two runs share their only slot, or fewer free slots than runs
    plan = pool.plan("gap_ratio")
    starved = [r for r in wanting if held(plan, r) == 0]
    assert starved == [], f"runs {starved} with demand got no slot: {plan}"


@settings(max_examples=300, deadline=None)
@given(pool=pools(same_gen_slots=True))
def test_gap_ratio_gives_every_run_with_demand_a_slot_when_there_are_as_many_free_slots_as_runs(pool):
    wanting = [r for r in pool.runs if pool.demand[r] > 0]
    plan = pool.plan("gap_ratio")
    if len(pool.free) >= len(wanting):
        assert all(held(plan, r) >= 1 for r in wanting), plan


@settings(max_examples=400, deadline=None)
@given(pool=pools())
def test_gap_ratio_gives_a_run_no_more_than_one_slot_per_group_beyond_what_nobody_else_needs(pool):
    plan = pool.plan("gap_ratio")
    short = {r for r in pool.runs if held(plan, r) < pool.demand[r]}
    for r in pool.runs:
        mine = [s for s, p in plan.items() if p == r]
        gained = [s for s in mine if pool.resident[s] != r]
        if gained:  # a switch onto a slot happens only while the run holds fewer slots than groups demanded
            assert len(mine) <= pool.demand[r], f"{r} took {gained}, holding {mine} for {pool.demand[r]} groups"
        # beyond its demand, a run keeps slots it was on and (that many at least) nobody short of theirs could use
        unwanted = [s for s in mine if not any(s in pool.runs[q].gen_slots for q in short - {r})]
        assert len(unwanted) >= len(mine) - pool.demand[r], (r, mine, short)
    for q in short:  # work-conserving: a run short of its demand finds none of its free slots empty
        assert all(plan[s] is not None for s in pool.free if s in pool.runs[q].gen_slots), (q, plan)


@settings(max_examples=400, deadline=None)
@given(pool=pools())
def test_gap_ratio_never_switches_a_slot_to_a_run_without_demand(pool):
    plan = pool.plan("gap_ratio")
    for s, r in plan.items():
        if r is not None and pool.demand[r] == 0:
            assert pool.resident[s] == r, f"slot {s} switched from {pool.resident[s]} to {r}, which demands nothing"


# -- static ------------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(pool=pools())
def test_static_holds_a_slot_for_a_run_that_owns_it_and_keeps_an_owner_that_is_there(pool):
    plan = pool.plan("static")
    for s, r in plan.items():
        owners = [n for n, rs in pool.runs.items() if rs.owns_statically(s) and s in rs.gen_slots]
        assert (r is None) == (not owners), (s, r, owners)
        assert r is None or r in owners
        if pool.resident[s] in owners:
            assert r == pool.resident[s], f"slot {s} changed from its owner {pool.resident[s]} to {r}"


@settings(max_examples=200, deadline=None)
@given(pool=pools(), demand=st.dictionaries(st.sampled_from(NAMES), st.integers(0, 8)))
def test_static_ignores_demand(pool, demand):
    assert targets("static", pool.free, pool.resident, demand, pool.runs) == pool.plan("static")


# -- by hand -----------------------------------------------------------------------------------
def two(gen=(0, 1, 2, 3)) -> dict[str, RunSlots]:
    return {"A": RunSlots("A", gen, (0,)), "B": RunSlots("B", gen, (2, 3))}


def test_shares_by_hand():
    runs = {**two(), "C": RunSlots("C", (0, 1, 2, 3), (1,))}
    # 9:3 of 4 slots: 9/12*4 = 3, 3/12*4 = 1
    assert shares(4, {"A": 9, "B": 3}, runs) == {"A": 3, "B": 1}
    # 1:7 of 4: 0.5 rounds up to 1 (and at least 1 anyway); 3.5 rounds up to 4
    assert shares(4, {"A": 1, "B": 7}, runs) == {"A": 1, "B": 4}
    # at most one per group: 2:2 of 8 slots is 4:4 by ratio, capped at 2 each
    assert shares(8, {"A": 2, "B": 2}, runs) == {"A": 2, "B": 2}
    # no demand, no share; an unknown run, no share
    assert shares(4, {"A": 0, "B": 5, "Z": 5}, runs) == {"B": 4}
    # 3:3:2 of 4 slots: 1.5, 1.5, 1.0 round half up to 2, 2, 1: 5 targets for 4 slots (the plan gives
    # every run its first slot before any run its second: see the next test)
    assert shares(4, {"A": 3, "B": 3, "C": 2}, runs) == {"A": 2, "B": 2, "C": 1}
    # more runs than slots: one each all the same (the plan serves the largest gaps first)
    assert shares(2, {"A": 1, "B": 1, "C": 1}, runs) == {"A": 1, "B": 1, "C": 1}


def test_gap_ratio_by_hand_keeps_what_is_within_target_and_moves_the_rest():
    runs = two()
    # A 9 groups, B 3 -> shares 3:1. A holds 0-1, B holds 2-3: B keeps slot 2 (its first), slot 3 goes to A
    plan = targets("gap_ratio", [0, 1, 2, 3], {0: "A", 1: "A", 2: "B", 3: "B"}, {"A": 9, "B": 3}, runs)
    assert plan == {0: "A", 1: "A", 2: "B", 3: "A"}
    assert moves({0: "A", 1: "A", 2: "B", 3: "B"}, plan).shrinks == (Move(3, "B"),)
    # B demands nothing: A (2 groups, share 2) takes the empty slots, first 1 (nobody trains there), then 0
    # (its own train slot); B's workers on 2-3 stay where they are, idle (nobody else needs them)
    plan = targets("gap_ratio", [0, 1, 2, 3], {0: None, 1: None, 2: "B", 3: "B"}, {"A": 2, "B": 0}, runs)
    assert plan == {0: "A", 1: "A", 2: "B", 3: "B"}
    # A trains on slot 0 (not free); A 1 group, B 1 group on 3 free slots: share 1.5 -> 2, capped at 1 each.
    # Equal gaps: A first (by name) takes slot 1, which nobody trains on; B then prefers its own train slot 2
    # to slot 3 (also its own) by number; slot 3 stays empty (nobody demands more)
    plan = targets("gap_ratio", [1, 2, 3], dict.fromkeys(range(4)), {"A": 1, "B": 1}, runs)
    assert plan == {1: "A", 2: "B", 3: None}


def test_gap_ratio_by_hand_rounded_up_shares_starve_nobody():
    # 3:3:2 on 4 slots: targets 2, 2, 1 (5 > 4). A holds slots 0-1, B 2-3, C none. First one each: A on 0,
    # B on 2 (their first), C takes a donor's slot: 1 (its own train slot) before 3 (B's train slot). Then B
    # keeps slot 3 (within its target 2); A stays at 1 of its 2
    runs = {**two(), "C": RunSlots("C", (0, 1, 2, 3), (1,))}
    plan = targets("gap_ratio", [0, 1, 2, 3], {0: "A", 1: "A", 2: "B", 3: "B"}, {"A": 3, "B": 3, "C": 2}, runs)
    assert plan == {0: "A", 1: "C", 2: "B", 3: "B"}
    # only slots 0-1 free (2-3 trained on), A 3 groups, C 1: targets 3/4*2 + 0.5 -> 2 and 1/4*2 + 0.5 -> 1.
    # A is on both: it keeps its first, C takes the other
    plan = targets("gap_ratio", [0, 1], {0: "A", 1: "A"}, {"A": 3, "C": 1}, runs)
    assert plan == {0: "A", 1: "C"}


def test_gap_ratio_by_hand_a_run_with_one_possible_slot_is_not_crowded_out():
    # C may generate only on slot 0; A (8 groups) on 0 and 1, where it is. Targets on the 2 free slots for
    # 8:1: 16/9 + 0.5 -> 2 for A, 1/9*2 + 0.5 -> 0, at least 1, for C. A starts on slot 0 (its first); C's
    # only slot is 0, so A moves over to slot 1, its other one, and C gets slot 0
    runs = {"A": RunSlots("A", (0, 1), (0,)), "C": RunSlots("C", (0,), (1,))}
    plan = targets("gap_ratio", [0, 1], {0: "A", 1: "A"}, {"A": 8, "C": 1}, runs)
    assert plan == {0: "C", 1: "A"}
    # nobody on them: A (may use 0-1, trains on 2) and B (only 0, trains on 1), 2:1 groups on 3 free slots:
    # targets 2/3*3 + 0.5 -> 2 and 1. One each, A first (by name): slot 0 (nobody trains there; 1 is B's
    # train slot); B's only slot is 0: A moves over to 1. A's second: none left that B could do without
    runs = {"A": RunSlots("A", (0, 1), (2,)), "B": RunSlots("B", (0,), (1,))}
    plan = targets("gap_ratio", [0, 1, 2], dict.fromkeys(range(3)), {"A": 2, "B": 1}, runs)
    assert plan == {0: "B", 1: "A", 2: None}


def test_gap_ratio_by_hand_a_plan_is_where_planning_again_ends():
    # A may use 1-4, B 0-1 (trains on 0-1); 0-2 free; 3:2 groups: targets 3/5*3 + 0.5 -> 2 and 2/5*3 + 0.5 -> 1.
    # One each: A on 2 (nobody's train slot), B on 1 (its own train slot; 0 is A's). A's second: only slot 1
    # is A's, and B can move to 0, so it does: A 1-2, B 0. Planned again from there, nothing moves (B on 1 and
    # A on 2 with B's work-conserving second slot on 0 would give slot 1 to A the next time round)
    runs = {"A": RunSlots("A", (1, 2, 3, 4), (0,)), "B": RunSlots("B", (0, 1), (0, 1))}
    plan = targets("gap_ratio", [0, 1, 2], dict.fromkeys(range(5)), {"A": 3, "B": 2}, runs)
    assert plan == {0: "B", 1: "A", 2: "A"}
    assert targets("gap_ratio", [0, 1, 2], {**dict.fromkeys(range(5)), **plan}, {"A": 3, "B": 2}, runs) == plan


def test_an_unknown_policy_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown pool policy 'fifo' .one of: gap_ratio, static"):
        targets("fifo", [0], {0: None}, {}, two())
