"""Layer (b): checkpoint and resume of the controller on the simulated backend (issue 9): a resumed run
trains what an uninterrupted one trains, storage that outlived a crash, refused and torn checkpoints,
checkpoint deadlines, background commits."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from replay.storage import InMemoryRowStorage, row_keys
from single_controller.backends.sim import (
    sim_prompts,
    sim_workers,
)
from single_controller.checkpoint import CheckpointError, check_compatible, latest_checkpoint, read_controller_state
from single_controller.controller import Controller, RunFailed
from single_controller.state import Workers
from tests.helpers.sim import make_cfg


async def _run_with_dir(cfg, run_dir, *, resume=None, skip=0, history=False):
    import itertools

    storage = InMemoryRowStorage()
    gens, trainer = sim_workers(storage, num_generators=2, gen_group_s=0.002)
    prompts = itertools.islice(sim_prompts(), skip, None)
    run_dir.mkdir(parents=True, exist_ok=True)
    hist = str(run_dir / "prompt_history.jsonl") if history else None
    ctl = Controller(
        cfg, prompts, storage, Workers(gens, trainer), run_dir=str(run_dir), resume=resume, prompt_history=hist
    )

    async def go():
        if resume is not None:
            await trainer.load_state(str(latest_checkpoint(run_dir) / "trainer"))
        return await asyncio.wait_for(ctl.run(), 30)

    return ctl, trainer, storage, await go()


def _per_step(ctl) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for r in ctl.state.prompts.to_dict()["prompts"]:  # the whole ledger, with or without a history file
        if r["fate"] == "trained":
            out.setdefault(r["step"], []).append(r["prompt_id"])
    return {k: sorted(v) for k, v in sorted(out.items())}


DETERMINISTIC_KEYS = ("rollout/reward_mean", "rollout/success_rate", "rollout/groups", "train/rows", "train/loss")


@pytest.mark.parametrize("updates", [1, 3], ids=["one_update", "three_updates"])
@pytest.mark.parametrize("history", [False, True], ids=["ledger_in_memory", "prompt_history_file"])
async def test_resumed_sim_run_trains_exactly_what_an_uninterrupted_run_trains(tmp_path, history, updates):
    train = {"updates_per_step": updates}  # several updates per step: the same steps, the same prompts
    full_cfg = make_cfg(steps=9, P=3, G=2, L=1, checkpoint={"every_steps": 0, "at_exit": False}, train=train)
    ctl_a, trainer_a, storage_a, _ = await _run_with_dir(full_cfg, tmp_path / "a")
    # The same run "crashes" after step 5 with its last checkpoint at step 4, then resumes.
    first = make_cfg(steps=5, P=3, G=2, L=1, checkpoint={"every_steps": 4, "at_exit": False}, train=train)
    ctl_b1, _, storage_b1, s1 = await _run_with_dir(first, tmp_path / "b", history=history)
    assert s1.checkpoint.step == 4
    saved = read_controller_state(latest_checkpoint(tmp_path / "b"))
    assert saved["step"] == 4 and saved["rolled_back"], "groups in flight at the cut are rolled back"
    check_compatible(saved, full_cfg, tmp_path / "b")  # max_steps may change on resume
    ctl_b2, trainer_b2, storage_b2, s2 = await _run_with_dir(
        full_cfg, tmp_path / "b", resume=saved, skip=saved["dataloader"]["taken"], history=history
    )
    assert s2.steps == 9 and trainer_b2.optimizer_steps == 9
    # exactly once over the whole run: the resumed ledger holds steps 0..8, each prompt trained once
    assert _per_step(ctl_b2) == _per_step(ctl_a)
    assert [r["step"] for r in ctl_b2.history] == list(range(4, 9))
    for ra, rb in zip(list(ctl_a.history)[4:], ctl_b2.history):
        assert {k: ra[k] for k in DETERMINISTIC_KEYS} == {k: rb[k] for k in DETERMINISTIC_KEYS}, ra["step"]
    assert sorted(trainer_b2.trained) == list(range(4, 9))  # the resumed trainer trained only 4..8
    assert await storage_b2.resident_keys() == set() and ctl_b2.state.ledger.resident() == 0
    assert ctl_b2.state.prompts.unsettled() == []


class ClientOfACrashedRun:
    """One run's client of a row storage that outlives the run (`storage.attach`): once the run has
    crashed (`crashed = True`), nothing it sends reaches the storage any more."""

    def __init__(self, store: InMemoryRowStorage):
        self.store, self.schema, self.crashed = store, store.schema, False
        self.stored: set[str] = set()  # keys this run put and has not cleared

    def _reach(self) -> InMemoryRowStorage:
        if self.crashed:
            raise RuntimeError("the run of this storage client crashed")
        return self.store

    async def put_rows(self, keys, columns, tags=None):
        await self._reach().put_rows(keys, columns, tags)
        self.stored.update(keys)

    async def get_rows(self, keys, fields):
        return await self._reach().get_rows(keys, fields)

    async def clear_rows(self, keys):
        await self._reach().clear_rows(keys)
        self.stored.difference_update(keys)

    async def resident_keys(self):
        return await self._reach().resident_keys()

    def statistics(self):
        return self.store.statistics()


class Crash(Exception):
    pass


@pytest.mark.parametrize("written_before", [None, 3])
async def test_a_checkpoint_keeps_every_step_record_the_driver_has_not_written(tmp_path, written_before):
    """The driver writes metrics.jsonl behind the controller and confirms what it wrote
    (`records_written`): a checkpoint keeps every record from the first one not confirmed, even when
    the driver lags more than a checkpoint interval (a kill then lost those steps' records, which a
    resume does not train again); with no driver confirming, the records since the previous one."""
    cfg = make_cfg(steps=9, P=3, G=2, L=1, checkpoint={"every_steps": 2, "at_exit": False})
    storage = InMemoryRowStorage()
    gens, trainer = sim_workers(storage, num_generators=2, gen_group_s=0.002)
    ctl = Controller(cfg, sim_prompts(), storage, Workers(gens, trainer), run_dir=str(tmp_path))
    if written_before is not None:
        ctl.records_written(0)
        ctl.records_written(written_before)  # and no further: the driver is stuck behind step 2
    summary = await asyncio.wait_for(ctl.run(), 30)
    saved = read_controller_state(latest_checkpoint(tmp_path))
    assert saved["step"] == summary.checkpoint.step == 8
    kept_from = 6 if written_before is None else written_before
    assert [r["step"] for r in saved["records"]] == list(range(kept_from, 8))


async def test_a_resume_into_a_storage_that_outlived_the_crash_clears_the_rows_of_attempts_after_the_cut(tmp_path):
    """`storage.attach`: the crashed run's rows stay in the storage. Those of attempts made after its
    last checkpoint (prompts taken after the cut, for steps the resume never reaches) are named
    nowhere in the checkpoint; the resume clears them too, and its run ends with no key left."""
    import itertools

    store = InMemoryRowStorage()  # the attached storage: it outlives the crashed run
    client = ClientOfACrashedRun(store)
    first = make_cfg(steps=16, P=3, G=2, L=1, checkpoint={"every_steps": 2, "at_exit": False})
    gens, trainer = sim_workers(client, num_generators=2, gen_group_s=0.001, train_group_s=0.01)

    def crash_once_rows_past_the_checkpoint_are_stored(record: dict) -> None:
        # After an odd step, the checkpoint of the step before is the last one the run takes (the
        # next is taken after this record) once it is committed (periodic ones commit in the background).
        pointer = tmp_path / "checkpoints" / "latest"
        if record["step"] % 2 == 0 or not pointer.exists():
            return
        if pointer.read_text().strip() != f"step_{record['step'] - 1:06d}":
            return
        saved = read_controller_state(latest_checkpoint(tmp_path))
        rolled_back = {k for g in saved["rolled_back"] for k in row_keys(g, 2)}
        if client.stored - rolled_back:
            client.crashed = True  # the process is gone: its teardown clears nothing
            raise Crash(f"crashed after step {record['step']}")

    ctl = Controller(
        first,
        sim_prompts(),
        client,
        Workers(gens, trainer),
        run_dir=str(tmp_path),
        on_step=crash_once_rows_past_the_checkpoint_are_stored,
    )
    with pytest.raises(RunFailed):  # whichever pump met the crash first
        await asyncio.wait_for(ctl.run(), 30)
    assert client.crashed
    saved = read_controller_state(latest_checkpoint(tmp_path))
    rolled_back = {k for g in saved["rolled_back"] for k in row_keys(g, 2)}
    after_cut = (await store.resident_keys()) - rolled_back
    assert after_cut, "the crash leaves rows of attempts made after the checkpoint's cut"
    # The resume (with the same storage) trains one step: the crashed run's later attempts are not made again.
    resumed = make_cfg(steps=saved["step"] + 1, P=3, G=2, L=1, checkpoint={"every_steps": 2, "at_exit": False})
    gens2, trainer2 = sim_workers(store, num_generators=2, gen_group_s=0.002)
    await trainer2.load_state(str(latest_checkpoint(tmp_path) / "trainer"))
    prompts = itertools.islice(sim_prompts(), saved["dataloader"]["taken"], None)
    ctl2 = Controller(resumed, prompts, store, Workers(gens2, trainer2), run_dir=str(tmp_path), resume=saved)
    summary = await asyncio.wait_for(ctl2.run(), 30)
    assert summary.steps == saved["step"] + 1 and sorted(trainer2.trained) == [saved["step"]]
    assert await store.resident_keys() == set(), "rows of the crashed run are left in the storage"
    assert ctl2.state.ledger.resident() == 0 and ctl2.state.prompts.unsettled() == []


async def test_checkpoint_from_a_different_config_is_refused_naming_the_keys(tmp_path):
    cfg = make_cfg(steps=2, P=2, G=2, L=1, checkpoint={"every_steps": 1})
    await _run_with_dir(cfg, tmp_path)
    saved = read_controller_state(latest_checkpoint(tmp_path))
    other = make_cfg(steps=5, P=3, G=2, L=1, train={"lr": 0.5})
    with pytest.raises(CheckpointError, match=r"train.groups_per_step: checkpoint 2, now 3.*train.lr"):
        check_compatible(saved, other, tmp_path)
    # a key added to the config after the checkpoint was taken counts as its default then
    del saved["config"]["train.lr"]
    check_compatible(saved, make_cfg(steps=5, P=2, G=2, L=1), tmp_path)
    with pytest.raises(CheckpointError, match=r"train.lr: checkpoint 0.001, now 0.5"):
        check_compatible(saved, make_cfg(steps=5, P=2, G=2, L=1, train={"lr": 0.5}), tmp_path)


async def test_a_crash_mid_write_leaves_the_previous_checkpoint_valid(tmp_path, monkeypatch):
    cfg = make_cfg(steps=4, P=2, G=2, L=1, checkpoint={"every_steps": 2, "at_exit": False})
    await _run_with_dir(cfg, tmp_path)
    good = latest_checkpoint(tmp_path)
    assert good.name == "step_000004"
    # a half-written next checkpoint (the process died before the rename) changes nothing
    (tmp_path / "checkpoints" / "step_000006.tmp" / "trainer").mkdir(parents=True)
    assert latest_checkpoint(tmp_path) == good
    assert read_controller_state(good)["step"] == 4


def _sim_controller(cfg, run_dir):
    storage = InMemoryRowStorage()
    gens, trainer = sim_workers(storage, num_generators=2, gen_group_s=0.002)
    return Controller(cfg, sim_prompts(), storage, Workers(gens, trainer), run_dir=str(run_dir)), trainer


async def test_a_checkpoint_slower_than_a_train_call_has_its_own_deadline(tmp_path):
    """Writing a real model's state takes minutes: a checkpoint is held to `timeouts.checkpoint_s`
    (plus its size), not to the split-API calls' `train_call_s`."""
    cfg = make_cfg(
        steps=4, P=2, G=2, L=1, checkpoint={"every_steps": 2}, timeouts={"train_call_s": 0.2, "checkpoint_s": 5}
    )
    ctl, trainer = _sim_controller(cfg, tmp_path)
    real_save = trainer.save_state

    async def slow_save(directory):
        await asyncio.sleep(0.5)  # longer than a train call may take
        await real_save(directory)

    trainer.save_state = slow_save
    summary = await asyncio.wait_for(ctl.run(), 30)
    assert summary.steps == 4 and summary.checkpoint is not None and summary.checkpoint.step == 4
    assert latest_checkpoint(tmp_path).name == "step_000004"


