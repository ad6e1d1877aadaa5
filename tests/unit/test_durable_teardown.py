"""Layer (b): the run's end on the simulated backend: the final checkpoint resumes, and the prompt
ledger says what the trainer applied, whatever ended the run (issue 34)."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections import Counter

import pytest

from replay.storage import InMemoryRowStorage
from single_controller.backends.sim import SimTrainerGroup, sim_prompts, sim_workers
from single_controller.checkpoint import latest_checkpoint, read_controller_state
from single_controller.controller import Controller, RunFailed
from single_controller.protocols import SubmitsByTask
from single_controller.state import Workers
from tests.helpers.sim import make_cfg


class SignallingFinish(SimTrainerGroup):
    """A sim trainer whose finish takes `finish_s` and sets `finishing[step]` as the trainer starts
    applying it."""

    def __init__(self, storage, finish_s: float):
        super().__init__(storage, finish_s=finish_s)
        self.finishing: dict[int, asyncio.Event] = {}

    async def _finish_step(self, step):
        self.finishing.setdefault(step, asyncio.Event()).set()
        return await super()._finish_step(step)


class BugDuringFinish(SubmitsByTask):
    """A sim generation worker with a bug: its request for `prompt_id` fails with a RuntimeError
    (which stops the run through the rollout pump) once the trainer applies step `step`'s finish."""

    def __init__(self, inner, trainer: SignallingFinish, step: int, prompt_id: str):
        self.inner, self.name = inner, inner.name
        self.trainer, self.step, self.prompt_id = trainer, step, prompt_id

    async def generate(self, request):
        if request.prompt.prompt_id == self.prompt_id:
            await self.trainer.finishing.setdefault(self.step, asyncio.Event()).wait()
            raise RuntimeError(f"generation bug on {request.group_id}")
        return await self.inner.generate(request)

    async def update_weights(self, weights):
        await self.inner.update_weights(weights)

    async def in_flight(self):
        return await self.inner.in_flight()


def _trainer_step_saved(run_dir) -> int:
    with open(latest_checkpoint(run_dir) / "trainer" / "sim_trainer.json", encoding="utf-8") as f:
        return json.load(f)["version"]


# -- a failure while a finish is in flight ---------------------------------------------------------
@pytest.mark.parametrize("every_steps", [1, 20], ids=["periodic_checkpoint_at_the_step", "final_checkpoint_only"])
async def test_a_finish_that_lands_as_another_pump_fails_is_recorded_trained_and_checkpointed_consistently(
    tmp_path, every_steps
):
    # Step 2 (p000004, p000005) is finishing (0.2 s on the trainer) when a generation bug on
    # p000007 (step 3) stops the run: the controller stops waiting, the trainer applies step 2.
    storage = InMemoryRowStorage()
    inner, _ = sim_workers(storage, num_generators=2, gen_group_s=0.002)
    trainer = SignallingFinish(storage, finish_s=0.2)
    gens = [BugDuringFinish(g, trainer, 2, "p000007") for g in inner]
    cfg = make_cfg(steps=6, P=2, G=2, L=1, checkpoint={"every_steps": every_steps})
    ctl = Controller(cfg, sim_prompts(), storage, Workers(gens, trainer), run_dir=str(tmp_path))
    with pytest.raises(RunFailed, match=r"rollout pump failed: RuntimeError: generation bug on p000007-a0") as failed:
        await asyncio.wait_for(ctl.run(), 30)
    assert trainer.version == 3 and sorted(trainer.trained) == [0, 1, 2]  # the finish landed
    # The newest checkpoint resumes: its controller step is its trainer state's step.
    saved = read_controller_state(latest_checkpoint(tmp_path))
    assert saved["step"] == _trainer_step_saved(tmp_path) == 3 == failed.value.checkpoint.step
    # The ledger says what the trainer applied: step 2's prompts trained in step 2, with its record.
    ledger = ctl.state.prompts
    assert [(ledger[p].fate, ledger[p].step) for p in ("p000004", "p000005")] == [("trained", 2), ("trained", 2)]
    assert [r["step"] for r in ctl.history] == [0, 1, 2] and ctl.history[-1]["train/rows"] == 4.0
    assert {p["prompt_id"] for p in saved["prompts"]["prompts"] if p["fate"] == "trained"} >= {"p000004", "p000005"}
    assert await storage.resident_keys() == set() and ctl.state.prompts.unsettled() == []
    # ... and the run goes on from it: steps 3.. only, step 2's prompts not trained again.
    resumed, trainer_2, summary = await _run(cfg, tmp_path, resume=saved)
    assert summary.steps == 6 and sorted(trainer_2.trained) == [3, 4, 5]
    per_step = _per_step(resumed)
    assert sorted(per_step) == list(range(6)) and per_step[2] == [("p000004", "p000004-a0"), ("p000005", "p000005-a0")]
    assert sum(map(len, per_step.values())) == len({p for ps in per_step.values() for p, *_ in ps}) == 12


