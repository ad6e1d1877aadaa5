"""The simulated backend's run, shared by the controller tests (tests/unit/): a small config, a run of the
whole controller on sim workers, and the checks every clean end must pass; the same with evaluation on. Not a
test module."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import replace

from replay.storage import InMemoryRowStorage
from single_controller.backends.sim import sim_prompts, sim_workers
from single_controller.config.schema import (
    BufferConfig,
    Config,
    RolloutConfig,
    RunConfig,
    SamplerConfig,
    TimeoutConfig,
    TrainConfig,
)
from single_controller.controller import Controller, RunFailed
from single_controller.data.tasks import EVAL_DATASETS
from single_controller.state import Workers

# The held-out prompts the eval tests (and the pool's eval-withdrawal test) evaluate
EVAL_PROMPTS = EVAL_DATASETS["reverse_digits.held_out"](8, 3, 0)


def make_cfg(
    *, steps=6, P=4, G=2, L=1, S=None, chunk=2, order="in_order", capacity=None, in_flight=64, **sections
) -> Config:
    cfg = Config(
        run=RunConfig(max_steps=steps, progress_bar=False, plot=False),
        rollout=RolloutConfig(group_size=G, max_in_flight_groups=in_flight),
        train=TrainConfig(groups_per_step=P, min_groups_per_chunk=chunk),
        sampler=SamplerConfig(max_lookahead_versions=L, max_staleness_versions=L if S is None else S, order=order),
        buffer=BufferConfig(capacity_groups=capacity),
        timeouts=TimeoutConfig(generate_s=5, train_call_s=5, weight_sync_s=5, storage_s=5),
    )
    return replace(cfg, **{k: replace(getattr(cfg, k), **v) for k, v in sections.items()})


class HangingClearStorage(InMemoryRowStorage):
    """In-memory storage whose `clear_rows` hangs (until cancelled by its deadline) when
    `hang(controller, keys)` says so."""

    def __init__(self, hang):
        super().__init__()
        self.hang, self.ctl = hang, None

    async def clear_rows(self, keys):
        if self.hang(self.ctl, list(keys)):
            await asyncio.Event().wait()
        await super().clear_rows(keys)


async def run_sim(
    cfg, faults=None, *, prompts=None, gen_s=0.0, train_s=0.0, num_generators=2, timeout=30.0, hang_clear=None
):
    storage = InMemoryRowStorage() if hang_clear is None else HangingClearStorage(hang_clear)
    gens, trainer = sim_workers(
        storage, num_generators=num_generators, gen_group_s=gen_s, train_group_s=train_s, faults=faults
    )
    ctl = Controller(cfg, prompts if prompts is not None else sim_prompts(), storage, Workers(gens, trainer))
    storage.ctl = ctl

    try:
        summary = await asyncio.wait_for(ctl.run(), timeout)
        err = None
    except RunFailed as e:
        summary, err = None, e
    return ctl, trainer, storage, summary, err


def trained_prompts(trainer) -> dict[int, list[str]]:
    return {s: sorted({k.split("-a")[0] for k in keys}) for s, keys in trainer.trained.items()}


async def assert_clean_end(ctl, trainer, storage):
    """Nothing resident, every prompt settled exactly once, nothing trained twice."""
    assert await storage.resident_keys() == set()
    assert ctl.state.ledger.resident() == 0
    assert ctl.state.prompts.unsettled() == []
    all_keys = [k for keys in trainer.trained.values() for k in keys]
    assert len(all_keys) == len(set(all_keys)), "a row was trained twice"
    prompts_trained = Counter(k.split("-a")[0] for k in {k.rsplit("_g", 1)[0] for k in all_keys})
    assert all(n == 1 for n in prompts_trained.values()), "a prompt was trained twice"
    for rec in ctl.state.prompts.records():
        if rec.fate == "trained":
            assert rec.prompt.prompt_id in trained_prompts(trainer)[rec.step]


# -- runs with evaluation on (the eval tests, tests/unit/test_eval*.py) --------------------------------------
def eval_cfg(steps=12, every=4, **sections):
    ev = {"enabled": True, "every_steps": every, "num_prompts": len(EVAL_PROMPTS), **sections.pop("eval", {})}
    return make_cfg(steps=steps, L=1, eval=ev, **sections)


class KeySpyStorage(InMemoryRowStorage):
    """Records every key anything writes."""

    def __init__(self):
        super().__init__()
        self.put_keys: set[str] = set()

    async def put_rows(self, keys, columns, tags=None):
        self.put_keys.update(keys)
        return await super().put_rows(keys, columns, tags)


def hold(ctl, gens, prompt_id: str, until) -> None:
    """Every round's first eval request for `prompt_id` is held (before the worker serves it)
    until `until(state)` holds: a deterministic way to let training move on mid-round."""

    for g in gens:
        orig = g.generate

        async def held(req, orig=orig):
            if req.eval and req.prompt.prompt_id == prompt_id and req.group_id.endswith("-a0"):
                await ctl.state.changed.wait_until(lambda: until(ctl.state))
            return await orig(req)

        g.generate = held


async def run_eval_sim(
    cfg,
    faults=None,
    *,
    gen_s=0.001,
    train_s=0.001,
    num_generators=2,
    prompts=EVAL_PROMPTS,
    timeout=30.0,
    held=None,
    on_step=None,
):
    storage = KeySpyStorage()
    gens, trainer = sim_workers(
        storage, num_generators=num_generators, gen_group_s=gen_s, train_group_s=train_s, faults=faults
    )
    ctl = Controller(cfg, sim_prompts(), storage, Workers(gens, trainer), eval_prompts=prompts)
    if held is not None:
        hold(ctl, gens, *held)
    if on_step is not None:
        ctl.on_step = lambda rec: on_step(ctl, rec)
    leftover: list = []

    async def go():
        try:
            return await asyncio.wait_for(ctl.run(), timeout)
        finally:
            leftover.extend(t for t in asyncio.all_tasks() if t is not asyncio.current_task())

    try:
        summary, err = await go(), None
    except RunFailed as e:
        summary, err = None, e
    assert leftover == [], f"tasks left behind: {leftover}"
    return ctl, gens, trainer, storage, summary, err