def _slow_saves(trainer, seconds: float) -> None:
    real_save = trainer.save_state

    async def slow_save(directory):
        await asyncio.sleep(seconds)
        await real_save(directory)

    trainer.save_state = slow_save


async def test_the_first_checkpoint_of_a_run_has_the_deadline_of_its_weights_size(tmp_path):
    """#48 S5: before a run has written a checkpoint, its deadline counts the size guessed from the
    published weights (8 x 1 GiB here: 0.2 + 8 x 0.5 s), not `checkpoint_s` alone (0.2 s, shorter
    than this write, as a real model's first checkpoint would have been)."""
    from single_controller.types import WeightsHandle

    cfg = make_cfg(
        steps=2,
        P=2,
        G=2,
        L=1,
        checkpoint={"every_steps": 2},
        timeouts={"checkpoint_s": 0.2, "checkpoint_s_per_gib": 0.5},
    )
    ctl, trainer = _sim_controller(cfg, tmp_path)
    real_export = trainer.export_weights

    async def export_1_gib(version):
        handle = await real_export(version)
        return WeightsHandle(handle.version, handle.payload, 2**30)

    trainer.export_weights = export_1_gib
    _slow_saves(trainer, 0.5)
    assert ctl._checkpoint_deadline() == 0.2  # no weights published yet
    summary = await asyncio.wait_for(ctl.run(), 30)
    assert summary.steps == 2 and summary.checkpoint is not None and summary.checkpoint.step == 2
    assert ctl.state.counters.checkpoints_written == 1  # (a second would be held to its real size)


