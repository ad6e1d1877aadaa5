"""Where a run's records go besides the console and `metrics.jsonl`: the loggers of `run.loggers`.

`RecordLoggers.open(cfg, run_dir)` starts `tensorboard` (`<run dir>/tensorboard/`) and `wandb`
(`<run dir>/wandb/`, offline unless `WANDB_MODE` says otherwise) in the driver, never the controller;
`log(record)` writes every finite number as a scalar and a record's `sample` as text. A logger that
raises is disabled with one warning; the run goes on. A resume continues in place (TensorBoard
purges the steps trained again, W&B resumes the id in `<run dir>/wandb_run_id`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import secrets
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeGuard

from single_controller.config.schema import Config
from single_controller.runtime.records import EVAL_VERSION_KEY, STEP_KEY, is_eval_record
from single_controller.runtime.run_dir import RunDirectory

__all__ = ["RecordLogger", "RecordLoggers", "sample_of", "sample_text", "scalars"]

log = logging.getLogger(__name__)

TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_run_id"
SAMPLE_KEY = "sample"
SAMPLE_COLUMNS = ("step", "prompt", "completion", "reward")


class RecordLogger(Protocol):
    name: str

    def log(self, record: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars(record: Mapping[str, Any]) -> tuple[int | None, dict[str, float]]:
    """(the step `record` is logged at, its finite numbers by key): a step's record at its `step`, every
    key but `step`; an eval point's at its `eval/policy_version`, its `eval/...` keys but that one (its
    `time/...` keys would land among the steps' at the same x); (None, {}) for a record with neither."""
    if is_eval_record(record):
        at, keys = record[EVAL_VERSION_KEY], [k for k in record if k.startswith("eval/") and k != EVAL_VERSION_KEY]
    elif STEP_KEY in record:
        at, keys = record[STEP_KEY], [k for k in record if k != STEP_KEY]
    else:
        return None, {}
    values = {k: float(record[k]) for k in keys if _is_number(record[k])}
    return int(at), values


def _is_number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def sample_of(record: Mapping[str, Any]) -> dict[str, Any] | None:
    """The record's `sample` as {prompt, completion, reward} (None: it has none, or not of that shape)."""
    sample = record.get(SAMPLE_KEY)
    if not isinstance(sample, Mapping) or not {"prompt", "completion"} <= sample.keys():
        return None
    reward = sample.get("reward")
    return {
        "prompt": str(sample["prompt"]),
        "completion": str(sample["completion"]),
        "reward": float(reward) if _is_number(reward) else None,
    }


def sample_text(step: int | None, sample: Mapping[str, Any]) -> str:
    """A sample as run.log's multi-line entry: a head line, then the prompt and the completion indented."""
    where, reward = (f"sample at step {step}" if step is not None else "sample"), sample.get("reward")
    lines = [f"{where}: reward {reward:.3f}" if reward is not None else f"{where}: no reward", "  prompt:"]
    lines += [f"    {line}" for line in str(sample["prompt"]).splitlines() or [""]]
    lines.append("  completion:")
    lines += [f"    {line}" for line in str(sample["completion"]).splitlines() or [""]]
    return "\n".join(lines)


def _sample_markdown(sample: Mapping[str, Any]) -> str:
    reward = sample.get("reward")
    shown = f"{reward:.3f}" if reward is not None else "none"
    fence = "````"  # longer than a fence a completion may hold
    return (
        f"**reward** {shown}\n\n**prompt**\n\n{fence}\n{sample['prompt']}\n{fence}\n\n"
        f"**completion**\n\n{fence}\n{sample['completion']}\n{fence}"
    )


class TensorBoardLogger:
    """Event files under `<run dir>/tensorboard/`, written by torch's `SummaryWriter` (torch is a
    dependency already; tensorboard's own `tensorboard.summary.Writer` is marked experimental and has
    neither text nor `purge_step`)."""

    name = "tensorboard"

    def __init__(self, cfg: Config, run_dir: RunDirectory):
        from torch.utils.tensorboard import SummaryWriter

        # a resume trains the steps from its checkpoint again: TensorBoard drops their first events
        self._writer = SummaryWriter(
            log_dir=str(run_dir.path / TENSORBOARD_DIR), purge_step=run_dir.resumed_from, flush_secs=10
        )

    def log(self, record: Mapping[str, Any]) -> None:
        step, values = scalars(record)
        if step is None:
            return
        for key, value in values.items():
            self._writer.add_scalar(key, value, step)
        sample = sample_of(record)
        if sample is not None:
            self._writer.add_text("samples", _sample_markdown(sample), step)

    def close(self) -> None:
        self._writer.close()


