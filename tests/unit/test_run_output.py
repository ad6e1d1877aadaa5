"""Run directory, metrics log, curves and console lines, fed with synthetic step records."""

from __future__ import annotations

import io
import json
import math
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
import torch

from single_controller.preflight.loader import load_config
from single_controller.runtime.console import ConsoleReporter, format_step_line
from single_controller.runtime.plots import plot_metrics, pump_wait_keys
from single_controller.runtime.records import read_metrics
from single_controller.runtime.run_dir import RunDirectory

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
NOW = datetime(2026, 3, 4, 5, 6, 7)


def cfg_in(tmp_path: Path, *overrides: str):
    return load_config(None, [f"run.output_dir={tmp_path / 'runs'}", "run.name=demo", *overrides])


def synthetic(steps: int, pumps=("rollout", "train", "advantage", "sync")) -> list[dict]:
    out = []
    for s in range(steps):
        success = s / max(1, steps - 1)
        record = {
            "step": s,
            "time/wall_s": 1.5 * (s + 1),
            "rollout/reward_mean": 0.2 + 0.7 * success,
            "rollout/success_rate": success,
            "train/staleness_mean": 0.5,
            "train/staleness_max": 1,
            "time/step_s": 1.5,
            "throughput/train_tokens_per_s": 1000.0 + s,
        }
        record.update({f"pump/{p}_wait_s": 0.01 * (i + 1) for i, p in enumerate(pumps)})
        out.append(record)
    return out


def assert_png(path: Path, min_width: int = 600) -> None:
    import matplotlib.image

    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    image = matplotlib.image.imread(path)
    height, width = image.shape[:2]
    assert width >= min_width and height >= min_width // 2
    assert image.std() > 0.01  # not a blank canvas


def test_run_directory_layout_and_resolved_config(tmp_path):
    cfg = cfg_in(tmp_path, "train.lr=3e-4")
    with RunDirectory(cfg, now=NOW) as run:
        assert run.path == tmp_path / "runs" / "demo-20260304-050607"
        assert run.config_path.name == "config.yaml"
        assert load_config(str(run.config_path), []) == cfg  # resolved: reloads to the same config


def test_two_runs_in_the_same_second_get_distinct_directories(tmp_path):
    cfg = cfg_in(tmp_path)
    with RunDirectory(cfg, now=NOW) as a, RunDirectory(cfg, now=NOW) as b:
        assert a.path != b.path
        assert b.path.name == "demo-20260304-050607-2"


def test_metrics_are_one_flushed_json_object_per_line(tmp_path):
    with RunDirectory(cfg_in(tmp_path), now=NOW) as run:
        for record in synthetic(3):
            run.append_metrics(record)
        # readable while the run is still going (flushed, not buffered until close)
        lines = run.metrics_path.read_text().splitlines()
        assert len(lines) == 3
        assert [json.loads(line)["step"] for line in lines] == [0, 1, 2]
        assert json.loads(lines[2]) == synthetic(3)[2]


def test_metrics_values_are_made_json_safe(tmp_path):
    with RunDirectory(cfg_in(tmp_path), now=NOW) as run:
        run.append_metrics(
            {
                "step": np.int64(4),
                "train/loss": torch.tensor(0.25),
                "train/grad_norm": float("nan"),
                "rollout/reward_mean": np.float32(0.5),
                "note": Path("x"),
            }
        )
        (record,) = read_metrics(run.metrics_path)
    assert record["step"] == 4 and record["train/loss"] == 0.25 and record["rollout/reward_mean"] == 0.5
    assert record["train/grad_norm"] is None  # strict JSON has no NaN
    assert record["note"] == "x"
    assert record["time/wall_s"] >= 0  # stamped when the record has none
    with pytest.raises(ValueError):
        run.append_metrics({"step": 5})  # closed


def test_a_torn_last_line_is_skipped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "rollo')
    assert read_metrics(path) == [{"step": 0}, {"step": 1}]


def test_save_plot_writes_a_valid_png(tmp_path):
    with RunDirectory(cfg_in(tmp_path), now=NOW) as run:
        for record in synthetic(20):
            run.append_metrics(record)
        path = run.save_plot()
    assert path == run.path / "curves.png"
    assert_png(path)


def test_start_plot_renders_in_the_background_and_close_waits_for_it(tmp_path):
    run = RunDirectory(cfg_in(tmp_path), now=NOW)
    for record in synthetic(20):
        run.append_metrics(record)
    run.start_plot()  # the records written so far, flushed first
    assert run._plotting is not None
    run.close()  # joins the render
    assert run._plotting is None
    assert_png(run.path / "curves.png")


def test_plot_with_missing_keys_or_no_records_still_renders(tmp_path):
    sparse = [{"step": s, "rollout/reward_mean": 0.1 * s} for s in range(5)]
    assert_png(plot_metrics(sparse, tmp_path / "sparse.png"))
    assert_png(plot_metrics([], tmp_path / "empty.png"))


