"""`run.loggers` (TensorBoard, W&B offline), `run.log` and the sample completions of step records.

A short sim run through the CLI (in a subprocess: its own console, its own W&B service) with every
logger, whose step records carry a `sample` every other step (as the controller puts one every
`run.sample_every_steps`), then resumed; each logger's files are read back with its own reader
(TensorBoard's `EventAccumulator`; W&B's `.wandb` transaction log, a LevelDB-format log of protobuf
records, as `wandb sync` reads it) and compared with metrics.jsonl. The failure modes (a logger that raises, an
unknown logger, a missing package) and the readers of records given a `sample`: tests/unit/test_loggers.py.
"""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from single_controller.runtime.loggers import sample_text
from single_controller.runtime.records import is_eval_record, read_metrics
from tests.helpers.logger_runs import CHECKPOINT, RESUMED_STEPS, RUN, STEPS, steps_of

ROOT = Path(__file__).resolve().parents[2]


def sc_grpo(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline"}
    return subprocess.run(
        [sys.executable, "-m", "single_controller", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(the first drive's process, a snapshot of its records, the resumed drive's process, the run directory)."""
    out = tmp_path_factory.mktemp("runs")
    first = sc_grpo("run", *RUN, f"run.output_dir={out}")
    assert first.returncode == 0, first.stdout + first.stderr
    (run_dir,) = out.glob("sim-*")
    records = read_metrics(run_dir / "metrics.jsonl")
    tensorboard = tensorboard_scalars(run_dir / "tensorboard")
    resumed = sc_grpo("run", "--resume", str(run_dir), f"run.max_steps={RESUMED_STEPS}")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    return first, records, tensorboard, resumed, run_dir


def numbers(record, *, skip=("step", "eval/policy_version")):
    return {
        k: v
        for k, v in record.items()
        if k not in skip and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


# ---------------------------------------------------------------- readers


def tensorboard_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    """tag -> step -> value of every scalar in the event files under `log_dir` (events a resume purged left out)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    out: dict[str, dict[int, float]] = {}
    for tag in acc.Tags()["scalars"]:
        events = acc.Scalars(tag)
        assert len({e.step for e in events}) == len(events), f"{tag}: a step logged twice"
        out[tag] = {e.step: e.value for e in events}
    return out


def tensorboard_texts(log_dir: Path, tag: str) -> dict[int, str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    return {e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors(f"{tag}/text_summary")}


def wandb_records(path: Path) -> list:
    """The protobuf records of a `.wandb` file: a 7-byte header (`:W&B`, magic, version), then the
    LevelDB log format: 32 KiB blocks of chunks (crc32c 4, length 2, type 1: full/first/middle/last)."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32 * 1024
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, parts, out = 7, [], []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        parts.append(data[pos + 7 : pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # full, last
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            out.append(record)
            parts = []
    return out


def wandb_run(offline_dir: Path) -> tuple[list, list[dict]]:
    """(its run records, its history rows as plain values) of one `offline-run-*` directory."""
    (path,) = offline_dir.glob("run-*.wandb")
    records = wandb_records(path)
    runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    rows = [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    return runs, rows


# ---------------------------------------------------------------- the run, read back


def assert_tensorboard_holds(records, tensorboard):
    """Every number of every record is in `tensorboard` at its step (an eval point's `eval/...` at its version)."""
    for r in records:
        at = r["eval/policy_version"] if is_eval_record(r) else r["step"]
        keys = {k: v for k, v in numbers(r).items() if k.startswith("eval/") or not is_eval_record(r)}
        for key, value in keys.items():
            # TensorBoard keeps float32: 1 part in 2**24
            assert tensorboard[key][at] == pytest.approx(value, rel=1e-7, abs=1e-30), (key, at)


def test_tensorboard_holds_every_number_of_every_step_and_eval_record_at_its_step(run):
    _, records, tensorboard, _, _ = run
    steps = steps_of(records)
    assert [r["step"] for r in steps] == list(range(STEPS))
    assert_tensorboard_holds(records, tensorboard)
    assert tensorboard["rollout/reward_mean"][STEPS - 1] == pytest.approx(steps[-1]["rollout/reward_mean"], rel=1e-7)
    assert "eval/accuracy" in tensorboard and "sample" not in tensorboard


def test_the_offline_wandb_run_holds_every_step_record_and_the_resolved_config(run):
    _, records, _, _, run_dir = run
    first = sorted((run_dir / "wandb").glob("offline-run-*"))[0]
    runs, rows = wandb_run(first)
    (started,) = runs
    assert started.run_id == (run_dir / "wandb_run_id").read_text().strip()
    assert started.project == "sim"
    config = {i.key: json.loads(i.value_json) for i in started.config.update}
    assert config["run"]["loggers"] == ["jsonl", "tensorboard", "wandb"]
    by_step = {row["step"]: row for row in rows if "step" in row}
    by_version = {row["eval/policy_version"]: row for row in rows if "eval/policy_version" in row}
    for r in records:
        row = by_version[r["eval/policy_version"]] if is_eval_record(r) else by_step[r["step"]]
        expected = {k: v for k, v in numbers(r).items() if k.startswith("eval/") or not is_eval_record(r)}
        assert {k: row[k] for k in expected} == expected  # JSON numbers: exact
    assert by_step[STEPS - 1]["rollout/reward_mean"] == steps_of(records)[-1]["rollout/reward_mean"]


def test_samples_are_tensorboard_text_and_a_wandb_table_of_every_sample_so_far(run):
    _, records, _, _, run_dir = run
    sampled = {r["step"]: r["sample"] for r in records if "sample" in r}
    assert sorted(sampled) == [0, 2, 4]
    assert all(x["completion"] and isinstance(x["reward"], float) for x in sampled.values())
    texts = tensorboard_texts(run_dir / "tensorboard", "samples")
    for step, sample in sampled.items():
        assert sample["prompt"] in texts[step] and sample["completion"] in texts[step]
    first = sorted((run_dir / "wandb").glob("offline-run-*"))[0]
    _, rows = wandb_run(first)
    last = [row for row in rows if row.get("step") == 4 and "samples/path" in row][-1]
    table = json.loads((first / "files" / last["samples/path"]).read_text())
    assert table["columns"] == ["step", "prompt", "completion", "reward"]
    assert table["data"] == [[s, x["prompt"], x["completion"], x["reward"]] for s, x in sorted(sampled.items())]


def test_run_log_holds_the_console_lines_with_their_components_and_the_samples(run):
    first, records, _, resumed, run_dir = run
    log = (run_dir / "run.log").read_text()
    for proc in (first, resumed):
        for line in proc.stdout.splitlines():
            component = "sc_grpo.driver" if line.startswith("sc-grpo: ") else "sc_grpo.steps"
            assert f" INFO {component}: {line.removeprefix('sc-grpo: ')}\n" in log, line
    step_lines = [line for line in log.splitlines() if " sc_grpo.steps: step " in line]
    assert len(step_lines) == STEPS + RESUMED_STEPS - CHECKPOINT  # both drives' lines, in one file
    sample = next(r for r in records if "sample" in r)
    assert f" INFO sc_grpo.samples: {sample_text(sample['step'], sample['sample'])}\n" in log


def test_the_console_shows_only_its_own_lines_with_every_logger_on(run):
    first, _, _, resumed, _ = run
    for proc in (first, resumed):
        assert proc.stderr == ""
        for line in proc.stdout.splitlines():
            assert line.startswith(("sc-grpo: ", "step ", "eval v")), line
        assert "<rev>" not in proc.stdout and "wandb" not in proc.stdout.lower()


def test_a_resume_continues_tensorboard_without_the_steps_trained_again_and_the_same_wandb_run(run):
    _, _, before, _, run_dir = run
    records = read_metrics(run_dir / "metrics.jsonl")
    steps = steps_of(records)
    assert [r["step"] for r in steps] == list(range(RESUMED_STEPS))
    after = tensorboard_scalars(run_dir / "tensorboard")  # asserts no step twice
    assert sorted(after["rollout/reward_mean"]) == list(range(RESUMED_STEPS))
    # the steps the resume trained again hold the resumed drive's values, not the first drive's
    # (`time/since_launch_s` tells them apart: each drive's clock starts at its own launch)
    assert_tensorboard_holds(records, after)
    assert before["rollout/reward_mean"].keys() == set(range(STEPS))
    key = "time/since_launch_s"
    assert all(before[key][s] != after[key][s] for s in range(CHECKPOINT, STEPS))
    offline = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 2
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    assert all(path.name.endswith(f"-{run_id}") for path in offline)
    _, rows = wandb_run(offline[1])
    assert {row["step"] for row in rows if "step" in row} >= set(range(STEPS, RESUMED_STEPS))
