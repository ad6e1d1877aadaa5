"""What a run leaves behind and prints: its directory, metrics log, curves and console lines.

Contract:
- `RunDirectory(cfg)` creates `<run.output_dir>/<run.name>-<YYYYmmdd-HHMMSS>` (a `-2`, `-3`... suffix if
  that exists), writes the resolved `config.yaml` into it, and its `run_id` (the directory name plus
  a random suffix: unique even across output directories and machines; a resume keeps it) into
  `run_id`. The run id names the run's Ray namespace and TransferQueue partition. It appends one JSON object per step to
  `metrics.jsonl` with `append_metrics(record)` (flushed line by line, so a crashed run keeps every
  finished step). Records use namespaced keys (`rollout/...`, `train/...`, `pump/...`, `time/...`);
  `time/wall_s` (seconds since the directory was created) is stamped on records that lack it.
  Eval records (`eval/...` keys, `eval/policy_version`, no `step`) are appended to the same file
  when eval is on; `is_eval_record` tells them apart.
- `save_plot()` renders `curves.png` from metrics.jsonl (matplotlib, Agg, no display needed); the
  held-out eval accuracy is drawn beside the training reward and success rate.
- `ConsoleReporter(cfg)` prints one line per step (`step(record)`) from the same records, plus a
  progress bar over `run.max_steps` when stdout is a terminal and `run.progress_bar` is true;
  `eval(record)` prints an eval line without advancing the bar.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Mapping, TextIO

from single_controller.config.schema import Config

__all__ = ["RunDirectory", "ConsoleReporter", "format_step_line", "format_eval_line", "is_eval_record", "read_metrics", "plot_metrics"]

RUN_ID_FILE = "run_id"
STEP_KEY = "step"
WALL_KEY = "time/wall_s"
EVAL_VERSION_KEY = "eval/policy_version"


def is_eval_record(record: Mapping[str, Any]) -> bool:
    """An eval point's record (see `pumps/eval.py`), not a training step's."""
    return EVAL_VERSION_KEY in record and STEP_KEY not in record
_PUMP_WAIT = re.compile(r"^pump/.*wait")


# ----------------------------------------------------------------------------------------------
# The run directory


class RunDirectory:
    """`<output_dir>/<name>-<timestamp>` with config.yaml, metrics.jsonl and (at the end) curves.png."""

    _plotting: threading.Thread | None = None  # start_plot()'s render, joined by close()

    def __init__(self, cfg: Config, *, now: datetime | None = None):
        from single_controller.config.loader import config_to_yaml

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
        self.path = path
        self.config_path = path / "config.yaml"
        self.metrics_path = path / "metrics.jsonl"
        self.plot_path = path / "curves.png"
        self.config_path.write_text(config_to_yaml(cfg), encoding="utf-8")
        self.run_id = f"{path.name}-{secrets.token_hex(3)}"
        (path / RUN_ID_FILE).write_text(self.run_id + "\n", encoding="utf-8")
        self.wall_offset_s = 0.0  # a resumed run's records continue the wall clock of the first part
        self._t0 = time.monotonic()
        self._metrics: TextIO | None = open(self.metrics_path, "a", encoding="utf-8")

    @classmethod
    def create(cls, cfg: Config, *, now: datetime | None = None) -> RunDirectory:
        """Same as `RunDirectory(cfg)`."""
        return cls(cfg, now=now)

    @classmethod
    def reopen(cls, path: str | Path, cfg: Config, *, from_step: int, recovered: list[dict] = ()) -> RunDirectory:
        """Continue an existing run directory (a resume): metrics records of steps >= `from_step`
        (trained after the checkpoint, so trained again now) and eval points of versions >= `from_step`
        (evaluated again) are dropped, later ones appended; step records before `from_step` that the
        file lacks (the driver was killed before writing them) are taken from `recovered` (the
        checkpoint's); the
        config actually used is written beside the original as `config.resume.yaml`."""
        from single_controller.config.loader import config_to_yaml

        self = cls.__new__(cls)
        self.path = Path(path)
        self.config_path = self.path / "config.yaml"
        self.metrics_path = self.path / "metrics.jsonl"
        self.plot_path = self.path / "curves.png"
        (self.path / "config.resume.yaml").write_text(config_to_yaml(cfg), encoding="utf-8")
        id_file = self.path / RUN_ID_FILE
        self.run_id = id_file.read_text(encoding="utf-8").strip() if id_file.exists() else self.path.name
        # eval points of versions >= from_step are measured again after the resume
        before = lambda r: r.get(EVAL_VERSION_KEY, -1) < from_step if is_eval_record(r) else r.get("step", -1) < from_step  # noqa: E731
        kept = [r for r in read_metrics(self.metrics_path) if before(r)] if self.metrics_path.exists() else []
        have = {r["step"] for r in kept if not is_eval_record(r) and "step" in r}
        kept += sorted((r for r in recovered if r["step"] < from_step and r["step"] not in have), key=lambda r: r["step"])
        tmp = self.metrics_path.with_name(self.metrics_path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r, allow_nan=False) + "\n" for r in kept), encoding="utf-8")
        tmp.replace(self.metrics_path)
        self.wall_offset_s = float(kept[-1].get(WALL_KEY) or 0.0) if kept else 0.0
        self._t0 = time.monotonic() - self.wall_offset_s
        self._metrics = open(self.metrics_path, "a", encoding="utf-8")
        return self

    def write_json(self, name: str, obj: Any) -> Path:
        """Write `obj` (made JSON-safe like metrics) as `<run dir>/<name>`, pretty-printed."""
        path = self.path / name
        path.write_text(json.dumps(_jsonable(obj), indent=2, allow_nan=False) + "\n", encoding="utf-8")
        return path

    def append_metrics(self, record: Mapping[str, Any]) -> None:
        """Append one step's record as a JSON line (non-finite numbers become null) and flush it."""
        if self._metrics is None:
            raise ValueError(f"{self.metrics_path} is closed")
        clean = {str(k): _jsonable(v) for k, v in record.items()}
        clean.setdefault(WALL_KEY, round(time.monotonic() - self._t0, 6))
        self._metrics.write(json.dumps(clean, allow_nan=False) + "\n")
        self._metrics.flush()

    def read_metrics(self) -> list[dict[str, Any]]:
        return read_metrics(self.metrics_path)

    def save_plot(self) -> Path:
        """Render curves.png from metrics.jsonl; returns its path."""
        if self._metrics is not None:
            self._metrics.flush()
        plot_metrics(self.read_metrics(), self.plot_path, title=self.path.name)
        return self.plot_path

    def start_plot(self) -> None:
        """`save_plot()` on a background thread (matplotlib's import and rendering take ~1 s of CPU,
        which then overlaps the run's shutdown); `close()` waits for it and reports a failure."""
        if self._metrics is not None:
            self._metrics.flush()
        records = self.read_metrics()

        def render() -> None:
            try:
                plot_metrics(records, self.plot_path, title=self.path.name)
            except Exception as e:  # a plot never fails a run that trained
                print(f"sc-grpo: could not render {self.plot_path}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)

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


def _jsonable(value: Any) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item"):  # numpy / torch scalars
        try:
            return _jsonable(value.item())
        except (ValueError, RuntimeError):  # not a single element
            pass
    if hasattr(value, "tolist"):
        return _jsonable(value.tolist())
    return str(value)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a metrics.jsonl (a torn last line from a killed run is skipped)."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


# ----------------------------------------------------------------------------------------------
# Curves


def _series(records: list[Mapping[str, Any]], x_key: str, y_key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    if x_key == STEP_KEY:
        records = [r for r in records if not is_eval_record(r)]  # the index fallback counts steps only
    for i, r in enumerate(records):
        x = r.get(x_key, i if x_key == STEP_KEY else None)
        y = r.get(y_key)
        if isinstance(x, (int, float)) and isinstance(y, (int, float)) and not isinstance(y, bool):
            xs.append(float(x))
            ys.append(float(y))
    return xs, ys


def pump_wait_keys(records: Iterable[Mapping[str, Any]]) -> list[str]:
    """The `pump/*wait*` keys present in any record, sorted."""
    return sorted({k for r in records for k in r if _PUMP_WAIT.match(k)})


def plot_metrics(records: list[Mapping[str, Any]], path: str | Path, *, title: str = "") -> Path:
    """Four panels: reward & success vs wall time, staleness vs step, pump waits vs step, step time &
    throughput vs step. Panels whose keys never occur say so instead of staying blank."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 8.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    (ax_reward, ax_stale), (ax_wait, ax_speed) = fig.subplots(2, 2)
    if title:
        fig.suptitle(title)

    def no_data(ax: Any, keys: str) -> None:
        ax.text(0.5, 0.5, f"no data\n({keys})", ha="center", va="center", transform=ax.transAxes,
                color="0.5")

    def lines(ax: Any, x_key: str, keys: list[tuple[str, str]], **style: Any) -> bool:
        drawn = False
        for key, label in keys:
            xs, ys = _series(records, x_key, key)
            if xs:
                ax.plot(xs, ys, label=label, **style)
                drawn = True
        return drawn

    # reward and success rate vs wall time (success on its own 0..1 axis)
    ax_reward.set_title("reward and success rate")
    ax_reward.set_xlabel("wall time (s)")
    ax_reward.set_ylabel("reward mean", color="C0")
    got_reward = lines(ax_reward, WALL_KEY, [("rollout/reward_mean", "reward mean")], color="C0")
    ax_success = ax_reward.twinx()
    ax_success.set_ylabel("success rate", color="C1")
    ax_success.set_ylim(-0.02, 1.02)
    got_success = lines(ax_success, WALL_KEY, [("rollout/success_rate", "success rate")], color="C1")
    got_eval = lines(ax_success, WALL_KEY, [("eval/accuracy", "held-out eval accuracy")], color="C2", marker="o", linestyle="-")
    if got_eval:
        ax_reward.set_title("reward, success rate and held-out eval accuracy")
    if got_reward or got_success or got_eval:
        handles = ax_reward.get_legend_handles_labels()[0] + ax_success.get_legend_handles_labels()[0]
        ax_reward.legend(handles=handles, loc="upper left")
    else:
        no_data(ax_reward, "rollout/reward_mean, rollout/success_rate")

    ax_stale.set_title("staleness of trained samples (versions)")
    ax_stale.set_xlabel("step")
    got_mean = lines(ax_stale, STEP_KEY, [("train/staleness_mean", "mean")], color="C0")
    got_max = lines(ax_stale, STEP_KEY, [("train/staleness_max", "max")], color="C3",
                    drawstyle="steps-mid", linestyle="--")
    if got_mean or got_max:
        ax_stale.set_ylim(bottom=0)
        ax_stale.legend(loc="best")
    else:
        no_data(ax_stale, "train/staleness_mean, train/staleness_max")

    ax_wait.set_title("pump wait per step (s)")
    ax_wait.set_xlabel("step")
    wait_keys = pump_wait_keys(records)
    if lines(ax_wait, STEP_KEY, [(k, k.removeprefix("pump/")) for k in wait_keys]):
        ax_wait.legend(loc="best", fontsize="small")
    else:
        no_data(ax_wait, "pump/*wait*")

    ax_speed.set_title("step time and training throughput")
    ax_speed.set_xlabel("step")
    ax_speed.set_ylabel("step time (s)", color="C2")
    got_time = lines(ax_speed, STEP_KEY, [("time/step_s", "step time")], color="C2")
    ax_tok = ax_speed.twinx()
    ax_tok.set_ylabel("train tokens / s", color="C3")
    got_tok = lines(ax_tok, STEP_KEY, [("throughput/train_tokens_per_s", "tokens/s")], color="C3")
    if not (got_time or got_tok):
        no_data(ax_speed, "time/step_s, throughput/train_tokens_per_s")

    for ax in (ax_reward, ax_stale, ax_wait, ax_speed):
        ax.grid(alpha=0.3)
    path = Path(path)
    fig.savefig(path, format="png")
    return path


# ----------------------------------------------------------------------------------------------
# Console


# (metric key, label, format) in the order they appear on a step line
_LINE_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("rollout/reward_mean", "reward", "{:.3f}"),
    ("rollout/success_rate", "success", "{:.3f}"),
    ("train/staleness_mean", "staleness", "{:.2f}"),
    ("time/step_s", "step_time", "{:.2f}s"),
    ("throughput/train_tokens_per_s", "tokens/s", "{:,.0f}"),
)


def format_step_line(record: Mapping[str, Any], max_steps: int | None = None, step: int | None = None) -> str:
    """`step 12/400 | reward 0.512 | success 0.250 | staleness 0.50 | step_time 1.23s | tokens/s 1,234`;
    fields whose key is missing (or not a number) are left out."""
    step = record.get(STEP_KEY, step)
    width = len(str(max_steps)) if max_steps else 0
    head = f"step {step:>{width}}" if step is not None else "step ?"
    if max_steps:
        head += f"/{max_steps}"
    parts = [head]
    for key, label, fmt in _LINE_FIELDS:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            parts.append(f"{label} {fmt.format(value)}")
    return " | ".join(parts)


def format_eval_line(record: Mapping[str, Any]) -> str:
    """`eval v10 | accuracy 0.953 | reward 0.981 | pass@1 0.953 | 64 prompts | 0.12s | reissued 3`."""
    parts = [f"eval v{record.get(EVAL_VERSION_KEY, '?')}"]
    for key, value in record.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            continue
        if key == "eval/accuracy":
            parts.append(f"accuracy {value:.3f}")
        elif key == "eval/reward_mean":
            parts.append(f"reward {value:.3f}")
        elif key.startswith("eval/pass@"):
            parts.append(f"{key.removeprefix('eval/')} {value:.3f}")
    if isinstance(record.get("eval/prompts"), (int, float)):
        parts.append(f"{record['eval/prompts']:.0f} prompts")
    if isinstance(record.get("eval/seconds"), (int, float)):
        parts.append(f"{record['eval/seconds']:.2f}s")
    if record.get("eval/reissued"):
        parts.append(f"reissued {record['eval/reissued']}")
    return " | ".join(parts)


class ConsoleReporter:
    """One line per step, and a tqdm bar over max_steps when `stream` is a terminal.

    `ConsoleReporter(cfg)` takes max_steps and the bar switch from `cfg.run`; `ConsoleReporter(n,
    progress_bar=...)` sets them directly.
    """

    def __init__(
        self,
        run: Config | int,
        *,
        progress_bar: bool | None = None,
        stream: TextIO | None = None,
    ):
        from tqdm import tqdm

        if isinstance(run, Config):
            max_steps = run.run.max_steps
            progress_bar = run.run.progress_bar if progress_bar is None else progress_bar
        else:
            max_steps = int(run)
            progress_bar = True if progress_bar is None else progress_bar
        self.max_steps = max_steps
        self.stream = stream if stream is not None else sys.stdout
        is_tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.bar_enabled = progress_bar and is_tty
        self._reported = 0
        self._bar = tqdm(total=max_steps, file=self.stream, disable=not self.bar_enabled,
                         unit="step", dynamic_ncols=True, leave=False)

    def step(self, record: Mapping[str, Any]) -> str:
        """Print the step's line (above the bar) and advance the bar; returns the line."""
        self._reported += 1
        line = format_step_line(record, self.max_steps, step=self._reported)
        if self.bar_enabled:
            self._bar.write(line, file=self.stream)
            self._bar.update(1)  # one record per step
        else:
            print(line, file=self.stream, flush=True)
        return line

    def eval(self, record: Mapping[str, Any]) -> str:
        """Print an eval point's line (above the bar, which does not advance); returns the line."""
        line = format_eval_line(record)
        if self.bar_enabled:
            self._bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)
        return line

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> ConsoleReporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
