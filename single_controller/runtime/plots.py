"""A run's curves: `curves.png` from its metrics records (matplotlib, Agg, no display needed).

Four panels: reward and success rate (and the held-out eval accuracy when eval is on) vs wall
time, staleness vs step, pump waits vs step, step time and training throughput vs step. A panel
whose keys never occur says so instead of staying blank.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from single_controller.runtime.records import STEP_KEY, WALL_KEY, is_eval_record

__all__ = ["plot_metrics", "pump_wait_keys"]

_PUMP_WAIT = re.compile(r"^pump/.*wait")


def pump_wait_keys(records: Iterable[Mapping[str, Any]]) -> list[str]:
    """The `pump/*wait*` keys present in any record, sorted."""
    return sorted({k for r in records for k in r if _PUMP_WAIT.match(k)})


def plot_metrics(records: Sequence[Mapping[str, Any]], path: str | Path, *, title: str = "") -> Path:
    """Render the four panels of `records` into the PNG file `path`; returns `path`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 8.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    (ax_reward, ax_stale), (ax_wait, ax_speed) = fig.subplots(2, 2)
    if title:
        fig.suptitle(title)
    _reward_panel(ax_reward, records)
    _staleness_panel(ax_stale, records)
    _wait_panel(ax_wait, records)
    _speed_panel(ax_speed, records)
    for ax in (ax_reward, ax_stale, ax_wait, ax_speed):
        ax.grid(alpha=0.3)
    path = Path(path)
    fig.savefig(path, format="png")
    return path


def _series(records: Sequence[Mapping[str, Any]], x_key: str, y_key: str) -> tuple[list[float], list[float]]:
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


def _lines(
    ax: Any, records: Sequence[Mapping[str, Any]], x_key: str, keys: list[tuple[str, str]], **style: Any
) -> bool:
    """Draw one line per (key, label) that has data; whether any was drawn."""
    drawn = False
    for key, label in keys:
        xs, ys = _series(records, x_key, key)
        if xs:
            ax.plot(xs, ys, label=label, **style)
            drawn = True
    return drawn


def _no_data(ax: Any, keys: str) -> None:
    ax.text(0.5, 0.5, f"no data\n({keys})", ha="center", va="center", transform=ax.transAxes, color="0.5")


def _reward_panel(ax: Any, records: Sequence[Mapping[str, Any]]) -> None:
    """Reward and success rate vs wall time (success and eval accuracy on their own 0..1 axis)."""
    ax.set_title("reward and success rate")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("reward mean", color="C0")
    got_reward = _lines(ax, records, WALL_KEY, [("rollout/reward_mean", "reward mean")], color="C0")
    ax_success = ax.twinx()
    ax_success.set_ylabel("success rate", color="C1")
    ax_success.set_ylim(-0.02, 1.02)
    got_success = _lines(ax_success, records, WALL_KEY, [("rollout/success_rate", "success rate")], color="C1")
    eval_line = [("eval/accuracy", "held-out eval accuracy")]
    got_eval = _lines(ax_success, records, WALL_KEY, eval_line, color="C2", marker="o", linestyle="-")
    if got_eval:
        ax.set_title("reward, success rate and held-out eval accuracy")
    if got_reward or got_success or got_eval:
        handles = ax.get_legend_handles_labels()[0] + ax_success.get_legend_handles_labels()[0]
        ax.legend(handles=handles, loc="upper left")
    else:
        _no_data(ax, "rollout/reward_mean, rollout/success_rate")


def _staleness_panel(ax: Any, records: Sequence[Mapping[str, Any]]) -> None:
    ax.set_title("staleness of trained samples (versions)")
    ax.set_xlabel("step")
    got_mean = _lines(ax, records, STEP_KEY, [("train/staleness_mean", "mean")], color="C0")
    got_max = _lines(
        ax, records, STEP_KEY, [("train/staleness_max", "max")], color="C3", drawstyle="steps-mid", linestyle="--"
    )
    if got_mean or got_max:
        ax.set_ylim(bottom=0)
        ax.legend(loc="best")
    else:
        _no_data(ax, "train/staleness_mean, train/staleness_max")


def _wait_panel(ax: Any, records: Sequence[Mapping[str, Any]]) -> None:
    ax.set_title("pump wait per step (s)")
    ax.set_xlabel("step")
    wait_keys = pump_wait_keys(records)
    if _lines(ax, records, STEP_KEY, [(k, k.removeprefix("pump/")) for k in wait_keys]):
        ax.legend(loc="best", fontsize="small")
    else:
        _no_data(ax, "pump/*wait*")


def _speed_panel(ax: Any, records: Sequence[Mapping[str, Any]]) -> None:
    ax.set_title("step time and training throughput")
    ax.set_xlabel("step")
    ax.set_ylabel("step time (s)", color="C2")
    got_time = _lines(ax, records, STEP_KEY, [("time/step_s", "step time")], color="C2")
    ax_tok = ax.twinx()
    ax_tok.set_ylabel("train tokens / s", color="C3")
    got_tok = _lines(ax_tok, records, STEP_KEY, [("throughput/train_tokens_per_s", "tokens/s")], color="C3")
    if not (got_time or got_tok):
        _no_data(ax, "time/step_s, throughput/train_tokens_per_s")