class WandbLogger:
    """A W&B run in `<run dir>/wandb/`: `mode` from `WANDB_MODE` (default offline: no network, no
    account), project `run.wandb_project` (else `run.name`), the resolved config as its config. Each
    record is one `log` call; its keys are plotted against `step` (an eval point's against
    `eval/policy_version`) through `define_metric`, so eval points that arrive after later steps and
    steps trained again after a resume are kept, not dropped as out-of-order `_step`s."""

    name = "wandb"

    def __init__(self, cfg: Config, run_dir: RunDirectory):
        import wandb

        id_file = run_dir.path / WANDB_ID_FILE
        if not id_file.is_file():
            id_file.write_text(secrets.token_hex(8) + "\n", encoding="utf-8")
        self._wandb = wandb
        mode = os.environ.get("WANDB_MODE", "offline")
        if "WANDB_MODE" not in os.environ:  # issue #54: never silently offline
            log.warning(
                "run.loggers: wandb logs offline to %s/wandb (WANDB_MODE is not set); set WANDB_MODE=online to "
                "sync it as it runs, or `wandb sync` that directory later",
                run_dir.path,
            )
        self._run = wandb.init(
            mode=mode,  # type: ignore[arg-type]  # wandb checks it
            dir=str(run_dir.path),
            project=cfg.run.wandb_project or cfg.run.name,
            name=run_dir.path.name,
            id=id_file.read_text(encoding="utf-8").strip(),
            resume="allow",
            config=dataclasses.asdict(cfg),
            # the console is sc-grpo's: no W&B banner, and W&B does not capture stdout/stderr
            settings=wandb.Settings(silent=True, console="off"),
        )
        self._defined: set[str] = set()
        self._samples: list[list[Any]] = []

    def log(self, record: Mapping[str, Any]) -> None:
        step, values = scalars(record)
        if step is None:
            return
        x = EVAL_VERSION_KEY if is_eval_record(record) else STEP_KEY
        data: dict[str, Any] = {x: step, **values}
        sample = sample_of(record)
        if sample is not None:
            self._samples.append([step, sample["prompt"], sample["completion"], sample["reward"]])
            data["samples"] = self._wandb.Table(columns=list(SAMPLE_COLUMNS), data=list(self._samples))
        for key in data.keys() - self._defined - {x}:
            self._run.define_metric(key, step_metric=x)
            self._defined.add(key)
        self._run.log(data)

    def close(self) -> None:
        try:
            self._run.finish()
        finally:
            self._wandb.teardown()  # its service process, which would outlive the run otherwise


LOGGERS: dict[str, Callable[[Config, RunDirectory], RecordLogger]] = {
    "tensorboard": TensorBoardLogger,
    "wandb": WandbLogger,
}


class RecordLoggers:
    """The started loggers of a run; one that raises is disabled (see the module docstring)."""

    def __init__(self, loggers: list[RecordLogger]):
        self.loggers = list(loggers)
        self._disabled: list[RecordLogger] = []  # closed at the end too (their files), quietly

    @classmethod
    def open(cls, cfg: Config, run_dir: RunDirectory) -> RecordLoggers:
        started: list[RecordLogger] = []
        for name in dict.fromkeys(cfg.run.loggers):  # jsonl: metrics.jsonl, RunDirectory's
            factory = LOGGERS.get(name)
            if factory is None:
                continue
            try:
                started.append(factory(cfg, run_dir))
            except Exception as e:
                _disabled(name, "could not start", e)
        return cls(started)

    def log(self, record: Mapping[str, Any]) -> None:
        for logger in list(self.loggers):
            try:
                logger.log(record)
            except Exception as e:
                self.loggers.remove(logger)
                self._disabled.append(logger)
                _disabled(logger.name, "failed", e)

    def close(self) -> None:
        loggers, self.loggers = self.loggers, []
        for logger in loggers:
            try:
                logger.close()
            except Exception as e:
                log.warning("run.loggers: %s could not close (%s: %s)", logger.name, type(e).__name__, e)
        disabled, self._disabled = self._disabled, []
        for logger in disabled:  # it said what failed already
            try:
                logger.close()
            except Exception as e:
                log.debug("run.loggers: closing the disabled %s: %s: %s", logger.name, type(e).__name__, e)


def _disabled(name: str, what: str, e: BaseException) -> None:
    why = f"{type(e).__name__}: {e}"
    log.warning(
        "run.loggers: %s %s (%s); it is off for the rest of this run (metrics.jsonl has every record)", name, what, why
    )
