"""Layer (a): the group ledger, the prompt ledger and the staleness sampler, with no asyncio.

The state machine test drives arbitrary interleavings of dispatch / commit / ready / select /
evict / drop / version bumps / failures and checks the invariants after every step.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from replay.ledger import TERMINAL, CapacityError, GroupLedger, GroupState, LedgerError, PromptLedger, _record_dict
from samplers.staleness import StalenessSampler
from single_controller.algorithm.advantages import grpo_advantages, is_zero_variance
from single_controller.config.schema import SamplerConfig
from single_controller.types import GenerationResult, Prompt


def prompt(i: int) -> Prompt:
    return Prompt(f"p{i}", (1, 2, 3), "x")


def result(group_id: str, version: int, G: int = 2) -> GenerationResult:
    return GenerationResult(group_id, (0.0, 1.0)[:G] + (0.5,) * max(0, G - 2), (3,) * G, 4, version, version)


# -- GRPO math: values derived by hand --------------------------------------------------------
def test_grpo_advantages_by_hand():
    # rewards [0, 1, 1, 0]: mean 0.5, population std 0.5 -> [-1, 1, 1, -1] (eps 0)
    assert grpo_advantages([0, 1, 1, 0], normalize_std=True, eps=0.0) == pytest.approx((-1, 1, 1, -1))
    # [1, 2, 3]: mean 2, std sqrt(2/3)=0.8165 -> (-1.2247, 0, 1.2247)
    assert grpo_advantages([1, 2, 3], normalize_std=True, eps=0.0) == pytest.approx((-1.224745, 0, 1.224745), abs=1e-6)
    # mean only: [1, 2, 3] -> (-1, 0, 1)
    assert grpo_advantages([1, 2, 3], normalize_std=False, eps=1e-4) == pytest.approx((-1, 0, 1))
    # all equal: zero advantages, no division blow-up thanks to eps
    assert grpo_advantages([0.5] * 4, normalize_std=True, eps=1e-4) == (0.0,) * 4
    assert is_zero_variance([0.5] * 4) and not is_zero_variance([0.5, 0.25])


# -- ledger transitions ---------------------------------------------------------------------
def test_capacity_counts_resident_rows_until_release():
    led = GroupLedger(capacity=2, group_size=2, groups_per_step=2, max_steps=5)
    a = led.reserve(prompt(0), attempt=0, target_step=0, policy_version=0, now=0)
    b = led.reserve(prompt(1), attempt=0, target_step=0, policy_version=0, now=0)
    with pytest.raises(CapacityError):
        led.reserve(prompt(2), attempt=0, target_step=1, policy_version=0, now=0)
    for g in (a, b):
        led.commit(g.group_id, result(g.group_id, 0), 1)
        led.mark_ready(g.group_id, (0.0, 0.0), 2)
    led.select([a.group_id, b.group_id], 0, 3)
    assert not led.has_capacity(), "selected groups still hold their rows"
    led.mark_trained(a.group_id, 0)
    assert not led.has_capacity(), "trained but not yet cleared still holds the slot"
    led.release(a.group_id)
    assert led.has_capacity()
    with pytest.raises(LedgerError):
        led.release(a.group_id)
    with pytest.raises(LedgerError):
        led.release(b.group_id)  # not terminal: its rows may still be needed


def test_refill_targets_the_step_a_dropped_group_was_meant_for():
    led = GroupLedger(capacity=10, group_size=2, groups_per_step=2, max_steps=3)
    gs = [
        led.reserve(prompt(i), attempt=0, target_step=led.next_target_step(), policy_version=0, now=0) for i in range(4)
    ]
    assert [g.target_step for g in gs] == [0, 0, 1, 1]
    assert led.next_target_step() == 2
    led.drop(gs[1].group_id, "generation_failed")
    assert led.next_target_step() == 0
    g = led.reserve(prompt(9), attempt=0, target_step=0, policy_version=0, now=0)
    assert g.target_step == 0 and led.next_target_step() == 2
    led.reserve(prompt(10), attempt=0, target_step=2, policy_version=0, now=0)
    led.reserve(prompt(11), attempt=0, target_step=2, policy_version=0, now=0)
    assert led.next_target_step() is None  # every step < max_steps is full


def test_illegal_transitions_raise():
    led = GroupLedger(capacity=4, group_size=2, groups_per_step=2, max_steps=2)
    g = led.reserve(prompt(0), attempt=0, target_step=0, policy_version=0, now=0)
    with pytest.raises(LedgerError):
        led.mark_ready(g.group_id, (0.0, 0.0), 0)  # not committed
    with pytest.raises(LedgerError):
        led.select([g.group_id], 0, 0)
    with pytest.raises(LedgerError):
        led.commit(g.group_id, result(g.group_id, 0, G=3), 0)  # wrong group size
    with pytest.raises(LedgerError):
        led.reserve(prompt(0), attempt=0, target_step=0, policy_version=0, now=0)  # same attempt twice
    led.drop(g.group_id, "x")
    with pytest.raises(LedgerError):
        led.drop(g.group_id, "again")


def test_a_refused_transition_names_the_group_and_its_state_and_changes_nothing():
    led = GroupLedger(capacity=4, group_size=2, groups_per_step=2, max_steps=2)
    a, b = (led.reserve(prompt(i), attempt=0, target_step=0, policy_version=0, now=0) for i in (0, 1))
    led.commit(a.group_id, result(a.group_id, 0), 1)
    led.mark_ready(a.group_id, (1.0, -1.0), 2)
    with pytest.raises(LedgerError, match=r"commit\(p0-a0\): state ready, expected reserved"):
        led.commit(a.group_id, result(a.group_id, 0), 3)
    with pytest.raises(LedgerError, match=r"mark_ready\(p9-a0\): unknown group"):
        led.mark_ready("p9-a0", (0.0, 0.0), 3)
    # one group of the selection is not READY: nothing is selected, the READY one stays as it was
    with pytest.raises(LedgerError, match=r"select\(p1-a0\): state reserved, expected ready"):
        led.select([a.group_id, b.group_id], 0, 3)
    assert a.state is GroupState.READY and led.count(GroupState.SELECTED) == 0
    assert led.ready_index() == {(0, 0): {a.group_id: a}} and list(led.ready_ids()) == [a.group_id]
    with pytest.raises(LedgerError, match=r"mark_trained\(p0-a0\): state ready, expected selected"):
        led.mark_trained(a.group_id, 0)
    (sel,) = led.select((g for g in [a.group_id]), 0, 3)  # any iterable of ids
    assert sel is a and a.state is GroupState.SELECTED and led.ready_index() == {} and a.trained_step == 0
    led.mark_trained(a.group_id, 0)
    assert a.state is GroupState.TRAINED and led.count(GroupState.SELECTED) == 0


def _through_a_step(mark_trained_at_once: bool) -> tuple[GroupLedger, list]:
    """Two steps of two groups; step 0's groups marked trained one by one or at once."""
    led = GroupLedger(capacity=6, group_size=2, groups_per_step=2, max_steps=3)
    groups = [led.reserve(prompt(i), attempt=0, target_step=i // 2, policy_version=0, now=0) for i in range(4)]
    for g in groups:
        led.commit(g.group_id, result(g.group_id, 0), 1)
        led.mark_ready(g.group_id, (1.0, -1.0), 2)
    ids = [g.group_id for g in groups[:2]]
    led.select(ids, 0, 3)
    if mark_trained_at_once:
        assert led.mark_trained_many(iter(ids), 0) == groups[:2]  # any iterable of ids
    else:
        for g in ids:
            led.mark_trained(g, 0)
    return led, groups


def test_marking_a_step_trained_at_once_is_marking_its_groups_one_by_one():
    (one, _), (many, groups) = _through_a_step(False), _through_a_step(True)
    assert [g.state for g in many.all_records()] == [g.state for g in one.all_records()]
    assert many.statistics() == one.statistics() and many.next_target_step() == one.next_target_step() == 2
    # the per-step counts that decide refills and retire finished steps agree too
    assert (many._open_by_step, many._live_by_step, many._min_short_step) == (
        one._open_by_step,
        one._live_by_step,
        one._min_short_step,
    )
    for g in groups[:2]:
        many.release(g.group_id)
        one.release(g.group_id)
    assert many.statistics() == one.statistics()


def test_marking_a_step_trained_at_once_refuses_before_changing_anything():
    led, groups = _through_a_step(False)
    a, b = groups[2:]
    led.select([a.group_id], 1, 3)
    with pytest.raises(LedgerError, match=r"mark_trained\(p3-a0\): state ready, expected selected"):
        led.mark_trained_many([a.group_id, b.group_id], 1)
    assert a.state is GroupState.SELECTED and led.count(GroupState.TRAINED) == 2
    with pytest.raises(LedgerError, match=r"group p2-a0 selected for step 1, trained in 2"):
        led.mark_trained_many([a.group_id], 2)
    with pytest.raises(LedgerError, match=r"listed twice"):
        led.mark_trained_many([a.group_id, a.group_id], 1)
    assert a.state is GroupState.SELECTED and led.statistics().trained_total == 2
    led.mark_trained_many([a.group_id], 1)
    assert a.state is GroupState.TRAINED and led.statistics().trained_total == 3


def test_prompt_ledger_is_exactly_once_and_serializable():
    pl = PromptLedger()
    pl.take(prompt(0))
    pl.take(prompt(1))
    with pytest.raises(LedgerError):
        pl.take(prompt(0))
    pl.add_attempt("p0", "p0-a0")
    pl.add_attempt("p0", "p0-a1")
    pl.settle("p0", "trained", step=3)
    with pytest.raises(LedgerError):
        pl.settle("p0", "dropped", reason="x")
    with pytest.raises(LedgerError):
        pl.add_attempt("p0", "p0-a2")
    assert pl.unsettled() == ["p1"]
    back = PromptLedger.from_dict(pl.to_dict())
    assert back.to_dict() == pl.to_dict()
    s = back.statistics()
    assert (s.taken, s.settled, s.trained, s.retries) == (2, 1, 1, 1)


@pytest.mark.parametrize("history", [False, True])
def test_the_ledger_streamed_to_a_file_holds_every_prompt_once(tmp_path, history):
    """`write_json` (the end-of-run prompt_ledger.json) copies the history file's lines as they are
    and adds the records in memory: the same records as `to_dict`, in settle order."""
    pl = PromptLedger(history=str(tmp_path / "history.jsonl") if history else None)
    for i in range(6):
        pl.take(prompt(i))
        pl.add_attempt(f"p{i}", f"p{i}-a0")
    pl.settle("p3", "trained", step=0)
    pl.settle("p1", "dropped", reason="zero_variance")
    pl.settle_trained(["p0", "p5"], step=1)
    assert pl.write_json(tmp_path / "ledger.json") == 6
    written = json.loads((tmp_path / "ledger.json").read_text())["prompts"]
    assert sorted(written, key=lambda d: d["order"]) == pl.to_dict()["prompts"]
    if history:  # the settled ones first, as they settled, then the ones still in memory
        assert [d["prompt_id"] for d in written[:4]] == ["p3", "p1", "p0", "p5"]
    assert not (tmp_path / "ledger.json.tmp").exists()
    pl.close()


# -- sampler --------------------------------------------------------------------------------
def test_admission_gate():
    s = StalenessSampler(SamplerConfig(max_lookahead_versions=0, max_staleness_versions=0))
    assert s.may_admit(0, 0) and not s.may_admit(1, 0) and s.may_admit(1, 1)
    s2 = StalenessSampler(SamplerConfig(max_lookahead_versions=2, max_staleness_versions=2))
    assert s2.may_admit(2, 0) and not s2.may_admit(3, 0)
    assert s2.required_capacity(16) == 48


@pytest.mark.parametrize("abort", [False, True])
def test_in_flight_groups_are_aborted_only_when_the_sampler_says_so(abort):
    """The weight sync skips its look at in-flight groups when `aborts_in_flight` is off: then no
    group, however stale, is one `should_abort_in_flight` would abort."""
    led = GroupLedger(capacity=10, group_size=2, groups_per_step=1, max_steps=10)
    s = StalenessSampler(SamplerConfig(max_lookahead_versions=1, max_staleness_versions=1, abort_stale_in_flight=abort))
    old = led.reserve(prompt(0), attempt=0, target_step=0, policy_version=0, now=0)  # could only train at step >= 3
    fresh = led.reserve(prompt(1), attempt=0, target_step=1, policy_version=2, now=0)
    assert s.aborts_in_flight is abort
    assert [s.should_abort_in_flight(g, 3) for g in (old, fresh)] == [abort, False]


def _ready_group(led, i, target, version):
    g = led.reserve(prompt(i), attempt=0, target_step=target, policy_version=version, now=i)
    led.commit(g.group_id, result(g.group_id, version), i)
    return led.mark_ready(g.group_id, (0.0, 0.0), i)


@pytest.mark.parametrize("order", ["in_order", "fifo", "freshest"])
def test_select_orders(order):
    led = GroupLedger(capacity=10, group_size=2, groups_per_step=3, max_steps=10)
    for args in ((0, 2, 0), (1, 2, 2), (2, 3, 1), (3, 2, 1)):
        _ready_group(led, *args)
    s = StalenessSampler(SamplerConfig(order=order, max_lookahead_versions=1, max_staleness_versions=1))
    picked = [g.prompt.prompt_id for g in s.select(led.in_state(GroupState.READY), 2, 10)]
    # staleness at step 2: p0 -> 2 (excluded everywhere), p1 -> 0, p2 -> 1, p3 -> 1
    expected = {"in_order": ["p1", "p3"], "fifo": ["p1", "p2", "p3"], "freshest": ["p1", "p2", "p3"]}[order]
    assert picked == expected
    assert [g.prompt.prompt_id for g in s.evictable(led.in_state(GroupState.READY), 2)] == ["p0"]
    assert len(s.select(led.in_state(GroupState.READY), 2, 1)) == 1


# -- arbitrary interleavings ------------------------------------------------------------------
class LedgerMachine(RuleBasedStateMachine):
    @initialize(
        L=st.integers(0, 2),
        extra=st.integers(0, 2),
        P=st.integers(1, 3),
        order=st.sampled_from(["in_order", "fifo", "freshest"]),
        spare=st.integers(0, 3),
    )
    def setup(self, L, extra, P, order, spare):
        self.S = L + extra
        self.sampler = StalenessSampler(
            SamplerConfig(max_lookahead_versions=L, max_staleness_versions=self.S, order=order)
        )
        self.P = P
        self.ledger = GroupLedger(
            capacity=self.sampler.required_capacity(P) + spare, group_size=2, groups_per_step=P, max_steps=8
        )
        self.policy = 0  # generation weights version
        self.step = 0  # trainer version: the step being assembled
        self.n = 0
        self.terminal_seen: dict[str, GroupState] = {}
        self.selected_this_step: list[str] = []
        self.clock = 0

    def _ready(self):
        return self.ledger.in_state(GroupState.READY)

    @rule()
    def dispatch(self):
        target = self.ledger.next_target_step()
        if target is None or not self.sampler.may_admit(target, self.policy):
            return
        if not self.ledger.has_capacity():
            with pytest.raises(CapacityError):
                self.ledger.reserve(prompt(self.n), attempt=0, target_step=target, policy_version=self.policy, now=0)
            return
        self.ledger.reserve(prompt(self.n), attempt=0, target_step=target, policy_version=self.policy, now=0)
        self.n += 1

    @precondition(lambda self: self.ledger.count(GroupState.RESERVED) > 0)
    @rule(data=st.data(), lag=st.integers(0, 1))
    def commit(self, data, lag):
        g = data.draw(st.sampled_from(self.ledger.in_state(GroupState.RESERVED)))
        version = max(g.version_reserved, self.policy - lag)  # finished on the reserved or a later version
        self.ledger.commit(g.group_id, result(g.group_id, version), 0)

    @precondition(lambda self: self.ledger.count(GroupState.COMMITTED) > 0)
    @rule(data=st.data())
    def make_ready(self, data):
        g = data.draw(st.sampled_from(self.ledger.in_state(GroupState.COMMITTED)))
        self.clock += 1
        self.ledger.mark_ready(g.group_id, (0.0, 0.0), self.clock)

    @precondition(lambda self: self.ledger.count(GroupState.RESERVED) + self.ledger.count(GroupState.COMMITTED) > 0)
    @rule(data=st.data())
    def fail(self, data):
        g = data.draw(
            st.sampled_from(self.ledger.in_state(GroupState.RESERVED) + self.ledger.in_state(GroupState.COMMITTED))
        )
        self.ledger.drop(g.group_id, "generation_failed")
        self.ledger.release(g.group_id)

    @rule(n=st.integers(1, 3))
    def select(self, n):
        ready = self._ready()
        picked = self.sampler.select(ready, self.step, n)
        evict = self.sampler.evictable(ready, self.step)
        assert not {g.group_id for g in picked} & {g.group_id for g in evict}, "select and evict claimed one group"
        picked = picked[: self.P - len(self.selected_this_step)]
        for g in picked:
            assert self.sampler.staleness(g, self.step) <= self.S
        self.ledger.select([g.group_id for g in picked], self.step, 0)
        self.selected_this_step += [g.group_id for g in picked]

    @rule()
    def evict(self):
        for g in self.sampler.evictable(self._ready(), self.step):
            self.ledger.evict(g.group_id, "stale")
            self.ledger.release(g.group_id)

    @precondition(lambda self: len(self.selected_this_step) > 0)
    @rule(at_once=st.booleans())
    def finish_step(self, at_once):
        if at_once:  # the train pump's way: the whole step in one call
            self.ledger.mark_trained_many(self.selected_this_step, self.step)
        else:
            for gid in self.selected_this_step:
                self.ledger.mark_trained(gid, self.step)
        for gid in self.selected_this_step:
            self.ledger.release(gid)
        self.selected_this_step = []
        self.step += 1

    @precondition(lambda self: self.policy < self.step)
    @rule()
    def sync(self):
        self.policy = self.step

    @invariant()
    def invariants(self):
        if not hasattr(self, "ledger"):
            return
        assert self.ledger.resident() <= self.ledger.capacity
        for g in self.ledger.all_records():
            if g.state in TERMINAL:
                prev = self.terminal_seen.setdefault(g.group_id, g.state)
                assert prev is g.state, f"{g.group_id} changed terminal state {prev} -> {g.state}"
            if g.state is GroupState.SELECTED:
                assert self.sampler.staleness(g, g.trained_step) <= self.S
        # live groups per step never exceed groups_per_step
        for s in range(8):
            assert self.ledger.live(s) <= self.P
        # the incremental indexes agree with a scan of the resident groups
        active = list(self.ledger.active_records())
        for state in GroupState:
            assert self.ledger.count(state) == sum(g.state is state for g in active), state
            assert self.ledger.in_state(state) == sorted((g for g in active if g.state is state), key=lambda g: g.seq)
        ready = [g for g in active if g.state is GroupState.READY]
        index = self.ledger.ready_index()
        assert sorted(g.group_id for b in index.values() for g in b.values()) == sorted(g.group_id for g in ready)
        for step in range(self.step, self.step + 3):  # the per-key decisions equal the per-group ones
            assert self.sampler.selectable(index, step) == len(self.sampler.select(ready, step, 10**9))
            assert self.sampler.select_from(index, step, self.P) == self.sampler.select(ready, step, self.P)
            assert self.sampler.any_evictable(index, step) == bool(self.sampler.evictable(ready, step))
            assert self.sampler.evictable_from(index, step) == self.sampler.evictable(ready, step)
        stats = self.ledger.statistics()
        assert stats.resident == len(active) and sum(stats.by_state.values()) == len(active)
        assert stats.oldest_ready_t == min((g.t_ready for g in ready), default=None)

    def teardown(self):
        if not hasattr(self, "ledger"):
            return
        for g in list(self.ledger.all_records()):
            if g.state not in TERMINAL:
                self.ledger.drop(g.group_id, "run_ended")
            if g.resident:
                self.ledger.release(g.group_id)
        assert all(g.state in TERMINAL and not g.resident for g in self.ledger.all_records())
        assert self.ledger.resident() == 0


TestLedgerMachine = LedgerMachine.TestCase
TestLedgerMachine.settings = settings(
    max_examples=150, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# -- the prompt ledger with a history file (settled records leave memory) -------------------------
def _settle_some(led: PromptLedger, ids, fate="trained", step=0):
    for i in ids:
        led.add_attempt(f"p{i}", f"p{i}-a0")
        if fate == "trained":
            led.settle(f"p{i}", "trained", step=step)
        else:
            led.settle(f"p{i}", fate, reason="zero_variance")


def test_prompt_history_keeps_only_unsettled_prompts_in_memory_and_the_whole_ledger_on_disk(tmp_path):
    hist = tmp_path / "prompt_history.jsonl"
    mem, led = PromptLedger(), PromptLedger(hist)
    for ledger in (mem, led):
        for i in range(6):
            ledger.take(prompt(i))
        _settle_some(ledger, [0, 1, 2])
        _settle_some(ledger, [3], fate="dropped")
        ledger.add_attempt("p4", "p4-a0")
        ledger.add_attempt("p4", "p4-a1")
    assert [r.prompt.prompt_id for r in led.records()] == ["p4", "p5"]  # the settled ones left memory
    assert led.to_dict() == mem.to_dict() and led.statistics() == mem.statistics()  # (flushes the file)
    assert len(hist.read_text().splitlines()) == 4
    assert len(led) == 6 and led.unsettled() == ["p4", "p5"]
    with pytest.raises(LedgerError, match="history file"):
        led.settle("p0", "trained", step=1)  # exactly once holds for records on disk too


def test_settling_a_step_trained_at_once_writes_what_settling_one_by_one_writes(tmp_path):
    files, ledgers = [], []
    for at_once in (False, True):
        hist = tmp_path / f"history_{at_once}.jsonl"
        led = PromptLedger(hist)
        for i in range(5):
            led.take(prompt(i))
            led.add_attempt(f"p{i}", f"p{i}-a0")
        led.settle("p0", "dropped", reason="zero_variance")
        if at_once:
            led.settle_trained(["p1", "p2", "p3"], 4)
        else:
            for i in (1, 2, 3):
                led.settle(f"p{i}", "trained", step=4)
        files.append(hist)
        ledgers.append(led)
    assert ledgers[1].statistics() == ledgers[0].statistics() and ledgers[1].unsettled() == ["p4"]
    assert ledgers[1].to_dict() == ledgers[0].to_dict()
    for led in ledgers:
        led.close()
    assert files[1].read_bytes() == files[0].read_bytes()


@pytest.mark.parametrize("history", [False, True])
def test_settling_a_step_trained_at_once_refuses_a_settled_prompt_and_keeps_the_ones_before_it(tmp_path, history):
    hist = tmp_path / "prompt_history.jsonl"
    led = PromptLedger(hist if history else None)
    for i in range(3):
        led.take(prompt(i))
        led.add_attempt(f"p{i}", f"p{i}-a0")
    led.settle("p1", "dropped", reason="zero_variance")
    with pytest.raises(LedgerError, match=r"p1 settled twice|p1 settled trained, but it was settled before"):
        led.settle_trained(["p0", "p1", "p2"], 0)
    assert led.unsettled() == ["p2"] and led.statistics().trained == 1  # p0 is settled, p2 is not
    if history:
        led.close()
        assert [json.loads(line)["prompt_id"] for line in hist.read_text().splitlines()] == ["p1", "p0"]
    else:
        assert led["p0"].fate == "trained" and led["p0"].step == 0


def test_a_failed_history_write_keeps_the_steps_prompts_in_the_ledger(tmp_path):
    """Settled records leave memory only once their lines are written: a full disk loses none."""
    led = PromptLedger(tmp_path / "prompt_history.jsonl")
    for i in range(2):
        led.take(prompt(i))
        led.add_attempt(f"p{i}", f"p{i}-a0")
    disk, led._history = led._history, _FullDisk()
    with pytest.raises(OSError, match="No space left"):
        led.settle_trained(["p0", "p1"], 3)
    led._history = disk
    assert [(r.prompt.prompt_id, r.fate, r.step) for r in led.records()] == [("p0", "trained", 3), ("p1", "trained", 3)]
    assert [p["prompt_id"] for p in led.to_dict()["prompts"]] == ["p0", "p1"] and led.unsettled() == []


class _FullDisk:
    def write(self, text: str) -> int:
        raise OSError(28, "No space left on device")


@settings(max_examples=200, deadline=None)
@given(
    prompt_id=st.text(min_size=1, max_size=12),
    tokens=st.lists(st.integers(0, 2**31), max_size=6),
    answer=st.text(max_size=8),
    attempts=st.integers(1, 3),
    fate=st.sampled_from(["trained", "dropped", "evicted"]),
    reason=st.one_of(st.none(), st.text(max_size=8)),
)
def test_a_prompt_history_line_is_exactly_what_json_dumps_writes(
    tmp_path_factory, prompt_id, tokens, answer, attempts, fate, reason
):
    """The history line is written without the generic JSON encoder (it was the largest single cost
    of settling a prompt): byte for byte what json.dumps of the record writes, for any text."""
    hist = tmp_path_factory.mktemp("h") / "prompt_history.jsonl"
    led = PromptLedger(hist)
    led.take(Prompt(prompt_id, tuple(tokens), answer))
    for a in range(attempts):
        led.add_attempt(prompt_id, f"{prompt_id}-a{a}")
    rec = led[prompt_id]
    if fate == "trained":
        led.settle(prompt_id, fate, step=attempts)
    else:
        led.settle(prompt_id, fate, reason=reason)
    led.close()
    assert hist.read_text(encoding="utf-8") == json.dumps(_record_dict(rec)) + "\n"


@pytest.mark.parametrize("history", [False, True])
def test_a_prompt_id_taken_again_after_its_first_was_settled_is_refused_naming_it(tmp_path, history):
    """A prompt source that repeats an id far apart: the first record left memory for the history
    file, yet the ledger refuses a second record for the id, also after a resume."""
    hist = tmp_path / "prompt_history.jsonl"
    led = PromptLedger(hist if history else None)
    for i in range(3):
        led.take(prompt(i))
    _settle_some(led, [0, 1])
    with pytest.raises(LedgerError, match=r"prompt p0 taken from the dataloader twice \(the first is settled\)"):
        led.take(prompt(0))
    with pytest.raises(
        LedgerError, match=r"prompt p2 taken from the dataloader twice \(the first is still in flight\)"
    ):
        led.take(prompt(2))
    assert len(led) == 3
    resumed = PromptLedger.from_dict(json.loads(json.dumps(led.checkpoint_dict())), hist if history else None)
    for i in (1, 2):
        with pytest.raises(LedgerError, match=f"prompt p{i} taken from the dataloader twice"):
            resumed.take(prompt(i))
    resumed.take(prompt(3))  # a new id is taken as ever


def test_prompt_history_checkpoint_cuts_the_file_back_on_resume(tmp_path):
    hist = tmp_path / "prompt_history.jsonl"
    led = PromptLedger(hist)
    for i in range(8):
        led.take(prompt(i))
    _settle_some(led, [0, 1])
    led.add_attempt("p2", "p2-a0")
    led.add_attempt("p2", "p2-a1")  # one retry, still open at the checkpoint
    saved = json.loads(json.dumps(led.checkpoint_dict()))  # what controller.json holds
    assert [d["prompt_id"] for d in saved["prompts"]] == ["p2", "p3", "p4", "p5", "p6", "p7"]
    at_cut = led.statistics()
    _settle_some(led, [3, 4], step=1)  # after the checkpoint: a crash forgets these
    led.close()
    resumed = PromptLedger.from_dict(saved, hist)
    assert resumed.statistics() == at_cut and len(resumed) == 8
    assert len(hist.read_text().splitlines()) == 2  # cut back to the checkpoint's length
    _settle_some(resumed, [3], step=1)
    assert [d["prompt_id"] for d in resumed.to_dict()["prompts"] if d["fate"]] == ["p0", "p1", "p3"]
    assert resumed.statistics().retries == 1 and resumed.statistics().trained == 3
    with pytest.raises(ValueError, match="history file"):
        PromptLedger.from_dict(saved)