async def test_the_first_checkpoint_after_a_resume_has_the_deadline_of_the_one_it_loaded(tmp_path):
    """#48 S5: a resumed run's first checkpoint is held to `checkpoint_s` plus the size of the
    checkpoint it loaded (here about 1 KB at 2^20 s per GiB: ~1 s; before, 0.2 s, as for none)."""
    first = make_cfg(steps=2, P=2, G=2, L=1, checkpoint={"every_steps": 2, "at_exit": False})
    await _run_with_dir(first, tmp_path)
    path = latest_checkpoint(tmp_path)
    loaded = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    saved = read_controller_state(path)
    cfg = make_cfg(
        steps=4,
        P=2,
        G=2,
        L=1,
        checkpoint={"every_steps": 2, "at_exit": False},
        timeouts={"checkpoint_s": 0.2, "checkpoint_s_per_gib": 2.0**20},
    )
    storage = InMemoryRowStorage()
    gens, trainer = sim_workers(storage, num_generators=2, gen_group_s=0.002)
    await trainer.load_state(str(path / "trainer"))
    prompts = itertools.islice(sim_prompts(), saved["dataloader"]["taken"], None)
    ctl = Controller(cfg, prompts, storage, Workers(gens, trainer), run_dir=str(tmp_path), resume=saved)
    assert 0.5 < 0.2 + loaded / 2**10 < 60  # the deadline this test relies on: longer than the write below
    _slow_saves(trainer, 0.5)
    summary = await asyncio.wait_for(ctl.run(), 30)
    assert summary.steps == 4 and summary.checkpoint is not None and summary.checkpoint.step == 4
    assert ctl._checkpoint_deadline() == 0.2 + ctl.last_checkpoint.num_bytes / 2**10  # then the one written