# -- an interrupt loses nothing a crash would not ---------------------------------------------------
def _interrupt(ctl: Controller) -> None:
    """What SIGTERM does (`ControllerHost.request_stop`)."""
    ctl.state.request_stop("interrupted (SIGTERM)", abandon_open_step=True)


async def _run(cfg, run_dir, *, resume=None, interrupt_after=None, history=False, wrap=None):
    """A sim run in `run_dir` (resumed from its newest checkpoint with `resume`), interrupted as
    SIGTERM does once step `interrupt_after` is recorded; `wrap(worker, interrupt)` wraps each
    generation worker."""
    storage = InMemoryRowStorage()
    gens, trainer = sim_workers(storage, num_generators=2, gen_group_s=0.01)
    skip = resume["dataloader"]["taken"] if resume is not None else 0
    box: list[Controller] = []
    if wrap is not None:
        gens = [wrap(g, lambda: _interrupt(box[0])) for g in gens]

    def on_step(rec):
        if rec["step"] == interrupt_after:
            _interrupt(box[0])

    run_dir.mkdir(parents=True, exist_ok=True)
    hist = str(run_dir / "prompt_history.jsonl") if history else None
    ctl = Controller(
        cfg,
        itertools.islice(sim_prompts(), skip, None),
        storage,
        Workers(gens, trainer),
        run_dir=str(run_dir),
        resume=resume,
        on_step=on_step,
        prompt_history=hist,
    )
    box.append(ctl)
    if resume is not None:
        assert await trainer.load_state(str(latest_checkpoint(run_dir) / "trainer")) == resume["step"]
    summary = await asyncio.wait_for(ctl.run(), 30)
    assert await storage.resident_keys() == set() and ctl.state.ledger.resident() == 0
    return ctl, trainer, summary


def _per_step(ctl) -> dict[int, list[tuple[str, ...]]]:
    """Each step's trained prompts, each with its attempts."""
    out: dict[int, list[tuple[str, ...]]] = {}
    for r in ctl.state.prompts.to_dict()["prompts"]:
        if r["fate"] == "trained":
            out.setdefault(r["step"], []).append((r["prompt_id"], *r["attempts"]))
    return {k: sorted(v) for k, v in sorted(out.items())}