def test_pump_wait_keys_are_whatever_exists():
    records = synthetic(2, pumps=("rollout", "train")) + [{"pump/sync_wait_s": 0.1, "pump/train_busy_s": 2}]
    assert pump_wait_keys(records) == ["pump/rollout_wait_s", "pump/sync_wait_s", "pump/train_wait_s"]


def test_step_line_has_every_known_field_in_order():
    record = synthetic(11)[10]
    line = format_step_line(record, max_steps=400)
    assert line == ("step  10/400 | reward 0.900 | success 1.000 | staleness 0.50 | step_time 1.50s | tokens/s 1,010")


def test_step_line_omits_missing_fields():
    assert format_step_line({"step": 3, "time/step_s": 0.5}, max_steps=9) == "step 3/9 | step_time 0.50s"
    assert format_step_line({"rollout/success_rate": math.nan}, step=2) == "step 2"


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_console_reporter_prints_lines_without_a_bar_when_not_a_tty():
    stream = io.StringIO()
    with ConsoleReporter(3, progress_bar=True, stream=stream) as reporter:
        assert not reporter.bar_enabled
        for record in synthetic(3):
            reporter.step(record)
    lines = stream.getvalue().splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["step 0/3", "step 1/3", "step 2/3"]


def test_console_reporter_shows_a_bar_on_a_tty_unless_disabled():
    stream = FakeTTY()
    with ConsoleReporter(4, progress_bar=True, stream=stream) as reporter:
        assert reporter.bar_enabled
        for record in synthetic(2):
            reporter.step(record)
        assert reporter._bar.n == 2
    out = stream.getvalue()
    assert "step 0/4 | reward" in out and "step 1/4 | reward" in out
    assert "0/4 [" in out and "1/4 [" in out  # the bar's own counter, redrawn under each line
    with ConsoleReporter(4, progress_bar=False, stream=FakeTTY()) as reporter:
        assert not reporter.bar_enabled


def test_console_reporter_from_config(tmp_path):
    cfg = cfg_in(tmp_path, "run.max_steps=7", "run.progress_bar=false")
    with ConsoleReporter(cfg, stream=FakeTTY()) as reporter:
        assert reporter.max_steps == 7 and not reporter.bar_enabled
        assert reporter.step({"step": 1}) == "step 1/7"
    with ConsoleReporter(cfg_in(tmp_path, "run.max_steps=7"), stream=FakeTTY()) as reporter:
        assert reporter.bar_enabled


def test_write_json_and_create(tmp_path):
    with RunDirectory.create(cfg_in(tmp_path), now=NOW) as run:
        path = run.write_json("summary.json", {"steps": np.int64(3), "wall_s": float("inf"), "ok": True})
        assert json.loads(path.read_text()) == {"steps": 3, "wall_s": None, "ok": True}


def test_reopen_fills_step_records_the_killed_driver_never_wrote_from_the_checkpoint(tmp_path):
    """A kill -9 can land after the controller checkpointed step 8 but before the driver wrote the
    record of step 7: the resume takes it from the checkpoint's records, and drops steps >= 8."""
    import json

    from single_controller.config.schema import Config
    from single_controller.runtime.run_dir import RunDirectory

    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "time/wall_s": float(s)}) + "\n" for s in range(7))
    )
    recovered = [{"step": s, "time/wall_s": float(s)} for s in range(4, 10)]
    rd = RunDirectory.reopen(tmp_path, Config(), from_step=8, recovered=recovered)
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(8))
    assert rd.wall_offset_s == 7.0


def test_a_second_resume_keeps_the_overrides_of_the_first_unless_it_overrides_them_again(tmp_path):
    """`sc-grpo run --resume DIR k=v` builds its config with `resume_config`: the config the run last
    ran with (the first resume's `config.resume.yaml`), not the original `config.yaml`, plus its own."""
    from single_controller.runtime.run_dir import resume_config

    with RunDirectory.create(cfg_in(tmp_path, "run.max_steps=10"), now=NOW) as run:
        path = run.path
    first = resume_config(path, ["run.max_steps=20", "timeouts.generate_s=77"])
    RunDirectory.reopen(path, first, from_step=0).close()  # the first resume runs with it
    second = resume_config(path, ["run.max_steps=30"])
    assert (second.timeouts.generate_s, second.run.max_steps, second.run.name) == (77, 30, "demo")
    assert resume_config(path, ["timeouts.generate_s=5"]).timeouts.generate_s == 5  # overridden again
    with pytest.raises(FileNotFoundError, match="is not a run directory"):
        resume_config(tmp_path)


