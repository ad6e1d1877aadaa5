"""Layer (b): a cancelled request writes nothing more before its rows are cleared: withdrawal before
clearing, at deadlines, aborts and a failed run."""

from __future__ import annotations

import asyncio

import pytest

from replay.storage import InMemoryRowStorage
from single_controller.backends.sim import (
    sim_prompts,
    sim_workers,
)
from single_controller.controller import Controller, RunFailed
from single_controller.protocols import SubmitsByTask
from single_controller.state import Workers
from tests.helpers.sim import assert_clean_end, make_cfg


class Withdrawing(SubmitsByTask):
    """A sim worker whose cancelled `generate` takes a while to be sure it writes nothing more, then
    records ("withdrawn", group id) in `events`. Requests `hold(request)` picks are never answered;
    `self_cancel` ones are cancelled by the worker itself (a contract breach)."""

    def __init__(self, inner, events, hold=lambda r: False, self_cancel=lambda r: False, withdraw_s=0.01):
        self.inner, self.name = inner, inner.name
        self.events, self.withdraw_s = events, withdraw_s
        self.hold, self.self_cancel = hold, self_cancel
        self.held: list[str] = []

    async def generate(self, request):
        if self.self_cancel(request):
            raise asyncio.CancelledError()
        try:
            if self.hold(request):
                self.held.append(request.group_id)
                await asyncio.Event().wait()
            return await self.inner.generate(request)
        except asyncio.CancelledError:
            await asyncio.sleep(self.withdraw_s)
            self.events.append(("withdrawn", request.group_id))
            raise

    async def update_weights(self, weights):
        await self.inner.update_weights(weights)

    async def in_flight(self):
        return await self.inner.in_flight()


class RecordingClears(InMemoryRowStorage):
    def __init__(self, events):
        super().__init__()
        self.events = events

    async def clear_rows(self, keys):
        self.events.extend(("cleared", gid) for gid in sorted({k.rsplit("_g", 1)[0] for k in keys}))
        await super().clear_rows(keys)


def _withdrawing(cfg, events, train_group_s=0.001, **kw):
    storage = RecordingClears(events)
    inner, trainer = sim_workers(storage, num_generators=2, gen_group_s=0.002, train_group_s=train_group_s)
    gens = [Withdrawing(g, events, **kw) for g in inner]
    return Controller(cfg, sim_prompts(), storage, Workers(gens, trainer)), gens, trainer, storage


def _withdrawn_before_cleared(events, gid):
    return events.index(("withdrawn", gid)) < events.index(("cleared", gid))


async def test_a_request_past_its_deadline_is_withdrawn_before_its_rows_are_cleared_and_retried():
    events: list = []
    cfg = make_cfg(steps=4, P=2, L=1, timeouts={"generate_s": 0.2})
    ctl, gens, trainer, storage = _withdrawing(cfg, events, hold=lambda r: r.group_id == "p000002-a0")
    summary = await asyncio.wait_for(ctl.run(), 30)
    assert summary.steps == 4
    assert [g for w in gens for g in w.held] == ["p000002-a0"]
    assert _withdrawn_before_cleared(events, "p000002-a0")
    # the request failed alone: its worker answered the liveness call, so it stays (never killed as hung)
    assert ctl.state.counters.worker_deaths == 0 and ctl.state.health.given_up == set()
    assert ctl.state.ledger["p000002-a0"].reason == "generation_timeout"
    assert ctl.state.prompts["p000002"].attempts[:2] == ["p000002-a0", "p000002-a1"]
    assert ctl.state.prompts["p000002"].uncharged == 0  # charged to the prompt's retries
    await assert_clean_end(ctl, trainer, storage)