@pytest.mark.parametrize("history", [False, True], ids=["ledger_in_memory", "prompt_history_file"])
@pytest.mark.parametrize("interrupt_after", [0, 2])
async def test_an_interrupted_run_resumed_trains_every_prompt_it_took_exactly_once(tmp_path, interrupt_after, history):
    cfg = make_cfg(steps=8, P=3, G=2, L=1, checkpoint={"every_steps": 0})
    ctl_a, _, _ = await _run(cfg, tmp_path / "a")  # the same run, never interrupted
    ctl_1, trainer_1, s1 = await _run(cfg, tmp_path / "b", interrupt_after=interrupt_after, history=history)
    assert s1.stop_reason == "interrupted (SIGTERM)" and s1.checkpoint.step == interrupt_after + 1
    saved = read_controller_state(latest_checkpoint(tmp_path / "b"))
    # What was in flight or not yet trained at the interrupt is unsettled in the checkpoint, its
    # attempt rolled back; nothing is dropped because the run ended.
    unsettled = {p["prompt_id"] for p in saved["prompts"]["prompts"] if p["fate"] is None}
    assert saved["rolled_back"] and {g.split("-a")[0] for g in saved["rolled_back"]} <= unsettled
    assert [p for p in saved["prompts"]["prompts"] if p["reason"] == "run_ended"] == []
    ctl_2, trainer_2, s2 = await _run(cfg, tmp_path / "b", resume=saved, history=history)
    assert s2.steps == 8
    # Exactly once over both runs: what the uninterrupted run trains, step by step, with the same
    # attempts (re-dispatched as after a crash, not as new attempts), and each prompt the
    # interrupted run took is trained (none lost to `run_ended`).
    assert _per_step(ctl_2) == _per_step(ctl_a)
    trained_1 = {k.split("-a")[0] for keys in trainer_1.trained.values() for k in keys}
    trained_2 = {k.split("-a")[0] for keys in trainer_2.trained.values() for k in keys}
    assert trained_1.isdisjoint(trained_2)
    taken_1 = {f"p{i:06d}" for i in range(saved["dataloader"]["taken"])}
    fates = {r["prompt_id"]: (r["fate"], r["reason"]) for r in ctl_2.state.prompts.to_dict()["prompts"]}
    assert all(fates[p] == ("trained", None) for p in taken_1), {p: fates[p] for p in taken_1}
    assert Counter(f for f, _ in fates.values()) == {"trained": 24, "dropped": len(fates) - 24}


class InterruptedWhileWithdrawn(SubmitsByTask):
    """A sim generation worker that never answers request `group_id`; SIGTERM interrupts the run
    while the controller withdraws it (past its deadline)."""

    def __init__(self, inner, interrupt, group_id: str):
        self.inner, self.name, self.interrupt, self.group_id = inner, inner.name, interrupt, group_id

    async def generate(self, request):
        if request.group_id == self.group_id:
            await asyncio.Event().wait()
        return await self.inner.generate(request)

    async def withdraw(self, request, future):
        await super().withdraw(request, future)
        if request.group_id == self.group_id:
            self.interrupt()

    async def update_weights(self, weights):
        await self.inner.update_weights(weights)

    async def in_flight(self):
        return await self.inner.in_flight()


async def test_an_attempt_that_fails_as_the_run_is_interrupted_is_dispatched_again_on_resume(tmp_path):
    # p000007's first attempt fails (its deadline) with retries left, and the run is interrupted
    # before the failure is settled: a crash then would have left the prompt for a resume to
    # dispatch again; so must the interrupt.
    cfg = make_cfg(
        steps=6, P=3, G=2, L=1, checkpoint={"every_steps": 0}, rollout={"max_retries": 2}, timeouts={"generate_s": 0.2}
    )
    ctl_1, _, s1 = await _run(cfg, tmp_path, wrap=lambda g, stop: InterruptedWhileWithdrawn(g, stop, "p000007-a0"))
    assert s1.stop_reason == "interrupted (SIGTERM)"
    saved = read_controller_state(latest_checkpoint(tmp_path))
    [p7] = [p for p in saved["prompts"]["prompts"] if p["prompt_id"] == "p000007"]
    assert (p7["fate"], p7["attempts"]) == (None, ["p000007-a0"])
    ctl_2, trainer_2, s2 = await _run(cfg, tmp_path, resume=saved)
    assert s2.steps == 6
    rec = ctl_2.state.prompts["p000007"]
    assert rec.fate == "trained" and rec.attempts == ["p000007-a0", "p000007-a1"]
    assert "p000007-a1_g0" in trainer_2.trained[rec.step]


async def test_an_early_stop_still_settles_the_prompts_in_flight_run_ended(tmp_path):
    """A run that stops complete (its success target reached) keeps the run's end as their fate:
    only an interrupt leaves them for a resume."""
    run = {"stop_at_success_rate": 0.0, "success_window": 1}  # stops after its first step
    cfg = make_cfg(steps=8, P=3, G=2, L=1, checkpoint={"every_steps": 0}, run=run)
    ctl, _, summary = await _run(cfg, tmp_path)
    assert summary.stop_reason.startswith("success rate >= 0.0") and summary.steps == 1
    saved = read_controller_state(latest_checkpoint(tmp_path))
    assert [p["reason"] for p in saved["prompts"]["prompts"] if p["fate"] == "dropped"].count("run_ended") > 0
