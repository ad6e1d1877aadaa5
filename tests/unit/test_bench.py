"""`sc-grpo bench scale` runs end to end on a tiny sweep and prints every figure it promises
(its speed targets are read off the real sweep, never asserted here)."""

import json
import re
import subprocess
import types
from pathlib import Path

import pytest

from single_controller.bench import runner as bench
from single_controller.bench.runner import main_scale

EMBEDDED = str(Path(__file__).resolve().parents[2] / "configs/embedded.yaml")


def test_bench_scale_prints_every_point_the_latency_samples_the_fit_and_the_memory_run(capsys):
    assert (
        main_scale(
            [
                "--groups",
                "2,4",
                "--workers",
                "1,2",
                "--workers-at",
                "2",
                "--groups-at",
                "4",
                "--group-size",
                "2",
                "--steps",
                "4",
                "--t",
                "0.02",
                "--long-steps",
                "20",
                "--long-groups",
                "1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if re.match(r"^\s+\d+\s+\d+\s+\d", line)]
    points = [(int(r[0]), int(r[1])) for r in rows if len(r) == 14]
    assert points == [(2, 2), (4, 2), (4, 1)]
    for r in rows[:3]:
        cpu, sim, ctl = (float(x.removesuffix("us")) for x in r[6:9])
        assert 0 < sim < cpu and abs(cpu - sim - ctl) <= 0.11  # the simulated workers' share, metered
        assert 0 < float(r[9]) < 50  # wake-ups per group: the run slept between its events (T = 0.02 s)
        assert int(r[12]) >= 1  # the latency run's samples: the train pump waited for its chunks
    assert "serial generation workers" in out  # the default: one completion per group
    assert (
        main_scale(
            [
                "--groups",
                "4",
                "--workers",
                "2",
                "--workers-at",
                "2",
                "--groups-at",
                "4",
                "--group-size",
                "2",
                "--steps",
                "4",
                "--t",
                "0.02",
                "--long-steps",
                "0",
                "--batch",
                "4",
            ]
        )
        == 0
    )
    batched = capsys.readouterr().out
    assert "generation workers batch up to 4 groups" in batched and re.search(r"^\s+4\s+2\s+\d", batched, re.M)
    assert re.search(
        r"controller CPU per step ~ [\d.]+ ms \+ -?[\d.]+ us x groups "
        r"per step \(least squares over the 2 points at 2 workers\)",
        out,
    )
    assert re.search(
        r"worst: overlap [\d.]+ .*ctl/group [\d.]+ us at \d+ x \d+ .*select p99 [\d.]+ ms at \d+ x \d+", out
    )
    # the target's point: the largest groups per step, at --workers-at workers (not the 4 x 1 run)
    p99_at_4x2 = float(rows[1][11].removesuffix("ms"))
    assert (int(rows[1][0]), int(rows[1][1])) == (4, 2)
    assert f"select p99 at 4 groups per step: {p99_at_4x2:.3f} ms (target < 1 ms at 1024)" in out
    assert "long run: 20 steps of 1 groups" in out
    assert re.search(
        r"this machine: one wake-up of an idle event loop costs \d+ us of CPU after 2 ms asleep, \d+ us after 100 ms",
        out,
    )


# -- the meter that tells the simulated workers' time from the controller's -----------------------
async def test_metered_sim_workers_train_exactly_what_unmetered_ones_do_and_count_their_time():
    import asyncio

    from replay.storage import InMemoryRowStorage
    from single_controller.backends.sim import Faults, SimMeter, sim_prompts, sim_workers
    from single_controller.bench.runner import scale_config
    from single_controller.controller import Controller
    from single_controller.state import Workers

    async def run(meter, batch=1):  # lookahead 0: what each step trains does not depend on timing
        storage = InMemoryRowStorage()
        gens, trainer = sim_workers(
            storage,
            num_generators=2,
            gen_group_s=0.002,
            train_group_s=0.001,
            meter=meter,
            faults=Faults(gen_fail={("p000003", 0)}),
            gen_max_batch=batch,
        )  # a failure crosses the meter too
        summary = await asyncio.wait_for(
            Controller(scale_config(4, 4, 2, 0, 4), sim_prompts(), storage, Workers(gens, trainer)).run(), 30
        )
        return summary.steps, trainer.trained, [g.generated for g in gens]

    meter = SimMeter()
    assert await run(meter) == await run(None)
    assert meter.seconds > 0
    # batching engines (what `bench scale` simulates by default) train the same steps
    batched = await run(SimMeter(), batch=4)
    assert batched[:2] == (await run(None))[:2] and batched == await run(None, batch=4)


async def test_meter_passes_cancellation_through_and_counts_a_nested_metered_call_once(monkeypatch):
    import asyncio

    from single_controller.backends import sim
    from single_controller.backends.sim import SimMeter

    clock = iter(range(0, 1000, 10))  # every reading 10 s after the last
    monkeypatch.setattr(sim.time, "perf_counter", lambda: next(clock))
    meter = SimMeter()
    blocked = asyncio.Event()

    async def inner():
        return 1

    async def outer():
        x = await sim._metered_coroutine(inner, meter)()  # nested in outer's step: not timed again
        blocked.set()
        await asyncio.Event().wait()
        return x

    task = asyncio.ensure_future(sim._metered_coroutine(outer, meter)())
    await blocked.wait()
    assert meter.seconds == 10  # one step, one pair of readings
    task.cancel()
    try:
        await task
        raise AssertionError("the cancellation did not reach the metered coroutine")
    except asyncio.CancelledError:
        pass
    assert meter.seconds == 20  # the step that took the cancellation


async def test_metered_callbacks_are_timed_once_and_not_again_inside_a_metered_step(monkeypatch):
    import asyncio

    from single_controller.backends import sim
    from single_controller.backends.sim import SimMeter

    clock = iter(range(0, 1000, 10))
    monkeypatch.setattr(sim.time, "perf_counter", lambda: next(clock))
    meter = SimMeter()
    seen = []
    callback = sim._metered_callback(seen.append, meter)
    callback("alone")
    assert meter.seconds == 10 and seen == ["alone"]

    async def step():
        callback("nested")  # inside the coroutine's metered step: counted by that step's readings
        return 7

    assert await asyncio.wait_for(sim._metered_coroutine(step, meter)(), 5) == 7  # any awaiting works
    assert meter.seconds == 20 and seen == ["alone", "nested"]
    assert not meter._inside

    def fails(_):
        raise ValueError("boom")

    try:
        sim._metered_callback(fails, meter)(None)
        raise AssertionError("the callback's error did not come through")
    except ValueError:
        pass
    assert meter.seconds == 30 and not meter._inside  # timed, and the meter is free again


def _fake_embedded(monkeypatch, stdout: str, ref_reached: bool = True, step_walls: list[float] | None = None):
    """`bench embedded` with its run command and reference loop replaced: what it ran, with what.
    `step_walls`: the run writes step records with these `time/wall_s` (and an eval record)."""
    runs, refs = [], []

    def fake_run(cmd, **kw):
        runs.append(cmd)
        if step_walls is not None:
            out = Path(next(a for a in cmd if a.startswith("run.output_dir=")).split("=", 1)[1])
            (out / "embedded-1").mkdir()
            lines = [{"step": i, "time/wall_s": w} for i, w in enumerate(step_walls)] + [
                {"eval/policy_version": 3, "time/wall_s": 99.0}
            ]
            (out / "embedded-1" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        return subprocess.CompletedProcess(cmd, 0, stdout=stdout, stderr="")

    def fake_reference(seed, **kw):
        refs.append((seed, kw))
        return types.SimpleNamespace(steps=100, seconds=8.0, reached=ref_reached)

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setattr("single_controller.bench.reference_loop.run_reference", fake_reference)
    return runs, refs


def test_bench_embedded_takes_overrides_after_seeds_and_gives_them_to_the_reference_loop_too(monkeypatch, capsys):
    runs, refs = _fake_embedded(
        monkeypatch, "sc-grpo: 50 steps in 4.0s of training (+7.0s startup): success rate >= 0.8 over 3 steps\n"
    )
    argv = [
        "--config",
        EMBEDDED,
        "--seeds",
        "0",
        "1",
        "train.lr=3e-4",
        "run.stop_at_success_rate=0.8",
        "run.success_window=3",
    ]
    assert bench.main_embedded(argv) == 0
    assert [c[c.index("run") + 2 : c.index("run") + 3] for c in runs] == [["seed=0"], ["seed=1"]]
    assert all(c[-3:] == ["train.lr=3e-4", "run.stop_at_success_rate=0.8", "run.success_window=3"] for c in runs)
    assert refs == [
        (
            s,
            dict(
                task="reverse_digits", num_digits=3, prompts_per_step=16, group_size=16, lr=3e-4, target=0.8, window=3
            ),
        )
        for s in (0, 1)
    ]
    out = capsys.readouterr().out
    assert out.count("ratio 0.50") == 2 and "training / reference 0.50" in out


def test_bench_embedded_times_the_run_to_the_end_of_the_step_that_reached_the_target(monkeypatch, capsys):
    """The reference loop's clock stops at the end of the step that reached the target; the run's
    "s of training" also holds its final checkpoint and teardown. The ratio uses the step's end."""
    _fake_embedded(
        monkeypatch,
        "sc-grpo: 3 steps in 4.0s of training (+7.0s startup): success rate >= 0.9 over 5 steps\n",
        step_walls=[1.0, 2.5, 3.6],
    )
    assert bench.main_embedded(["--config", EMBEDDED, "--seeds", "0"]) == 0
    out = capsys.readouterr().out
    assert "training 3.60 s" in out and "with the final checkpoint and teardown 4.00 s" in out
    assert "ratio 0.45" in out and "training / reference 0.45" in out


def test_bench_embedded_reports_no_ratio_for_a_run_that_stopped_short_of_the_target(monkeypatch, capsys):
    _fake_embedded(monkeypatch, "sc-grpo: 3 steps in 0.3s of training (+7.0s startup): training finished\n")
    assert bench.main_embedded(["--config", EMBEDDED, "--seeds", "0", "run.max_steps=3"]) == 1
    out = capsys.readouterr().out
    assert "no ratio: the run did not reach success 0.9" in out and "ratio 0.04" not in out


def test_bench_embedded_refuses_a_config_the_reference_loop_cannot_mirror(monkeypatch):
    runs, _ = _fake_embedded(monkeypatch, "")
    with pytest.raises(SystemExit, match="model other than the default"):
        bench.main_embedded(["--config", EMBEDDED, "model.d_model=128"])
    with pytest.raises(SystemExit, match="stop_at_success_rate=null"):
        bench.main_embedded(["--config", EMBEDDED, "run.stop_at_success_rate=null"])
    assert runs == []  # refused before any run


@pytest.mark.parametrize(
    "main, argv, why",
    [
        (bench.main_overlap, ["--steps", "1"], "--steps must be at least 2"),
        (bench.main_eval, ["--backend", "sim", "--steps", "3", "--repeats", "0"], "--repeats, --steps and --every"),
    ],
)
def test_bench_arguments_that_leave_nothing_to_measure_are_refused_before_running(main, argv, why, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2 and why in capsys.readouterr().err


def test_bench_trl_gives_both_sides_the_same_settings_and_a_valid_sc_grpo_config(tmp_path):
    from single_controller.bench import trl, trl_loop
    from single_controller.preflight.loader import load_config

    model = tmp_path / "m"
    for steps in (None, 30):
        cfg = load_config("configs/embedded.yaml", trl.sc_grpo_overrides(model, 1, steps, 400, str(tmp_path)))
        theirs = trl_loop.parse_args(trl.trl_command(model, 1, steps, 400)[3:])
        assert (cfg.seed, theirs.seed) == (1, 1) and theirs.model == str(model)
        assert cfg.task.name == theirs.task and cfg.task.num_digits == theirs.num_digits
        assert cfg.task.num_prompts == theirs.num_prompts
        assert cfg.rollout.group_size == theirs.group_size and cfg.train.groups_per_step == theirs.prompts_per_step
        assert cfg.train.lr == theirs.lr and tuple(cfg.train.betas) == tuple(theirs.betas)
        assert cfg.train.clip_eps == theirs.clip_eps and cfg.train.grad_clip == theirs.grad_clip
        assert cfg.rollout.max_new_tokens == theirs.num_digits and cfg.rollout.stop_at_eos
        assert cfg.run.success_window == theirs.window and cfg.model.dtype == "float32"
        assert cfg.train.kl_coef == 0 and not cfg.train.gradient_checkpointing and cfg.train.loss_agg == "token_mean"
        if steps is None:
            assert cfg.run.stop_at_success_rate == theirs.target and theirs.steps is None
        else:
            assert cfg.run.max_steps == theirs.steps == steps and cfg.run.stop_at_success_rate is None


def test_bench_trl_reads_both_summary_lines_and_reports_the_ratios():
    import subprocess as sp

    from single_controller.bench import trl

    def done(line: str) -> sp.CompletedProcess[str]:
        return sp.CompletedProcess([], 0, stdout=f"noise\n{line}\n", stderr="")

    theirs = trl._parse(
        "trl", "tiny", 0, done("TRL: 100 steps in 10.00s of training (+3.00s startup): success 0.9"), 20.0, 1.9
    )
    ours = trl._parse(
        "sc-grpo colocated",
        "tiny",
        0,
        done("sc-grpo: 100 steps in 8.00s of training (+4.0s startup): success rate >= 0.9"),
        16.0,
        1.5,
    )
    assert (ours.steps, ours.train_s, ours.startup_s, ours.step_s) == (100, 8.0, 4.0, 0.08)
    [line] = trl.summarize([theirs, ours])
    assert line.startswith("tiny, sc-grpo colocated: ")
    assert "speed per step TRL / sc-grpo 1.25x" in line and "time to the target: TRL / sc-grpo 1.25x" in line
    assert "whole command sc-grpo / TRL 0.80" in line
    with pytest.raises(RuntimeError, match=r"(?s)sc-grpo .tiny, seed 0. failed .exit 1.*boom"):
        trl._parse("sc-grpo", "tiny", 0, sp.CompletedProcess([], 1, stdout="", stderr="boom"), 1.0, 1.0)


def test_bench_one_gpu_splits_each_step_into_its_phases_and_states_both_ratios():
    from single_controller.bench.one_gpu import ratios, summarize

    def rec(step_s, train_s, switch_total, gen_tokens=1000.0):
        return {
            "time/step_s": step_s,
            "train/step_s": train_s,
            "sync/admission_closed_s": 0.1,
            "sync/last_s": 0.2,
            "throughput/gen_tokens_per_s": gen_tokens / step_s,
            "train/tokens": 2000.0,
            "rollout/reward_mean": 0.5,
            "turns/sleep_s": switch_total,
        }

    # turns: each step 4 s = 0.1 sync + 1 train + 0.4 switch + 2.5 generation (running totals of the switch)
    records = [rec(4.0, 1.0, 0.4 * (i + 1)) for i in range(6)]
    turns = summarize(records, "turns")
    assert turns["switch_s"] == pytest.approx(0.4) and turns["gen_s"] == pytest.approx(2.5)
    assert turns["gen_tokens_per_s"] == pytest.approx(1000 / 2.5) and turns["train_tokens_per_s"] == pytest.approx(2000)
    # shared: generation runs beside training, so its phase is the step less the sync's closed admission
    shared = summarize([rec(2.0, 1.5, 0.0) for _ in range(6)], "shared")
    assert shared["gen_s"] == pytest.approx(1.9) and shared["switch_s"] == 0.0
    lines = ratios({"engine": {"gen_tokens_per_s": 500.0}, "shared": shared, "turns": turns, "trl": {"step_s": 3.0}})
    assert lines[0] == "- steps/s, sc-grpo (shared) over TRL colocated: **1.50x** (target >= 1.3)"
    assert "sc-grpo turns over vLLM alone: **0.80**" in lines[2]
    assert ratios({"trl": {"failed": "exit 1"}, "turns": turns}) == []


def test_bench_logprob_memory_runs_both_formulas_each_in_its_own_process(tmp_path, capsys):
    """`sc-grpo bench logprob-memory` at a small vocabulary: both sides run, give the same logprobs,
    and the table is written."""
    from single_controller.bench import logprob_memory

    argv = ["--vocab", "2000", "--rows", "2", "--prompt", "4", "--response", "8", "--out", str(tmp_path)]
    assert logprob_memory.main(argv) == 0
    text = (tmp_path / "logprob_memory.md").read_text()
    assert "| chunked (`picked_logprobs`) |" in text and "ratio chunked / whole" in text
    sums = text.rsplit("logprob sums: ", 1)[1]
    whole, chunked = (float(part.split()[-1].rstrip(",")) for part in sums.split(", "))
    assert whole == pytest.approx(chunked, rel=1e-5)
