"""A run's metrics records: their keys and their file, `metrics.jsonl`.

Contract:
- A step's record has `step` and namespaced keys (`rollout/...`, `train/...`, `pump/...`, `time/...`);
  an eval point's record has `eval/...` keys and `eval/policy_version`, no `step` (`is_eval_record`).
- `time/wall_s` is the run's wall clock: seconds since its controller started, continued across
  resumes (a resumed run's records go on from the latest record kept, `RunDirectory.reopen`; the
  controller stamps it, so the records a checkpoint keeps carry it too). It never goes back.
  `time/since_launch_s` is seconds since this `sc-grpo run` command started: it starts again at
  each resume.
- `metrics.jsonl` holds one JSON object per line; `jsonable` makes a value fit for it (non-finite
  numbers become null, numpy and torch scalars plain numbers); `read_metrics` reads every record
  back and skips a torn last line left by a killed run.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

STEP_KEY = "step"
WALL_KEY = "time/wall_s"
EVAL_VERSION_KEY = "eval/policy_version"


def is_eval_record(record: Mapping[str, Any]) -> bool:
    """An eval point's record (see `pumps/eval.py`), not a training step's."""
    return EVAL_VERSION_KEY in record and STEP_KEY not in record


def jsonable(value: Any) -> Any:
    """`value` as JSON-safe plain data: non-finite floats -> None, scalars of arrays -> numbers."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if hasattr(value, "item"):  # numpy / torch scalars
        try:
            return jsonable(value.item())
        except (ValueError, RuntimeError):  # not a single element
            pass
    if hasattr(value, "tolist"):
        return jsonable(value.tolist())
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