def test_the_wall_clock_of_step_records_never_goes_back_over_two_resumes_that_recover_records(tmp_path):
    """A kill -9 can take the driver before it wrote the last steps' records; each resume takes
    them from its checkpoint. Over a sim run and two such resumes, `time/wall_s` of the step
    records (in step order) only goes forward: the records a resumed part checkpointed carry the
    run's clock, not that part's own."""
    from single_controller.runtime.driver import EXIT_OK, run_from_config

    root = Path(__file__).resolve().parents[2]
    overrides = [f"run.output_dir={tmp_path}", "checkpoint.every_steps=2", "metrics.enabled=false", "run.plot=false"]
    cfg = load_config(str(root / "configs/sim.yaml"), [*overrides, "run.max_steps=6", "run.progress_bar=false"])
    assert run_from_config(cfg) == EXIT_OK
    (run_dir,) = tmp_path.glob("sim-*")
    metrics = run_dir / "metrics.jsonl"
    for max_steps in (12, 18):
        # the killed driver never wrote the last two steps' records (the final checkpoint holds them)
        lines = metrics.read_text().splitlines(keepends=True)
        metrics.write_text("".join(lines[:-2]))
        cfg = load_config(str(run_dir / "config.yaml"), [f"run.max_steps={max_steps}"])
        assert run_from_config(cfg, str(run_dir)) == EXIT_OK
    records = read_metrics(metrics)
    assert [r["step"] for r in records] == list(range(18))
    back = [
        (r["step"], r["time/wall_s"])
        for prev, r in zip(records, records[1:])
        if r["time/wall_s"] <= prev["time/wall_s"]
    ]
    assert not back, f"step records whose wall clock goes back (step, time/wall_s): {back}"


def test_an_error_raised_inside_a_ray_actor_is_said_as_its_cause_in_one_line():
    import ray.exceptions

    from single_controller.errors import error_text

    class TQRuntimeError(RuntimeError):
        pass

    remote_tb = 'Traceback (most recent call last):\n  File "service.py", line 1, in setup\nTQRuntimeError: boom'
    err = ray.exceptions.RayTaskError(
        "ControllerHost.setup", remote_tb, TQRuntimeError("a TransferQueue controller already runs")
    )
    assert "File " in str(err) and "File " in str(err.as_instanceof_cause())  # what the driver used to print
    assert error_text(err) == "TQRuntimeError: a TransferQueue controller already runs (in ControllerHost.setup)"
    assert error_text(err.as_instanceof_cause()).startswith("TQRuntimeError: a TransferQueue controller already runs")
    assert "\n" not in error_text(err.as_instanceof_cause())
    assert error_text(ValueError("plain")) == "ValueError: plain"
    # an actor whose __init__ raised: said by the remote error's last line
    init = ray.exceptions.RayTaskError(
        "GenerationActor.__init__",
        'Traceback (most recent call last):\n  File "g.py", line 4\nSyntaxError: invalid syntax',
        SyntaxError("invalid syntax"),
    )
    assert (
        error_text(ray.exceptions.ActorDiedError(init))
        == "ActorDiedError: an actor's __init__ failed: SyntaxError: invalid syntax"
    )


def test_errors_that_failed_together_are_each_named_nested_groups_flattened():
    from single_controller.controller import RunFailed
    from single_controller.errors import error_text

    group = ExceptionGroup(
        "unhandled errors in a TaskGroup",
        [ValueError("bad value"), ExceptionGroup("inner", [KeyError("k"), OSError("disk on fire")])],
    )
    said = "3 errors together: ValueError: bad value; KeyError: 'k'; OSError: disk on fire"
    assert error_text(group) == said
    assert error_text(ExceptionGroup("one", [ExceptionGroup("nested", [OSError("alone")])])) == "OSError: alone"
    failed = RunFailed("rollout", group, also=[("train", ExceptionGroup("g", [RuntimeError("rank 1 gone")]))])
    assert str(failed) == f"rollout pump failed: {said}; the train pump failed too: RuntimeError: rank 1 gone"


async def test_the_driver_gets_the_records_of_several_steps_per_call_and_the_end_at_once():
    """`next_records(cursor, linger_s)`: after the first new record, the call waits up to `linger_s`
    for the ones behind it (one actor call for a few steps, not one per step), but returns as soon as
    the run has finished; asking from a cursor drops the records before it."""
    import asyncio
    import time
    import types

    from single_controller.config.schema import Config
    from single_controller.runtime.actor_host import ControllerHost

    host = ControllerHost(Config())
    written: list[int] = []  # what the controller is told the driver wrote (its checkpoints keep the rest)
    host.controller = types.SimpleNamespace(records_written=written.append)  # type: ignore[assignment]

    async def steps(first: int, n: int, finish: bool = False) -> None:
        for i in range(first, first + n):
            await asyncio.sleep(0.02)
            host._on_step({"step": i})
        if finish:
            host._finished.set()
            host._changed.set()

    feeding = asyncio.ensure_future(steps(0, 5))
    records, finished = await host.next_records(0, 1.0)
    await feeding
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4] and not finished
    records, _ = await host.next_records(0)  # no linger: what there is, at once
    assert len(records) == 5
    feeding = asyncio.ensure_future(steps(5, 2, finish=True))
    t0 = time.perf_counter()
    records, finished = await host.next_records(5, 30.0)
    assert time.perf_counter() - t0 < 5.0, "lingered past the run's end"
    assert [r["step"] for r in records] == [5, 6]
    assert host._records_base == 5 and len(host.records) == 2, "acknowledged records kept"
    assert written == [5], "the controller was not told which records the driver wrote"
    await feeding
    t0 = time.perf_counter()
    assert await host.next_records(7, 30.0) == ([], True)
    assert time.perf_counter() - t0 < 5.0