@pytest.mark.parametrize("order", ["in_order", "fifo"])
async def test_a_sync_that_aborts_while_a_late_request_is_being_withdrawn_does_not_hang_the_run(order):
    """A request past its deadline is being withdrawn (slowly) when a weight sync with
    drain_policy=abort aborts what is in flight: the group is still discarded once withdrawn, so
    the train pump is not left waiting for it."""
    events: list = []
    cfg = make_cfg(
        steps=8, P=2, L=1, chunk=1, order=order, timeouts={"generate_s": 0.2}, sync={"drain_policy": "abort"}
    )
    # a step trains for 0.3 s: the held request's deadline (0.2 s) passes before the step's sync,
    # which comes while the withdrawal (0.5 s) is still under way
    hold = lambda r: r.group_id == "p000002-a0"  # noqa: E731
    ctl, gens, trainer, storage = _withdrawing(cfg, events, train_group_s=0.15, hold=hold, withdraw_s=0.5)
    summary = await asyncio.wait_for(ctl.run(), 20)
    assert summary.steps == 8
    assert _withdrawn_before_cleared(events, "p000002-a0")
    assert ctl.state.ledger["p000002-a0"].reason == "sync_abort"  # aborted while it was being withdrawn
    await assert_clean_end(ctl, trainer, storage)


async def test_an_aborted_request_is_withdrawn_before_its_rows_are_cleared():
    """The stale in-flight rule cancels a request: discarded as aborted (not an error),
    after the worker's withdrawal."""
    events: list = []
    cfg = make_cfg(steps=6, P=2, L=1, S=1, chunk=1, order="fifo", sampler={"abort_stale_in_flight": True})
    ctl, gens, trainer, storage = _withdrawing(cfg, events, hold=lambda r: r.group_id == "p000000-a0")
    summary = await asyncio.wait_for(ctl.run(), 30)
    assert summary.steps == 6
    assert _withdrawn_before_cleared(events, "p000000-a0")
    assert ctl.state.sampler.statistics().aborted_in_flight_total >= 1 and ctl.state.pumps["rollout"].errors == 0
    assert ctl.state.prompts["p000000"].attempts[0] == "p000000-a0" and len(ctl.state.prompts["p000000"].attempts) >= 2
    await assert_clean_end(ctl, trainer, storage)


async def test_requests_still_in_flight_when_the_run_fails_are_withdrawn():
    events: list = []
    cfg = make_cfg(steps=6, P=2, L=1, train={"max_step_retries": 0})
    ctl, gens, trainer, storage = _withdrawing(cfg, events, hold=lambda r: r.group_id in ("p000004-a0", "p000005-a0"))
    trainer.faults.train_fail.add((1, 0, 0))
    with pytest.raises(RunFailed, match="injected trainer failure"):
        await asyncio.wait_for(ctl.run(), 30)
    held = [g for w in gens for g in w.held]
    assert held and all(("withdrawn", g) in events for g in held)
    assert ctl.state.teardown_errors == []


async def test_a_worker_that_cancels_a_request_itself_stops_the_run_naming_it():
    events: list = []
    ctl, gens, trainer, storage = _withdrawing(
        make_cfg(steps=4, P=2), events, self_cancel=lambda r: r.group_id == "p000001-a0"
    )
    with pytest.raises(RunFailed, match=r"cancelled the request of p000001-a0 itself"):
        await asyncio.wait_for(ctl.run(), 30)


async def test_two_errors_that_fail_the_run_together_are_each_named_not_counted_as_a_group():
    """Two settle tasks of the rollout pump raise in the same tick: the run's error is an exception
    group of two; RunFailed says each error (type: message), not "(2 sub-exceptions)"."""
    events: list = []
    ctl, gens, trainer, storage = _withdrawing(
        make_cfg(steps=4, P=2), events, self_cancel=lambda r: r.group_id in ("p000000-a0", "p000001-a0")
    )
    with pytest.raises(RunFailed) as info:
        await asyncio.wait_for(ctl.run(), 30)
    text = str(info.value)
    assert isinstance(info.value.__cause__, BaseExceptionGroup)  # the two errors did fail together
    assert "sub-exception" not in text
    assert text.startswith("rollout pump failed: 2 errors together: RuntimeError: generation worker sim-gen-")
    for gid in ("p000000-a0", "p000001-a0"):
        assert f"cancelled the request of {gid} itself" in text