async def test_a_periodic_checkpoint_commits_in_the_background_while_training_goes_on(tmp_path, monkeypatch):
    """The fsyncs, rename and `latest` of a periodic checkpoint do not hold up training: steps go on
    while step 2's checkpoint is still being committed, and `latest` names it only once it is."""
    import threading
    import time

    from single_controller import checkpoint as ckpt

    cfg = make_cfg(steps=6, P=2, G=2, L=1, checkpoint={"every_steps": 2, "at_exit": False})
    ctl, trainer = _sim_controller(cfg, tmp_path)
    real, seen = ckpt._fsync_tree, {}

    def slow_fsync(path):
        if path.name == "step_000002.tmp":  # committing step 2's checkpoint: wait for 2 more steps
            deadline = time.monotonic() + 10
            while len(trainer.trained) < 4 and time.monotonic() < deadline:
                time.sleep(0.005)
            seen.update(
                trained=len(trainer.trained),
                latest=(tmp_path / "checkpoints" / "latest").exists(),
                thread=threading.current_thread() is not threading.main_thread(),
            )
        real(path)

    monkeypatch.setattr(ckpt, "_fsync_tree", slow_fsync)
    summary = await asyncio.wait_for(ctl.run(), 30)
    assert seen == {"trained": 4, "latest": False, "thread": True}
    assert summary.checkpoint.step == 6 and latest_checkpoint(tmp_path).name == "step_000006"
    assert ctl.state.counters.checkpoints_written == 3
    assert read_controller_state(latest_checkpoint(tmp_path))["step"] == 6


async def test_a_checkpoint_that_fails_to_commit_stops_the_run_with_its_cause(tmp_path, monkeypatch):
    from single_controller import checkpoint as ckpt

    cfg = make_cfg(steps=8, P=2, G=2, L=1, checkpoint={"every_steps": 2, "at_exit": False})
    ctl, trainer = _sim_controller(cfg, tmp_path)
    real = ckpt._fsync_tree

    def full_disk(path):
        if path.name == "step_000004.tmp":
            raise OSError(28, "No space left on device")
        real(path)

    monkeypatch.setattr(ckpt, "_fsync_tree", full_disk)
    with pytest.raises(RunFailed, match=r"train pump failed: OSError: .*No space left on device") as failed:
        await asyncio.wait_for(ctl.run(), 30)
    assert failed.value.checkpoint.step == 2  # the newest one that is durable
    assert latest_checkpoint(tmp_path).name == "step_000002"
    assert trainer.optimizer_steps <= 6  # stopped at the next checkpoint, not at the end
