"""A run's directory: where everything a run leaves behind goes.

`RunDirectory(cfg)` creates `<run.output_dir>/<run.name>-<timestamp>`, writes the resolved
`config.yaml` and the `run_id` (directory name + random suffix, kept by resumes: it names the Ray
namespace and the TQ partition). `append_metrics` appends one flushed line per record to
`metrics.jsonl`; a resume writes `config.resume.yaml`, which the next resume starts from. `logs/`,
`run.log`, `tensorboard/`, `wandb/` and `curves.png` (`start_plot`, on a thread) live here too.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

from single_controller.config.schema import Config
from single_controller.runtime.records import EVAL_VERSION_KEY, WALL_KEY, is_eval_record, jsonable, read_metrics

__all__ = ["LOGS_DIR", "RESUME_CONFIG_FILE", "RUN_ID_FILE", "RunDirectory", "resume_config"]

log = logging.getLogger(__name__)

RUN_ID_FILE = "run_id"
LOGS_DIR = "logs"
CONFIG_FILE = "config.yaml"
RESUME_CONFIG_FILE = "config.resume.yaml"  # the config the run's latest resume ran with


def resume_config(path: str | Path, overrides: Sequence[str] = ()) -> Config:
    """The config a resume of the run directory `path` runs with: the one the run last ran with
    (its latest resume's `config.resume.yaml`, else its `config.yaml`) plus `overrides`. Raises
    `FileNotFoundError` when `path` has no `config.yaml` (not a run directory), `ConfigError` as
    `load_config` does."""
    from single_controller.preflight.loader import load_config

    path = Path(path)
    if not (path / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{path} is not a run directory (no {CONFIG_FILE})")
    last = path / RESUME_CONFIG_FILE
    return load_config(str(last if last.is_file() else path / CONFIG_FILE), overrides)


class RunDirectory:
    """`<output_dir>/<name>-<timestamp>` with config.yaml, metrics.jsonl, logs/ and (at the end) curves.png."""

    _plotting: threading.Thread | None = None  # start_plot()'s render, joined by close()

    def __init__(self, cfg: Config, *, now: datetime | None = None):
        from single_controller.preflight.loader import config_to_yaml

        stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
        root = Path(cfg.run.output_dir)
        root.mkdir(parents=True, exist_ok=True)
        base = f"{cfg.run.name}-{stamp}"
        for n in range(1, 1000):
            path = root / (base if n == 1 else f"{base}-{n}")
            try:
                path.mkdir()
                break
            except FileExistsError:
                continue
        else:
            raise FileExistsError(f"no free run directory name for {root / base}")
        self._set_paths(path)
        self.config_path.write_text(config_to_yaml(cfg), encoding="utf-8")
        self.run_id = f"{path.name}-{secrets.token_hex(3)}"
        (path / RUN_ID_FILE).write_text(self.run_id + "\n", encoding="utf-8")
        self.wall_offset_s = 0.0  # the run's wall clock when this part started (a resume continues it)
        self.resumed_from: int | None = None  # the checkpoint's step a resume trains on from
        self._t0 = time.monotonic()
        self._metrics: TextIO | None = open(self.metrics_path, "a", encoding="utf-8")

    @classmethod
    def create(cls, cfg: Config, *, now: datetime | None = None) -> RunDirectory:
        """Same as `RunDirectory(cfg)`."""
        return cls(cfg, now=now)

    @classmethod
    def reopen(cls, path: str | Path, cfg: Config, *, from_step: int, recovered: Sequence[dict] = ()) -> RunDirectory:
        """Continue an existing run directory (a resume): metrics records of steps >= `from_step`
        (trained after the checkpoint, so trained again now) and eval points of versions >= `from_step`
        (evaluated again) are dropped, later ones appended; step records before `from_step` that the
        file lacks (the driver was killed before writing them) are taken from `recovered` (the
        checkpoint's); the config actually used is written beside the original as `config.resume.yaml`
        (where the next resume starts from, `resume_config`)."""
        from single_controller.preflight.loader import config_to_yaml

        self = cls.__new__(cls)
        self._set_paths(Path(path))
        (self.path / RESUME_CONFIG_FILE).write_text(config_to_yaml(cfg), encoding="utf-8")
        id_file = self.path / RUN_ID_FILE
        self.run_id = id_file.read_text(encoding="utf-8").strip() if id_file.exists() else self.path.name

        # eval points of versions >= from_step are measured again after the resume
        def before(r: dict[str, Any]) -> bool:
            return r.get(EVAL_VERSION_KEY, -1) < from_step if is_eval_record(r) else r.get("step", -1) < from_step

        kept = [r for r in read_metrics(self.metrics_path) if before(r)] if self.metrics_path.exists() else []
        have = {r["step"] for r in kept if not is_eval_record(r) and "step" in r}
        kept += sorted(
            (r for r in recovered if r["step"] < from_step and r["step"] not in have), key=lambda r: r["step"]
        )
        tmp = self.metrics_path.with_name(self.metrics_path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r, allow_nan=False) + "\n" for r in kept), encoding="utf-8")
        tmp.replace(self.metrics_path)
        # the clock goes on from the latest record kept: a resumed run never steps back in time
        self.wall_offset_s = max((float(r.get(WALL_KEY) or 0.0) for r in kept), default=0.0)
        self._t0 = time.monotonic() - self.wall_offset_s
        self.resumed_from = from_step
        self._metrics = open(self.metrics_path, "a", encoding="utf-8")
        return self

    def _set_paths(self, path: Path) -> None:
        self.path = path
        self.config_path = path / CONFIG_FILE
        self.metrics_path = path / "metrics.jsonl"
        self.plot_path = path / "curves.png"
        self.logs_path = path / LOGS_DIR  # created by the first worker that writes its log there

    def write_json(self, name: str, obj: Any) -> Path:
        """Write `obj` (made JSON-safe like metrics) as `<run dir>/<name>`, pretty-printed."""
        path = self.path / name
        path.write_text(json.dumps(jsonable(obj), indent=2, allow_nan=False) + "\n", encoding="utf-8")
        return path

    def append_metrics(self, record: Mapping[str, Any]) -> None:
        """Append one step's record as a JSON line (non-finite numbers become null) and flush it."""
        if self._metrics is None:
            raise ValueError(f"{self.metrics_path} is closed")
        clean = {str(k): jsonable(v) for k, v in record.items()}
        clean.setdefault(WALL_KEY, round(time.monotonic() - self._t0, 6))
        self._metrics.write(json.dumps(clean, allow_nan=False) + "\n")
        self._metrics.flush()

    def read_metrics(self) -> list[dict[str, Any]]:
        return read_metrics(self.metrics_path)

    def save_plot(self) -> Path:
        """Render curves.png from metrics.jsonl; returns its path."""
        from single_controller.runtime.plots import plot_metrics

        if self._metrics is not None:
            self._metrics.flush()
        plot_metrics(self.read_metrics(), self.plot_path, title=self.path.name)
        return self.plot_path

    def start_plot(self) -> None:
        """`save_plot()` on a background thread (matplotlib's import and rendering then overlap
        the run's shutdown); `close()` waits for it and reports a failure."""
        if self._metrics is not None:
            self._metrics.flush()
        from single_controller.runtime.plots import plot_metrics

        records = self.read_metrics()

        def render() -> None:
            try:
                plot_metrics(records, self.plot_path, title=self.path.name)
            except Exception as e:  # a plot never fails a run that trained
                log.warning("could not render %s: %s: %s", self.plot_path, type(e).__name__, e)

        self._plotting = threading.Thread(target=render, name="sc-grpo-plot", daemon=True)
        self._plotting.start()

    def close(self) -> None:
        plotting, self._plotting = self._plotting, None
        if plotting is not None:
            plotting.join()
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None

    def __enter__(self) -> RunDirectory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
