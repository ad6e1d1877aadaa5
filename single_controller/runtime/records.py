"""A run's metrics records: their keys and their file, `metrics.jsonl`.

A step's record has `step` and namespaced keys (`rollout/...`, `train/...`, `pump/...`, `time/...`);
an eval point's has `eval/...` keys and no `step` (`is_eval_record`). `time/wall_s` is the run's
clock, continued across resumes (it never goes back); `time/since_launch_s` restarts with each
command. `jsonable` makes a value fit for JSON; `read_metrics` skips a torn last line.
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
