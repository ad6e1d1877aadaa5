"""`run.loggers` in this process: a logger that raises is disabled with one warning (alone and in a sim run), one that
cannot start is left out, an unknown logger or a missing package is refused before the run; records with a sample
are written, plotted, resumed and printed as one line. A whole run with every logger, read back by each logger's own
reader: tests/e2e/test_loggers_run.py."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from single_controller.preflight.loader import ConfigError, load_config
from single_controller.runtime.loggers import RecordLoggers
from single_controller.runtime.records import read_metrics
from tests.helpers.logger_runs import RUN, STEPS, steps_of

ROOT = Path(__file__).resolve().parents[2]


class FakeLogger:
    def __init__(self, name: str, fail_at: int | None = None):
        self.name, self.fail_at, self.seen, self.closed = name, fail_at, [], False

    def log(self, record):
        if record["step"] == self.fail_at:
            raise OSError(f"{self.name}: disk full")
        self.seen.append(record["step"])

    def close(self):
        self.closed = True


def test_a_logger_that_raises_is_disabled_with_one_warning_and_the_others_go_on(caplog):
    bad, good = FakeLogger("tensorboard", fail_at=1), FakeLogger("wandb")
    loggers = RecordLoggers([bad, good])
    with caplog.at_level(logging.WARNING, logger="single_controller.runtime.loggers"):
        for step in range(4):
            loggers.log({"step": step})
        loggers.close()
    assert (bad.seen, good.seen) == ([0], [0, 1, 2, 3])
    assert good.closed and bad.closed  # a disabled logger's files are closed too, without a second warning
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "run.loggers: tensorboard failed (OSError: tensorboard: disk full)" in warning


def test_a_run_whose_logger_raises_succeeds_with_one_warning_and_every_record_in_metrics_jsonl(
    tmp_path, monkeypatch, caplog
):
    from torch.utils.tensorboard import SummaryWriter

    from single_controller.runtime.driver import EXIT_OK, run_from_config

    def add_scalar(self, *args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(SummaryWriter, "add_scalar", add_scalar)
    cfg = load_config(str(ROOT / RUN[0]), ["run.loggers=[tensorboard]", *RUN[2:], f"run.output_dir={tmp_path}"])
    with caplog.at_level(logging.WARNING, logger="single_controller.runtime.loggers"):
        assert run_from_config(cfg) == EXIT_OK
    (run_dir,) = tmp_path.glob("sim-*")
    assert [r["step"] for r in steps_of(read_metrics(run_dir / "metrics.jsonl"))] == list(range(STEPS))
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "tensorboard failed (OSError: No space left on device)" in warning
    assert (run_dir / "run.log").read_text().count("tensorboard failed") == 1


def test_a_logger_that_cannot_start_is_left_out_with_one_warning(tmp_path, monkeypatch, caplog):
    from single_controller.runtime import loggers as loggers_module
    from single_controller.runtime.run_dir import RunDirectory

    def broken(cfg, run_dir):
        raise RuntimeError("wandb-core did not start")

    monkeypatch.setitem(loggers_module.LOGGERS, "wandb", broken)
    cfg = load_config(None, ["run.loggers=[jsonl,wandb]", f"run.output_dir={tmp_path}"])
    with RunDirectory(cfg) as run_dir, caplog.at_level(logging.WARNING, logger="single_controller.runtime.loggers"):
        started = RecordLoggers.open(cfg, run_dir)
    assert started.loggers == []
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "run.loggers: wandb could not start (RuntimeError: wandb-core did not start)" in warning


def test_an_unknown_logger_is_a_config_error_naming_the_choices():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["run.loggers=[jsonl,tensorbord]"])
    message = " ".join(str(info.value).split())
    assert "run.loggers: each item must be one of jsonl, tensorboard, wandb; got 'tensorbord'" in message
    assert "did you mean 'tensorboard'?" in message


def test_a_logger_whose_package_is_missing_is_refused_before_the_run_naming_the_pip_package(tmp_path, monkeypatch):
    import importlib.util

    from single_controller.runtime.driver import run_from_config

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    cfg = load_config(str(ROOT / RUN[0]), [*RUN[1:], f"run.output_dir={tmp_path}"])
    with pytest.raises(ConfigError) as info:
        run_from_config(cfg)
    message = " ".join(str(info.value).split())
    assert "run.loggers names wandb, which needs the `wandb` package, not installed: pip install wandb" in message
    assert "tensorboard" not in message  # installed here
    assert not list(tmp_path.iterdir())  # nothing started


def test_records_with_a_sample_are_written_plotted_resumed_and_printed_as_one_line(tmp_path):
    import io

    from single_controller.runtime.console import ConsoleReporter
    from single_controller.runtime.plots import plot_metrics
    from single_controller.runtime.run_dir import RunDirectory

    cfg = load_config(None, [f"run.output_dir={tmp_path}", "run.name=demo"])
    sample = {"prompt": "<rev> 1 2 3", "completion": "3 2 1", "reward": 1.0}
    records = [{"step": s, "rollout/reward_mean": 0.5, "time/wall_s": float(s + 1)} for s in range(4)]
    records[1]["sample"] = sample
    with RunDirectory(cfg) as run_dir:
        for r in records:
            run_dir.append_metrics(r)
    assert read_metrics(run_dir.metrics_path)[1]["sample"] == sample
    plot_metrics(read_metrics(run_dir.metrics_path), tmp_path / "curves.png")
    reopened = RunDirectory.reopen(run_dir.path, cfg, from_step=3)
    reopened.close()
    assert [r.get("sample") for r in read_metrics(run_dir.metrics_path)] == [None, sample, None]
    out = io.StringIO()
    ConsoleReporter(4, progress_bar=False, stream=out).step(records[1])
    assert out.getvalue() == "step 1/4 | reward 0.500\n"


@pytest.mark.parametrize("mode", [None, "online"])
def test_wandb_offline_by_default_says_so_once(tmp_path, monkeypatch, caplog, mode):
    """Issue #54 trap 3: W&B is offline unless WANDB_MODE says otherwise; that is said, not silent."""
    import sys
    import types

    from single_controller.runtime import loggers as loggers_module
    from single_controller.runtime.run_dir import RunDirectory

    calls = []
    fake = types.SimpleNamespace(init=lambda **kw: calls.append(kw) or object(), Settings=lambda **kw: kw)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    if mode is None:
        monkeypatch.delenv("WANDB_MODE", raising=False)
    else:
        monkeypatch.setenv("WANDB_MODE", mode)
    cfg = load_config(None, ["run.loggers=[jsonl,wandb]", f"run.output_dir={tmp_path}"])
    with RunDirectory(cfg) as run_dir, caplog.at_level(logging.WARNING, logger="single_controller.runtime.loggers"):
        loggers_module.WandbLogger(cfg, run_dir)
    assert calls[0]["mode"] == (mode or "offline")
    said = [r.getMessage() for r in caplog.records if "offline" in r.getMessage()]
    if mode is None:
        assert len(said) == 1 and "set WANDB_MODE=online" in said[0]
    else:
        assert said == []
